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


@pytest.mark.parametrize("kv,sparse,q_len,page_size", [
    ("bf16", False, 1, 64), ("fp16", False, 2, 16), ("bf16", True, 2, 1),
    ("fp8", False, 1, 64), ("fp8", True, 2, 1), ("fp8", False, 2, 128)])
def test_hopper_kernel_compiles_for_sm90a(kv, sparse, q_len, page_size):
    from offline_compile import hopper_compile

    from mla_tune.backends.triton_mla.hopper import hopper_smem_bytes
    from mla_tune.backends.triton_mla.launch import HOPPER_SHAPE

    ptx, smem, report = hopper_compile(kv=kv, sparse=sparse, q_len=q_len, page_size=page_size)
    assert hopper_smem_bytes(block_n=HOPPER_SHAPE[1], stages=HOPPER_SHAPE[3]) <= smem <= SMEM_LIMIT, smem
    assert "wgmma.mma_async.sync.aligned.m64n32k16" in ptx and "wgmma.mma_async.sync.aligned.m64n256k16" in ptx
    assert "setmaxnreg" in ptx, "the loader warpgroup must hand its registers to the MMA warps"
    if kv == "fp8":  # the loader casts e4m3 pairs to fp16 itself, from 16-byte loads
        assert "cvt.rn.f16x2.e4m3x2" in ptx and "ld.global.v4" in ptx
    else:
        assert "cp.async.cg.shared.global" in ptx and "cp.async.mbarrier.arrive.noinc" in ptx
    # a few bytes at most (Triton 3.6.0: none; 3.7.1: 4-8 B in the FP8 variants; an earlier kernel spilled 20 B
    # there); a loader that kept a tile ahead in registers as bytes spilled 4.5 KB
    assert _spill_bytes(report) <= 64, report


@pytest.mark.parametrize("kv,sparse,q_len,rows", [
    ("bf16", False, 1, 16), ("fp8", False, 1, 16), ("fp8", False, 2, 32), ("bf16", True, 1, 32), ("fp8", True, 2, 16),
    ("fp8", True, 1, 32)])
def test_hopper_narrow_form_compiles_for_sm90a(kv, sparse, q_len, rows):
    from offline_compile import hopper_compile

    from mla_tune.backends.triton_mla.hopper import hopper_smem_bytes
    from mla_tune.backends.triton_mla.launch import HOPPER_SHAPES

    ptx, smem, report = hopper_compile(kv=kv, sparse=sparse, q_len=q_len, page_size=1 if sparse else 64, rows=rows)
    block_n, stages = HOPPER_SHAPES[rows][1], HOPPER_SHAPES[rows][3]
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


@pytest.mark.parametrize("kv,sparse,q_len,page_size", [
    ("bf16", False, 1, 64), ("fp16", False, 2, 16), ("fp8", False, 1, 64), ("fp8", False, 2, 128), ("bf16", True, 1, 1),
    ("fp8", True, 2, 1)])
def test_hopper_ksplit_form_compiles_for_sm90a(kv, sparse, q_len, page_size):
    from collections import Counter

    from offline_compile import hopper_compile

    from mla_tune.backends.triton_mla.hopper import hopper_smem_bytes
    from mla_tune.backends.triton_mla.launch import HOPPER_KSPLIT_SHAPE

    ptx, smem, report = hopper_compile(kv=kv, sparse=sparse, q_len=q_len, page_size=page_size, ksplit=True)
    block_n, stages = HOPPER_KSPLIT_SHAPE[1], HOPPER_KSPLIT_SHAPE[3]
    assert hopper_smem_bytes(block_n=block_n, stages=stages, ksplit=True) <= smem <= SMEM_LIMIT, smem
    # per tile: the scores as m64n64 in one warpgroup (36 k-steps over all 576 columns), `p @ v` as m64n256 (4 k-steps
    # a warpgroup); no m64n32 of the token split
    mmas = Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)", ptx))
    assert mmas == {"m64n64k16": 36, "m64n256k16": 8}, mmas
    # p over the slot's rope columns (stmatrix), read there by the second warpgroup's wgmma, not back into registers
    assert "stmatrix" in ptx and "ldmatrix" not in ptx
    assert re.search(r"\.reqntid (\d+)", ptx).group(1) == "384"  # two MMA warpgroups and the loader
    assert "setmaxnreg.dec.sync.aligned.u32" in ptx
    # spill stores with Triton 3.7.1: 0 B (BF16), 8 B (FP8)
    assert _spill_bytes(report) <= 64, report


@pytest.mark.parametrize("rows,mode,mmas", [
    (32, "mma_only", 36 + 32), (32, "mma_no_pv", 36), (32, "mma_scores", 36), (32, "mma_pv", 32),
    (64, "mma_no_pv", 36), (64, "mma_scores", 36)])
def test_measurement_modes_time_the_mma_warps_in_parts(rows, mode, mmas):
    # hopper.DEBUG_MODES 4-6 (bench/hopper_dev.py --debug): the MMA warps run only their part (per tile 36 score MMAs,
    # k 576, and 32 for `p @ v` in the narrow form; the wide form's score MMAs without its `p @ v`), the loaders copy
    # nothing (no cp.async of the cache, no casts)
    from offline_compile import hopper_compile

    from mla_tune.backends.triton_mla.hopper import DEBUG_MODES

    ptx, _, report = hopper_compile(kv="fp8", rows=rows, DEBUG=DEBUG_MODES[mode])
    assert len(re.findall(r"wgmma\.mma_async", ptx)) == mmas
    assert "cp.async.cg.shared.global" not in ptx and "cvt.rn.f16x2.e4m3x2" not in ptx
    assert _spill_bytes(report) <= 64, report


