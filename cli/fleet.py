"""`mla-tune export`, `mla-tune import`, `mla-tune report`, and the fleet view of `mla-tune show --fleet`."""

from __future__ import annotations

import dataclasses

import click

from mla_tune.cli.output import echo, fail, print_json, table
from mla_tune.cli.params import db_option


def _open(ctx, *, create: bool):
    from mla_tune.cli.main import db_url
    from mla_tune.store.repository import Store

    return Store.open(db_url(ctx), create=create)


def _missing_sqlite_file(ctx) -> bool:
    import os

    from mla_tune.cli.main import db_url
    from mla_tune.store.sqlite_file import sqlite_path

    path = sqlite_path(db_url(ctx))
    return path is not None and not os.path.exists(path)


@click.command("export")
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False, writable=True),
              metavar="FILE", help="Where to write the export (JSON, schema in docs/export-schema.md).")
@click.option("--node", default=None, metavar="NAME", help="Producer node recorded in the file (default: host name).")
@db_option
@click.pass_context
def export_cmd(ctx, out_path: str, node: str | None) -> None:
    """Write every decision and its evidence to FILE as versioned, checksummed JSON.

    Two exports of the same data are byte-identical, so they can be diffed and reviewed. The export is
    one snapshot of the store, read without writing it. FILE is replaced atomically (written, synced,
    then renamed); a symbolic link is written through to its target, and a device or pipe such as
    /dev/stdout is written directly.

    Example: mla-tune export --out h200-node17.json
    """
    from mla_tune.store.engine import StoreError
    from mla_tune.store.exchange import write_export

    try:
        with _open(ctx, create=False) as store:
            summary = write_export(store, out_path, node=node)
    except StoreError as exc:
        raise fail(str(exc), exit_code=exc.exit_code) from None
    except OSError as exc:
        raise fail(f"cannot write {out_path}: {exc.strerror or exc}") from None
    echo(f"wrote {summary['path']}: {summary['decisions']} decision(s), {summary['measurements']} "
               f"measurement(s), {summary['runs']} run(s), {summary['devices']} GPU(s); {summary['checksum']}")


@click.command("import")
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--check", is_flag=True, help="Validate and report what would change; write nothing.")
@click.option("--max-bytes", type=click.IntRange(min=1), default=None, metavar="N",
              help="Refuse files larger than N bytes (default 256 MiB).")
@db_option
@click.pass_context
def import_cmd(ctx, files: tuple[str, ...], check: bool, max_bytes: int | None) -> None:
    """Import export FILEs: validated strictly, applied all or nothing, idempotent.

    Decisions of a key measured on several nodes are rebuilt from all their
    measurements (median across GPUs), and nodes whose times disagree beyond the
    noise margin are reported. A rejected file exits with status 2 and changes nothing; --check reads
    the store without writing it. Two imports of the same file at once store it once.

    Example: mla-tune --db postgresql+psycopg://mla@db/mla import node*.json --check
    """
    from mla_tune.store.engine import StoreError
    from mla_tune.store.exchange import MAX_IMPORT_BYTES, ExchangeError, read_export
    from mla_tune.store.importer import import_documents
    from mla_tune.tuner.decide import decide

    try:  # every file is validated before the store is even opened
        documents = [read_export(path, max_bytes=max_bytes or MAX_IMPORT_BYTES) for path in files]
    except ExchangeError as exc:
        raise fail(str(exc), exit_code=2) from None
    if check and _missing_sqlite_file(ctx):
        # Nothing stored yet: everything would be added. Compare with an empty store of our own
        # rather than create the user's database for a check.
        import tempfile

        from mla_tune.store.repository import Store

        click.echo("mla-tune: the database does not exist yet; comparing with an empty one", err=True)
        with tempfile.TemporaryDirectory() as scratch, Store.open(f"sqlite:///{scratch}/empty.db") as store:
            report = import_documents(store, documents, files=list(files), check=True, decide=decide)
    else:
        try:
            with _open(ctx, create=not check) as store:
                report = import_documents(store, documents, files=list(files), check=check, decide=decide)
        except StoreError as exc:
            raise fail(str(exc), exit_code=exc.exit_code) from None
    for line in report.lines():
        echo(line)


@click.command("report")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), metavar="DIR",
              help="Directory for index.md and the PNG plots (created if missing).")
@db_option
@click.pass_context
def report_cmd(ctx, out_dir: str) -> None:
    """Write a Markdown report with PNG plots of every decision and its evidence into DIR.

    Example: mla-tune report --out report/ && xdg-open report/index.md
    """
    from mla_tune.store.engine import StoreError
    from mla_tune.tuner.report import write_report

    try:
        with _open(ctx, create=False) as store:
            decisions, measurements = store.decisions(), store.measurements()
    except StoreError as exc:
        raise fail(str(exc), exit_code=exc.exit_code) from None
    try:
        path = write_report(decisions, measurements, out_dir)
    except ImportError as exc:
        raise fail(f"reports need matplotlib (pip install 'mla-tune[report]'): {exc}") from None
    except OSError as exc:
        raise fail(f"cannot write the report into {out_dir}: {exc.strerror or exc}") from None
    echo(f"wrote {path} ({len(decisions)} decision(s))")


FLEET_COLUMNS = ["GPU SKU", "key", "winner", "margin", "nodes", "GPUs", "spread of the winner"]


def show_fleet(store, *, as_json: bool) -> None:
    """Print the fleet view of `store` (what `mla-tune show --fleet` prints)."""
    from mla_tune.store.fleet import fleet_view

    view = fleet_view(store)
    if as_json:
        print_json({"decisions": [dataclasses.asdict(r) for r in view.rows],
                    "outliers": [dataclasses.asdict(o) for o in view.outliers]})
        return
    if not view.rows:
        echo(f"no decisions stored in {store.where} yet")
    else:
        rows = []
        for r in view.rows:
            margin = f"{100 * r.margin:.1f}%" if r.margin is not None else "-"
            spread = "-" if r.spread is None else (
                f"{100 * r.spread:.1f}% (batch {r.spread_shape[0]}, kv_len {r.spread_shape[1]})")
            rows.append([r.sku, r.key_label, r.winner, margin, str(len(r.nodes)), str(len(r.gpus)), spread])
        table(f"Fleet decisions in {store.where}", FLEET_COLUMNS, rows)
    if view.outliers:
        table("GPUs markedly slower than their SKU's median GPU", ["GPU SKU", "GPU", "nodes", "slower by", "points"],
              [[o.sku, o.gpu_uuid, ", ".join(o.nodes) or "-", f"{100 * o.slower:.1f}%", str(o.compared)]
               for o in view.outliers])
    elif view.rows:
        click.echo("no outlier GPUs (none more than 10% slower than its SKU's median, where 3 or more GPUs measured)")
