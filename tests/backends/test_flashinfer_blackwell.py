"""Blackwell FlashInfer paths: argument construction on the CPU, and eligibility.

No SM100/SM120 GPU has run these paths, so they are untested on hardware; the
arguments are checked against FlashInfer's own shape validation (which runs
without a GPU) and their meaning against the float32 reference.
"""

from __future__ import annotations

import sys

import pytest
import torch

from mla_tune.backends.flashinfer_blackwell import (TrtllmGenMLA, TrtllmGenSparseMLA,
                                                    XqaSparseMLA, bmm_scales,
                                                    packed_sparse_slots, padded_block_table,
                                                    trtllm_arguments, trtllm_refusal)
from mla_tune.backends.inputs import make_inputs
from mla_tune.backends.interface import BackendUnavailable
from mla_tune.backends.problem import DeviceSpec, Problem, Shape
from mla_tune.backends.reference import mla_reference
from mla_tune.backends.registry import backend_reasons, load_adapter

BLACKWELL = ("FLASHINFER_MLA", "FLASHINFER_MLA_SPARSE", "FLASHINFER_MLA_SPARSE_SM120")
DEVICES = {"sm80": DeviceSpec("NVIDIA A100-SXM4-80GB", (8, 0)),
           "sm89": DeviceSpec("NVIDIA L40S", (8, 9)),
           "sm90": DeviceSpec("NVIDIA H100 80GB HBM3", (9, 0)),
           "sm100": DeviceSpec("NVIDIA B200", (10, 0)),
           "sm120": DeviceSpec("NVIDIA RTX PRO 6000 Blackwell", (12, 0))}


@pytest.fixture(autouse=True, scope="module")
def _forget_flashinfer():
    """Unload FlashInfer after this module: other tests assert that lookups never import it."""
    before = set(sys.modules)
    yield
    for name in [n for n in sys.modules if n not in before and n.split(".")[0] == "flashinfer"]:
        del sys.modules[name]


@pytest.mark.parametrize("device", ["sm80", "sm89", "sm90"])
@pytest.mark.parametrize("name", BLACKWELL)
def test_pre_blackwell_gpus_never_try_blackwell_paths(name, device):
    for problem in (Problem(num_heads=16), Problem(num_heads=16, topk=2048),
                    Problem(num_heads=128, kv_cache_dtype="fp8")):
        reasons = backend_reasons(name, problem, DEVICES[device], check_packages=False)
        assert any("compute capability" in r for r in reasons), reasons


def test_blackwell_eligibility_matches_flashinfers_checks():
    sm100 = DEVICES["sm100"]
    dense = Problem(num_heads=16, page_size=64)
    assert backend_reasons("FLASHINFER_MLA", dense, sm100, check_packages=False) == []
    assert backend_reasons("FLASHINFER_MLA_SPARSE", dense.replace(topk=2048), sm100,
                           check_packages=False) == []
    assert backend_reasons("FLASHINFER_MLA", dense.replace(num_heads=96), sm100,
                           check_packages=False)
    assert backend_reasons("FLASHINFER_MLA", dense.replace(page_size=16), sm100,
                           check_packages=False)
    assert backend_reasons("FLASHINFER_MLA_SPARSE_SM120", dense.replace(topk=2048), sm100,
                           check_packages=False)
    # the registry and the adapter's own refusal agree on the head, page and query limits
    for heads, page_size, query in ((96, 64, "bf16"), (16, 16, "bf16"), (128, 32, "bf16"),
                                    (64, 64, "bf16"), (16, 64, "fp16")):
        problem = Problem(num_heads=heads, page_size=page_size, query_dtype=query)
        by_registry = bool(backend_reasons("FLASHINFER_MLA", problem, sm100, check_packages=False))
        assert by_registry == (trtllm_refusal(problem, (10, 0)) is not None)


@pytest.mark.parametrize("topk,q_len,kv_dtype", [(None, 1, "bf16"), (None, 2, "fp8_e4m3"),
                                                 (64, 1, "bf16"), (64, 2, "fp8_e4m3")])
def test_arguments_pass_flashinfers_shape_check(topk, q_len, kv_dtype):
    pytest.importorskip("flashinfer")
    from flashinfer.mla._core import _check_trtllm_gen_mla_shape

    problem = Problem(num_heads=16, kv_cache_dtype=kv_dtype, page_size=32, topk=topk, q_len=q_len)
    inputs = make_inputs(problem, Shape(3, 150), seed=2)
    query = inputs.q.to(torch.float8_e4m3fn) if kv_dtype == "fp8_e4m3" else inputs.q
    args = trtllm_arguments(problem, inputs, query)
    assert args["backend"] == "trtllm-gen" and args["max_seq_len"] == 150
    assert args["sparse_mla_top_k"] == (topk or 0)
    for aligned in (True, False):
        kv4 = _check_trtllm_gen_mla_shape(
            args["query"], args["kv_cache"], args["kv_lora_rank"], args["qk_rope_head_dim"],
            args["sparse_mla_top_k"], args["block_tables"], problem.page_size,
            require_aligned_block_table=aligned)
        assert kv4.shape == (inputs.kv_cache.shape[0], 1, 32, 576)
    assert args["block_tables"].dtype == torch.int32


