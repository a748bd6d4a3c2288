"""Database URLs and engines: where the store lives, and how we connect to it.

SQLite (the default, one file in the user's data directory) runs in WAL mode
with a busy timeout; PostgreSQL goes through psycopg 3 with a 2 s connect
timeout. Everything that can go wrong opening a store becomes a `StoreError`
with one clear line that never contains a password.

SQLAlchemy is imported lazily here: the read-only lookup path
(`store/readonly.py`) uses `default_url`, `mask_url` and `StoreError` and must
not pay for importing SQLAlchemy.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

from mla_tune.store.sqlite_file import StoreError, check_sqlite_file, sqlite_path

if TYPE_CHECKING:
    from sqlalchemy import Engine

__all__ = ["StoreError", "default_url", "resolve_url", "mask_url", "make_engine",
           "sqlite_path", "check_sqlite_file", "translate_error", "CONNECT_TIMEOUT_S",
           "DEFAULT_BUSY_TIMEOUT_S"]

ENV_VAR = "MLA_TUNE_DB"
CONNECT_TIMEOUT_S = 2
DEFAULT_BUSY_TIMEOUT_S = 5.0

# Dialect+driver pairs we know how to run; a bare "postgresql://" means psycopg 3.
_DRIVERS = {
    "sqlite": {None: "sqlite", "pysqlite": "sqlite+pysqlite"},
    "postgresql": {None: "postgresql+psycopg", "psycopg": "postgresql+psycopg"},
}

_PASSWORD = re.compile(r"(?P<head>://[^:/@\s]*:)(?P<pw>[^@\s]*)(?P<tail>@)")


def default_url() -> str:
    """`$MLA_TUNE_DB`, else an SQLite file in the user's data directory."""
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        return env
    import platformdirs

    return f"sqlite:///{os.path.join(platformdirs.user_data_dir('mla-tune'), 'mla-tune.db')}"


def mask_url(url: object) -> str:
    """The URL as text with any password replaced by `***`."""
    return _PASSWORD.sub(lambda m: f"{m['head']}***{m['tail']}", str(url))


def scrub(text: str, url: str | None) -> str:
    """`text` with the URL's password (if any) replaced by `***`, wherever it appears."""
    text = mask_url(text)
    if url:
        match = _PASSWORD.search(url)
        if match and match["pw"]:
            text = text.replace(match["pw"], "***")
    return text


def resolve_url(url: str | None) -> str:
    """The URL to use: `url`, else `default_url()`, normalised to a driver we support.

    Raises:
        ValueError: one line naming the problem, for a malformed URL or an
            unknown dialect or driver. Nothing is created.
    """
    raw = default_url() if url is None or not str(url).strip() else str(url).strip()
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(raw)
    except (ArgumentError, ValueError) as exc:
        raise ValueError(f"malformed database URL {mask_url(raw)!r}: expected "
                         f"dialect[+driver]://..., e.g. sqlite:///path/to.db or "
                         f"postgresql://user@host/db ({scrub(str(exc), raw)})") from None
    backend, _, driver = parsed.drivername.partition("+")
    drivers = _DRIVERS.get(backend)
    if drivers is None:
        raise ValueError(f"unsupported database {backend!r} in {mask_url(raw)!r}: "
                         f"use sqlite:///PATH or postgresql://USER@HOST/DB")
    if (driver or None) not in drivers:
        known = ", ".join(sorted(d for d in drivers if d))
        raise ValueError(f"unsupported driver {driver!r} for {backend} in {mask_url(raw)!r}: "
                         f"use {backend}:// or {backend}+{known}://")
    if backend == "sqlite":
        database = parsed.database or ""
        if database in ("", ":memory:"):
            raise ValueError(f"database URL {mask_url(raw)!r} names no file: "
                             f"use sqlite:///PATH (an in-memory store would be lost at exit)")
        if parsed.host:
            raise ValueError(f"malformed SQLite URL {mask_url(raw)!r}: use sqlite:///relative/path "
                             f"or sqlite:////absolute/path")
        database = os.path.abspath(os.path.expanduser(database))
        return parsed.set(drivername=drivers[driver or None], database=database).render_as_string(
            hide_password=False)
    if not parsed.host and not parsed.query.get("host"):
        raise ValueError(f"PostgreSQL URL {mask_url(raw)!r} names no host: "
                         f"use postgresql://USER@HOST[:PORT]/DB")
    return parsed.set(drivername=drivers[driver or None]).render_as_string(hide_password=False)


