"""The tune: plan -> measure every (key, shape) in crash-isolated workers -> decide -> store.

One worker subprocess per GPU (`worker.py`), each fed by its own thread from
a shared list of units (`plan.py`). Measurements are stored the moment a
shape finishes, so a killed tune loses at most the shapes in flight and
`--resume` continues from the store. A key is decided as soon as its last
shape is in; anomalies across head counts are computed once all keys are
decided. Identical GPUs (one SKU) share one decision built from all their
measurements; a GPU markedly slower than its siblings on the shapes all of
them measured is reported.
"""

from __future__ import annotations

import socket
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from mla_tune.backends.device import DeviceInfo, SoftwareFingerprint
from mla_tune.store.records import Decision, DecisionKey, Measurement
from mla_tune.tuner.decide import family, with_anomalies
from mla_tune.tuner.lock import GpuLock
from mla_tune.tuner.plan import KeyPlan, check_budget, done_shapes, estimate_s
from mla_tune.tuner.presets import SHAPE_TIME_CAP_S, TuneSpec, expand_keys
from mla_tune.tuner.prewarm import JIT_PREFIXES, prewarm
from mla_tune.tuner.progress import TuneProgress
from mla_tune.tuner.sku_tune import SkuTune


# GPU memory a pre-build worker may hold (CUDA context, library workspaces, batch-1 inputs): bounds the workers
# on a small GPU or MIG instance.
PREWARM_WORKER_MIB = 2048


class TuneError(RuntimeError):
    """The tune cannot start (GPU busy or locked, no backend can run): exit status 1."""


@dataclass(frozen=True)
class TuneOptions:
    """How to run a tune (the spec says what to tune).

    Attributes:
        budget_s: wall-clock bound of the whole run; None = no bound.
        resume: reuse stored outcomes of unfinished keys (same SKU and fingerprint).
        force: re-tune keys already decided with this software.
        seed: input seed (the same inputs for every backend at a shape).
        rel_ci_target: stop timing a shape when the CI half-width is this fraction of the median.
        max_seconds: timing cap per shape; None = the grid level's default.
        worker_device: `cuda`, or `cpu` for tests.
        adapters: backend name -> "module:Class"; replaces the registry's candidates (tests).
        bench: "module:function" replacing `timing.time_interleaved` (tests).
        static_choice: name of vLLM's choice for every key; None = `priority.static_choice`.
        fingerprint: the software fingerprint; None = `software.current_fingerprint`.
        timeouts_s: per-phase worker timeouts.
        progress: show rich progress bars on stderr.
        node: host name stored with runs and decisions.
        prewarm: build what the units would build (JIT libraries of backends whose names start with
            `jit_prefixes`, our and vLLM's Triton kernels) in parallel workers before timing (`prewarm.py`).
        engine_max_seq_len: vLLM's max_seq_len for timing our kernel as our vLLM backend launches it (dense;
            vLLM captures its full CUDA graphs with the longest length it serves); None = the longest kv_len
            the tune times for the key.
        skip_backends: backend names the operator left out (`--skip-backends`): not timed, listed as ineligible.
    """

    budget_s: float | None = None
    resume: bool = False
    force: bool = False
    seed: int = 0
    rel_ci_target: float = 0.01
    max_seconds: float | None = None
    worker_device: str = "cuda"
    adapters: Mapping[str, str] | None = None
    bench: str | None = None
    static_choice: str | None = None
    fingerprint: SoftwareFingerprint | None = None
    timeouts_s: Mapping[str, float] | None = None
    progress: bool = True
    node: str = field(default_factory=socket.gethostname)
    prewarm: bool = True
    jit_prefixes: tuple[str, ...] = JIT_PREFIXES
    engine_max_seq_len: int | None = None
    skip_backends: frozenset[str] = frozenset()


@dataclass
class TuneReport:
    """What a tune did, for the table and the operator."""

    decisions: list[Decision] = field(default_factory=list)
    already_tuned: list[DecisionKey] = field(default_factory=list)
    undecided: dict[DecisionKey, str] = field(default_factory=dict)
    budget_exhausted: bool = False
    units_done: int = 0
    units_planned: int = 0
    estimate_s: float = 0.0
    elapsed_s: float = 0.0
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # prepare/inputs/timing
    peak_memory_bytes: dict[str, int] = field(default_factory=dict)                # gpu uuid -> bytes
    notes: list[str] = field(default_factory=list)                                  # slow GPUs, skips, restarts
    fingerprints: dict[str, str] = field(default_factory=dict)                      # SKU -> software digest used


