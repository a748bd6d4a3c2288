"""The shared input generator: random, scattered, ragged, with valid top-k positions."""

from __future__ import annotations

import math

import pytest
import torch

from mla_tune.backends.inputs import (FP8_KV_SCALE, bytes_touched, clone_data, input_set_bytes,
                                      kv_bytes_read, make_inputs)
from mla_tune.backends.interface import check_inputs
from mla_tune.backends.problem import Problem, Shape


def test_dense_inputs_pass_check_and_are_scattered_and_ragged():
    problem = Problem(num_heads=16, page_size=64)
    inputs = make_inputs(problem, Shape(8, 1024), seed=3)
    check_inputs(problem, inputs)
    lens = inputs.seq_lens.tolist()
    assert max(lens) == 1024 and len(set(lens)) > 1
    assert all(n % 64 for n in lens if n != 1024)
    used = [int(inputs.block_table[b, p]) for b, n in enumerate(lens) for p in range(math.ceil(n / 64))]
    assert len(used) == len(set(used)), "two requests share a page"
    assert inputs.kv_cache.shape[0] > len(used), "no spare pages in the pool"
    assert used != sorted(used), "pages are laid out in order"
    first_row = [int(inputs.block_table[0, p]) for p in range(16)]
    assert first_row != list(range(first_row[0], first_row[0] + 16))
    assert inputs.q.abs().min() >= 0 and inputs.q.float().std() > 0.5
    assert inputs.kv_cache.float().std() > 0.5


def test_same_seed_same_inputs_other_seed_differs():
    problem = Problem(num_heads=4, page_size=16, topk=32)
    a, b = (make_inputs(problem, Shape(3, 100), seed=1) for _ in range(2))
    c = make_inputs(problem, Shape(3, 100), seed=2)
    assert torch.equal(a.q, b.q) and torch.equal(a.topk_indices, b.topk_indices)
    assert not torch.equal(a.q, c.q)


def test_not_ragged_gives_equal_lengths():
    inputs = make_inputs(Problem(num_heads=2, page_size=16), Shape(4, 100), ragged=False)
    assert inputs.seq_lens.tolist() == [100] * 4


def test_fp8_inputs_have_scale_and_unit_real_values():
    problem = Problem(num_heads=2, kv_cache_dtype="fp8", page_size=16)
    inputs = make_inputs(problem, Shape(2, 200))
    check_inputs(problem, inputs)
    assert inputs.kv_cache.dtype == torch.float8_e4m3fn and inputs.kv_scale == FP8_KV_SCALE
    real_std = (inputs.kv_cache.float() * inputs.kv_scale).std()
    assert 0.8 < real_std < 1.2


@pytest.mark.parametrize("q_len", [1, 2])
def test_topk_positions_are_distinct_visible_and_padded(q_len):
    problem = Problem(num_heads=2, page_size=16, topk=64, q_len=q_len)
    inputs = make_inputs(problem, Shape(6, 120), seed=5)
    check_inputs(problem, inputs)
    idx = inputs.topk_indices
    for b, n in enumerate(inputs.seq_lens.tolist()):
        for i in range(q_len):
            visible = n - q_len + 1 + i
            row = idx[b, i].tolist()
            valid = [p for p in row if p >= 0]
            assert len(valid) == min(64, visible)
            assert len(set(valid)) == len(valid) and all(p < visible for p in valid)
            assert row[len(valid):] == [-1] * (64 - len(valid))
    assert (idx == -1).any() or min(inputs.seq_lens.tolist()) >= 64


def test_clone_data_shares_metadata_and_copies_data():
    inputs = make_inputs(Problem(num_heads=2, page_size=16), Shape(2, 50))
    sets = clone_data(inputs, 3)
    assert sets[0] is inputs and len(sets) == 3
    assert sets[1].block_table is inputs.block_table
    assert sets[2].kv_cache.data_ptr() != inputs.kv_cache.data_ptr()
    assert torch.equal(sets[2].kv_cache, inputs.kv_cache)
    assert input_set_bytes(inputs) == (inputs.q.numel() + inputs.kv_cache.numel()) * 2
    assert kv_bytes_read(inputs) == int(inputs.seq_lens.sum()) * 576 * 2


def test_bytes_touched_counts_the_rows_a_step_reads_not_the_cache():
    dense = make_inputs(Problem(num_heads=3, page_size=16), Shape(3, 50), seed=2)
    q_bytes = dense.q.numel() * 2
    assert bytes_touched(dense) == q_bytes + int(dense.seq_lens.sum()) * 576 * 2
    # sparse MTP: two query positions of a request name overlapping rows, counted once
    sparse = make_inputs(Problem(num_heads=3, q_len=2, topk=64, page_size=16), Shape(2, 300), seed=2)
    distinct = sum(len({p for p in sparse.topk_indices[b].flatten().tolist() if p >= 0}) for b in range(2))
    assert bytes_touched(sparse) == sparse.q.numel() * 2 + distinct * 576 * 2
    assert 64 < distinct < 2 * 2 * 64          # overlapping, yet more than one position's
    assert bytes_touched(sparse) < kv_bytes_read(sparse) + sparse.q.numel() * 2 < input_set_bytes(sparse)


def test_cold_l2_sets_rotate_until_the_rows_read_cover_three_l2s():
    from mla_tune.tuner.timing import cold_l2_sets

    sparse = make_inputs(Problem(num_heads=3, topk=64, page_size=16), Shape(2, 3000), seed=2)
    l2 = 4 * bytes_touched(sparse)
    assert 3 * l2 < input_set_bytes(sparse)    # so a rotation sized by allocated bytes had one set
    sets = cold_l2_sets(sparse, l2_bytes=l2)
    assert len(sets) == 12 and sets[0] is sparse
    assert len(cold_l2_sets(sparse, l2_bytes=l2, free_bytes=2 * input_set_bytes(sparse))) == 3


def test_kv_len_shorter_than_q_len_is_refused():
    with pytest.raises(ValueError, match="q_len"):
        make_inputs(Problem(num_heads=2, q_len=3), Shape(1, 2))
