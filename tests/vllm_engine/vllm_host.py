"""The real vLLM 0.33 on a machine without a GPU, as far as it goes: its CUDA platform, selector, layer, builder.

What cannot exist here is replaced, and only that:
- `vllm._C_stable_libtorch` (vLLM's CUDA ops) does not load without `libcuda.so.1`; an empty module stands in,
  so no vLLM CUDA op can run (none is needed on our decode path).
- the GPUs' identity (compute capability, SM count, name, how many) comes from `GPU` instead of the driver,
  and host buffers are not page-locked (that needs the driver too).
- modules that load CUDA extensions when imported under the CUDA platform (FlashAttention, CUTLASS checks)
  are imported first under vLLM's CPU-less default platform; then every vLLM module that bound
  `current_platform` sees the CUDA platform.
Everything else is vLLM's code: `EngineArgs.create_engine_config`, the selector and its validation,
`MLAAttention` (with vLLM's CPU SDPA prefill backend; prefill is not under test), `get_kv_cache_spec`,
the metadata builders and `SparseMLACommonImpl.forward_mqa`.
"""

from __future__ import annotations

import json
import socket
import sys
import types
from pathlib import Path

def real_vllm_installed() -> bool:
    """Whether the vLLM distribution is installed (a `vllm` module alone may be tests/fleet's fake host)."""
    from importlib import metadata

    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return False
    return True


def require_vllm() -> None:
    """Skip the calling test module unless the real vLLM is installed."""
    import pytest

    if not real_vllm_installed():
        pytest.skip("the real vLLM is not installed here; run `pytest -m vllm tests/vllm_engine` in its "
                    "environment (.ci/vllm-tests)", allow_module_level=True)


GPU = {"name": "NVIDIA H100 80GB HBM3", "capability": (9, 0), "sms": 132, "count": 8}
_STATE: dict = {}


