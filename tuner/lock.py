"""A per-GPU file lock: two mla-tune processes never time the same GPU at once.

`fcntl.flock` on one file per GPU UUID; the kernel drops the lock when the
holder exits, however it exits, so a killed tune leaves no stale lock.
"""

from __future__ import annotations

import fcntl
import os
import re
import tempfile
from pathlib import Path


class GpuBusy(RuntimeError):
    """Another process holds the GPU's lock; the message names it."""


def lock_dir() -> Path:
    """Where lock files live: `$MLA_TUNE_LOCK_DIR`, else a shared folder under the temp dir."""
    env = os.environ.get("MLA_TUNE_LOCK_DIR")
    path = Path(env) if env else Path(tempfile.gettempdir()) / "mla-tune-locks"
    path.mkdir(parents=True, exist_ok=True)
    return path


class GpuLock:
    """Exclusive, non-blocking lock of one GPU; use as a context manager.

    Args:
        gpu_id: the GPU's UUID (or any stable id, such as `cpu0` in tests).
        directory: folder for lock files (default `lock_dir()`).
    """

    def __init__(self, gpu_id: str, *, directory: Path | None = None):
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", gpu_id) or "gpu"
        self.gpu_id = gpu_id
        self.path = (directory or lock_dir()) / f"{safe}.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise GpuBusy naming the holder's pid."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise GpuBusy(f"GPU {self.gpu_id} is being timed by another mla-tune process "
                          f"(pid {holder}, lock {self.path})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> GpuLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
