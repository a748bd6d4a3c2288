"""Alembic environment: migrations run on the connection `store.migrate` hands over.

`render_as_batch=True` lets SQLite alter tables (copy-and-move) in later revisions.
"""

from __future__ import annotations

from alembic import context

from mla_tune.store.models import Base

config = context.config
connection = config.attributes.get("connection")
if connection is None:  # `alembic -c store/alembic.ini ...` from a checkout
    import os

    from mla_tune.store.engine import make_engine, resolve_url, sqlite_path

    url = resolve_url(config.get_main_option("sqlalchemy.url") or None)
    if sqlite_path(url):
        os.makedirs(os.path.dirname(sqlite_path(url)), exist_ok=True)
    engine = make_engine(url)
    with engine.begin() as connection:
        context.configure(connection=connection, target_metadata=Base.metadata,
                          render_as_batch=True, compare_type=True)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()
else:
    context.configure(connection=connection, target_metadata=Base.metadata,
                      render_as_batch=True, compare_type=True)
    with context.begin_transaction():
        context.run_migrations()