def translate_error(exc: BaseException, url: str, *, busy_timeout_s: float | None = None) -> StoreError:
    """A one-line `StoreError` for a DBAPI/SQLAlchemy error raised while using `url`."""
    where = sqlite_path(url) or mask_url(url)
    orig = getattr(exc, "orig", None) or exc
    text = " ".join(str(orig).split())
    low = text.lower()
    if "file is not a database" in low:
        msg = f"{where} is not an SQLite database (file is not a database)"
    elif "malformed" in low:
        msg = f"{where} is corrupt or truncated (database disk image is malformed)"
    elif "database is locked" in low or "database table is locked" in low:
        waited = f" after waiting {busy_timeout_s:g} s" if busy_timeout_s is not None else ""
        msg = f"{where} is locked by another process{waited}; try again when it finishes"
    elif "readonly database" in low or "read-only" in low:
        msg = f"{where} is read-only ({text}); mla-tune needs to write it"
    elif "unable to open database file" in low:
        msg = (f"cannot open {where} (unable to open database file): check that the file and its "
               f"directory exist and are readable, and writable for the -wal/-shm files")
    elif "no such table" in low:
        msg = f"{where} has no mla-tune tables ({text}); run `mla-tune db upgrade`"
    elif url.startswith("postgresql") and "authentication failed" in low:
        msg = f"the PostgreSQL server refused the credentials in {mask_url(url)}: {text}"
    elif url.startswith("postgresql") and "database" in low and "does not exist" in low:
        msg = f"the PostgreSQL server has no such database ({text}); create it first: {mask_url(url)}"
    elif url.startswith("postgresql") and ("connect" in low or "timeout" in low
                                            or "refused" in low or "resolve" in low):
        msg = f"cannot reach the PostgreSQL server at {mask_url(url)}: {text}"
    else:
        msg = f"database error on {where}: {type(orig).__name__}: {text}"
    return StoreError(scrub(msg, url))


def require_driver(url: str) -> None:
    """StoreError with the install command when the URL's driver is not installed."""
    if url.startswith("postgresql"):
        try:
            import psycopg  # noqa: F401
        except ImportError as exc:
            raise StoreError(f"PostgreSQL stores need psycopg 3 ({exc}); install it with "
                             f"pip install 'mla-tune[postgres]'") from None


def make_engine(url: str, *, busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S) -> Engine:
    """An engine for a resolved URL: SQLite with WAL + busy timeout, PostgreSQL with a 2 s connect timeout.

    Transactions on SQLite start with `BEGIN` (deferred) unless the engine
    carries the execution option `sqlite_begin="IMMEDIATE"`, which writers use
    so that two writers queue on the busy timeout instead of failing on a
    lock upgrade.
    """
    from sqlalchemy import create_engine, event
    from sqlalchemy.pool import NullPool

    if url.startswith("sqlite"):
        engine = create_engine(url, poolclass=NullPool,
                               connect_args={"timeout": busy_timeout_s, "check_same_thread": False})
        busy_ms = int(busy_timeout_s * 1000)

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn, _record):
            dbapi_conn.isolation_level = None  # we emit BEGIN ourselves (below)
            cursor = dbapi_conn.cursor()
            cursor.execute(f"PRAGMA busy_timeout = {busy_ms}")
            cursor.execute("PRAGMA foreign_keys = ON")
            try:
                mode = cursor.execute("PRAGMA journal_mode").fetchone()[0]
                if mode.lower() != "wal":
                    cursor.execute("PRAGMA journal_mode = WAL")
            except Exception:  # read-only or locked file: the first real write reports it
                pass
            cursor.execute("PRAGMA synchronous = NORMAL")
            cursor.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn):
            mode = conn.get_execution_options().get("sqlite_begin", "DEFERRED")
            conn.exec_driver_sql(f"BEGIN {mode}")

        return engine
    require_driver(url)
    return create_engine(url, pool_pre_ping=True, pool_size=2, max_overflow=4,
                         connect_args={"connect_timeout": CONNECT_TIMEOUT_S})
