"""Our `forward_mqa` inside vLLM: a layer vLLM built with our backend, metadata from vLLM's own builder.

On a machine without a GPU the kernel runs in Triton's interpreter; outputs are checked against
the float32 reference (`mla_tune.backends.reference.mla_reference`).
"""

from __future__ import annotations

import pytest

import vllm_host  # noqa: E402

vllm_host.require_vllm()
pytestmark = pytest.mark.vllm

import torch  # noqa: E402

LAYERS = {}


def _layer(vllm_host, models, name: str, *, backend: str, kv_cache_dtype: str = "auto", topk: int | None = None,
           tag: str = ""):
    """One layer per (model, backend, cache dtype, tag), built once: vLLM refuses a second layer of one name."""
    key = (name, backend, kv_cache_dtype, tag)
    if key not in LAYERS:
        config = vllm_host.engine_config(models[name], attention_backend=backend, kv_cache_dtype=kv_cache_dtype,
                                         block_size=64 if topk else 16)
        vllm_host.start_distributed(config)
        prefix = f"model.layers.{len(LAYERS)}.self_attn.attn"
        buffer = torch.full((config.scheduler_config.max_num_batched_tokens, topk), -1, dtype=torch.int32) \
            if topk else None
        layer = vllm_host.mla_layer(config, prefix=prefix, topk_buffer=buffer)
        spec, builder = vllm_host.metadata_builder(layer, config, prefix=prefix)
        LAYERS[key] = (config, layer, spec, builder)
    return LAYERS[key]


def _reference(q, kv_cache, block_table, seq_lens, *, scale, kv_scale=None, topk=None):
    from mla_tune.backends.reference import mla_reference

    return mla_reference(q, kv_cache, block_table, seq_lens, sm_scale=scale, kv_scale=kv_scale, topk_indices=topk)


@pytest.mark.parametrize("query_len", [1, 2])
def test_dense_bf16_forward_mqa_matches_the_reference(vllm_host, models, query_len):
    config, layer, spec, builder = _layer(vllm_host, models, "small-dense", backend="MLA_TUNE_TRITON")
    assert type(layer.impl).__name__ == "MlaTuneTritonImpl" and spec.head_size == 576 and spec.block_size == 16
    # vLLM raises the threshold to 1 + num_speculative_tokens when speculative decoding is on.
    builder.reorder_batch_threshold = query_len
    g = torch.Generator().manual_seed(query_len)
    seq_lens = [5, 37, 16, 33]  # not multiples of the block size; one shorter than a block
    common, num_blocks = vllm_host.paged_batch(seq_lens, query_len=query_len, block_size=16, spare_blocks=3,
                                               generator=g)
    metadata = builder.build(0, common)
    assert metadata.num_decodes == len(seq_lens) and metadata.num_prefills == 0
    kv_cache = torch.randn(num_blocks, 16, 576, generator=g).to(torch.bfloat16)
    q = torch.randn(len(seq_lens) * query_len, 5, 576, generator=g).to(torch.bfloat16)
    out, lse = layer.impl.forward_mqa((q[..., :512], q[..., 512:]), kv_cache, metadata, layer)
    assert layer.impl.fallback_reason is None
    ref_out, ref_lse = _reference(q.view(len(seq_lens), query_len, 5, 576), kv_cache, common.block_table_tensor,
                                  common.seq_lens, scale=layer.impl.scale)
    torch.testing.assert_close(out.float(), ref_out.view(-1, 5, 512), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse.view(-1, 5), atol=1e-3, rtol=1e-3)


def test_dense_fp8_forward_mqa_reads_vllms_cache_with_its_k_scale(vllm_host, models):
    config, layer, spec, builder = _layer(vllm_host, models, "small-dense", backend="MLA_TUNE_TRITON",
                                          kv_cache_dtype="fp8")
    assert layer.impl.supports_quant_query_input is False  # the query stays bf16, as for vLLM's TRITON_MLA
    g = torch.Generator().manual_seed(7)
    seq_lens = [70, 3, 41]
    common, num_blocks = vllm_host.paged_batch(seq_lens, query_len=1, block_size=16, spare_blocks=2, generator=g)
    metadata = builder.build(0, common)
    # vLLM allocates the cache as bytes and views it as e4m3 before forward_mqa (MLAAttention.forward_impl).
    raw = (torch.randn(num_blocks, 16, 576, generator=g) * 4).to(torch.float8_e4m3fn).view(torch.uint8)
    kv_cache = raw.view(torch.float8_e4m3fn)
    layer._k_scale.fill_(0.37)
    q = torch.randn(len(seq_lens), 5, 576, generator=g).to(torch.bfloat16)
    out, lse = layer.impl.forward_mqa(q, kv_cache, metadata, layer)
    assert kv_cache.data_ptr() == raw.data_ptr()
    ref_out, ref_lse = _reference(q, kv_cache, common.block_table_tensor, common.seq_lens, scale=layer.impl.scale,
                                  kv_scale=0.37)
    torch.testing.assert_close(out.float(), ref_out, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=2e-3)


