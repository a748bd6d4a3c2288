"""The plain records the store persists: decision keys, measurements, decisions.

ORM rows never leave `store`; these frozen dataclasses are what the tuner
writes and what readers get back.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from mla_tune.backends.device import SoftwareFingerprint
from mla_tune.backends.problem import Geometry, Problem

# Outcomes of one (backend, shape) attempt; only "ok" can win.
STATUSES = ("ok", "ineligible", "failed", "incorrect", "timeout", "skipped")


@dataclass(frozen=True)
class DecisionKey:
    """Device SKU + compute capability + dtypes + heads + geometry + page size + sparsity + q_len."""

    sku: str
    compute_capability: str          # "9.0"
    query_dtype: str
    kv_cache_dtype: str
    num_heads: int
    geometry: str = "512/64/128/128"  # Geometry.label
    page_size: int = 64
    topk: int = 0                     # 0 = dense
    q_len: int = 1

    @classmethod
    def of(cls, sku: str, compute_capability: tuple[int, int], problem: Problem) -> DecisionKey:
        return cls(sku=sku, compute_capability=f"{compute_capability[0]}.{compute_capability[1]}",
                   query_dtype=problem.query_dtype, kv_cache_dtype=problem.kv_cache_dtype,
                   num_heads=problem.num_heads, geometry=problem.geometry.label,
                   page_size=problem.page_size, topk=problem.topk or 0, q_len=problem.q_len)

    def problem(self) -> Problem:
        rank, rope, nope, v = (int(x) for x in self.geometry.split("/"))
        return Problem(num_heads=self.num_heads, kv_cache_dtype=self.kv_cache_dtype,
                       query_dtype=self.query_dtype, geometry=Geometry(rank, rope, nope, v),
                       page_size=self.page_size, topk=self.topk or None, q_len=self.q_len)

    @property
    def label(self) -> str:
        sparse = f" top-k {self.topk}" if self.topk else ""
        mtp = f" q_len {self.q_len}" if self.q_len != 1 else ""
        return (f"{self.kv_cache_dtype} kv, {self.num_heads} heads, page {self.page_size}"
                f"{sparse}{mtp}, {self.geometry}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Measurement:
    """One backend at one shape of one key, on one GPU: a time or the reason it has none."""

    key: DecisionKey
    backend: str
    batch_size: int
    kv_len: int
    status: str                          # one of STATUSES
    median_ms: float | None = None
    ci_low_ms: float | None = None       # 95% confidence interval of the median
    ci_high_ms: float | None = None
    samples: int = 0
    rel_error: float | None = None       # ||out - ref|| / ||ref|| from the correctness gate
    reason: str = ""                     # why not ok, as a sentence
    gpu_uuid: str = ""
    sm_clock_mhz_before: int | None = None
    sm_clock_mhz_after: int | None = None
    temperature_c_before: int | None = None
    temperature_c_after: int | None = None
    measured_at: str = ""                # ISO 8601, UTC
    # A backend the tuner refines (our Triton kernel): the launch it was timed with, the fastest correct of its
    # candidate tiles: {"tile": Tile fields, "label", "default_label", "default_median_ms", "candidates",
    # "rejected": {label: why}}, and the launch our vLLM backend makes of it: "engine_median_ms" (None when it
    # failed or was wrong, "engine_reason" says why) with "engine_max_seq_len" (vLLM's max_seq_len it was
    # launched with). None for every other backend.
    params: dict | None = None

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} not in {STATUSES}")


@dataclass(frozen=True)
class ShapeWinner:
    batch_size: int
    kv_len: int
    backend: str
    median_ms: float


@dataclass(frozen=True)
class Decision:
    """The answer for one key, and why."""

    key: DecisionKey
    winner: str
    static_choice: str | None
    scores: dict[str, float]             # backend -> weighted geometric mean of time / best (1.0 = best)
    runner_up: str | None = None
    margin: float | None = None          # runner-up score / winner score - 1
    static_score: float | None = None
    noise_margin: float = 0.0            # relative noise the rule allowed (e.g. 0.02)
    kept_static: bool = False            # True when the static choice was kept within noise
    per_shape: tuple[ShapeWinner, ...] = ()
    anomalies: tuple[str, ...] = ()
    failures: dict[str, str] = field(default_factory=dict)   # backend -> why it could not win
    fingerprint: SoftwareFingerprint = SoftwareFingerprint()
    gpu_uuids: tuple[str, ...] = ()
    decided_at: str = ""                 # ISO 8601, UTC
    # {engine: the fastest backend that engine runs under its own name}; None when the decision did not
    # time the engines' own kernels (decided before it could), so no engine may be handed its answer.
    engine_best: dict[str, str] | None = None
    # {backend: score of the launch our vLLM plugin makes of it}, for each refined backend whose vLLM launch was
    # timed at every scored shape (the same weighted geometric mean against the same per-shape best); None
    # when the decision did not time that launch, so our kernel is never handed to vLLM on its strength.
    plugin_scores: dict[str, float] | None = None


RUN_STATUSES = ("running", "done", "failed", "interrupted")


@dataclass(frozen=True)
class Run:
    """One tuning run on one GPU of one node, as stored."""

    id: int
    sku: str
    gpu_uuid: str
    fingerprint_digest: str
    preset: str
    node: str
    status: str                          # one of RUN_STATUSES
    started_at: str                      # ISO 8601, UTC
    finished_at: str | None = None
