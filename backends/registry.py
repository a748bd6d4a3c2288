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

    MLA_TUNE_TRITON = "MLA_TUNE_TRITON"
    MLA_TUNE_TRITON_SPARSE = "MLA_TUNE_TRITON_SPARSE"
    MLA_TUNE_TRITON_FP8Q = "MLA_TUNE_TRITON_FP8Q"
    TRITON_MLA = "TRITON_MLA"
    FLASHINFER_MLA = "FLASHINFER_MLA"
    FLASHINFER_MLA_SPARSE = "FLASHINFER_MLA_SPARSE"
    FLASHINFER_MLA_SPARSE_SM120 = "FLASHINFER_MLA_SPARSE_SM120"
    FLASHINFER_MLA_SPARSE_SM90 = "FLASHINFER_MLA_SPARSE_SM90"
    FLASHINFER_FA2_MLA = "FLASHINFER_FA2_MLA"
    FLASHINFER_FA3_MLA = "FLASHINFER_FA3_MLA"
    FLASHINFER_FA2_MLA_SPARSE = "FLASHINFER_FA2_MLA_SPARSE"
    FLASHINFER_FA3_MLA_SPARSE = "FLASHINFER_FA3_MLA_SPARSE"
    FLASHMLA = "FLASHMLA"
    FLASHMLA_SPARSE = "FLASHMLA_SPARSE"
    FLASH_ATTN_MLA = "FLASH_ATTN_MLA"
    FLASH_ATTN_MLA_SPARSE = "FLASH_ATTN_MLA_SPARSE"
    FLASH_ATTN_MLA_SPARSE_FA4 = "FLASH_ATTN_MLA_SPARSE_FA4"
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
_BF16 = frozenset({"bf16"})
# vLLM's kernels are imported from the installed vLLM (or from its unpacked wheel on a machine
# whose torch vLLM does not support); each entry names the files its adapter loads.
_FLASHMLA = ("torch", "vllm", "vllm._flashmla_C", "vllm.third_party.flashmla.flash_mla_interface")
_FA3 = ("torch", "vllm", "vllm.vllm_flash_attn._vllm_fa3_C", "vllm.vllm_flash_attn.flash_attn_interface")
_UNTESTED_BLACKWELL = {"blackwell": "untested on hardware: argument construction checked on the CPU only"}
_VLLM = "mla_tune.backends.vllm_kernels"

