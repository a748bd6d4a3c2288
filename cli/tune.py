"""`mla-tune tune` and the no-argument main job: parse, call `tuner.run.tune`, print the decision table."""

from __future__ import annotations

import click

from mla_tune.cli.output import fail, warn
from mla_tune.cli.params import db_option


def _int_list(text: str | None, what: str) -> tuple[int, ...]:
    if text is None:
        return ()
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"expected a comma-separated list of integers, got {text!r}",
                                 param_hint=what) from None
    if not values or any(v <= 0 for v in values):
        raise click.BadParameter(f"expected positive integers, got {text!r}", param_hint=what)
    return values


def _str_list(text: str | None) -> tuple[str, ...]:
    return tuple(x.strip() for x in (text or "").split(",") if x.strip())


def _backend_names(ctx, param, text: str | None) -> frozenset[str]:
    """`--skip-backends`: registry names (any case); an unknown one is a usage error."""
    from mla_tune.backends.registry import BACKENDS

    names = frozenset(name.upper() for name in _str_list(text))
    unknown = sorted(names - set(BACKENDS))
    if unknown:
        raise click.BadParameter(f"unknown backend {unknown[0]!r}; `mla-tune backends` lists them")
    return names


def select_devices(devices, gpus: str | None, *, force: bool):
    """The GPUs to time: `--gpus all|0,2` (default: the first idle one), idle ones unless `force`.

    Raises:
        click.BadParameter: an index that does not exist (exit 2).
        click.ClickException: every selected GPU is busy (exit 1).
    """
    from mla_tune.tuner.probe import device_busy_reasons

    if gpus is None or gpus.strip() == "":
        # Default: the first idle GPU (a serving node may have GPU 0 busy and another free).
        for device in devices:
            if force or not device_busy_reasons(device.index):
                return [device]
        chosen = devices[:1]
    elif gpus.strip().lower() == "all":
        chosen = list(devices)
    else:
        parts = [x.strip() for x in gpus.split(",") if x.strip()]
        wanted = [int(x) for x in parts] if parts and all(x.isdigit() for x in parts) else None
        if wanted is None:
            raise click.BadParameter(f"expected 'all' or GPU indices such as 0,2, got {gpus!r}",
                                     param_hint="'--gpus'")
        indices = sorted({d.index for d in devices})
        missing = [i for i in wanted if i not in indices]
        if missing:
            raise click.BadParameter(f"GPU index {missing[0]} does not exist (this node has GPU(s) "
                                     f"{', '.join(map(str, indices))})", param_hint="'--gpus'")
        chosen = [d for d in devices if d.index in wanted]
    usable = []
    for device in chosen:
        reasons = [] if force else device_busy_reasons(device.index)
        if reasons:
            warn(f"GPU {device.index} ({device.name}) is busy and will not be timed "
                 f"(its numbers would be wrong; --force times it anyway): {'; '.join(reasons)}")
        else:
            usable.append(device)
    if not usable:
        raise fail("no idle GPU to time: every selected GPU is busy (see the warnings above); "
                   "use --force to time anyway")
    return usable