@pytest.mark.parametrize("rows,kv", [(32, "fp8"), (16, "bf16"), (64, "fp8"), (64, "bf16")])
def test_decoupled_mode_drops_only_the_waits_between_the_partitions(rows, kv):
    # hopper.DEBUG_MODES 7 (bench/hopper_dev.py 'fp8:dflt@decoupled'): the narrow and token-split wide forms run their
    # loaders and MMA warps in full, but no side waits on the other's slot barriers
    from offline_compile import hopper_compile

    from mla_tune.backends.triton_mla.hopper import DEBUG_MODES

    counted = (r"mbarrier\.try_wait", r"wgmma\.mma_async", r"cp\.async\.cg\.shared\.global", r"cvt\.rn\.f16x2\.e4m3x2")
    default = [len(re.findall(c, hopper_compile(kv=kv, rows=rows)[0])) for c in counted]
    ptx, _, report = hopper_compile(kv=kv, rows=rows, DEBUG=DEBUG_MODES["decoupled"])
    decoupled = [len(re.findall(c, ptx)) for c in counted]
    assert default[0] >= 2 and decoupled[0] == 0
    assert decoupled[1:] == default[1:]
    assert _spill_bytes(report) <= 64, report


@pytest.mark.parametrize("mode,copies,casts", [("decoupled_copies", True, False), ("decoupled_casts", False, True)])
def test_decoupled_loader_parts_run_only_their_part(mode, copies, casts):
    # hopper.DEBUG_MODES 8-9 (narrow FP8 form): decoupled as in mode 7, with the staged loader doing only its cp.async
    # copies into the staging ring (8) or only its read-back, casts and fp16 stores (9; only the prologue's copies)
    from offline_compile import hopper_compile

    from mla_tune.backends.triton_mla.hopper import DEBUG_MODES

    ptx, _, report = hopper_compile(kv="fp8", rows=32, DEBUG=DEBUG_MODES[mode])
    assert "mbarrier.try_wait" not in ptx
    assert len(re.findall(r"cp\.async\.cg\.shared\.global", ptx)) == (36 if copies else 18)
    assert len(re.findall(r"cvt\.rn\.f16x2\.e4m3x2", ptx)) == (144 if casts else 0)
    assert _spill_bytes(report) == 0, report


@pytest.mark.parametrize("rows,ksplit,mode", [(64, False, "mma_pv"), (64, True, "mma_no_pv"),
                                              (32, False, "no_reductions"), (64, True, "decoupled"),
                                              (64, False, "decoupled_copies"), (64, False, "qk1_eager_rescale"),
                                              (32, False, "qk1_eager_rescale"), (64, False, "qk1_row_mask"),
                                              (32, False, "scalar_cast")])
def test_a_form_refuses_a_measurement_mode_it_does_not_have(rows, ksplit, mode):
    from offline_compile import hopper_compile
    from triton.compiler.errors import CompilationError

    from mla_tune.backends.triton_mla.hopper import DEBUG_MODES

    with pytest.raises(CompilationError, match="no such measurement mode"):
        hopper_compile(kv="fp8", rows=rows, ksplit=ksplit, DEBUG=DEBUG_MODES[mode])


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_the_ksplit_form_skips_its_second_warpgroups_rescale_where_no_reference_moved(kv):
    # round 52: mode 10 (the eager rescale) multiplies both 64 x 256 accumulators every tile; the default branches
    # around the second warpgroup's 128 multiplies a thread, and only there (the first warpgroup's branch spilled)
    from offline_compile import hopper_compile

    from mla_tune.backends.triton_mla.hopper import DEBUG_MODES

    def multiplies(ptx):
        return len(re.findall(r"^\s*mul\.f32", ptx, flags=re.M))

    lazy, _, report = hopper_compile(kv=kv, ksplit=True)
    eager, _, _ = hopper_compile(kv=kv, ksplit=True, DEBUG=DEBUG_MODES["qk1_eager_rescale"])
    assert multiplies(lazy) == multiplies(eager)  # the same multiplies, one group of them behind a branch
    assert lazy.count("bra") > eager.count("bra")
    assert _spill_bytes(report) <= 16, report


@pytest.mark.parametrize("q_len", [1, 2])
def test_the_ksplit_form_masks_one_query_tokens_scores_with_a_column_bias(q_len):
    # round 55: one query token sees the whole request, so its mask is a column bias (0 or -inf) added to the scaled
    # score by one FMA (32 a thread); with two (MTP) the mask by row and column stays, as in mode 11
    from offline_compile import hopper_compile

    from mla_tune.backends.triton_mla.hopper import DEBUG_MODES

    def fmas(ptx):
        return len(re.findall(r"fma\.rn\.f32", ptx))

    bias, _, report = hopper_compile(kv="bf16", ksplit=True, sparse=True, q_len=q_len)
    row_mask, _, _ = hopper_compile(kv="bf16", ksplit=True, sparse=True, q_len=q_len,
                                    DEBUG=DEBUG_MODES["qk1_row_mask"])
    assert fmas(bias) - fmas(row_mask) == (32 if q_len == 1 else 0)
    assert _spill_bytes(report) == 0, report


