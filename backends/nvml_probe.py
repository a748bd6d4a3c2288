"""The NVML probe: what GPUs (and MIG instances) this node has, as `DeviceInfo` values.

Both the runtime lookup (`mla_tune.runtime`, to find the local GPU) and the tuner (`tuner/probe.py`) read NVML
through this module, so the public API needs no tuner code. Uses `pynvml` (nvidia-ml-py), never torch, so
probing is cheap and works in a process that has not touched CUDA. Every function takes an optional `nvml`
module so tests can inject a fake (`tests/nvml_fake.py`); the real one is `pynvml`.
"""

from __future__ import annotations

import os
import re

from mla_tune.backends.device import DeviceInfo

class ProbeError(RuntimeError):
    """NVML is unusable: no driver, no GPU, or the library is missing. The message is one line."""


def _load_nvml(nvml):
    if nvml is not None:
        return nvml
    try:
        import pynvml
    except ImportError as exc:
        raise ProbeError(f"nvidia-ml-py is not installed ({exc})") from None
    return pynvml


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def optional_call(call, *args, default=None):
    """NVML calls a GPU may not support (power limit on some boards, MIG on most) return `default`."""
    try:
        return call(*args)
    except Exception:  # noqa: BLE001 - pynvml raises a zoo of NVMLError subclasses
        return default


class NvmlSession:
    """nvmlInit ... nvmlShutdown, turning an init failure into one ProbeError line."""

    def __init__(self, nvml):
        self.nvml = _load_nvml(nvml)

    def __enter__(self):
        try:
            self.nvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound, _DriverNotLoaded, ...
            detail = " ".join(str(exc).split()) or type(exc).__name__
            raise ProbeError(f"no NVIDIA GPU found: NVML could not start ({detail})") from None
        return self.nvml

    def __exit__(self, *exc_info):
        optional_call(self.nvml.nvmlShutdown)


def _mig_profile(name: str) -> str | None:
    """"NVIDIA H100 80GB HBM3 MIG 3g.40gb" -> "3g.40gb"."""
    match = re.search(r"MIG\s+(\S+)\s*$", name)
    return match.group(1) if match else None


def _describe(nvml, handle, *, index: int, parent=None, common: dict) -> DeviceInfo:
    cc_source = parent if parent is not None else handle
    major, minor = nvml.nvmlDeviceGetCudaComputeCapability(cc_source)
    memory = optional_call(nvml.nvmlDeviceGetMemoryInfo, handle)
    pci = optional_call(nvml.nvmlDeviceGetPciInfo, cc_source)
    clock = optional_call(nvml.nvmlDeviceGetMaxClockInfo, cc_source, getattr(nvml, "NVML_CLOCK_SM", 1), default=0)
    power_mw = optional_call(nvml.nvmlDeviceGetPowerManagementLimit, cc_source, default=0)
    name = _text(nvml.nvmlDeviceGetName(handle))
    return DeviceInfo(
        name=name if parent is None else _text(nvml.nvmlDeviceGetName(parent)),
        compute_capability=(int(major), int(minor)),
        uuid=_text(optional_call(nvml.nvmlDeviceGetUUID, handle, default="")),
        index=index,
        memory_total_mib=int(memory.total // (1024 * 1024)) if memory is not None else 0,
        max_sm_clock_mhz=int(clock or 0),
        power_limit_w=float(power_mw or 0) / 1000.0,
        mig_mode=parent is not None or common.get("mig_enabled", False),
        mig_profile=_mig_profile(name) if parent is not None else None,
        pci_device_id=f"0x{int(pci.pciDeviceId) & 0xFFFFFFFF:08X}" if pci is not None else "",
        driver_version=common["driver_version"],
        cuda_driver_version=common["cuda_driver_version"],
    )


def _common(nvml) -> dict:
    cuda = optional_call(getattr(nvml, "nvmlSystemGetCudaDriverVersion_v2", nvml.nvmlSystemGetCudaDriverVersion),
                     default=0) or 0
    return {"driver_version": _text(optional_call(nvml.nvmlSystemGetDriverVersion, default="")),
            "cuda_driver_version": f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else ""}


def _mig_handles(nvml, handle) -> tuple[bool, list]:
    """(MIG mode on, handles of its instances)."""
    mode = optional_call(nvml.nvmlDeviceGetMigMode, handle)
    enabled = getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1)
    if not mode or mode[0] != enabled:
        return False, []
    handles = []
    for slot in range(optional_call(nvml.nvmlDeviceGetMaxMigDeviceCount, handle, default=0) or 0):
        mig = optional_call(nvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, slot)
        if mig is not None:
            handles.append(mig)
    return True, handles


def probe_devices(*, nvml=None) -> list[DeviceInfo]:
    """Every GPU of this node; a GPU in MIG mode is listed as its MIG instances instead.

    Args:
        nvml: the NVML module (default `pynvml`); tests inject a fake.

    Returns:
        One `DeviceInfo` per GPU or MIG instance, in NVML index order. MIG
        instances carry the parent's name and compute capability, their own
        memory and UUID, and `mig_profile` (e.g. "3g.40gb"), which is part of
        the SKU.

    Raises:
        ProbeError: NVML cannot start (no driver, no GPU) or reports no GPU.
    """
    with NvmlSession(nvml) as lib:
        common = _common(lib)
        devices: list[DeviceInfo] = []
        for index in range(lib.nvmlDeviceGetCount()):
            handle = lib.nvmlDeviceGetHandleByIndex(index)
            mig_enabled, migs = _mig_handles(lib, handle)
            if not migs:
                devices.append(_describe(lib, handle, index=index, common={**common, "mig_enabled": mig_enabled}))
            for mig in migs:
                devices.append(_describe(lib, mig, index=index, parent=handle, common=dict(common)))
    if not devices:
        raise ProbeError("no NVIDIA GPU found: NVML started but reports 0 devices")
    return devices


def local_device(*, nvml=None) -> DeviceInfo:
    """The GPU this process would use: the first of `CUDA_VISIBLE_DEVICES`, else GPU 0.

    `CUDA_VISIBLE_DEVICES` may list indices or UUIDs (`GPU-...`, `MIG-...`).

    Raises:
        ProbeError: no GPU, or `CUDA_VISIBLE_DEVICES` names none of this node's GPUs.
    """
    devices = probe_devices(nvml=nvml)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        if visible is not None:
            raise ProbeError("CUDA_VISIBLE_DEVICES is empty: this process sees no GPU")
        return devices[0]
    first = visible.split(",")[0].strip()
    if first.isdigit():
        ordinal = int(first)
        by_index = [d for d in devices if d.index == ordinal]
        if by_index:
            return by_index[0]
    else:
        for device in devices:
            if device.uuid and (device.uuid == first or device.uuid.startswith(first)):
                return device
    raise ProbeError(f"CUDA_VISIBLE_DEVICES={visible!r} names no GPU of this node")