def test_sparse_bf16_forward_mqa_gathers_the_top_k_rows(vllm_host, models):
    config, layer, spec, builder = _layer(vllm_host, models, "small-sparse", backend="MLA_TUNE_TRITON_SPARSE",
                                          topk=128)
    assert type(layer.impl).__name__ == "MlaTuneTritonSparseImpl" and spec.block_size == 64
    g = torch.Generator().manual_seed(11)
    seq_lens = [200, 45, 130]
    common, num_blocks = vllm_host.paged_batch(seq_lens, query_len=1, block_size=64, spare_blocks=2, generator=g)
    metadata = builder.build(0, common)
    assert metadata.num_decode_tokens == len(seq_lens)
    kv_cache = torch.randn(num_blocks, 64, 576, generator=g).to(torch.bfloat16)
    # The indexer's answer: per token, 128 positions within its request, -1 where it has fewer.
    logical = torch.full((len(seq_lens), 128), -1, dtype=torch.int32)
    for row, n in enumerate(seq_lens):
        picked = torch.randperm(n, generator=g)[:128].to(torch.int32)
        logical[row, :picked.numel()] = picked
    # What vLLM's index conversion hands the kernel: global rows block x block_size + offset.
    blocks = common.block_table_tensor.long().gather(1, (logical.clamp(min=0) // 64).long())
    physical = torch.where(logical >= 0, blocks * 64 + logical % 64, -1).to(torch.int32)
    q = torch.randn(len(seq_lens), 3, 576, generator=g).to(torch.bfloat16)
    out, lse = layer.impl._forward_mqa_kernel((q[..., :512], q[..., 512:]), kv_cache, physical,
                                              (logical >= 0).sum(1).to(torch.int32), layer=layer, block_size=64,
                                              is_decode=True)
    ref_out, ref_lse = _reference(q, kv_cache, common.block_table_tensor, common.seq_lens, scale=layer.impl.scale,
                                  topk=logical.unsqueeze(1))
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)


def test_sparse_forward_mqa_through_vllms_index_conversion(vllm_host, models):
    """vLLM's own `SparseMLACommonImpl.forward_mqa` (top-k buffer, conversion, then our kernel)."""
    config, layer, spec, builder = _layer(vllm_host, models, "small-sparse", backend="MLA_TUNE_TRITON_SPARSE",
                                          topk=128)
    g = torch.Generator().manual_seed(12)
    seq_lens = [190, 64]
    common, num_blocks = vllm_host.paged_batch(seq_lens, query_len=1, block_size=64, spare_blocks=1, generator=g)
    metadata = builder.build(0, common)
    kv_cache = torch.randn(num_blocks, 64, 576, generator=g).to(torch.bfloat16)
    buffer = layer.impl.topk_indices_buffer
    buffer.fill_(-1)
    for row, n in enumerate(seq_lens):
        buffer[row, :min(n, 128)] = torch.randperm(n, generator=g)[:128].to(torch.int32)
    q = torch.randn(len(seq_lens), 3, 576, generator=g).to(torch.bfloat16)
    out, _ = layer.impl.forward_mqa((q[..., :512], q[..., 512:]), kv_cache, metadata, layer)
    ref_out, _ = _reference(q, kv_cache, common.block_table_tensor, common.seq_lens, scale=layer.impl.scale,
                            topk=buffer[:len(seq_lens)].unsqueeze(1))
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)


