"""The read-only fast path behind `mla_tune.lookup`.

A serving engine calls this at startup (eight at once on an 8-GPU node), so it
never creates, migrates or writes the store and it is cheap: SQLite goes
through the standard library's `sqlite3` opened with `mode=ro` (importing
SQLAlchemy alone costs several hundred ms); PostgreSQL goes through psycopg
directly with a 2 s connect timeout in a read-only session. Neither SQLAlchemy
nor Alembic is imported here.

Every problem with the store raises `StoreError` with one line; the caller
falls back to the static choice.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from mla_tune.store import codec
from mla_tune.store.engine import (CONNECT_TIMEOUT_S, check_userinfo, default_url, mask_url, pg_read_options,
                                   require_driver, scrub, translate_error)
from mla_tune.store.records import Decision
from mla_tune.store.schema import KNOWN_REVISIONS, newer_schema_message
from mla_tune.store.sqlite_file import CorruptValueError, StoreError, check_sqlite_file, connect_ro, sqlite_path

TILES_REVISION = "0002"  # the first schema with measurements.params
# The first schema whose decisions say which backend each engine should get, and how the launch our vLLM plugin
# makes of our kernel scores.
DECISIONS_REVISION = "0005"

_DECISION_COLUMNS = (*codec.KEY_FIELDS, "winner", "runner_up", "margin", "static_choice",
                     "static_score", "noise_margin", "kept_static", "scores", "per_shape",
                     "anomalies", "failures", "gpu_uuids", "engine_best", "plugin_scores", "decided_at")
_SELECT = ("SELECT " + ", ".join(f"d.{c}" for c in _DECISION_COLUMNS) + ", "
           + ", ".join(f"f.{c} AS fp_{c}" for c in codec.FINGERPRINT_FIELDS)
           + " FROM decisions d JOIN fingerprints f ON f.digest = d.fingerprint_digest")
_PARAM = re.compile(r":(\w+)")  # our named parameters, rewritten to psycopg's %(name)s
_ORDER = " ORDER BY d.decided_at DESC, d.updated_at DESC, d.id DESC"


def _query(select: str, order: str, alias: str, *, sku: str | None, device_name: str | None,
           key_fields: Mapping[str, Any] | None, where: Mapping[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    """`select` filtered on table `alias` by SKU (or every SKU of a device name), decision-key fields and the
    `where` column values, then `order`."""
    clauses, params = [], {}
    if sku is not None:
        clauses.append(f"{alias}.sku = :sku")
        params["sku"] = sku
    elif device_name is not None:
        prefix = f"{device_name} | "
        clauses.append(f"substr({alias}.sku, 1, :prefix_len) = :prefix")
        params.update(prefix=prefix, prefix_len=len(prefix))
    unknown = [name for name in key_fields or {} if name not in codec.KEY_FIELDS]
    if unknown:
        raise ValueError(f"unknown decision key field {unknown[0]!r}; known: {', '.join(codec.KEY_FIELDS)}")
    for name, value in {**(key_fields or {}), **(where or {})}.items():
        clauses.append(f"{alias}.{name} = :{name}")
        params[name] = value
    return select + (" WHERE " + " AND ".join(clauses) if clauses else "") + order, params


def _convert_all(rows, convert, where: str) -> list:
    """`convert` of each row; a row with a value of the wrong kind is a StoreError naming it."""
    out = []
    for row in rows:
        try:
            out.append(convert(row))
        except (CorruptValueError, ValueError, TypeError, KeyError, AttributeError) as exc:
            raise StoreError(f"{where} holds a corrupt row ({' '.join(str(exc).split())}); fix or delete it, "
                             f"or re-run `mla-tune` to tune again") from None
    return out


def _decision(row: Mapping[str, Any]) -> Decision:
    fingerprint = codec.fingerprint_from({c: row[f"fp_{c}"] for c in codec.FINGERPRINT_FIELDS})
    return codec.decision_from(row, fingerprint)


def _check_revision(revisions: list[str], where: str, min_revision: str) -> None:
    if not revisions:
        raise StoreError(f"{where} has no mla-tune schema revision (not migrated); run `mla-tune db upgrade`")
    for revision in revisions:
        if revision not in KNOWN_REVISIONS:
            raise StoreError(newer_schema_message(where, revision))
        if KNOWN_REVISIONS.index(revision) < KNOWN_REVISIONS.index(min_revision):
            raise StoreError(f"{where} has schema revision {revision}, older than the {min_revision} this read "
                             f"needs; run `mla-tune db upgrade`")


def find_decisions(url: str | None = None, *, sku: str | None = None, device_name: str | None = None,
                   key_fields: Mapping[str, Any] | None = None) -> list[Decision]:
    """Stored decisions matching a SKU (or a device name) and key fields, newest first.

    Args:
        url: the store; None for `$MLA_TUNE_DB` or the default SQLite file.
        sku: exact `DeviceInfo.sku`; takes precedence over `device_name`.
        device_name: match every SKU of this GPU name (when only the name is known).
        key_fields: `DecisionKey` field -> value, e.g. `{"kv_cache_dtype": "fp8_e4m3", "num_heads": 16}`.

    Returns:
        Every match, under any software fingerprint; the caller checks compatibility.

    Raises:
        StoreError: the store is missing, empty, not a database, truncated, a
            directory, unreadable, locked beyond the timeout, of a newer or
            unknown schema, or unreachable.
        ValueError: `key_fields` names a field that is not part of a decision key.
    """
    sql, params = _query(_SELECT, _ORDER, "d", sku=sku, device_name=device_name, key_fields=key_fields)
    return _find(url, sql, params, _decision, min_revision=DECISIONS_REVISION)


def _find(url: str | None, sql: str, params: dict[str, Any], convert, *,
          min_revision: str = KNOWN_REVISIONS[0]) -> list:
    """`convert` of every row `sql` selects in the store at `url` (None: `$MLA_TUNE_DB` or the default file),
    which must be at `min_revision` or later."""
    url = url if url and str(url).strip() else default_url()
    path = sqlite_path(url)
    if path is not None:
        return _find_sqlite(path, url, sql, params, convert, min_revision)
    return _find_postgres(url, sql, params, convert, min_revision)


def _find_sqlite(path: str, url: str, sql: str, params: dict[str, Any], convert, min_revision: str) -> list:
    import sqlite3

    check_sqlite_file(path, must_exist=True)
    connection = None
    try:
        connection = connect_ro(sqlite3, path, timeout_s=CONNECT_TIMEOUT_S)
        connection.row_factory = sqlite3.Row
        tables = {r[0] for r in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "alembic_version" not in tables:
            raise StoreError(f"{path} has no mla-tune tables (an SQLite database of something else, "
                             f"or never migrated); run `mla-tune db upgrade`")
        _check_revision([r[0] for r in connection.execute("SELECT version_num FROM alembic_version")], path,
                        min_revision)
        return _convert_all(connection.execute(sql, params), convert, path)
    except sqlite3.Error as exc:
        raise translate_error(exc, url, busy_timeout_s=CONNECT_TIMEOUT_S) from None
    finally:
        if connection is not None:
            connection.close()


def _pg_connect_args(url: str) -> dict[str, Any]:
    """psycopg keyword arguments of a PostgreSQL URL, parsed here rather than handed to libpq as a string:
    libpq's messages about a malformed string quote it, password included."""
    from urllib.parse import parse_qsl, unquote, urlsplit

    check_userinfo(url)
    parts = urlsplit(url)
    args: dict[str, Any] = dict(parse_qsl(parts.query, keep_blank_values=True))
    netloc = parts.netloc
    userinfo, at, hostport = netloc.rpartition("@")
    if at:
        user, colon, password = userinfo.partition(":")
        if user:
            args["user"] = unquote(user)
        if colon:
            args["password"] = unquote(password)
    host, colon, port = hostport.rpartition(":") if not hostport.endswith("]") else (hostport, "", "")
    if not colon:
        host, port = hostport, ""
    if host:
        args["host"] = unquote(host.strip("[]"))
    if port:
        args["port"] = port
    if parts.path.strip("/"):
        args["dbname"] = unquote(parts.path.lstrip("/"))
    return args


