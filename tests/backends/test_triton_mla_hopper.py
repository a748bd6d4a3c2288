"""The warp-specialised Hopper kernel (`backends/triton_mla/hopper*.py`): its dispatch and its correctness.

CPU: the dispatch picks each form and per-form switch where docs/kernels.md says; the launch parameters refuse what
the kernel cannot run. CPU, marked `slow`: every form compiles for sm_90a offline (Gluon has no interpreter), with
wgmma, no spills beyond a few bytes and within the SM's shared memory, and each switch changes what it should.
GPU (marker `gpu`, Hopper only): the correctness grid against the float32 reference through `mla_decode` with
explicit warp-specialised parameters.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

# Triton versions whose Hopper code generation the register budgets (HOPPER_LOAD_REGS) were timed with.
REGISTERS_TUNED_ON = ("3.6.", "3.7.")

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")

from mla_tune.backends.problem import Problem, Shape  # noqa: E402
from test_triton_mla import EDGE_LENGTHS, _gpu_problem, _order_case, _run_case, _tol  # noqa: E402

SMEM_LIMIT = 227 * 1024  # an SM90 block's dynamic shared memory


def _spill_bytes(report: str) -> int:
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", report))


@pytest.mark.slow
@pytest.mark.parametrize("kv,sparse,q_len,page_size", [
    ("bf16", False, 1, 64), ("fp16", False, 2, 16), ("bf16", True, 2, 1),
    ("fp8", False, 1, 64), ("fp8", True, 2, 1), ("fp8", False, 2, 128)])
def test_hopper_token_split_form_compiles_for_sm90a(kv, sparse, q_len, page_size):
    from offline_compile import hopper_compile

    from mla_tune.backends.triton_mla.config import HOPPER_TOKEN_SPLIT_SHAPE as SHAPE
    from mla_tune.backends.triton_mla.hopper import hopper_smem_bytes

    ptx, smem, report = hopper_compile(kv=kv, sparse=sparse, q_len=q_len, page_size=page_size)
    assert hopper_smem_bytes(block_n=SHAPE.block_n, stages=SHAPE.num_stages) <= smem <= SMEM_LIMIT, smem
    assert "wgmma.mma_async.sync.aligned.m64n32k16" in ptx and "wgmma.mma_async.sync.aligned.m64n256k16" in ptx
    assert "setmaxnreg" in ptx, "the loader warpgroup must hand its registers to the MMA warps"
    if kv == "fp8":  # the loader casts e4m3 pairs to fp16 itself, from 16-byte loads
        assert "cvt.rn.f16x2.e4m3x2" in ptx and "ld.global.v4" in ptx
    else:
        assert "cp.async.cg.shared.global" in ptx and "cp.async.mbarrier.arrive.noinc" in ptx
    # a few bytes at most (Triton 3.7.1: 4-8 B in the FP8 variants; a loader keeping a tile as bytes spilled 4.5 KB)
    assert _spill_bytes(report) <= 64, report


@pytest.mark.slow
@pytest.mark.parametrize("kv,sparse,q_len,rows", [
    ("bf16", False, 1, 16), ("fp8", False, 1, 16), ("fp8", False, 2, 32), ("bf16", True, 1, 32), ("fp8", True, 2, 16),
    ("fp8", True, 1, 32)])
def test_hopper_narrow_form_compiles_for_sm90a(kv, sparse, q_len, rows):
    from offline_compile import hopper_compile

    from mla_tune.backends.triton_mla.config import HOPPER_SHAPES
    from mla_tune.backends.triton_mla.hopper import hopper_smem_bytes

    ptx, smem, report = hopper_compile(kv=kv, sparse=sparse, q_len=q_len, page_size=1 if sparse else 64, rows=rows)
    block_n, stages = HOPPER_SHAPES[rows].block_n, HOPPER_SHAPES[rows].num_stages
    assert hopper_smem_bytes(block_n=block_n, stages=stages, rows=rows, kv_fp8=kv == "fp8") <= smem <= SMEM_LIMIT, smem
    # per tile 36 score MMAs (k 576) and 8 x 4 for o^T = v^T p^T (m 512, k 64), n = the rows: none wasted
    mmas = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)[^;]*, (\d), (\d);", ptx)
    assert {shape for shape, _, _ in mmas} == {f"m64n{rows}k16"} and len(mmas) == 36 + 32, mmas[:3]
    assert sum(tnsp_a == "1" for _, tnsp_a, _ in mmas) == 32, "v^T is the slot read transposed"
    assert "setmaxnreg.dec.sync.aligned.u32" in ptx, "the loader hands registers to the MMA warpgroup"
    if kv == "fp8":  # the staged loader: e4m3 bytes by cp.async, cast from shared memory
        assert "cp.async.cg.shared.global" in ptx and "cvt.rn.f16x2.e4m3x2" in ptx
    # one MMA warpgroup and its loaders: two for 16-bit caches and for sparse FP8 (one half tile each)
    loaders = 1 if kv == "fp8" and not sparse else 2
    assert re.search(r"\.reqntid (\d+)", ptx).group(1) == str(128 * (1 + loaders))
    assert _spill_bytes(report) <= 64, report


@pytest.mark.slow
@pytest.mark.parametrize("kv,sparse,q_len,page_size", [
    ("bf16", False, 1, 64), ("fp16", False, 2, 16), ("fp8", False, 1, 64), ("fp8", False, 2, 128), ("bf16", True, 1, 1),
    ("fp8", True, 2, 1)])
def test_hopper_qk1_form_compiles_for_sm90a(kv, sparse, q_len, page_size):
    from collections import Counter

    from offline_compile import hopper_compile

    from mla_tune.backends.triton_mla.config import HOPPER_QK1_SHAPE as SHAPE
    from mla_tune.backends.triton_mla.hopper import hopper_smem_bytes

    ptx, smem, report = hopper_compile(kv=kv, sparse=sparse, q_len=q_len, page_size=page_size, qk1=True)
    assert hopper_smem_bytes(block_n=SHAPE.block_n, stages=SHAPE.num_stages, qk1=True) <= smem <= SMEM_LIMIT, smem
    # per tile: the scores as m64n64 in one warpgroup (36 k-steps over all 576 columns), `p @ v` as m64n256 (4 k-steps
    # a warpgroup); no m64n32 of the token-split form
    mmas = Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)", ptx))
    assert mmas == {"m64n64k16": 36, "m64n256k16": 8}, mmas
    # p over the slot's rope columns (stmatrix), read there by the second warpgroup's wgmma, not back into registers
    assert "stmatrix" in ptx and "ldmatrix" not in ptx
    # launched with 4 warps, 12 run: the two MMA warpgroups and the loader
    assert SHAPE.num_warps == 4 and re.search(r"\.reqntid (\d+)", ptx).group(1) == str(32 * SHAPE.warps_run) == "384"
    assert "setmaxnreg.dec.sync.aligned.u32" in ptx
    # spill stores with Triton 3.7.1: 0 B (BF16), 8 B (FP8)
    assert _spill_bytes(report) <= 64, report


@pytest.mark.slow
def test_the_qk1_form_rounds_p_to_bf16_two_values_an_instruction():
    # `cvt.rn.bf16x2.f32`: ptxas makes a scalar bf16 cast one F2F a value
    from offline_compile import hopper_compile

    def casts(ptx):
        return len(re.findall(r"cvt\.rn\.bf16x2\.f32", ptx)), len(re.findall(r"cvt\.rn\.bf16\.f32", ptx))

    packed, _, _ = hopper_compile(kv="bf16", qk1=True, sparse=True)
    assert casts(packed) == (16, 0)  # p: 64 x 64 over 128 threads, two a cast


@pytest.mark.slow
@pytest.mark.parametrize("rows,qk1", [(64, False), (32, False), (64, True)])
def test_split_partials_are_stored_with_an_l2_evict_last_hint(rows, qk1):
    # every form's epilogue: with PARTIAL_EVICT_LAST (the launcher sets it with more than one split) the output stores
    # carry an evict-last cache policy, without it none does
    from offline_compile import hopper_compile

    hinted, _, _ = hopper_compile(kv="fp8", rows=rows, qk1=qk1, PARTIAL_EVICT_LAST=True)
    plain, _, _ = hopper_compile(kv="fp8", rows=rows, qk1=qk1, PARTIAL_EVICT_LAST=False)
    assert "createpolicy.fractional.L2::evict_last" in hinted and "L2::cache_hint" in hinted
    assert "evict_last" not in plain and "L2::cache_hint" not in plain


def test_launch_hints_the_partials_only_where_there_are_splits(monkeypatch):
    import torch

    from mla_tune.backends.triton_mla import dispatch, hopper, launcher
    from mla_tune.backends.triton_mla.config import LaunchParams

    seen = []
    kernel_params = set(hopper._mla_hopper_kernel.arg_names) | {"num_warps", "maxnreg"}

    class RecordingKernel:  # stands in for the Gluon kernel: records the hint (no GPU here)
        def __getitem__(self, grid):
            def launch_(*args, **kw):
                assert set(kw) <= kernel_params, set(kw) - kernel_params  # every keyword is one the kernel takes
                seen.append(kw["PARTIAL_EVICT_LAST"])
            return launch_

    monkeypatch.setattr(hopper, "_mla_hopper_kernel", RecordingKernel())
    # `_launch_hopper` refuses CPU tensors and reads the query's shape
    cuda_q = type("CudaTensor", (), {"is_cuda": True, "shape": (1, 1, 64, 576)})()
    kv = torch.empty(1, 64, 576, dtype=torch.bfloat16)
    fields = dispatch.HOPPER_TOKEN_SPLIT_TILE.launch_fields()
    # a grid over (row blocks, requests, splits), and a longest-first one over (row blocks, programs, 1)
    for splits, grid in ((1, (1, 1, 1)), (2, (1, 1, 2)), (8, (1, 1, 8)), (8, (1, 40, 1))):
        launcher._launch_hopper((), grid, {"SPARSE": False, "Q_LEN": 1}, q=cuda_q, kv_cache=kv, tiles=4,
                                params=LaunchParams(**fields, num_splits=splits, split_items=512,
                                                    longest_first=grid[2] == 1))
    assert seen == [False, True, True, True]


def test_the_loader_ahead_is_not_given_a_cache_it_cannot_read_as_words(monkeypatch):
    # `_load_fp8_ahead` reads the FP8 cache as 32-bit words (strides divided by 4): a cache view whose token stride is
    # not a whole number of words launches the loader without it; the same shape, contiguous, takes it
    import torch

    from mla_tune.backends.triton_mla import dispatch, hopper, launcher
    from mla_tune.backends.triton_mla.config import HOPPER_LOAD_REGS, LaunchParams

    seen = []

    class RecordingKernel:  # stands in for the Gluon kernel (no GPU here)
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append((kw["LOADER_AHEAD"], kw["LOAD_REGS"]))

    monkeypatch.setattr(hopper, "_mla_hopper_kernel", RecordingKernel())
    cuda_q = type("CudaTensor", (), {"is_cuda": True, "shape": (1, 1, 64, 576)})()
    params = LaunchParams(**dispatch.HOPPER_QK1_TILE.launch_fields())
    contiguous = torch.empty(2, 1, 576, dtype=torch.float8_e4m3fn)
    odd_rows = torch.empty(2, 1, 577, dtype=torch.float8_e4m3fn)[:, :, :576]
    assert launcher.kv_cache_in_words(contiguous) and not launcher.kv_cache_in_words(odd_rows)
    for kv in (contiguous, odd_rows):
        launcher._launch_hopper((), (1, 1, 1), {"SPARSE": True, "Q_LEN": 1}, q=cuda_q, kv_cache=kv, params=params,
                              tiles=32)
    assert seen == [(True, HOPPER_LOAD_REGS["fp8_ahead"]), (False, HOPPER_LOAD_REGS["fp8"])]


def test_warp_specialized_params_refuse_what_the_kernel_cannot_run():
    from mla_tune.backends.triton_mla import LaunchParams

    with pytest.raises(ValueError, match="does not take the tl kernel's split_d"):
        LaunchParams(block_h=64, block_n=64, num_warps=8, split_d=True, warp_specialized=True)
    with pytest.raises(ValueError, match=r"runs \(block_h, block_n, num_warps, num_stages\) = \(64, 64, 8, 2\) or "):
        LaunchParams(block_h=64, block_n=32, num_warps=8, num_stages=4, warp_specialized=True)
    assert LaunchParams(block_h=64, num_warps=8, block_n=64, warp_specialized=True).label().endswith("Wx1")


@pytest.mark.parametrize("kind,bucket", [("16bit", 16), ("16bit", 32), ("16bit", 64), ("16bit", 128),
                                         ("fp8", 16), ("fp8", 32), ("fp8", 64), ("fp8", 128)])
@pytest.mark.parametrize("sparse", [False, True])
def test_sm90_takes_the_warp_specialized_kernel_from_the_measured_batch(kind, bucket, sparse):
    from mla_tune.backends.triton_mla.dispatch import (
        HOPPER_NARROW_MIN_BATCH, HOPPER_QK1_MIN_BATCH, HOPPER_TOKEN_SPLIT_MIN_BATCH, MinBatch, short_requests)
    from mla_tune.backends.triton_mla.splits import default_params

    never = MinBatch(dense=None, sparse=None)
    for batch in (1, 2, 4, 16, 64, 128):
        for items in (256, 1024, 2048, 4096):
            kwargs = dict(num_heads=bucket, q_len=1, batch=batch, max_items=items, num_sms=132, sparse=sparse,
                          kv_fp8=kind == "fp8", lengths=[items] * batch)
            short = short_requests(kind=kind, bucket=bucket, batch=batch, max_items=items, sparse=sparse)
            takes = dict(batch=batch, sparse=sparse)
            narrow = HOPPER_NARROW_MIN_BATCH.get((kind, bucket), never).takes(**takes) and not short
            qk1 = HOPPER_QK1_MIN_BATCH.get((kind, bucket), never).takes(**takes) and not short and not narrow
            wide = (qk1 or HOPPER_TOKEN_SPLIT_MIN_BATCH.get((kind, bucket), never).takes(**takes)) and not short \
                and not narrow
            hopper = default_params(**kwargs, cc_major=9)
            assert hopper.warp_specialized == (narrow or wide), (batch, items, hopper)
            if narrow or wide:  # the form: narrow (16/32 rows), qk1 where its table says, token-split otherwise
                assert hopper.block_h == (bucket if narrow else 64), (batch, items, hopper)
                expected = "narrow" if narrow else "qk1" if qk1 else "token_split"
                assert hopper.kernel_form == expected, (batch, items, hopper)
            for other in (8, 10, 12, None):  # no wgmma / setmaxnreg there (None: the CPU interpreter)
                assert not default_params(**kwargs, cc_major=other).warp_specialized


@pytest.mark.parametrize("heads,batch,items,kv_fp8,sparse,hopper", [
    (16, 128, 16384, True, False, 16),     # FP8 16 heads: the narrow form
    (32, 4, 2048, True, True, 32),         # sparse FP8 32 heads at batch 4: the narrow form, two loaders
    (64, 1, 4096, False, False, True),     # BF16 64 heads from batch 1
    (64, 1, 1024, False, False, False),    # short requests at a small batch: the tl tile
    (64, 64, 1024, False, False, True),    # short requests at batch 64
    (64, 16, 1024, False, False, True),    # ... and at batch 16 for 64 heads
    (32, 16, 1024, True, False, 32),       # FP8 32 heads short: the narrow form
    (32, 16, 1024, False, False, 32),      # BF16 32 heads short from batch 16: the narrow form
    (32, 8, 1024, False, False, False),    # ... below: the tl tile
    (32, 4, 1024, True, False, False),     # FP8 32 heads short below batch 8: the tl tile
    (32, 8, 1024, True, False, 32),        # ... from batch 8: the narrow form
    (32, 8, 512, True, False, False),      # ... not under 1024 items
    (32, 32, 512, False, False, False),    # BF16 32 heads under 1024 items: the tl tile below batch 64
    (128, 4, 1024, True, False, True),     # 128 heads short from batch 4
    (128, 1, 1024, False, False, True),    # ... BF16 from batch 1
    (128, 1, 1024, True, False, False),    # ... not FP8 at batch 1
    (64, 1, 1024, True, False, True),      # FP8 64 heads short from batch 1
    (64, 2, 1024, False, False, True),     # BF16 64 heads short from batch 2
    (16, 128, 16384, False, False, 16),    # dense BF16 16 heads: the narrow form
    (16, 1, 4096, False, False, 16),       # ... from batch 1
    (16, 1, 1024, False, False, 16),       # ... short requests from batch 1 too
    (16, 1, 1024, True, False, 16),        # ... and FP8
    (32, 64, 4096, False, False, 32),      # dense BF16 32 heads: the narrow form
    (32, 4, 16384, False, False, 32),      # ... at any batch
    (32, 64, 2048, False, False, 32),      # ... shorter too (its tiles by TMA)
    (32, 4, 2048, False, False, 32),       # ... shorter at batch 4
    (32, 4, 16384, True, False, True),     # FP8 32 heads
    (16, 128, 2048, False, True, 16),      # sparse BF16 16 heads at batch 64-128: the narrow form
    (16, 16, 2048, False, True, 16),       # ... and at batch 16
    (16, 4, 2048, False, True, False),     # ... the tl tile at batch 4
    (32, 64, 2048, False, True, 32),       # sparse BF16 32 heads from batch 64: the narrow form
    (32, 16, 2048, False, True, 64),       # ... the token-split form below
])
def test_sm90_dispatch_on_measured_cases(heads, batch, items, kv_fp8, sparse, hopper):
    # docs/kernels.md's dispatch table gives the measurement behind each case
    from mla_tune.backends.triton_mla.splits import default_params

    params = default_params(num_heads=heads, q_len=1, batch=batch, max_items=items, num_sms=132, sparse=sparse,
                            kv_fp8=kv_fp8, lengths=[items] * batch, cc_major=9)
    assert params.warp_specialized == bool(hopper), params
    if hopper is not True and hopper:  # a row count: the form (narrow 16/32 rows, 64 rows otherwise)
        assert params.block_h == hopper, params


@pytest.mark.slow
@pytest.mark.parametrize("kv,rows,sparse,qk1", [
    ("bf16", 64, False, False), ("fp8", 64, False, False), ("fp8", 16, False, False), ("bf16", 32, True, False),
    ("bf16", 64, False, True), ("bf16", 64, True, True), ("fp8", 64, True, True)])
def test_the_query_is_loaded_before_the_partitions_or_by_the_mma_warps(kv, rows, sparse, qk1):
    # Code before `warp_specialize` runs on the MMA warps while the loader waits at the partitions' start (PTX
    # `barrier.sync 1`): with QUERY_IN_CONSUMER no query load is left there, so the loader's first copies do not wait
    # for the query; both ways compile without more spills
    from offline_compile import hopper_compile

    def query_loads_before_partitions(ptx):
        return len(re.findall(r"ld\.global\.v4", ptx.split("barrier.sync \t1;")[0]))

    kw = dict(kv=kv, rows=rows, sparse=sparse, page_size=1 if sparse else 64, qk1=qk1)
    before, _, report_before = hopper_compile(**kw, QUERY_IN_CONSUMER=False)
    inside, _, report_inside = hopper_compile(**kw, QUERY_IN_CONSUMER=True)
    assert query_loads_before_partitions(before) > 0 and query_loads_before_partitions(inside) == 0
    assert _spill_bytes(report_inside) <= _spill_bytes(report_before), (report_before, report_inside)


@pytest.mark.parametrize("heads,kv_fp8,sparse,batch,inside", [
    (16, True, False, 64, True), (32, False, True, 64, True),   # narrow forms
    (64, False, False, 8, True), (64, True, True, 16, True),    # token-split: BF16 dense below batch 16, sparse FP8
    (64, True, True, 64, True),                                 # sparse FP8 on the qk1 form
    (128, True, False, 4, False),                               # token-split FP8 dense
    (128, False, False, 128, True), (64, False, False, 64, True),  # the qk1 form, dense
    (128, True, False, 128, True), (64, True, False, 64, True),
    (128, False, True, 128, True), (64, False, True, 4, True),  # ... sparse BF16
])
def test_launch_picks_who_loads_the_query_by_form(heads, kv_fp8, sparse, batch, inside):
    from mla_tune.backends.triton_mla.dispatch import hopper_constexprs
    from mla_tune.backends.triton_mla.splits import default_params

    params = default_params(num_heads=heads, q_len=1, batch=batch, max_items=4096, sparse=sparse, kv_fp8=kv_fp8,
                            cc_major=9, num_sms=132, lengths=[4096] * batch)
    assert params.warp_specialized, params
    form = hopper_constexprs(params, kv_fp8=kv_fp8, sparse=sparse)
    assert form["QUERY_IN_CONSUMER"] is inside, (params.label(), form)


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_sparse_warpgroup_0_loads_the_next_positions_after_its_p_v(kv):
    # POSITIONS_AHEAD: after a tile's score MMAs the scorer's next global loads (the top-k positions its mask needs)
    # come after that tile's p @ v MMAs, not before them; spills no more than without
    from offline_compile import hopper_compile

    def after_the_scores(ptx):
        events = []
        for line in ptx.splitlines():
            line = re.sub(r"^@!?%p\d+\s+", "", line.strip())
            mma = re.match(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", line)
            if mma:
                events.append("scores" if mma.group(1) == "64" else "p @ v")
            elif line.startswith("ld.global"):
                events.append("load")
        last_score = len(events) - 1 - events[::-1].index("scores")
        return next(e for e in events[last_score + 1:] if e != "scores")

    kw = dict(kv=kv, sparse=True, page_size=1, qk1=True)
    ahead, _, report_ahead = hopper_compile(**kw, POSITIONS_AHEAD=True)
    inside, _, report_inside = hopper_compile(**kw, POSITIONS_AHEAD=False)
    assert after_the_scores(ahead) == "p @ v" and after_the_scores(inside) == "load"
    assert _spill_bytes(report_ahead) <= _spill_bytes(report_inside), (report_ahead, report_inside)


@pytest.mark.parametrize("switch,heads,kv_fp8,sparse,batch,form,on", [
    ("POSITIONS_AHEAD", 128, False, True, 128, "qk1", True),       # sparse BF16 on the qk1 form
    ("POSITIONS_AHEAD", 64, False, True, 4, "qk1", True),
    ("POSITIONS_AHEAD", 64, True, True, 64, "qk1", True),          # sparse FP8: the qk1 form
    ("POSITIONS_AHEAD", 64, True, True, 4, "token_split", False),  # ... token-split
    ("POSITIONS_AHEAD", 128, False, False, 128, "qk1", False),     # dense: positions from the tile's start
    ("SUMS_UNROUNDED", 128, False, False, 128, "qk1", True),       # dense BF16 on the qk1 form
    ("SUMS_UNROUNDED", 64, False, False, 16, "qk1", True),
    ("SUMS_UNROUNDED", 128, False, True, 128, "qk1", False),       # sparse BF16, dense FP8: the rounded p
    ("SUMS_UNROUNDED", 64, True, False, 64, "qk1", False),
])
def test_launch_sets_the_qk1_switches_by_form(switch, heads, kv_fp8, sparse, batch, form, on):
    from mla_tune.backends.triton_mla.dispatch import hopper_constexprs
    from mla_tune.backends.triton_mla.splits import default_params

    params = default_params(num_heads=heads, q_len=1, batch=batch, max_items=4096, sparse=sparse, kv_fp8=kv_fp8,
                            cc_major=9, num_sms=132, lengths=[4096] * batch)
    assert params.kernel_form == form, params.label()
    assert hopper_constexprs(params, kv_fp8=kv_fp8, sparse=sparse)[switch] is on, params.label()


@pytest.mark.slow
def test_warpgroup_0_sums_p_before_rounding_it():
    # SUMS_UNROUNDED: the row sums add the fp32 p, so no rounded value is widened back (32 cvt.f32.bf16 a tile
    # without it); no more spills than without
    from offline_compile import hopper_compile

    kw = dict(kv="bf16", qk1=True, TMA_KV=True)
    unrounded, _, report_unrounded = hopper_compile(**kw, SUMS_UNROUNDED=True)
    rounded, _, report_rounded = hopper_compile(**kw, SUMS_UNROUNDED=False)
    assert rounded.count("cvt.f32.bf16") == 32 and "cvt.f32.bf16" not in unrounded
    assert unrounded.count("cvt.rn.bf16x2.f32") == rounded.count("cvt.rn.bf16x2.f32") == 16
    assert _spill_bytes(report_unrounded) <= _spill_bytes(report_rounded), (report_unrounded, report_rounded)


@pytest.mark.slow
@pytest.mark.parametrize("kv,sparse,cols", [("bf16", True, 0), ("bf16", True, 128), ("bf16", True, 192),
                                             ("fp16", True, 128), ("fp8", False, 64)])
def test_warpgroup_0_takes_the_querys_first_columns_from_registers(kv, sparse, cols):
    # the qk1 form's score MMAs read `cols` query columns (rope first) from registers (wgmma with A in registers:
    # `p @ v`'s 4 k-steps, plus cols / 16) and the rest from shared memory, 36 k-steps in all, no spills
    from offline_compile import hopper_compile

    ptx, _, report = hopper_compile(kv=kv, sparse=sparse, page_size=1 if sparse else 64, qk1=True,
                                    QUERY_REG_COLS=cols)
    mmas = [line for line in ptx.splitlines() if "wgmma.mma_async" in line]
    register_a = [line for line in mmas if re.search(r"wgmma\.mma_async\S*\s+\{[^}]*\},\s*\{", line)]
    assert len(mmas) == 36 + 8 and len(register_a) == 4 + cols // 16, (len(mmas), len(register_a))
    if kv != "fp8":
        assert _spill_bytes(report) == 0, report


@pytest.mark.parametrize("heads,kv_fp8,sparse,batch,cols", [
    (128, False, True, 64, 128), (128, False, True, 128, 128),   # sparse BF16 on the qk1 form
    (64, False, True, 4, 128),                                   # ... which runs 64 heads at every batch
    (128, False, False, 128, 0), (64, True, False, 64, 0),       # the dense qk1 form: none, BF16 or FP8
    (64, True, True, 64, 0), (64, True, True, 4, 0),             # sparse FP8: none (qk1 form and token-split)
])
def test_launch_picks_the_query_columns_in_registers_by_form(heads, kv_fp8, sparse, batch, cols):
    from mla_tune.backends.triton_mla.dispatch import hopper_constexprs
    from mla_tune.backends.triton_mla.splits import default_params

    params = default_params(num_heads=heads, q_len=1, batch=batch, max_items=4096, sparse=sparse, kv_fp8=kv_fp8,
                            cc_major=9, num_sms=132, lengths=[4096] * batch)
    assert params.warp_specialized, params
    form = hopper_constexprs(params, kv_fp8=kv_fp8, sparse=sparse)
    assert form["QUERY_REG_COLS"] == cols, form


@pytest.mark.parametrize("heads,kv_fp8,sparse,batch,flags", [
    (128, False, False, 64, True), (64, False, False, 128, True),   # the dense qk1 form on a 16-bit cache
    (128, False, True, 64, False), (64, True, False, 64, False),    # sparse BF16, dense FP8: warpgroup 1 reduces
])
def test_launch_picks_the_per_warp_flags_by_form(heads, kv_fp8, sparse, batch, flags):
    from mla_tune.backends.triton_mla.dispatch import hopper_constexprs
    from mla_tune.backends.triton_mla.splits import default_params

    params = default_params(num_heads=heads, q_len=1, batch=batch, max_items=4096, sparse=sparse, kv_fp8=kv_fp8,
                            cc_major=9, num_sms=132, lengths=[4096] * batch)
    assert params.kernel_form == "qk1", params
    assert hopper_constexprs(params, kv_fp8=kv_fp8, sparse=sparse)["WARP_FLAGS"] is flags


@pytest.mark.slow
def test_warpgroup_1_reads_the_flags_without_a_barrier_of_its_own():
    # with the flags, warpgroup 1 no longer reduces the rescale factors across its warps: fewer of its partition
    # barriers (bar.sync 2) and fewer shuffles (how many fewer depends on Triton's version), and nothing spills
    from offline_compile import hopper_compile

    def counts(warp_flags):
        ptx, _, report = hopper_compile(kv="bf16", qk1=True, WARP_FLAGS=warp_flags)
        return ptx.count("bar.sync \t2, 128"), ptx.count("shfl.sync"), _spill_bytes(report)

    (bars, shuffles, _), (flag_bars, flag_shuffles, spills) = counts(False), counts(True)
    assert flag_bars < bars and flag_shuffles < shuffles and spills == 0, (bars, flag_bars, shuffles, flag_shuffles)


def test_kv_descriptors_of_a_16bit_cache_take_a_tiles_rows_in_128_byte_blocks():
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from mla_tune.backends.triton_mla.launcher import kv_descriptors

    lat, rope = kv_descriptors(torch.zeros(10, 64, 576, dtype=torch.bfloat16), 64)
    # eight blocks of 64 columns, as the 128-byte swizzled bf16 slot lies; the rope one 128-byte box a row
    assert (lat.shape, lat.strides, lat.block_shape) == ([8, 640, 64], [64, 576, 1], [8, 64, 64])
    assert (rope.shape, rope.block_shape) == ([640, 576], [64, 64])
    assert lat.layout.element_bitwidth == 16 and rope.layout.swizzle_byte_width == 128
    lat, rope = kv_descriptors(torch.zeros(10, 128, 576, dtype=torch.float16), 64)  # a tile is half a page
    assert (lat.shape, lat.block_shape) == ([8, 1280, 64], [8, 64, 64])
    assert kv_descriptors(torch.zeros(10, 64, 577, dtype=torch.bfloat16)[:, :, 1:], 64) is None  # rows 2 bytes off


@pytest.mark.parametrize("heads,q_len,kv_fp8,sparse,batch,page_size,form,tma", [
    (128, 1, False, False, 64, 64, "qk1", True), (64, 2, False, False, 64, 128, "qk1", True),  # 2 row blocks
    (64, 1, False, False, 128, 64, "qk1", False),   # one row block (measured slower by TMA)
    (128, 1, False, False, 64, 16, "qk1", False),   # a tile over four pages: every loader thread's cp.async
    (128, 1, False, True, 64, 64, "qk1", False), (128, 1, True, False, 64, 64, "qk1", False),  # sparse, FP8
    (16, 1, False, False, 1, 64, "narrow", True), (32, 1, False, False, 128, 128, "narrow", True),  # dense 16-bit
    (16, 2, False, False, 16, 64, "narrow", True),
    (32, 1, False, False, 128, 16, "narrow", False),   # pages shorter than a tile
    (16, 1, True, False, 128, 64, "narrow", False), (16, 1, False, True, 128, 64, "narrow", False),  # FP8, sparse
])
def test_launch_copies_16bit_tiles_by_tma_by_form(heads, q_len, kv_fp8, sparse, batch, page_size, form, tma):
    from mla_tune.backends.triton_mla.dispatch import copies_by_tma
    from mla_tune.backends.triton_mla.splits import default_params

    params = default_params(num_heads=heads, q_len=q_len, batch=batch, max_items=4096, sparse=sparse,
                            kv_fp8=kv_fp8, cc_major=9, num_sms=132, lengths=[4096] * batch)
    assert params.kernel_form == form, params
    rows = heads if sparse else heads * q_len
    assert copies_by_tma(params, kv_fp8=kv_fp8, sparse=sparse, page_size=page_size, query_rows=rows) is tma


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [64, 128])
def test_the_qk1_loader_copies_whole_16bit_tiles_by_tma(page_size):
    # one 3-d box of the latent blocks and one 2-d box of the rope a tile, issued by one thread, instead of 36
    # cp.async a thread; the partial last tile still by cp.async (zeros past the range); nothing spills
    from offline_compile import hopper_compile

    ptx, smem, report = hopper_compile(kv="bf16", qk1=True, TMA_KV=True, page_size=page_size)
    copies = re.findall(r"cp\.async\.bulk\.tensor\.(\d)d", ptx)
    assert sorted(copies) == ["2", "3"] and "cp.async.cg.shared.global" in ptx, copies
    assert "cp.async.mbarrier.arrive" not in ptx and _spill_bytes(report) == 0 and smem <= SMEM_LIMIT, report
    plain, _, _ = hopper_compile(kv="bf16", qk1=True, page_size=page_size)
    assert "cp.async.bulk.tensor" not in plain and "cp.async.mbarrier.arrive" in plain
    # TMA writes through the async proxy: neither MMA warpgroup fences a slot (the loader fences its cp.async tile),
    # unless HOPPER_CONSUMER_FENCE asks them to
    fenced, _, _ = hopper_compile(kv="bf16", qk1=True, page_size=page_size, TMA_KV=True, CONSUMER_FENCE=True)
    fences = [text.count("fence.proxy.async") for text in (ptx, plain, fenced)]
    assert fences[0] < fences[1] < fences[2], fences


@pytest.mark.slow
@pytest.mark.parametrize("rows", [16, 32])
def test_the_narrow_form_copies_whole_16bit_tiles_by_one_tma_loader(rows):
    # with the descriptors one loader warpgroup: two boxes a tile and 36 cp.async a thread for the partial last
    # tile, where two cp.async loaders make 36 each; 8 warps instead of 12; nothing spills
    from offline_compile import hopper_compile

    ptx, smem, report = hopper_compile(kv="bf16", rows=rows, TMA_KV=True)
    plain, _, _ = hopper_compile(kv="bf16", rows=rows, TMA_KV=False)
    assert ".reqntid 256" in ptx and ".reqntid 384" in plain
    assert sorted(re.findall(r"cp\.async\.bulk\.tensor\.(\d)d", ptx)) == ["2", "3"]
    assert ptx.count("cp.async.cg.shared.global") * 2 == plain.count("cp.async.cg.shared.global") == 72
    assert "cp.async.mbarrier.arrive" not in ptx and "cp.async.bulk.tensor" not in plain
    assert _spill_bytes(report) == 0 and smem <= SMEM_LIMIT, report


@pytest.mark.slow
@pytest.mark.parametrize("kv,sparse,qk1,prefetches", [
    ("fp8", True, False, True), ("fp8", False, False, True), ("fp8", False, True, True), ("bf16", False, False, False)])
def test_the_fp8_register_loader_can_prefetch_the_next_tile_into_l2(kv, sparse, qk1, prefetches):
    # With L2_PREFETCH the 64-row forms' FP8 register loader issues prefetch.global.L2 for the next tile's lines (four
    # a thread: two rows, two of the offsets 0-575), without it none; 16-bit caches copy with cp.async, no prefetch
    from offline_compile import hopper_compile

    kw = dict(kv=kv, sparse=sparse, page_size=1 if sparse else 64, qk1=qk1, LOADER_AHEAD=False)
    on, _, report_on = hopper_compile(**kw, L2_PREFETCH=True)
    off, _, report_off = hopper_compile(**kw, L2_PREFETCH=False)
    assert len(re.findall(r"prefetch\.global\.L2", on)) == (4 if prefetches else 0)
    assert "prefetch.global.L2" not in off
    assert _spill_bytes(report_on) <= _spill_bytes(report_off) + 16, (report_off, report_on)


@pytest.mark.slow
@pytest.mark.parametrize("qk1,sparse", [(True, True), (True, False), (False, True)])
def test_the_loader_ahead_holds_the_next_tile_as_words_without_spilling(qk1, sparse):
    # LOADER_AHEAD: the next tile's 18 16-byte loads a thread are issued before the loop and again after each tile's
    # stores, and cast from 32-bit words; at HOPPER_LOAD_REGS["fp8_ahead"] dense spills nothing and sparse at most
    # 32 B (with fewer registers the loop spills the loads' destinations and waits for them before the slot)
    from offline_compile import hopper_compile

    from mla_tune.backends.triton_mla.config import HOPPER_LOAD_REGS

    kw = dict(kv="fp8", sparse=sparse, page_size=1 if sparse else 64, qk1=qk1)
    off, _, _ = hopper_compile(**kw, LOADER_AHEAD=False, LOAD_REGS=HOPPER_LOAD_REGS["fp8"])
    on, _, report = hopper_compile(**kw, LOADER_AHEAD=True, LOAD_REGS=HOPPER_LOAD_REGS["fp8_ahead"])
    assert re.search(rf"setmaxnreg\.\w+\.sync\.aligned\.u32\s+{HOPPER_LOAD_REGS['fp8_ahead']};", on)
    assert on.count("ld.global.v4") == off.count("ld.global.v4") + 18
    assert on.count("cvt.rn.f16x2.e4m3x2") == off.count("cvt.rn.f16x2.e4m3x2")
    spilled, limit = _spill_bytes(report), (32 if sparse else 0)
    if spilled > limit and not triton.__version__.startswith(REGISTERS_TUNED_ON):
        # The register budgets were timed with the code these Triton versions generate; another version's code
        # generation spills differently (3.8: 44 B sparse, 3.9: 76 B dense) and needs its own timing on a GPU.
        pytest.xfail(f"triton {triton.__version__} spills {spilled} B here (limit {limit} B, tuned on "
                     f"{', '.join(REGISTERS_TUNED_ON)})")
    assert spilled <= limit, report


@pytest.mark.parametrize("heads,sparse,batch,kv_len,ahead", [
    (64, True, 64, 4096, True), (128, True, 128, 4096, True),    # sparse FP8 on the qk1 form
    (64, True, 4, 4096, False), (128, True, 16, 4096, False),    # the sparse token-split form: left without
    (64, False, 4, 8192, True), (64, False, 16, 4096, True),     # dense, up to 8 tiles a program
    (64, False, 16, 16384, False), (64, False, 128, 16384, False),  # dense, 32 / 256 tiles: slower with it
    (16, True, 128, 4096, False)])                               # the narrow form has its own (staged) loader
def test_launch_gives_the_loader_ahead_to_sparse_and_short_dense_fp8_qk1_programs(heads, sparse, batch, kv_len,
                                                                                 ahead):
    from mla_tune.backends.triton_mla.config import HOPPER_LOAD_REGS
    from mla_tune.backends.triton_mla.dispatch import hopper_constexprs
    from mla_tune.backends.triton_mla.splits import default_params

    params = default_params(num_heads=heads, q_len=1, batch=batch, max_items=kv_len, sparse=sparse, kv_fp8=True,
                            cc_major=9, num_sms=132, lengths=[kv_len] * batch)
    tiles = -(-params.split_items // params.block_n)  # as `launcher.launch` gives it
    form = hopper_constexprs(params, kv_fp8=True, sparse=sparse, tiles=tiles)
    assert form["LOADER_AHEAD"] is ahead, (params.label(), tiles, form)
    assert form["LOAD_REGS"] == HOPPER_LOAD_REGS["fp8_ahead" if ahead else "fp8"], form
    if not sparse:  # without the tile count (an offline compile) dense never takes it
        assert not hopper_constexprs(params, kv_fp8=True, sparse=False)["LOADER_AHEAD"]


@pytest.mark.slow
@pytest.mark.parametrize("kv,rows,qk1", [("fp8", 64, False), ("fp8", 16, False), ("fp8", 64, True),
                                          ("bf16", 64, False), ("bf16", 32, False)])
def test_fp8_slots_are_fenced_by_their_loader_and_16bit_ones_by_the_mma_warps(kv, rows, qk1):
    # The FP8 loaders store a slot, fence it (fence.proxy.async) and arrive: with CONSUMER_FENCE off (the default) the
    # MMA warps do not fence it again; cp.async slots (16-bit) are always fenced by the MMA warps after their barrier
    from offline_compile import hopper_compile

    from mla_tune.backends.triton_mla.dispatch import HOPPER_CONSUMER_FENCE

    def fences(ptx):
        return len(re.findall(r"fence\.proxy\.async", ptx))

    kw = dict(kv=kv, rows=rows, qk1=qk1)
    fenced, _, _ = hopper_compile(**kw, CONSUMER_FENCE=True)
    default, _, _ = hopper_compile(**kw)
    assert HOPPER_CONSUMER_FENCE is False
    # (the qk1 form: both MMA warpgroups wait for the full slot, each would fence it)
    assert fences(default) == fences(fenced) - (kv == "fp8") * (2 if qk1 else 1)


@pytest.mark.parametrize("heads,kv_fp8,sparse,prefetch", [
    (64, True, True, True), (128, True, True, True),     # sparse FP8 (the qk1 form at batch 64)
    (64, True, False, True),                             # dense token-split FP8
    (16, True, True, False), (64, False, True, False)])  # the narrow form (staged loader), BF16 (cp.async)
def test_launch_prefetches_into_l2_by_form(heads, kv_fp8, sparse, prefetch):
    from mla_tune.backends.triton_mla.dispatch import hopper_constexprs
    from mla_tune.backends.triton_mla.splits import default_params

    params = default_params(num_heads=heads, q_len=1, batch=64, max_items=4096, sparse=sparse, kv_fp8=kv_fp8,
                            cc_major=9, num_sms=132, lengths=[4096] * 64)
    assert params.warp_specialized, params
    assert hopper_constexprs(params, kv_fp8=kv_fp8, sparse=sparse)["L2_PREFETCH"] is prefetch


@pytest.mark.parametrize("sparse", [False, True])
def test_the_qk1_fp8_form_prefetches_into_l2(sparse):
    from mla_tune.backends.triton_mla.dispatch import HOPPER_QK1_TILE, hopper_constexprs
    from mla_tune.backends.triton_mla.splits import params_from_tile

    params = params_from_tile(HOPPER_QK1_TILE, num_heads=128, q_len=1, batch=64, max_items=4096, num_sms=132,
                              sparse=sparse, lengths=[4096] * 64)
    form = hopper_constexprs(params, kv_fp8=True, sparse=sparse)
    assert form["QK1"] and form["L2_PREFETCH"]


@pytest.mark.parametrize("heads,q_len,batch,kv_fp8,sparse,qk1", [
    (128, 1, 4, False, False, True),    # BF16 128 heads from batch 4
    (128, 1, 128, False, False, True),
    (128, 1, 1, False, False, False),   # ... not at batch 1
    (128, 1, 128, True, False, True),   # FP8 128 heads from batch 16
    (128, 1, 4, True, False, False),    # ... not at batch 4
    (64, 1, 64, True, False, True),     # FP8 64 heads from batch 1
    (64, 1, 16, True, False, True),
    (64, 2, 64, False, False, True),    # 128 packed rows (two query tokens of 64 heads)
    (64, 1, 128, False, False, True),   # BF16 64 heads from batch 16
    (64, 1, 4, False, False, False),    # ... not below
    (64, 1, 1, False, True, True),      # sparse BF16 64 heads from batch 1
    (128, 1, 128, False, True, True),   # sparse BF16 128 heads from batch 1
    (128, 1, 4, False, True, True),
    (128, 1, 1, False, True, True),
    (128, 1, 128, True, True, True),    # sparse FP8 from batch 64
    (64, 1, 64, True, True, True),
    (128, 1, 16, True, True, False),    # ... not below
    (64, 1, 4, True, True, False),
])
def test_sm90_dispatch_of_the_qk1_form(heads, q_len, batch, kv_fp8, sparse, qk1):
    from mla_tune.backends.triton_mla.dispatch import HOPPER_QK1_TILE, HOPPER_TOKEN_SPLIT_TILE, candidate_tiles
    from mla_tune.backends.triton_mla.splits import default_params

    kwargs = dict(num_heads=heads, q_len=q_len, batch=batch, max_items=4096, sparse=sparse, kv_fp8=kv_fp8, cc_major=9)
    params = default_params(**kwargs, num_sms=132, lengths=[4096] * batch)
    assert params.warp_specialized and params.block_h == 64, params
    assert (params.kernel_form == "qk1") == qk1 and params.label().startswith("h64n64w4" if qk1 else "h64n64w8")
    # the tuner times both 64-row forms from 64 rows, whichever the default is
    tiles = candidate_tiles(**kwargs)
    assert HOPPER_QK1_TILE in tiles and HOPPER_TOKEN_SPLIT_TILE in tiles, tiles


@pytest.mark.parametrize("batch,splits", [(1, 16), (2, 16), (4, 8), (8, 8), (16, 4), (64, 1)])
def test_sparse_bf16_128_heads_takes_splits_of_256_tokens_from_batch_4(batch, splits, monkeypatch):
    # `HOPPER_QK1_SPARSE_SPLITS`: at batch 4, 8 splits of 256 top-k slots (16 of 128 without it); batch 1 keeps 16;
    # from batch 8 the split model picks them by itself
    from mla_tune.backends.triton_mla import dispatch
    from mla_tune.backends.triton_mla.splits import default_params

    kwargs = dict(num_heads=128, q_len=1, batch=batch, max_items=2048, kv_fp8=False, cc_major=9)
    sparse = default_params(**kwargs, sparse=True, num_sms=132, lengths=[2048] * batch)
    dense = default_params(**kwargs, num_sms=132, lengths=[2048] * batch)
    assert sparse.kernel_form == "qk1" and sparse.num_splits == splits, sparse
    assert dispatch.HOPPER_QK1_TILE in dispatch.candidate_tiles(**kwargs, sparse=True)  # the tuner still times 128
    monkeypatch.setattr(dispatch, "HOPPER_QK1_SPARSE_SPLITS", {})
    before = default_params(**kwargs, sparse=True, num_sms=132, lengths=[2048] * batch)
    assert (before.num_splits == 16) == (batch <= 4) and (before == sparse) == (batch != 4), before
    assert default_params(**kwargs, num_sms=132, lengths=[2048] * batch) == dense  # dense: no change


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


def _params(kv_dtype, *, heads, q_len, batch, max_items, lengths, sparse=False, form="token_split"):
    """The parameters of one Hopper form: "token_split" or "qk1" (64 rows), or "narrow" for the rows bucket (skips
    above 32 rows)."""
    from mla_tune.backends.triton_mla.config import rows_bucket
    from mla_tune.backends.triton_mla.dispatch import HOPPER_QK1_TILE, HOPPER_TILES, HOPPER_TOKEN_SPLIT_TILE
    from mla_tune.backends.triton_mla.splits import params_from_tile

    rows = heads if sparse else heads * q_len
    tile = HOPPER_QK1_TILE if form == "qk1" else HOPPER_TOKEN_SPLIT_TILE
    if form == "narrow":
        if rows > 32:
            pytest.skip("the narrow form takes up to 32 rows")
        tile = HOPPER_TILES[rows_bucket(rows)]
    return params_from_tile(tile, num_heads=heads, q_len=q_len, batch=batch, max_items=max_items, sparse=sparse,
                            lengths=lengths, num_sms=torch.cuda.get_device_properties(0).multi_processor_count)


GPU_KV_DTYPES = ("bf16", "fp16", "fp8_e4m3")
# 64 rows over two MMA warpgroups scoring half a tile each; 64 rows with warpgroup 0 scoring the whole tile; up to 32
# rows, one MMA warpgroup on transposed products
FORMS = ("token_split", "qk1", "narrow")

hopper_only = pytest.mark.skipif(not _hopper(), reason="the warp-specialised kernel needs an SM90 GPU")


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("kv_dtype", GPU_KV_DTYPES)
@pytest.mark.parametrize("q_len", [1, 2])
@pytest.mark.parametrize("heads", [1, 3, 16, 20, 64, 128])
@pytest.mark.parametrize("page_size", [16, 64, 128])
@pytest.mark.parametrize("form", FORMS)
def test_gpu_hopper_dense_edge_lengths(kv_dtype, q_len, heads, page_size, form):
    # lengths 1, 15, 16, 17, 1000, 0 (+ two long ones, so that requests split), permuted pages
    lens = [max(n, q_len) if n else 0 for n in EDGE_LENGTHS] + [5000, 777]
    params = _params(kv_dtype, heads=heads, q_len=q_len, batch=len(lens), max_items=5000, lengths=lens, form=form)
    problem = _gpu_problem(kv_dtype, num_heads=heads, page_size=page_size, q_len=q_len)
    r = _run_case(problem, Shape(len(lens), 5000), device="cuda", seq_lens=lens, params=params)
    assert params.warp_specialized and not r["nan"] and r["unseen_rows_ok"] and r["out_dtype_ok"]
    assert r["rel_err"] < _tol(kv_dtype) and r["lse_err"] < 1e-2, r


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("q_len,heads,sparse", [(3, 3, False), (4, 3, False), (3, 16, False), (4, 20, False),
                                                (3, 128, False), (4, 3, True), (3, 16, True), (4, 64, True),
                                                (3, 128, True)])
@pytest.mark.parametrize("form", FORMS)
def test_gpu_hopper_mtp_with_3_and_4_query_tokens(kv_dtype, q_len, heads, sparse, form):
    # dense: q_len x heads packed rows (9 to 384: one to six row blocks), causal inside the query block, edge lengths
    # and two long requests that split; sparse: a row block per query token and head block, top-k 2048
    lens = [2048] * 6 if sparse else [max(n, q_len) if n else 0 for n in EDGE_LENGTHS] + [5000, 777]
    items = 2048 if sparse else 5000
    params = _params(kv_dtype, heads=heads, q_len=q_len, batch=len(lens), max_items=items, lengths=lens,
                     sparse=sparse, form=form)
    problem = _gpu_problem(kv_dtype, num_heads=heads, page_size=16, q_len=q_len, topk=2048 if sparse else None)
    if sparse:
        r = _run_case(problem, Shape(len(lens), 2500), device="cuda", params=params)
    else:
        r = _run_case(problem, Shape(len(lens), 5000), device="cuda", seq_lens=lens, params=params)
    assert params.warp_specialized and not r["nan"] and r["unseen_rows_ok"] and r["out_dtype_ok"]
    assert r["rel_err"] < _tol(kv_dtype) and r["lse_err"] < 1e-2, r


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("heads,q_len", [(3, 1), (20, 2), (128, 1)])
@pytest.mark.parametrize("form", (*FORMS, "fp8_query"))
def test_gpu_hopper_launch_order_changes_no_result(kv_dtype, heads, q_len, form):
    # the prepared order (longest first) against grid order: the same bits, and the kernel runs what it names
    if form == "fp8_query" and (kv_dtype != "fp8_e4m3" or heads * q_len > 32):
        pytest.skip("the FP8-query form: an e4m3 cache, up to 32 rows")
    from mla_tune.backends.inputs import ragged_lengths

    shape = Shape(24, 3000)
    lens = ragged_lengths(shape, page_size=16, min_len=q_len, seed=5)
    params = None if form == "fp8_query" else _params(kv_dtype, heads=heads, q_len=q_len, batch=shape.batch_size,
                                                      max_items=max(lens), lengths=lens, form=form)
    problem = _gpu_problem(kv_dtype, num_heads=heads, page_size=16, q_len=q_len)
    r = _order_case(problem, shape, device="cuda", params=params, fp8_query=form == "fp8_query")
    assert r["splits"] > 1 and r["grid_order"] is None and r["order"] is not None, r["splits"]
    assert r["same"] and r["follows_order"]
    assert r["rel_err"] < (6e-2 if form == "fp8_query" else _tol(kv_dtype)), r["rel_err"]  # FP8Q: query in e4m3


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("kv_dtype", GPU_KV_DTYPES)
@pytest.mark.parametrize("heads,batch,kv_len,q_len", [(16, 1, 32768, 1), (128, 2, 32768, 1), (64, 8, 4096, 1),
                                                      (20, 33, 3000, 2), (128, 64, 1024, 2), (16, 33, 3000, 2),
                                                      (32, 64, 16384, 1)])
@pytest.mark.parametrize("form", FORMS)
def test_gpu_hopper_dense_long(kv_dtype, heads, batch, kv_len, q_len, form):
    from mla_tune.backends.inputs import ragged_lengths

    lens = ragged_lengths(Shape(batch, kv_len), page_size=64, min_len=q_len, seed=7)
    params = _params(kv_dtype, heads=heads, q_len=q_len, batch=batch, max_items=kv_len, lengths=lens, form=form)
    problem = _gpu_problem(kv_dtype, num_heads=heads, page_size=64, q_len=q_len)
    r = _run_case(problem, Shape(batch, kv_len), device="cuda", params=params)
    assert not r["nan"] and r["rel_err"] < _tol(kv_dtype) and r["lse_err"] < 1e-2, r


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("kv_dtype", GPU_KV_DTYPES)
@pytest.mark.parametrize("heads,q_len", [(16, 1), (3, 2), (32, 1), (128, 1)])
@pytest.mark.parametrize("splits", [1, None])
@pytest.mark.parametrize("form", FORMS)
def test_gpu_hopper_scores_rising_along_the_request(kv_dtype, heads, q_len, splits, form):
    # keys scaled up along each request and a 4x query: a row's max grows tile after tile, so the output and the
    # sums are rescaled again and again (one split: up to 79 tiles in a program)
    from dataclasses import replace

    lens = [5000, 777, 3001, 64, 17]
    params = _params(kv_dtype, heads=heads, q_len=q_len, batch=len(lens), max_items=5000, lengths=lens, form=form)
    if splits is not None:
        params = replace(params, num_splits=splits, split_items=0, longest_first=False)
    problem = _gpu_problem(kv_dtype, num_heads=heads, page_size=64, q_len=q_len)
    r = _run_case(problem, Shape(len(lens), 5000), device="cuda", seq_lens=lens, params=params, q_mult=4.0,
                  kv_ramp=True)
    assert not r["nan"] and r["unseen_rows_ok"] and r["rel_err"] < _tol(kv_dtype) and r["lse_err"] < 1e-2, r


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("kv_dtype", GPU_KV_DTYPES)
@pytest.mark.parametrize("q_len", [1, 2])
@pytest.mark.parametrize("heads,page_size", [(3, 1), (16, 64), (20, 16), (32, 1), (64, 1), (128, 64)])
@pytest.mark.parametrize("form", FORMS)
def test_gpu_hopper_sparse_topk2048(kv_dtype, q_len, heads, page_size, form):
    # ragged lengths up to 2500: most requests have fewer than 2048 positions, so slots are -1 padded
    batch = 6
    params = _params(kv_dtype, heads=heads, q_len=q_len, batch=batch, max_items=2048, lengths=[2048] * batch,
                     sparse=True, form=form)
    problem = _gpu_problem(kv_dtype, num_heads=heads, page_size=page_size, topk=2048, q_len=q_len)
    r = _run_case(problem, Shape(batch, 2500), device="cuda", params=params)
    assert not r["nan"] and r["unseen_rows_ok"] and r["rel_err"] < _tol(kv_dtype) and r["lse_err"] < 1e-2, r


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
def test_gpu_hopper_large_query_and_many_tiles(kv_dtype):
    # |q| ~ 3e4: the fp16 query of FP8 must keep its 2^-8 scale; one split of 3000 tokens runs 47 tiles,
    # so both ring slots wrap their mbarrier phases many times (a 0-d scale tensor for FP8)
    lens = [3000, 17, 2999]
    params = _params(kv_dtype, heads=64, q_len=1, batch=3, max_items=3000, lengths=lens)
    params = dataclasses.replace(params, num_splits=1, split_items=3008)
    problem = Problem(num_heads=64, kv_cache_dtype=kv_dtype, page_size=64)
    r = _run_case(problem, Shape(3, 3000), device="cuda", seq_lens=lens, params=params, q_mult=3e4,
                  scale_tensor=kv_dtype == "fp8_e4m3")
    assert not r["nan"] and r["rel_err"] < _tol(kv_dtype) and r["lse_err"] < 1e-2, r


@pytest.mark.gpu
@hopper_only
def test_gpu_default_params_take_the_hopper_kernel_and_match_the_reference():
    # mla_decode with no params on an SM90 GPU: the warp-specialised kernel for 64 heads
    from mla_tune.backends.triton_mla.splits import default_params

    problem = Problem(num_heads=64, kv_cache_dtype="fp8_e4m3", page_size=64)
    assert default_params(num_heads=64, q_len=1, batch=8, max_items=4096, num_sms=132, kv_fp8=True,
                          cc_major=torch.cuda.get_device_capability()[0]).warp_specialized
    r = _run_case(problem, Shape(8, 4096), device="cuda")
    assert not r["nan"] and r["rel_err"] < _tol("fp8_e4m3"), r


@pytest.mark.gpu
@hopper_only
def test_gpu_sparse_128_heads_at_batch_4_takes_8_splits_and_matches_the_reference():
    # `HOPPER_QK1_SPARSE_SPLITS`: the launch the adapters' `default_params` picks (8 splits of 4 tiles on 132 SMs)
    from mla_tune.backends.triton_mla.splits import default_params

    problem = _gpu_problem("bf16", num_heads=128, page_size=64, topk=2048)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    params = default_params(num_heads=128, q_len=1, batch=4, max_items=2048, num_sms=sms, sparse=True,
                            lengths=[2048] * 4, cc_major=9)
    assert params.num_warps == 4 and (params.num_splits == 8 or sms != 132), params
    r = _run_case(problem, Shape(4, 2500), device="cuda", params=params)
    assert not r["nan"] and r["unseen_rows_ok"] and r["rel_err"] < _tol("bf16") and r["lse_err"] < 1e-2, r


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("heads", [64, 128])
def test_gpu_sparse_fp8_at_batch_64_takes_the_qk1_form_with_the_prefetch_and_matches_the_reference(heads):
    # `HOPPER_QK1_MIN_BATCH` (sparse FP8 from batch 64), `L2_PREFETCH_FORMS` and `LOADER_AHEAD_FORMS` ("qk1", "fp8",
    # "sparse"): the launch the adapters' `default_params` picks, through the loader that keeps the next tile in
    # registers and prefetches the one after, top-k 2048 of 3000 tokens
    from mla_tune.backends.triton_mla.dispatch import hopper_constexprs
    from mla_tune.backends.triton_mla.splits import default_params

    problem = _gpu_problem("fp8_e4m3", num_heads=heads, page_size=64, topk=2048)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    params = default_params(num_heads=heads, q_len=1, batch=64, max_items=2048, num_sms=sms, sparse=True,
                            kv_fp8=True, lengths=[2048] * 64, cc_major=9)
    form = hopper_constexprs(params, kv_fp8=True, sparse=True)
    assert params.kernel_form == "qk1" and form["QK1"] and form["L2_PREFETCH"] and form["LOADER_AHEAD"], (params, form)
    r = _run_case(problem, Shape(64, 3000), device="cuda", params=params)
    assert not r["nan"] and r["unseen_rows_ok"] and r["rel_err"] < _tol("fp8_e4m3") and r["lse_err"] < 1e-2, r


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("sparse,batch,kv_len", [(True, 64, 3000), (False, 16, 4096)])
def test_gpu_fp8_cache_with_an_odd_token_stride_skips_the_loader_ahead_and_matches_the_reference(
        monkeypatch, sparse, batch, kv_len):
    # `kv_cache_in_words`: the default launch of 64 heads (sparse at batch 64; dense at 8 tiles a program) gives the
    # loader ahead to the contiguous cache, and not to the same cache as a view with a 577-byte token stride; both
    # outputs match the reference computed from the contiguous cache
    from mla_tune.backends.inputs import make_inputs
    from mla_tune.backends.reference import mla_reference
    from mla_tune.backends.triton_mla import launcher, mla_decode
    from test_triton_mla import _rel_err

    forms = []
    hopper_constexprs = launcher.hopper_constexprs

    def recording_hopper_constexprs(*args, **kwargs):
        forms.append(hopper_constexprs(*args, **kwargs))
        return forms[-1]

    monkeypatch.setattr(launcher, "hopper_constexprs", recording_hopper_constexprs)
    problem = _gpu_problem("fp8_e4m3", num_heads=64, page_size=64, topk=2048 if sparse else None)
    inputs = make_inputs(problem, Shape(batch, kv_len), device="cuda", seed=5, ragged=sparse)
    wide = torch.empty(*inputs.kv_cache.shape[:2], 577, dtype=inputs.kv_cache.dtype, device="cuda")
    wide[..., :576] = inputs.kv_cache
    odd = wide[..., :576]
    ref_out, ref_lse = mla_reference(inputs.q, inputs.kv_cache, inputs.block_table, inputs.seq_lens,
                                     sm_scale=inputs.sm_scale, kv_scale=inputs.kv_scale,
                                     topk_indices=inputs.topk_indices)
    outs = [mla_decode(inputs.q, kv, inputs.block_table, inputs.seq_lens, sm_scale=inputs.sm_scale,
                       kv_scale=inputs.kv_scale, topk_indices=inputs.topk_indices) for kv in (inputs.kv_cache, odd)]
    assert [f["LOADER_AHEAD"] for f in forms] == [True, False], forms
    seen = torch.isfinite(ref_lse)
    for out, lse in outs:
        assert not out.isnan().any() and _rel_err(out[seen], ref_out[seen]) < _tol("fp8_e4m3")
        assert torch.allclose(lse[seen], ref_lse[seen], atol=1e-2, rtol=1e-3)


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
