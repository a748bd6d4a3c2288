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

import math
import socket
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from mla_tune.backends.device import DeviceInfo, SoftwareFingerprint
from mla_tune.store.records import Decision, DecisionKey, Measurement
from mla_tune.tuner.decide import NoDecision, decide, family, with_anomalies
from mla_tune.tuner.lock import GpuLock
from mla_tune.tuner.measure import Outcome, ShapeTask
from mla_tune.tuner.plan import (KeyPlan, Unit, check_budget, done_shapes, estimate_s, plan_units,
                                 unit_estimate_s)
from mla_tune.tuner.presets import SHAPE_TIME_CAP_S, TuneSpec, expand_keys
from mla_tune.tuner.prewarm import JIT_PREFIXES, jit_tasks, prewarm
from mla_tune.tuner.progress import TuneProgress
from mla_tune.tuner.worker import Worker

# A GPU whose times on the common shapes are this much above its siblings' median is reported.
SLOW_GPU_RATIO = 1.10


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
        prewarm: compile JIT backends (names starting with `jit_prefixes`) in parallel
            workers before timing (`prewarm.py`).
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


def _now_iso() -> str:
    from datetime import UTC, datetime

    return datetime.now(UTC).isoformat(timespec="milliseconds")


def _candidates(work, device: DeviceInfo, options: TuneOptions) -> tuple[tuple[str, ...], dict[str, str], str | None]:
    """(backends to time, {ineligible backend: reasons}, vLLM's static choice) for one key on one SKU."""
    if options.adapters is not None:
        return tuple(options.adapters), {}, options.static_choice
    from mla_tune.backends.priority import static_choice
    from mla_tune.backends.registry import candidates, runnable_reasons

    runnable, ineligible = [], {}
    for name in candidates():
        reasons = runnable_reasons(name, work.problem, device.spec)
        if reasons:
            ineligible[name] = "; ".join(reasons)
        else:
            runnable.append(name)
    static = options.static_choice
    if static is None:
        static = static_choice(work.problem, device.spec).backend
    return tuple(runnable), ineligible, static


def _measurement(key: DecisionKey, backend: str, unit: Unit, outcome: Outcome, gpu_uuid: str) -> Measurement:
    clocks = outcome.clocks or {}
    return Measurement(key=key, backend=backend, batch_size=unit.shape.batch_size, kv_len=unit.shape.kv_len,
                       status=outcome.status, median_ms=outcome.median_ms, ci_low_ms=outcome.ci_low_ms,
                       ci_high_ms=outcome.ci_high_ms, samples=outcome.samples, rel_error=outcome.rel_error,
                       reason=outcome.reason, gpu_uuid=gpu_uuid,
                       sm_clock_mhz_before=clocks.get("sm_clock_mhz_before"),
                       sm_clock_mhz_after=clocks.get("sm_clock_mhz_after"),
                       temperature_c_before=clocks.get("temperature_c_before"),
                       temperature_c_after=clocks.get("temperature_c_after"),
                       measured_at=_now_iso(), params=outcome.params)


