"""Build every kernel the tune will need, in parallel workers, before timing starts.

On a fresh machine the units would build FlashInfer modules (25-40 s each) and a few dozen Triton kernels (a few
seconds each) one after the other, as their keys come up. Here `variants.py` lists the distinct builds and a pool
of workers (one process each, at most one per CPU) prepares each build once on a small shape, so the builds
overlap and land in the on-disk caches (FlashInfer's JIT folder, Triton's cache) that the units then load from.
Nothing is timed, gated or stored: a build that fails here fails again, and is recorded, in the real units.

A build that succeeded is marked in Triton's cache folder (`BuildMarks`), under the software fingerprint and the
GPU SKU; with every build marked, the pre-build starts no worker at all.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mla_tune.tuner.variants import (
    JIT_PREFIXES, KIND_LABELS, OUR_TRITON, VLLM_TRITON, CompileJob, jit_jobs, triton_jobs)
from mla_tune.tuner.worker import Worker, WorkerStartError

__all__ = ["JIT_PREFIXES", "BuildMarks", "PrewarmResult", "build_in_worker", "prewarm"]


def build_in_worker(job: CompileJob, emit, *, device: str) -> None:
    """In a worker: prepare `job.backend` on fresh inputs at `job.shape` and run it once (untimed, ungated).

    Sends `begin`, one `result` and `shape_done` with `prepare_s` and `evidence` (the JIT libraries on disk
    that this process loaded), like `measure.measure_shape`.

    Raises:
        PoisonedContext: after reporting, when a CUDA error leaves the context unusable.
    """
    import torch

    from mla_tune.backends.inputs import make_inputs
    from mla_tune.backends.interface import BackendUnavailable
    from mla_tune.tuner.measure import Outcome, PoisonedContext, describe_exception, is_fatal, resolve_adapter

    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    emit(("begin", job.backend, "prepare"))
    t0 = time.perf_counter()
    fatal = None
    try:
        inputs = make_inputs(job.problem, job.shape, device=dev)
        adapter = resolve_adapter(job.backend, dict(job.adapters))
        if job.engine:
            adapter = adapter().vllm_launch(max_seq_len=job.max_seq_len)
        else:
            adapter = adapter(params=job.params) if job.params is not None else adapter()
        runner = adapter.prepare(job.problem, inputs)
        getattr(runner, "prebuild", runner.run)(inputs)  # our kernel also builds its other combine launch
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        outcome = Outcome("ok", prepare_s=time.perf_counter() - t0)
    except BackendUnavailable as exc:
        outcome = Outcome("ineligible", reason=f"rejected at prepare: {exc}")
    except Exception as exc:  # noqa: BLE001 - a failure is data; the real unit records it
        outcome = Outcome("failed", reason=f"prepare or first run raised {describe_exception(exc)}")
        fatal = exc if dev.type == "cuda" and is_fatal(exc) else None
    emit(("result", job.backend, outcome))
    if fatal is not None:
        raise PoisonedContext(describe_exception(fatal)) from fatal
    emit(("shape_done", {"prepare_s": {job.backend: time.perf_counter() - t0}, "evidence": _jit_libraries()}))


def _jit_libraries() -> list[str]:
    """The FlashInfer JIT libraries this process has built or loaded (none when FlashInfer is not imported)."""
    if "flashinfer" not in sys.modules:
        return []
    try:
        from flashinfer.jit.core import jit_spec_registry

        return sorted(str(spec.get_library_path()) for spec in jit_spec_registry.get_all_specs().values()
                      if spec.is_compiled)
    except Exception:  # noqa: BLE001 - another FlashInfer version: no evidence, the mark still holds
        return []


def triton_cache_dir() -> Path:
    """Triton's on-disk kernel cache (TRITON_CACHE_DIR, else $TRITON_HOME/.triton/cache), as Triton finds it."""
    if os.environ.get("TRITON_CACHE_DIR"):
        return Path(os.environ["TRITON_CACHE_DIR"])
    return Path(os.environ.get("TRITON_HOME") or os.path.expanduser("~")) / ".triton" / "cache"


