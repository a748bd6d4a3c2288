"""MLA_TUNE_TRITON_FP8Q: the Hopper kernel on FP8 tensor cores (`LaunchParams.fp8_query`): the narrow form for 16-32
rows (`hopper_fp8_query.py`), the wide form for 64 (`hopper_fp8_query_wide.py`).

CPU: what the launch parameters, the launcher and the registry accept; marked `slow`, the forms compile for sm_90a
offline with e4m3 wgmma only and no cast of the tiles. GPU (marker `gpu`, Hopper only): against the float32
reference (the gate's FP8-query limit) and, tighter, against the reference run on the query rounded the way the
kernel rounds it, so what is left is the rounding of p.
"""

from __future__ import annotations

import math
import re
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from mla_tune.backends.inputs import make_inputs  # noqa: E402
from mla_tune.backends.problem import DeviceSpec, Problem, Shape  # noqa: E402
from mla_tune.backends.reference import mla_reference  # noqa: E402
from mla_tune.backends.triton_mla.dispatch import FP8_QUERY_FORMS, FP8_QUERY_WIDE_MIN_ROWS  # noqa: E402
from test_triton_mla import _ramp_keys  # noqa: E402

H100 = DeviceSpec("NVIDIA H100 80GB HBM3", (9, 0))


def test_fp8_query_runs_on_the_fp8_query_forms_only():
    from mla_tune.backends.triton_mla import LaunchParams

    for rows in (16, 32, 64):
        params = LaunchParams(block_h=rows, block_n=64, num_warps=4, num_stages=3, warp_specialized=True,
                              fp8_query=True)
        assert params.kernel_form == ("fp8_query_wide" if rows == 64 else "narrow")
    for fields in (dict(block_h=64, block_n=64, num_warps=8, num_stages=2, warp_specialized=True),
                   dict(block_h=64, block_n=64, num_warps=4, num_stages=2, warp_specialized=True),
                   dict(block_h=32, block_n=64, num_warps=4, num_stages=2, warp_specialized=True),
                   dict(block_h=16, block_n=32, num_warps=4, num_stages=2)):
        with pytest.raises(ValueError, match="FP8-query Hopper forms only"):
            LaunchParams(**fields, fp8_query=True)
    # three slots hold e4m3 tiles, not 16-bit ones
    for rows in (16, 64):
        with pytest.raises(ValueError, match="FP8-query form's launch shape"):
            LaunchParams(block_h=rows, block_n=64, num_warps=4, num_stages=3, warp_specialized=True)


def test_every_hopper_form_runs_12_warps_as_its_maxnreg_assumes():
    from mla_tune.backends.triton_mla.config import (
        HOPPER_FP8_QUERY_SHAPES, HOPPER_FP8_QUERY_WIDE_AHEAD_SHAPE, HOPPER_MAXNREG, HOPPER_QK1_SHAPE, HOPPER_SHAPES)

    shapes = [*HOPPER_SHAPES.values(), HOPPER_QK1_SHAPE, *HOPPER_FP8_QUERY_SHAPES.values(),
              HOPPER_FP8_QUERY_WIDE_AHEAD_SHAPE]
    assert {s.warps_run for s in shapes} == {12} and HOPPER_MAXNREG * 12 * 32 <= 65536
    assert sorted(HOPPER_FP8_QUERY_SHAPES) == [16, 32, 64]


