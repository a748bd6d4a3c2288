"""Printing for the CLI: rich tables for people, JSON for machines, one-line errors."""

from __future__ import annotations

import json

import click


def console():
    """A rich console on stdout (imported lazily: `rich.console` costs ~55 ms to import on the 2-core dev machine)."""
    import sys

    from rich.console import Console

    # Piped output (logs, CI, `| less`) gets a wide table instead of rich's 80-column default.
    width = None if sys.stdout.isatty() else 160
    return Console(highlight=False, soft_wrap=False, width=width)


def table(title: str | None, columns: list[str], rows: list[list[str]]):
    """Print a rich table with `columns` and `rows` of text."""
    from rich.table import Table

    t = Table(title=title, title_justify="left", show_lines=False)
    for column in columns:
        t.add_column(column, overflow="fold")
    for row in rows:
        t.add_row(*[str(cell) for cell in row])
    console().print(t)


def print_json(value) -> None:
    """One JSON document on stdout, keys sorted, two-space indent."""
    click.echo(json.dumps(value, indent=2, sort_keys=True, default=str))


def warn(text: str) -> None:
    """One warning line on stderr."""
    click.echo(f"mla-tune: warning: {' '.join(str(text).split())}", err=True)


def fail(text: str, *, exit_code: int = 1) -> click.ClickException:
    """A `ClickException` with one line and the given exit status (raise it)."""
    exc = click.ClickException(" ".join(str(text).split()))
    exc.exit_code = exit_code
    return exc