class BuildMarks:
    """Which builds are on disk: one small file per build that succeeded, in Triton's cache folder (removing the
    cache removes the marks), named by the software fingerprint, the GPU SKU and the build. A mark lists the JIT
    libraries it relied on; it counts only while they exist.

    Args:
        fingerprint: the software fingerprint's digest (torch, Triton, FlashInfer, driver, our kernel sources).
        sku: the GPU SKU.
        folder: where the marks live; None = `triton_cache_dir() / "mla-tune-builds"`.
    """

    def __init__(self, *, fingerprint: str, sku: str, folder: Path | None = None):
        from mla_tune.backends.software import package_version

        self.folder = folder or triton_cache_dir() / "mla-tune-builds"
        self.salt = [fingerprint, sku, package_version("vllm")]   # vLLM's version: its Triton kernel's source

    def _path(self, what) -> Path:
        text = json.dumps([*self.salt, repr(what)])
        return self.folder / hashlib.sha256(text.encode()).hexdigest()[:32]

    def done(self, what) -> bool:
        """Whether `what` (a build, or a whole plan) is marked and every JIT library it relied on exists."""
        try:
            evidence = json.loads(self._path(what).read_text())["evidence"]
        except (OSError, ValueError, KeyError, TypeError):
            return False
        return all(os.path.exists(path) for path in evidence)

    def mark(self, what, *, evidence: Sequence[str] = (), label: str = "") -> None:
        """Mark `what` built (best effort: an unwritable cache only means building again next time)."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            path = self._path(what)
            tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}")
            tmp.write_text(json.dumps({"what": label, "evidence": sorted(set(evidence))}))
            tmp.replace(path)
        except OSError:
            pass

    def device_facts(self, gpu: str) -> dict | None:
        """The SM count and compute capability a worker found on `gpu` earlier (None: not known)."""
        try:
            facts = json.loads(self._path(("device", gpu)).read_text())["facts"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return facts if isinstance(facts, dict) and "num_sms" in facts else None

    def save_device_facts(self, gpu: str, facts: dict) -> None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._path(("device", gpu)).write_text(json.dumps({"evidence": [], "facts": facts}))
        except OSError:
            pass


@dataclass
class PrewarmResult:
    """What the pre-build did: wall seconds, the name it goes under in "Time went to", notes."""

    seconds: float = 0.0
    label: str = "JIT pre-build"
    notes: list[str] = field(default_factory=list)


def plan_identity(plans: Sequence, *, prefixes: Sequence[str], seed: int,
                  engine_max_seq_len: int | None = None) -> tuple:
    """What decides the builds of `plans`: every unit's (backend, problem, shape) of a backend that builds, and
    vLLM's max_seq_len for the engine steps."""
    builds = (*prefixes, *OUR_TRITON, VLLM_TRITON)
    units = (repr((b, plan.work.problem, shape)) for plan in plans for shape in plan.todo for b in plan.backends
             if b.startswith(builds))
    return seed, engine_max_seq_len, tuple(sorted(units))


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class _Pool:
    """The job queue shared by the pool's threads (one worker process each); our Triton kernel's jobs join it
    once the first worker has said how many SMs the GPU has."""

    def __init__(self, jobs: list[CompileJob], *, plans, marks: BuildMarks, gpu: str, seed: int, adapters,
                 enumerated: bool, engine_max_seq_len: int | None = None):
        self.pending, self.plans, self.marks = jobs, plans, marks
        self.gpu, self.seed, self.adapters = gpu, seed, adapters
        self.engine_max_seq_len = engine_max_seq_len
        self.lock = threading.Lock()
        self.enumerated = threading.Event()
        if enumerated:
            self.enumerated.set()
        self.claimed = enumerated
        self.builds: Counter = Counter()
        self.longest: tuple[float, str] = (0.0, "")
        self.failures: list[str] = []    # built again by the units
        self.refused: list[str] = []     # ineligible at prepare: nothing to build
        self.evidence: set[str] = set()

    def add_triton_jobs(self, facts: dict) -> None:
        """List our Triton builds for this GPU (once, by the first worker ready) and queue the unmarked ones."""
        with self.lock:
            if self.claimed:
                return
            self.claimed = True
        try:
            self.marks.save_device_facts(self.gpu, facts)
            jobs = [job for job in triton_jobs(self.plans, num_sms=facts["num_sms"], cc_major=facts["cc_major"],
                                               seed=self.seed, adapters=self.adapters,
                                               engine_max_seq_len=self.engine_max_seq_len)
                    if not self.marks.done(job.builds[0])]
            with self.lock:
                self.pending = sorted(self.pending + jobs, key=lambda job: job.rank)
        except Exception as exc:  # noqa: BLE001 - the units build what is not built here
            with self.lock:
                self.failures.append(f"listing the Triton builds failed: {type(exc).__name__}: {exc}")
        finally:
            self.enumerated.set()

    def next_job(self) -> CompileJob | None:
        while True:
            with self.lock:
                if self.pending:
                    return self.pending.pop(0)
            if self.enumerated.is_set():
                with self.lock:
                    return self.pending.pop(0) if self.pending else None
            self.enumerated.wait(0.2)

    def record(self, job: CompileJob, result) -> None:
        outcome = result.outcomes.get(job.backend)
        with self.lock:
            ok = outcome is not None and outcome.status in ("ok", "ineligible") and not result.skipped_reason
            if ok:
                # ineligible: the backend refused the problem at prepare, as it will in the units; nothing to build
                evidence = result.info.get("evidence") or []
                self.evidence.update(evidence)
                for build in job.builds:
                    self.marks.mark(build, evidence=evidence, label=job.label())
            if ok and outcome.status == "ok":
                self.builds[job.kind] += 1
                secs = (result.info.get("prepare_s") or {}).get(job.backend, 0.0)
                self.longest = max(self.longest, (secs, job.label()))
                return
            why = result.skipped_reason or (f"{outcome.status}: {outcome.reason}" if outcome else "no result")
            (self.refused if ok else self.failures).append(f"{job.label()}: {why}")


