"""The decision rule: which backend wins a key, by how much, and why (DESIGN.md principles).

1. Only a backend that ran correctly at every scored shape can win; a
   failure, a hang, an incorrect result or a missing shape disqualifies it,
   and the reason is kept.
2. Score = weighted geometric mean over shapes of time / best time at that
   shape (1.0 = best everywhere).
3. vLLM's static choice is kept when its score is within the measured noise
   margin of the best score; without one, among backends within the noise
   margin of the best, a fixed preference (the registry's order) picks, so
   that decisions do not flip between runs or nodes on noise.
4. Anomalies: a backend whose score at one head count departs by more than
   20% from the trend of its neighbouring head counts, and a vLLM static
   choice more than 10% slower than the fastest backend vLLM runs.
5. Engines: each engine is handed the fastest backend whose timed kernel is
   the one it runs under that name (`Decision.engine_best`). Our kernel reaches
   vLLM through our plugin, which launches it its own way (vLLM's max_seq_len,
   no host lengths); that launch is timed at every shape too, and scored
   against the same per-shape best (`Decision.plugin_scores`).

Pure functions of records: no torch, no store, no GPU.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from mla_tune.backends.device import SoftwareFingerprint
from mla_tune.backends.engine_names import engine_best, vllm_gap
from mla_tune.store.records import Decision, DecisionKey, Measurement, ShapeWinner

# The noise margin is the measured relative confidence half-widths of the two
# scores added, clamped: never below 0.5% (a CI from few samples understates
# drift between runs), never above 2% (the decision-quality promise is "the
# stored winner scores within 2% of the best"; a wider band would break it).
NOISE_FLOOR = 0.005
NOISE_CAP = 0.02
ANOMALY_THRESHOLD = 0.20
# vLLM's static choice losing by more than this to vLLM's own best is worth an operator's attention.
STATIC_LOSS_THRESHOLD = 0.10
_DISQUALIFYING = ("failed", "incorrect", "timeout", "ineligible")


def preference(backend: str) -> tuple:
    """A fixed order among backends the noise cannot separate: the registry's order, then by name."""
    from mla_tune.backends.registry import BACKENDS

    order = list(BACKENDS)
    return (order.index(backend), backend) if backend in BACKENDS else (len(order), backend)


class NoDecision(ValueError):
    """No backend ran correctly at any shape of the key; the message says why."""


def _rel_halfwidth(m: Measurement) -> float:
    if m.ci_low_ms is None or m.ci_high_ms is None or not m.median_ms:
        return 0.0
    return max(0.0, (m.ci_high_ms - m.ci_low_ms) / (2.0 * m.median_ms))


@dataclass
class _Evidence:
    """One key's measurements gathered: median time and mean relative noise per (backend, shape), failures, GPUs."""

    median: dict[tuple[str, tuple[int, int]], float]
    noise: dict[tuple[str, tuple[int, int]], float]
    failures: dict[str, str]
    gpus: set[str]
    engine: dict[tuple[str, tuple[int, int]], float]   # a refined backend's launch as our vLLM backend makes it


def _gather(key: DecisionKey, measurements: Iterable[Measurement], failures: dict[str, str]) -> _Evidence:
    """Correct times of `key` by (backend, shape), several GPUs' combined by their median; the first
    disqualifying outcome of each backend goes to `failures`."""
    times: dict[tuple[str, tuple[int, int]], list[float]] = defaultdict(list)
    noise: dict[tuple[str, tuple[int, int]], list[float]] = defaultdict(list)
    engine: dict[tuple[str, tuple[int, int]], list[float]] = defaultdict(list)
    gpus: set[str] = set()
    for m in measurements:
        if m.key != key:
            continue
        if m.gpu_uuid:
            gpus.add(m.gpu_uuid)
        shape = (m.batch_size, m.kv_len)
        if m.status == "ok" and m.median_ms is not None and m.median_ms > 0:
            times[(m.backend, shape)].append(m.median_ms)
            noise[(m.backend, shape)].append(_rel_halfwidth(m))
            engine_ms = (m.params or {}).get("engine_median_ms")
            if isinstance(engine_ms, (int, float)) and engine_ms > 0:
                engine[(m.backend, shape)].append(float(engine_ms))
        elif m.status in _DISQUALIFYING and m.backend not in failures:
            failures[m.backend] = (f"{m.status} at batch {m.batch_size} x kv_len {m.kv_len}: "
                                   f"{m.reason or 'no reason recorded'}")
    return _Evidence({k: statistics.median(v) for k, v in times.items()},
                     {k: statistics.mean(v) for k, v in noise.items()}, failures, gpus,
                     {k: statistics.median(v) for k, v in engine.items()})


