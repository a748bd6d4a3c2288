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

from mla_tune.store.sqlite_file import StoreError, StorePathError, check_sqlite_file, connect_ro, sqlite_path

if TYPE_CHECKING:
    from sqlalchemy import Engine

__all__ = ["StoreError", "default_url", "resolve_url", "mask_url", "make_engine",
           "sqlite_path", "check_sqlite_file", "translate_error", "CONNECT_TIMEOUT_S",
           "DEFAULT_BUSY_TIMEOUT_S"]

ENV_VAR = "MLA_TUNE_DB"
CONNECT_TIMEOUT_S = 2
DEFAULT_BUSY_TIMEOUT_S = 5.0
READ_LOCK_TIMEOUT_MS = 1000      # a reader waits this long for a table lock (e.g. a migration's), then fails
READ_STATEMENT_TIMEOUT_MS = 1500  # and a read statement runs at most this long on PostgreSQL

# Dialect+driver pairs we know how to run; a bare "postgresql://" means psycopg 3.
_DRIVERS = {
    "sqlite": {None: "sqlite", "pysqlite": "sqlite+pysqlite"},
    "postgresql": {None: "postgresql+psycopg", "psycopg": "postgresql+psycopg"},
}

# userinfo "user:password@" of a URL in any text: the password runs to the last "@" before the path, so an
# unencoded "@" or space in it is masked whole.
_PASSWORD = re.compile(r"(?P<head>[A-Za-z][\w+.-]*://[^:/@\s]*:)(?P<pw>[^/?#]*)(?P<tail>@)")
# password=... in a URL query or a libpq keyword string (quoted or not)
_PASSWORD_PARAM = re.compile(r"(?i)(?P<head>\b(?:password|passwd|pwd|sslpassword)\s*=\s*)"
                             r"(?P<pw>'(?:[^'\\]|\\.)*'|\"[^\"]*\"|[^&\s;,)]*)")
_SECRET_PARAMS = ("password", "passwd", "pwd", "sslpassword")


def default_sqlite_path() -> str:
    """The SQLite file used when neither `--db` nor `$MLA_TUNE_DB` names a store."""
    import platformdirs

    return os.path.join(platformdirs.user_data_dir("mla-tune"), "mla-tune.db")


def default_url() -> str:
    """`$MLA_TUNE_DB`, else an SQLite file in the user's data directory."""
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        return env
    return f"sqlite:///{default_sqlite_path()}"


def mask_url(url: object) -> str:
    """The URL (or any text holding URLs or `password=` settings) with every password replaced by `***`."""
    text = _PASSWORD.sub(lambda m: f"{m['head']}***{m['tail']}", str(url))
    return _PASSWORD_PARAM.sub(lambda m: f"{m['head']}***", text)


def url_secrets(url: str | None) -> list[str]:
    """Every form of the password a URL carries (userinfo or `?password=`), raw, decoded and encoded,
    longest first: what must never be printed."""
    from urllib.parse import quote, unquote, unquote_plus

    if not url:
        return []
    scheme, sep, rest = str(url).partition("://")
    if not sep:
        return []
    head, _, query = rest.partition("?")
    found = []
    at = head.rfind("@")
    if at >= 0:
        _, colon, password = head[:at].partition(":")
        if colon and password:
            found.append(password)
    for part in query.split("&"):
        name, eq, value = part.partition("=")
        if eq and value and name.strip().lower() in _SECRET_PARAMS:
            found.append(value)
    forms = set()
    for secret in found:
        forms |= {secret, unquote(secret), unquote_plus(secret), quote(unquote(secret), safe="")}
        forms |= {piece for piece in unquote(secret).split() if len(piece) >= 4}  # as a driver splits it
    return sorted((f for f in forms if f), key=len, reverse=True)


def scrub(text: str, url: str | None) -> str:
    """`text` with the URL's password (in any form) and any other URL password replaced by `***`."""
    for secret in url_secrets(url):
        text = text.replace(secret, "***")
    return mask_url(text)


def check_userinfo(raw: str) -> None:
    """ValueError for a URL whose user name or password holds an unencoded "@": the host it names is
    then partly the password (and a driver would print it)."""
    scheme, sep, rest = raw.partition("://")
    authority = rest.partition("?")[0].partition("/")[0] if sep else ""
    if authority.count("@") > 1:
        raise ValueError(f"database URL {mask_url(raw)!r} has more than one '@' before the host: "
                         f"percent-encode an '@' in the user name or password as %40")


def resolve_url(url: str | None) -> str:
    """The URL to use: `url`, else `default_url()`, normalised to a driver we support.

    Raises:
        ValueError: one line naming the problem, for a malformed URL or an
            unknown dialect or driver. Nothing is created.
    """
    raw = default_url() if url is None or not str(url).strip() else str(url).strip()
    check_userinfo(raw)
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(raw)
    except (ArgumentError, ValueError) as exc:
        raise ValueError(scrub(f"malformed database URL {raw!r}: expected "
                               f"dialect[+driver]://..., e.g. sqlite:///path/to.db or "
                               f"postgresql://user@host/db ({exc})", raw)) from None
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
    elif "lock timeout" in low or "statement timeout" in low:
        msg = (f"{where} is locked by another session (a table lock held longer than the "
               f"{READ_LOCK_TIMEOUT_MS / 1000:g} s this read waits); try again when it finishes")
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


def pg_read_options() -> str:
    """libpq `options` of a read-only PostgreSQL session: it cannot write, and waits a bounded time."""
    return (f"-c default_transaction_read_only=on -c lock_timeout={READ_LOCK_TIMEOUT_MS} "
            f"-c statement_timeout={READ_STATEMENT_TIMEOUT_MS}")


def make_engine(url: str, *, busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S, read_only: bool = False) -> Engine:
    """An engine for a resolved URL: SQLite with WAL + busy timeout, PostgreSQL with a 2 s connect timeout.

    Transactions on SQLite start with `BEGIN` (deferred) unless the engine
    carries the execution option `sqlite_begin="IMMEDIATE"`, which writers use
    so that two writers queue on the busy timeout instead of failing on a
    lock upgrade.

    With `read_only`, SQLite files are opened with `mode=ro` (and the journal
    mode is left as it is: switching to WAL rewrites the header), and
    PostgreSQL sessions are read-only with lock and statement timeouts.
    """
    from sqlalchemy import create_engine, event
    from sqlalchemy.pool import NullPool

    if url.startswith("sqlite"):
        path = sqlite_path(url)
        connect_args = {"timeout": busy_timeout_s, "check_same_thread": False}
        extra = {}
        if read_only:
            import sqlite3

            extra["creator"] = lambda: connect_ro(sqlite3, path, timeout_s=busy_timeout_s)
        engine = create_engine(url, poolclass=NullPool, connect_args=connect_args, **extra)
        busy_ms = int(busy_timeout_s * 1000)

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn, _record):
            dbapi_conn.isolation_level = None  # we emit BEGIN ourselves (below)
            cursor = dbapi_conn.cursor()
            cursor.execute(f"PRAGMA busy_timeout = {busy_ms}")
            if read_only:
                cursor.execute("PRAGMA query_only = ON")
                cursor.close()
                return
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
    connect_args = {"connect_timeout": CONNECT_TIMEOUT_S}
    if read_only:
        connect_args["options"] = pg_read_options()
    return create_engine(url, pool_pre_ping=True, pool_size=2, max_overflow=4, connect_args=connect_args)