def _find_postgres(url: str, sql: str, params: dict[str, Any], convert, min_revision: str) -> list:
    """Through psycopg directly: SQLAlchemy's import alone would add ~0.3 s to an engine's start."""
    scheme = url.partition("://")[0]
    if scheme not in ("postgresql", "postgresql+psycopg"):
        from mla_tune.store.engine import resolve_url

        try:
            url = resolve_url(url)  # raises for what we cannot use; else it names psycopg
        except ValueError as exc:
            raise StoreError(str(exc)) from None
    try:
        args = _pg_connect_args(url)
    except ValueError as exc:
        raise StoreError(scrub(str(exc), url)) from None
    require_driver(url)
    import psycopg
    from psycopg.rows import dict_row

    where = mask_url(url)
    # A read-only session whose lock and statement waits are bounded: a table lock held by a migration or an
    # operator must not hang a serving engine's start.
    args["options"] = " ".join(filter(None, (args.get("options", ""), pg_read_options())))
    args["connect_timeout"] = CONNECT_TIMEOUT_S
    try:
        with psycopg.connect(autocommit=True, row_factory=dict_row, **args) as connection:
            try:
                revisions = [r["version_num"] for r in connection.execute("SELECT version_num FROM alembic_version")]
            except psycopg.errors.UndefinedTable:
                raise StoreError(f"the database at {where} has no mla-tune tables; "
                                 f"run `mla-tune db upgrade`") from None
            _check_revision(revisions, where, min_revision)
            return _convert_all(connection.execute(_PARAM.sub(r"%(\1)s", sql), params), convert, where)
    except psycopg.Error as exc:
        raise translate_error(exc, url, busy_timeout_s=CONNECT_TIMEOUT_S) from None