def _qualified(key: DecisionKey, ev: _Evidence, weights: Mapping[tuple[int, int], float]) -> tuple[list[str], list]:
    """(backends that ran correctly at every covered shape, the covered shapes); a backend missing a shape the
    others were scored on is disqualified with a reason. Raises NoDecision when none qualifies."""
    shapes = sorted({shape for _, shape in ev.median if weights.get(shape, 0.0) > 0})
    if not shapes:
        reasons = "; ".join(f"{b}: {r}" for b, r in sorted(ev.failures.items())) or "nothing was measured"
        raise NoDecision(f"no backend has a correct time for {key.label} ({reasons})")
    backends = sorted({b for b, _ in ev.median} - set(ev.failures))
    # Shapes nobody qualified reached are dropped (a skipped or unfinished shape).
    covered = [s for s in shapes if any((b, s) in ev.median for b in backends)]
    for b in backends:
        missing = [s for s in covered if (b, s) not in ev.median]
        if missing:
            ev.failures[b] = f"not measured at batch {missing[0][0]} x kv_len {missing[0][1]}"
    backends = [b for b in backends if b not in ev.failures]
    if not backends:
        reasons = "; ".join(f"{b}: {r}" for b, r in sorted(ev.failures.items()))
        raise NoDecision(f"no backend ran correctly at every shape of {key.label} ({reasons})")
    return backends, covered


def _scores(ev: _Evidence, backends: list[str], covered: list, weights) -> tuple[dict, dict, dict]:
    """(score, weighted mean relative noise, per-shape best time) over the covered shapes."""
    total_w = sum(weights[s] for s in covered)
    best = {s: min(ev.median[(b, s)] for b in backends) for s in covered}
    scores, noise_of = {}, {}
    for b in backends:
        scores[b] = math.exp(sum(weights[s] * math.log(ev.median[(b, s)] / best[s]) for s in covered) / total_w)
        noise_of[b] = sum(weights[s] * ev.noise[(b, s)] for s in covered) / total_w
    return scores, noise_of, best


def _plugin_scores(ev: _Evidence, backends: list[str], *, covered: list, weights,
                   best: Mapping[tuple[int, int], float]) -> dict[str, float]:
    """{backend: score of its launch as our vLLM backend makes it} for each backend with that launch timed at every
    covered shape: the weighted geometric mean of its time over the same per-shape best the scores use."""
    total_w = sum(weights[s] for s in covered)
    return {b: math.exp(sum(weights[s] * math.log(ev.engine[(b, s)] / best[s]) for s in covered) / total_w)
            for b in backends if all((b, s) in ev.engine for s in covered)}


def decide(key: DecisionKey, measurements: Iterable[Measurement], *,
           weights: Mapping[tuple[int, int], float] | None = None,
           static_choice: str | None = None,
           fingerprint: SoftwareFingerprint = SoftwareFingerprint(),
           decided_at: str = "",
           extra_failures: Mapping[str, str] | None = None) -> Decision:
    """Apply the decision rule to one key's measurements (from one or several identical GPUs).

    Args:
        key: the decision key; measurements of other keys are ignored.
        measurements: every attempt at this key; several GPUs' times for the
            same (backend, shape) are combined by their median.
        weights: (batch_size, kv_len) -> weight; missing shapes weigh 0,
            None = uniform over the measured shapes.
        static_choice: vLLM's pick for this key (kept when within noise).
        fingerprint: the software the measurements were taken with.
        decided_at: ISO 8601 timestamp to store.
        extra_failures: backend -> reason for backends that never reached a
            shape (ineligible before timing).

    Raises:
        NoDecision: no backend has a correct time at any weighted shape.
    """
    ev = _gather(key, measurements, dict(extra_failures or {}))
    if weights is None:
        weights = {shape: 1.0 for _, shape in ev.median}
    backends, covered = _qualified(key, ev, weights)
    scores, noise_of, best = _scores(ev, backends, covered, weights)
    ranked = sorted(backends, key=lambda b: (scores[b], b))
    fastest = ranked[0]

    def noise_between(b: str) -> float:
        return min(NOISE_CAP, max(NOISE_FLOOR, noise_of[b] + noise_of[fastest]))

    def within_noise(b: str) -> bool:
        return scores[b] <= scores[fastest] * (1.0 + noise_between(b))

    winner, kept_static = fastest, False
    static_score = scores.get(static_choice) if static_choice else None
    if static_score is not None and static_choice != fastest and within_noise(static_choice):
        winner, kept_static = static_choice, True
    elif static_choice != fastest:
        # No static choice to keep: among backends the noise cannot tell apart, a fixed
        # preference picks, so that noise alone never flips a decision between runs or nodes.
        winner = min((b for b in ranked if within_noise(b)), key=preference)
    noise_margin = noise_between(winner if winner != fastest else
                                 (static_choice if static_score is not None else fastest))
    others = [b for b in ranked if b != winner]
    runner_up = others[0] if others else None
    # Negative when a slower backend was kept within noise (the static choice or the preferred one).
    margin = scores[runner_up] / scores[winner] - 1.0 if runner_up else None
    if static_choice and static_choice not in scores and static_choice not in ev.failures:
        ev.failures[static_choice] = "vLLM's static choice was not timed (mla-tune has no adapter for it here)"
    per_shape = tuple(ShapeWinner(s[0], s[1], min(backends, key=lambda b: (ev.median[(b, s)], b)), best[s])
                      for s in covered)
    return Decision(key=key, winner=winner, static_choice=static_choice, scores=scores,
                    runner_up=runner_up, margin=margin, static_score=static_score,
                    noise_margin=noise_margin, kept_static=kept_static, per_shape=per_shape,
                    failures=ev.failures, fingerprint=fingerprint, gpu_uuids=tuple(sorted(ev.gpus)),
                    decided_at=decided_at, engine_best=engine_best(scores),
                    plugin_scores=_plugin_scores(ev, backends, covered=covered, weights=weights,
                                                  best=best))