def test_fp8_query_tile_is_the_narrow_form_up_to_32_rows_and_the_wide_form_with_enough_work():
    from mla_tune.backends.triton_mla.dispatch import fp8_query_tile

    big = dict(batch=128, max_items=16384)
    for heads, q_len, rows in ((1, 1, 16), (15, 1, 16), (16, 1, 64), (8, 2, 64), (20, 1, 64), (32, 1, 64),
                               (33, 1, 64), (20, 2, 64), (64, 1, 64), (128, 2, 64)):
        tile = fp8_query_tile(num_heads=heads, q_len=q_len, **big)
        assert tile.fp8_query and tile.warp_specialized and tile.block_h == rows, (heads, q_len, tile)
    # rows x batch x the longest request: from 2^21 with 128 heads (from batch 16 at 1k tokens, 4 at 4k, 1 at 16k),
    # from 2^22 with 64 (from batch 64 at 1k, 16 at 4k, 4 at 16k), from 2^19 with 32 (batch 16 at 1k, 1 at 16k); four
    # slots and the scores ahead from 2^25 (64 heads at batch 32, 16k tokens; 32 heads from batch 64 at 16k); 16
    # heads from 2^22 too (batch 64 at 4k, 16 at 16k)
    for heads, batch, max_items, rows, slots in (
            (16, 64, 4096, 64, 3), (16, 16, 16384, 64, 3), (16, 32, 4096, 16, 3), (16, 128, 1024, 16, 3),
            (16, 128, 16384, 64, 4),
            (64, 128, 1024, 64, 3), (64, 64, 1024, 64, 3), (64, 32, 1024, 32, 3), (64, 16, 4096, 64, 3),
            (64, 8, 4096, 32, 3), (64, 4, 16384, 64, 3), (64, 2, 16384, 32, 3), (64, 16, 2048, 32, 3),
            (128, 1, 16384, 64, 3), (128, 4, 4096, 64, 3), (128, 2, 4096, 32, 3), (128, 16, 1024, 64, 3),
            (128, 8, 1024, 32, 3), (32, 16, 8192, 64, 3), (32, 16, 4096, 64, 3), (32, 64, 1024, 64, 3),
            (32, 16, 1024, 64, 3), (32, 1, 16384, 64, 3), (32, 8, 1024, 32, 3), (32, 1, 8192, 32, 3),
            (32, 128, 1024, 64, 3), (32, 32, 16384, 64, 3),
            (64, 64, 16384, 64, 4), (128, 128, 4096, 64, 4), (128, 16, 16384, 64, 4), (64, 16, 16384, 64, 3),
            (64, 32, 16384, 64, 4), (128, 64, 2048, 64, 3), (32, 64, 16384, 64, 4), (20, 128, 16384, 64, 4),
            (20, 64, 4096, 64, 3), (20, 16, 4096, 64, 3), (20, 4, 4096, 32, 3)):
        tile = fp8_query_tile(num_heads=heads, q_len=1, batch=batch, max_items=max_items)
        assert (tile.block_h, tile.num_stages) == (rows, slots), (heads, batch, max_items, tile)
    # the dispatch gives it whatever the shape; the tuner's refinement also times the other forms from 16 rows,
    # and otherwise varies its splits only
    from mla_tune.backends.triton_mla.dispatch import candidate_tiles, default_tile

    for heads, batch, other in ((64, 128, 32), (64, 1, 64), (32, 128, 64), (20, 128, 64), (16, 128, 16),
                                (15, 128, None)):
        facts = dict(num_heads=heads, q_len=1, batch=batch, max_items=16384, kv_fp8=True, cc_major=9)
        default = fp8_query_tile(num_heads=heads, q_len=1, batch=batch, max_items=16384)
        assert default_tile(**facts, fp8_query=True) == default
        tiles = candidate_tiles(**facts, fp8_query=True)
        assert tiles[0] == default and len(tiles) > 1 and all(t.fp8_query for t in tiles)
        forms = {t.replace(min_split_tokens=0) for t in tiles}
        # from 16 rows all three forms: the narrow form (16 rows, or 32-row blocks), the wide form with three slots
        # and with four
        assert {(t.block_h, t.num_stages) for t in forms} == ({(16 if heads <= 16 else 32, 3), (64, 3),
                                                               (64, 4)} if other else
                                                              {(default.block_h, default.num_stages)}), tiles
        assert not any(t.fp8_query for t in candidate_tiles(**facts))


def test_the_wide_forms_p_v_products_take_the_launchs_rows_bucket():
    from mla_tune.backends.triton_mla.config import LaunchParams
    from mla_tune.backends.triton_mla.dispatch import fp8_query_form_tile, hopper_constexprs

    wide = LaunchParams(**fp8_query_form_tile("wide").launch_fields())
    narrow = LaunchParams(**fp8_query_form_tile("narrow", 16).launch_fields())
    for rows, pv_rows in ((1, 16), (16, 16), (17, 32), (20, 32), (32, 32), (33, 64), (64, 64), (128, 64),
                          (None, 64)):
        const = hopper_constexprs(wide, kv_fp8=True, sparse=False, query_rows=rows)
        assert const["PV_ROWS"] == pv_rows, rows
        assert const["SCORES_T"] == (pv_rows == 16), rows   # the scores transposed at 16 rows only (measured)
        assert const["HALF_ROWS"] == (pv_rows == 32), rows  # the softmax over the 32 rows alone (measured)
        assert const["ROW_AHEAD"]
    const = hopper_constexprs(narrow, kv_fp8=True, sparse=False, query_rows=16)
    assert const["PV_ROWS"] == 64 and not const["SCORES_T"] and not const["ROW_AHEAD"]  # not its switches
    assert not const["HALF_ROWS"]


def _warp_stores(layout, element_bytes: int, vector: int) -> list[list[int]]:
    """Per warp store instruction of a distributed linear layout over a row-major `[rows, 512]` output: the byte
    addresses each of its 32 lanes writes (`vector` adjacent registers a store), warp 0."""
    def offset(bits, bases):
        row = col = 0
        for i, (r, c) in enumerate(bases):
            if bits >> i & 1:
                row, col = row ^ r, col ^ c
        return row, col

    n_regs = 1 << len(layout.reg_bases)
    stores = []
    for first in range(0, n_regs, vector):
        lanes = []
        for lane in range(32):
            lr, lc = offset(lane, layout.lane_bases)
            for reg in range(first, first + vector):
                rr, rc = offset(reg, layout.reg_bases)
                lanes.append(((lr ^ rr) * 512 + (lc ^ rc)) * element_bytes)
        stores.append(lanes)
    return stores


# fp32 partials take the partial layout and bf16 outputs the store layout (whose fp32 stores would fill half sectors),
# of 64 rows or of the 16 or 32 the p @ v products keep where the launch packs no more
@pytest.mark.parametrize("name,rows,element_bytes,whole", [
    ("partial", 16, 4, True), ("store", 64, 2, True), ("store", 32, 2, True), ("store", 16, 2, True),
    ("store", 64, 4, False)])
