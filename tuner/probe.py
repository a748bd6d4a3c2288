"""The tuner's NVML questions: is a GPU idle enough to time kernels on, and its SM clock and temperature.

What GPUs this node has is `backends/nvml_probe.py` (the runtime lookup needs it too); its names are
re-exported here for the CLI and the tuner.
"""

from __future__ import annotations

import os

from mla_tune.backends.nvml_probe import (NvmlSession, ProbeError, local_device, optional_call,
                                          probe_devices)

__all__ = ["BUSY_UTILIZATION_PERCENT", "GpuSensors", "ProbeError", "device_busy_reasons", "local_device",
           "probe_devices"]

BUSY_UTILIZATION_PERCENT = 5   # above this, someone else is computing on the GPU


def device_busy_reasons(index: int, *, nvml=None, own_pid: int | None = None) -> list[str]:
    """Why GPU `index` is not idle enough to time kernels on; empty means idle.

    Args:
        index: NVML index of the GPU.
        nvml: the NVML module (default `pynvml`); tests inject a fake.
        own_pid: a process id to ignore (default: this process).

    Raises:
        ProbeError: NVML cannot start, or `index` is not a GPU of this node.
    """
    own_pid = os.getpid() if own_pid is None else own_pid
    reasons: list[str] = []
    with NvmlSession(nvml) as lib:
        count = lib.nvmlDeviceGetCount()
        if not isinstance(index, int) or not 0 <= index < count:
            raise ProbeError(f"GPU index {index!r} does not exist (this node has {count} GPUs)")
        handle = lib.nvmlDeviceGetHandleByIndex(index)
        processes = list(optional_call(lib.nvmlDeviceGetComputeRunningProcesses, handle, default=[]) or [])
        processes += list(optional_call(lib.nvmlDeviceGetGraphicsRunningProcesses, handle, default=[]) or [])
        others = sorted({int(p.pid) for p in processes if int(p.pid) != own_pid})
        if others:
            listed = ", ".join(str(pid) for pid in others[:8]) + (", ..." if len(others) > 8 else "")
            reasons.append(f"{len(others)} other process(es) use GPU {index} (pid {listed})")
        rates = optional_call(lib.nvmlDeviceGetUtilizationRates, handle)
        if rates is not None and int(rates.gpu) > BUSY_UTILIZATION_PERCENT:
            reasons.append(f"GPU {index} utilisation is {int(rates.gpu)}% "
                           f"(above {BUSY_UTILIZATION_PERCENT}%)")
    return reasons


class GpuSensors:
    """SM clock and temperature of the worker's GPU (None fields when NVML is unavailable)."""

    def __init__(self, gpu: str | None):
        self.handle = None
        if gpu is None:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self.lib = pynvml
            self.handle = (pynvml.nvmlDeviceGetHandleByUUID(gpu) if not gpu.isdigit()
                           else pynvml.nvmlDeviceGetHandleByIndex(int(gpu)))
        except Exception:  # noqa: BLE001 - clocks are optional facts, never a reason to fail
            self.handle = None

    def read(self) -> tuple[int | None, int | None]:
        if self.handle is None:
            return None, None
        try:
            clock = int(self.lib.nvmlDeviceGetClockInfo(self.handle, self.lib.NVML_CLOCK_SM))
            temp = int(self.lib.nvmlDeviceGetTemperature(self.handle, self.lib.NVML_TEMPERATURE_GPU))
            return clock, temp
        except Exception:  # noqa: BLE001
            return None, None
