"""The registry: every backend name, its capabilities, and where its adapter lives.

Listing backends or checking eligibility loads no kernel library: adapters
are named as "module:Class" strings and imported on first use by
`load_adapter`.
"""

from __future__ import annotations

import enum
import importlib

from mla_tune.backends.capabilities import BackendInfo, Capabilities, eligibility_reasons
from mla_tune.backends.problem import DeviceSpec, Problem


class BackendName(str, enum.Enum):
    """Stable names stored in the database; renaming one needs a migration."""

    TRITON_MLA = "TRITON_MLA"
    TRITON_MLA_SPARSE = "TRITON_MLA_SPARSE"
    FLASHINFER_MLA = "FLASHINFER_MLA"
    FLASHINFER_MLA_SPARSE = "FLASHINFER_MLA_SPARSE"
    FLASHINFER_MLA_SPARSE_SM120 = "FLASHINFER_MLA_SPARSE_SM120"
    FLASHINFER_FA2_MLA = "FLASHINFER_FA2_MLA"
    FLASHINFER_FA3_MLA = "FLASHINFER_FA3_MLA"
    FLASHINFER_FA2_MLA_SPARSE = "FLASHINFER_FA2_MLA_SPARSE"
    FLASHINFER_FA3_MLA_SPARSE = "FLASHINFER_FA3_MLA_SPARSE"
    FLASHMLA = "FLASHMLA"
    FLASHMLA_SPARSE = "FLASHMLA_SPARSE"
    FLASH_ATTN_MLA = "FLASH_ATTN_MLA"
    FLASH_ATTN_MLA_SPARSE = "FLASH_ATTN_MLA_SPARSE"
    CUTLASS_MLA = "CUTLASS_MLA"
    TOKENSPEED_MLA = "TOKENSPEED_MLA"
    TORCH_REFERENCE = "TORCH_REFERENCE"


_BF16_FP16 = frozenset({"bf16", "fp16"})
_WITH_FP8 = frozenset({"bf16", "fp16", "fp8_e4m3"})
_FLASHINFER_HOPPER = dict(min_cc=(8, 0), kv_cache_dtypes=_WITH_FP8, fp8_needs_bf16_query=True,
                          fp8_cc_majors=frozenset({9}), required_modules=("flashinfer", "torch"))
# Triton has e4m3 (`fp8e4nv`) only from SM89: below it the FP8 kernels do not compile.
_TRITON = dict(min_cc=(8, 0), kv_cache_dtypes=_WITH_FP8, fp8_needs_bf16_query=True, fp8_min_cc=(8, 9),
               max_heads=128, max_q_len=4, required_modules=("triton", "torch"))
_SM100 = frozenset({10})