def deepseek_config(folder: Path, *, heads: int = 128, topk: int | None = None, layers: int = 61) -> Path:
    """A DeepSeek-V3 (or, with `topk`, V3.2) `config.json` in `folder`; `heads` and `layers` shrink it."""
    config = {
        "architectures": ["DeepseekV32ForCausalLM" if topk else "DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v32" if topk else "deepseek_v3",
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "vocab_size": 129280, "max_position_embeddings": 163840, "torch_dtype": "bfloat16",
        "rope_theta": 10000, "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 0,
        "eos_token_id": 1,
    }
    if topk:
        config.update(index_topk=topk, index_head_dim=128, index_n_heads=64)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def start_cuda_platform():
    """Make vLLM's CUDA platform current in this process (once); return it."""
    if "platform" in _STATE:
        return _STATE["platform"]
    sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
    # Imported under the default platform: they load CUDA extensions at import under the CUDA one.
    import vllm.distributed  # noqa: F401
    import vllm.model_executor.layers.attention.mla_attention  # noqa: F401
    import vllm.model_executor.layers.attention.sparse_mla_attention  # noqa: F401
    import vllm.model_executor.layers.linear  # noqa: F401
    # what vLLM's model registry imports to save an inspected architecture (w8a8_utils asks the CUDA ops at import)
    import vllm.model_executor.model_loader.weight_utils  # noqa: F401
    import vllm.platforms as platforms
    import vllm.platforms.cuda as cuda
    from vllm.platforms.interface import DeviceCapability

    import mla_tune.vllm_backends.dense  # noqa: F401
    import mla_tune.vllm_backends.sparse  # noqa: F401

    platform_cls = cuda.CudaPlatform
    platform_cls.get_device_capability = classmethod(lambda cls, device_id=0: DeviceCapability(*GPU["capability"]))
    platform_cls.get_device_name = classmethod(lambda cls, device_id=0: GPU["name"])
    platform_cls.num_compute_units = classmethod(lambda cls, device_id=0: GPU["sms"])
    platform_cls.device_count = classmethod(lambda cls: GPU["count"])
    old = platforms.current_platform
    new = platform_cls()
    platforms._current_platform = new
    for module in list(sys.modules.values()):
        if getattr(module, "current_platform", None) is old:
            module.current_platform = new
        if getattr(module, "PIN_MEMORY", None) is True:
            module.PIN_MEMORY = False  # page-locked host memory needs the driver
    _STATE["platform"] = new
    return new


def set_capability(major: int, minor: int) -> None:
    """The compute capability the CUDA platform reports from now on (selector results are cached per config)."""
    from vllm.v1.attention.selector import _cached_get_attn_backend

    GPU["capability"] = (major, minor)
    _cached_get_attn_backend.cache_clear()


def start_distributed(vllm_config) -> None:
    """A one-process gloo group, as vLLM's worker creates before building layers (once)."""
    if _STATE.get("distributed"):
        return
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
        initialize_model_parallel(1, 1)
    _STATE["distributed"] = True


def engine_config(model: Path, **engine_args):
    """`EngineArgs(...).create_engine_config()` for a config folder (dummy weights, no tokenizer).

    With tensor parallelism vLLM sizes its FlashInfer all-reduce + RMSNorm fusion by importing the fusion
    passes, which read CUDA ops (`torch.ops._C.rotary_embedding`) at import: that fusion is turned off here.
    """
    from vllm.engine.arg_utils import EngineArgs

    if engine_args.get("tensor_parallel_size", 1) > 1:
        engine_args.setdefault("compilation_config", {"pass_config": {"fuse_allreduce_rms": False}})
    return EngineArgs(model=str(model), load_format="dummy", skip_tokenizer_init=True, **engine_args
                      ).create_engine_config()


def mla_layer(vllm_config, *, prefix: str, topk_buffer=None):
    """vLLM's `MLAAttention` for the config's model, its backend chosen by vLLM's selector."""
    import math

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend

    hf = vllm_config.model_config.hf_text_config
    heads = vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(vllm_config.model_config.dtype)  # as vLLM's model loader does
    try:
        with set_current_vllm_config(vllm_config):
            return MLAAttention(
                num_heads=heads, scale=1.0 / math.sqrt(hf.qk_nope_head_dim + hf.qk_rope_head_dim),
                qk_nope_head_dim=hf.qk_nope_head_dim, qk_rope_head_dim=hf.qk_rope_head_dim,
                v_head_dim=hf.v_head_dim, q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank,
                # The up-projection's weights play no part in decode attention: a plain linear of its shape.
                kv_b_proj=torch.nn.Linear(hf.kv_lora_rank, heads * (hf.qk_nope_head_dim + hf.v_head_dim),
                                          bias=False),
                cache_config=vllm_config.cache_config, prefix=prefix, use_sparse=topk_buffer is not None,
                topk_indices_buffer=topk_buffer, prefill_backend_cls=CPUSDPAMLAPrefillBackend)
    finally:
        torch.set_default_dtype(previous)


def metadata_builder(layer, vllm_config, *, prefix: str):
    """The metadata builder of the layer's backend, as vLLM's model runner creates it."""
    import torch
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_config):
        spec = layer.get_kv_cache_spec(vllm_config)
        return spec, layer.attn_backend.get_builder_cls()(spec, [prefix], vllm_config, torch.device("cpu"))


def paged_batch(seq_lens: list[int], *, query_len: int, block_size: int, spare_blocks: int, generator):
    """vLLM's `CommonAttentionMetadata` for a uniform decode batch over a randomly permuted block table."""
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata

    batch = len(seq_lens)
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    order = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    table = torch.zeros(batch, max(needed) + 2, dtype=torch.int32)   # wider than needed, as vLLM's is
    start = 0
    for row, count in enumerate(needed):
        table[row, :count] = order[start:start + count]
        start += count
    starts = torch.arange(batch + 1, dtype=torch.int32) * query_len
    lengths = torch.tensor(seq_lens, dtype=torch.int32)
    positions = torch.cat([torch.arange(n - query_len, n) for n in seq_lens])
    slots = (table.long().gather(1, (positions // block_size).view(batch, query_len)).flatten() * block_size
             + positions % block_size)
    common = CommonAttentionMetadata(
        query_start_loc=starts, query_start_loc_cpu=starts.clone(), seq_lens=lengths, num_reqs=batch,
        num_actual_tokens=batch * query_len, max_query_len=query_len, max_seq_len=max(seq_lens),
        block_table_tensor=table, slot_mapping=slots, seq_lens_cpu_upper_bound=lengths.clone())
    return common, num_blocks
