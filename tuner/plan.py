"""The plan: which keys to measure on one SKU, in what order, what is reused, and what it costs.

Keys come most valuable first (`presets.expand_keys`); keys already decided
on this SKU under this software fingerprint are skipped unless `force`; with
`resume`, shapes whose every backend already has a stored outcome under this
fingerprint are not measured again.

Work is split into units of one (key, shape). Identical GPUs of one SKU share
the units, except each key's first shape, which every GPU measures: those
common points are what a markedly slower GPU is detected by.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from mla_tune.backends.problem import Shape
from mla_tune.store.records import DecisionKey, Measurement
from mla_tune.tuner.presets import KeyWork

# A first guess of a unit's cost before anything was measured: worker overhead,
# inputs, the reference and the gate per backend, plus the timing cap.
UNIT_OVERHEAD_S = 0.5
GATE_S_PER_BACKEND = 0.1
# First use of a FlashInfer backend compiles a module (about 25 s on a fresh machine).
JIT_S_PER_BACKEND = 30.0
_DONE_STATUSES = ("ok", "failed", "incorrect", "timeout", "ineligible")


class BudgetError(ValueError):
    """The budget cannot fit a single measurement (exit status 2)."""


@dataclass(frozen=True)
class Unit:
    """One shape of one key, measured on one GPU (`gpu` None: whichever is free)."""

    key_index: int
    shape: Shape
    gpu: str | None = None


@dataclass
class KeyPlan:
    """One key's plan: its work, the backends to time, why the others are not timed, what is reused."""

    key: DecisionKey
    work: KeyWork
    backends: tuple[str, ...]
    ineligible: dict[str, str] = field(default_factory=dict)
    static_choice: str | None = None
    reused: list[Measurement] = field(default_factory=list)
    todo: tuple[Shape, ...] = ()

    @property
    def weights(self) -> dict[tuple[int, int], float]:
        return {(s.batch_size, s.kv_len): w for s, w in zip(self.work.shapes, self.work.weights)}


def unit_estimate_s(n_backends: int, max_seconds: float) -> float:
    """A unit's expected seconds before any was measured (JIT excluded)."""
    return UNIT_OVERHEAD_S + GATE_S_PER_BACKEND * n_backends + max_seconds


def check_budget(budget_s: float | None, *, max_seconds: float) -> None:
    """Raise BudgetError when `budget_s` cannot fit one measurement of one shape."""
    if budget_s is None:
        return
    need = unit_estimate_s(1, max_seconds)
    if not budget_s > 0 or budget_s < need:
        raise BudgetError(f"--budget-s {budget_s:g} cannot fit a single measurement "
                          f"(one shape needs about {need:.1f} s); give at least {math.ceil(need)} s")


def done_shapes(measurements: Iterable[Measurement], backends: Sequence[str]) -> set[tuple[int, int]]:
    """Shapes where every backend in `backends` has an outcome (ok or a failure) stored."""
    seen: dict[tuple[int, int], set[str]] = {}
    for m in measurements:
        if m.status in _DONE_STATUSES:
            seen.setdefault((m.batch_size, m.kv_len), set()).add(m.backend)
        elif m.status == "skipped":   # a shape that did not fit: done for every backend
            seen.setdefault((m.batch_size, m.kv_len), set()).update(backends)
    return {shape for shape, names in seen.items() if set(backends) <= names}


def plan_units(plans: Sequence[KeyPlan], gpus: Sequence[str]) -> list[Unit]:
    """Units in plan order; each key's first remaining shape is pinned to every GPU when there are several."""
    units: list[Unit] = []
    for index, plan in enumerate(plans):
        for i, shape in enumerate(plan.todo):
            if i == 0 and len(gpus) > 1:
                units.extend(Unit(index, shape, gpu) for gpu in gpus)
            else:
                units.append(Unit(index, shape))
    return units


def estimate_s(plans: Sequence[KeyPlan], *, max_seconds: float, n_gpus: int = 1,
               jit_prefixes: Sequence[str] = ("FLASHINFER",)) -> float:
    """Expected wall seconds for the plan, with one cold JIT build when a JIT backend is in it.

    The builds run in parallel before timing (`prewarm.py`), so they cost about one build's time.
    """
    total = 0.0
    backends: set[str] = set()
    for plan in plans:
        total += len(plan.todo) * unit_estimate_s(len(plan.backends), max_seconds)
        backends.update(plan.backends)
    jit = JIT_S_PER_BACKEND if any(b.startswith(tuple(jit_prefixes)) for b in backends) else 0.0
    return total / max(1, n_gpus) + jit
