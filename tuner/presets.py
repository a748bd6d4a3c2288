"""What to tune: model presets, the TP sweep, KV dtypes and batch x kv_len grids.

A `TuneSpec` is the plain description of a tune request (which models, TP
sizes, KV dtypes, grid level, workload weights); `expand_keys` turns it into
one `KeyWork` per decision key: the decode `Problem`, its shapes and the
weight of each shape in the decision rule.

The grids follow vLLM's attention benchmark (`benchmarks/attention_benchmarks`):
decode batches 1 to 128, contexts 512 to 32k, with the benchmark's
"32 requests at 16k and 32k" long-context points.
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from mla_tune.backends.problem import DEEPSEEK, Geometry, Problem, Shape, normalize_kv_cache_dtype


@dataclass(frozen=True)
class ModelPreset:
    """The MLA facts of one model that matter to decode attention."""

    name: str
    num_heads: int                 # attention heads of the whole model (TP=1)
    geometry: Geometry = DEEPSEEK
    topk: int | None = None        # sparse top-k (DeepSeek sparse attention), None for dense
    description: str = ""


MODELS: dict[str, ModelPreset] = {p.name: p for p in (
    ModelPreset("deepseek-v3", 128, description="DeepSeek-V3, dense MLA"),
    ModelPreset("deepseek-r1", 128, description="DeepSeek-R1, dense MLA (same attention as V3)"),
    ModelPreset("deepseek-v3.2", 128, topk=2048, description="DeepSeek-V3.2, sparse top-k 2048"),
    ModelPreset("kimi-k2", 64, description="Kimi K2 / K2.5, dense MLA with 64 heads"),
    ModelPreset("deepseek-v2-lite", 16, description="DeepSeek-V2-Lite, 16 heads"),
    ModelPreset("glm-5", 64, Geometry(512, 64, 192, 256), topk=2048,
                description="GLM-5, qk_nope 192, sparse top-k 2048"),
)}
# The default tune: DeepSeek-V3's dense MLA and DeepSeek-V3.2's sparse MLA, whose TP sweep is where vLLM's
# static sparse choice is known to lose (64 heads per rank, TP 2).
DEFAULT_MODELS = ("deepseek-v3", "deepseek-v3.2")
DEFAULT_TPS = (1, 2, 4, 8)
DEFAULT_KV_CACHE_DTYPES = ("bf16", "fp8")

# Grid levels: (batch sizes, kv lengths, extra (batch, kv_len) points).
# quick: 6 shapes; default: 15 + 2 long-context points; thorough: 8 x 7.
GRIDS: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[int, int], ...]]] = {
    "quick": ((1, 16, 128), (1024, 8192), ()),
    "default": ((1, 4, 16, 64, 128), (1024, 4096, 16384), ((32, 32768),)),
    "thorough": ((1, 2, 4, 8, 16, 32, 64, 128), (512, 1024, 2048, 4096, 8192, 16384, 32768), ()),
}

# Sparse decode reads top-k tokens whatever the context, so a sparse key times each batch size at one
# long context (DeepSeek-V3.2's top-k 2048 of 32k in the default grid) instead of the dense contexts.
SPARSE_KV_LENS: dict[str, tuple[int, ...]] = {"quick": (8192,), "default": (32768,), "thorough": (8192, 32768)}

# Seconds the timing harness may spend on one shape (all backends interleaved).
SHAPE_TIME_CAP_S = {"quick": 0.3, "default": 0.6, "thorough": 2.0}


class SpecError(ValueError):
    """Bad tune input (unknown preset, empty grid, bad workload file): exit status 2."""


def parse_model(name: str, *, num_heads: int | None = None) -> ModelPreset:
    """Return the preset called `name`, or a custom geometry.

    A custom geometry is written `custom:RANK/ROPE/NOPE/V` (kv_lora_rank,
    qk_rope_head_dim, qk_nope_head_dim, v_head_dim), optionally followed by
    `:topk=N` and `:heads=N`; for example `custom:512/64/192/256:heads=64`.
    Without `heads=` it uses `num_heads` or 128.

    Raises:
        SpecError: unknown preset or malformed custom geometry.
    """
    text = str(name).strip().lower()
    if text in MODELS:
        return MODELS[text]
    if text == "custom" or text.startswith("custom:"):
        parts = text.split(":")[1:]
        geometry, topk, heads = DEEPSEEK, None, num_heads or 128
        try:
            for part in parts:
                if part.startswith("topk="):
                    topk = int(part[5:]) or None
                elif part.startswith("heads="):
                    heads = int(part[6:])
                elif part:
                    rank, rope, nope, v = (int(x) for x in part.split("/"))
                    geometry = Geometry(rank, rope, nope, v)
        except ValueError:
            raise SpecError(f"bad custom geometry {name!r}; expected custom:RANK/ROPE/NOPE/V"
                            f"[:topk=N][:heads=N], e.g. custom:512/64/192/256:heads=64") from None
        if heads <= 0 or min(geometry.kv_lora_rank, geometry.qk_rope_head_dim,
                             geometry.qk_nope_head_dim, geometry.v_head_dim) <= 0:
            raise SpecError(f"bad custom geometry {name!r}: every dimension and heads must be positive")
        return ModelPreset("custom", heads, geometry, topk, description=f"custom {geometry.label}")
    raise SpecError(f"unknown model preset {name!r}; known: {', '.join(sorted(MODELS))}, custom:RANK/ROPE/NOPE/V")


def heads_per_rank(model_heads: int, tps) -> list[tuple[int, int]]:
    """(tp, heads per rank) for each TP that divides the heads and leaves at least one head."""
    return [(tp, model_heads // tp) for tp in tps if tp >= 1 and model_heads // tp >= 1
            and model_heads % tp == 0]


@dataclass(frozen=True)
class Workload:
    """Weights of batch sizes and contexts (for example from a serving trace).

    Either `batch_weights` / `kv_len_weights` (a value's weight goes to the
    nearest grid point, in log space; a shape's weight is the product), or
    explicit `shapes` [(batch, kv_len, weight)] that replace the grid.
    """

    batch_weights: dict[int, float] = field(default_factory=dict)
    kv_len_weights: dict[int, float] = field(default_factory=dict)
    shapes: tuple[tuple[int, int, float], ...] = ()
    source: str = ""


def _weights(table, what: str, path) -> dict[int, float]:
    if not isinstance(table, dict) or not table:
        raise SpecError(f"workload file {path}: {what} must be a non-empty table of value = weight")
    out = {}
    for k, v in table.items():
        try:
            key, weight = int(k), float(v)
        except (TypeError, ValueError):
            raise SpecError(f"workload file {path}: {what} entry {k!r} = {v!r} is not integer = number") from None
        if key <= 0 or weight < 0 or not math.isfinite(weight):
            raise SpecError(f"workload file {path}: {what} entry {k} = {v} must be positive = non-negative")
        out[key] = weight
    if sum(out.values()) <= 0:
        raise SpecError(f"workload file {path}: {what} weights sum to zero")
    return out


def load_workload(path) -> Workload:
    """Read a workload profile (JSON or TOML, by extension; JSON is tried first otherwise).

    Format (JSON shown; TOML has the same keys)::

        {"batch_size": {"1": 0.2, "16": 0.5, "64": 0.3},
         "kv_len": {"2048": 0.6, "16384": 0.4}}
        or {"shapes": [{"batch_size": 32, "kv_len": 4096, "weight": 2.0}, ...]}

    Raises:
        SpecError: unreadable, unparseable or meaningless file.
    """
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise SpecError(f"cannot read workload file {path}: {exc.strerror or exc}") from None
    data = None
    errors = []
    parsers = [("TOML", tomllib.loads), ("JSON", json.loads)]
    if p.suffix.lower() != ".toml":
        parsers.reverse()
    for fmt, parse in parsers:
        try:
            data = parse(text)
            break
        except (ValueError, tomllib.TOMLDecodeError) as exc:
            errors.append(f"{fmt}: {exc}")
    if not isinstance(data, dict):
        raise SpecError(f"workload file {path} does not parse ({'; '.join(errors) or 'not a table'})")
    if "shapes" in data:
        shapes = []
        rows = data["shapes"]
        if not isinstance(rows, list) or not rows:
            raise SpecError(f"workload file {path}: shapes must be a non-empty list")
        for row in rows:
            try:
                b, n, w = int(row["batch_size"]), int(row["kv_len"]), float(row.get("weight", 1.0))
            except (TypeError, KeyError, ValueError):
                raise SpecError(f"workload file {path}: shape {row!r} needs integer batch_size and kv_len") from None
            if b <= 0 or n <= 0 or w < 0:
                raise SpecError(f"workload file {path}: shape {row!r} must have positive sizes and weight >= 0")
            shapes.append((b, n, w))
        if sum(w for _, _, w in shapes) <= 0:
            raise SpecError(f"workload file {path}: shape weights sum to zero")
        return Workload(shapes=tuple(shapes), source=str(path))
    unknown = set(data) - {"batch_size", "kv_len"}
    if unknown or not data:
        raise SpecError(f"workload file {path}: expected keys batch_size and kv_len (or shapes), "
                        f"got {', '.join(sorted(data)) or 'nothing'}")
    return Workload(batch_weights=_weights(data["batch_size"], "batch_size", path) if "batch_size" in data else {},
                    kv_len_weights=_weights(data["kv_len"], "kv_len", path) if "kv_len" in data else {},
                    source=str(path))


def _nearest(value: int, grid) -> int:
    return min(grid, key=lambda g: (abs(math.log(g) - math.log(value)), g))


def shape_grid(level: str, workload: Workload | None = None, *, sparse: bool = False) -> list[tuple[Shape, float]]:
    """The (shape, weight) pairs of a grid level; weights sum to 1.

    A sparse grid has the level's batch sizes at `SPARSE_KV_LENS` contexts (a workload's explicit shapes
    replace either grid).

    Raises:
        SpecError: unknown level, or a workload that gives every shape weight 0.
    """
    if level not in GRIDS:
        raise SpecError(f"unknown grid level {level!r}; known: {', '.join(GRIDS)}")
    if workload is not None and workload.shapes:
        pairs = [(Shape(b, n), w) for b, n, w in workload.shapes]
    else:
        batches, kv_lens, extra = GRIDS[level]
        if sparse:
            kv_lens, extra = SPARSE_KV_LENS[level], ()
        points = [(b, n) for b in batches for n in kv_lens] + [p for p in extra if p not in
                                                                  {(b, n) for b in batches for n in kv_lens}]
        bw = {b: 1.0 for b, _ in points}
        nw = {n: 1.0 for _, n in points}
        if workload is not None and workload.batch_weights:
            grid_b = sorted(bw)
            bw = dict.fromkeys(grid_b, 0.0)
            for b, w in workload.batch_weights.items():
                bw[_nearest(b, grid_b)] += w
        if workload is not None and workload.kv_len_weights:
            grid_n = sorted(nw)
            nw = dict.fromkeys(grid_n, 0.0)
            for n, w in workload.kv_len_weights.items():
                nw[_nearest(n, grid_n)] += w
        pairs = [(Shape(b, n), bw[b] * nw[n]) for b, n in points]
    pairs = [(s, w) for s, w in pairs if w > 0]
    total = sum(w for _, w in pairs)
    if not pairs or total <= 0:
        raise SpecError("the shape grid is empty (every shape has weight 0)")
    return [(s, w / total) for s, w in pairs]


@dataclass(frozen=True)
class TuneSpec:
    """One tune request, as the CLI parsed it."""

    models: tuple[str, ...] = DEFAULT_MODELS
    tps: tuple[int, ...] = DEFAULT_TPS
    heads: tuple[int, ...] = ()                # explicit heads per rank; replaces the TP sweep
    kv_cache_dtypes: tuple[str, ...] = DEFAULT_KV_CACHE_DTYPES
    level: str = "default"
    workload: Workload | None = None
    mtp: bool = False                          # also tune q_len 2 (multi-token prediction)
    query_dtype: str = "bf16"
    page_size: int = 64

    @property
    def preset_label(self) -> str:
        return f"{','.join(self.models)}/{self.level}" + ("/mtp" if self.mtp else "")


@dataclass(frozen=True)
class KeyWork:
    """One decision key's worth of work: its problem, shapes with weights, and how much it matters."""

    problem: Problem
    shapes: tuple[Shape, ...]
    weights: tuple[float, ...]
    tp: int | None
    model: str
    value: float                               # higher = measured earlier


