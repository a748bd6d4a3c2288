"""Inside a worker: measure every backend at one shape (inputs, reference, prepare, gate, time).

This runs in the worker subprocess (see `worker.py`), never in the tuner's
main process, so a backend that aborts or corrupts the CUDA context takes only
the worker down. Every step reports an event through `emit` as it happens, so
the parent knows which backend was in flight when something dies.

Events sent (plain tuples, picklable):
    ("begin", backend, phase)        phase in prepare, capture, timing
    ("result", backend, Outcome)     one per backend
    ("timing_failed", reason, names) interleaved timing of several backends broke; the parent
                                     times each of them alone to find the culprit
    ("shape_skipped", reason)        the shape does not fit or cannot be built
    ("shape_done", info dict)        seconds per phase, peak memory, clocks
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, is_dataclass

from mla_tune.backends.problem import Problem, Shape, kv_bytes_per_element
from mla_tune.tuner.gate import check_output, quantizes_query
from mla_tune.tuner.probe import GpuSensors

# Fraction of free GPU memory a shape may plan to use (allocator slack, library workspaces).
MEMORY_HEADROOM = 0.85
# Per-backend allowance for workspaces and output buffers beyond q/KV (FlashInfer's
# float workspace is 128 MiB; plan info and outputs are small).
BACKEND_WORKSPACE_BYTES = 256 << 20


@dataclass(frozen=True)
class ShapeTask:
    """One shape of one key, for the listed backends, as sent to a worker."""

    problem: Problem
    shape: Shape
    backends: tuple[str, ...]
    seed: int = 0
    rel_ci_target: float = 0.01
    max_seconds: float = 1.0
    adapters: tuple[tuple[str, str], ...] = ()   # name -> "module:Class" overrides (tests)
    refine_tiles: bool = True                    # time every candidate tile of a backend that has them
    # vLLM's max_seq_len for the step that times a refined backend as our vLLM backend launches it (dense; at
    # least this shape's kv_len, which None means): vLLM's full CUDA graphs are captured with the longest length.
    engine_max_seq_len: int | None = None


@dataclass(frozen=True)
class Outcome:
    """What happened to one backend at one shape."""

    status: str                           # a Measurement status
    median_ms: float | None = None
    ci_low_ms: float | None = None
    ci_high_ms: float | None = None
    samples: int = 0
    rel_error: float | None = None
    reason: str = ""
    prepare_s: float | None = None        # prepare + first run (JIT, plan), untimed
    clocks: dict = field(default_factory=dict)   # sm_clock_mhz_before/after, temperature_c_before/after
    params: dict | None = None            # a refined backend: the launch it was timed with (`_refined_params`)


class PoisonedContext(RuntimeError):
    """A CUDA error that leaves the context unusable: the worker must exit after reporting."""


_FATAL_MARKERS = ("illegal memory access", "device-side assert", "unspecified launch failure",
                  "misaligned address", "illegal instruction", "CUDA error", "cudaError",
                  "an illegal", "launch timed out")


def describe_exception(exc: BaseException) -> str:
    """One line: the exception type and the first line of its message (at most 400 characters)."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first}"[:400]