def test_the_wide_forms_output_stores_fill_whole_sectors(name, rows, element_bytes, whole):
    from mla_tune.backends.triton_mla import hopper_fp8_query_wide

    layout = (hopper_fp8_query_wide._O_T_PARTIAL_LAYOUT.value if name == "partial"
              else hopper_fp8_query_wide._o_t_store_layout(rows))
    assert layout.shape == [rows, 256]
    vector = 16 // element_bytes  # 16-byte stores: the thread's first registers are adjacent columns
    assert layout.reg_bases[:vector.bit_length() - 1] == [[0, 1 << i] for i in range(vector.bit_length() - 1)]
    written = set()
    for addresses in _warp_stores(layout, element_bytes, vector):
        sectors = {a // 32 for a in addresses}
        assert (len(sectors) * 32 == len(addresses) * element_bytes) == whole, (name, sorted(sectors))
        written.update(addresses)
    assert len(written) == 32 << len(layout.reg_bases)  # every element of warp 0's once
    assert {a // (512 * element_bytes) for a in written} == set(range(rows))  # warp 0: every row, 64 columns


@pytest.mark.parametrize("kv", ["bf16", "fp8_ds_mla"])
def test_the_launcher_refuses_fp8_query_without_an_e4m3_cache(kv):
    from mla_tune.backends.triton_mla import LaunchParams, mla_decode

    problem = Problem(num_heads=16, kv_cache_dtype="fp8_e4m3" if kv == "fp8_ds_mla" else kv, page_size=64)
    inputs = make_inputs(problem, Shape(2, 100))
    kv_cache, kv_scale = inputs.kv_cache, inputs.kv_scale
    if kv == "fp8_ds_mla":
        from mla_tune.backends.vllm_kernels.flashmla import pack_fp8_ds_mla

        kv_cache, kv_scale = pack_fp8_ds_mla(inputs.kv_cache, inputs.kv_scale), None
    params = LaunchParams(block_h=16, block_n=64, num_warps=4, num_stages=3, warp_specialized=True, fp8_query=True)
    with pytest.raises(ValueError, match="needs a float8_e4m3fn cache"):
        mla_decode(inputs.q, kv_cache, inputs.block_table, inputs.seq_lens, sm_scale=inputs.sm_scale,
                   kv_scale=kv_scale, params=params)


def test_kv_descriptors_read_the_cache_rows_as_one_matrix_in_a_tiles_boxes():
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from mla_tune.backends.triton_mla.launcher import kv_descriptors

    cache = torch.zeros(10, 64, 576, dtype=torch.float8_e4m3fn)
    lat, rope = kv_descriptors(cache, 64)
    assert (lat.shape, lat.strides, lat.block_shape) == ([4, 640, 128], [128, 576, 1], [4, 64, 128])
    assert (rope.shape, rope.strides, rope.block_shape) == ([640, 576], [576, 1], [64, 64])
    assert lat.layout.swizzle_byte_width == 128 and rope.layout.swizzle_byte_width == 64
    # pages of 16 rows: four pages a tile, a box per page and 128 latent columns
    lat, rope = kv_descriptors(torch.zeros(10, 16, 576, dtype=torch.float8_e4m3fn), 64)
    assert (lat.shape, lat.block_shape, rope.block_shape) == ([160, 576], [16, 128], [16, 64])
    # the wide form's p @ v warpgroups copy half the latent columns each: [2, 64, 128] boxes
    assert kv_descriptors(cache, 64, col_blocks=2)[0].block_shape == [2, 64, 128]
    # rows of a wider buffer (vLLM's fp8_ds_mla-sized rows): the row stride is the buffer's
    wide_rows = torch.zeros(10, 64, 656, dtype=torch.float8_e4m3fn)[:, :, :576]
    assert kv_descriptors(wide_rows, 64)[1].strides == [656, 1]


@pytest.mark.parametrize("cache", [
    lambda: torch.zeros(10, 64, 576, dtype=torch.float8_e4m3fn)[::2],  # pages not back to back
    lambda: torch.zeros(10, 64, 577, dtype=torch.float8_e4m3fn)[:, :, 1:],  # rows not 16-byte aligned
    lambda: torch.zeros(10, 1, 576, dtype=torch.float8_e4m3fn),  # a page of one row
    lambda: torch.zeros(10, 24, 576, dtype=torch.float8_e4m3fn),  # pages that do not divide a tile
], ids=["page-stride", "unaligned", "page-1", "page-24"])
def test_kv_descriptors_are_none_where_tma_cannot_read_the_cache_that_way(cache):
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from mla_tune.backends.triton_mla.launcher import kv_descriptors

    assert kv_descriptors(cache(), 64) is None


ROUNDING_CASES = {"h3-q2": (3, 2), "h64": (64, 1), "h20": (20, 1)}  # heads, q_len


def _rounding_case(heads: int, q_len: int) -> dict:
    """`round_query` against its torch reference: random rows at scales far apart, one row of zeros, a query that is
    a view into a wider buffer (row strides that are not 576)."""
    from mla_tune.backends.triton_mla.query_e4m3 import round_query, round_query_reference

    gen = torch.Generator().manual_seed(3)
    batch = 5
    wide = torch.randn(batch, q_len, heads, 600, generator=gen) * torch.logspace(-3, 3, heads)[None, None, :, None]
    q = wide[..., 7:583].to(torch.bfloat16)
    q[1, 0, 0] = 0
    q8 = torch.empty(batch, q_len, heads, 576, dtype=torch.float8_e4m3fn)
    q_amax = torch.empty(batch, q_len, heads)
    round_query(q, q8, q_amax)
    ref8, ref_amax = round_query_reference(q)
    scaled = q_amax != 1.0
    got, want = q8.float(), ref8.float()
    # Triton's interpreter emulates the e4m3 rounding from the first dropped bit alone (ties away from zero, not to
    # even) and without its carry into the exponent (a value that rounds up to a power of two comes out as half of
    # it); the GPU test below holds the compiled kernel's bytes to torch's (one e4m3 step apart at most where a
    # scale's last bit differs, on fewer than 1 in 1000 values)
    step = 2.0 ** (torch.floor(torch.log2(want.abs().clamp(min=2.0 ** -6))) - 3)
    dropped_carry = got == torch.sign(want) * 2.0 ** torch.floor(torch.log2(want.abs() + step)) / 2
    return {"e4m3_within_the_interpreters_rounding": bool((((got - want).abs() <= step) | dropped_carry).all()),
            "amax_equal": bool(torch.equal(q_amax, ref_amax)), "zero_row_factor": float(q_amax[1, 0, 0]),
            "row_max_448": bool((got.abs().amax(-1)[scaled] == 448.0).all())}


def _worker() -> None:
    """Subprocess entry: the CPU kernel cases under TRITON_INTERPRET=1, as one JSON line."""
    import json

    print(json.dumps({name: _rounding_case(*case) for name, case in ROUNDING_CASES.items()}))


@pytest.fixture(scope="module")
def interpreted_results():
    from interpreted import interpreted_worker

    return interpreted_worker(__file__, timeout_s=600)


@pytest.mark.parametrize("case", sorted(ROUNDING_CASES))
def test_the_query_rounding_kernel_matches_torch_up_to_the_interpreters_rounding(interpreted_results, case):
    # the real Triton interpreter (the GPU test below runs it compiled); each row's largest magnitude rounds to
    # e4m3's largest, a row of zeros keeps the factor 1
    assert interpreted_results[case] == {"e4m3_within_the_interpreters_rounding": True, "amax_equal": True,
                                         "zero_row_factor": 1.0, "row_max_448": True}


def test_the_query_rounding_refuses_buffers_of_another_shape_or_type():
    from mla_tune.backends.triton_mla.query_e4m3 import round_query

    q = torch.zeros(2, 1, 4, 576, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q8 must be"):
        round_query(q, torch.empty(2, 1, 4, 576, dtype=torch.bfloat16), torch.empty(2, 1, 4))
    with pytest.raises(ValueError, match="q_amax must be"):
        round_query(q, torch.empty(2, 1, 4, 576, dtype=torch.float8_e4m3fn), torch.empty(2, 4))


def test_a_wide_fp8_query_launch_keeps_its_rounded_query_in_the_workspace():
    from mla_tune.backends.triton_mla import LaunchParams
    from mla_tune.backends.triton_mla.workspace import Workspace

    def workspace(block_h, **fields):
        params = LaunchParams(block_h=block_h, block_n=64, num_warps=4, warp_specialized=True, num_splits=1,
                              **fields)
        return Workspace.for_launch(params, batch=3, q_len=2, num_heads=50, sparse=False, device="cpu")

    ws = workspace(64, num_stages=3, fp8_query=True)
    assert ws.o_part is None and ws.q8.shape == (3, 2, 50, 576) and ws.q8.dtype == torch.float8_e4m3fn
    assert ws.q_amax.shape == (3, 2, 50) and ws.q_amax.is_contiguous()
    # the narrow form rounds its rows in each program; the other forms multiply a 16-bit query
    assert workspace(32, num_stages=3, fp8_query=True) is None and workspace(16, num_stages=2) is None


def test_the_launcher_refuses_fp8_query_on_a_sparse_problem():
    from mla_tune.backends.triton_mla import LaunchParams, mla_decode

    inputs = make_inputs(Problem(num_heads=16, kv_cache_dtype="fp8_e4m3", page_size=64, topk=64), Shape(2, 100))
    params = LaunchParams(block_h=16, block_n=64, num_warps=4, num_stages=3, warp_specialized=True, fp8_query=True)
    with pytest.raises(ValueError, match="dense decode only"):
        mla_decode(inputs.q, inputs.kv_cache, inputs.block_table, inputs.seq_lens, sm_scale=inputs.sm_scale,
                   kv_scale=inputs.kv_scale, topk_indices=inputs.topk_indices, params=params)


def test_the_fp8_query_backend_is_its_own_candidate_on_hopper_fp8_dense():
    from mla_tune.backends.registry import BACKENDS, backend_reasons
    from mla_tune.tuner.gate import quantizes_query, rel_error_limit

    fp8 = Problem(num_heads=64, kv_cache_dtype="fp8_e4m3", page_size=64)
    assert backend_reasons("MLA_TUNE_TRITON_FP8Q", fp8, H100) == []
    assert quantizes_query("MLA_TUNE_TRITON_FP8Q", "fp8_e4m3") and not quantizes_query("MLA_TUNE_TRITON", "fp8_e4m3")
    assert rel_error_limit("fp8_e4m3", fp8_query=True) > rel_error_limit("fp8_e4m3")
    assert BACKENDS["MLA_TUNE_TRITON_FP8Q"].capabilities.candidate
    refused = [(Problem(num_heads=64, kv_cache_dtype="bf16", page_size=64), H100),
               (Problem(num_heads=64, kv_cache_dtype="fp8_e4m3", page_size=64, topk=2048), H100),
               (fp8, DeviceSpec("NVIDIA A100-SXM4-80GB", (8, 0))),
               (fp8, DeviceSpec("NVIDIA B200", (10, 0)))]
    for problem, device in refused:
        assert backend_reasons("MLA_TUNE_TRITON_FP8Q", problem, device), (problem, device)


def test_no_engine_is_handed_the_fp8_query_backend_even_where_it_wins():
    from mla_tune.backends.engine_names import engine_name, rank_for_engine

    for engine in ("vllm", "sglang"):
        assert engine_name("MLA_TUNE_TRITON_FP8Q", engine, with_plugin=True) is None
    ranked = rank_for_engine({"MLA_TUNE_TRITON_FP8Q": 9.0, "FLASHMLA": 1.0}, "vllm", with_plugin=True)
    assert [ours for ours, _, _ in ranked] == ["FLASHMLA"]


@pytest.mark.slow
@pytest.mark.parametrize("rows,q_len", [(16, 1), (32, 1), (32, 2)])
def test_the_fp8_query_form_compiles_to_e4m3_wgmma_without_casting_the_tiles(rows, q_len):
    from offline_compile import hopper_compile

    from mla_tune.backends.triton_mla.hopper import hopper_smem_bytes

    ptx, smem, report = hopper_compile(kv="fp8", rows=rows, q_len=q_len, FP8_QUERY=True, STAGES=3)
    # per tile: the scores 2 + 16 k-steps of 32 (rope, latent), o^T = v^T p^T 8 m-blocks x 2 k-steps; nothing in fp16
    mmas = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k\d+)\.f32\.(\w+)\.(\w+)", ptx)
    assert mmas and set(mmas) == {(f"m64n{rows}k32", "e4m3", "e4m3")} and len(mmas) == 34, mmas[:3]
    # the loaders copy e4m3 bytes (cp.async) and store v^T with stmatrix (their read-back layout's purpose: four-way
    # conflicted 32-bit stores otherwise); the only e4m3 -> fp16 casts are p's, for the row sums (16 or 8 values a
    # thread, two a cast)
    assert "cp.async.cg.shared.global" in ptx and len(re.findall(r"stmatrix\.sync\.aligned\.m8n8\.x4", ptx)) == 32
    assert len(re.findall(r"cvt\.rn\.f16x2\.e4m3x2", ptx)) == rows // 4
    # three slots of e4m3 tokens and their v^T
    assert hopper_smem_bytes(block_n=64, stages=3, rows=rows, fp8_query=True) <= smem <= 227 * 1024, smem
    # none with Triton 3.6 (what the GPU runs), 8 bytes with 3.9
    assert sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", report)) <= 64, report


@pytest.mark.slow
@pytest.mark.parametrize("q_len,slots", [(1, 3), (2, 3), (1, 4), (2, 4)])
def test_the_wide_fp8_query_form_compiles_to_a_scorer_and_two_p_v_warpgroups(q_len, slots):
    from offline_compile import hopper_compile

    from mla_tune.backends.triton_mla.config import FP8_QUERY_WIDE_PV_REGS
    from mla_tune.backends.triton_mla.hopper import hopper_smem_bytes

    # a launch with split partials (the helper's fp32 output)
    ptx, smem, report = hopper_compile(kv="fp8", rows=64, q_len=q_len, FP8_QUERY=True, TMA_KV=True, STAGES=slots,
                                       SCORES_AHEAD=slots == 4, MMA_REGS=FP8_QUERY_WIDE_PV_REGS)
    # the scorer: 2 + 16 k-steps of m64n64k32 (rope, latent) a tile, the query from shared memory; each p @ v
    # warpgroup: 4 M blocks x 2 k-steps of m64n64k32 with v^T's four 32-bit registers of e4m3 as the A operand
    mmas = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k\d+)\.f32\.(\w+)\.(\w+)", ptx)
    register_a = re.findall(r"wgmma\.mma_async[^\n]*\}, \{%r\d+,%r\d+,%r\d+,%r\d+\}", ptx)
    assert set(mmas) == {("m64n64k32", "e4m3", "e4m3")} and len(mmas) == 18 + 2 * 8, mmas[:3]
    assert len(register_a) == 2 * 8
    # whole tiles go by TMA, as two 3-d boxes of half the latent columns and a 2-d one of the rope: the scorer
    # copies the first `slots` tiles, each p @ v warpgroup its half of every later one (the first with the rope);
    # the scorer copies a partial tile by cp.async; no v^T goes through shared memory
    assert _tma_copies(ptx) == {"3d": 2 * slots + 2, "2d": slots + 1} and "cp.async.cg.shared.global" in ptx
    assert "stmatrix" not in ptx
    # each p @ v thread's 128 partial values as 32 16-byte stores, after a lane-pair shuffle of half of them
    assert len(re.findall(r"st\.global[^\n]*\.v4\.b32", ptx)) == 2 * 32
    assert len(re.findall(r"shfl\.sync", ptx)) >= 2 * 64
    # 12 warps at 168 registers: the p @ v warpgroups' 128-register accumulators fit
    assert re.search(r"\.maxnreg 168", ptx) and ".reqntid 384" in ptx
    assert hopper_smem_bytes(block_n=64, stages=slots, rows=64, fp8_query=True) <= smem <= 227 * 1024, smem
    # Triton 3.6 (what the GPU runs): at most 8 bytes, none inside a loop; none with 3.9
    assert sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", report)) <= 8, report


@pytest.mark.slow
@pytest.mark.parametrize("slots", [3, 4])
def test_the_wide_fp8_query_form_scores_16_rows_transposed(slots):
    from offline_compile import hopper_compile

    from mla_tune.backends.triton_mla.config import FP8_QUERY_WIDE_PV_REGS, LaunchParams
    from mla_tune.backends.triton_mla.dispatch import fp8_query_form_tile, hopper_constexprs

    params = LaunchParams(**fp8_query_form_tile("wide").launch_fields())
    form = hopper_constexprs(params, kv_fp8=True, sparse=False, query_rows=16)
    ptx, _, report = hopper_compile(kv="fp8", rows=64, FP8_QUERY=True, TMA_KV=True, STAGES=slots,
                                    SCORES_AHEAD=slots == 4, MMA_REGS=FP8_QUERY_WIDE_PV_REGS,
                                    PV_ROWS=form["PV_ROWS"], SCORES_T=form["SCORES_T"])
    # the scorer: 2 + 16 k-steps of m64n16k32 a tile (tokens on M, the 16 rows on N; with the rows on M, m64n64k32);
    # each p @ v warpgroup 4 M blocks x 2 k-steps of m64n16k32, v^T in registers
    mmas = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k\d+)\.f32\.(\w+)\.(\w+)", ptx)
    register_a = re.findall(r"wgmma\.mma_async[^\n]*\}, \{%r\d+,%r\d+,%r\d+,%r\d+\}", ptx)
    assert set(mmas) == {("m64n16k32", "e4m3", "e4m3")} and len(mmas) == 18 + 2 * 8 and len(register_a) == 2 * 8
    assert sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", report)) == 0, report


