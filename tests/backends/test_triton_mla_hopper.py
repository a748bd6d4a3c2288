"""The warp-specialised Hopper kernel (`backends/triton_mla/hopper.py`) against the float32 reference.

CPU: every variant compiles for sm_90a offline (Gluon has no interpreter), with wgmma, no spills beyond a
few bytes and within the SM's shared memory; the launch parameters refuse what the kernel cannot run.
GPU (marker `gpu`, Hopper only): issue 4's correctness grid through `mla_decode` with explicit
warp-specialised parameters.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from mla_tune.backends.problem import Problem, Shape  # noqa: E402
from test_triton_mla import EDGE_LENGTHS, _gpu_problem, _run_case, _tol  # noqa: E402

SMEM_LIMIT = 227 * 1024  # an SM90 block's dynamic shared memory


def _spill_bytes(report: str) -> int:
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", report))


@pytest.mark.parametrize("split_scores", [True, False])
@pytest.mark.parametrize("kv,sparse,q_len,page_size", [
    ("bf16", False, 1, 64), ("fp16", False, 2, 16), ("bf16", True, 2, 1),
    ("fp8", False, 1, 64), ("fp8", True, 2, 1), ("fp8", False, 2, 128)])
def test_hopper_kernel_compiles_for_sm90a(kv, sparse, q_len, page_size, split_scores):
    from offline_compile import hopper_compile

    from mla_tune.backends.triton_mla.launch import HOPPER_TILES

    tile = HOPPER_TILES["fp8" if kv == "fp8" else "16bit"]
    ptx, smem, report = hopper_compile(kv=kv, sparse=sparse, q_len=q_len, page_size=page_size,
                                       block_n=tile.block_n, stages=tile.num_stages, split_scores=split_scores)
    assert smem <= SMEM_LIMIT, smem
    assert "wgmma.mma_async" in ptx and "cp.async.cg.shared.global" in ptx
    assert "setmaxnreg" in ptx, "the loader warpgroup must hand its registers to the MMA warps"
    # the two-partition form keeps a few wgmma descriptors in local memory (uniform registers run out)
    assert _spill_bytes(report) <= (64 if split_scores else 512), report


def test_warp_specialized_params_refuse_tl_only_fields():
    from mla_tune.backends.triton_mla import LaunchParams

    with pytest.raises(ValueError, match="does not take the tl kernel's split_d"):
        LaunchParams(block_h=64, num_warps=8, split_d=True, warp_specialized=True)
    with pytest.raises(ValueError, match="needs block_h 64"):
        LaunchParams(block_h=32, num_warps=8, warp_specialized=True)
    assert LaunchParams(block_h=64, num_warps=8, block_n=64, warp_specialized=True).label().endswith("Wx1")


def test_warp_specialized_launch_needs_a_gpu():
    from mla_tune.backends.inputs import make_inputs
    from mla_tune.backends.triton_mla import LaunchParams, mla_decode

    inputs = make_inputs(Problem(num_heads=4, page_size=16), Shape(1, 40))
    with pytest.raises(ValueError, match="CUDA GPU only"):
        mla_decode(inputs.q, inputs.kv_cache, inputs.block_table, inputs.seq_lens, sm_scale=inputs.sm_scale,
                   params=LaunchParams(block_h=64, num_warps=8, block_n=64, warp_specialized=True))


# ---------------------------------------------------------------- GPU (Hopper)

def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _params(kv_dtype, *, heads, q_len, batch, max_items, lengths, sparse=False, stages=None, split_scores=None):
    from mla_tune.backends.triton_mla.launch import HOPPER_TILES, params_from_tile

    tile = HOPPER_TILES["fp8" if kv_dtype == "fp8_e4m3" else "16bit"]
    if stages:
        tile = tile._replace(num_stages=stages)
    if split_scores is not None:
        tile = tile._replace(split_scores=split_scores)
    return params_from_tile(tile, rows=heads if sparse else heads * q_len, q_len=q_len, batch=batch,
                            max_items=max_items, sparse=sparse, lengths=lengths,
                            num_sms=torch.cuda.get_device_properties(0).multi_processor_count)


GPU_KV_DTYPES = ("bf16", "fp16", "fp8_e4m3")
hopper_only = pytest.mark.skipif(not _hopper(), reason="the warp-specialised kernel needs an SM90 GPU")


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("kv_dtype", GPU_KV_DTYPES)
@pytest.mark.parametrize("q_len", [1, 2])
@pytest.mark.parametrize("heads", [1, 3, 16, 20, 64, 128])
@pytest.mark.parametrize("page_size", [16, 64, 128])
@pytest.mark.parametrize("split_scores", [True, False])
def test_gpu_hopper_dense_edge_lengths(kv_dtype, q_len, heads, page_size, split_scores):
    # lengths 1, 15, 16, 17, 1000, 0 (+ two long ones, so that requests split), permuted pages
    lens = [max(n, q_len) if n else 0 for n in EDGE_LENGTHS] + [5000, 777]
    params = _params(kv_dtype, heads=heads, q_len=q_len, batch=len(lens), max_items=5000, lengths=lens,
                     split_scores=split_scores)
    problem = _gpu_problem(kv_dtype, num_heads=heads, page_size=page_size, q_len=q_len)
    r = _run_case(problem, Shape(len(lens), 5000), device="cuda", seq_lens=lens, params=params)
    assert params.warp_specialized and not r["nan"] and r["unseen_rows_ok"] and r["out_dtype_ok"]
    assert r["rel_err"] < _tol(kv_dtype) and r["lse_err"] < 1e-2, r


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("kv_dtype", GPU_KV_DTYPES)
@pytest.mark.parametrize("heads,batch,kv_len,q_len", [(16, 1, 32768, 1), (128, 2, 32768, 1), (64, 8, 4096, 1),
                                                      (20, 33, 3000, 2), (128, 64, 1024, 2)])
@pytest.mark.parametrize("split_scores", [True, False])
def test_gpu_hopper_dense_long(kv_dtype, heads, batch, kv_len, q_len, split_scores):
    from mla_tune.backends.inputs import ragged_lengths

    lens = ragged_lengths(Shape(batch, kv_len), page_size=64, min_len=q_len, seed=7)
    params = _params(kv_dtype, heads=heads, q_len=q_len, batch=batch, max_items=kv_len, lengths=lens,
                     split_scores=split_scores)
    problem = _gpu_problem(kv_dtype, num_heads=heads, page_size=64, q_len=q_len)
    r = _run_case(problem, Shape(batch, kv_len), device="cuda", params=params)
    assert not r["nan"] and r["rel_err"] < _tol(kv_dtype) and r["lse_err"] < 1e-2, r


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("kv_dtype", GPU_KV_DTYPES)
@pytest.mark.parametrize("q_len", [1, 2])
@pytest.mark.parametrize("heads,page_size", [(3, 1), (16, 64), (20, 16), (64, 1), (128, 64)])
@pytest.mark.parametrize("split_scores", [True, False])
def test_gpu_hopper_sparse_topk2048(kv_dtype, q_len, heads, page_size, split_scores):
    # ragged lengths up to 2500: most requests have fewer than 2048 positions, so slots are -1 padded
    batch = 6
    params = _params(kv_dtype, heads=heads, q_len=q_len, batch=batch, max_items=2048, lengths=[2048] * batch,
                     sparse=True, split_scores=split_scores)
    problem = _gpu_problem(kv_dtype, num_heads=heads, page_size=page_size, topk=2048, q_len=q_len)
    r = _run_case(problem, Shape(batch, 2500), device="cuda", params=params)
    assert not r["nan"] and r["unseen_rows_ok"] and r["rel_err"] < _tol(kv_dtype) and r["lse_err"] < 1e-2, r


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("kv_dtype,stages", [("fp8_e4m3", 2), ("bf16", 3)])
@pytest.mark.parametrize("split_scores", [True, False])
def test_gpu_hopper_large_query_and_ring_depth(kv_dtype, stages, split_scores):
    # |q| ~ 3e4: the fp16 query of FP8 must keep its 2^-8 scale; a 3-slot ring (BF16 32-token slots)
    # wraps its phases differently
    lens = [3000, 17, 2999]
    params = _params(kv_dtype, heads=64, q_len=1, batch=3, max_items=3000, lengths=lens, stages=stages,
                     split_scores=split_scores)
    if stages == 3:
        params = dataclasses.replace(params, block_n=32,
                                     split_items=(params.split_items + 31) // 32 * 32)
    problem = Problem(num_heads=64, kv_cache_dtype=kv_dtype, page_size=64)
    r = _run_case(problem, Shape(3, 3000), device="cuda", seq_lens=lens, params=params, q_mult=3e4,
                  scale_tensor=kv_dtype == "fp8_e4m3")
    assert not r["nan"] and r["rel_err"] < _tol(kv_dtype) and r["lse_err"] < 1e-2, r


@pytest.mark.gpu
@hopper_only
def test_gpu_hopper_runs_inside_a_cuda_graph():
    from mla_tune.backends.inputs import make_inputs
    from mla_tune.backends.reference import mla_reference
    from mla_tune.backends.triton_mla.adapter import TritonMLA
    from test_triton_mla import _rel_err

    problem = Problem(num_heads=64, kv_cache_dtype="bf16", page_size=64)
    inputs = make_inputs(problem, Shape(4, 3000), device="cuda", seed=3)
    lens = [int(n) for n in inputs.seq_lens.tolist()]
    prepared = TritonMLA(_params("bf16", heads=64, q_len=1, batch=4, max_items=max(lens),
                                 lengths=lens)).prepare(problem, inputs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = prepared.run(inputs)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    ref_out, _ = mla_reference(inputs.q, inputs.kv_cache, inputs.block_table, inputs.seq_lens,
                               sm_scale=inputs.sm_scale)
    assert _rel_err(out, ref_out) < 1e-2