BACKENDS: dict[str, BackendInfo] = {info.name: info for info in (
    BackendInfo(
        "FLASHINFER_MLA",
        # FlashInfer 0.7.2 requires a bf16 `out` for trtllm-gen, hence a bf16 query.
        Capabilities(cc_majors=_SM100, query_dtypes=frozenset({"bf16"}), kv_cache_dtypes=_WITH_FP8,
                     page_sizes=frozenset({32, 64}),
                     qk_nope_head_dims=frozenset({64, 128, 192}), forbidden_heads=((65, 127),),
                     required_modules=("flashinfer",)),
        adapter="mla_tune.backends.flashinfer_blackwell:TrtllmGenMLA",
        vllm_name="FLASHINFER_MLA", sglang_name="trtllm_mla",
        summary="FlashInfer trtllm-gen decode (trtllm_batch_decode_with_kv_cache_mla), SM100/103"),
    BackendInfo(
        "FLASHINFER_MLA_SPARSE",
        Capabilities(cc_majors=_SM100, query_dtypes=frozenset({"bf16"}), kv_cache_dtypes=_WITH_FP8,
                     page_sizes=frozenset({32, 64}),
                     qk_nope_head_dims=frozenset({128, 192}), dense=False, sparse=True,
                     required_modules=("flashinfer",)),
        adapter="mla_tune.backends.flashinfer_blackwell:TrtllmGenSparseMLA",
        vllm_name="FLASHINFER_MLA_SPARSE",
        summary="FlashInfer trtllm-gen sparse decode (sparse_mla_top_k), SM100/103"),
    BackendInfo(
        "FLASHINFER_MLA_SPARSE_SM120",
        Capabilities(cc_majors=frozenset({12}), query_dtypes=frozenset({"bf16"}),
                     kv_cache_dtypes=frozenset({"bf16", "fp8_e4m3", "fp8_ds_mla"}),
                     page_sizes=frozenset({64, 256}), dense=False, sparse=True,
                     sparse_topks=frozenset({2048}), required_modules=("flashinfer",)),
        adapter="mla_tune.backends.flashinfer_blackwell:XqaSparseMLA",
        vllm_name="FLASHINFER_MLA_SPARSE_SM120",
        summary="FlashInfer sparse MLA for SM120/121"),
    BackendInfo(
        "FLASHINFER_FA2_MLA",
        Capabilities(**_FLASHINFER_HOPPER),
        adapter="mla_tune.backends.flashinfer_mla:FlashInferFA2",
        sglang_name=None,
        summary="FlashInfer BatchMLAPagedAttentionWrapper, backend fa2 (vLLM PR 36322)"),
    BackendInfo(
        "FLASHINFER_FA3_MLA",
        Capabilities(**{**_FLASHINFER_HOPPER, "min_cc": None, "cc_majors": frozenset({9})}),
        adapter="mla_tune.backends.flashinfer_mla:FlashInferFA3",
        sglang_name="flashinfer",
        summary="FlashInfer BatchMLAPagedAttentionWrapper, backend fa3 (SM90)"),
    BackendInfo(
        "FLASHINFER_FA2_MLA_SPARSE",
        Capabilities(**_FLASHINFER_HOPPER, dense=False, sparse=True),
        adapter="mla_tune.backends.flashinfer_mla:FlashInferFA2Sparse",
        summary="FlashInfer fa2 with page size 1 and the top-k positions as the page list"),
    BackendInfo(
        "FLASHINFER_FA3_MLA_SPARSE",
        Capabilities(**{**_FLASHINFER_HOPPER, "min_cc": None, "cc_majors": frozenset({9})},
                     dense=False, sparse=True),
        adapter="mla_tune.backends.flashinfer_mla:FlashInferFA3Sparse",
        summary="FlashInfer fa3 with page size 1 and the top-k positions as the page list"),
    BackendInfo(
        "FLASHMLA",
        Capabilities(cc_majors=frozenset({9}), kv_cache_dtypes=_WITH_FP8, page_sizes=frozenset({64}),
                     required_modules=("vllm",)),
        vllm_name="FLASHMLA", sglang_name="flashmla",
        summary="FlashMLA (vLLM third_party build)"),
    BackendInfo(
        "FLASHMLA_SPARSE",
        Capabilities(cc_majors=frozenset({9, 10}), query_dtypes=frozenset({"bf16"}),
                     kv_cache_dtypes=frozenset({"bf16", "fp8_e4m3", "fp8_ds_mla"}),
                     page_sizes=frozenset({64}), dense=False, sparse=True, required_modules=("vllm",)),
        vllm_name="FLASHMLA_SPARSE",
        summary="FlashMLA sparse (fp8 stored as fp8_ds_mla, 656 B/token)"),
    BackendInfo(
        "FLASH_ATTN_MLA",
        Capabilities(cc_majors=frozenset({9}), kv_cache_dtypes=_BF16_FP16, page_size_multiple=16,
                     required_modules=("vllm",)),
        vllm_name="FLASH_ATTN_MLA", sglang_name="fa3",
        summary="FlashAttention 3 with MLA (vllm-flash-attn)"),
    BackendInfo(
        "FLASH_ATTN_MLA_SPARSE",
        Capabilities(cc_majors=frozenset({9}), kv_cache_dtypes=_BF16_FP16, page_sizes=frozenset({64}),
                     dense=False, sparse=True, required_modules=("vllm",)),
        vllm_name="FLASH_ATTN_MLA_SPARSE",
        summary="FlashAttention 3 MLA with a top-k block table"),
    BackendInfo(
        "CUTLASS_MLA",
        Capabilities(cc_majors=_SM100, kv_cache_dtypes=_WITH_FP8, page_sizes=frozenset({128}),
                     max_heads=128, required_modules=("vllm",)),
        vllm_name="CUTLASS_MLA", sglang_name="cutlass_mla",
        summary="vLLM's CUTLASS SM100 MLA op (heads padded to 128)"),
    BackendInfo(
        "TOKENSPEED_MLA",
        Capabilities(cc_majors=_SM100, kv_cache_dtypes=frozenset({"fp8_e4m3"}),
                     page_sizes=frozenset({32, 64}), qk_nope_head_dims=frozenset({128}),
                     required_modules=("tokenspeed_mla",)),
        vllm_name="TOKENSPEED_MLA",
        summary="tokenspeed MLA kernels (FP8 only)"),
    BackendInfo(
        "TRITON_MLA",
        Capabilities(**_TRITON, page_size_multiple=16),
        adapter="mla_tune.backends.triton_mla.adapter:TritonMLA",
        vllm_name="TRITON_MLA", sglang_name="triton",
        summary="mla-tune's Triton decode kernel (FP8 dequantised on load)",
        engine_caveat=("the engine's Triton MLA backend runs the engine's own Triton kernel, not "
                       "mla-tune's, which is what was timed; expect different speed")),
    BackendInfo(
        "TRITON_MLA_SPARSE",
        Capabilities(**_TRITON, dense=False, sparse=True),
        adapter="mla_tune.backends.triton_mla.adapter:TritonMLASparse",
        summary="mla-tune's Triton sparse (top-k) decode kernel"),
    BackendInfo(
        "TORCH_REFERENCE",
        Capabilities(kv_cache_dtypes=_WITH_FP8, dense=True, sparse=True, kv_lora_ranks=None,
                     qk_rope_head_dims=None, required_modules=("torch",), candidate=False),
        adapter="mla_tune.backends.reference:TorchReference",
        summary="float32 PyTorch reference (the correctness oracle; never a winner)"),
)}