def test_the_ksplit_form_rounds_p_to_bf16_two_values_an_instruction():
    # round 56: `cvt.rn.bf16x2.f32` (ptxas makes a scalar bf16 cast one F2F each); mode 12 is the scalar cast
    from offline_compile import hopper_compile

    from mla_tune.backends.triton_mla.hopper import DEBUG_MODES

    def casts(ptx):
        return len(re.findall(r"cvt\.rn\.bf16x2\.f32", ptx)), len(re.findall(r"cvt\.rn\.bf16\.f32", ptx))

    packed, _, _ = hopper_compile(kv="bf16", ksplit=True, sparse=True)
    scalar, _, _ = hopper_compile(kv="bf16", ksplit=True, sparse=True, DEBUG=DEBUG_MODES["scalar_cast"])
    assert casts(packed) == (16, 0)  # p: 64 x 64 over 128 threads, two a cast
    assert casts(scalar) == (0, 32)


@pytest.mark.parametrize("rows,ksplit", [(64, False), (32, False), (64, True)])
def test_split_partials_are_stored_with_an_l2_evict_last_hint(rows, ksplit):
    # every form's epilogue: with PARTIAL_EVICT_LAST (launch sets it with more than one split) the output stores
    # carry an evict-last cache policy, without it none does
    from offline_compile import hopper_compile

    hinted, _, _ = hopper_compile(kv="fp8", rows=rows, ksplit=ksplit, PARTIAL_EVICT_LAST=True)
    plain, _, _ = hopper_compile(kv="fp8", rows=rows, ksplit=ksplit, PARTIAL_EVICT_LAST=False)
    assert "createpolicy.fractional.L2::evict_last" in hinted and "L2::cache_hint" in hinted
    assert "evict_last" not in plain and "L2::cache_hint" not in plain


def test_launch_hints_the_partials_only_where_there_are_splits(monkeypatch):
    import torch

    from mla_tune.backends.triton_mla import hopper, launch

    seen = []
    kernel_params = set(hopper._mla_hopper_kernel.arg_names) | {"num_warps", "maxnreg"}

    class RecordingKernel:  # stands in for the Gluon kernel: records the split count and the hint (no GPU here)
        def __getitem__(self, grid):
            def launch_(*args, **kw):
                assert set(kw) <= kernel_params, set(kw) - kernel_params  # every keyword is one the kernel takes
                seen.append((grid[2], kw["PARTIAL_EVICT_LAST"]))
            return launch_

    monkeypatch.setattr(hopper, "_mla_hopper_kernel", RecordingKernel())
    cuda_q = type("CudaTensor", (), {"is_cuda": True})()  # `_launch_hopper` refuses CPU tensors
    kv = torch.empty(1, 64, 576, dtype=torch.bfloat16)
    params = launch.LaunchParams(**launch._launch_fields(launch.HOPPER_TILE))
    for splits in (1, 2, 8):
        launch._launch_hopper((), (1, 1, splits), {"SPARSE": False, "Q_LEN": 1}, q=cuda_q, kv_cache=kv, params=params,
                              tiles=4)
    assert seen == [(1, False), (2, True), (8, True)]


def test_the_loader_ahead_is_not_given_a_cache_it_cannot_read_as_words(monkeypatch):
    # `_load_fp8_ahead` reads the FP8 cache as 32-bit words (strides divided by 4): a cache view whose token stride is
    # not a whole number of words launches the loader without it; the same shape, contiguous, takes it
    import torch

    from mla_tune.backends.triton_mla import hopper, launch

    seen = []

    class RecordingKernel:  # stands in for the Gluon kernel (no GPU here)
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append((kw["LOADER_AHEAD"], kw["LOAD_REGS"]))

    monkeypatch.setattr(hopper, "_mla_hopper_kernel", RecordingKernel())
    cuda_q = type("CudaTensor", (), {"is_cuda": True})()
    params = launch.LaunchParams(**launch._launch_fields(launch.HOPPER_KSPLIT_TILE))
    contiguous = torch.empty(2, 1, 576, dtype=torch.float8_e4m3fn)
    odd_rows = torch.empty(2, 1, 577, dtype=torch.float8_e4m3fn)[:, :, :576]
    assert launch.kv_cache_in_words(contiguous) and not launch.kv_cache_in_words(odd_rows)
    for kv in (contiguous, odd_rows):
        launch._launch_hopper((), (1, 1, 1), {"SPARSE": True, "Q_LEN": 1}, q=cuda_q, kv_cache=kv, params=params,
                              tiles=32)
    assert seen == [(True, launch.HOPPER_LOAD_REGS["fp8_ahead"]), (False, launch.HOPPER_LOAD_REGS["fp8"])]


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
    from mla_tune.backends.triton_mla.launch import (
        HOPPER_KSPLIT_MIN_BATCH, HOPPER_MIN_BATCH, HOPPER_NARROW_MIN_BATCH, default_params, short_requests)

    min_batch = HOPPER_MIN_BATCH.get((kind, bucket), (None, None))[sparse]
    narrow_min = HOPPER_NARROW_MIN_BATCH.get((kind, bucket), (None, None))[sparse]
    for batch in (1, 2, 4, 16, 64, 128):
        for items in (1024, 2048, 4096):
            kwargs = dict(num_heads=bucket, q_len=1, batch=batch, max_items=items, num_sms=132, sparse=sparse,
                          kv_fp8=kind == "fp8", lengths=[items] * batch)
            short = short_requests(kind=kind, bucket=bucket, batch=batch, max_items=items, sparse=sparse)
            narrow = narrow_min is not None and batch >= narrow_min and not short
            wide = min_batch is not None and batch >= min_batch and not short and not narrow
            hopper = default_params(**kwargs, cc_major=9)
            assert hopper.warp_specialized == (narrow or wide), (batch, items, hopper)
            if narrow or wide:  # the form: narrow (16/32 rows) or wide (64; dense 128 rows: k-split from a batch)
                assert hopper.block_h == (bucket if narrow else 64), (batch, items, hopper)
                ksplit_min = HOPPER_KSPLIT_MIN_BATCH.get((kind, bucket), (None, None))[sparse]
                ksplit = wide and ksplit_min is not None and batch >= ksplit_min
                assert hopper.num_warps == (4 if ksplit or narrow else 8), (batch, items, hopper)
            for other in (8, 10, 12, None):  # no wgmma / setmaxnreg there (None: the CPU interpreter)
                assert not default_params(**kwargs, cc_major=other).warp_specialized


