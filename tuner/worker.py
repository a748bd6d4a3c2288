"""Worker subprocesses: backends run in a spawned process per GPU, with timeouts.

A worker serves `ShapeTask`s (measure one shape) and `CompileJob`s (build one kernel before timing,
`prewarm.py`).

An illegal memory access, an abort, a segfault, an out-of-memory or a hang
inside a backend kills or stalls only its worker. The parent notices (the
pipe closes, or no event arrives within the phase's timeout), records the
backend that was in flight as failed or timed out with the worker's last
words, starts a fresh worker and sends it the rest of the shape.

The worker's stderr (and stdout) go to a log file, so messages printed by
native code before an abort become the failure's reason.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from mla_tune.tuner.measure import Outcome, PoisonedContext, ShapeTask, describe_exception

# Seconds without an event before the phase in flight counts as hung.
# prepare includes JIT compilation (about 25 s per FlashInfer module, more when
# several compile at once on a fresh machine).
DEFAULT_TIMEOUTS_S = {"start": 120.0, "inputs": 300.0, "prepare": 420.0, "capture": 120.0,
                      "timing": 180.0}


class WorkerStartError(RuntimeError):
    """A worker could not start (no usable CUDA device, broken install); the message says why."""


@dataclass
class ShapeResult:
    """Everything one shape produced: an outcome per backend, or why the shape was skipped."""

    outcomes: dict[str, Outcome] = field(default_factory=dict)
    skipped_reason: str | None = None
    info: dict = field(default_factory=dict)
    restarts: int = 0


def _merge_info(into: dict, more: dict) -> None:
    """Add one attempt's shape info to the running total (seconds add up, dicts merge, peaks max)."""
    for name, value in more.items():
        if isinstance(value, dict):
            into.setdefault(name, {}).update(value)
        elif name == "peak_memory_bytes":
            into[name] = max(into.get(name, 0), value)
        elif isinstance(value, float):
            into[name] = into.get(name, 0.0) + value
        else:
            into[name] = value


