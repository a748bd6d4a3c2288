"""The plain values that describe an MLA decode problem: geometry, dtypes, device.

Nothing here imports torch: these frozen dataclasses cross every package
boundary (backends, tuner, store, public API), and the runtime lookup of a
serving engine must stay free of GPU libraries.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

# Canonical KV-cache dtype names stored in the database and used in keys.
KV_CACHE_DTYPES = ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla",
                   "fp8_per_token_head", "int8_per_token_head", "nvfp4")
QUERY_DTYPES = ("bf16", "fp16")
# vLLM's fp8_ds_mla row: 512 e4m3 latent values, a float32 scale per DS_MLA_GROUP of them, 64 bf16 RoPE values.
DS_MLA_GROUP = 128
DS_MLA_BYTES = 512 + 4 * (512 // DS_MLA_GROUP) + 2 * 64

# Every spelling vLLM's `--kv-cache-dtype` accepts, plus the short ones,
# mapped to the canonical name. "auto" means "the model's dtype", bf16 for
# every model this tool targets.
_KV_CACHE_SPELLINGS = {
    "auto": "bf16",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3",
    "fp8_inc": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2",
    "fp8_ds_mla": "fp8_ds_mla",
    "fp8_per_token_head": "fp8_per_token_head",
    "fp8_e4m3_per_token_head": "fp8_per_token_head",
    "int8_per_token_head": "int8_per_token_head",
    "nvfp4": "nvfp4",
}
_QUERY_SPELLINGS = {"bf16": "bf16", "bfloat16": "bf16", "auto": "bf16",
                    "fp16": "fp16", "float16": "fp16", "half": "fp16"}


def normalize_kv_cache_dtype(spelling: str) -> str:
    """Return the canonical KV-cache dtype for any accepted spelling.

    Args:
        spelling: vLLM's `--kv-cache-dtype` value (`auto`, `fp8`, `fp8_e5m2`,
            `fp8_ds_mla`, ...) or a short name (`bf16`, `fp16`).

    Raises:
        ValueError: the spelling is unknown; the message lists the accepted ones.
    """
    if not isinstance(spelling, str):
        raise ValueError(f"kv_cache_dtype must be a string, got {spelling!r}")
    canonical = _KV_CACHE_SPELLINGS.get(spelling.strip().lower())
    if canonical is None:
        accepted = ", ".join(sorted(_KV_CACHE_SPELLINGS))
        raise ValueError(f"unknown kv_cache_dtype {spelling!r}; accepted: {accepted}")
    return canonical


def is_vllm_kv_cache_dtype(spelling: str) -> bool:
    """True when `spelling` is a spelling this module accepts."""
    return isinstance(spelling, str) and spelling.strip().lower() in _KV_CACHE_SPELLINGS


def is_quantized_kv_cache(spelling: str) -> bool:
    """vLLM's test for a quantized cache: starts with fp8, ends with per_token_head, or nvfp4."""
    raw = spelling.strip().lower()
    return raw.startswith("fp8") or raw.endswith("per_token_head") or raw == "nvfp4"


def normalize_query_dtype(spelling: str) -> str:
    """Return `bf16` or `fp16` for the model (query) dtype, else raise ValueError."""
    canonical = _QUERY_SPELLINGS.get(str(spelling).strip().lower())
    if canonical is None:
        raise ValueError(f"unknown query dtype {spelling!r}; accepted: bf16, fp16")
    return canonical


def kv_bytes_per_element(kv_cache_dtype: str) -> float:
    """Bytes one stored KV element occupies (fp8_ds_mla packs DS_MLA_BYTES per 576-wide token)."""
    return {"bf16": 2.0, "fp16": 2.0, "nvfp4": 0.5, "fp8_ds_mla": DS_MLA_BYTES / 576}.get(kv_cache_dtype, 1.0)


