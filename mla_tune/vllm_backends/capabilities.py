"""What our vLLM backends can run, as data, and the one checker that explains a refusal.

Imports neither torch nor vLLM, so the plugin can check a model's configuration
before the engine starts (and fall back to vLLM's choice) and the vLLM backend
classes can give the same sentences to vLLM's selector.
"""

from __future__ import annotations

from dataclasses import dataclass, field



@dataclass(frozen=True)
class VllmBackendCapabilities:
    """The limits of one of our vLLM attention backends, in vLLM's own terms.

    Attributes:
        name: the `AttentionBackendEnum` name it is registered under.
        class_path: `module.Class` of the backend, imported by vLLM on first use.
        sparse: True for DeepSeek-V3.2 top-k attention (`index_topk` in the model config).
        head_size: the MLA head size vLLM passes (kv_lora_rank + qk_rope_head_dim).
        kv_lora_rank: the latent width the kernel is built for.
        model_dtypes: the model (query) dtypes, as torch names without the `torch.` prefix.
        kv_cache_dtypes: vLLM `--kv-cache-dtype` values the kernel reads as they are stored.
        fp8_kv_cache_dtypes: the subset stored as e4m3 (with vLLM's per-tensor `k_scale`, or fp8_ds_mla's own
            scales), read from `min_fp8_capability`.
        refused_kv_cache_dtypes: kv-cache dtypes vLLM could ask for that we refuse, each with why.
        block_size_multiple: vLLM's block size must be a multiple of this.
        min_capability: the lowest compute capability (major, minor).
        min_fp8_capability: the lowest compute capability for an FP8 cache (e4m3 conversion).
        max_heads: query heads per rank the kernel tiles (1..max_heads).
        max_decode_query_len: query tokens per request the kernel runs natively (speculative decode).
        cudagraph_support: vLLM's `AttentionCGSupport` member name for the builder.
    """

    name: str
    class_path: str
    sparse: bool
    head_size: int = 576
    kv_lora_rank: int = 512
    model_dtypes: tuple[str, ...] = ("bfloat16", "float16")
    kv_cache_dtypes: tuple[str, ...] = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3")
    fp8_kv_cache_dtypes: tuple[str, ...] = ("fp8", "fp8_e4m3")
    refused_kv_cache_dtypes: dict[str, str] = field(default_factory=dict)
    block_size_multiple: int = 16
    min_capability: tuple[int, int] = (8, 0)
    min_fp8_capability: tuple[int, int] = (8, 9)
    max_heads: int = 128
    max_decode_query_len: int = 4
    cudagraph_support: str = "UNIFORM_BATCH"


DENSE = VllmBackendCapabilities(
    name="MLA_TUNE_TRITON", class_path="mla_tune.vllm_backends.dense.MlaTuneTritonBackend", sparse=False,
    refused_kv_cache_dtypes={"fp8_ds_mla": "fp8_ds_mla is a sparse (DeepSeek-V3.2) cache format"})
# vLLM 0.33 turns a sparse model's fp8 into fp8_ds_mla for FLASHMLA_SPARSE (and FLASHINFER_MLA_SPARSE_SM120) only:
# our backend gets "fp8"/"fp8_e4m3" as 576 e4m3 values with k_scale, and fp8_ds_mla where it is asked for by name.
SPARSE = VllmBackendCapabilities(
    name="MLA_TUNE_TRITON_SPARSE", class_path="mla_tune.vllm_backends.sparse.MlaTuneTritonSparseBackend",
    sparse=True, model_dtypes=("bfloat16",), kv_cache_dtypes=("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_ds_mla"),
    fp8_kv_cache_dtypes=("fp8", "fp8_e4m3", "fp8_ds_mla"), block_size_multiple=64, max_decode_query_len=1)
BACKENDS: dict[str, VllmBackendCapabilities] = {caps.name: caps for caps in (DENSE, SPARSE)}


def _cc(capability) -> str:
    return f"{capability[0]}.{capability[1]}"