def prewarm(plans: Sequence, *, gpu: str, sku: str, fingerprint: str, worker_device: str = "cuda",
            cuda_visible: str | None = None, bench: str | None = None, timeouts_s: dict | None = None,
            adapters: tuple[tuple[str, str], ...] = (), prefixes: Sequence[str] = JIT_PREFIXES, seed: int = 0,
            engine_max_seq_len: int | None = None,
            max_workers: int | None = None, marks: BuildMarks | None = None) -> PrewarmResult | None:
    """Build what `plans` will build, in parallel workers on one GPU (None: no backend of theirs builds anything);
    never raises for a failed build.

    Args:
        plans: the tune's `KeyPlan`s (their `todo` shapes and backends).
        gpu: the GPU's UUID (or index), whose SM count the Triton builds depend on.
        sku: its SKU; fingerprint: the software fingerprint's digest (both name the marks).
        worker_device, cuda_visible, bench, timeouts_s: as for `Worker`.
        adapters: backend name -> "module:Class" overrides (tests).
        prefixes: backends that build a JIT library (`variants.JIT_PREFIXES`).
        seed: the units' input seed (our kernel's splits follow the inputs' lengths).
        engine_max_seq_len: `TuneOptions.engine_max_seq_len` (our vLLM backend's launch depends on it).
        max_workers: at most this many workers (each holds a CUDA context); None = one per CPU.
    """
    started = time.monotonic()
    marks = marks or BuildMarks(fingerprint=fingerprint, sku=sku)
    whole = plan_identity(plans, prefixes=prefixes, seed=seed, engine_max_seq_len=engine_max_seq_len)
    if not whole[-1]:
        return None
    if marks.done(whole):
        return PrewarmResult(time.monotonic() - started, "JIT pre-build (every build already on disk)")
    jobs = [job for job in jit_jobs(plans, prefixes=prefixes, adapters=adapters) if not marks.done(job.builds[0])]
    wants_triton = any(b in (*OUR_TRITON, VLLM_TRITON) for plan in plans if plan.todo for b in plan.backends)
    facts = marks.device_facts(gpu) if wants_triton else None
    pool = _Pool(jobs, plans=plans, marks=marks, gpu=gpu, seed=seed, adapters=adapters,
                 engine_max_seq_len=engine_max_seq_len,
                 enumerated=not wants_triton)
    if facts is not None:
        pool.add_triton_jobs(facts)
    n_workers = min(max_workers or _cpus(), len(pool.pending) if pool.enumerated.is_set() else _cpus())
    if n_workers > 0:
        _run_pool(pool, n_workers, worker_device=worker_device, cuda_visible=cuda_visible, bench=bench,
                  timeouts_s=timeouts_s)
    built = sum(pool.builds.values())
    if not pool.failures and pool.enumerated.is_set() and not pool.pending:
        marks.mark(whole, evidence=sorted(pool.evidence), label="every build of a plan")
    notes = [f"JIT pre-build of {failure} (the units build it again and record any failure)"
             for failure in dict.fromkeys(pool.failures)] + [f"JIT pre-build of {refused}" for refused in pool.refused]
    if built:
        kinds = ", ".join(f"{pool.builds[kind]} {label}" for kind, label in KIND_LABELS.items() if pool.builds[kind])
        notes.insert(0, f"JIT pre-build: {built} build(s) ({kinds}) in {n_workers} parallel worker(s); the longest "
                        f"was {pool.longest[1]}, {pool.longest[0]:.1f} s")
    label = f"JIT pre-build ({built} builds, {n_workers} workers)" if n_workers or pool.failures else \
        "JIT pre-build (every build already on disk)"
    return PrewarmResult(time.monotonic() - started, label, notes)


def _run_pool(pool: _Pool, n_workers: int, *, worker_device: str, cuda_visible: str | None, bench: str | None,
              timeouts_s: dict | None) -> None:
    def serve() -> None:
        worker = Worker(cuda_visible=cuda_visible, device=worker_device, gpu=cuda_visible, bench=bench,
                        timeouts_s=timeouts_s)
        try:
            pool.add_triton_jobs(worker.start())
            while (job := pool.next_job()) is not None:
                pool.record(job, worker.run_shape(job))
        except WorkerStartError as exc:
            with pool.lock:
                pool.failures.append(f"a worker: {exc}")
        except Exception as exc:  # noqa: BLE001 - the pre-build is an optimisation; the units record failures
            with pool.lock:
                pool.failures.append(f"a worker: {type(exc).__name__}: {exc}")
        finally:
            worker.close()

    threads = [threading.Thread(target=serve, daemon=True, name=f"mla-tune-prebuild-{i}") for i in range(n_workers)]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(timeout=0.5)