@pytest.mark.slow
def test_the_wide_fp8_query_forms_softmax_takes_32_packed_rows_alone():
    from offline_compile import hopper_compile

    from mla_tune.backends.triton_mla.config import FP8_QUERY_WIDE_PV_REGS

    def compiled(half_rows):
        return hopper_compile(kv="fp8", rows=64, FP8_QUERY=True, TMA_KV=True, MMA_REGS=FP8_QUERY_WIDE_PV_REGS,
                              PV_ROWS=32, HALF_ROWS=half_rows)

    (half, _, report), (every, _, _) = compiled(True), compiled(False)
    # the scores still m64n64k32 with the rows on M; the softmax's exp2 over 32 rows (each thread's first row of the
    # two the accumulator gives it), not 64, in the loop and after it: half the ex2
    mmas = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k\d+)\.f32", half))
    assert mmas == {"m64n64k32", "m64n32k32"} and half.count("ex2.approx") * 2 == every.count("ex2.approx")
    assert sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", report)) == 0, report


def _tma_copies(ptx: str) -> dict:
    """TMA copies into shared memory in `ptx`, by their box's rank (Triton 3.9 writes `shared::cta`, 3.6
    `shared::cluster`)."""
    copies = re.findall(r"cp\.async\.bulk\.tensor\.(\dd)\.shared::(?:cta|cluster)\.global", ptx)
    return {rank: copies.count(rank) for rank in sorted(set(copies))}


