"""The tune of one GPU SKU: one thread and worker per GPU pull shapes from a shared list, store each
measurement as it arrives, decide a key when its last shape is in, and report a GPU slower than its siblings.

`run.tune` builds the plans and holds the GPU locks; this module only measures and decides.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from mla_tune.backends.device import DeviceInfo, SoftwareFingerprint
from mla_tune.store.records import DecisionKey, Measurement
from mla_tune.tuner.decide import NoDecision, decide
from mla_tune.tuner.measure import Outcome, ShapeTask
from mla_tune.tuner.plan import KeyPlan, Unit, plan_units, unit_estimate_s
from mla_tune.tuner.progress import TuneProgress
from mla_tune.tuner.variants import plan_max_seq_len
from mla_tune.tuner.worker import ShapeResult, Worker

if TYPE_CHECKING:
    from mla_tune.tuner.run import TuneOptions, TuneReport

# A GPU whose times on the common shapes are this much above its siblings' median is reported.
SLOW_GPU_RATIO = 1.10


def _now_iso() -> str:
    from datetime import UTC, datetime

    return datetime.now(UTC).isoformat(timespec="milliseconds")


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


class SkuTune:
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

    def run(self) -> None:
        """Measure every unit on every GPU of the SKU, decide each key, and record the runs' end."""
        for device in self.devices:
            self.run_ids[device.uuid] = self.store.start_run(device=device, fingerprint=self.fingerprint,
                                                             preset=self.preset, node=self.options.node)
        # Keys with nothing left to measure (everything reused) are decided now.
        for index, plan in enumerate(self.plans):
            if self.remaining[index] == 0:
                self._decide(index)
        self._run_gpu_threads()
        if self.errors:
            raise self.errors[0]
        for index, plan in enumerate(self.plans):
            if self.remaining[index] > 0 and plan.key not in self.report.undecided:
                self.report.undecided[plan.key] = (f"{self.remaining[index]} shape(s) not measured "
                                                   f"(budget exhausted); run `mla-tune tune --resume`")
        self._report_slow_gpus()

    def _run_gpu_threads(self) -> None:
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
            for run_id in self.run_ids.values():
                self.store.finish_run(run_id, status)

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
        """Measure one unit, store its rows, account its seconds, and decide its key when it was the last shape."""
        plan = self.plans[unit.key_index]
        task = ShapeTask(plan.work.problem, unit.shape, plan.backends, seed=self.options.seed,
                         rel_ci_target=self.options.rel_ci_target, max_seconds=self.max_seconds,
                         adapters=tuple((self.options.adapters or {}).items()),
                         engine_max_seq_len=plan_max_seq_len(plan, self.options.engine_max_seq_len))
        started = time.monotonic()
        self.progress.unit_started(plan.key, unit.shape, device)
        result = worker.run_shape(task, on_event=lambda ev: self.progress.event(device, ev))
        if self.aborted:
            return  # interrupted: the workers were stopped under this shape; record nothing
        rows = self._rows(plan, unit, result, device)
        for row in rows:
            self.store.add_measurement(self.run_ids[device.uuid], row)
        with self.lock:
            self.new[unit.key_index].extend(rows)
            self._account(plan, unit, result, device, elapsed_s=time.monotonic() - started)
            self.remaining[unit.key_index] -= 1
            last = self.remaining[unit.key_index] == 0
        self.progress.unit_done(plan.key, device)
        if last:
            self._decide(unit.key_index)

    def _rows(self, plan: KeyPlan, unit: Unit, result: ShapeResult, device: DeviceInfo) -> list[Measurement]:
        """The measurements of one unit: an outcome per backend (or the shape's skip), plus, at a key's first
        shape, its ineligible backends with their reasons."""
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
            rows += [_measurement(plan.key, name, unit, Outcome("ineligible", reason=why), device.uuid)
                     for name, why in plan.ineligible.items()]
        return rows

    def _account(self, plan: KeyPlan, unit: Unit, result: ShapeResult, device: DeviceInfo, *,
                 elapsed_s: float) -> None:
        """Add one unit's seconds, peak memory and worker restarts to the report (the caller holds the lock)."""
        info = result.info
        prep = sum((info.get("prepare_s") or {}).values())
        parts = {"worker start (torch import, CUDA init)": info.get("worker_start_s", 0.0),
                 "prepare (JIT, plan, first run)": prep,
                 "inputs and float32 reference": info.get("inputs_and_reference_s", 0.0),
                 "graph capture and timing": info.get("timing_s", 0.0)}
        parts["correctness gate, store and other"] = max(0.0, elapsed_s - sum(parts.values()))
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
        self.unit_seconds.append(max(0.0, elapsed_s - prep - info.get("worker_start_s", 0.0)))
        self.report.units_done += 1

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

    def _report_slow_gpus(self) -> None:
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