@pytest.mark.parametrize("heads,batch,items,kv_fp8,sparse,hopper", [
    (16, 128, 16384, True, False, 16),     # FP8 16 heads, narrow form: 0.73 of the wide time (call 59)
    (32, 4, 2048, True, True, 32),         # sparse FP8 32 heads at batch 4, two loaders: narrow 0.963 (call 69)
    (64, 1, 4096, False, False, True),     # measured 0.98 of the tl time (call 39)
    (64, 1, 1024, False, False, False),    # 1.45x slower in the official grids (short request, small batch)
    (64, 64, 1024, False, False, True),    # short requests at batch 64 did not lose
    (64, 16, 1024, False, False, True),    # ... and at batch 16 they win now: 0.94 / 0.92 (H100 / H200, call 89/90)
    (32, 16, 1024, True, False, 32),       # FP8 32 heads, narrow: 0.73 / 0.72 of the tl time
    (32, 16, 1024, False, False, False),   # but bf16 32 heads short: the wide form 1.07 / 1.01, so the tl tile
    (128, 4, 1024, True, False, True),     # 128 heads from batch 4: 0.87 / 0.85 (FP8), 0.92 / 0.88 (bf16)
    (128, 1, 1024, False, False, False),   # ... not at batch 1 (1.04 / 1.05)
    (64, 4, 1024, True, False, False),     # 64 heads at batch 4 stays on the tl tile (1.03 / 1.05)
    (16, 128, 16384, False, False, False),  # dense BF16 16 heads: H200 6-13% slower
    (32, 4, 16384, True, False, True),     # FP8 32 heads: 0.67 (call 40)
    (16, 128, 2048, False, True, 16),      # sparse BF16 16 heads at batch 64-128: narrow 0.96-0.98 of wide
    (16, 16, 2048, False, True, 16),       # ... 0.967 at batch 16 (call 69)
    (16, 4, 2048, False, True, False),     # ... the tl tile at batch 4 (narrow 1.04x, wide 1.13x its time)
    (32, 64, 2048, False, True, 32),       # sparse BF16 32 heads, batch 64-128: narrow 0.97-1.00 (H100), 0.86-0.94
    (32, 16, 2048, False, True, 64),       # ... and the wide kernel below (narrow 1.01 at batch 16 on both)
])
def test_sm90_dispatch_on_measured_cases(heads, batch, items, kv_fp8, sparse, hopper):
    from mla_tune.backends.triton_mla.launch import default_params

    params = default_params(num_heads=heads, q_len=1, batch=batch, max_items=items, num_sms=132, sparse=sparse,
                            kv_fp8=kv_fp8, lengths=[items] * batch, cc_major=9)
    assert params.warp_specialized == bool(hopper), params
    if hopper is not True and hopper:  # a row count: the form (narrow 16/32 rows, wide 64)
        assert params.block_h == hopper, params


@pytest.mark.parametrize("kv,rows,sparse,ksplit", [
    ("bf16", 64, False, False), ("fp8", 64, False, False), ("fp8", 16, False, False), ("bf16", 32, True, False),
    ("bf16", 64, False, True), ("bf16", 64, True, True), ("fp8", 64, True, True)])