@pytest.mark.slow
def test_the_wide_forms_stage1_waits_for_the_rounding_kernel_that_lets_it_start():
    # offline sm_90a compiles: the rounding kernel issues griddepcontrol.launch_dependents (on SM90+; the interpreter
    # has none), and stage 1 on the rounded query one griddepcontrol.wait (before the scorer copies the rows)
    from offline_compile import hopper_compile, round_query_ptx

    assert "griddepcontrol.launch_dependents" in round_query_ptx(LAUNCH_DEPENDENTS=True)
    assert "griddepcontrol" not in round_query_ptx()
    rounded = hopper_compile(kv="fp8", rows=64, FP8_QUERY=True, TMA_KV=True, ROUNDED_QUERY=True)[0]
    assert rounded.count("griddepcontrol.wait") == 1
    assert "griddepcontrol" not in hopper_compile(kv="fp8", rows=64, FP8_QUERY=True, TMA_KV=True,
                                                  ROUNDED_QUERY=False)[0]


@pytest.mark.slow
@pytest.mark.parametrize("rows,page_size,boxes", [(64, 64, {"3d": 10, "2d": 5}), (64, 16, {"2d": 100}),
                                                   (32, 64, {"3d": 2, "2d": 2}), (16, 16, {"2d": 40})])