def _sparse_batch(layer, common, seq_lens, g):
    """The indexer's answer (128 positions per token, -1 where fewer) and vLLM's conversion to global rows."""
    logical = torch.full((len(seq_lens), 128), -1, dtype=torch.int32)
    for row, n in enumerate(seq_lens):
        picked = torch.randperm(n, generator=g)[:128].to(torch.int32)
        logical[row, :picked.numel()] = picked
    blocks = common.block_table_tensor.long().gather(1, (logical.clamp(min=0) // 64).long())
    return logical, torch.where(logical >= 0, blocks * 64 + logical % 64, -1).to(torch.int32)


def test_sparse_fp8_ds_mla_forward_mqa_reads_the_656_byte_rows_in_place(vllm_host, models):
    from mla_tune.backends.vllm_kernels.flashmla import quantize_fp8_ds_mla, unpack_fp8_ds_mla

    config, layer, spec, builder = _layer(vllm_host, models, "small-sparse", backend="MLA_TUNE_TRITON_SPARSE",
                                          kv_cache_dtype="fp8_ds_mla", topk=128)
    assert layer.kv_cache_dtype == "fp8_ds_mla" and spec.state_content_bytes == 656 and spec.dtype == torch.uint8
    g = torch.Generator().manual_seed(13)
    seq_lens = [200, 45, 130]
    common, num_blocks = vllm_host.paged_batch(seq_lens, query_len=1, block_size=64, spare_blocks=2, generator=g)
    builder.build(0, common)
    values = torch.randn(num_blocks, 64, 576, generator=g)
    values[..., :512] *= torch.exp(torch.randn(num_blocks, 64, 1, generator=g))  # per-token scales differ
    kv_cache = quantize_fp8_ds_mla(values)                          # uint8 [blocks, 64, 656], as vLLM holds it
    logical, physical = _sparse_batch(layer, common, seq_lens, g)
    q = torch.randn(len(seq_lens), 3, 576, generator=g).to(torch.bfloat16)
    out, lse = layer.impl._forward_mqa_kernel((q[..., :512], q[..., 512:]), kv_cache, physical,
                                              (logical >= 0).sum(1).to(torch.int32), layer=layer, block_size=64,
                                              is_decode=True)
    ref_out, ref_lse = _reference(q, unpack_fp8_ds_mla(kv_cache), common.block_table_tensor, common.seq_lens,
                                  scale=layer.impl.scale, topk=logical.unsqueeze(1))
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)


def test_sparse_fp8_stays_e4m3_with_k_scale_for_our_backend(vllm_host, models):
    """vLLM turns a sparse model's fp8 into fp8_ds_mla for FLASHMLA_SPARSE only: ours gets 576 e4m3 values a token
    and the layer's k_scale."""
    config, layer, spec, builder = _layer(vllm_host, models, "small-sparse", backend="MLA_TUNE_TRITON_SPARSE",
                                          kv_cache_dtype="fp8", topk=128)
    assert layer.kv_cache_dtype == "fp8" and spec.state_content_bytes is None
    g = torch.Generator().manual_seed(14)
    seq_lens = [150, 70]
    common, num_blocks = vllm_host.paged_batch(seq_lens, query_len=1, block_size=64, spare_blocks=1, generator=g)
    builder.build(0, common)
    kv_cache = (torch.randn(num_blocks, 64, 576, generator=g) * 40).to(torch.float8_e4m3fn)
    layer._k_scale.fill_(0.03)
    logical, physical = _sparse_batch(layer, common, seq_lens, g)
    q = torch.randn(len(seq_lens), 3, 576, generator=g).to(torch.bfloat16)
    out, lse = layer.impl._forward_mqa_kernel((q[..., :512], q[..., 512:]), kv_cache, physical,
                                              (logical >= 0).sum(1).to(torch.int32), layer=layer, block_size=64,
                                              is_decode=True)
    ref_out, ref_lse = _reference(q, kv_cache, common.block_table_tensor, common.seq_lens, scale=layer.impl.scale,
                                  kv_scale=0.03, topk=logical.unsqueeze(1))
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)


def test_dense_falls_back_to_vllms_triton_mla_when_our_kernel_cannot_launch(vllm_host, models, monkeypatch, caplog):
    import logging

    import vllm.v1.attention.backends.mla.triton_mla as vllm_triton_mla

    import mla_tune.backends.triton_mla as triton_mla

    config, layer, spec, builder = _layer(vllm_host, models, "small-dense", backend="MLA_TUNE_TRITON",
                                          tag="fallback")

    def compile_failure(*args, **kwargs):  # what a ptxas failure on an unknown GPU looks like to the caller
        raise RuntimeError("PTXAS error: Internal Triton PTX codegen error")

    monkeypatch.setattr(triton_mla, "mla_decode", compile_failure)
    vllm_kernel_calls = []
    vllm_kernel = vllm_triton_mla.decode_attention_fwd
    monkeypatch.setattr(vllm_triton_mla, "decode_attention_fwd",
                        lambda *args, **kwargs: vllm_kernel_calls.append(1) or vllm_kernel(*args, **kwargs))
    caplog.set_level(logging.WARNING, logger="mla_tune.vllm_backends")
    g = torch.Generator().manual_seed(3)
    seq_lens = [21, 50]
    common, num_blocks = vllm_host.paged_batch(seq_lens, query_len=1, block_size=16, spare_blocks=1, generator=g)
    metadata = builder.build(0, common)
    kv_cache = torch.randn(num_blocks, 16, 576, generator=g).to(torch.bfloat16)
    q = torch.randn(len(seq_lens), 5, 576, generator=g).to(torch.bfloat16)
    ref_out, _ = _reference(q, kv_cache, common.block_table_tensor, common.seq_lens, scale=layer.impl.scale)
    for _ in range(2):  # the second call goes straight to vLLM's kernel, without a second warning
        out, _ = layer.impl.forward_mqa(q, kv_cache, metadata, layer)
        assert out.shape == ref_out.shape
        if q.is_cuda:  # vLLM's decode_attention_fwd is wrong in Triton's CPU interpreter (max error ~8e8)
            torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)
    assert len(vllm_kernel_calls) == 2
    assert layer.impl.fallback_reason == "RuntimeError: PTXAS error: Internal Triton PTX codegen error"
    warnings = [r.getMessage() for r in caplog.records if "could not launch" in r.getMessage()]
    assert len(warnings) == 1 and "runs vLLM's TRITON_MLA kernel from now on" in warnings[0]