def vllm_dtype(name: str) -> str:
    """vLLM's name for one of our dtype names (`bf16` -> `bfloat16`, `fp16` -> `float16`); others are the same."""
    return {"bf16": "bfloat16", "fp16": "float16"}.get(name, name)


def refusal_reasons(caps: VllmBackendCapabilities, *, head_size: int | None = None, model_dtype: str | None = None,
                    kv_cache_dtype: str | None = None, block_size: int | None = None, sparse: bool | None = None,
                    capability: tuple[int, int] | None = None, num_heads: int | None = None,
                    kv_lora_rank: int | None = None) -> list[str]:
    """Why `caps` cannot run this configuration: one sentence per violated limit, with the observed value.

    Empty means it can. A value left None is not checked (not known yet). Never raises.

    Args:
        model_dtype: `bfloat16`, `float16`, ... (a `torch.` prefix is accepted).
        kv_cache_dtype: vLLM's cache dtype string (`auto`, `fp8`, `fp8_ds_mla`, ...).
        capability: the GPU's compute capability (major, minor).
        num_heads: query heads per rank (model heads / tensor-parallel size).
    """
    reasons = []
    name = caps.name
    if sparse is not None and sparse != caps.sparse:
        reasons.append(f"{name} runs {'sparse' if caps.sparse else 'dense'} MLA only; this model is "
                       f"{'sparse (it has index_topk)' if sparse else 'dense (no index_topk)'}")
    if head_size is not None and head_size != caps.head_size:
        reasons.append(f"{name} needs MLA head size {caps.head_size} (latent {caps.kv_lora_rank} + RoPE 64); "
                       f"got {head_size}")
    if kv_lora_rank is not None and kv_lora_rank != caps.kv_lora_rank:
        reasons.append(f"{name} is built for kv_lora_rank {caps.kv_lora_rank}; got {kv_lora_rank}")
    if model_dtype is not None:
        dtype = str(model_dtype).removeprefix("torch.")
        if dtype not in caps.model_dtypes:
            reasons.append(f"{name} runs model dtype {' or '.join(caps.model_dtypes)}; got {dtype}")
    if kv_cache_dtype is not None:
        if kv_cache_dtype in caps.refused_kv_cache_dtypes:
            reasons.append(f"{name} does not support kv_cache_dtype {kv_cache_dtype}: "
                           f"{caps.refused_kv_cache_dtypes[kv_cache_dtype]}")
        elif kv_cache_dtype not in caps.kv_cache_dtypes:
            reasons.append(f"{name} does not support kv_cache_dtype {kv_cache_dtype}; it reads "
                           f"{{{', '.join(caps.kv_cache_dtypes)}}}")
        elif model_dtype is not None and kv_cache_dtype in ("bfloat16", "float16"):
            dtype = str(model_dtype).removeprefix("torch.")
            if dtype in caps.model_dtypes and dtype != kv_cache_dtype:
                reasons.append(f"{name} reads a 16-bit cache in the model's dtype {dtype}; "
                               f"got kv_cache_dtype {kv_cache_dtype}")
    if block_size is not None and block_size % caps.block_size_multiple:
        reasons.append(f"{name} needs a block size that is a multiple of {caps.block_size_multiple}; "
                       f"got {block_size}")
    if capability is not None:
        capability = (int(capability[0]), int(capability[1]))
        if capability < caps.min_capability:
            reasons.append(f"{name} needs compute capability {_cc(caps.min_capability)} or newer; "
                           f"this GPU has {_cc(capability)}")
        elif (kv_cache_dtype in caps.fp8_kv_cache_dtypes and capability < caps.min_fp8_capability):
            reasons.append(f"{name} reads an FP8 cache from compute capability {_cc(caps.min_fp8_capability)} "
                           f"(native e4m3); this GPU has {_cc(capability)}")
    if num_heads is not None and not 1 <= num_heads <= caps.max_heads:
        reasons.append(f"{name} runs 1..{caps.max_heads} query heads per rank; got {num_heads}")
    return reasons