def test_the_fp8_query_forms_copy_whole_tiles_by_tma(rows, page_size, boxes):
    from offline_compile import hopper_compile

    ptx, _, _ = hopper_compile(kv="fp8", rows=rows, page_size=page_size, FP8_QUERY=True, TMA_KV=True)
    # a page of a tile's 64 rows: one [4, 64, 128] latent box (wide form: two [2, 64, 128] boxes) and one rope box;
    # pages of 16 rows: a box per page and 128 latent columns, and a rope box per page, four pages. The wide form
    # (four slots here) copies at four sites before its loop and in its two p @ v warpgroups, the narrow form's two
    # loaders at one each; a partial tile is copied by cp.async (zeros past the range)
    assert _tma_copies(ptx) == boxes
    assert "cp.async.cg.shared.global" in ptx


# ---------------------------------------------------------------- GPU (Hopper)

def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


hopper_only = pytest.mark.skipif(not _hopper(), reason="the FP8-query form needs an SM90 GPU")
FORMS = tuple(FP8_QUERY_FORMS)


def _forms(rows: int) -> tuple:
    """Every FP8-query form (`_fp8_query_case`'s `form`) from FP8_QUERY_WIDE_MIN_ROWS packed rows, else the
    dispatch's."""
    return FORMS if rows >= FP8_QUERY_WIDE_MIN_ROWS else (None,)


