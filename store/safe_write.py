"""Write a file so that a reader sees the old bytes or the new ones, never part, and nothing else is touched.

Used by `mla-tune export`: a symbolic link is written through, a device or pipe is written directly, a
regular file is replaced atomically after its bytes are synced, and no directory is ever created.
"""

from __future__ import annotations

import contextlib
import os

TEMP_MARK = ".mla-tune-export-"


def write_file(path: str | os.PathLike, data: bytes) -> str:
    """Write `data` to `path` and return the path written.

    A regular file (or a missing one) is replaced atomically: the bytes go to
    `.NAME.mla-tune-export-PID.tmp` in the same directory, are synced, then the
    file is renamed into place and the directory synced. A failure removes the
    temporary file; a kill leaves the old file or the new one, and at most a
    temporary file that the next export to that directory removes (its process
    is gone). A symbolic link is followed to the
    file it names (the link stays); a device, pipe or socket (`/dev/stdout`) is
    written directly and never replaced. Missing directories are not created.
    """
    import stat

    path = os.fspath(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(21, "Is a directory", path)
    if st is not None and not stat.S_ISREG(st.st_mode):
        with open(path, "wb") as handle:   # a terminal, pipe or /dev/null: the bytes go straight to it
            handle.write(data)
        return path
    target = os.path.realpath(path)
    directory, name = os.path.split(target)
    if not os.path.isdir(directory):
        raise FileNotFoundError(2, f"No such directory {directory} (it is not created)", path)
    _remove_stale_temps(directory, name)
    temp = os.path.join(directory, f".{name}{TEMP_MARK}{os.getpid()}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o666)
    named = True
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if st is not None:
            os.fchmod(fd, stat.S_IMODE(st.st_mode))
        os.fsync(fd)   # the bytes are on disk before the rename makes them the file
        os.close(fd)
        fd = -1
        os.replace(temp, target)
        named = False
        _sync_directory(directory)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        if named:
            with contextlib.suppress(OSError):
                os.remove(temp)
        raise
    return path


def _remove_stale_temps(directory: str, name: str) -> None:
    """Remove `.NAME.mla-tune-export-PID.tmp` files whose process is gone (a killed export's)."""
    prefix = f".{name}{TEMP_MARK}"
    try:
        entries = os.listdir(directory)
    except OSError:
        return
    for entry in entries:
        pid = entry[len(prefix):-len(".tmp")] if entry.startswith(prefix) and entry.endswith(".tmp") else ""
        if not pid.isdigit() or (int(pid) != os.getpid() and _alive(int(pid))):
            continue
        with contextlib.suppress(OSError):
            os.remove(os.path.join(directory, entry))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _sync_directory(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot sync a directory; the rename itself is done
    finally:
        os.close(fd)