def _candidates(work, device: DeviceInfo, options: TuneOptions) -> tuple[tuple[str, ...], dict[str, str], str | None]:
    """(backends to time, {ineligible backend: reasons}, vLLM's static choice) for one key on one SKU."""
    from mla_tune.backends.priority import static_choice
    from mla_tune.backends.registry import candidates, runnable_reasons

    runnable, ineligible = [], {}
    for name in candidates() if options.adapters is None else options.adapters:
        if name in options.skip_backends:
            ineligible[name] = "left out by the operator (--skip-backends)"
            continue
        reasons = [] if options.adapters is not None else runnable_reasons(name, work.problem, device.spec)
        if reasons:
            ineligible[name] = "; ".join(reasons)
        else:
            runnable.append(name)
    if options.adapters is not None:
        return tuple(runnable), ineligible, options.static_choice
    static = options.static_choice
    if static is None:
        static = static_choice(work.problem, device.spec).backend
    return tuple(runnable), ineligible, static


def _stale_runs(store, devices: Sequence[DeviceInfo]) -> None:
    """Runs left `running` on our GPUs by a killed tune: we hold the GPU locks, so they are dead."""
    uuids = {d.uuid for d in devices}
    for run in store.runs(status="running"):
        if run.gpu_uuid in uuids:
            store.finish_run(run.id, "interrupted")


def _reused(store, key: DecisionKey, sku: str, digest: str) -> list[Measurement]:
    out = []
    for run in store.runs(sku=sku):
        if run.fingerprint_digest == digest:
            out.extend(store.measurements(key=key, run_id=run.id))
    return out


def build_plans(spec: TuneSpec, store, device: DeviceInfo, fingerprint: SoftwareFingerprint,
                options: TuneOptions, report: TuneReport) -> list[KeyPlan]:
    """The keys to measure on `device`'s SKU, in value order, with what `--resume` reuses."""
    tuned = set() if options.force else store.tuned_keys(device.sku, fingerprint.digest)
    plans = []
    for work in expand_keys(spec):
        key = DecisionKey.of(device.sku, device.compute_capability, work.problem)
        if key in tuned:
            report.already_tuned.append(key)
            continue
        backends, ineligible, static = _candidates(work, device, options)
        if not backends:
            report.undecided[key] = "no backend can run it here: " + "; ".join(
                f"{b}: {r}" for b, r in sorted(ineligible.items()))
            continue
        plan = KeyPlan(key, work, backends, ineligible, static)
        if options.resume:
            plan.reused = [m for m in _reused(store, key, device.sku, fingerprint.digest)
                           if m.backend in backends]
        done = done_shapes(plan.reused, backends)
        plan.reused = [m for m in plan.reused if (m.batch_size, m.kv_len) in done]
        plan.todo = tuple(s for s in work.shapes if (s.batch_size, s.kv_len) not in done)
        plans.append(plan)
    return plans