def test_the_query_is_loaded_before_the_partitions_or_by_the_mma_warps(kv, rows, sparse, ksplit):
    # Code before `warp_specialize` runs on the MMA warps while the loader waits at the partitions' start (PTX
    # `barrier.sync 1`): with QUERY_IN_CONSUMER no query load is left there, so the loader's first copies do not wait
    # for the query; both ways compile without more spills
    from offline_compile import hopper_compile

    def query_loads_before_partitions(ptx):
        return len(re.findall(r"ld\.global\.v4", ptx.split("barrier.sync \t1;")[0]))

    kw = dict(kv=kv, rows=rows, sparse=sparse, page_size=1 if sparse else 64, ksplit=ksplit)
    before, _, report_before = hopper_compile(**kw, QUERY_IN_CONSUMER=False)
    inside, _, report_inside = hopper_compile(**kw, QUERY_IN_CONSUMER=True)
    assert query_loads_before_partitions(before) > 0 and query_loads_before_partitions(inside) == 0
    assert _spill_bytes(report_inside) <= _spill_bytes(report_before), (report_before, report_inside)


@pytest.mark.parametrize("heads,kv_fp8,sparse,batch,inside", [
    (16, True, False, 64, True), (32, False, True, 64, True),   # narrow forms
    (64, False, False, 8, True), (64, True, True, 16, True),    # wide: BF16 (dense below batch 16), sparse FP8
    (64, True, True, 64, True),                                 # sparse FP8 from batch 64, 4-warp: 0.986-0.996
    (64, True, False, 64, False),                               # wide FP8 dense: 1.02-1.22x slower inside
    (128, False, False, 128, False), (64, False, False, 64, False),  # the 4-warp launch (qk1), dense
    (128, False, True, 128, True), (64, False, True, 4, True),  # ... sparse BF16: 0.97-0.99 inside (call 178)
])
def test_launch_picks_who_loads_the_query_by_form(heads, kv_fp8, sparse, batch, inside):
    from mla_tune.backends.triton_mla.launch import default_params, hopper_form

    params = default_params(num_heads=heads, q_len=1, batch=batch, max_items=4096, sparse=sparse, kv_fp8=kv_fp8,
                            cc_major=9, num_sms=132, lengths=[4096] * batch)
    assert params.warp_specialized, params
    form = hopper_form(params, kv_fp8=kv_fp8, sparse=sparse, splits=params.num_splits)
    assert form["QUERY_IN_CONSUMER"] is inside, (params.label(), form)


@pytest.mark.parametrize("kv,sparse,cols", [("bf16", True, 0), ("bf16", True, 128), ("bf16", True, 192),
                                             ("fp16", True, 128), ("fp8", False, 64)])
def test_warpgroup_0_takes_the_querys_first_columns_from_registers(kv, sparse, cols):
    # round 62: the 4-warp launch's score MMAs read `cols` query columns (rope first) from registers (wgmma with A
    # in registers: `p @ v`'s 4 k-steps, plus cols / 16) and the rest from shared memory, 36 k-steps in all, no spills
    from offline_compile import hopper_compile

    ptx, _, report = hopper_compile(kv=kv, sparse=sparse, page_size=1 if sparse else 64, ksplit=True,
                                    QUERY_REG_COLS=cols)
    mmas = [line for line in ptx.splitlines() if "wgmma.mma_async" in line]
    register_a = [line for line in mmas if re.search(r"wgmma\.mma_async\S*\s+\{[^}]*\},\s*\{", line)]
    assert len(mmas) == 36 + 8 and len(register_a) == 4 + cols // 16, (len(mmas), len(register_a))
    if kv != "fp8":
        assert _spill_bytes(report) == 0, report


@pytest.mark.parametrize("heads,kv_fp8,sparse,batch,cols", [
    (128, False, True, 64, 128), (128, False, True, 128, 128),   # sparse BF16, 4-warp launch: 0.964-0.982 (266-267)
    (64, False, True, 4, 128),                                   # ... which runs 64 heads at every batch
    (128, False, False, 128, 0), (64, True, False, 64, 0),       # dense 4-warp launch: no gain, BF16 or FP8
    (64, True, True, 64, 0), (64, True, True, 4, 0),             # sparse FP8: the 4-warp launch (1.28x slower), wide
])
def test_launch_picks_the_query_columns_in_registers_by_form(heads, kv_fp8, sparse, batch, cols):
    from mla_tune.backends.triton_mla.launch import default_params, hopper_form

    params = default_params(num_heads=heads, q_len=1, batch=batch, max_items=4096, sparse=sparse, kv_fp8=kv_fp8,
                            cc_major=9, num_sms=132, lengths=[4096] * batch)
    assert params.warp_specialized, params
    assert hopper_form(params, kv_fp8=kv_fp8, sparse=sparse, splits=params.num_splits)["QUERY_REG_COLS"] == cols


@pytest.mark.parametrize("kv,sparse,ksplit,prefetches", [
    ("fp8", True, False, True), ("fp8", False, False, True), ("fp8", False, True, True), ("bf16", False, False, False)])
def test_the_fp8_register_loader_can_prefetch_the_next_tile_into_l2(kv, sparse, ksplit, prefetches):
    # With L2_PREFETCH the wide forms' FP8 register loader issues prefetch.global.L2 for the next tile's lines (four a
    # thread: two rows, two of the offsets 0-575), without it none; 16-bit caches copy with cp.async and never prefetch
    from offline_compile import hopper_compile

    kw = dict(kv=kv, sparse=sparse, page_size=1 if sparse else 64, ksplit=ksplit)
    on, _, report_on = hopper_compile(**kw, L2_PREFETCH=True)
    off, _, report_off = hopper_compile(**kw, L2_PREFETCH=False)
    assert len(re.findall(r"prefetch\.global\.L2", on)) == (4 if prefetches else 0)
    assert "prefetch.global.L2" not in off
    assert _spill_bytes(report_on) <= _spill_bytes(report_off) + 16, (report_off, report_on)