def test_padded_block_table_keeps_rows_and_aligns_width():
    table = torch.arange(6, dtype=torch.int32).view(2, 3)
    padded = padded_block_table(table, page_size=32)
    assert padded.shape == (2, 4) and torch.equal(padded[:, :3], table)
    assert padded_block_table(table, page_size=64).shape == (2, 4)
    assert padded_block_table(torch.zeros(1, 4, dtype=torch.int32), page_size=32).shape == (1, 4)


def emulate_trtllm(args, *, kv_lora_rank=512):
    """softmax(q.k x bmm1) @ v x bmm2 over stored KV values, as the kernel defines it."""
    q = args["query"].float()
    flat = args["kv_cache"].reshape(-1, args["kv_cache"].shape[-1]).float()
    page_size = args["kv_cache"].shape[1]
    batch, q_len, heads, _ = q.shape
    out = torch.zeros(batch, q_len, heads, kv_lora_rank)
    for b in range(batch):
        length = int(args["seq_lens"][b])
        for i in range(q_len):
            if args["sparse_mla_top_k"]:
                slots = args["block_tables"][b, i].long()
                keys = flat[slots[slots >= 0]]
            else:
                visible = length - q_len + 1 + i
                pos = torch.arange(visible)
                keys = flat[args["block_tables"][b, pos // page_size].long() * page_size
                            + pos % page_size]
            probs = torch.softmax(q[b, i] @ keys.T * args["bmm1_scale"], -1)
            out[b, i] = probs @ keys[:, :kv_lora_rank] * args["bmm2_scale"]
    return out


@pytest.mark.parametrize("topk,kv_dtype", [(None, "fp8_e4m3"), (None, "bf16"), (48, "fp8_e4m3")])
def test_scales_and_slots_mean_what_the_reference_computes(topk, kv_dtype):
    problem = Problem(num_heads=2, kv_cache_dtype=kv_dtype, page_size=32, topk=topk, q_len=2)
    inputs = make_inputs(problem, Shape(3, 90), seed=4)
    args = trtllm_arguments(problem, inputs, inputs.q)   # unquantised q: isolates the scales
    want, _ = mla_reference(inputs.q, inputs.kv_cache, inputs.block_table, inputs.seq_lens,
                            sm_scale=inputs.sm_scale, kv_scale=inputs.kv_scale,
                            topk_indices=inputs.topk_indices)
    torch.testing.assert_close(emulate_trtllm(args), want, rtol=2e-4, atol=2e-4)


def test_sparse_slots_are_packed_valid_first():
    table = torch.tensor([[3, 1]], dtype=torch.int32)
    idx = torch.tensor([[[-1, 5, -1, 40]]], dtype=torch.int32)
    slots = packed_sparse_slots(table, torch.tensor([50], dtype=torch.int32), idx, page_size=32)
    assert slots.tolist() == [[[101, 40, -1, -1]]]


def test_bmm_scales():
    assert bmm_scales(sm_scale=0.1, kv_scale=None) == (0.1, 1.0)
    assert bmm_scales(sm_scale=0.1, kv_scale=0.5) == pytest.approx((0.05, 0.5))


@pytest.mark.parametrize("cls", [TrtllmGenMLA, TrtllmGenSparseMLA, XqaSparseMLA])
def test_adapters_refuse_with_a_reason_off_blackwell(cls):
    assert load_adapter(cls.name) is cls
    problem = Problem(num_heads=16, page_size=64, topk=2048 if cls is not TrtllmGenMLA else None)
    inputs = make_inputs(problem, Shape(1, 100))
    with pytest.raises(BackendUnavailable) as err:
        cls().prepare(problem, inputs)
    assert "SM100" in str(err.value) or "fp8_ds_mla" in str(err.value)


def test_trtllm_refusal_reasons_name_the_value():
    assert "9.0" in trtllm_refusal(Problem(num_heads=16), (9, 0))
    assert "fp16" in trtllm_refusal(Problem(num_heads=16, query_dtype="fp16"), (10, 0))
    assert "96" in trtllm_refusal(Problem(num_heads=96), (10, 0))
    assert trtllm_refusal(Problem(num_heads=128, page_size=32), (10, 0)) is None
