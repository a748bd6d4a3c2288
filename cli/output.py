"""Printing for the CLI: rich tables for people, JSON for machines, one-line errors.

Everything printed that comes from a store, a file or a URL goes through `safe`: control characters
are escaped (an ANSI sequence or a newline in a node name cannot reach the terminal or forge a line)
and every password of the store URLs this process was given is replaced by `***`.
"""

from __future__ import annotations

import json
import os
import re

import click

_URLS: list[str] = []   # store URLs given to this process (--db, $MLA_TUNE_DB): their passwords are never printed
# C0 and C1 controls, DEL, and the bidirectional overrides that reorder what a terminal shows.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def remember_url(url: str | None) -> None:
    """Note a store URL whose password must never appear in any output."""
    if url and url not in _URLS:
        _URLS.append(url)


def redact(text: str) -> str:
    """`text` with the passwords of every remembered URL, and any URL password or `password=`, masked."""
    from mla_tune.store.engine import mask_url, url_secrets

    for url in _URLS:
        for secret in url_secrets(url):
            text = text.replace(secret, "***")
    return mask_url(text)


def _escape(match: re.Match) -> str:
    char = match.group()
    return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(char) or (
        f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}")


def escape_controls(text: str) -> str:
    """`text` with every control character written as a visible escape such as `\\x1b` or `\\n`."""
    return _CONTROL.sub(_escape, text)


def safe(value) -> str:
    """Text fit for a terminal line: passwords redacted, control characters escaped."""
    return escape_controls(redact(str(value)))


def console():
    """A rich console on stdout (imported lazily: `rich.console` costs ~55 ms to import on the 2-core dev machine).

    Its width is `$COLUMNS` when set, else the terminal's; piped output without `$COLUMNS` (logs, CI) gets
    160 columns instead of rich's 80.
    """
    import sys

    from rich.console import Console

    columns = os.environ.get("COLUMNS", "").strip()
    if columns.isdigit() and int(columns) > 0:
        width = int(columns)
    else:
        width = None if sys.stdout.isatty() else 160
    return Console(highlight=False, soft_wrap=False, width=width, markup=False, emoji=False)


def table(title: str | None, columns: list[str], rows: list[list[str]]):
    """Print `rows` under `columns` (shown literally: no markup, controls escaped) within the console width.

    Cells wrap between words. When even the longest word of every column cannot fit side by side, each
    row is printed as a block of `column: value` lines instead, wrapped between words, so that no name is
    ever cut in two.
    """
    from rich.table import Table
    from rich.text import Text

    cells = [[safe(cell) for cell in row] for row in rows]
    heads = [safe(column) for column in columns]
    out = console()
    longest = [max([len(word) for row in [heads, *cells] for word in (row[i].split() or [""])]) for i in range(len(heads))]
    if sum(longest) + 3 * len(heads) + 1 > out.width:
        _blocks(out, title, heads, cells)
        return
    t = Table(title=None if title is None else Text(safe(title)), title_justify="left", show_lines=False)
    for head, width in zip(heads, longest):
        t.add_column(Text(head), overflow="fold", min_width=width)
    for row in cells:
        t.add_row(*[Text(cell) for cell in row])
    out.print(t)


def _blocks(out, title: str | None, heads: list[str], cells: list[list[str]]) -> None:
    import textwrap

    width = max(out.width, 20)
    lines = [] if title is None else textwrap.wrap(safe(title), width, break_on_hyphens=False)
    for row in cells:
        lines.append("")
        for head, cell in zip(heads, row):
            lines += textwrap.wrap(f"{head}: {cell}", width, subsequent_indent="    ", break_on_hyphens=False) or [""]
    click.echo("\n".join(lines))


def print_json(value) -> None:
    """One JSON document on stdout, keys sorted, two-space indent (non-ASCII and controls escaped)."""
    click.echo(redact(json.dumps(value, indent=2, sort_keys=True, default=str)))


def echo(text: str = "", *, err: bool = False) -> None:
    """One line of data-derived text, made `safe`."""
    click.echo(safe(text), err=err)


def warn(text: str) -> None:
    """One warning line on stderr."""
    click.echo(f"mla-tune: warning: {' '.join(safe(text).split())}", err=True)


def fail(text: str, *, exit_code: int = 1) -> click.ClickException:
    """A `ClickException` with the given exit status (raise it); `MainGroup` prints it as one safe line."""
    exc = click.ClickException(str(text))
    exc.exit_code = exit_code
    return exc
