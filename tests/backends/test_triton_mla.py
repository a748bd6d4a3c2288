"""MLA_TUNE_TRITON / MLA_TUNE_TRITON_SPARSE (the portable tl kernel) against the float32 reference.

CPU: the kernels run under the Triton interpreter in one subprocess (the
interpreter must be switched on before triton is imported, and must stay off
for the GPU tests in this process), on small shapes. GPU (marker `gpu`): the
full correctness grid on the device.
"""

from __future__ import annotations

import json
import math
import sys

import pytest
from interpreted import interpreted_worker

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from mla_tune.backends.inputs import make_inputs  # noqa: E402
from mla_tune.backends.problem import Problem, Shape  # noqa: E402
from mla_tune.backends.reference import mla_reference  # noqa: E402

BF16_TOL, FP8_TOL = 1e-2, 2e-2

# name -> (problem kwargs, shape, explicit seq_lens or None, LaunchParams keywords or None, kv_scale as tensor
#          [, factor applied to q])
CPU_CASES = {
    "bf16_h3_edge_lengths": (dict(num_heads=3, page_size=16), (5, 17), [1, 15, 16, 17, 0], None, False),
    "bf16_h3_qlen2_splits": (dict(num_heads=3, page_size=16, q_len=2), (3, 70), None,
                             dict(block_h=16, block_n=16, num_warps=4, num_stages=1, num_splits=3), False),
    "bf16_h20_qlen2_two_mblocks": (dict(num_heads=20, page_size=16, q_len=2), (2, 40), None,
                                   dict(block_h=32, block_n=16, num_warps=4, num_stages=1, num_splits=2,
                                        split_d=True), False),
    # MTP with 3 and 4 query tokens (causal inside the query block): 12 and 15 packed rows in one 16-row block, 60
    # rows in two 32-row blocks, and sparse (each query token its own top-k row)
    "bf16_h3_qlen4_splits": (dict(num_heads=3, page_size=16, q_len=4), (3, 70), [4, 17, 70],
                             dict(block_h=16, block_n=16, num_warps=4, num_stages=1, num_splits=3), False),
    "fp8_h5_qlen3_page64_splits": (dict(num_heads=5, kv_cache_dtype="fp8_e4m3", page_size=64, q_len=3), (2, 150),
                                   None, dict(block_h=16, block_n=32, num_warps=4, num_stages=2, num_splits=2,
                                              reload_v=True), False),
    "bf16_h20_qlen3_two_mblocks": (dict(num_heads=20, page_size=16, q_len=3), (2, 40), None,
                                   dict(block_h=32, block_n=16, num_warps=4, num_stages=1, num_splits=2,
                                        split_d=True), False),
    "sparse_bf16_h3_qlen4": (dict(num_heads=3, page_size=16, topk=32, q_len=4), (3, 60), None,
                             dict(block_h=16, block_n=16, num_warps=4, num_stages=1, num_splits=2), False),
    "fp8_h5_page64_splits": (dict(num_heads=5, kv_cache_dtype="fp8_e4m3", page_size=64), (2, 150), None,
                             dict(block_h=16, block_n=32, num_warps=4, num_stages=2, num_splits=2, reload_v=True),
                             False),
    "fp8_h1_scale_tensor": (dict(num_heads=1, kv_cache_dtype="fp8_e4m3", page_size=16), (2, 33), None, None, True),
    "fp16_h3": (dict(num_heads=3, kv_cache_dtype="fp16", query_dtype="fp16", page_size=32), (2, 50), None, None,
                False),
    # block-table entries held in registers, 4 at a time: several chunks per split, ragged ends
    "bf16_h3_hoisted_pages": (dict(num_heads=3, page_size=16), (5, 130), [1, 15, 16, 17, 130],
                              dict(block_h=16, block_n=16, num_warps=4, num_stages=3, num_splits=1, split_d=True,
                                   hoist_pages=4), False),
    "fp8_h5_hoisted_pages_splits": (dict(num_heads=5, kv_cache_dtype="fp8_e4m3", page_size=32), (2, 200), None,
                                    dict(block_h=16, block_n=32, num_warps=4, num_stages=3, num_splits=2,
                                         split_d=True, reload_v=True, hoist_pages=4), False),
    # FP8 tiles multiplied in fp16 (q scaled by 2^-8); queries of 3e4 would overflow an unscaled fp16
    "fp8_h5_fp16_math_splits": (dict(num_heads=5, kv_cache_dtype="fp8_e4m3", page_size=16), (3, 90), [1, 17, 90],
                                dict(block_h=16, block_n=32, num_warps=4, num_stages=2, num_splits=2, split_d=True,
                                     reload_v=True, fp16_math=True), False),
    "fp8_h3_fp16_math_large_query": (dict(num_heads=3, kv_cache_dtype="fp8_e4m3", page_size=16), (2, 40), None,
                                     dict(block_h=16, block_n=16, num_warps=4, num_stages=2, num_splits=1,
                                          split_d=True, fp16_math=True), False, 3e4),
    "sparse_fp8_h3_fp16_math": (dict(num_heads=3, kv_cache_dtype="fp8_e4m3", page_size=16, topk=24), (2, 40), None,
                                dict(block_h=16, block_n=16, num_warps=4, num_stages=2, num_splits=2, split_d=True,
                                     reload_v=True, fp16_math=True), False),
    # scores split between warpgroups, p and alpha exchanged through the scratch (ragged, several splits)
    "bf16_h20_split_scores": (dict(num_heads=20, page_size=16), (4, 150), [1, 17, 150, 0],
                              dict(block_h=32, block_n=16, num_warps=4, num_stages=2, num_splits=3, split_d=True,
                                   split_scores=True), False),
    "fp8_h5_split_scores_fp16_hoisted": (dict(num_heads=5, kv_cache_dtype="fp8_e4m3", page_size=16), (2, 90), None,
                                         dict(block_h=16, block_n=16, num_warps=4, num_stages=3, num_splits=2,
                                              split_d=True, hoist_pages=4, fp16_math=True, split_scores=True),
                                         False),
    "sparse_bf16_h3_split_scores": (dict(num_heads=3, page_size=16, topk=40, q_len=2), (2, 60), None,
                                    dict(block_h=16, block_n=16, num_warps=4, num_stages=2, num_splits=2,
                                         split_d=True, split_scores=True), False),
    "sparse_bf16_h3_qlen2": (dict(num_heads=3, page_size=16, topk=32, q_len=2), (3, 60), None,
                             dict(block_h=16, block_n=16, num_warps=4, num_stages=1, num_splits=2), False),
    "sparse_fp8_h3_page1": (dict(num_heads=3, kv_cache_dtype="fp8_e4m3", page_size=1, topk=24), (2, 40), None,
                            dict(block_h=16, block_n=16, num_warps=4, num_stages=2, num_splits=1, split_d=True,
                                 reload_v=True), False),
    # sparse rows looked up a chunk of top-k slots at a time (ragged chunks, -1 slots, several splits)
    "sparse_bf16_h3_hoisted_topk": (dict(num_heads=3, page_size=16, topk=40, q_len=2), (3, 60), [60, 17, 33],
                                    dict(block_h=16, block_n=16, num_warps=4, num_stages=2, num_splits=2,
                                         split_d=True, hoist_pages=16), False),
    # the 32-row sparse BF16 tile (odd head count: 20 of 32 rows used), hoisted, two splits
    "sparse_bf16_h20_rows32_hoisted": (dict(num_heads=20, page_size=16, topk=48, q_len=2), (3, 70), [70, 17, 40],
                                       dict(block_h=32, block_n=16, num_warps=4, num_stages=3, num_splits=2,
                                            split_d=True, hoist_pages=32), False),
    "sparse_fp8_h5_hoisted_topk_page1": (dict(num_heads=5, kv_cache_dtype="fp8_e4m3", page_size=1, topk=24),
                                         (2, 40), None, dict(block_h=16, block_n=16, num_warps=4, num_stages=2,
                                                             num_splits=1, split_d=True, reload_v=True,
                                                             hoist_pages=32, fp16_math=True), False),
}


