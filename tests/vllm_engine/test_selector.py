"""vLLM's own selector (CUDA platform, `get_attn_backend`) accepts our backends and explains a refusal."""

from __future__ import annotations

import logging

import pytest

import vllm_host  # noqa: E402

vllm_host.require_vllm()
pytestmark = pytest.mark.vllm


def _select(config, *, sparse: bool):
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import _cached_get_attn_backend, get_attn_backend

    _cached_get_attn_backend.cache_clear()
    with set_current_vllm_config(config):
        return get_attn_backend(576, config.model_config.dtype, config.cache_config.cache_dtype, use_mla=True,
                                use_sparse=sparse, num_heads=config.model_config.get_num_attention_heads(
                                    config.parallel_config))


@pytest.mark.parametrize("tp", [1, 8])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp8_e4m3"])
def test_selector_accepts_dense_backend_for_deepseek_v3(vllm_host, models, tp, kv_cache_dtype):
    config = vllm_host.engine_config(models["DeepSeek-V3"], attention_backend="MLA_TUNE_TRITON",
                                     kv_cache_dtype=kv_cache_dtype, tensor_parallel_size=tp, block_size=64)
    assert config.attention_config.backend.name == "MLA_TUNE_TRITON"
    assert _select(config, sparse=False).__name__ == "MlaTuneTritonBackend"


def test_selector_accepts_sparse_backend_for_deepseek_v32(vllm_host, models):
    config = vllm_host.engine_config(models["DeepSeek-V3.2"], attention_backend="MLA_TUNE_TRITON_SPARSE",
                                     tensor_parallel_size=4, block_size=64)
    assert config.attention_config.backend.name == "MLA_TUNE_TRITON_SPARSE"
    assert _select(config, sparse=True).__name__ == "MlaTuneTritonSparseBackend"


def test_selector_refuses_fp8_on_ampere_with_our_reason(vllm_host, models, capability):
    config = vllm_host.engine_config(models["DeepSeek-V3"], attention_backend="MLA_TUNE_TRITON",
                                     kv_cache_dtype="fp8", tensor_parallel_size=8)
    capability(8, 0)
    with pytest.raises(ValueError) as refused:
        _select(config, sparse=False)
    assert ("MLA_TUNE_TRITON reads an FP8 cache from compute capability 8.9 (native e4m3); this GPU has 8.0"
            in str(refused.value))
    assert "compute capability not supported" not in str(refused.value)  # vLLM's bare reason, replaced


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3", "fp8_ds_mla"])
def test_selector_accepts_sparse_backend_with_fp8_caches(vllm_host, models, kv_cache_dtype):
    config = vllm_host.engine_config(models["DeepSeek-V3.2"], attention_backend="MLA_TUNE_TRITON_SPARSE",
                                     kv_cache_dtype=kv_cache_dtype, tensor_parallel_size=4, block_size=64)
    assert config.attention_config.backend.name == "MLA_TUNE_TRITON_SPARSE"
    assert _select(config, sparse=True).__name__ == "MlaTuneTritonSparseBackend"


def test_selector_refuses_a_dense_model_for_the_sparse_backend(vllm_host, models):
    config = vllm_host.engine_config(models["DeepSeek-V3"], attention_backend="MLA_TUNE_TRITON")
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    config.attention_config.backend = AttentionBackendEnum["MLA_TUNE_TRITON_SPARSE"]
    with pytest.raises(ValueError) as refused:
        _select(config, sparse=False)
    assert "MLA_TUNE_TRITON_SPARSE runs sparse MLA only; this model is dense (no index_topk)" in str(refused.value)


def test_plugin_hands_an_unfit_choice_back_to_vllm_with_one_warning(vllm_host, models, caplog):
    caplog.set_level(logging.WARNING, logger="mla_tune.vllm_plugin")
    config = vllm_host.engine_config(models["DeepSeek-V3.2"], attention_backend="MLA_TUNE_TRITON_SPARSE",
                                     block_size=16)
    assert config.attention_config.backend is None  # vLLM's normal selection
    ours = [r for r in caplog.records if "cannot run this model" in r.getMessage()]
    assert len(ours) == 1
    assert "MLA_TUNE_TRITON_SPARSE needs a block size that is a multiple of 64; got 16" in ours[0].getMessage()