def resolve_adapter(name: str, overrides: dict[str, str]):
    """The adapter class of backend `name`: `overrides`' "module:Class" where it names one (tests), else the
    registry's."""
    path = overrides.get(name)
    if path is None:
        from mla_tune.backends.registry import load_adapter

        return load_adapter(name)
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def shape_bytes(problem: Problem, shape: Shape) -> int:
    """Upper bound of one input set's bytes (q + the page pool with its spare pages)."""
    head = problem.geometry.head_size
    pages = shape.batch_size * (-(-shape.kv_len // problem.page_size)) * 1.125 + shape.batch_size + 1
    kv = pages * problem.page_size * head * kv_bytes_per_element(problem.kv_cache_dtype)
    q = shape.batch_size * problem.q_len * problem.num_heads * head * 2
    return int(kv + q)


def is_fatal(exc: BaseException) -> bool:
    """Whether `exc` is a CUDA error that leaves the context unusable."""
    text = str(exc)
    return any(marker in text for marker in _FATAL_MARKERS)


def _gpu_steps(prepared: dict, inputs, *, free_bytes: int, emit, backend_of: dict,
               on_failure) -> dict[str, Callable[[], object]]:
    """CUDA graphs of each step over rotating input copies (cold L2), captured per step.

    A step whose capture raises goes to `on_failure(step, Outcome)` and is left out (PoisonedContext when
    the CUDA context is gone).
    """
    from mla_tune.tuner import timing

    from mla_tune.backends.interface import adopt_rotation

    sets = timing.cold_l2_sets(inputs, free_bytes=free_bytes)
    steps = {}
    for name, runner in prepared.items():
        emit(("begin", backend_of[name], "capture"))
        try:
            adopt_rotation(runner, sets)   # adapters reading another cache layout convert each copy, untimed
            steps[name] = timing.capture_graph(lambda runner=runner: [runner.run(s) for s in sets],
                                               iterations_per_replay=len(sets))
        except Exception as exc:  # noqa: BLE001 - a failure is data
            on_failure(name, Outcome("failed", reason=f"CUDA graph capture raised {describe_exception(exc)}"))
            if is_fatal(exc):
                raise PoisonedContext(describe_exception(exc)) from exc
    return steps


def measure_shape(task: ShapeTask, emit: Callable[[tuple], None], *, device: str = "cuda",
                  gpu: str | None = None, bench: Callable | None = None) -> None:
    """Measure `task` and report through `emit` (see the module docstring).

    Args:
        task: the key's problem, the shape and the backends to try.
        emit: sends one event to the parent.
        device: `cuda` (the one GPU this worker sees) or `cpu` (tests).
        gpu: NVML index or UUID of the GPU, for clocks and temperature.
        bench: the timing function (`timing.time_interleaved` signature);
            None = the real one.

    Raises:
        PoisonedContext: after reporting, when a CUDA error leaves the context unusable.
    """
    import torch

    run = _ShapeRun(task, emit, torch.device("cuda", 0) if device == "cuda" else torch.device("cpu"))
    if not run.fits_in_memory() or not run.build_inputs():
        return
    steps = _steps(task, task.problem, run.inputs, dict(task.adapters), emit)
    failed = _Failures(steps, emit)
    prepared = run.prepare_and_gate(steps, failed)
    failed.report()
    timed = run.graphs_or_calls(prepared, steps, failed) if prepared else {}
    prepared = {name: p for name, p in prepared.items() if name in timed}
    if timed:
        if bench is None:
            from mla_tune.tuner.timing import time_interleaved as bench
        measured = run.time_together(timed, steps, prepared, bench, GpuSensors(gpu if run.on_cuda else None))
        if measured is not None:
            _report_results(steps, prepared, *measured, failed, emit)
            if run.on_cuda:
                run.info["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated(run.dev))
            run.info["pid"] = os.getpid()
    emit(("shape_done", run.info))


class _ShapeRun:
    """The steps of `measure_shape` on one shape: memory check, inputs and reference, prepare and gate, timing.

    Each step reports through `emit` and records seconds in `info`; one that ends the shape early says so by its
    return value (False or None).
    """

    def __init__(self, task: ShapeTask, emit: Callable[[tuple], None], dev):
        self.task, self.problem, self.emit, self.dev = task, task.problem, emit, dev
        self.on_cuda = dev.type == "cuda"
        self.info: dict = {"prepare_s": {}}
        self.inputs = self.ref = None
        self._timing_t0 = time.perf_counter()

    def fits_in_memory(self) -> bool:
        """False (and `shape_skipped` sent) when the shape's inputs and workspaces cannot fit the free GPU memory."""
        if not self.on_cuda:
            return True
        import torch

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.dev)
        free_bytes, _ = torch.cuda.mem_get_info(self.dev)
        # Inputs, plus either one rotated copy or (FP8) the bf16 draft the cache is quantised from,
        # which is twice the FP8 cache; then each backend's workspace and outputs.
        factor = 3 if self.problem.kv_cache_dtype.startswith("fp8") else 2
        need = (shape_bytes(self.problem, self.task.shape) * factor
                + BACKEND_WORKSPACE_BYTES * len(self.task.backends))
        if need <= free_bytes * MEMORY_HEADROOM:
            return True
        self.emit(("shape_skipped", f"needs about {need / 2**30:.1f} GiB for inputs, a rotated copy and "
                                    f"workspaces, but only {free_bytes / 2**30:.1f} GiB of GPU memory is free"))
        return False

    def build_inputs(self) -> bool:
        """Random inputs and the float32 reference's output; False (and `shape_skipped` sent) when out of memory."""
        import torch

        from mla_tune.backends.inputs import make_inputs
        from mla_tune.backends.reference import TorchReference

        t0 = time.perf_counter()
        try:
            self.inputs = make_inputs(self.problem, self.task.shape, device=self.dev, seed=self.task.seed)
            self.ref = TorchReference().prepare(self.problem, self.inputs).run(self.inputs)
            self._sync()
        except torch.OutOfMemoryError as exc:
            self.emit(("shape_skipped", f"out of memory building inputs or the reference: "
                                        f"{describe_exception(exc)}"))
            return False
        self.info["inputs_and_reference_s"] = time.perf_counter() - t0
        return True

    def prepare_and_gate(self, steps: list[_Step], failed: _Failures) -> dict:
        """Prepare each step and gate its first output; step name -> (runner, rel_error, prepare_s) of those that
        pass. A failure goes to `failed`."""
        prepared = {}
        for step in steps:
            self.emit(("begin", step.backend, "prepare"))
            done = self._prepare_one(step, failed)
            if done is not None:
                prepared[step.name] = done
        return prepared

    def _prepare_one(self, step: _Step, failed: _Failures):
        import torch

        from mla_tune.backends.interface import BackendUnavailable

        t0 = time.perf_counter()
        try:
            runner = step.adapter.prepare(self.problem, self.inputs)
            out, lse = runner.run(self.inputs)
            self._sync()
            prepare_s = time.perf_counter() - t0
            self.info["prepare_s"][step.name] = prepare_s
            verdict = check_output(out, lse, *self.ref, kv_cache_dtype=self.problem.kv_cache_dtype,
                                   fp8_query=quantizes_query(step.backend, self.problem.kv_cache_dtype))
        except BackendUnavailable as exc:
            failed[step.name] = Outcome("ineligible", reason=f"rejected at prepare: {exc}")
            return None
        except torch.OutOfMemoryError as exc:
            if self.on_cuda:
                torch.cuda.empty_cache()
            failed[step.name] = Outcome("failed", reason=f"out of memory at prepare: {describe_exception(exc)}")
            return None
        except Exception as exc:  # noqa: BLE001 - a failure is data
            failed[step.name] = Outcome("failed", reason=f"prepare or first run raised {describe_exception(exc)}")
            if self.on_cuda and is_fatal(exc):
                failed.report()
                raise PoisonedContext(describe_exception(exc)) from exc
            return None
        if not verdict.ok:
            failed[step.name] = Outcome("incorrect", rel_error=verdict.rel_error, reason=verdict.reason,
                                        prepare_s=prepare_s)
            return None
        return runner, verdict.rel_error, prepare_s

    def graphs_or_calls(self, prepared: dict, steps: list[_Step], failed: _Failures) -> dict:
        """What the timing replays: a CUDA graph per step over cold-L2 input copies, or (CPU) a plain call."""
        self._timing_t0 = time.perf_counter()  # timing_s includes graph capture: both are the cost of timing
        if not self.on_cuda:
            return {name: (lambda r=p[0]: r.run(self.inputs)) for name, p in prepared.items()}
        import torch

        free_now, _ = torch.cuda.mem_get_info(self.dev)
        try:
            return _gpu_steps({name: p[0] for name, p in prepared.items()}, self.inputs,
                              free_bytes=int(free_now * MEMORY_HEADROOM), emit=self.emit,
                              backend_of={step.name: step.backend for step in steps}, on_failure=failed.__setitem__)
        finally:
            failed.report()

    def time_together(self, timed: dict, steps: list[_Step], prepared: dict, bench: Callable, nvml: GpuSensors):
        """(timings, clocks) of the interleaved timing of every step, or None when it raised (reported here)."""
        try:
            self.emit(("begin", None, "timing"))
            clock_before, temp_before = nvml.read()
            timings = bench(timed, rel_ci_target=self.task.rel_ci_target, max_seconds=self.task.max_seconds)
            clock_after, temp_after = nvml.read()
        except Exception as exc:  # noqa: BLE001 - a failure is data
            self._report_timing_failure(exc, timed, steps, prepared)
            return None
        self.info["timing_s"] = time.perf_counter() - self._timing_t0
        return timings, dict(sm_clock_mhz_before=clock_before, sm_clock_mhz_after=clock_after,
                             temperature_c_before=temp_before, temperature_c_after=temp_after)

    def _report_timing_failure(self, exc: Exception, timed: dict, steps: list[_Step], prepared: dict) -> None:
        reason = f"interleaved timing raised {describe_exception(exc)}"
        backend_of = {step.name: step.backend for step in steps}
        backends = tuple(dict.fromkeys(backend_of[name] for name in timed))
        if len(backends) == 1:
            _, rel, prepare_s = next(iter(prepared.values()))
            self.emit(("result", backends[0], Outcome("failed", rel_error=rel, prepare_s=prepare_s, reason=reason)))
        else:
            # Which backend broke it is unknown: the parent times each one alone to find out.
            self.emit(("timing_failed", reason, backends))
        if self.on_cuda and is_fatal(exc):
            raise PoisonedContext(describe_exception(exc)) from exc

    def _sync(self) -> None:
        if self.on_cuda:
            import torch

            torch.cuda.synchronize(self.dev)


def _report_results(steps: list[_Step], prepared: dict, timings: dict, clocks: dict, failed: _Failures,
                    emit: Callable[[tuple], None]) -> None:
    """One `result` per backend that reached the timing: its fastest candidate's time (a refined backend's
    measurement also records which tile won and why others were left out)."""
    for backend in dict.fromkeys(step.backend for step in steps):
        mine = [step for step in steps if step.backend == backend and step.name in prepared and _is_candidate(step)]
        if not mine:
            continue  # reported by failed.report()
        done = [(step, timings[step.name]) for step in mine if timings.get(step.name) is not None]
        if not done:
            _, rel, prepare_s = prepared[mine[0].name]
            emit(("result", backend, Outcome("failed", rel_error=rel, prepare_s=prepare_s,
                                             reason="the timing harness returned no time for it")))
            continue
        best, timing = min(done, key=lambda pair: pair[1].median_ms)
        _, rel, prepare_s = prepared[best.name]
        params = _refined_params(steps, best, timings, failed) if best.tile is not None else None
        emit(("result", backend, Outcome("ok", median_ms=float(timing.median_ms),
                                         ci_low_ms=float(timing.ci_low_ms), ci_high_ms=float(timing.ci_high_ms),
                                         samples=int(timing.samples), rel_error=rel, prepare_s=prepare_s,
                                         clocks=clocks, params=params)))


@dataclass(frozen=True)
class _Step:
    """One thing to time: a backend, or one candidate tile of a refined backend (`name` = `backend#i`)."""

    name: str
    backend: str
    adapter: object
    tile: object | None = None     # a candidate's tile: a dataclass or a NamedTuple
    label: str = ""                # its launch parameters, `LaunchParams.label()`
    engine: bool = False           # the launch our vLLM backend makes (`vllm_launch`), timed beside the candidates
    max_seq_len: int | None = None  # the vLLM max_seq_len that launch was given (dense)


ENGINE_STEP = "@vllm"   # suffix of the engine step's name


def _is_candidate(step: _Step) -> bool:
    return not step.engine


def _steps(task: ShapeTask, problem, inputs, overrides: dict, emit) -> list[_Step]:
    """The steps of `task`: one per backend, or one per candidate tile where the adapter has `tile_candidates`
    (our Triton kernel; the first candidate is its default) and `task.refine_tiles` is set, then, where the
    adapter has `vllm_launch`, one more: the launch our vLLM backend makes of it."""
    steps = []
    for name in task.backends:
        adapter = resolve_adapter(name, overrides)()
        choose = getattr(adapter, "tile_candidates", None) if task.refine_tiles else None
        if choose is None:
            steps.append(_Step(name, name, adapter))
            continue
        try:
            candidates = choose(problem, inputs)
        except Exception as exc:  # noqa: BLE001 - a failure is data
            emit(("result", name, Outcome("failed", reason=f"choosing its candidate tiles raised "
                                                            f"{describe_exception(exc)}")))
            continue
        steps += [_Step(f"{name}#{i}", name, type(adapter)(params=params), tile, params.label())
                  for i, (tile, params) in enumerate(candidates)]
        engine = _engine_step(task, name, adapter, emit)
        if engine is not None:
            steps.append(engine)
    return steps


def engine_seq_len(problem, shape, configured: int | None) -> int | None:
    """vLLM's max_seq_len for a unit's engine step: `configured`, at least the shape's kv_len (dense); None (sparse,
    whose launch does not take it)."""
    return None if problem.sparse else max(configured or 0, shape.kv_len)


def _engine_step(task: ShapeTask, name: str, adapter, emit) -> _Step | None:
    """The launch our vLLM backend makes of a refined backend (vLLM's max_seq_len: at least the shape's kv_len),
    or None where the adapter has none."""
    make = getattr(adapter, "vllm_launch", None)
    if make is None:
        return None
    max_seq_len = engine_seq_len(task.problem, task.shape, task.engine_max_seq_len)
    return _Step(f"{name}{ENGINE_STEP}", name, make(max_seq_len=max_seq_len), label="vLLM launch", engine=True,
                 max_seq_len=max_seq_len)


class _Failures(dict):
    """Step name -> Outcome of the steps that failed (at prepare, the gate or graph capture). `report` gives each
    backend all of whose steps failed its first step's failure as its result, once; a refined backend's failed
    candidates beside a working one are listed with its result instead (`_refined_params`)."""

    def __init__(self, steps: list[_Step], emit):
        super().__init__()
        self.steps, self.emit, self.reported = steps, emit, set()

    def report(self) -> None:
        for backend in dict.fromkeys(step.backend for step in self.steps):
            mine = [step for step in self.steps if step.backend == backend and _is_candidate(step)]
            if backend not in self.reported and all(step.name in self for step in mine):
                self.emit(("result", backend, self[mine[0].name]))
                self.reported.add(backend)


def _refined_params(steps: list[_Step], best: _Step, timings: dict, failed: dict) -> dict:
    """What a refined backend's measurement records: the winning tile (`Tile` fields), its label, the default
    tile's time (the first candidate) and why any candidate was left out."""
    mine = [step for step in steps if step.backend == best.backend and _is_candidate(step)]
    default = timings.get(mine[0].name)
    params = {"tile": asdict(best.tile) if is_dataclass(best.tile) else best.tile._asdict(), "label": best.label,
              "default_label": mine[0].label,
              "default_median_ms": None if default is None else float(default.median_ms),
              "candidates": len(mine),
              "rejected": {step.label: failed[step.name].reason or failed[step.name].status
                           for step in mine if step.name in failed}}
    engine = next((step for step in steps if step.backend == best.backend and step.engine), None)
    if engine is not None:
        params.update(_engine_params(engine, timings, failed))
    return params


def _engine_params(step: _Step, timings: dict, failed: dict) -> dict:
    """What a refined backend's measurement records of the launch our vLLM backend makes: its time, or None and
    why (it failed, was wrong, or got no time)."""
    timing = timings.get(step.name)
    if step.name in failed:
        reason = failed[step.name].reason or failed[step.name].status
    elif timing is None:
        reason = "the timing harness returned no time for it"
    else:
        reason = ""
    return {"engine_median_ms": None if reason else float(timing.median_ms), "engine_max_seq_len": step.max_seq_len,
            "engine_reason": reason}