def _rel_err(out, ref) -> float:
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def _lse_err(lse, ref) -> float:
    """Largest LSE error, absolute up to |lse| = 10 and relative (x 1/10) above (huge logits)."""
    return float(((lse - ref).abs() / (ref.abs() / 10).clamp_min(1.0)).max())


def _ramp_keys(inputs, page_size: int, low: float = 0.25) -> None:
    """Scale each request's token t by `low + (1 - low) t / (len - 1)`, so its scores grow along the request and a
    row's running max keeps moving (pages found through the block table, as the kernels find them)."""
    kv = inputs.kv_cache
    factor = torch.ones(kv.shape[:2], dtype=torch.float32, device=kv.device)
    for b, n in enumerate(inputs.seq_lens.tolist()):
        t = torch.arange(n, device=kv.device)
        factor[inputs.block_table[b, t // page_size].long(), t % page_size] = low + (1 - low) * t / max(n - 1, 1)
    inputs.kv_cache = (kv.float() * factor[..., None]).to(kv.dtype)


def _run_case(problem: Problem, shape: Shape, *, device, seq_lens=None, params=None, scale_tensor=False,
              q_mult=1.0, kv_ramp=False):
    from mla_tune.backends.triton_mla import LaunchParams, mla_decode

    inputs = make_inputs(problem, shape, device=device, seed=7)
    if q_mult != 1.0:
        inputs.q = inputs.q * q_mult
    if seq_lens is not None:
        inputs.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    if kv_ramp:
        _ramp_keys(inputs, problem.page_size)
    kv_scale = inputs.kv_scale
    if scale_tensor:
        kv_scale = torch.tensor(kv_scale, dtype=torch.float32, device=device)
    out, lse = mla_decode(inputs.q, inputs.kv_cache, inputs.block_table, inputs.seq_lens,
                          sm_scale=inputs.sm_scale, kv_scale=kv_scale, topk_indices=inputs.topk_indices,
                          params=params if isinstance(params, LaunchParams) or params is None
                          else LaunchParams(**params))
    ref_out, ref_lse = mla_reference(inputs.q, inputs.kv_cache, inputs.block_table, inputs.seq_lens,
                                     sm_scale=inputs.sm_scale, kv_scale=inputs.kv_scale,
                                     topk_indices=inputs.topk_indices)
    seen = torch.isfinite(ref_lse)
    return {
        "rel_err": _rel_err(out[seen], ref_out[seen]) if seen.any() else 0.0,
        "lse_err": _lse_err(lse[seen], ref_lse[seen]) if seen.any() else 0.0,
        "nan": bool(out.isnan().any() or lse.isnan().any()),
        "unseen_rows_ok": bool((out[~seen] == 0).all() and (lse[~seen] == -math.inf).all()),
        "out_dtype_ok": out.dtype == inputs.q.dtype and lse.dtype == torch.float32,
    }


def _adapter_case(problem: Problem, shape: Shape, *, device) -> dict:
    """MLA_TUNE_TRITON(_SPARSE) through prepare/run with the default (work-balanced) splits."""
    from mla_tune.backends.triton_mla.adapter import TritonMLA, TritonMLASparse

    inputs = make_inputs(problem, shape, device=device, seed=11)
    prepared = (TritonMLASparse if problem.sparse else TritonMLA)().prepare(problem, inputs)
    out, lse = prepared.run(inputs)
    ref_out, ref_lse = mla_reference(inputs.q, inputs.kv_cache, inputs.block_table, inputs.seq_lens,
                                     sm_scale=inputs.sm_scale, kv_scale=inputs.kv_scale,
                                     topk_indices=inputs.topk_indices)
    return {"rel_err": _rel_err(out, ref_out), "lse_err": _lse_err(lse, ref_lse),
            "nan": bool(out.isnan().any()), "unseen_rows_ok": True, "out_dtype_ok": True,
            "num_splits": prepared.params.num_splits}


ADAPTER_CASES = {
    "adapter_bf16_h5_ragged_balanced_splits": (dict(num_heads=5, page_size=16), (3, 1100)),
}


# Launches in the prepared order (longest first) against the same launches in grid order: ragged lengths off the page
# size, permuted pages, odd heads, two query tokens, several splits a request.
ORDER_CASES = {
    "order_bf16_h5_qlen2": (dict(num_heads=5, page_size=16, q_len=2), (4, 700)),
    "order_fp8_h3": (dict(num_heads=3, kv_cache_dtype="fp8_e4m3", page_size=16), (5, 900)),
}


def _order_case(problem: Problem, shape: Shape, *, device, params=None, fp8_query=False) -> dict:
    """MLA_TUNE_TRITON (`fp8_query`: _FP8Q) prepared with `params` (None: its own choice, which is longest first)
    and with the same parameters in grid order, on the same inputs."""
    import dataclasses

    from mla_tune.backends.triton_mla.adapter import TritonMLA, TritonMLAFp8Query

    adapter = TritonMLAFp8Query if fp8_query else TritonMLA
    inputs = make_inputs(problem, shape, device=device, seed=5)
    params = params or adapter().choose_params(problem, inputs)
    runs = {}
    for ordered in (False, True):
        prepared = adapter(dataclasses.replace(params, longest_first=ordered)).prepare(problem, inputs)
        out, lse = prepared.run(inputs)
        workspace = prepared.workspace
        runs[ordered] = (out.clone(), lse.clone(), None if workspace is None or workspace.order is None
                         else workspace.order.tolist(), prepared.params.num_splits)
    ref_out, _ = mla_reference(inputs.q, inputs.kv_cache, inputs.block_table, inputs.seq_lens,
                               sm_scale=inputs.sm_scale, kv_scale=inputs.kv_scale)
    # an order naming request 0's first split for every program: the other requests' partials stay unwritten (NaN)
    workspace.o_part.fill_(float("nan"))
    workspace.lse_part.fill_(float("nan"))
    workspace.order.zero_()
    wrong, _ = prepared.run(inputs)
    (out, lse, order, splits), (grid_out, grid_lse, grid_order, _) = runs[True], runs[False]
    return {"same": bool(torch.equal(out, grid_out) and torch.equal(lse, grid_lse)), "rel_err": _rel_err(out, ref_out),
            "order": order, "grid_order": grid_order, "splits": splits, "batch": shape.batch_size,
            "follows_order": bool(wrong[1:].isnan().all()), "chosen_longest_first": params.longest_first}


# The split combine on its own: (number of splits, splits loaded together, every partial loaded ahead of the LSEs);
# some splits empty (lse -inf, their partial NaN, as an unwritten workspace can be), one row empty in every split.
COMBINE_CASES = {f"combine_s{splits}_at{at_once}{'_ahead' if ahead else ''}": (splits, at_once, ahead)
                 for splits, at_once, ahead in ((1, 1, False), (2, 1, False), (2, 8, False), (3, 8, False),
                                                (8, 8, False), (11, 8, False), (11, 1, False), (11, 16, False),
                                                (64, 8, False), (64, 32, False), (2, 2, True), (3, 4, True),
                                                (11, 16, True), (16, 16, True))}


def _combine_case(splits: int, at_once: int, ahead: bool = False) -> dict:
    """`_mla_combine_kernel` against a float64 softmax-weighted sum of random partials."""
    import triton

    from mla_tune.backends.triton_mla import _interpreter
    from mla_tune.backends.triton_mla.combine import _mla_combine_kernel

    _interpreter.apply()
    gen = torch.Generator().manual_seed(splits * 10 + at_once)
    batch, q_len, heads, d = 2, 2, 3, 512
    o_part = torch.randn(batch, splits, q_len, heads, d, generator=gen)
    lse_part = torch.randn(batch, splits, q_len, heads, generator=gen) * 3
    empty = torch.rand(batch, splits, q_len, heads, generator=gen) < 0.3
    empty[1, :, 1, 2] = True  # a row no split saw
    lse_part[empty] = float("-inf")
    o_part[empty] = float("nan")
    out = torch.empty(batch, q_len, heads, d)
    lse = torch.empty(batch, q_len, heads)
    _mla_combine_kernel[(q_len * heads, batch)](
        o_part, lse_part, out, lse, *o_part.stride()[:4], *lse_part.stride(), *out.stride()[:3], *lse.stride(),
        heads, splits, None, 0, D_LATENT=d, BLOCK_S=triton.next_power_of_2(splits), SPLITS_AT_ONCE=at_once,
        LOADS_AHEAD=ahead, num_warps=4)
    ref_lse = torch.logsumexp(lse_part.double(), dim=1)
    weights = torch.exp(lse_part.double() - ref_lse.unsqueeze(1)).nan_to_num(0.0)  # empty rows: -inf - -inf
    ref = (weights.unsqueeze(-1) * o_part.double().nan_to_num(0.0)).sum(1)
    return {"nan": bool(out.isnan().any()), "max_err": float((out.double() - ref).abs().max()),
            "lse_ok": bool(torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
                           and (lse.double() - ref_lse).nan_to_num(0.0).abs().max() < 1e-5),
            "empty_row_zero": bool((out[1, 1, 2] == 0).all())}


def _combine_of_lengths_case(ahead: bool = False) -> dict:
    """`_mla_combine_kernel` with SPLITS_OF_LENGTHS: each request merges only its splits of `split_items` that hold
    tokens; the others' partials are stale (finite lse, NaN values) and must not be read."""
    import triton

    from mla_tune.backends.triton_mla import _interpreter
    from mla_tune.backends.triton_mla.combine import _mla_combine_kernel

    _interpreter.apply()
    gen = torch.Generator().manual_seed(3)
    splits, split_items, heads, d = 5, 64, 3, 512
    seq_lens = torch.tensor([300, 64, 65, 0], dtype=torch.int32)  # 5, 1, 2 and (empty) 1 splits
    batch = seq_lens.numel()
    o_part = torch.randn(batch, splits, 1, heads, d, generator=gen)
    lse_part = torch.randn(batch, splits, 1, heads, generator=gen)
    ran = [max(1, -(-int(n) // split_items)) for n in seq_lens]
    for b, k in enumerate(ran):
        o_part[b, k:] = float("nan")
    out, lse = torch.empty(batch, 1, heads, d), torch.empty(batch, 1, heads)
    _mla_combine_kernel[(heads, batch)](
        o_part, lse_part, out, lse, *o_part.stride()[:4], *lse_part.stride(), *out.stride()[:3], *lse.stride(),
        heads, splits, seq_lens, split_items, D_LATENT=d, BLOCK_S=8, SPLITS_AT_ONCE=2, SPLITS_OF_LENGTHS=True,
        LOADS_AHEAD=ahead, num_warps=4)
    err = 0.0
    for b, k in enumerate(ran):
        ref_lse = torch.logsumexp(lse_part[b, :k].double(), dim=0)
        ref = (torch.exp(lse_part[b, :k].double() - ref_lse).unsqueeze(-1) * o_part[b, :k].double()).sum(0)
        err = max(err, float((out[b].double() - ref).abs().max()), float((lse[b].double() - ref_lse).abs().max()))
    return {"nan": bool(out.isnan().any()), "max_err": err}


def _worker() -> None:
    """Subprocess entry: run CPU_CASES under TRITON_INTERPRET=1, print JSON."""
    results = {name: _adapter_case(Problem(**kw), Shape(*shape), device="cpu")
               for name, (kw, shape) in ADAPTER_CASES.items()}
    results.update({name: _combine_case(*case) for name, case in COMBINE_CASES.items()})
    results["combine_of_lengths"] = _combine_of_lengths_case()
    results["combine_of_lengths_ahead"] = _combine_of_lengths_case(ahead=True)
    for name, (kw, shape) in ORDER_CASES.items():
        results[name] = _order_case(Problem(**kw), Shape(*shape), device="cpu")
    for name, (kwargs, shape, lens, params, scale_tensor, *q_mult) in CPU_CASES.items():
        results[name] = _run_case(Problem(**kwargs), Shape(*shape), device="cpu", seq_lens=lens,
                                  params=params, scale_tensor=scale_tensor, q_mult=q_mult[0] if q_mult else 1.0)
    print(json.dumps(results))


@pytest.fixture(scope="module")
def interpreted_results():
    return interpreted_worker(__file__, timeout_s=600)


@pytest.mark.parametrize("case", sorted(COMBINE_CASES))
def test_interpreted_combine_merges_the_splits_exactly(interpreted_results, case):
    # any number of splits, loaded one at a time or several together; empty splits never read
    result = interpreted_results[case]
    assert not result["nan"] and result["max_err"] < 1e-5, result
    assert result["lse_ok"] and result["empty_row_zero"], result


@pytest.mark.parametrize("case", ["combine_of_lengths", "combine_of_lengths_ahead"])
def test_interpreted_combine_merges_only_the_splits_a_length_holds(interpreted_results, case):
    result = interpreted_results[case]
    assert not result["nan"] and result["max_err"] < 1e-5, result


@pytest.mark.parametrize("case", sorted(CPU_CASES) + sorted(ADAPTER_CASES))
def test_interpreted_kernel_matches_reference(interpreted_results, case):
    result = interpreted_results[case]
    tol = FP8_TOL if "fp8" in case else BF16_TOL
    assert not result["nan"]
    assert result["rel_err"] < tol, result
    assert result["lse_err"] < 1e-2, result
    assert result["unseen_rows_ok"], "rows with no visible key must give out 0 and lse -inf"
    assert result["out_dtype_ok"]


@pytest.mark.parametrize("case", sorted(ORDER_CASES))
def test_interpreted_launch_order_changes_no_result(interpreted_results, case):
    # the prepared order runs the same programs as the grid, so the results are the same bits
    result = interpreted_results[case]
    assert result["chosen_longest_first"] and result["splits"] > 1 and result["grid_order"] is None, result
    ran = sorted(result["order"])
    assert len(set(ran)) == len(ran) and result["order"] != ran, "each split once, not in grid order"
    assert len(ran) < result["batch"] * result["splits"], "splits past a request's end are not launched"
    assert result["same"], result
    assert result["follows_order"], "the kernel runs the (request, split) the order names"
    assert result["rel_err"] < (FP8_TOL if "fp8" in case else BF16_TOL), result


def test_adapter_splits_a_ragged_batch_by_work(interpreted_results):
    # 3 requests of 275..1100 tokens on 4 interpreter "SMs": fixed-size splits, several per request
    assert interpreted_results["adapter_bf16_h5_ragged_balanced_splits"]["num_splits"] > 1


def test_empty_request_gives_zero_output_and_minus_inf_lse(interpreted_results):
    # seq_len 0 is the last request of the edge-length case; "unseen_rows_ok" covers it.
    assert interpreted_results["bf16_h3_edge_lengths"]["unseen_rows_ok"]


def test_default_splits_fill_the_gpu_and_respect_the_workspace_bound():
    from mla_tune.backends.triton_mla.splits import default_params

    small = default_params(num_heads=16, q_len=1, batch=1, max_items=16384, num_sms=132)
    assert small.num_splits > 16, "one long request must be split across many SMs"
    big = default_params(num_heads=128, q_len=1, batch=128, max_items=16384, num_sms=132)
    assert big.num_splits == 1
    for batch in (1, 3, 64):
        for heads in (1, 16, 128):
            p = default_params(num_heads=heads, q_len=2, batch=batch, max_items=32768, num_sms=132)
            m_blocks = math.ceil(2 * heads / p.block_h)
            assert batch * p.num_splits <= batch + 4 * 132 / m_blocks + 1
    short = default_params(num_heads=16, q_len=1, batch=1, max_items=100, num_sms=132)
    assert short.num_splits == 1, "a split shorter than a few hundred tokens costs more than it saves"


def test_gpus_without_228kb_shared_memory_get_16_row_tiles():
    from mla_tune.backends.triton_mla.splits import default_params

    hopper = default_params(num_heads=128, q_len=1, batch=8, max_items=4096, num_sms=132, cc_major=9)
    ampere = default_params(num_heads=128, q_len=1, batch=8, max_items=4096, num_sms=108, cc_major=8)
    assert hopper.block_h == 64
    assert ampere.block_h == 16, "a 216 KB tile does not fit an A100's 164 KB of shared memory"


def test_every_tile_table_entry_launches_dense_and_sparse():
    # each entry must give valid launch parameters; a sparse chunk of top-k slots holds whole tiles
    from mla_tune.backends.triton_mla.dispatch import (
        SMALL_BATCH_TILES, SPARSE_SMALL_BATCH_TILES, SPARSE_TILE_TABLE, TILE_TABLE)
    from mla_tune.backends.triton_mla.splits import params_from_tile

    for sparse, table, small in ((False, TILE_TABLE, SMALL_BATCH_TILES),
                                 (True, SPARSE_TILE_TABLE, SPARSE_SMALL_BATCH_TILES)):
        assert set(table) == {(k, b) for k in ("16bit", "fp8") for b in (16, 32, 64, 128)}
        assert set(small) <= set(table)
        entries = list(table.items()) + [(key, entry.tile) for key, entry in small.items()]
        for (kind, bucket), tile in entries:
            p = params_from_tile(tile, num_heads=bucket, q_len=1, batch=4, max_items=2048, num_sms=132,
                                 sparse=sparse, lengths=[2048] * 4)
            assert p.split_items % p.block_n == 0 and p.num_splits * p.split_items >= 2048, (kind, bucket, p)
            assert not sparse or p.hoist_pages % p.block_n == 0, (kind, bucket, p)


def test_small_batches_take_their_own_tile_up_to_the_measured_batch():
    from mla_tune.backends.triton_mla.dispatch import SMALL_BATCH_TILES, TILE_TABLE
    from mla_tune.backends.triton_mla.splits import default_params

    small = SMALL_BATCH_TILES[("fp8", 32)]
    few = default_params(num_heads=32, q_len=1, batch=small.max_batch, max_items=4096, num_sms=132, kv_fp8=True)
    many = default_params(num_heads=32, q_len=1, batch=small.max_batch + 1, max_items=4096, num_sms=132, kv_fp8=True)
    assert few.block_h == small.tile.block_h == 16
    assert many.block_h == TILE_TABLE[("fp8", 32)].block_h == 32
    bf16 = default_params(num_heads=32, q_len=1, batch=1, max_items=4096, num_sms=132)
    assert bf16.block_h == TILE_TABLE[("16bit", 32)].block_h, "only measured buckets change"


def _greedy_makespan(lengths, s, *, m_blocks, slots, overhead):
    """The makespan of `launch_order`'s programs, each started on the first free slot (one heap step a program)."""
    import heapq

    from mla_tune.backends.triton_mla.splits import launch_order

    loads = [0] * slots
    for piece in launch_order(lengths, split_items=s):
        split, b = piece >> 16, piece & 0xFFFF
        tokens = min(s, lengths[b] - split * s)
        if tokens > 0 or split == 0:
            for _ in range(m_blocks):
                heapq.heapreplace(loads, loads[0] + max(tokens, 0) + overhead)
    return max(loads)


@pytest.mark.parametrize("m_blocks", [1, 3])
def test_the_split_models_makespan_is_the_longest_first_launchs(m_blocks):
    # the model's shortcut (full splits spread evenly, then the rest) against the launch order run one program at a
    # time on the first free slot
    from mla_tune.backends.inputs import ragged_lengths
    from mla_tune.backends.triton_mla import dispatch
    from mla_tune.backends.triton_mla.splits import _longest_first_makespan

    for batch, kv_len, s, slots in [(5, 1000, 64, 4), (37, 4096, 448, 132), (128, 16384, 2624, 132),
                                    (64, 2000, 2048, 16)]:
        lengths = ragged_lengths(Shape(batch, kv_len), page_size=64, seed=batch) + [0]
        assert _longest_first_makespan(lengths, s, m_blocks=m_blocks, slots=slots) == _greedy_makespan(
            lengths, s, m_blocks=m_blocks, slots=slots, overhead=dispatch.PROGRAM_TOKENS), (batch, kv_len, s)


def test_launch_order_runs_the_longest_splits_first_and_only_those_that_hold_tokens():
    from mla_tune.backends.triton_mla.splits import launch_order

    lengths = [1000, 10, 0, 777, 256]
    pieces = [(piece >> 16, piece & 0xFFFF) for piece in launch_order(lengths, split_items=256)]
    assert sorted(pieces) == sorted([(j, 0) for j in range(4)] + [(0, 1), (0, 2)] + [(j, 3) for j in range(4)]
                                    + [(0, 4)]), "every split with tokens once, split 0 of the empty request"
    tokens = [max(0, min(256, lengths[b] - j * 256)) for j, b in pieces]
    assert tokens == sorted(tokens, reverse=True), "longest first"
    assert pieces[:6] == [(0, 0), (0, 3), (0, 4), (1, 0), (1, 3), (2, 0)], "ties: split, then request"
    with pytest.raises(ValueError, match="16 bits"):
        launch_order([1] * (1 << 16), split_items=64)


def test_a_longest_first_launch_needs_fixed_splits_and_the_lengths():
    from mla_tune.backends.triton_mla.config import LaunchParams
    from mla_tune.backends.triton_mla.workspace import Workspace

    with pytest.raises(ValueError, match="needs split_items and not split_per_request"):
        LaunchParams(num_splits=2, longest_first=True)
    with pytest.raises(ValueError, match="needs split_items and not split_per_request"):
        LaunchParams(num_splits=2, split_items=64, split_per_request=True, longest_first=True)
    params = LaunchParams(block_h=16, block_n=16, num_warps=4, num_splits=2, split_items=64, longest_first=True)
    with pytest.raises(ValueError, match="ordered by its requests' lengths"):
        Workspace.for_launch(params, batch=2, q_len=1, num_heads=3, sparse=False, device="cpu")
    workspace = Workspace.for_launch(params, batch=2, q_len=1, num_heads=3, sparse=False, device="cpu",
                                     seq_lens=torch.tensor([100, 0], dtype=torch.int32))
    assert workspace.order.tolist() == [0, 1 << 16, 1], "64 tokens of request 0, its last 36, request 1's split 0"


def test_balanced_splits_keep_a_large_ragged_batch_within_a_tenth_of_its_work_per_sm():
    from mla_tune.backends.inputs import ragged_lengths
    from mla_tune.backends.triton_mla import dispatch
    from mla_tune.backends.triton_mla.splits import _longest_first_makespan, balanced_splits

    for batch, kv_len, m_blocks in [(1, 4096, 1), (4, 16384, 1), (16, 16384, 2), (64, 4096, 1), (128, 32768, 4),
                                    (128, 1024, 1)]:
        lengths = ragged_lengths(Shape(batch, kv_len), page_size=64, seed=3)
        splits, split_items = balanced_splits(lengths=lengths, m_blocks=m_blocks, num_sms=132, per_sm=1,
                                              block_n=64, min_split_tokens=256, partial_row_tokens=0.0)
        assert splits * split_items >= max(lengths), "the splits must cover the longest request"
        assert split_items % 64 == 0 and split_items >= 256
        assert batch * splits <= batch + 4 * 132, "workspace bound"
        if batch >= 64 and kv_len >= 4096:
            per_sm = m_blocks * sum(lengths) / 132
            makespan = _longest_first_makespan(lengths, split_items, m_blocks=m_blocks, slots=132)
            assert makespan < 1.1 * (per_sm + dispatch.PROGRAM_TOKENS), (batch, kv_len, makespan, per_sm)


def test_mla_decode_names_the_bad_tensor():
    from mla_tune.backends.triton_mla import mla_decode

    q = torch.zeros(1, 1, 4, 576, dtype=torch.bfloat16)
    kv = torch.zeros(2, 16, 576, dtype=torch.float16)
    bt = torch.zeros(1, 1, dtype=torch.int32)
    lens = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="kv_cache has dtype"):
        mla_decode(q, kv, bt, lens, sm_scale=0.1)
    with pytest.raises(ValueError, match="kv_scale is required"):
        mla_decode(q, kv.to(torch.float8_e4m3fn), bt, lens, sm_scale=0.1)
    with pytest.raises(ValueError, match="block_table must be int32"):
        mla_decode(q, kv.bfloat16(), bt.long(), lens, sm_scale=0.1)
    # a tensor on another device (the meta device stands in for a GPU here): named, before any launch
    with pytest.raises(ValueError, match=r"kv_cache is on meta; expected q's device cpu"):
        mla_decode(q, kv.bfloat16().to("meta"), bt, lens, sm_scale=0.1)
    with pytest.raises(ValueError, match=r"seq_lens is on meta; expected q's device cpu"):
        mla_decode(q, kv.bfloat16(), bt, lens.to("meta"), sm_scale=0.1)


# ---------------------------------------------------------------- GPU: the full correctness grid

GPU_HEADS = (1, 3, 16, 20, 64, 128)
EDGE_LENGTHS = [1, 15, 16, 17, 1000, 0]
GPU_KV_DTYPES = ("bf16", "fp16", "fp8_e4m3")


def _tol(kv_dtype: str) -> float:
    return FP8_TOL if kv_dtype == "fp8_e4m3" else BF16_TOL


def _gpu_problem(kv_dtype: str, **kwargs) -> Problem:
    """An FP16 cache comes with an FP16 query; BF16 and FP8 caches with a BF16 one."""
    return Problem(kv_cache_dtype=kv_dtype, query_dtype="fp16" if kv_dtype == "fp16" else "bf16", **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", GPU_KV_DTYPES)
@pytest.mark.parametrize("q_len", [1, 2, 3, 4])
@pytest.mark.parametrize("heads", GPU_HEADS)
@pytest.mark.parametrize("page_size", [16, 64, 128])
def test_gpu_dense_edge_lengths(kv_dtype, q_len, heads, page_size):
    problem = _gpu_problem(kv_dtype, num_heads=heads, page_size=page_size, q_len=q_len)
    lens = [max(n, q_len) if n else 0 for n in EDGE_LENGTHS]
    r = _run_case(problem, Shape(len(lens), 1000), device="cuda", seq_lens=lens)
    assert not r["nan"] and r["unseen_rows_ok"] and r["out_dtype_ok"]
    assert r["rel_err"] < _tol(kv_dtype), r
    assert r["lse_err"] < 1e-2, r


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", GPU_KV_DTYPES)
@pytest.mark.parametrize("heads", [7, 33, 65, 100, 127])
@pytest.mark.parametrize("sparse", [False, True])
def test_gpu_odd_head_counts(kv_dtype, heads, sparse):
    # head counts that leave the last row block partly empty (65: one row of a second 64-row block), dense with edge
    # lengths and two long requests that split, sparse with top-k 2048; whichever kernel the dispatch picks
    problem = _gpu_problem(kv_dtype, num_heads=heads, page_size=64, topk=2048 if sparse else None)
    lens = None if sparse else [n or 0 for n in EDGE_LENGTHS] + [5000, 777]
    r = _run_case(problem, Shape(6 if sparse else len(lens), 5000), device="cuda", seq_lens=lens)
    assert not r["nan"] and r["unseen_rows_ok"] and r["out_dtype_ok"]
    assert r["rel_err"] < _tol(kv_dtype) and r["lse_err"] < 1e-2, r


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", GPU_KV_DTYPES)
@pytest.mark.parametrize("heads,batch,kv_len", [(16, 1, 32768), (128, 2, 32768), (64, 8, 4096), (20, 33, 3000)])
def test_gpu_dense_long(kv_dtype, heads, batch, kv_len):
    problem = _gpu_problem(kv_dtype, num_heads=heads, page_size=64, q_len=2 if heads == 20 else 1)
    r = _run_case(problem, Shape(batch, kv_len), device="cuda")
    assert not r["nan"] and r["rel_err"] < _tol(kv_dtype), r


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("q_len", [1, 2])
@pytest.mark.parametrize("heads,page_size", [(3, 16), (64, 64), (128, 16)])
def test_gpu_split_scores_edge_lengths(kv_dtype, q_len, heads, page_size):
    # the 64-row tile with its score matmul split between warpgroups (p exchanged via scratch)
    from mla_tune.backends.triton_mla.dispatch import TILE_TABLE
    from mla_tune.backends.triton_mla.splits import params_from_tile

    kind = "fp8" if kv_dtype == "fp8_e4m3" else "16bit"
    tile = TILE_TABLE[(kind, 64)].replace(split_scores=True)
    lens = [max(n, q_len) if n else 0 for n in EDGE_LENGTHS] + [5000, 777]
    params = params_from_tile(tile, num_heads=heads, q_len=q_len, batch=len(lens), max_items=5000,
                              num_sms=torch.cuda.get_device_properties(0).multi_processor_count, lengths=lens)
    problem = Problem(num_heads=heads, kv_cache_dtype=kv_dtype, page_size=page_size, q_len=q_len)
    r = _run_case(problem, Shape(len(lens), 5000), device="cuda", seq_lens=lens, params=params)
    assert not r["nan"] and r["unseen_rows_ok"]
    assert r["rel_err"] < _tol(kv_dtype) and r["lse_err"] < 1e-2, r


@pytest.mark.gpu
@pytest.mark.parametrize("fp16_math", [False, True])
@pytest.mark.parametrize("heads", [16, 64])
def test_gpu_fp8_large_query_stays_finite(heads, fp16_math):
    # |q| up to ~1.5e5: past fp16's 65504, so the fp16 path must keep its 2^-8 query scale
    from mla_tune.backends.triton_mla.config import rows_bucket
    from mla_tune.backends.triton_mla.dispatch import TILE_TABLE
    from mla_tune.backends.triton_mla.splits import params_from_tile

    tile = TILE_TABLE[("fp8", rows_bucket(heads))].replace(fp16_math=fp16_math)
    problem = Problem(num_heads=heads, kv_cache_dtype="fp8_e4m3", page_size=64)
    params = params_from_tile(tile, num_heads=heads, q_len=1, batch=3, max_items=2000,
                              num_sms=torch.cuda.get_device_properties(0).multi_processor_count)
    r = _run_case(problem, Shape(3, 2000), device="cuda", params=params, q_mult=3e4)
    assert not r["nan"] and r["rel_err"] < FP8_TOL and r["lse_err"] < 1e-2, r


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", GPU_KV_DTYPES)
@pytest.mark.parametrize("q_len", [1, 2, 3, 4])
@pytest.mark.parametrize("heads", GPU_HEADS)
def test_gpu_sparse_topk2048(kv_dtype, q_len, heads):
    problem = _gpu_problem(kv_dtype, num_heads=heads, page_size=64, topk=2048, q_len=q_len)
    r = _run_case(problem, Shape(4, 5000), device="cuda")
    assert not r["nan"] and r["rel_err"] < _tol(kv_dtype), r


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("heads,page_size,hoist", [(3, 1, 64), (16, 64, 64), (20, 16, 128), (64, 64, 64),
                                                   (128, 1, 64)])
def test_gpu_sparse_hoisted_topk(kv_dtype, heads, page_size, hoist):
    # rows looked up a chunk of top-k slots at a time; short requests give -1 slots and a ragged last chunk
    from mla_tune.backends.triton_mla.config import rows_bucket
    from mla_tune.backends.triton_mla.dispatch import SPARSE_TILE_TABLE
    from mla_tune.backends.triton_mla.splits import params_from_tile

    kind = "fp8" if kv_dtype == "fp8_e4m3" else "16bit"
    tile = SPARSE_TILE_TABLE[(kind, rows_bucket(heads))].replace(hoist_pages=hoist)
    batch = 6  # ragged lengths up to 2500: most requests have fewer than 2048 positions to choose from
    params = params_from_tile(tile, num_heads=heads, q_len=2, batch=batch, max_items=2048, sparse=True,
                              num_sms=torch.cuda.get_device_properties(0).multi_processor_count,
                              lengths=[2048] * batch)
    problem = Problem(num_heads=heads, kv_cache_dtype=kv_dtype, page_size=page_size, topk=2048, q_len=2)
    r = _run_case(problem, Shape(batch, 2500), device="cuda", params=params)
    assert params.hoist_pages == hoist and not r["nan"] and r["unseen_rows_ok"]
    assert r["rel_err"] < _tol(kv_dtype) and r["lse_err"] < 1e-2, r


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype,heads,topk", [("fp8_e4m3", 32, None), ("fp8_e4m3", 20, None),
                                                 ("fp8_e4m3", 32, 2048), ("bf16", 64, None), ("bf16", 33, None)])
def test_gpu_small_batch_tiles(kv_dtype, heads, topk):
    # batches up to SMALL_BATCH_TILES' limit take the narrower tile: several 16-row blocks per request
    from mla_tune.backends.triton_mla.config import rows_bucket
    from mla_tune.backends.triton_mla.dispatch import SMALL_BATCH_TILES, SPARSE_SMALL_BATCH_TILES
    from mla_tune.backends.triton_mla.splits import default_params

    kind = ("fp8" if kv_dtype == "fp8_e4m3" else "16bit", rows_bucket(heads))
    batch = min(3, (SPARSE_SMALL_BATCH_TILES if topk else SMALL_BATCH_TILES)[kind].max_batch)
    lens = [5000, 17, 1000][:batch]
    # cc_major None: the tl tables as they stand (on SM90 the warp-specialised kernel may take the batch)
    params = default_params(num_heads=heads, q_len=1, batch=batch, max_items=topk or 5000, num_sms=132,
                            sparse=topk is not None, kv_fp8=kv_dtype == "fp8_e4m3",
                            lengths=[topk] * batch if topk else lens,
                            cc_major=None)
    assert params.block_h == 16, params
    problem = _gpu_problem(kv_dtype, num_heads=heads, page_size=64, topk=topk)
    r = _run_case(problem, Shape(batch, 5000), device="cuda", seq_lens=None if topk else lens, params=params)
    assert not r["nan"] and r["rel_err"] < _tol(kv_dtype) and r["lse_err"] < 1e-2, r


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp16"])
def test_gpu_sparse_32_rows_above_the_small_batch_limit(kv_dtype):
    # batch 17 > SPARSE_SMALL_BATCH_TILES' 16: one hoisted 32-row program per query token and split
    from mla_tune.backends.triton_mla.splits import default_params

    batch = 17
    params = default_params(num_heads=32, q_len=2, batch=batch, max_items=2048, num_sms=132, sparse=True,
                            lengths=[2048] * batch, cc_major=None)
    assert params.block_h == 32 and params.hoist_pages == 64, params
    problem = _gpu_problem(kv_dtype, num_heads=32, page_size=16, topk=2048, q_len=2)
    r = _run_case(problem, Shape(batch, 2500), device="cuda", params=params)
    assert not r["nan"] and r["unseen_rows_ok"] and r["rel_err"] < _tol(kv_dtype) and r["lse_err"] < 1e-2, r


@pytest.mark.gpu
def test_gpu_sparse_short_requests_pad_with_minus_one():
    problem = Problem(num_heads=16, kv_cache_dtype="bf16", page_size=1, topk=2048, q_len=2)
    r = _run_case(problem, Shape(3, 700), device="cuda")
    assert not r["nan"] and r["rel_err"] < BF16_TOL, r


@pytest.mark.gpu
def test_gpu_adapter_runs_inside_a_cuda_graph():
    from mla_tune.backends.triton_mla.adapter import TritonMLA

    problem = Problem(num_heads=64, kv_cache_dtype="fp8_e4m3", page_size=64)
    inputs = make_inputs(problem, Shape(4, 3000), device="cuda", seed=3)
    prepared = TritonMLA().prepare(problem, inputs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = prepared.run(inputs)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    ref_out, _ = mla_reference(inputs.q, inputs.kv_cache, inputs.block_table, inputs.seq_lens,
                               sm_scale=inputs.sm_scale, kv_scale=inputs.kv_scale)
    assert _rel_err(out, ref_out) < FP8_TOL


def test_opaque_v_cast_needs_the_v_reload_and_fp16_math():
    from mla_tune.backends.triton_mla import LaunchParams

    with pytest.raises(ValueError, match="opaque_v_cast needs reload_v and fp16_math"):
        LaunchParams(block_h=16, opaque_v_cast=True, fp16_math=True)
    assert LaunchParams(block_h=16, reload_v=True, fp16_math=True, opaque_v_cast=True).label().endswith("ox1")


def test_opaque_v_cast_reads_v_as_fp16_through_ldmatrix_trans_on_sm90():
    # offline sm_90 compile of the FP8 16-row tile: the V operand must not come from 8-bit shared loads
    from offline_compile import kernel_ptx

    tile = dict(block_h=16, block_n=32, num_warps=4, num_stages=2, RELOAD_V=True, HOIST_PAGES=64, FP16_MATH=True)
    opaque = kernel_ptx(**tile, OPAQUE_V_CAST=True)
    assert "ld.shared.b8" not in opaque and "ld.shared.u8" not in opaque
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in opaque
    assert opaque.count("cvt.rn.f16x2.e4m3x2") > 0


@pytest.mark.slow
def test_stage1_lets_the_combine_start_early_and_the_combine_waits_for_its_writes():
    # offline sm_90a compiles: with the early combine stage 1 (tl and Hopper kernels) issues
    # griddepcontrol.launch_dependents, and the combine griddepcontrol.wait before it reads any partial
    from offline_compile import combine_ptx, hopper_compile, kernel_ptx

    tile = dict(block_h=16, block_n=32, num_warps=4, num_stages=2)
    assert "griddepcontrol.launch_dependents" in kernel_ptx(**tile, LAUNCH_COMBINE_EARLY=True)
    assert "griddepcontrol" not in kernel_ptx(**tile)
    assert "griddepcontrol.launch_dependents" in hopper_compile(kv="bf16", rows=64, qk1=True,
                                                                LAUNCH_COMBINE_EARLY=True)[0]
    waits = combine_ptx(AFTER_STAGE1=True)
    assert waits.index("griddepcontrol.wait") < waits.index("ld.global"), "no partial read before the wait"
    assert "griddepcontrol" not in combine_ptx()


def test_the_combine_starts_early_only_where_stage1s_idle_sms_hold_its_programs(monkeypatch):
    # SM90+ only, and only where the SMs stage 1's grid leaves idle hold the combine's programs at
    # COMBINE_EARLY_PER_IDLE_SM or fewer each (crowded onto a few idle SMs they ran up to 3 us slower on an H200).
    # No SM90 GPU here: its compute capability and SM count are what the launcher is told
    from mla_tune.backends.triton_mla import dispatch, launcher

    q = torch.empty(1)
    monkeypatch.setattr(launcher, "sm_count", lambda device: 132)
    monkeypatch.setattr(launcher, "cc_major", lambda device: 9)
    per_sm = dispatch.COMBINE_EARLY_PER_IDLE_SM
    assert launcher._early_combine(q, (1, 8, 1), 124 * per_sm), "124 idle SMs"
    assert not launcher._early_combine(q, (1, 8, 1), 124 * per_sm + 1)
    assert not launcher._early_combine(q, (2, 66, 1), 1), "no idle SM"
    assert launcher._early_combine(q, (1, 4, 2), 16)
    monkeypatch.setattr(dispatch, "COMBINE_AFTER_STAGE1", False)
    assert not launcher._early_combine(q, (1, 8, 1), 16)
    monkeypatch.setattr(dispatch, "COMBINE_AFTER_STAGE1", True)
    monkeypatch.setattr(launcher, "cc_major", lambda device: 8)
    assert not launcher._early_combine(q, (1, 8, 1), 16), "programmatic dependent launch is SM90+"


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", [1, 2])
@pytest.mark.parametrize("heads,page_size,block_h,topk", [(3, 16, 16, None), (16, 64, 16, None), (20, 16, 32, None),
                                                          (32, 128, 32, None), (16, 1, 16, 2048), (20, 64, 32, 2048)])
def test_gpu_opaque_v_cast(q_len, heads, page_size, block_h, topk):
    # FP8 V reload cast by inline asm (opaque_v_cast): edge and ragged lengths, permuted pages, top-k
    from mla_tune.backends.triton_mla.dispatch import SPARSE_TILE_TABLE, TILE_TABLE
    from mla_tune.backends.triton_mla.splits import params_from_tile

    tile = (SPARSE_TILE_TABLE if topk else TILE_TABLE)[("fp8", block_h)]
    tile = tile.replace(reload_v=True, fp16_math=True, opaque_v_cast=True)
    # dense: edge lengths; sparse: ragged lengths up to 2500, so most requests leave top-k slots at -1
    lens = None if topk else [max(n, q_len) if n else 0 for n in EDGE_LENGTHS] + [5000, 777]
    batch = 6 if topk else len(lens)
    params = params_from_tile(tile, num_heads=heads, q_len=q_len, batch=batch,
                              max_items=topk or 5000, sparse=bool(topk), lengths=[topk] * batch if topk else lens,
                              num_sms=torch.cuda.get_device_properties(0).multi_processor_count)
    problem = Problem(num_heads=heads, kv_cache_dtype="fp8_e4m3", page_size=page_size, q_len=q_len, topk=topk)
    r = _run_case(problem, Shape(batch, 2500 if topk else 5000), device="cuda", seq_lens=lens, params=params)
    assert params.opaque_v_cast and not r["nan"] and r["unseen_rows_ok"]
    assert r["rel_err"] < FP8_TOL and r["lse_err"] < 1e-2, r


@pytest.mark.slow
def test_fp8_kernels_compile_from_sm89_as_the_registry_declares():
    # Triton has e4m3 only from SM89: the registry's fp8_min_cc must say so (offline compile, no GPU)
    from offline_compile import kernel_ptx

    from mla_tune.backends.registry import BACKENDS

    ours = [info for info in BACKENDS.values() if info.adapter == "mla_tune.backends.triton_mla.adapter:TritonMLA"]
    assert len(ours) == 1 and ours[0].capabilities.fp8_min_cc == (8, 9)
    tile = dict(block_h=16, block_n=32, num_warps=4, num_stages=2)
    assert "mma.sync" in kernel_ptx(**tile, arch=89) and "mma.sync" in kernel_ptx(**tile, arch=80, fp8=False)
    with pytest.raises(Exception, match="fp8e4nv not supported"):
        kernel_ptx(**tile, arch=80)


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _worker()