@dataclass(frozen=True)
class Geometry:
    """MLA dimensions of a model (absorbed decode sees kv_lora_rank + qk_rope_head_dim)."""

    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128

    @property
    def head_size(self) -> int:
        """Width of q and of one KV row in the absorbed form (576 for DeepSeek)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def sm_scale(self) -> float:
        """Softmax scale of the unabsorbed model: 1/sqrt(qk_nope + qk_rope)."""
        return 1.0 / math.sqrt(self.qk_nope_head_dim + self.qk_rope_head_dim)

    @property
    def label(self) -> str:
        return f"{self.kv_lora_rank}/{self.qk_rope_head_dim}/{self.qk_nope_head_dim}/{self.v_head_dim}"


DEEPSEEK = Geometry()


@dataclass(frozen=True)
class Problem:
    """Everything about a decode problem except batch and length (those are a Shape).

    Attributes:
        num_heads: query heads per rank (model heads / TP).
        kv_cache_dtype: canonical KV-cache dtype (see `normalize_kv_cache_dtype`).
        query_dtype: `bf16` or `fp16`.
        page_size: tokens per KV-cache page.
        topk: sparse top-k (2048 for DeepSeek-V3.2 and GLM-5); None for dense.
        q_len: query tokens per request (1; 2 with MTP).
    """

    num_heads: int
    kv_cache_dtype: str = "bf16"
    query_dtype: str = "bf16"
    geometry: Geometry = DEEPSEEK
    page_size: int = 64
    topk: int | None = None
    q_len: int = 1

    def __post_init__(self):
        if isinstance(self.num_heads, bool) or not isinstance(self.num_heads, int) or self.num_heads <= 0:
            raise ValueError(f"num_heads must be a positive integer, got {self.num_heads!r}")
        object.__setattr__(self, "kv_cache_dtype", normalize_kv_cache_dtype(self.kv_cache_dtype))
        object.__setattr__(self, "query_dtype", normalize_query_dtype(self.query_dtype))
        if not isinstance(self.page_size, int) or self.page_size <= 0:
            raise ValueError(f"page_size must be a positive integer, got {self.page_size!r}")
        if self.topk is not None and (not isinstance(self.topk, int) or self.topk <= 0):
            raise ValueError(f"topk must be a positive integer or None, got {self.topk!r}")
        if not isinstance(self.q_len, int) or not 1 <= self.q_len <= 8:
            raise ValueError(f"q_len must be an integer in 1..8, got {self.q_len!r}")

    @property
    def sparse(self) -> bool:
        return self.topk is not None

    def replace(self, **changes) -> Problem:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Shape:
    """Batch size and KV length of one timed decode step (plus top-k when sparse)."""

    batch_size: int
    kv_len: int

    def __post_init__(self):
        for name in ("batch_size", "kv_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class DeviceSpec:
    """What eligibility needs to know about a GPU: its name and compute capability."""

    name: str
    compute_capability: tuple[int, int]

    def __post_init__(self):
        cc = self.compute_capability
        if (not isinstance(cc, tuple) or len(cc) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 100 for x in cc)):
            raise ValueError(f"compute_capability must be a (major, minor) pair of integers, got {cc!r}")

    @property
    def cc_label(self) -> str:
        return f"{self.compute_capability[0]}.{self.compute_capability[1]}"


def parse_compute_capability(text) -> tuple[int, int]:
    """Parse `9.0`, `"9.0"`, `(9, 0)` or `90` into (major, minor); ValueError otherwise."""
    if isinstance(text, (tuple, list)) and len(text) == 2:
        major, minor = text
    elif isinstance(text, str) and "." in text:
        major, _, minor = text.strip().partition(".")
    elif isinstance(text, (int, str)) and str(text).strip().isdigit() and len(str(text).strip()) >= 2:
        digits = str(text).strip()
        major, minor = digits[:-1], digits[-1]
    else:
        raise ValueError(f"bad compute capability {text!r}; expected MAJOR.MINOR such as 9.0")
    try:
        pair = (int(major), int(minor))
    except (TypeError, ValueError):
        raise ValueError(f"bad compute capability {text!r}; expected MAJOR.MINOR such as 9.0") from None
    if not all(0 <= x < 100 for x in pair):
        raise ValueError(f"bad compute capability {text!r}; expected MAJOR.MINOR such as 9.0")
    return pair
