"""`mla-tune db ...`: store maintenance."""

from __future__ import annotations

import click

from mla_tune.cli.output import echo, fail
from mla_tune.cli.params import db_option


@click.group()
@db_option
def db() -> None:
    """Maintain the decision store.

    Example: mla-tune --db postgresql://tuner@db.internal/mla db upgrade
    """


@db.command()
@db_option
@click.pass_context
def upgrade(ctx) -> None:
    """Create the store if needed and migrate it to the newest schema this mla-tune knows.

    A missing or empty (0-byte) SQLite file is initialised; its directory must
    exist (only the default store's directory is created). Exits with status 2
    when the path cannot hold a store (missing directory, dangling symbolic
    link; nothing is created), and with status 1 and one line when the store
    cannot be used (not a database, truncated, read-only, newer schema); the
    file is left as it was.

    Example: mla-tune db upgrade
    """
    from mla_tune.cli.main import db_url
    from mla_tune.store.engine import StoreError
    from mla_tune.store.repository import Store

    try:
        with Store.open(db_url(ctx), create=True) as store:
            store.upgrade()
            echo(f"{store.where}: schema at revision {store.schema_revision()}")
    except StoreError as exc:
        raise fail(str(exc), exit_code=exc.exit_code) from None