def _round_query_like_the_kernel(q: torch.Tensor) -> torch.Tensor:
    """q with each (token, head) row rounded to e4m3 as the kernels round it (`round_query_reference`: times
    448 / max |row|), scaled back."""
    from mla_tune.backends.triton_mla.query_e4m3 import round_query_reference

    q8, factor = round_query_reference(q)
    return (q8.float() * factor[..., None]).to(q.dtype)


def _rel(a, b) -> float:
    return float(torch.linalg.vector_norm(a.float() - b.float()) / torch.linalg.vector_norm(b.float()))


def _fp8_query_case(heads, q_len, page_size, shape: Shape, lens=None, splits=None, q_mult=1.0,
                    kv_ramp=False, form=None, outputs=False) -> dict:
    """MLA_TUNE_TRITON_FP8Q's kernel on one case against the references; `form` (from FP8_QUERY_WIDE_MIN_ROWS packed
    rows): force the narrow form ("narrow": 32-row blocks, 16 rows up to 16), the wide form with three slots ("wide")
    or four and the scores ahead ("ahead"); None:
    the dispatch's choice; `outputs`: the kernel's (out, lse) under "outputs" too."""
    from mla_tune.backends.triton_mla import mla_decode
    from mla_tune.backends.triton_mla.dispatch import fp8_query_form_tile, fp8_query_tile
    from mla_tune.backends.triton_mla.splits import params_from_tile

    problem = Problem(num_heads=heads, kv_cache_dtype="fp8_e4m3", page_size=page_size, q_len=q_len)
    inputs = make_inputs(problem, shape, device="cuda", seed=11)
    inputs.q = inputs.q * q_mult
    if lens is not None:
        inputs.seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    if kv_ramp:
        _ramp_keys(inputs, page_size)
    lengths = inputs.seq_lens.tolist()
    tile = fp8_query_tile(num_heads=heads, q_len=q_len, batch=shape.batch_size, max_items=max(max(lengths), 1))
    if form is not None:
        tile = fp8_query_form_tile(form, heads * q_len)
    params = params_from_tile(tile, num_heads=heads, q_len=q_len,
                              batch=shape.batch_size, max_items=max(max(lengths), 1), sparse=False, lengths=lengths,
                              num_sms=torch.cuda.get_device_properties(0).multi_processor_count)
    if splits is not None:
        from dataclasses import replace

        params = replace(params, num_splits=splits, split_items=0, longest_first=False)
    out, lse = mla_decode(inputs.q, inputs.kv_cache, inputs.block_table, inputs.seq_lens, sm_scale=inputs.sm_scale,
                          kv_scale=inputs.kv_scale, params=params)
    ref = dict(block_table=inputs.block_table, seq_lens=inputs.seq_lens, sm_scale=inputs.sm_scale,
               kv_scale=inputs.kv_scale)
    ref_out, ref_lse = mla_reference(inputs.q, inputs.kv_cache, **ref)
    rq_out, rq_lse = mla_reference(_round_query_like_the_kernel(inputs.q), inputs.kv_cache, **ref)
    seen = torch.isfinite(ref_lse)
    return {
        "params": params.label(),
        "rel_err": _rel(out[seen], ref_out[seen]),
        "lse_err": float((lse[seen] - ref_lse[seen]).abs().max()),
        "rel_err_rounded_q": _rel(out[seen], rq_out[seen]),
        "lse_err_rounded_q": float((lse[seen] - rq_lse[seen]).abs().max()),
        "rounding_lse_err": float((rq_lse[seen] - ref_lse[seen]).abs().max()),
        "lse_magnitude": float(rq_lse[seen].abs().max()),
        "nan": bool(out.isnan().any() or lse.isnan().any()),
        "unseen_rows_ok": bool((out[~seen] == 0).all() and (lse[~seen] == -math.inf).all()),
        **({"outputs": (out, lse)} if outputs else {}),
    }


