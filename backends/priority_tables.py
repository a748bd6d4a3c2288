"""vLLM's MLA backend priority at known vLLM versions, as data.

Each `PinnedPriority` is a copy of `_get_backend_priorities(use_mla=True, ...)`
in `vllm/platforms/cuda.py` at one vLLM version: the same list serves dense
and sparse models, and each backend's own validation later drops the ones
that do not fit. The branches are the same at every pinned version (compute
capability major 10, major 12, every other major); the lists, the "quantized
cache" test and the head-size placement of one sparse backend are the data.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QuantizedTest:
    """vLLM's `is_quantized_kv_cache` at one version, applied to a vLLM `--kv-cache-dtype` spelling."""

    prefixes: tuple[str, ...] = ()
    suffixes: tuple[str, ...] = ()
    names: frozenset[str] = frozenset()

    def __call__(self, spelling: str) -> bool:
        return spelling in self.names or spelling.startswith(self.prefixes) or spelling.endswith(self.suffixes)


@dataclass(frozen=True)
class PinnedPriority:
    """vLLM's MLA priority rule at one release or commit.

    Attributes:
        version: the release ("0.33.0") or the commit hash as far as it is known.
        is_release: True for a release, False for a commit.
        commit: the commit hash (as far as it is known) a commit prefix must match.
        kv_cache_dtypes: vLLM's own `--kv-cache-dtype` values at this version
            (mla-tune's spellings are accepted as well; empty when not recorded).
        quantized: vLLM's quantized-cache test at this version.
        sm100_dense: major 10, the list before the sparse tail.
        sm100_sparse_quantized: major 10 sparse tail for a quantized cache.
        sm100_sparse_few_heads: major 10 sparse tail, unquantized cache, at most `few_heads` heads.
        sm100_sparse_many_heads: major 10 sparse tail otherwise (heads unknown included).
        few_heads: the head count up to which `sm100_sparse_few_heads` applies.
        sm120: major 12, the whole list.
        other_dense: every other major, the list before the sparse tail.
        other_sparse: every other major, the sparse tail.
        head_size_backend: a backend put first in `other_sparse` when the head
            size equals `head_size_first`, last otherwise; None when absent.
        head_size_first: see `head_size_backend`.
    """

    version: str
    is_release: bool
    commit: str
    kv_cache_dtypes: frozenset[str]
    quantized: QuantizedTest
    sm100_dense: tuple[str, ...]
    sm100_sparse_quantized: tuple[str, ...]
    sm100_sparse_few_heads: tuple[str, ...]
    sm100_sparse_many_heads: tuple[str, ...]
    few_heads: int
    sm120: tuple[str, ...]
    other_dense: tuple[str, ...]
    other_sparse: tuple[str, ...]
    head_size_backend: str | None = None
    head_size_first: int | None = None

    @property
    def label(self) -> str:
        """How a sentence names it: "vLLM 0.33.0" or "vLLM commit 81be2e09aebf"."""
        return f"vLLM {self.version}" if self.is_release else f"vLLM commit {self.version}"

    def order(self, major: int, kv_cache_dtype: str, num_heads: int | None, head_size: int | None) -> list[str]:
        """The unfiltered MLA list for already validated arguments (`kv_cache_dtype` in vLLM's spelling)."""
        if major == 10:
            if self.quantized(kv_cache_dtype):
                tail = self.sm100_sparse_quantized
            elif num_heads is not None and num_heads <= self.few_heads:
                tail = self.sm100_sparse_few_heads
            else:
                tail = self.sm100_sparse_many_heads
            return [*self.sm100_dense, *tail]
        if major == 12:
            return list(self.sm120)
        tail = list(self.other_sparse)
        if self.head_size_backend is not None:
            if head_size == self.head_size_first:
                tail.insert(0, self.head_size_backend)
            else:
                tail.append(self.head_size_backend)
        return [*self.other_dense, *tail]


_SM100_DENSE = ("FLASHINFER_MLA", "TOKENSPEED_MLA", "CUTLASS_MLA", "FLASH_ATTN_MLA", "FLASHMLA", "TRITON_MLA")
_OTHER_DENSE = ("FLASH_ATTN_MLA", "FLASHMLA", "FLASHINFER_MLA", "TRITON_MLA")
_SM120 = ("TRITON_MLA", "FLASHINFER_MLA_SPARSE_SM120")

# REFERENCE.md section 1: vLLM main at 81be2e09aebf (2026-08-06).
COMMIT_81BE2E09 = PinnedPriority(
    version="81be2e09aebf", is_release=False, commit="81be2e09aebf", kv_cache_dtypes=frozenset(),
    quantized=QuantizedTest(prefixes=("fp8",), suffixes=("per_token_head",), names=frozenset({"nvfp4"})),
    sm100_dense=_SM100_DENSE,
    sm100_sparse_quantized=("FLASHINFER_MLA_SPARSE", "FLASHMLA_SPARSE"),
    sm100_sparse_few_heads=("FLASHINFER_MLA_SPARSE", "FLASHMLA_SPARSE"),
    sm100_sparse_many_heads=("FLASHMLA_SPARSE", "FLASHINFER_MLA_SPARSE"),
    few_heads=16, sm120=_SM120, other_dense=_OTHER_DENSE,
    other_sparse=("FLASH_ATTN_MLA_SPARSE", "FLASHMLA_SPARSE"),
)

# vLLM 0.33.0 (release of 2026-11): `_get_backend_priorities` and `get_kv_quant_mode` of its wheel.
RELEASE_0_33_0 = PinnedPriority(
    version="0.33.0", is_release=True, commit="4ba787ec9",   # the wheel's vllm/_version.py commit_id
    kv_cache_dtypes=frozenset({
        "auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla", "nvfp4_ds_mla",
        "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc", "octave_k3v4",
        "octave_k3v3", "octave_k3v3_compact", "ultraquant_4bit", "int4_per_token_head", "int8_per_token_head",
        "fp8_per_token_head", "nvfp4", "nvfp4_4over6"}),
    # Any mode but NONE: fp8* (per tensor), nvfp4* (incl. nvfp4_ds_mla), turboquant_*, octave_*,
    # ultraquant_4bit and the three per-token-head types, matched by name as vLLM does.
    quantized=QuantizedTest(prefixes=("fp8", "nvfp4", "turboquant_", "octave_"),
                            names=frozenset({"ultraquant_4bit", "int4_per_token_head", "int8_per_token_head",
                                             "fp8_per_token_head"})),
    sm100_dense=_SM100_DENSE,
    sm100_sparse_quantized=("FLASHINFER_MLA_SPARSE", "FLASHMLA_SPARSE"),
    sm100_sparse_few_heads=("FLASH_ATTN_MLA_SPARSE_FA4", "FLASHINFER_MLA_SPARSE", "FLASHMLA_SPARSE"),
    sm100_sparse_many_heads=("FLASHMLA_SPARSE", "FLASHINFER_MLA_SPARSE"),
    few_heads=16, sm120=_SM120, other_dense=_OTHER_DENSE,
    other_sparse=("FLASH_ATTN_MLA_SPARSE", "FLASHMLA_SPARSE"),
    # MLA head size is kv_lora_rank + qk_rope_head_dim: 512 for NoPE models, 576 for DeepSeek.
    head_size_backend="FLASHINFER_MLA_SPARSE_SM90", head_size_first=512,
)

PINNED: tuple[PinnedPriority, ...] = (RELEASE_0_33_0, COMMIT_81BE2E09)   # newest first
NEWEST = PINNED[0]
