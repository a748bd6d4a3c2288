"""`mla-tune show`: the stored decision table."""

from __future__ import annotations

import dataclasses

import click

from mla_tune.cli.output import echo, fail, print_json, table
from mla_tune.cli.params import db_option


def current_software():
    """This process's software fingerprint, with the driver when NVML can be read."""
    from mla_tune.backends.software import current_fingerprint
    from mla_tune.tuner.probe import ProbeError, probe_devices

    try:
        devices = probe_devices()
    except ProbeError:
        devices = []
    return current_fingerprint(driver_version=devices[0].driver_version if devices else "")


def staleness(decisions, current) -> list[list[str]]:
    """For each decision, why it is stale for `current` software (empty = current)."""
    from mla_tune.backends.software import compatibility_problems

    return [compatibility_problems(d.fingerprint, current) for d in decisions]


def decision_rows(decisions, current=None) -> list[list[str]]:
    """Table rows (GPU SKU, key, winner, margin, static choice, what vLLM gets, anomalies, software, when).

    `current` is the software to judge staleness against (default: this process's).
    """
    from mla_tune.backends.engine_names import vllm_regret

    stale = staleness(decisions, current if current is not None else current_software())
    rows = []
    for d, problems in zip(decisions, stale):
        margin = f"{100 * d.margin:.1f}% over {d.runner_up}" if d.margin is not None and d.runner_up else "-"
        static = d.static_choice or "-"
        if d.kept_static:
            static += " (kept: within noise)"
        software = f"STALE: {'; '.join(problems)}" if problems else "current"
        rows.append([d.key.sku, d.key.label, d.winner, margin, static, vllm_regret(d),
                     "; ".join(d.anomalies) or "-", software, _minute(d.decided_at)])
    return rows


DECISION_COLUMNS = ["GPU SKU", "key", "winner", "margin", "vLLM static choice", "vLLM gets", "anomalies",
                    "software", "decided at"]


def _minute(stamp: str | None) -> str:
    """An ISO time as "YYYY-MM-DD HH:MM" (UTC when it says so); unparseable text as it is."""
    from datetime import datetime, timezone

    if not stamp:
        return "-"
    try:
        when = datetime.fromisoformat(stamp)
    except ValueError:
        return stamp
    return when.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M UTC") if when.tzinfo else \
        when.strftime("%Y-%m-%d %H:%M")


def print_decisions(title: str, decisions, current=None) -> None:
    """The decision table; decisions of a single GPU SKU name it in the title instead of in every row,
    which leaves the other columns room to keep names whole."""
    rows = decision_rows(decisions, current)
    skus = {row[0] for row in rows}
    if len(skus) == 1:
        table(f"{title} on {skus.pop()}", DECISION_COLUMNS[1:], [row[1:] for row in rows])
    else:
        table(title, DECISION_COLUMNS, rows)


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--fleet", is_flag=True, help="Per SKU and key: nodes and GPUs behind each decision, their spread, "
              "and GPUs markedly slower than their SKU's median.")
@db_option
@click.pass_context
def show(ctx, as_json: bool, fleet: bool) -> None:
    """Print every stored decision: key, winner, margin over the runner-up, vLLM's static choice, anomalies.

    Decisions measured with other software than this process has (torch, triton,
    flashinfer, our kernel sources, the driver) are marked STALE: `lookup`
    ignores them and `mla-tune` re-tunes them.

    Reads only: nothing is created, migrated or written. Exits with status 1 and one
    line when the store cannot be opened or holds a corrupt row (docs/errors.md).

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
        raise fail(str(exc), exit_code=exc.exit_code) from None
    decisions.sort(key=lambda d: (d.key.sku, d.key.kv_cache_dtype, d.key.topk, -d.key.num_heads, d.key.page_size))
    current = current_software()
    if as_json:
        print_json([{**dataclasses.asdict(d), "stale": problems}
                    for d, problems in zip(decisions, staleness(decisions, current))])
        return
    if not decisions:
        echo(f"no decisions stored in {where} yet; run `mla-tune` on a GPU node to tune")
        return
    print_decisions(f"Decisions in {where}", decisions, current)
