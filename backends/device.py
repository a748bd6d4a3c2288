"""What we know about a GPU (from NVML) and about the software that timed it.

Plain frozen values: they cross from the tuner (which probes) to the store
(which persists) and the public lookup (which compares fingerprints).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from mla_tune.backends.problem import DeviceSpec


@dataclass(frozen=True)
class DeviceInfo:
    """NVML facts about one GPU (or one MIG instance)."""

    name: str                                  # e.g. "NVIDIA H100 80GB HBM3"
    compute_capability: tuple[int, int]
    uuid: str = ""
    index: int = 0
    memory_total_mib: int = 0
    driver_version: str = ""
    cuda_driver_version: str = ""             # e.g. "13.0"
    max_sm_clock_mhz: int = 0
    power_limit_w: float = 0.0
    mig_mode: bool = False
    mig_profile: str | None = None             # e.g. "3g.40gb" for a MIG instance
    pci_device_id: str = ""                    # e.g. "0x233010DE"

    @property
    def memory_class_gib(self) -> int:
        """Memory rounded to whole GiB (80 for an H100 80GB, 141 for an H200)."""
        return int(round(self.memory_total_mib / 1024))

    @property
    def sku(self) -> str:
        """What decisions are shared across: name, compute capability, memory class, PCI id, MIG profile."""
        parts = [self.name, f"{self.compute_capability[0]}.{self.compute_capability[1]}",
                 f"{self.memory_class_gib}GiB", self.pci_device_id or "-"]
        if self.mig_profile:
            parts.append(f"MIG {self.mig_profile}")
        return " | ".join(parts)

    @property
    def spec(self) -> DeviceSpec:
        return DeviceSpec(self.name, tuple(self.compute_capability))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> DeviceInfo:
        data = dict(data)
        data["compute_capability"] = tuple(data["compute_capability"])
        return cls(**data)


# Fields whose change invalidates a stored decision (DESIGN: "compatible software fingerprint").
COMPATIBILITY_FIELDS = ("torch", "triton", "flashinfer", "driver", "kernel_hash")


@dataclass(frozen=True)
class SoftwareFingerprint:
    """Versions of everything that can change a kernel's speed, plus a hash of our kernel sources."""

    torch: str = ""
    triton: str = ""
    flashinfer: str = ""
    cuda_runtime: str = ""
    driver: str = ""
    mla_tune: str = ""
    kernel_hash: str = ""

    @property
    def digest(self) -> str:
        """A short stable id of the whole fingerprint (16 hex digits)."""
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def incompatibilities(self, other: SoftwareFingerprint) -> list[str]:
        """Sentences naming each compatibility field that differs; empty = compatible."""
        return [f"{field} {getattr(self, field) or 'absent'} differs from {getattr(other, field) or 'absent'}"
                for field in COMPATIBILITY_FIELDS if getattr(self, field) != getattr(other, field)]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> SoftwareFingerprint:
        return cls(**data)