@pytest.mark.parametrize("ksplit,sparse", [(True, True), (True, False), (False, True)])
def test_the_loader_ahead_holds_the_next_tile_as_words_without_spilling(monkeypatch, ksplit, sparse):
    # LOADER_AHEAD (round 59): the next tile's 18 16-byte loads a thread are issued before the loop and again after each
    # tile's stores, and cast from 32-bit words. At HOPPER_LOAD_REGS["fp8_ahead"] (Triton 3.7.1) dense spills nothing
    # and sparse 28 B (scalars; the loader loop reloads one before the slot wait), against 68-136 B at 96 registers,
    # where the loop spilled some of the loads' destinations and so waited for them before the slot (H100 call 244)
    from offline_compile import hopper_compile

    from mla_tune.backends.triton_mla import hopper
    from mla_tune.backends.triton_mla.launch import HOPPER_LOAD_REGS

    kw = dict(kv="fp8", sparse=sparse, page_size=1 if sparse else 64, ksplit=ksplit)
    monkeypatch.setattr(hopper, "LOADER_AHEAD", False)
    off, _, _ = hopper_compile(**kw)
    monkeypatch.setattr(hopper, "LOADER_AHEAD", True)
    on, _, report = hopper_compile(**kw)
    assert re.search(rf"setmaxnreg\.\w+\.sync\.aligned\.u32\s+{HOPPER_LOAD_REGS['fp8_ahead']};", on)
    assert on.count("ld.global.v4") == off.count("ld.global.v4") + 18
    assert on.count("cvt.rn.f16x2.e4m3x2") == off.count("cvt.rn.f16x2.e4m3x2")
    assert _spill_bytes(report) <= (32 if sparse else 0), report


@pytest.mark.parametrize("heads,sparse,batch,kv_len,ahead", [
    (64, True, 64, 4096, True), (128, True, 128, 4096, True),    # sparse FP8 on the 4-warp launch: 0.93-0.97
    (64, True, 4, 4096, False), (128, True, 16, 4096, False),    # the sparse wide form: 0.98-1.02, left
    (64, False, 4, 16384, True), (64, False, 16, 4096, True),    # dense, 8 tiles a program: 0.95-0.96
    (64, False, 16, 16384, False), (64, False, 128, 16384, False),  # dense, 32 / 256 tiles: 1.03 / 1.08
    (16, True, 128, 4096, False)])                               # the narrow form has its own (staged) loader