# How much a key matters, for ordering under a budget. Wide deployments run
# DeepSeek-class models at TP 8 and 4; TP 2 (64 heads) is where FlashInfer's
# sparse MLA misbehaved, so it comes before TP 1. FP8 KV is where static
# choices are most often wrong on Hopper (REFERENCE.md section 5).
TP_VALUE = {8: 1.0, 4: 0.9, 2: 0.85, 1: 0.6}
KV_VALUE = {"bf16": 1.0, "fp8_e4m3": 0.95}


def expand_keys(spec: TuneSpec) -> list[KeyWork]:
    """Every key the spec asks for, most valuable first, without duplicates.

    Raises:
        SpecError: unknown model, no TP that leaves a head, bad dtype, empty grid.
    """
    grids = {sparse: shape_grid(spec.level, spec.workload, sparse=sparse) for sparse in (False, True)}
    try:
        kvs = [normalize_kv_cache_dtype(d) for d in spec.kv_cache_dtypes]
    except ValueError as exc:
        raise SpecError(str(exc)) from None
    if not kvs:
        raise SpecError("no KV-cache dtype given")
    out: dict[tuple, KeyWork] = {}
    for model_name in spec.models:
        model = parse_model(model_name, num_heads=spec.heads[0] if spec.heads else None)
        if spec.heads:
            pairs = [(None, h) for h in spec.heads]
            if any(h <= 0 for h in spec.heads):
                raise SpecError(f"--heads must be positive integers, got {list(spec.heads)}")
        else:
            pairs = heads_per_rank(model.num_heads, spec.tps)
            if not pairs:
                raise SpecError(f"no TP in {list(spec.tps)} divides {model.name}'s {model.num_heads} heads "
                                f"into at least one head per rank")
        for q_len in ((1, 2) if spec.mtp else (1,)):
            for tp, heads in pairs:
                for kv in kvs:
                    try:
                        problem = Problem(num_heads=heads, kv_cache_dtype=kv, query_dtype=spec.query_dtype,
                                          geometry=model.geometry, page_size=spec.page_size,
                                          topk=model.topk, q_len=q_len)
                    except ValueError as exc:
                        raise SpecError(str(exc)) from None
                    value = TP_VALUE.get(tp, 0.8) * KV_VALUE.get(kv, 0.5) * (1.0 if q_len == 1 else 0.5)
                    ident = (problem,)
                    grid = grids[problem.sparse]
                    if ident not in out:
                        out[ident] = KeyWork(problem, tuple(s for s, _ in grid), tuple(w for _, w in grid),
                                             tp, model.name, value)
    # Stable: equal values keep the spec's order.
    return sorted(out.values(), key=lambda k: -k.value)