def run_tune(ctx, spec, *, budget_s=None, resume=False, force=False, gpus=None, engine_max_seq_len=None,
             skip_backends=frozenset()) -> None:
    """Validate, probe, tune, print. Bad input exits 2 before anything is stored; no GPU exits 1."""
    from mla_tune.cli.main import db_url
    from mla_tune.store.engine import StoreError
    from mla_tune.store.repository import Store
    from mla_tune.tuner.lock import GpuBusy
    from mla_tune.tuner.plan import BudgetError, check_budget
    from mla_tune.tuner.presets import SHAPE_TIME_CAP_S, SpecError, expand_keys
    from mla_tune.tuner.probe import ProbeError, probe_devices
    from mla_tune.tuner.run import TuneError, TuneOptions, tune
    from mla_tune.tuner.worker import WorkerStartError

    try:
        expand_keys(spec)
        check_budget(budget_s, max_seconds=SHAPE_TIME_CAP_S[spec.level])
    except (SpecError, BudgetError) as exc:
        raise click.UsageError(str(exc)) from None
    url = db_url(ctx)
    try:
        devices = probe_devices()
    except ProbeError as exc:
        raise fail(f"cannot tune: {exc}") from None
    devices = select_devices(devices, gpus, force=force)
    options = TuneOptions(budget_s=budget_s, resume=resume, force=force, engine_max_seq_len=engine_max_seq_len,
                          skip_backends=skip_backends)
    try:
        with Store.open(url) as store:
            def on_plan(plans, estimate):
                shapes = sum(len(p.todo) for p in plans)
                click.echo(f"Tuning {len(plans)} key(s), {shapes} shape(s) on {len(devices)} GPU(s) "
                           f"({', '.join(sorted({d.name for d in devices}))}); estimated {estimate:.0f} s"
                           + (f", budget {budget_s:g} s" if budget_s else ""), err=True)

            report = tune(spec, store=store, devices=devices, options=options, on_plan=on_plan)
            # Every decision of these GPUs made with this software: new ones and those skipped as tuned.
            shown = [d for sku, digest in sorted(report.fingerprints.items())
                     for d in store.decisions(sku=sku) if d.fingerprint.digest == digest]
    except (SpecError, BudgetError) as exc:
        raise click.UsageError(str(exc)) from None
    except (StoreError, GpuBusy, TuneError, WorkerStartError) as exc:
        raise fail(str(exc), exit_code=getattr(exc, "exit_code", 1)) from None
    print_report(report, shown)


def print_report(report, decisions) -> None:
    """The decision table, then where the time went, notes and what is left."""
    from mla_tune.cli.show import print_decisions

    decisions = sorted(decisions, key=lambda d: (d.key.sku, d.key.kv_cache_dtype, d.key.topk, d.key.q_len,
                                                 -d.key.num_heads))
    if decisions:
        print_decisions("Decisions (key, winner, margin over the runner-up, vLLM's static choice, anomalies)",
                        decisions)
    for d in report.decisions:
        for backend, why in sorted(d.failures.items()):
            if not why.startswith("ineligible"):
                click.echo(f"{d.key.label}: {backend} cannot win: {why}")
    click.echo(f"Measured {report.units_done} of {report.units_planned} shape(s) in {report.elapsed_s:.1f} s "
               f"(estimated {report.estimate_s:.0f} s); {len(report.already_tuned)} key(s) already tuned "
               f"with this software were skipped.")
    if report.seconds:
        parts = ", ".join(f"{name} {secs:.1f} s" for name, secs in report.seconds.items())
        click.echo(f"Time went to: {parts}.")
    for uuid, peak in sorted(report.peak_memory_bytes.items()):
        click.echo(f"Peak GPU memory of the worker on {uuid}: {peak / 2**30:.2f} GiB.")
    for note in report.notes:
        click.echo(f"Note: {note}")
    for key, why in report.undecided.items():
        click.echo(f"Not decided: {key.label}: {why}")
    if report.budget_exhausted:
        click.echo("The budget ran out before every shape was measured; `mla-tune tune --resume` continues.")


def _spec(model, tp, heads, kv_cache_dtype, quick, thorough, workload, mtp):
    from mla_tune.tuner.presets import (DEFAULT_KV_CACHE_DTYPES, DEFAULT_MODELS, DEFAULT_TPS, SpecError, TuneSpec,
                                        load_workload)

    if quick and thorough:
        raise click.UsageError("--quick and --thorough are mutually exclusive")
    try:
        profile = load_workload(workload) if workload else None
    except SpecError as exc:
        raise click.UsageError(str(exc)) from None
    models = _str_list(model) or DEFAULT_MODELS
    kvs = _str_list(kv_cache_dtype) or DEFAULT_KV_CACHE_DTYPES
    if kv_cache_dtype is not None and not _str_list(kv_cache_dtype):
        raise click.BadParameter("empty list", param_hint="'--kv-cache-dtype'")
    return TuneSpec(models=models, tps=_int_list(tp, "'--tp'") or DEFAULT_TPS,
                    heads=_int_list(heads, "'--heads'"), kv_cache_dtypes=kvs,
                    level="quick" if quick else "thorough" if thorough else "default",
                    workload=profile, mtp=mtp)


