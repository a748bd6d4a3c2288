"""The fleet view: per SKU and key, the decision and the nodes and GPUs behind it; slow GPUs.

A GPU is an outlier when, over every (key, backend, shape) that at least
`min_gpus` GPUs of its SKU measured, its times are on geometric mean more
than `threshold` (default 10%) slower than the SKU's median GPU: a health
signal (clocks, cooling, power capping, a bad board), not a tuning result.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass

from mla_tune.store import provenance

OUTLIER_THRESHOLD = 0.10
OUTLIER_MIN_GPUS = 3


@dataclass(frozen=True)
class FleetRow:
    """One decision and the evidence behind it."""

    sku: str
    key_label: str
    num_heads: int
    kv_cache_dtype: str
    winner: str
    margin: float | None
    static_choice: str | None
    nodes: tuple[str, ...]
    gpus: tuple[str, ...]
    spread: float | None        # max over shapes of (slowest - fastest) / median of the winner across GPUs
    spread_shape: tuple[int, int] | None
    decided_at: str


@dataclass(frozen=True)
class OutlierGpu:
    sku: str
    gpu_uuid: str
    nodes: tuple[str, ...]
    slower: float               # geometric-mean time / SKU median - 1
    compared: int               # (key, backend, shape) points compared


@dataclass(frozen=True)
class FleetView:
    rows: tuple[FleetRow, ...]
    outliers: tuple[OutlierGpu, ...]


def _spread(times_by_gpu: dict[tuple[int, int], dict[str, float]]) -> tuple[float | None, tuple | None]:
    worst, where = None, None
    for shape, per_gpu in sorted(times_by_gpu.items()):
        if len(per_gpu) < 2:
            continue
        values = list(per_gpu.values())
        spread = (max(values) - min(values)) / statistics.median(values)
        if worst is None or spread > worst:
            worst, where = spread, shape
    return worst, where


def fleet_view(store, *, threshold: float = OUTLIER_THRESHOLD, min_gpus: int = OUTLIER_MIN_GPUS) -> FleetView:
    """Build the fleet view from everything in `store`."""
    newest = {}
    for d in store.decisions():
        if d.key not in newest or (d.decided_at, d.fingerprint.digest) > (newest[d.key].decided_at,
                                                                          newest[d.key].fingerprint.digest):
            newest[d.key] = d
    evidence = provenance.evidence(store)
    by_group = defaultdict(list)
    for ev in evidence:
        by_group[(ev.measurement.key, ev.fingerprint_digest)].append(ev)
    rows = []
    for key, d in newest.items():
        group = by_group.get((key, d.fingerprint.digest), [])
        winner_times: dict[tuple[int, int], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for ev in group:
            m = ev.measurement
            if m.backend == d.winner and m.status == "ok" and m.median_ms:
                winner_times[(m.batch_size, m.kv_len)][m.gpu_uuid].append(m.median_ms)
        per_gpu = {s: {g: statistics.median(v) for g, v in gpus.items()} for s, gpus in winner_times.items()}
        spread, shape = _spread(per_gpu)
        gpus = {ev.measurement.gpu_uuid for ev in group if ev.measurement.gpu_uuid} | set(d.gpu_uuids)
        rows.append(FleetRow(sku=key.sku, key_label=key.label, num_heads=key.num_heads,
                             kv_cache_dtype=key.kv_cache_dtype, winner=d.winner, margin=d.margin,
                             static_choice=d.static_choice,
                             nodes=tuple(sorted({ev.node for ev in group if ev.node})),
                             gpus=tuple(sorted(gpus)), spread=spread, spread_shape=shape,
                             decided_at=d.decided_at))
    rows.sort(key=lambda r: (r.sku, r.kv_cache_dtype, -r.num_heads, r.key_label))
    return FleetView(rows=tuple(rows), outliers=tuple(find_outliers(evidence, threshold=threshold,
                                                                    min_gpus=min_gpus)))


def find_outliers(evidence, *, threshold: float = OUTLIER_THRESHOLD,
                  min_gpus: int = OUTLIER_MIN_GPUS) -> list[OutlierGpu]:
    """GPUs markedly slower than their SKU's median GPU (see the module docstring)."""
    points: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    nodes: dict[str, set[str]] = defaultdict(set)
    for ev in evidence:
        m = ev.measurement
        if m.status == "ok" and m.median_ms and m.gpu_uuid:
            points[(m.key, m.backend, m.batch_size, m.kv_len)][m.gpu_uuid].append(m.median_ms)
            if ev.node:
                nodes[m.gpu_uuid].add(ev.node)
    logs: dict[tuple[str, str], list[float]] = defaultdict(list)
    for (key, *_), per_gpu in points.items():
        if len(per_gpu) < min_gpus:
            continue
        times = {g: statistics.median(v) for g, v in per_gpu.items()}
        center = statistics.median(times.values())
        for gpu, t in times.items():
            logs[(key.sku, gpu)].append(math.log(t / center))
    out = []
    for (sku, gpu), values in sorted(logs.items()):
        slower = math.exp(sum(values) / len(values)) - 1.0
        if slower > threshold:
            out.append(OutlierGpu(sku=sku, gpu_uuid=gpu, nodes=tuple(sorted(nodes.get(gpu, ()))),
                                  slower=slower, compared=len(values)))
    return sorted(out, key=lambda o: (o.sku, -o.slower, o.gpu_uuid))
