"""Compile JIT backends in parallel before timing starts.

FlashInfer compiles one module per (backend, dtype) on first use, about 25 s
each on a fresh machine; inside the tune they would compile one after the
other as keys come up. Here each needed (backend, problem kind) gets its own
short-lived worker that prepares it on a tiny shape, all at once, so the
compiles overlap. Nothing is timed or stored:
a backend that fails here fails again, and is recorded, in the real units.
With a warm cache this costs one worker start (a few seconds).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from mla_tune.backends.problem import Shape
from mla_tune.tuner.measure import ShapeTask
from mla_tune.tuner.worker import Worker

# Backends whose first prepare compiles for tens of seconds.
JIT_PREFIXES = ("FLASHINFER",)


def jit_tasks(plans: Sequence, *, prefixes: Sequence[str] = JIT_PREFIXES,
              adapters: tuple[tuple[str, str], ...] = ()) -> list[ShapeTask]:
    """One tiny task per (JIT backend, dtypes, geometry, sparsity, q_len) the plans need."""
    seen, tasks = set(), []
    for plan in plans:
        p = plan.work.problem
        for backend in plan.backends:
            if not backend.startswith(tuple(prefixes)):
                continue
            ident = (backend, p.kv_cache_dtype, p.query_dtype, p.geometry, p.page_size, p.topk, p.q_len)
            if ident in seen:
                continue
            seen.add(ident)
            tasks.append(ShapeTask(p, Shape(1, max(2 * p.page_size, p.q_len + 1)), (backend,),
                                   rel_ci_target=1.0, max_seconds=0.01, adapters=adapters))
    return tasks


def prewarm(tasks: Sequence[ShapeTask], *, cuda_visible: str | None, device: str, bench: str | None = None,
            timeouts_s: dict | None = None) -> tuple[float, list[str]]:
    """Run `tasks` in parallel workers (one each); returns (wall seconds, notes: build times, failures)."""
    if not tasks:
        return 0.0, []
    started = time.monotonic()
    notes: list[str] = []
    lock = threading.Lock()

    def one(task: ShapeTask) -> None:
        worker = Worker(cuda_visible=cuda_visible, device=device, gpu=cuda_visible, bench=bench,
                        timeouts_s=timeouts_s)
        try:
            result = worker.run_shape(task)
            secs = (result.info.get("prepare_s") or {}).get(task.backends[0])
            if secs is not None:
                with lock:
                    notes.append(f"JIT warm-up of {task.backends[0]} ({task.problem.kv_cache_dtype} KV): "
                                 f"{secs:.1f} s to prepare and run once (compile included when the cache was cold)")
            bad = {n: o for n, o in result.outcomes.items() if o.status != "ok"}
            if result.skipped_reason or bad:
                why = result.skipped_reason or "; ".join(f"{n}: {o.status}: {o.reason}" for n, o in bad.items())
                with lock:
                    notes.append(f"JIT warm-up of {task.backends[0]} ({task.problem.kv_cache_dtype}) "
                                 f"did not succeed: {why}")
        except Exception as exc:  # noqa: BLE001 - warm-up is an optimisation; the real units record failures
            with lock:
                notes.append(f"JIT warm-up of {task.backends[0]} could not run: {exc}")
        finally:
            worker.close()

    threads = [threading.Thread(target=one, args=(t,), daemon=True, name="mla-tune-prewarm") for t in tasks]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(timeout=0.5)
    return time.monotonic() - started, notes
