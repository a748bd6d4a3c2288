"""`mla-tune show`: the stored decision table."""

from __future__ import annotations

import dataclasses

import click

from mla_tune.cli.output import fail, print_json, table


def decision_rows(decisions) -> list[list[str]]:
    """Table rows (GPU SKU, key, winner, margin, static choice, anomalies) for `decisions`."""
    rows = []
    for d in decisions:
        margin = f"{100 * d.margin:.1f}% over {d.runner_up}" if d.margin is not None and d.runner_up else "-"
        static = d.static_choice or "-"
        if d.kept_static:
            static += " (kept: within noise)"
        rows.append([d.key.sku, d.key.label, d.winner, margin, static,
                     "; ".join(d.anomalies) or "-", d.decided_at or "-"])
    return rows


DECISION_COLUMNS = ["GPU SKU", "key", "winner", "margin", "vLLM static choice", "anomalies", "decided at"]


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--fleet", is_flag=True, help="Per SKU and key: nodes and GPUs behind each decision, their spread, "
              "and GPUs markedly slower than their SKU's median.")
@click.pass_context
def show(ctx, as_json: bool, fleet: bool) -> None:
    """Print every stored decision: key, winner, margin over the runner-up, vLLM's static choice, anomalies.

    Exits with status 1 and one line when the store cannot be opened.

    Example: mla-tune --db sqlite:///decisions.db show --json
    """
    from mla_tune.cli.main import db_url
    from mla_tune.store.engine import StoreError
    from mla_tune.store.repository import Store

    try:
        with Store.open(db_url(ctx), create=False) as store:
            if fleet:
                from mla_tune.cli.fleet import show_fleet

                return show_fleet(store, as_json=as_json)
            decisions = store.decisions()
            where = store.where
    except StoreError as exc:
        raise fail(str(exc)) from None
    decisions.sort(key=lambda d: (d.key.sku, d.key.kv_cache_dtype, d.key.topk, -d.key.num_heads, d.key.page_size))
    if as_json:
        print_json([dataclasses.asdict(d) for d in decisions])
        return
    if not decisions:
        click.echo(f"no decisions stored in {where} yet; run `mla-tune` on a GPU node to tune")
        return
    table(f"Decisions in {where}", DECISION_COLUMNS, decision_rows(decisions))
