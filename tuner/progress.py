"""Rich progress bars for a tune: one overall bar with ETA, one bar per key, a line per GPU.

Disabled (every method a no-op) for tests and `--json`-style quiet runs.
"""

from __future__ import annotations

import threading


class TuneProgress:
    """Progress display; thread-safe (GPU threads report into it)."""

    def __init__(self, *, enabled: bool = True):
        self.enabled = enabled
        self._lock = threading.Lock()
        self._progress = None
        self._overall = None
        self._keys: dict = {}
        self._gpus: dict = {}

    def __enter__(self) -> TuneProgress:
        if self.enabled:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                      console=Console(stderr=True), transient=False)
            self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()

    def add_plans(self, plans, units) -> None:
        if self._progress is None:
            return
        counts: dict = {}
        for unit in units:
            counts[unit.key_index] = counts.get(unit.key_index, 0) + 1
        with self._lock:
            if self._overall is None:
                self._overall = self._progress.add_task("all keys", total=0)
            self._progress.update(self._overall, total=(self._progress.tasks[self._overall].total or 0) + len(units))
            for index, plan in enumerate(plans):
                if counts.get(index):
                    self._keys[plan.key] = self._progress.add_task(f"  {plan.key.label}", total=counts[index])

    def unit_started(self, key, shape, device) -> None:
        if self._progress is None:
            return
        with self._lock:
            text = (f"  GPU {device.index}: {key.num_heads} heads {key.kv_cache_dtype}, "
                    f"batch {shape.batch_size} x {shape.kv_len}")
            if device.uuid not in self._gpus:
                self._gpus[device.uuid] = self._progress.add_task(text, total=None)
            else:
                self._progress.update(self._gpus[device.uuid], description=text)

    def event(self, device, event) -> None:
        if self._progress is None or event[0] != "begin":
            return
        _, name, phase = event
        with self._lock:
            task = self._gpus.get(device.uuid)
            if task is not None:
                base = self._progress.tasks[task].description.split(" | ")[0]
                self._progress.update(task, description=f"{base} | {phase} {name or 'all backends'}")

    def unit_done(self, key, device) -> None:
        if self._progress is None:
            return
        with self._lock:
            if key in self._keys:
                self._progress.advance(self._keys[key])
            if self._overall is not None:
                self._progress.advance(self._overall)