def _assert_close(r: dict) -> None:
    from mla_tune.tuner.gate import FP8_QUERY_REL_ERROR_LIMIT

    assert not r["nan"] and r["unseen_rows_ok"], r
    # the lse of a request of one or a few tokens moves by the query's rounding alone (up to ~0.1 here), so the lse
    # is held to what that rounding does plus what p's rounding may add (below)
    assert r["rel_err"] < FP8_QUERY_REL_ERROR_LIMIT and r["lse_err"] < r["rounding_lse_err"] + 0.061, r
    # with the query rounded as the kernel rounds it, what is left is p's rounding to e4m3, which moves the row sums
    # (and so the lse) by at most log(1 + 2^-4) = 0.061
    assert r["rel_err_rounded_q"] < 2e-2 and r["lse_err_rounded_q"] < 0.061, r


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("q_len", [1, 2])
@pytest.mark.parametrize("heads", [1, 3, 16, 20, 64, 128])
@pytest.mark.parametrize("page_size", [16, 64])
def test_gpu_fp8_query_edge_lengths(q_len, heads, page_size):
    # lengths 1, 15, 16, 17, 1000, 0 and two long ones that split, permuted pages, odd head counts; from 16 packed
    # rows the narrow form and both wide forms (16 heads: 48 of the wide form's 64 rows masked)
    lens = [max(n, q_len) if n else 0 for n in (1, 15, 16, 17, 1000, 0)] + [5000, 777]
    for form in _forms(heads * q_len):
        _assert_close(_fp8_query_case(heads, q_len, page_size, Shape(len(lens), 5000), lens=lens, form=form))


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("heads,batch,kv_len", [(16, 1, 32768), (32, 64, 16384), (128, 8, 4096), (64, 3, 3001)])
def test_gpu_fp8_query_long(heads, batch, kv_len):
    for form in _forms(heads):
        _assert_close(_fp8_query_case(heads, 1, 64, Shape(batch, kv_len), form=form))


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("heads,q_len", [(16, 1), (32, 1), (20, 2), (48, 1), (64, 1), (128, 1)])
@pytest.mark.parametrize("splits", [1, None])
def test_gpu_fp8_query_scores_rising_along_the_request(heads, q_len, splits):
    # keys scaled up along each request and a 4x query: a row's max grows tile after tile, so the output and the
    # sums are rescaled again and again. Scores this large make the softmax follow the query's rounding (6-7 % from
    # the float32 reference on an H200, above the gate's limit), so the kernel is held to the reference on the query
    # rounded as it rounds it, and its lse to what p's rounding may move (log(1 + 2^-4))
    lens = [5000, 777, 3001, 64, 17]
    for form in _forms(heads * q_len):
        r = _fp8_query_case(heads, q_len, 64, Shape(len(lens), 5000), lens=lens, splits=splits, q_mult=4.0,
                            kv_ramp=True, form=form)
        assert not r["nan"] and r["unseen_rows_ok"], r
        assert r["rel_err_rounded_q"] < 2e-2 and r["lse_err_rounded_q"] < 0.061, r


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("heads,q_len", [(20, 1), (3, 2), (64, 1), (128, 2)])
def test_gpu_the_rounded_query_gives_what_rounding_in_each_program_gave(heads, q_len):
    # the query rounded once before stage 1 (the forms in dispatch.FP8Q_ROUNDED_QUERY_FORMS) against each program
    # rounding its own rows: the same e4m3 rows and scales, so the same bits out, in every form either way
    from mla_tune.backends.triton_mla import dispatch
    from mla_tune.backends.triton_mla.query_e4m3 import round_query, round_query_reference

    lens = [1, 17, 5000, 777, 0, 3001]
    forms = _forms(heads * q_len)
    for form in forms:
        results = []
        for rounded in (frozenset({"narrow", "fp8_query_wide"}), frozenset()):
            saved, dispatch.FP8Q_ROUNDED_QUERY_FORMS = dispatch.FP8Q_ROUNDED_QUERY_FORMS, rounded
            try:
                results.append(_fp8_query_case(heads, q_len, 64, Shape(len(lens), 5000), lens=lens, form=form,
                                               outputs=True))
            finally:
                dispatch.FP8Q_ROUNDED_QUERY_FORMS = saved
        (out_a, lse_a), (out_b, lse_b) = results[0]["outputs"], results[1]["outputs"]
        assert torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b), form
        _assert_close(results[0])
    q = torch.randn(4, q_len, heads, 576, device="cuda", dtype=torch.bfloat16) * 30
    q[0, 0, 0] = 0
    q8 = torch.empty(q.shape, dtype=torch.float8_e4m3fn, device="cuda")
    q_amax = torch.empty(q.shape[:3], device="cuda")
    round_query(q, q8, q_amax)
    ref8, ref_amax = round_query_reference(q)
    # the kernel divides with PTX's div.full.f32 (within 2 ulp of torch's IEEE division), so a scale may differ in
    # its last bit and move a value that lies on a rounding boundary by one e4m3 step
    got, want = q8.float(), ref8.float()
    step = 2.0 ** (torch.floor(torch.log2(want.abs().clamp(min=2.0 ** -6))) - 3)
    assert torch.allclose(q_amax, ref_amax, rtol=2.5e-7, atol=0) and ((got - want).abs() <= step).all()
    assert (got != want).float().mean() < 1e-3 and q_amax[0, 0, 0] == 1.0


@pytest.mark.gpu
@hopper_only
def test_gpu_fp8_query_one_split_of_many_tiles_and_a_large_query():
    # 47 tiles in one program (the slots wrap their barrier phases), |q| ~ 3e4 (the per-row scale keeps it in e4m3's
    # range); scores of ~1e5 make the softmax follow the query's rounding (28 % from the float32 reference), so the
    # kernel is held to the reference on the query rounded as it rounds it; its lse (~1e5) to 1 % of itself, as the
    # FP8 MMAs accumulate the scores with fewer bits than float32 (786 off at 1e5 on an H200)
    for form in FORMS:
        r = _fp8_query_case(64, 1, 64, Shape(3, 3000), lens=[3000, 17, 2999], splits=1, q_mult=3e4, form=form)
        assert not r["nan"] and r["rel_err_rounded_q"] < 2e-2 and r["lse_err_rounded_q"] < 1e-2 * r["lse_magnitude"], r


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _worker()