def _load(path: str | None):
    if not path:
        return None
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def _exit_with_parent() -> None:
    """Exit as soon as the tuner dies (even by SIGKILL), rather than finish a shape or a JIT build
    for nobody while holding the GPU."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(4)

    threading.Thread(target=watch, daemon=True, name="mla-tune-parent-watch").start()


def _worker_main(conn, cuda_visible: str | None, device: str, gpu: str | None,
                 bench_path: str | None, log_path: str) -> None:
    """Entry point of the spawned worker: serve ShapeTasks until told to stop."""
    # Ctrl-C reaches the whole process group; the parent handles it and stops the workers, so
    # that an interrupted measurement is never recorded as a backend's failure.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.dup2(fd, 1)
    if cuda_visible is not None:
        # Before torch is imported: this worker sees exactly one GPU, as cuda:0.
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible
    from mla_tune.tuner.measure import measure_shape
    from mla_tune.tuner.prewarm import build_in_worker
    from mla_tune.tuner.variants import CompileJob

    try:
        bench = _load(bench_path)
        import torch  # here, so its import counts as worker start

        if device == "cuda":
            torch.cuda.set_device(0)
            torch.cuda.init()
        from mla_tune.backends.triton_mla.config import cc_major, sm_count

        dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        facts = {"num_sms": sm_count(dev), "cc_major": cc_major(dev)}   # what our kernel's dispatch reads
    except Exception as exc:  # noqa: BLE001
        conn.send(("fatal", f"worker could not start: {describe_exception(exc)}"))
        return
    conn.send(("ready", os.getpid(), facts))
    while True:
        try:
            task = conn.recv()
        except EOFError:
            task = None
        if task is None:
            # Skip interpreter teardown (torch's takes seconds); nothing is left to flush.
            conn.close()
            os._exit(0)
        try:
            if isinstance(task, CompileJob):
                build_in_worker(task, conn.send, device=device)
            else:
                measure_shape(task, conn.send, device=device, gpu=gpu, bench=bench)
        except PoisonedContext as exc:
            conn.send(("fatal", f"CUDA context unusable after {exc}"))
            conn.close()
            os._exit(3)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            conn.send(("shape_skipped", f"the worker failed outside any backend: {describe_exception(exc)}"))


def _death_reason(exitcode: int | None, log_path: Path) -> str:
    if exitcode is None:
        what = "the worker stopped responding"
    elif exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        what = f"the worker died of {name}"
    else:
        what = f"the worker exited with status {exitcode}"
    tail = ""
    try:
        lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
        if lines:
            tail = " (last output: " + " | ".join(lines[-3:])[-300:] + ")"
    except OSError:
        pass
    return what + tail


class Worker:
    """One worker subprocess bound to one GPU (or the CPU in tests), replaced after a crash.

    Args:
        cuda_visible: the `CUDA_VISIBLE_DEVICES` value for the worker (an index or UUID);
            None leaves the environment alone.
        device: `cuda` or `cpu`.
        gpu: NVML index or UUID, for clocks and temperature.
        bench: "module:function" replacing `timing.time_interleaved` (tests).
        timeouts_s: per-phase timeouts (see DEFAULT_TIMEOUTS_S).
        log_dir: where worker logs go (default: a fresh temp folder).
    """

    def __init__(self, *, cuda_visible: str | None = None, device: str = "cuda", gpu: str | None = None,
                 bench: str | None = None, timeouts_s: dict[str, float] | None = None,
                 log_dir: Path | None = None):
        self.cuda_visible, self.device, self.gpu, self.bench = cuda_visible, device, gpu, bench
        self.timeouts_s = {**DEFAULT_TIMEOUTS_S, **(timeouts_s or {})}
        self._own_log_dir = log_dir is None
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="mla-tune-worker-"))
        self._ctx = multiprocessing.get_context("spawn")
        self._proc = None
        self._conn = None
        self.starts = 0
        self.log_path = self.log_dir / "worker-0.log"
        self.device_facts: dict = {}   # from the worker: num_sms, cc_major of the GPU it sees

    def _start(self) -> None:
        self.starts += 1
        self.log_path = self.log_dir / f"worker-{self.starts}.log"
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(
            target=_worker_main, daemon=True, name=f"mla-tune-worker-{self.gpu or self.device}",
            args=(child, self.cuda_visible, self.device, self.gpu, self.bench, str(self.log_path)))
        self._proc.start()
        child.close()
        self._conn = parent
        event = self._next_event(self.timeouts_s["start"])
        if event is None or event[0] != "ready":
            reason = event[1] if event and event[0] == "fatal" else _death_reason(self._proc.exitcode,
                                                                                  self.log_path)
            self.stop()
            raise WorkerStartError(f"could not start a worker for GPU {self.gpu or self.device}: {reason}")
        self.device_facts = event[2] if len(event) > 2 else {}

    def start(self) -> dict:
        """Start the worker unless it runs; returns what it found of its GPU (`device_facts`).

        Raises:
            WorkerStartError: the worker could not start; the message says why.
        """
        if self._proc is None or not self._proc.is_alive():
            self.stop()
            self._start()
        return self.device_facts

    def _next_event(self, timeout_s: float):
        """The next event, or None when the worker died or said nothing for `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                if self._conn.poll(min(left, 0.2)):
                    return self._conn.recv()
            except (EOFError, OSError):
                self._proc.join(timeout=5)
                return None
            if not self._proc.is_alive():
                # Drain anything sent just before dying.
                try:
                    if self._conn.poll(0):
                        return self._conn.recv()
                except (EOFError, OSError):
                    pass
                return None

    def stop(self) -> None:
        """Stop the worker (politely, then by SIGKILL)."""
        if self._proc is None:
            return
        try:
            if self._proc.is_alive():
                try:
                    self._conn.send(None)
                except (OSError, BrokenPipeError):
                    pass
                self._proc.join(timeout=2)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(timeout=5)
        finally:
            if self._conn is not None:
                self._conn.close()
            self._proc = self._conn = None

    def _kill(self) -> None:
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join(timeout=5)
            self._exitcode = self._proc.exitcode
        self.stop()

    def run_shape(self, task: ShapeTask, *, on_event: Callable[[tuple], None] | None = None,
                  _alone: bool = False) -> ShapeResult:
        """Measure `task`, surviving crashes and hangs of individual backends.

        Args:
            task: what to measure.
            on_event: called with every event (progress display).

        Returns:
            An outcome for every backend of `task` (or the shape's skip reason). When
            the interleaved timing of several backends crashes or hangs, each of them
            is timed again alone, so that only the culprit is recorded as failed.
        """
        result = ShapeResult()
        pending = list(task.backends)
        suspects: list[str] = []
        sent = False
        while pending:
            if result.restarts > len(task.backends) + 1:
                for name in pending:
                    result.outcomes[name] = Outcome("failed", reason="the worker kept dying at this shape")
                break
            self._ensure_running(result, restart=sent)
            sent = True
            # Every field of the task travels (refine_tiles, adapters, ...); only the backends still to do change.
            self._conn.send(replace(task, backends=tuple(pending)))
            if self._collect(task, pending, result, suspects, on_event=on_event, alone=_alone):
                return result
            pending = [n for n in pending if n not in result.outcomes and n not in suspects]
            if pending and self._proc is not None and self._proc.is_alive():
                # shape_done without a result for some backend: should not happen; do not loop forever.
                for name in pending:
                    result.outcomes[name] = Outcome("failed", reason="the worker finished the shape without a result")
                pending = []
        self._time_alone(task, suspects, result, on_event=on_event)
        return result

    def _ensure_running(self, result: ShapeResult, *, restart: bool) -> None:
        """Start a worker when none is alive; a start after a task was sent counts as a restart."""
        if self._proc is not None and self._proc.is_alive():
            return
        if self._proc is not None:
            self.stop()
        if restart:
            result.restarts += 1
        t0 = time.monotonic()
        self._start()
        _merge_info(result.info, {"worker_start_s": time.monotonic() - t0})

    def _collect(self, task: ShapeTask, pending: list[str], result: ShapeResult, suspects: list[str], *,
                 on_event: Callable[[tuple], None] | None, alone: bool) -> bool:
        """Read one attempt's events into `result` until the shape is done or the worker is lost.

        Returns:
            True when the shape ends here (skipped, or it could not be built).
        """
        in_flight: list[str] = []
        phase = "inputs"
        while True:
            timeout = self.timeouts_s.get(phase, 300.0)
            if phase == "timing":
                timeout += task.max_seconds * 3
            event = self._next_event(timeout)
            if event is None:
                return self._lost_worker(phase, timeout, in_flight, result, suspects, alone=alone)
            if on_event is not None:
                on_event(event)
            kind = event[0]
            if kind == "begin":
                _, name, phase = event
                in_flight = [n for n in pending if n not in result.outcomes] if name is None else [name]
            elif kind == "result":
                _, name, outcome = event
                result.outcomes[name] = outcome
                in_flight = [n for n in in_flight if n != name]
            elif kind == "timing_failed":
                _, reason, names = event
                if alone:
                    for name in names:
                        result.outcomes[name] = Outcome("failed", reason=reason)
                else:
                    suspects.extend(n for n in names if n not in result.outcomes)
                in_flight = []
            elif kind == "shape_skipped":
                result.skipped_reason = event[1]
                return True
            elif kind == "shape_done":
                _merge_info(result.info, event[1])
                return False
            elif kind == "fatal":
                # The worker reported the backend's failure before exiting; wait for it to go.
                self._proc.join(timeout=10)
                self._kill()
                return False

    def _lost_worker(self, phase: str, timeout: float, in_flight: list[str], result: ShapeResult,
                     suspects: list[str], *, alone: bool) -> bool:
        """The worker died or went silent: blame what was in flight. True when the shape itself could not be built."""
        hung = self._proc is not None and self._proc.is_alive()
        self._kill()
        if hung:
            status, reason = "timeout", f"no progress for {timeout:.0f} s during {phase}; worker killed"
        else:
            status, reason = "failed", f"{_death_reason(self._exitcode, self.log_path)} during {phase}"
        if not in_flight and not result.outcomes:
            result.skipped_reason = f"the shape could not be built: {reason}"
            return True
        if phase == "timing" and len(in_flight) > 1 and not alone:
            suspects.extend(in_flight)
            return False
        for name in in_flight:
            result.outcomes[name] = Outcome(status, reason=reason)
        return False

    def _time_alone(self, task: ShapeTask, suspects: list[str], result: ShapeResult, *,
                    on_event: Callable[[tuple], None] | None) -> None:
        """Time each backend of an interleaved timing that broke on its own, so only the culprit fails."""
        for name in suspects:
            if self._proc is None:
                result.restarts += 1
            alone = self.run_shape(replace(task, backends=(name,)), on_event=on_event, _alone=True)
            result.restarts += alone.restarts
            _merge_info(result.info, alone.info)
            result.outcomes[name] = alone.outcomes.get(name) or Outcome(
                "failed", reason=f"timed alone after the interleaved timing broke: {alone.skipped_reason}")

    _exitcode: int | None = None

    def close(self) -> None:
        """Stop the worker for good and remove its logs (when mla-tune made their folder)."""
        self.stop()
        if self._own_log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
