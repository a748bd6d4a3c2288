"""FlashInfer fa2/fa3 argument construction, checked on the CPU.

The CSR metadata is interpreted the way FlashInfer's kernels read it (pages
of the cache view, causal bottom-right mask) and must reproduce the float32
reference; where FlashInfer's own metadata validation runs without a GPU, the
metadata must pass it too.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

from mla_tune.backends.flashinfer_mla import (FlashInferFA2, FlashInferFA2Sparse, FlashInferFA3,
                                              FlashInferFA3Sparse, csr_page_counts_match,
                                              dense_csr, kv_cache_view, sparse_csr,
                                              sparse_token_slots)
from mla_tune.backends.inputs import make_inputs
from mla_tune.backends.interface import BackendUnavailable
from mla_tune.backends.problem import Geometry, Problem, Shape
from mla_tune.backends.reference import mla_reference
from mla_tune.backends.registry import BACKENDS, load_adapter

SMALL = Geometry(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)


@pytest.fixture(autouse=True, scope="module")
def _forget_flashinfer():
    """Unload FlashInfer after this module: other tests assert that lookups never import it."""
    before = set(sys.modules)
    yield
    for name in [n for n in sys.modules if n not in before and n.split(".")[0] == "flashinfer"]:
        del sys.modules[name]


def attend_csr(q, kv_view, meta, *, sm_scale, kv_lora_rank, kv_scale=None):
    """What the FlashInfer kernel computes from CSR metadata, in float32."""
    tokens = q.reshape(-1, q.shape[-2], q.shape[-1]).float()
    out = torch.zeros(tokens.shape[0], tokens.shape[1], kv_lora_rank)
    scale = 1.0 if kv_scale is None else kv_scale
    for s in range(meta.kv_len_arr.numel()):
        q0, q1 = int(meta.qo_indptr[s]), int(meta.qo_indptr[s + 1])
        p0, p1 = int(meta.kv_indptr[s]), int(meta.kv_indptr[s + 1])
        n = int(meta.kv_len_arr[s])
        pages = meta.kv_indices[p0:p1].long()
        keys = kv_view[pages].reshape(-1, kv_view.shape[-1])[:n].float() * scale
        for j in range(q1 - q0):
            seen = n - (q1 - q0) + 1 + j if meta.causal else n
            logits = tokens[q0 + j] @ keys[:seen].T * sm_scale
            out[q0 + j] = torch.softmax(logits, -1) @ keys[:seen, :kv_lora_rank]
    return out.view(*q.shape[:-1], kv_lora_rank)


@pytest.mark.parametrize("kv_dtype,page_size,q_len", [("bf16", 16, 1), ("fp8_e4m3", 8, 1),
                                                       ("bf16", 4, 3)])
def test_dense_csr_reproduces_reference(kv_dtype, page_size, q_len):
    problem = Problem(num_heads=3, kv_cache_dtype=kv_dtype, geometry=SMALL,
                      page_size=page_size, q_len=q_len)
    inputs = make_inputs(problem, Shape(5, 45), seed=7)
    meta = dense_csr(inputs.block_table, inputs.seq_lens, page_size=page_size, q_len=q_len)
    assert meta.causal == (q_len > 1) and meta.page_size == page_size
    assert csr_page_counts_match(meta)
    assert meta.qo_indptr.tolist() == list(range(0, 5 * q_len + 1, q_len))
    got = attend_csr(inputs.q, kv_cache_view(inputs.kv_cache, sparse=False), meta,
                     sm_scale=inputs.sm_scale, kv_lora_rank=32, kv_scale=inputs.kv_scale)
    want, _ = mla_reference(inputs.q, inputs.kv_cache, inputs.block_table, inputs.seq_lens,
                            sm_scale=inputs.sm_scale, kv_lora_rank=32, kv_scale=inputs.kv_scale)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("q_len", [1, 2])
def test_sparse_csr_reproduces_reference(q_len):
    problem = Problem(num_heads=2, geometry=SMALL, page_size=8, topk=16, q_len=q_len)
    inputs = make_inputs(problem, Shape(4, 40), seed=3)
    inputs.topk_indices[0, 0, :3] = -1          # holes in the middle of a row are dropped too
    meta = sparse_csr(inputs.block_table, inputs.seq_lens, inputs.topk_indices, page_size=8)
    assert meta.page_size == 1 and not meta.causal and csr_page_counts_match(meta)
    assert meta.kv_len_arr.numel() == 4 * q_len
    got = attend_csr(inputs.q, kv_cache_view(inputs.kv_cache, sparse=True), meta,
                     sm_scale=inputs.sm_scale, kv_lora_rank=32)
    want, _ = mla_reference(inputs.q, inputs.kv_cache, inputs.block_table, inputs.seq_lens,
                            sm_scale=inputs.sm_scale, kv_lora_rank=32,
                            topk_indices=inputs.topk_indices)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_sparse_slots_follow_the_block_table_and_drop_invisible_positions():
    table = torch.tensor([[5, 2, 7]], dtype=torch.int32)
    lens = torch.tensor([20], dtype=torch.int32)
    idx = torch.tensor([[[0, 9, 19, -1], [19, 3, -1, -1]]], dtype=torch.int32)   # q_len 2
    slots, valid = sparse_token_slots(table, lens, idx, page_size=8)
    # position 19 is on page column 2 (page 7), offset 3; query 0 sees only 19 tokens
    assert slots[0, 0].tolist() == [40, 17, -1, -1]
    assert slots[0, 1].tolist() == [59, 43, -1, -1]
    assert valid.sum().item() == 4


def test_sparse_row_without_valid_index_is_refused():
    table = torch.zeros(1, 2, dtype=torch.int32)
    idx = torch.full((1, 1, 4), -1, dtype=torch.int32)
    with pytest.raises(ValueError, match="no valid top-k index"):
        sparse_csr(table, torch.tensor([10], dtype=torch.int32), idx, page_size=8)


def test_dense_csr_refuses_a_short_block_table():
    with pytest.raises(ValueError, match="block_table has 1 columns"):
        dense_csr(torch.zeros(1, 1, dtype=torch.int32), torch.tensor([70], dtype=torch.int32),
                  page_size=64, q_len=1)


def test_registry_points_at_these_adapters():
    for cls in (FlashInferFA2, FlashInferFA3, FlashInferFA2Sparse, FlashInferFA3Sparse):
        assert load_adapter(cls.name) is cls
        assert BACKENDS[cls.name].capabilities.sparse == cls.sparse


def test_prepare_refuses_wrong_shape_before_any_gpu_work():
    problem = Problem(num_heads=4, page_size=16)
    inputs = make_inputs(problem, Shape(2, 40))
    collapsed = inputs.with_data(inputs.q, inputs.kv_cache.view(-1, 1, 576))
    with pytest.raises(ValueError, match="kv_cache has shape"):
        FlashInferFA3().prepare(problem, collapsed)
    with pytest.raises(ValueError, match="q has shape"):
        FlashInferFA2().prepare(problem.replace(num_heads=8), inputs)
    with pytest.raises(BackendUnavailable, match="needs CUDA tensors"):
        FlashInferFA3().prepare(problem, inputs)
    with pytest.raises(BackendUnavailable, match="does not run sparse"):
        FlashInferFA3().prepare(problem.replace(topk=16), make_inputs(problem.replace(topk=16),
                                                                      Shape(2, 40)))


def test_metadata_passes_flashinfers_own_csr_validation():
    pytest.importorskip("flashinfer")
    from flashinfer.mla._batch_mla._planning import (_DensePlanMetadata, _derive_csr_from_dense,
                                                     _validate_csr_metadata)

    problem = Problem(num_heads=2, page_size=16, topk=32, q_len=2)
    inputs = make_inputs(problem, Shape(6, 100), seed=11)
    dense = dense_csr(inputs.block_table, inputs.seq_lens, page_size=16, q_len=2)
    sparse = sparse_csr(inputs.block_table, inputs.seq_lens, inputs.topk_indices, page_size=16)
    for meta in (dense, sparse):
        _validate_csr_metadata(qo_indptr=meta.qo_indptr, kv_indptr=meta.kv_indptr,
                               kv_indices=meta.kv_indices, kv_len_arr=meta.kv_len_arr,
                               page_size=meta.page_size, device=torch.device("cpu"))
    theirs = _derive_csr_from_dense(
        _DensePlanMetadata(cum_seq_lens_q=dense.qo_indptr, block_tables=inputs.block_table,
                           seq_lens=inputs.seq_lens, max_q_len=2), page_size=16)
    assert torch.equal(theirs.kv_indptr, dense.kv_indptr)
    assert torch.equal(theirs.kv_indices, dense.kv_indices)


@pytest.mark.parametrize("heads,batch,kv_len", [(128, 128, 16384), (16, 128, 32768), (1, 1, 1024)])
def test_benchmark_grid_fits_flashinfers_work_item_limit(heads, batch, kv_len):
    pytest.importorskip("flashinfer")
    from flashinfer.mla._batch_mla._backends._fa_common import (_FA_MAX_WORK_ITEMS,
                                                                _fa_plan_work_count)

    h100_sms = 132
    count = _fa_plan_work_count([1] * batch, [kv_len] * batch, heads, h100_sms, False)
    assert count <= _FA_MAX_WORK_ITEMS
    sparse_count = _fa_plan_work_count([1] * batch, [min(2048, kv_len)] * batch, heads,
                                       h100_sms, False)
    assert sparse_count <= _FA_MAX_WORK_ITEMS
    assert math.isfinite(count)
