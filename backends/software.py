"""The software fingerprint of this process, read without importing any GPU library.

A serving engine calls the lookup at startup, so this must cost a few
milliseconds: versions come from installed package metadata
(`importlib.metadata`), the CUDA runtime from the text of torch's
`version.py` (read, not imported), and the kernel hash from our Triton
kernel sources on disk.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import re
import sys
from pathlib import Path

from mla_tune.backends.device import SoftwareFingerprint

_KERNEL_DIR = Path(__file__).resolve().parent / "triton_mla"
_CUDA_LINE = re.compile(r"""^cuda\s*(?::[^=]*)?=\s*['"]([^'"]+)['"]""", re.MULTILINE)
_CUDA_SUFFIX = re.compile(r"\+cu(\d+)(\d)$")


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def package_version(distribution: str) -> str:
    """The installed version of `distribution`, or "" when it is not installed.

    Reads the `NAME-VERSION.dist-info` (or `.egg-info`) directory names on
    `sys.path`, the first match winning as in `importlib.metadata`, whose
    import alone costs ~35 ms at a serving engine's startup (`python -X importtime`
    on the 2-core dev machine).
    """
    wanted = _normalized(distribution)
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            stem, dot, suffix = name.rpartition(".")
            if dot and suffix in ("dist-info", "egg-info"):
                dist, _, version = stem.partition("-")
                if version and _normalized(dist) == wanted:
                    return version.split("-")[0] if suffix == "egg-info" else version
    return ""


def torch_cuda_runtime(torch_version: str = "") -> str:
    """The CUDA runtime torch was built against (e.g. "13.0"), "" for a CPU build or no torch.

    Reads `torch/version.py` as text; falls back to the `+cuXYZ` suffix of the
    version string.
    """
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    for location in (spec.submodule_search_locations or []) if spec else []:
        try:
            text = (Path(location) / "version.py").read_text(encoding="utf-8")
        except OSError:
            continue
        match = _CUDA_LINE.search(text)
        if match:
            return match.group(1)
        return ""
    match = _CUDA_SUFFIX.search(torch_version)
    return f"{match.group(1)}.{match.group(2)}" if match else ""


def kernel_hash(directory: Path = _KERNEL_DIR) -> str:
    """sha256 (16 hex digits) over the relative paths and bytes of our kernel sources.

    Any edit to a `.py` file under `backends/triton_mla/` changes it, which
    makes decisions measured with the old kernels stale.
    """
    digest = hashlib.sha256()
    if directory.is_dir():
        for path in sorted(directory.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            digest.update(path.relative_to(directory).as_posix().encode())
            digest.update(b"\0")
            digest.update(path.read_bytes())
            digest.update(b"\0")
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def current_fingerprint(*, driver_version: str = "") -> SoftwareFingerprint:
    """The fingerprint of the software installed for this interpreter (cached per process).

    Args:
        driver_version: the NVIDIA driver version from NVML (e.g. "580.65.06");
            "" when unknown (no GPU probed).

    Returns:
        torch, triton and flashinfer versions ("" when absent), the CUDA
        runtime torch was built for, the driver, mla-tune's version and the
        kernel-source hash.
    """
    from mla_tune import __version__

    torch_version = package_version("torch")
    return SoftwareFingerprint(
        torch=torch_version,
        triton=package_version("triton"),
        flashinfer=package_version("flashinfer-python"),
        cuda_runtime=torch_cuda_runtime(torch_version) if torch_version else "",
        driver=driver_version,
        mla_tune=__version__,
        kernel_hash=kernel_hash(),
    )


def compatibility_problems(stored: SoftwareFingerprint, current: SoftwareFingerprint) -> list[str]:
    """Why a decision measured with `stored` may not be used with `current`; empty = compatible.

    What the current process cannot know is not judged: the driver without an NVML
    probe, and torch, triton or flashinfer where they are not installed (an init
    container or a CLI venv that looks up for the engine beside it). What it does
    know, and our kernel sources, must match.
    """
    from mla_tune.backends.device import COMPATIBILITY_FIELDS

    unknown = {field: getattr(stored, field) for field in COMPATIBILITY_FIELDS if not getattr(current, field)}
    if unknown:
        current = SoftwareFingerprint(**{**current.to_dict(), **unknown})
    return current.incompatibilities(stored)
