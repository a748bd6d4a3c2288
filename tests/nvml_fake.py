"""A stand-in for the `pynvml` module (NVML cannot exist on a machine without an NVIDIA driver).

Only the calls `backends/nvml_probe.py` and `tuner/probe.py` make are implemented, with pynvml's shapes:
handles are opaque, names may be bytes, memory comes in bytes, power in mW,
the CUDA driver version as 13000 for 13.0.
"""

from __future__ import annotations

from types import SimpleNamespace

NVML_CLOCK_SM = 1
NVML_DEVICE_MIG_ENABLE = 1
NVML_DEVICE_MIG_DISABLE = 0


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):  # noqa: N801 - pynvml's spelling
    pass


def gpu(name="NVIDIA H100 80GB HBM3", cc=(9, 0), memory_mib=81559, uuid="GPU-11111111-2222", pci_id=0x233010DE,
        clock_mhz=1980, power_mw=700000, utilization=0, pids=(), migs=None):
    """One fake GPU; `migs` is a list of (profile, memory_mib, uuid) when MIG mode is on."""
    return dict(name=name, cc=cc, memory_mib=memory_mib, uuid=uuid, pci_id=pci_id, clock_mhz=clock_mhz,
                power_mw=power_mw, utilization=utilization, pids=list(pids), migs=migs)


class FakeNVML:
    """Module-like object: `probe_devices(nvml=FakeNVML([...]))`."""

    NVML_CLOCK_SM = NVML_CLOCK_SM
    NVML_DEVICE_MIG_ENABLE = NVML_DEVICE_MIG_ENABLE
    NVMLError = NVMLError

    def __init__(self, gpus=(), *, init_error: str | None = None, driver="580.65.06", cuda=13000):
        self.gpus = list(gpus)
        self.init_error = init_error
        self.driver = driver
        self.cuda = cuda
        self.initialized = 0
        self.shutdowns = 0

    # -- library -------------------------------------------------------------------------------
    def nvmlInit(self):
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.initialized += 1

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self):
        return self.driver.encode()

    def nvmlSystemGetCudaDriverVersion_v2(self):
        return self.cuda

    def nvmlSystemGetCudaDriverVersion(self):
        return self.cuda

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        if not 0 <= index < len(self.gpus):
            raise NVMLError("Invalid Argument")
        return ("gpu", index)

    # -- per handle ----------------------------------------------------------------------------
    def _gpu(self, handle):
        return self.gpus[handle[1]]

    def _mig(self, handle):
        return self._gpu(handle)["migs"][handle[2]]

    def nvmlDeviceGetName(self, handle):
        g = self._gpu(handle)
        if handle[0] == "mig":
            return f"{g['name']} MIG {self._mig(handle)[0]}".encode()
        return g["name"].encode()

    def nvmlDeviceGetUUID(self, handle):
        return self._mig(handle)[2] if handle[0] == "mig" else self._gpu(handle)["uuid"]

    def nvmlDeviceGetCudaComputeCapability(self, handle):
        if handle[0] == "mig":
            raise NVMLError_NotSupported("Not Supported")
        return self._gpu(handle)["cc"]

    def nvmlDeviceGetMemoryInfo(self, handle):
        mib = self._mig(handle)[1] if handle[0] == "mig" else self._gpu(handle)["memory_mib"]
        return SimpleNamespace(total=mib * 1024 * 1024, used=0, free=mib * 1024 * 1024)

    def nvmlDeviceGetPciInfo(self, handle):
        return SimpleNamespace(pciDeviceId=self._gpu(handle)["pci_id"], busId=b"00000000:01:00.0")

    def nvmlDeviceGetMaxClockInfo(self, handle, clock):
        assert clock == NVML_CLOCK_SM
        return self._gpu(handle)["clock_mhz"]

    def nvmlDeviceGetPowerManagementLimit(self, handle):
        if self._gpu(handle)["power_mw"] is None:
            raise NVMLError_NotSupported("Not Supported")
        return self._gpu(handle)["power_mw"]

    def nvmlDeviceGetMigMode(self, handle):
        if self._gpu(handle)["migs"] is None:
            raise NVMLError_NotSupported("Not Supported")
        return (NVML_DEVICE_MIG_ENABLE, NVML_DEVICE_MIG_ENABLE)

    def nvmlDeviceGetMaxMigDeviceCount(self, handle):
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle, slot):
        if slot >= len(self._gpu(handle)["migs"]):
            raise NVMLError("Not Found")
        return ("mig", handle[1], slot)

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return [SimpleNamespace(pid=pid, usedGpuMemory=1 << 30) for pid in self._gpu(handle)["pids"]]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle):
        return []

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=self._gpu(handle)["utilization"], memory=0)