# Capabilities are vLLM 0.33.0's own backend classes (vllm/v1/attention/backends/mla/*.py):
# supported_kv_cache_dtypes, supports_compute_capability, get_supported_kernel_block_sizes,
# supported_dtypes and the limits of supports_combination.
BACKENDS: dict[str, BackendInfo] = {info.name: info for info in (
    BackendInfo(
        "FLASHINFER_MLA",
        # FlashInfer 0.7.2 requires a bf16 `out` for trtllm-gen, hence a bf16 query.
        Capabilities(cc_majors=_SM100, query_dtypes=_BF16, kv_cache_dtypes=_WITH_FP8,
                     page_sizes=frozenset({32, 64}), fp8_quantizes_query=True,
                     qk_nope_head_dims=frozenset({64, 128, 192}), forbidden_heads=((65, 127),),
                     required_modules=("flashinfer",)),
        adapter="mla_tune.backends.flashinfer_blackwell:TrtllmGenMLA",
        vllm_name="FLASHINFER_MLA", sglang_name="trtllm_mla", hardware=_UNTESTED_BLACKWELL,
        summary="FlashInfer trtllm-gen decode (trtllm_batch_decode_with_kv_cache_mla), SM100/103"),
    BackendInfo(
        "FLASHINFER_MLA_SPARSE",
        Capabilities(cc_majors=_SM100, query_dtypes=_BF16, kv_cache_dtypes=_WITH_FP8,
                     page_size_multiple=32, fp8_quantizes_query=True,
                     qk_nope_head_dims=frozenset({128, 192}), dense=False, sparse=True,
                     required_modules=("flashinfer",)),
        adapter="mla_tune.backends.flashinfer_blackwell:TrtllmGenSparseMLA",
        vllm_name="FLASHINFER_MLA_SPARSE", hardware=_UNTESTED_BLACKWELL,
        summary="FlashInfer trtllm-gen sparse decode (sparse_mla_top_k), SM100/103"),
    BackendInfo(
        "FLASHINFER_MLA_SPARSE_SM120",
        Capabilities(cc_majors=frozenset({12}), query_dtypes=_BF16,
                     kv_cache_dtypes=frozenset({"bf16", "fp8_e4m3", "fp8_ds_mla"}),
                     page_size_multiple=64, dense=False, sparse=True,
                     sparse_topks=frozenset({2048}), required_modules=("flashinfer",)),
        adapter="mla_tune.backends.flashinfer_blackwell:XqaSparseMLA",
        vllm_name="FLASHINFER_MLA_SPARSE_SM120", hardware=_UNTESTED_BLACKWELL,
        summary="FlashInfer sparse MLA for SM120/121"),
    BackendInfo(
        "FLASHINFER_MLA_SPARSE_SM90",
        # FlashInfer's SM90 MLA wrapper (fa3) over the top-k slots as a page-size-1 table.
        Capabilities(cc_majors=frozenset({9}), query_dtypes=_BF16,
                     kv_cache_dtypes=frozenset({"bf16", "fp8_e4m3"}), page_size_multiple=64,
                     dense=False, sparse=True, qk_rope_head_dims=frozenset({0, 64}),
                     required_modules=("torch", "flashinfer")),
        adapter=f"{_VLLM}.flashinfer_sm90:FlashInferSparseSM90",
        vllm_name="FLASHINFER_MLA_SPARSE_SM90",
        summary="vLLM's FLASHINFER_MLA_SPARSE_SM90: FlashInfer fa3 MLA with the top-k slots as pages"),
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
        # The class says majors 9 and 10, but is_flashmla_dense_supported admits Hopper only.
        Capabilities(cc_majors=frozenset({9}), kv_cache_dtypes=_WITH_FP8, page_sizes=frozenset({64}),
                     fp8_quantizes_query=True, required_modules=(*_FLASHMLA, "vllm._flashmla_extension_C")),
        adapter=f"{_VLLM}.flashmla:FlashMLA",
        vllm_name="FLASHMLA",
        summary="vLLM's FlashMLA dense decode (FP8: FP8 query and descales, as vLLM calls it)"),
    BackendInfo(
        "FLASHMLA_SPARSE",
        # FP8 is vLLM's fp8_ds_mla (656 B/token), packed from the FP8 cache untimed.
        Capabilities(cc_majors=frozenset({9, 10}), query_dtypes=_BF16,
                     kv_cache_dtypes=frozenset({"bf16", "fp8_e4m3", "fp8_ds_mla"}),
                     page_size_multiple=64, dense=False, sparse=True, required_modules=_FLASHMLA),
        adapter=f"{_VLLM}.flashmla:FlashMLASparse",
        vllm_name="FLASHMLA_SPARSE", hardware={"blackwell": "untested on hardware"},
        summary="vLLM's FlashMLA sparse (bf16 prefill kernel; FP8 decode kernel on fp8_ds_mla, heads padded to 64/128)"),
    BackendInfo(
        "FLASH_ATTN_MLA",
        Capabilities(cc_majors=frozenset({9}), kv_cache_dtypes=_BF16_FP16, page_size_multiple=16,
                     required_modules=_FA3),
        adapter=f"{_VLLM}.flash_attn:FlashAttnMLA",
        vllm_name="FLASH_ATTN_MLA",
        summary="vLLM's FlashAttention 3 with q_v (vllm.vllm_flash_attn)"),
    BackendInfo(
        "FLASH_ATTN_MLA_SPARSE",
        Capabilities(cc_majors=frozenset({9}), kv_cache_dtypes=_BF16_FP16, page_size_multiple=64,
                     dense=False, sparse=True, required_modules=_FA3),
        adapter=f"{_VLLM}.flash_attn:FlashAttnMLASparse",
        vllm_name="FLASH_ATTN_MLA_SPARSE",
        summary="vLLM's FlashAttention 3 MLA with the top-k slots as a page-size-1 block table"),
    BackendInfo(
        "FLASH_ATTN_MLA_SPARSE_FA4",
        # FA4 (cute DSL) for decode, trtllm-gen for prefill: Blackwell only, bf16 KV only.
        Capabilities(cc_majors=_SM100, query_dtypes=_BF16, kv_cache_dtypes=_BF16,
                     page_size_multiple=64, head_counts=frozenset({8, 16, 32, 64, 128}),
                     dense=False, sparse=True, sparse_topk_multiple=128,
                     qk_nope_head_dims=frozenset({128, 192}),
                     required_modules=("vllm", "flashinfer")),
        vllm_name="FLASH_ATTN_MLA_SPARSE_FA4", hardware={"blackwell": "no adapter in mla-tune"},
        summary="vLLM's FlashAttention 4 sparse MLA decode (SM100)"),
    BackendInfo(
        "CUTLASS_MLA",
        Capabilities(cc_majors=_SM100, kv_cache_dtypes=_WITH_FP8, page_sizes=frozenset({128}),
                     max_heads=128, required_modules=("torch", "vllm", "vllm._C_stable_libtorch")),
        adapter=f"{_VLLM}.cutlass:CutlassMLA",
        vllm_name="CUTLASS_MLA", hardware=_UNTESTED_BLACKWELL,
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
        # vLLM declares no compute-capability limit; Triton itself compiles e4m3 only from SM89.
        Capabilities(kv_cache_dtypes=_WITH_FP8, fp8_min_cc=(8, 9), page_size_multiple=16,
                     kv_lora_ranks=None, qk_rope_head_dims=None,
                     required_modules=("torch", "triton", "vllm",
                                       "vllm.v1.attention.ops.triton_decode_attention")),
        adapter=f"{_VLLM}.triton:VllmTritonMLA",
        vllm_name="TRITON_MLA",
        summary="vLLM's own Triton MLA decode kernel (triton_decode_attention.decode_attention_fwd)"),
    BackendInfo(
        "MLA_TUNE_TRITON",
        Capabilities(**_TRITON, page_size_multiple=16),
        adapter="mla_tune.backends.triton_mla.adapter:TritonMLA",
        vllm_plugin_name="MLA_TUNE_TRITON",
        summary="mla-tune's Triton decode kernel (FP8 dequantised on load)"),
    BackendInfo(
        "MLA_TUNE_TRITON_SPARSE",
        # fp8_ds_mla: vLLM's 656-byte rows, packed from the FP8 cache untimed and read in place by the tl kernel.
        Capabilities(**{**_TRITON, "kv_cache_dtypes": _WITH_FP8 | {"fp8_ds_mla"}}, dense=False, sparse=True),
        adapter="mla_tune.backends.triton_mla.adapter:TritonMLASparse",
        vllm_plugin_name="MLA_TUNE_TRITON_SPARSE",
        summary="mla-tune's Triton sparse (top-k) decode kernel"),
    BackendInfo(
        "MLA_TUNE_TRITON_FP8Q",
        # The Hopper FP8-query forms, narrow and wide (e4m3 products on wgmma, SM90): an e4m3 cache, q and p rounded.
        Capabilities(**{**_TRITON, "kv_cache_dtypes": frozenset({"fp8_e4m3"}), "min_cc": (9, 0)},
                     cc_majors=frozenset({9}), fp8_quantizes_query=True, page_size_multiple=16),
        adapter="mla_tune.backends.triton_mla.adapter:TritonMLAFp8Query",
        summary="mla-tune's Hopper decode kernel on FP8 tensor cores (q and p rounded to e4m3)"),
    BackendInfo(
        "TORCH_REFERENCE",
        Capabilities(kv_cache_dtypes=_WITH_FP8 | {"fp8_ds_mla"}, dense=True, sparse=True, kv_lora_ranks=None,
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