@click.command()
@click.option("--model", metavar="PRESET[,PRESET]",
              help="Model preset(s): deepseek-v3, deepseek-r1, deepseek-v3.2, kimi-k2, deepseek-v2-lite, "
                   "glm-5, or custom:RANK/ROPE/NOPE/V[:topk=N][:heads=N]. Default deepseek-v3,deepseek-v3.2.")
@click.option("--tp", metavar="LIST", help="Tensor-parallel sizes to sweep (heads per rank = heads / TP). "
                                            "Default 1,2,4,8.")
@click.option("--heads", metavar="LIST", help="Heads per rank to tune instead of the TP sweep, e.g. 16,64.")
@click.option("--kv-cache-dtype", metavar="LIST", help="KV-cache dtypes, e.g. bf16,fp8. Default bf16,fp8.")
@click.option("--quick", is_flag=True, help="A small grid (6 shapes per key), short timing.")
@click.option("--thorough", is_flag=True, help="The full grid (56 shapes per key), longer timing.")
@click.option("--budget-s", type=float, default=None, metavar="S",
              help="Bound the whole run to S seconds; the most valuable keys come first.")
@click.option("--resume", is_flag=True, help="Reuse shapes already measured by an interrupted run.")
@click.option("--force", is_flag=True, help="Re-tune keys already tuned with this software; time busy GPUs.")
@click.option("--gpus", metavar="all|0,2", default=None,
              help="GPUs to tune in parallel, one worker each (default: the first idle GPU).")
@click.option("--workload", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Workload profile (JSON or TOML): batch_size and kv_len weights, or explicit shapes.")
@click.option("--mtp", is_flag=True, help="Also tune q_len 2 (multi-token prediction).")
@click.option("--engine-max-seq-len", type=click.IntRange(min=1), default=None, metavar="TOKENS",
              help="vLLM's max_seq_len our kernel is timed with as vLLM launches it (e.g. your --max-model-len, "
                   "which vLLM's full CUDA graphs are captured with). Default: the longest kv_len tuned.")
@click.option("--skip-backends", metavar="LIST", callback=_backend_names,
              help="Backends not to time, e.g. MLA_TUNE_TRITON_FP8Q (it rounds the query to e4m3). "
                   "Keys already tuned keep their decisions unless --force.")
@db_option
@click.pass_context
def tune(ctx, model, tp, heads, kv_cache_dtype, quick, thorough, budget_s, resume, force, gpus, workload, mtp,
         engine_max_seq_len, skip_backends):
    """Time every eligible MLA backend on this GPU and store the decisions.

    Probes the GPU(s), checks each backend against the float32 reference,
    times the correct ones on representative batch x context shapes in
    crash-isolated workers, and stores measurements as they finish and a
    decision per key (heads per rank x KV dtype). Keys already tuned with
    this software are skipped unless --force.

    Example: mla-tune tune --model deepseek-v3 --tp 2,8 --kv-cache-dtype fp8 --quick
    """
    spec = _spec(model, tp, heads, kv_cache_dtype, quick, thorough, workload, mtp)
    run_tune(ctx, spec, budget_s=budget_s, resume=resume, force=force, gpus=gpus,
             engine_max_seq_len=engine_max_seq_len, skip_backends=skip_backends)


def main_job(ctx) -> None:
    """`mla-tune` with no command: the default preset for every key not yet tuned, then the table."""
    from mla_tune.tuner.presets import TuneSpec

    run_tune(ctx, TuneSpec(), resume=True)