assert set(BACKENDS) == {name.value for name in BackendName}


def get_backend(name: str) -> BackendInfo:
    """Look a backend up by its stable name; ValueError lists the known names."""
    info = BACKENDS.get(str(name).strip().upper())
    if info is None:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(sorted(BACKENDS))}")
    return info


def backend_reasons(name: str, problem: Problem, device: DeviceSpec | None,
                    *, check_packages: bool = True) -> list[str]:
    """Reasons `name` cannot run `problem` on `device` (empty = eligible), adapter included."""
    info = get_backend(name)
    return eligibility_reasons(info.capabilities, problem, device, check_packages=check_packages)


def runnable_reasons(name: str, problem: Problem, device: DeviceSpec | None) -> list[str]:
    """Like `backend_reasons`, plus a reason when mla-tune has no adapter to time it."""
    reasons = backend_reasons(name, problem, device)
    if get_backend(name).adapter is None:
        reasons.append("mla-tune has no adapter for it (it lives inside vLLM and is not timed here)")
    return reasons


def candidates() -> list[str]:
    """Names of every backend that may win a decision (all but the reference)."""
    return [name for name, info in BACKENDS.items() if info.capabilities.candidate]


def load_adapter(name: str):
    """Import and return the adapter class of `name` (this loads its kernel library)."""
    info = get_backend(name)
    if info.adapter is None:
        raise ValueError(f"backend {info.name} has no adapter in mla-tune")
    module, _, attr = info.adapter.partition(":")
    return getattr(importlib.import_module(module), attr)
