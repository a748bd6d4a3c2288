"""Alembic, configured in code: read a database's revision, migrate it to head.

Migrations run inside one transaction on the caller's connection; on
PostgreSQL an advisory lock serialises nodes that open a fresh shared store
at the same moment (SQLite's `BEGIN IMMEDIATE` does the same there).
"""

from __future__ import annotations

import os

from sqlalchemy import Connection, Engine, inspect, text

from mla_tune.store.schema import HEAD_REVISION, KNOWN_REVISIONS, newer_schema_message
from mla_tune.store.sqlite_file import StoreError

MIGRATIONS_DIR = os.path.join(os.path.dirname(__file__), "migrations")
_PG_LOCK_ID = 0x6D6C6174  # "mlat": any constant shared by every mla-tune


def alembic_config(connection: Connection | None = None):
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", MIGRATIONS_DIR)
    config.attributes["connection"] = connection
    return config


def current_revision(connection: Connection) -> str | None:
    """The database's Alembic revision; None for a database without mla-tune tables."""
    if not inspect(connection).has_table("alembic_version"):
        return None
    rows = connection.execute(text("SELECT version_num FROM alembic_version")).scalars().all()
    if len(rows) > 1:
        raise StoreError(f"database has several schema revisions {sorted(rows)} (branched history); "
                         f"mla-tune knows a single line up to {HEAD_REVISION}")
    return rows[0] if rows else None


def check_known(revision: str | None, where: str) -> None:
    """Raise StoreError when `revision` is not one this mla-tune knows (i.e. newer)."""
    if revision is not None and revision not in KNOWN_REVISIONS:
        raise StoreError(newer_schema_message(where, revision))


def migrate(engine: Engine, where: str, *, target: str = "head", downgrade: bool = False) -> None:
    """Upgrade (or with `downgrade`, downgrade) the database to `target` in one transaction."""
    if target == "head" and not downgrade:
        # Usually there is nothing to do: find out without taking the write lock, so that
        # opening a store that another process is writing does not wait on it.
        with engine.connect() as connection:
            revision = current_revision(connection)
        check_known(revision, where)
        if revision == HEAD_REVISION:
            return
    from alembic import command

    with engine.execution_options(sqlite_begin="IMMEDIATE").begin() as connection:
        if connection.dialect.name == "postgresql":
            connection.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": _PG_LOCK_ID})
        revision = current_revision(connection)
        check_known(revision, where)
        if downgrade:
            command.downgrade(alembic_config(connection), target)
        elif not (target == "head" and revision == HEAD_REVISION):
            command.upgrade(alembic_config(connection), target)
