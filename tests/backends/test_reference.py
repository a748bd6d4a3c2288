"""The float32 reference against a naive per-request, per-query, per-head Python loop."""

from __future__ import annotations

import math

import pytest
import torch

from mla_tune.backends.inputs import make_inputs
from mla_tune.backends.interface import DecodeInputs
from mla_tune.backends.problem import Geometry, Problem, Shape
from mla_tune.backends.reference import TorchReference, mla_reference

SMALL = Geometry(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)


def naive(inputs: DecodeInputs, kv_lora_rank: int):
    """Token by token: find each key through the block table, softmax in float64."""
    q, kv, bt = inputs.q.double(), inputs.kv_cache, inputs.block_table
    page_size = kv.shape[1]
    scale = 1.0 if inputs.kv_scale is None else inputs.kv_scale
    batch, q_len, heads, _ = q.shape
    out = torch.zeros(batch, q_len, heads, kv_lora_rank, dtype=torch.float64)
    lse = torch.full((batch, q_len, heads), -math.inf, dtype=torch.float64)
    for b in range(batch):
        length = int(inputs.seq_lens[b])
        for i in range(q_len):
            visible = length - q_len + 1 + i
            if inputs.topk_indices is None:
                positions = list(range(visible))
            else:
                positions = [int(p) for p in inputs.topk_indices[b, i] if 0 <= int(p) < visible]
            if not positions:
                continue
            keys = torch.stack([kv[int(bt[b, p // page_size]), p % page_size].double() * scale
                                for p in positions])
            for h in range(heads):
                logits = [float(q[b, i, h] @ k) * inputs.sm_scale for k in keys]
                top = max(logits)
                weights = [math.exp(x - top) for x in logits]
                total = sum(weights)
                lse[b, i, h] = top + math.log(total)
                out[b, i, h] = sum(w / total * k[:kv_lora_rank] for w, k in zip(weights, keys))
    return out, lse


CASES = [
    # heads, kv dtype, page size, topk, q_len, batch, kv_len
    (1, "bf16", 16, None, 1, 3, 50),
    (5, "fp16", 8, None, 2, 4, 37),
    (3, "fp8_e4m3", 16, None, 1, 3, 40),
    (4, "bf16", 4, 12, 1, 4, 30),        # some requests shorter than top-k: -1 padding
    (2, "fp8_e4m3", 8, 16, 3, 3, 33),    # sparse MTP
]


@pytest.mark.parametrize("heads,kv_dtype,page_size,topk,q_len,batch,kv_len", CASES)
def test_reference_matches_naive_loop(heads, kv_dtype, page_size, topk, q_len, batch, kv_len):
    problem = Problem(num_heads=heads, kv_cache_dtype=kv_dtype, geometry=SMALL,
                      page_size=page_size, topk=topk, q_len=q_len)
    inputs = make_inputs(problem, Shape(batch, kv_len), seed=heads + q_len)
    out, lse = mla_reference(inputs.q, inputs.kv_cache, inputs.block_table, inputs.seq_lens,
                             sm_scale=inputs.sm_scale, kv_lora_rank=SMALL.kv_lora_rank,
                             kv_scale=inputs.kv_scale, topk_indices=inputs.topk_indices)
    want_out, want_lse = naive(inputs, SMALL.kv_lora_rank)
    assert out.dtype == torch.float32 and out.shape == (batch, q_len, heads, SMALL.kv_lora_rank)
    assert lse.shape == (batch, q_len, heads)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-4)


def test_three_dim_query_gives_three_dim_output():
    problem = Problem(num_heads=3, geometry=SMALL, page_size=16)
    inputs = make_inputs(problem, Shape(2, 40))
    out4, lse4 = mla_reference(inputs.q, inputs.kv_cache, inputs.block_table, inputs.seq_lens,
                               sm_scale=0.1, kv_lora_rank=32)
    out3, lse3 = mla_reference(inputs.q[:, 0], inputs.kv_cache, inputs.block_table,
                               inputs.seq_lens, sm_scale=0.1, kv_lora_rank=32)
    assert out3.shape == (2, 3, 32) and lse3.shape == (2, 3)
    torch.testing.assert_close(out3, out4[:, 0])
    torch.testing.assert_close(lse3, lse4[:, 0])


def test_row_without_visible_key_gives_zero_and_minus_inf():
    problem = Problem(num_heads=2, geometry=SMALL, page_size=8, topk=4)
    inputs = make_inputs(problem, Shape(2, 20))
    inputs.topk_indices[1] = -1
    out, lse = mla_reference(inputs.q, inputs.kv_cache, inputs.block_table, inputs.seq_lens,
                             sm_scale=0.1, kv_lora_rank=32, topk_indices=inputs.topk_indices)
    assert torch.all(out[1] == 0) and torch.all(lse[1] == -math.inf)
    assert torch.all(torch.isfinite(lse[0])) and out[0].abs().sum() > 0


def test_fp8_scale_is_applied():
    problem = Problem(num_heads=2, kv_cache_dtype="fp8_e4m3", geometry=SMALL, page_size=8)
    inputs = make_inputs(problem, Shape(2, 20))
    args = (inputs.q, inputs.kv_cache, inputs.block_table, inputs.seq_lens)
    scaled, _ = mla_reference(*args, sm_scale=0.1, kv_lora_rank=32, kv_scale=inputs.kv_scale)
    doubled, _ = mla_reference(*args, sm_scale=0.05, kv_lora_rank=32,
                               kv_scale=torch.tensor(2 * inputs.kv_scale))
    torch.testing.assert_close(doubled, 2 * scaled)


def test_adapter_checks_inputs_and_returns_query_dtype():
    problem = Problem(num_heads=4, geometry=SMALL, page_size=16)
    inputs = make_inputs(problem, Shape(2, 40))
    prepared = TorchReference().prepare(problem, inputs)
    out, lse = prepared.run(inputs)
    assert TorchReference.name == "TORCH_REFERENCE"
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    bad = inputs.with_data(inputs.q, inputs.kv_cache.view(-1, 1, SMALL.head_size))
    with pytest.raises(ValueError, match="kv_cache"):
        TorchReference().prepare(problem, bad)