def test_launch_gives_the_loader_ahead_to_sparse_and_short_dense_fp8_4_warp_programs(heads, sparse, batch, kv_len,
                                                                                    ahead):
    from mla_tune.backends.triton_mla.launch import HOPPER_LOAD_REGS, default_params, hopper_form

    params = default_params(num_heads=heads, q_len=1, batch=batch, max_items=kv_len, sparse=sparse, kv_fp8=True,
                            cc_major=9, num_sms=132, lengths=[kv_len] * batch)
    tiles = -(-params.split_items // params.block_n)  # as `launch.launch` gives it
    form = hopper_form(params, kv_fp8=True, sparse=sparse, splits=params.num_splits, tiles=tiles)
    assert form["LOADER_AHEAD"] is ahead, (params.label(), tiles, form)
    assert form["LOAD_REGS"] == HOPPER_LOAD_REGS["fp8_ahead" if ahead else "fp8"], form
    if not sparse:  # without the tile count (an offline compile) dense never takes it
        assert not hopper_form(params, kv_fp8=True, sparse=False, splits=params.num_splits)["LOADER_AHEAD"]


@pytest.mark.parametrize("kv,rows,ksplit", [("fp8", 64, False), ("fp8", 16, False), ("fp8", 64, True),
                                             ("bf16", 64, False), ("bf16", 32, False)])
def test_fp8_slots_are_fenced_by_their_loader_and_16bit_ones_by_the_mma_warps(kv, rows, ksplit):
    # The FP8 loaders store a slot, fence it (fence.proxy.async) and arrive: with CONSUMER_FENCE off (the default) the
    # MMA warps do not fence it again; cp.async slots (16-bit) are always fenced by the MMA warps after their barrier
    from offline_compile import hopper_compile

    from mla_tune.backends.triton_mla.launch import HOPPER_CONSUMER_FENCE

    def fences(ptx):
        return len(re.findall(r"fence\.proxy\.async", ptx))

    kw = dict(kv=kv, rows=rows, ksplit=ksplit)
    fenced, _, _ = hopper_compile(**kw, CONSUMER_FENCE=True)
    default, _, _ = hopper_compile(**kw)
    assert HOPPER_CONSUMER_FENCE is False
    # (the 4-warp launch: both MMA warpgroups wait for the full slot, each would fence it)
    assert fences(default) == fences(fenced) - (kv == "fp8") * (2 if ksplit else 1)


@pytest.mark.parametrize("heads,kv_fp8,sparse,prefetch", [
    (64, True, True, True), (128, True, True, True),     # sparse FP8 (4-warp launch at batch 64): 0.91-0.95
    (64, True, False, True),                             # dense wide FP8: 0.93-0.95 without the consumer fence
    (16, True, True, False), (64, False, True, False)])  # the narrow form (staged loader), BF16 (cp.async)
def test_launch_prefetches_into_l2_by_form(heads, kv_fp8, sparse, prefetch):
    from mla_tune.backends.triton_mla.launch import default_params, hopper_form

    params = default_params(num_heads=heads, q_len=1, batch=64, max_items=4096, sparse=sparse, kv_fp8=kv_fp8,
                            cc_major=9, num_sms=132, lengths=[4096] * 64)
    assert params.warp_specialized, params
    assert hopper_form(params, kv_fp8=kv_fp8, sparse=sparse, splits=params.num_splits)["L2_PREFETCH"] is prefetch


@pytest.mark.parametrize("sparse,prefetch", [(False, True), (True, True)])
def test_the_ksplit_fp8_form_prefetches_into_l2_where_measured(sparse, prefetch):
    # the 4-warp launch's FP8 form, dense: 0.926-0.939 of the time at 64 heads batch 4-128, 0.98-1.01 at 128 heads (H100
    # call 140); sparse: 0.91-0.95 at batch 64-128, 0.95-0.99 at batch 1-16 (calls 230-232, H100 and H200)
    from mla_tune.backends.triton_mla.launch import HOPPER_KSPLIT_TILE, hopper_form, params_from_tile

    params = params_from_tile(HOPPER_KSPLIT_TILE, rows=128, q_len=1, batch=64, max_items=4096, num_sms=132,
                              sparse=sparse, lengths=[4096] * 64)
    form = hopper_form(params, kv_fp8=True, sparse=sparse, splits=params.num_splits)
    assert form["KSPLIT"] and form["L2_PREFETCH"] is prefetch


@pytest.mark.parametrize("heads,q_len,batch,kv_fp8,sparse,ksplit", [
    # the 4-warp launch (qk1 division; call 172, H100, uniform lengths, over the wide form):
    (128, 1, 4, False, False, True),    # BF16 128 heads from batch 4: 0.90
    (128, 1, 128, False, False, True),  # ... 0.99 at batch 128 kv 16k (0.96 at batch 64 kv 4k)
    (128, 1, 1, False, False, False),   # ... not at batch 1 (1.03)
    (128, 1, 128, True, False, True),   # FP8 128 heads from batch 16: 0.87 at batch 128 kv 16k (0.90 ragged)
    (128, 1, 4, True, False, False),    # ... not at batch 4 (0.94 uniform, 1.03 ragged)
    (64, 1, 64, True, False, True),     # FP8 64 heads: 0.94 at batch 64 (1.00 ragged), 0.93 at batch 128 kv 16k
    (64, 1, 16, True, False, True),     # ... with the lazy rescale from batch 1: 0.97-0.98 (0.99-1.00 ragged, call 191)
    (64, 2, 64, False, False, True),    # 128 packed rows (two query tokens of 64 heads)
    (64, 1, 128, False, False, True),   # BF16 64 heads from batch 16: 0.86 on an H200, 0.99 on an H100 (calls 223-224)
    (64, 1, 4, False, False, False),    # ... not below (H100 1.01-1.03 at batch 2-8)
    (64, 1, 1, False, True, True),      # sparse BF16 64 heads from batch 1: H200 0.94, H100 0.94
    (128, 1, 128, False, True, True),   # sparse BF16 128 heads from batch 4, the query by warpgroup 0: 0.87 at 128
    (128, 1, 4, False, True, True),     # ... 0.98 at batch 4 (call 178)
    (128, 1, 1, False, True, True),     # ... and at batch 1: 0.983 (H100 call 183), 0.986 (H200 call 181)
    (128, 1, 128, True, True, True),    # sparse FP8 from batch 64, with the L2 prefetch: 0.971-0.988 (calls 230-232)
    (64, 1, 64, True, True, True),      # ... 0.976-0.980
    (128, 1, 16, True, True, False),    # ... not below (H200 0.99-1.04 at batch 1-16)
    (64, 1, 4, True, True, False),
])
def test_sm90_dispatch_of_the_ksplit_form(heads, q_len, batch, kv_fp8, sparse, ksplit):
    from mla_tune.backends.triton_mla.launch import HOPPER_KSPLIT_TILE, HOPPER_TILE, candidate_tiles, default_params

    kwargs = dict(num_heads=heads, q_len=q_len, batch=batch, max_items=4096, sparse=sparse, kv_fp8=kv_fp8, cc_major=9)
    params = default_params(**kwargs, num_sms=132, lengths=[4096] * batch)
    assert params.warp_specialized and params.block_h == 64, params
    assert (params.num_warps == 4) == ksplit and params.label().startswith("h64n64w4" if ksplit else "h64n64w8")
    # the tuner times both wide forms from 64 rows, whichever the default is
    tiles = candidate_tiles(**kwargs)
    assert HOPPER_KSPLIT_TILE in tiles and HOPPER_TILE in tiles, tiles


@pytest.mark.parametrize("batch,splits", [(1, 16), (2, 16), (4, 8), (8, 8), (16, 4), (64, 1)])
def test_sparse_bf16_128_heads_takes_splits_of_256_tokens_from_batch_4(batch, splits, monkeypatch):
    # `HOPPER_KSPLIT_SPARSE_MIN_SPLIT`: at batch 4, 8 splits of 256 top-k slots (16 of 128 before: 0.946 / 0.944 of
    # the time, device calls 206-207); batch 1 keeps 16 (1.24x slower with 8); from batch 8 the split model picks them
    from mla_tune.backends.triton_mla import launch

    kwargs = dict(num_heads=128, q_len=1, batch=batch, max_items=2048, kv_fp8=False, cc_major=9)
    sparse = launch.default_params(**kwargs, sparse=True, num_sms=132, lengths=[2048] * batch)
    dense = launch.default_params(**kwargs, num_sms=132, lengths=[2048] * batch)
    assert sparse.num_warps == 4 and sparse.num_splits == splits, sparse
    assert launch.HOPPER_KSPLIT_TILE in launch.candidate_tiles(**kwargs, sparse=True)  # the tuner still times 128
    monkeypatch.setattr(launch, "HOPPER_KSPLIT_SPARSE_MIN_SPLIT", {})
    before = launch.default_params(**kwargs, sparse=True, num_sms=132, lengths=[2048] * batch)
    assert (before.num_splits == 16) == (batch <= 4) and (before == sparse) == (batch != 4), before
    assert launch.default_params(**kwargs, num_sms=132, lengths=[2048] * batch) == dense  # dense: no change


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


def _params(kv_dtype, *, heads, q_len, batch, max_items, lengths, sparse=False, form="wide"):
    """The wide kernel's parameters (64 rows; "wide_ks": its k-split form), or the narrow form's for the rows
    bucket (skips above 32 rows)."""
    from mla_tune.backends.triton_mla.launch import (
        HOPPER_KSPLIT_TILE, HOPPER_TILE, HOPPER_TILES, params_from_tile, rows_bucket)

    rows = heads if sparse else heads * q_len
    tile = HOPPER_KSPLIT_TILE if form == "wide_ks" else HOPPER_TILE
    if form == "narrow":
        if rows > 32:
            pytest.skip("the narrow form takes up to 32 rows")
        tile = HOPPER_TILES[rows_bucket(rows)]
    return params_from_tile(tile, rows=rows, q_len=q_len, batch=batch, max_items=max_items, sparse=sparse,
                            lengths=lengths, num_sms=torch.cuda.get_device_properties(0).multi_processor_count)


GPU_KV_DTYPES = ("bf16", "fp16", "fp8_e4m3")
# 64 rows, two MMA warpgroups; the same with the scores split over k (`HOPPER_KSPLIT_TILE`); up to 32 rows, one
# MMA warpgroup on transposed products
FORMS = ("wide", "wide_ks", "narrow")

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
    from mla_tune.backends.triton_mla.launch import default_params

    problem = Problem(num_heads=64, kv_cache_dtype="fp8_e4m3", page_size=64)
    assert default_params(num_heads=64, q_len=1, batch=8, max_items=4096, num_sms=132, kv_fp8=True,
                          cc_major=torch.cuda.get_device_capability()[0]).warp_specialized
    r = _run_case(problem, Shape(8, 4096), device="cuda")
    assert not r["nan"] and r["rel_err"] < _tol("fp8_e4m3"), r


@pytest.mark.gpu
@hopper_only
def test_gpu_sparse_128_heads_at_batch_4_takes_8_splits_and_matches_the_reference():
    # `HOPPER_KSPLIT_SPARSE_MIN_SPLIT`: the launch the adapters' `default_params` picks (8 splits of 4 tiles on 132 SMs)
    from mla_tune.backends.triton_mla.launch import default_params

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
def test_gpu_sparse_fp8_at_batch_64_takes_the_4_warp_launch_with_the_prefetch_and_matches_the_reference(heads):
    # `HOPPER_KSPLIT_MIN_BATCH` (sparse FP8 from batch 64), `L2_PREFETCH_FORMS` and `LOADER_AHEAD_FORMS` ("ksplit",
    # "fp8", "sparse"): the launch the adapters' `default_params` picks, through the loader that keeps the next tile in
    # registers and prefetches the one after, top-k 2048 of 3000 tokens
    from mla_tune.backends.triton_mla.launch import default_params, hopper_form

    problem = _gpu_problem("fp8_e4m3", num_heads=heads, page_size=64, topk=2048)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    params = default_params(num_heads=heads, q_len=1, batch=64, max_items=2048, num_sms=sms, sparse=True,
                            kv_fp8=True, lengths=[2048] * 64, cc_major=9)
    form = hopper_form(params, kv_fp8=True, sparse=True, splits=params.num_splits)
    assert params.num_warps == 4 and form["KSPLIT"] and form["L2_PREFETCH"] and form["LOADER_AHEAD"], (params, form)
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
    from mla_tune.backends.triton_mla import launch, mla_decode
    from test_triton_mla import _rel_err

    forms = []
    hopper_form = launch.hopper_form

    def recording_hopper_form(*args, **kwargs):
        forms.append(hopper_form(*args, **kwargs))
        return forms[-1]

    monkeypatch.setattr(launch, "hopper_form", recording_hopper_form)
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