def tune(spec: TuneSpec, *, store, devices: Sequence[DeviceInfo], options: TuneOptions = TuneOptions(),
         on_plan: Callable[[list[KeyPlan], float], None] | None = None) -> TuneReport:
    """Tune `spec` on `devices` and store measurements and decisions.

    Args:
        spec: what to tune (models, TP, KV dtypes, grid level, workload).
        store: an open `Store`.
        devices: the GPUs to time on (already checked idle); identical ones share decisions.
        options: how (budget, resume, force, injection points for tests).
        on_plan: called with (plans of every SKU, estimated seconds) before measuring.

    Raises:
        SpecError, BudgetError: bad input; raised before anything is stored.
        GpuBusy: another mla-tune process holds one of the GPUs.
    """
    started = time.monotonic()
    max_seconds = options.max_seconds if options.max_seconds is not None else SHAPE_TIME_CAP_S[spec.level]
    expand_keys(spec)                          # SpecError before anything is touched
    check_budget(options.budget_s, max_seconds=max_seconds)
    report = TuneReport()
    locks = [GpuLock(d.uuid or f"index{d.index}") for d in devices]
    held = []
    try:
        for lock in locks:
            lock.acquire()
            held.append(lock)
        _stale_runs(store, devices)
        work = _plan_skus(spec, store, devices, options, report)
        all_plans = [p for _, plans, _ in work for p in plans]
        report.estimate_s = sum(estimate_s(plans, max_seconds=max_seconds, n_gpus=len(group),
                                           jit_prefixes=options.jit_prefixes if options.prewarm else ())
                                for group, plans, _ in work)
        if on_plan is not None:
            on_plan(all_plans, report.estimate_s)
        _prewarm_jit(work, options, report)
        deadline = started + options.budget_s if options.budget_s is not None else None
        with TuneProgress(enabled=options.progress) as progress:
            for group, plans, fp in work:
                if not plans:
                    continue
                sku_tune = SkuTune(store, group, plans, fingerprint=fp, options=options,
                                   max_seconds=max_seconds, report=report, progress=progress,
                                   deadline=deadline, preset=spec.preset_label)
                report.units_planned += len(sku_tune.units)
                progress.add_plans(plans, sku_tune.units)
                sku_tune.run()
                _refresh_anomalies(store, report, group[0].sku, fp, node=options.node)
    finally:
        for lock in held:
            lock.release()
    report.elapsed_s = time.monotonic() - started
    return report


def _plan_skus(spec: TuneSpec, store, devices: Sequence[DeviceInfo], options: TuneOptions,
               report: TuneReport) -> list[tuple[list[DeviceInfo], list[KeyPlan], SoftwareFingerprint]]:
    """(GPUs, plans, software fingerprint) per SKU: identical GPUs share one plan and one decision per key."""
    from mla_tune.backends.software import current_fingerprint

    by_sku: dict[str, list[DeviceInfo]] = defaultdict(list)
    for device in devices:
        by_sku[device.sku].append(device)
    work = []
    for sku, group in by_sku.items():
        fp = options.fingerprint or current_fingerprint(driver_version=group[0].driver_version)
        report.fingerprints[sku] = fp.digest
        work.append((group, build_plans(spec, store, group[0], fp, options, report), fp))
    return work


def _prewarm_jit(work: list[tuple[list[DeviceInfo], list[KeyPlan], SoftwareFingerprint]], options: TuneOptions,
                 report: TuneReport) -> None:
    """Build the kernels each SKU's plans need (JIT libraries, Triton kernels), in parallel on its first GPU,
    before any timing (`prewarm.py`)."""
    if not options.prewarm:
        return
    for group, plans, fp in work:
        first = group[0]
        gpu, mib = first.uuid or str(first.index), first.memory_total_mib
        started = time.monotonic()
        try:
            result = prewarm(plans, gpu=gpu, sku=first.sku, fingerprint=fp.digest,
                             worker_device=options.worker_device, cuda_visible=gpu, bench=options.bench,
                             timeouts_s=dict(options.timeouts_s or {}),
                             adapters=tuple((options.adapters or {}).items()), prefixes=options.jit_prefixes,
                             seed=options.seed, engine_max_seq_len=options.engine_max_seq_len,
                             max_workers=max(1, mib // PREWARM_WORKER_MIB) if mib else None)
        except Exception as exc:  # noqa: BLE001 - the pre-build is an optimisation; the units build and record
            report.seconds["JIT pre-build (failed)"] += time.monotonic() - started
            report.notes.append(f"JIT pre-build failed, the units build as they go: {type(exc).__name__}: {exc}")
            continue
        if result is not None:
            report.seconds[result.label] += result.seconds
            report.notes.extend(result.notes)


def _refresh_anomalies(store, report: TuneReport, sku: str, fp: SoftwareFingerprint, *, node: str) -> None:
    """Recompute anomalies over every decision of this SKU and fingerprint; store the changed ones."""
    new_keys = {d.key for d in report.decisions}
    stored = [d for d in store.decisions(sku=sku) if d.fingerprint.digest == fp.digest]
    families = {family(k) for k in new_keys}
    group = [d for d in stored if family(d.key) in families]
    updated = {d.key: d for d in with_anomalies(group)}
    before = {d.key: d for d in group}
    for key, d in updated.items():
        if d.anomalies != before[key].anomalies:
            store.save_decision(d, node=node)
    report.decisions = [updated.get(d.key, d) for d in report.decisions]
