"""Cheap facts about an SQLite store file, without importing SQLAlchemy.

Used by both the writer (`Store.open`) and the read-only lookup path, so that
a file that is not a database, truncated, empty or a directory is reported in
one clear line before SQLite gets a chance to misread or modify it.
"""

from __future__ import annotations

import os
import struct
from urllib.parse import unquote

_MAGIC = b"SQLite format 3\x00"


class StoreError(Exception):
    """The store cannot be used; the message is one line and never contains a password."""


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
        with open(path, "rb") as f:
            header = f.read(100)
            size = os.fstat(f.fileno()).st_size
    except (FileNotFoundError, NotADirectoryError):  # nothing there (or a file in the way of a folder)
        if must_exist:
            raise StoreError(f"no database at {path} (nothing has been tuned or stored there yet)") from None
        return False
    except OSError as exc:
        raise StoreError(f"cannot read {path}: {exc.strerror or exc}") from None
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
