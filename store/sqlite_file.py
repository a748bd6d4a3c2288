"""Cheap facts about an SQLite store file, without importing SQLAlchemy.

Used by both the writer (`Store.open`) and the read-only lookup path, so that
a file that is not a database, truncated, empty or a directory is reported in
one clear line before SQLite gets a chance to misread or modify it.
"""

from __future__ import annotations

import os
import stat
import struct
from urllib.parse import quote, unquote

_MAGIC = b"SQLite format 3\x00"


class StoreError(Exception):
    """The store cannot be used; the message is one line and never contains a password.

    Attributes:
        exit_code: the CLI's exit status for it: 1 (the store is unusable), 2 for `StorePathError`.
    """

    exit_code = 1


class StorePathError(StoreError):
    """The path given cannot hold a store at all (its directory is missing, a dangling symbolic link):
    a bad argument, exit status 2, and nothing was created."""

    exit_code = 2


class CorruptValueError(ValueError):
    """A stored row holds a value of the wrong kind (`codec` raises it; the store reports it as a StoreError)."""


class Unparsed(str):
    """The raw text of a JSON column that does not parse (see `models.StoredJSON`)."""


_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def file_kind(mode: int) -> str:
    """'a FIFO (named pipe)', ... for a stat mode that is not a regular file or directory."""
    return next((text for test, text in _KINDS if test(mode)), "not a regular file")


def check_parent(path: str) -> None:
    """StorePathError unless the directory that would hold a new file at `path` exists, and `path` is no
    dangling symbolic link (SQLite would create the link's target, and a failure would remove the link)."""
    if os.path.islink(path) and not os.path.exists(path):
        raise StorePathError(f"{path} is a symbolic link to {os.readlink(path)}, which does not exist; "
                             f"point it at an existing store or remove it")
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise StorePathError(f"the directory {parent} does not exist (nothing was created); create it first "
                             f"or fix the path")


def sqlite_path(url: str) -> str | None:
    """The absolute file path of an `sqlite://` URL; None for any other URL or an in-memory one."""
    scheme, sep, rest = str(url).partition("://")
    if not sep or scheme.split("+")[0] != "sqlite":
        return None
    if not rest.startswith("/"):
        return None  # sqlite://host/... is malformed; resolve_url reports it
    path = unquote(rest[1:].partition("?")[0])
    if path in ("", ":memory:"):
        return None
    return os.path.abspath(os.path.expanduser(path))


def check_sqlite_file(path: str, *, must_exist: bool) -> bool:
    """Check what lies at `path` before SQLite opens it.

    Returns:
        True when a non-empty file is there, False when nothing is there (or an
        empty file, which SQLite treats as a new database).

    Raises:
        StoreError: the path is a directory, unreadable, not an SQLite file,
            or truncated (shorter than the page count its header records);
            or nothing is there and `must_exist`.
    """
    if os.path.isdir(path):
        raise StoreError(f"{path} is a directory, not an SQLite database file")
    try:
        # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except (FileNotFoundError, NotADirectoryError):  # nothing there (or a file in the way of a folder)
        if must_exist:
            raise StoreError(f"no database at {path} (nothing has been tuned or stored there yet)") from None
        return False
    except OSError as exc:
        raise StoreError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise StoreError(f"{path} is {file_kind(mode)}, not an SQLite database file")
        header = os.pread(fd, 100, 0)
        size = os.fstat(fd).st_size
    except OSError as exc:
        raise StoreError(f"cannot read {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if size == 0:
        if must_exist:
            raise StoreError(f"{path} is an empty file, not an mla-tune database")
        return False
    if len(header) < 100 or not header.startswith(_MAGIC):
        raise StoreError(f"{path} is not an SQLite database (its first bytes are not the SQLite header)")
    page_size = struct.unpack(">H", header[16:18])[0]
    page_size = 65536 if page_size == 1 else page_size
    change_counter, page_count = struct.unpack(">II", header[24:32])
    valid_for = struct.unpack(">I", header[92:96])[0]
    if page_size < 512 or page_size & (page_size - 1):
        raise StoreError(f"{path} is corrupt (header page size {page_size} is not a power of two >= 512)")
    if size % page_size:
        raise StoreError(f"{path} is truncated or corrupt ({size} bytes is not a whole number of "
                         f"{page_size}-byte pages)")
    if valid_for == change_counter and page_count and size < page_count * page_size:
        raise StoreError(f"{path} is truncated ({size} bytes, its header records {page_count} pages "
                         f"of {page_size} bytes = {page_count * page_size} bytes)")
    return True


def connect_ro(sqlite3, path: str, *, timeout_s: float):
    """Open `path` read-only (`mode=ro`); a WAL database whose `-shm` cannot be made is opened immutable.

    A read-only connection to a WAL database needs the `-shm` file next to it
    and creates it when missing. When that is impossible (read-only directory
    or medium; SQLite 3.40 says "attempt to write a readonly database", older
    ones "unable to open database file") and there is no non-empty `-wal`
    file, no writer can have left anything unmerged, so reading the file as
    immutable is exact.
    """
    uri = f"file:{quote(path)}?mode=ro"
    connection = sqlite3.connect(uri, uri=True, timeout=timeout_s, check_same_thread=False)
    try:
        connection.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()
        return connection
    except sqlite3.OperationalError as exc:
        connection.close()
        text = str(exc).lower()
        cannot_make_shm = "unable to open" in text or "readonly" in text or "read-only" in text
        try:
            wal_bytes = os.stat(path + "-wal").st_size
        except OSError:
            wal_bytes = 0
        if not cannot_make_shm:
            raise
        if wal_bytes:
            raise StoreError(f"{path} cannot be read: its -wal file holds {wal_bytes} bytes not yet merged and "
                             f"the directory cannot be written for the -shm file ({exc})") from None
    return sqlite3.connect(uri + "&immutable=1", uri=True, timeout=timeout_s, check_same_thread=False)