class _SkuTune:
    """The tune of one SKU: its GPUs, plans, shared units, and the decisions they produce."""

    def __init__(self, store, devices: Sequence[DeviceInfo], plans: list[KeyPlan], *,
                 fingerprint: SoftwareFingerprint, options: TuneOptions, max_seconds: float,
                 report: TuneReport, progress: TuneProgress, deadline: float | None, preset: str):
        self.store, self.devices, self.plans = store, list(devices), plans
        self.fingerprint, self.options, self.max_seconds = fingerprint, options, max_seconds
        self.report, self.progress, self.deadline, self.preset = report, progress, deadline, preset
        self.lock = threading.Lock()
        self.units = plan_units(plans, [d.uuid for d in self.devices])
        self.remaining = defaultdict(int)
        for u in self.units:
            self.remaining[u.key_index] += 1
        self.new: dict[int, list[Measurement]] = defaultdict(list)
        self.unit_seconds: list[float] = []
        self.errors: list[BaseException] = []
        self.run_ids: dict[str, int] = {}
        self.stopped = False
        self.aborted = False           # the main thread was interrupted: drop shapes in flight
        self._first_shape_done: set[int] = set()

    def _next_unit(self, gpu: str) -> Unit | None:
        with self.lock:
            if self.stopped:
                return None
            for i, unit in enumerate(self.units):
                if unit.gpu not in (None, gpu):
                    continue
                if self.deadline is not None:
                    plan = self.plans[unit.key_index]
                    guess = (statistics.median(self.unit_seconds) if self.unit_seconds
                             else unit_estimate_s(len(plan.backends), self.max_seconds))
                    if time.monotonic() + guess > self.deadline:
                        self.report.budget_exhausted = True
                        self.stopped = True
                        return None
                return self.units.pop(i)
            return None

    def _gpu_loop(self, device: DeviceInfo) -> None:
        opts = self.options
        # The worker sees only its GPU; by UUID, so a parent CUDA_VISIBLE_DEVICES cannot renumber it.
        cuda_visible = device.uuid or str(device.index)
        worker = Worker(cuda_visible=cuda_visible, device=opts.worker_device,
                        gpu=(device.uuid or str(device.index)) if opts.worker_device == "cuda" else None,
                        bench=opts.bench, timeouts_s=dict(opts.timeouts_s or {}))
        try:
            while True:
                unit = self._next_unit(device.uuid)
                if unit is None:
                    return
                self._measure(worker, device, unit)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the main thread
            with self.lock:
                self.errors.append(exc)
                self.stopped = True
        finally:
            worker.close()

    def _measure(self, worker: Worker, device: DeviceInfo, unit: Unit) -> None:
        plan = self.plans[unit.key_index]
        task = ShapeTask(plan.work.problem, unit.shape, plan.backends, self.options.seed,
                         self.options.rel_ci_target, self.max_seconds,
                         tuple((self.options.adapters or {}).items()))
        started = time.monotonic()
        self.progress.unit_started(plan.key, unit.shape, device)
        result = worker.run_shape(task, on_event=lambda ev: self.progress.event(device, ev))
        if self.aborted:
            return  # interrupted: the workers were stopped under this shape; record nothing
        rows = []
        if result.skipped_reason is not None:
            rows = [_measurement(plan.key, name, unit, Outcome("skipped", reason=result.skipped_reason),
                                 device.uuid) for name in plan.backends]
            with self.lock:
                self.report.notes.append(f"{plan.key.label}: batch {unit.shape.batch_size} x kv_len "
                                         f"{unit.shape.kv_len} skipped on GPU {device.index}: {result.skipped_reason}")
        else:
            rows = [_measurement(plan.key, name, unit, outcome, device.uuid)
                    for name, outcome in result.outcomes.items()]
        with self.lock:
            first = unit.key_index not in self._first_shape_done
            self._first_shape_done.add(unit.key_index)
        if first:
            # Ineligible backends are stored once per key, at its first measured shape, with their reasons.
            rows += [_measurement(plan.key, name, unit, Outcome("ineligible", reason=why), device.uuid)
                     for name, why in plan.ineligible.items()]
        for row in rows:
            self.store.add_measurement(self.run_ids[device.uuid], row)
        elapsed = time.monotonic() - started
        info = result.info
        with self.lock:
            self.new[unit.key_index].extend(rows)
            prep = sum((info.get("prepare_s") or {}).values())
            parts = {"worker start (torch import, CUDA init)": info.get("worker_start_s", 0.0),
                     "prepare (JIT, plan, first run)": prep,
                     "inputs and float32 reference": info.get("inputs_and_reference_s", 0.0),
                     "graph capture and timing": info.get("timing_s", 0.0)}
            parts["correctness gate, store and other"] = max(0.0, elapsed - sum(parts.values()))
            for name, secs in parts.items():
                self.report.seconds[name] += secs
            if "peak_memory_bytes" in info:
                self.report.peak_memory_bytes[device.uuid] = max(self.report.peak_memory_bytes.get(device.uuid, 0),
                                                                 int(info["peak_memory_bytes"]))
            if result.restarts:
                self.report.notes.append(f"GPU {device.index}: worker replaced {result.restarts} time(s) at "
                                         f"{plan.key.label}, batch {unit.shape.batch_size} "
                                         f"x kv_len {unit.shape.kv_len}")
            # The budget's guess of a unit excludes one-off costs (JIT, worker start).
            self.unit_seconds.append(max(0.0, elapsed - prep - info.get("worker_start_s", 0.0)))
            self.report.units_done += 1
            self.remaining[unit.key_index] -= 1
            last = self.remaining[unit.key_index] == 0
        self.progress.unit_done(plan.key, device)
        if last:
            self._decide(unit.key_index)

    def _decide(self, index: int) -> None:
        plan = self.plans[index]
        measurements = plan.reused + self.new[index]
        try:
            decision = decide(plan.key, measurements, weights=plan.weights, static_choice=plan.static_choice,
                              fingerprint=self.fingerprint, decided_at=_now_iso(),
                              extra_failures={b: f"ineligible: {why}" for b, why in plan.ineligible.items()})
        except NoDecision as exc:
            with self.lock:
                self.report.undecided[plan.key] = str(exc)
            return
        self.store.save_decision(decision, node=self.options.node)
        with self.lock:
            self.report.decisions.append(decision)

    def run(self) -> None:
        for device in self.devices:
            self.run_ids[device.uuid] = self.store.start_run(device=device, fingerprint=self.fingerprint,
                                                             preset=self.preset, node=self.options.node)
        # Keys with nothing left to measure (everything reused) are decided now.
        for index, plan in enumerate(self.plans):
            if self.remaining[index] == 0:
                self._decide(index)
        threads = [threading.Thread(target=self._gpu_loop, args=(d,), name=f"mla-tune-gpu{d.index}", daemon=True)
                   for d in self.devices]
        status = "interrupted"         # unless every unit completes
        try:
            for t in threads:
                t.start()
            for t in threads:
                while t.is_alive():
                    t.join(timeout=0.5)
            status = "interrupted" if (self.units or self.errors) else "done"
        except BaseException:
            self.aborted = True
            raise
        finally:
            with self.lock:
                self.stopped = True
            for uuid, run_id in self.run_ids.items():
                self.store.finish_run(run_id, status)
        if self.errors:
            raise self.errors[0]
        for index, plan in enumerate(self.plans):
            if self.remaining[index] > 0 and plan.key not in self.report.undecided:
                self.report.undecided[plan.key] = (f"{self.remaining[index]} shape(s) not measured "
                                                   f"(budget exhausted); run `mla-tune tune --resume`")
        self._slow_gpus()

    def _slow_gpus(self) -> None:
        """Report a GPU whose times on the shapes every GPU measured are markedly above its siblings'."""
        if len(self.devices) < 2:
            return
        by_point: dict[tuple, dict[str, float]] = defaultdict(dict)
        for rows in self.new.values():
            for m in rows:
                if m.status == "ok" and m.median_ms:
                    by_point[(m.key, m.backend, m.batch_size, m.kv_len)][m.gpu_uuid] = m.median_ms
        logs: dict[str, list[float]] = defaultdict(list)
        for times in by_point.values():
            for uuid, ms in times.items():
                others = [t for u, t in times.items() if u != uuid]
                if others:
                    logs[uuid].append(math.log(ms / statistics.median(others)))
        for device in self.devices:
            if logs.get(device.uuid):
                ratio = math.exp(statistics.mean(logs[device.uuid]))
                if ratio > SLOW_GPU_RATIO:
                    self.report.notes.append(
                        f"GPU {device.index} ({device.uuid}) is {ratio:.2f}x slower than its siblings on the "
                        f"{len(logs[device.uuid])} points every GPU measured (check clocks, power, thermals)")


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
    by_sku: dict[str, list[DeviceInfo]] = defaultdict(list)
    for device in devices:
        by_sku[device.sku].append(device)
    locks = [GpuLock(d.uuid or f"index{d.index}") for d in devices]
    held = []
    try:
        for lock in locks:
            lock.acquire()
            held.append(lock)
        _stale_runs(store, devices)
        work = []
        for sku, group in by_sku.items():
            from mla_tune.backends.software import current_fingerprint

            fp = options.fingerprint or current_fingerprint(driver_version=group[0].driver_version)
            report.fingerprints[sku] = fp.digest
            plans = build_plans(spec, store, group[0], fp, options, report)
            work.append((group, plans, fp))
        all_plans = [p for _, plans, _ in work for p in plans]
        report.estimate_s = sum(estimate_s(plans, max_seconds=max_seconds, n_gpus=len(group),
                                           jit_prefixes=options.jit_prefixes if options.prewarm else ())
                                for group, plans, _ in work)
        if on_plan is not None:
            on_plan(all_plans, report.estimate_s)
        deadline = started + options.budget_s if options.budget_s is not None else None
        tasks = (jit_tasks(all_plans, prefixes=options.jit_prefixes,
                           adapters=tuple((options.adapters or {}).items()))
                 if options.prewarm and devices else [])
        if tasks:
            first = devices[0]
            seconds, notes = prewarm(tasks, cuda_visible=first.uuid or str(first.index),
                                     device=options.worker_device, bench=options.bench,
                                     timeouts_s=dict(options.timeouts_s or {}))
            report.seconds[f"JIT warm-up ({len(tasks)} builds in parallel)"] += seconds
            report.notes.extend(notes)
        with TuneProgress(enabled=options.progress) as progress:
            for group, plans, fp in work:
                if not plans:
                    continue
                sku_tune = _SkuTune(store, group, plans, fingerprint=fp, options=options,
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