def family(key: DecisionKey) -> tuple:
    """Everything of a key but the head count: keys of one family form a TP sweep."""
    return (key.sku, key.compute_capability, key.query_dtype, key.kv_cache_dtype, key.geometry,
            key.page_size, key.topk, key.q_len)


def find_anomalies(decisions: Sequence[Decision], *,
                   threshold: float = ANOMALY_THRESHOLD) -> dict[DecisionKey, list[str]]:
    """Flag backends whose score at one head count departs from the trend of its neighbours.

    Within each family (same key but heads), for each backend and each
    interior head count h (one smaller and one larger head count measured),
    the trend is the log-log interpolation of the backend's scores at the two
    neighbours; a score more than `threshold` above or below it is an anomaly.

    Returns:
        key -> sentences, only for keys with anomalies.
    """
    groups: dict[tuple, list[Decision]] = defaultdict(list)
    for d in decisions:
        groups[family(d.key)].append(d)
    found: dict[DecisionKey, list[str]] = defaultdict(list)
    for group in groups.values():
        group = sorted({d.key.num_heads: d for d in group}.values(), key=lambda d: d.key.num_heads)
        for i in range(1, len(group) - 1):
            lo, mid, hi = group[i - 1], group[i], group[i + 1]
            for backend, score in sorted(mid.scores.items()):
                if backend not in lo.scores or backend not in hi.scores:
                    continue
                x0, x, x1 = (math.log(d.key.num_heads) for d in (lo, mid, hi))
                t = (x - x0) / (x1 - x0)
                trend = math.exp((1 - t) * math.log(lo.scores[backend]) + t * math.log(hi.scores[backend]))
                departure = score / trend - 1.0
                if abs(departure) > threshold:
                    word = "above" if departure > 0 else "below"
                    found[mid.key].append(
                        f"{backend} at {mid.key.num_heads} heads scores {score:.2f}x the per-shape best, "
                        f"{abs(departure):.0%} {word} its trend from {lo.key.num_heads} heads "
                        f"({lo.scores[backend]:.2f}x) and {hi.key.num_heads} heads ({hi.scores[backend]:.2f}x)")
    return dict(found)


def static_loss(decision: Decision, *, threshold: float = STATIC_LOSS_THRESHOLD) -> str | None:
    """A sentence when vLLM's static choice takes more than (1 + threshold) times the time of the fastest
    backend vLLM runs, at this key; None otherwise (or when either was not scored)."""
    gap = vllm_gap(decision)
    if gap is None or gap.static_over_best is None or gap.static_over_best <= 1.0 + threshold:
        return None
    return (f"vLLM's static choice {gap.static} takes {gap.static_over_best:.2f}x the time of vLLM's fastest "
            f"backend {gap.best} at {decision.key.num_heads} heads")


def with_anomalies(decisions: Sequence[Decision]) -> list[Decision]:
    """The same decisions with `anomalies` recomputed: departures from the head-count trend, and a
    static choice that loses to vLLM's own best."""
    found = find_anomalies(decisions)
    out = []
    for d in decisions:
        notes = list(found.get(d.key, ()))
        loss = static_loss(d)
        if loss:
            notes.append(loss)
        out.append(replace(d, anomalies=tuple(notes)))
    return out