_TILE_SELECT = ("SELECT m.sku, m.batch_size, m.kv_len, m.params, m.measured_at, "
                + ", ".join(f"f.{c} AS fp_{c}" for c in codec.FINGERPRINT_FIELDS)
                + " FROM measurements m JOIN fingerprints f ON f.id = m.fingerprint_id")
_TILE_ORDER = " ORDER BY m.measured_at DESC, m.id DESC"


def find_tiles(url: str | None = None, *, backend: str, device_name: str,
               key_fields: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The launches the tuner stored for a refined backend (our Triton kernel) on every SKU of `device_name`,
    newest first: one dict per ok measurement with `sku`, `batch_size`, `kv_len`, `params`
    (records.Measurement.params), `measured_at` and `fingerprint` (a SoftwareFingerprint). Raises StoreError as
    `find_decisions` does, and for a store older than TILES_REVISION."""
    sql, params = _query(_TILE_SELECT, _TILE_ORDER, "m", sku=None, device_name=device_name, key_fields=key_fields,
                         where={"backend": backend, "status": "ok"})
    rows = _find(url, sql, params, _tile_row, min_revision=TILES_REVISION)
    return [row for row in rows if row["params"] is not None]  # measured before the refinement: none


def _tile_row(row: Mapping[str, Any]) -> dict[str, Any]:
    return {"sku": row["sku"], "batch_size": int(row["batch_size"]), "kv_len": int(row["kv_len"]),
            "params": codec._json(row["params"]), "measured_at": row["measured_at"],
            "fingerprint": codec.fingerprint_from({c: row[f"fp_{c}"] for c in codec.FINGERPRINT_FIELDS})}
