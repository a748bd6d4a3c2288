"""The warp-specialised absorbed-MLA decode kernel for Hopper (SM90), in Gluon (Triton's tile-level dialect).

The portable `tl` kernel (`tl_kernel.py`) has every warp issue the KV loads, wait for them at a CTA-wide barrier and
then compute; `tl` has no way to give loading and computing to different warps. Here they are different warps: a
loader warpgroup streams KV tiles into a ring of shared-memory slots (`hopper_loaders.py`) while MMA warpgroups
compute on the other slot. The kernel has three forms, chosen by the launch shape (`config.LaunchParams.kernel_form`):

- token-split (`hopper_token_split.py`): 64 rows, two MMA warpgroups each scoring half a tile's tokens;
- narrow (`hopper_narrow.py`): 16 or 32 rows, one MMA warpgroup on transposed products;
- qk1 (`hopper_qk1.py`): 64 rows, warpgroup 0 scores the whole tile and hands p to warpgroup 1.

With `FP8_QUERY` (`LaunchParams.fp8_query`, an e4m3 cache) every product runs on e4m3 tensor cores instead, with
slots and loaders of its own: the narrow form for 16-32 rows (`hopper_fp8_query.py`), the wide form for 64
(`hopper_fp8_query_wide.py`: a scorer warpgroup and two p @ v warpgroups, which copy the tiles by TMA).

A program is the same unit as in the tl kernel (packed query rows x one split of the KV range) and writes the same
`(out, lse)` partials, merged by `combine._mla_combine_kernel`. Shared memory: the query (64 x 576 x 2 bytes = 72 KiB)
plus two 64-token slots (144 KiB), 216 KiB: one program per SM (`hopper_common.hopper_smem_bytes`). docs/kernels.md
describes each form and the switches `dispatch.hopper_constexprs` sets.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.language.extra.cuda import gdc_launch_dependents

from mla_tune.backends.triton_mla.hopper_common import (
    LOAD_WARPS, ROWS, KvSource, Program, Ring, _store_query, hopper_smem_bytes)
from mla_tune.backends.triton_mla.hopper_fp8_query import _run_fp8q
from mla_tune.backends.triton_mla.hopper_fp8_query_wide import _run_fp8q_wide
from mla_tune.backends.triton_mla.hopper_narrow import _run_narrow
from mla_tune.backends.triton_mla.hopper_qk1 import _run_qk1
from mla_tune.backends.triton_mla.hopper_token_split import _run_token_split

__all__ = ["_mla_hopper_kernel", "hopper_smem_bytes"]


@gluon.jit
def _mla_hopper_kernel(
    q_ptr, kv_ptr, block_table_ptr, seq_lens_ptr, topk_ptr, kv_scale_ptr,
    o_ptr, lse_ptr,
    sm_scale_log2, kv_scale, q_scale,
    stride_qb, stride_qt, stride_qh,
    stride_kvp, stride_kvt,
    stride_btb,
    stride_tkb, stride_tkt,
    stride_ob, stride_os, stride_ot, stride_oh,
    stride_lb, stride_ls, stride_lt, stride_lh,
    num_heads, topk, split_items,
    Q_LEN: gl.constexpr, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    SPARSE: gl.constexpr, KV_FP8: gl.constexpr, KV_SCALE_IS_PTR: gl.constexpr, LOAD_REGS: gl.constexpr,
    N_ROWS: gl.constexpr = ROWS, STAGED_LOADERS: gl.constexpr = 1, QK1: gl.constexpr = False,
    MMA_REGS: gl.constexpr = 0, PARTIAL_EVICT_LAST: gl.constexpr = False, QUERY_IN_CONSUMER: gl.constexpr = False,
    SPLIT_PER_REQUEST: gl.constexpr = False,
    L2_PREFETCH: gl.constexpr = False, CONSUMER_FENCE: gl.constexpr = True, LOADER_AHEAD: gl.constexpr = False,
    QUERY_REG_COLS: gl.constexpr = 0, DS_MLA: gl.constexpr = False, FP8_QUERY: gl.constexpr = False,
    SCORES_AHEAD: gl.constexpr = False, PV_ROWS: gl.constexpr = ROWS, SCORES_T: gl.constexpr = False,
    ROW_AHEAD: gl.constexpr = False, WARP_FLAGS: gl.constexpr = False,
    HALF_ROWS: gl.constexpr = False, F16_SUMS: gl.constexpr = False,
    order_ptr=None, ORDERED: gl.constexpr = False, kv_lat_desc=None, kv_rope_desc=None, q_amax_ptr=None,
    LAUNCH_COMBINE_EARLY: gl.constexpr = False, POSITIONS_AHEAD: gl.constexpr = False,
    SUMS_UNROUNDED: gl.constexpr = False,
):
    if LAUNCH_COMBINE_EARLY:  # the combine (its programmatic dependent) may start as SMs free up
        gdc_launch_dependents()
    pid_m = gl.program_id(0)
    b = gl.program_id(1)
    split = gl.program_id(2)
    if ORDERED:  # grid (m_blocks, programs): the (request, split) this one runs (splits.launch_order)
        piece = gl.load(order_ptr + b)
        b = piece & 0xFFFF
        split = piece >> 16
    seq_len = gl.load(seq_lens_ptr + b)
    if SPARSE:
        n_items = topk
        topk_row = topk_ptr + b.to(gl.int64) * stride_tkb + (pid_m // gl.cdiv(num_heads, N_ROWS)) * stride_tkt
    else:
        n_items = seq_len
        topk_row = topk_ptr
    if SPLIT_PER_REQUEST:  # this request's size from its length (tl_kernel.split_size); split_items: the shortest
        split_items = gl.maximum(gl.cdiv(gl.cdiv(n_items, gl.num_programs(2)), BLOCK_N) * BLOCK_N, split_items)
    start = split * split_items
    end = gl.minimum(start + split_items, n_items)
    n_tiles = gl.maximum(gl.cdiv(end - start, BLOCK_N), 0)
    # Split 0 always stores (zeros, lse -inf for an empty request); other empty splits store only lse.
    store_o = (start < n_items) | (split == 0)

    if KV_SCALE_IS_PTR:
        kv_scale = gl.load(kv_scale_ptr).to(gl.float32)
    qk_scale = sm_scale_log2 * kv_scale
    if KV_FP8 and not FP8_QUERY:
        qk_scale = qk_scale / q_scale  # the query was scaled by q_scale before its fp16 rounding
    # The MMA warps fence a full slot for wgmma after cp.async (16-bit); FP8 loaders fence their own stores, and the
    # 16-bit TMA loader writes through the async proxy (its partial tile's cp.async it fences itself).
    FENCE_SLOTS: gl.constexpr = CONSUMER_FENCE or (not KV_FP8 and kv_lat_desc is None)
    prog = Program(o_ptr, lse_ptr, topk_row, pid_m, b, split, seq_len, num_heads, start, end, n_tiles, store_o,
                   qk_scale, kv_scale, stride_ob, stride_os, stride_ot, stride_oh, stride_lb, stride_ls, stride_lt,
                   stride_lh, q_ptr, stride_qb, stride_qt, stride_qh, q_scale, q_amax_ptr, Q_LEN, SPARSE, N_ROWS,
                   BLOCK_N, STAGES, KV_FP8, QUERY_IN_CONSUMER, FENCE_SLOTS, PARTIAL_EVICT_LAST)

    bt_row = block_table_ptr + b.to(gl.int64) * stride_btb
    src = KvSource(kv_ptr, bt_row, topk_row, seq_len, start, n_tiles, end, stride_kvp, stride_kvt, BLOCK_N, PAGE_SIZE,
                   SPARSE, KV_FP8, DS_MLA)
    if FP8_QUERY:  # e4m3 products (`hopper_fp8_query*.py`): slots, query and barriers of their own
        gl.static_assert(KV_FP8 and not DS_MLA and not SPARSE, "FP8_QUERY: dense, on an e4m3 cache")
        TMA_KV: gl.constexpr = kv_lat_desc is not None  # the launcher's descriptors (launcher.kv_descriptors)
        if N_ROWS < ROWS:
            _run_fp8q(src, prog, LOAD_REGS, kv_lat_desc, kv_rope_desc, TMA_KV)
        else:
            _run_fp8q_wide(src, prog, MMA_REGS, kv_lat_desc, kv_rope_desc, TMA_KV, SCORES_AHEAD, PV_ROWS, SCORES_T,
                           ROW_AHEAD, HALF_ROWS, F16_SUMS)
    else:
        # The query's shared memory (FP8: scaled by q_scale, then rounded to fp16), filled here by every warp before the
        # partitions start, or (QUERY_IN_CONSUMER) by the MMA warps while the loader already streams KV tiles.
        mma_dtype: gl.constexpr = gl.float16 if KV_FP8 else q_ptr.dtype.element_ty
        smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        q_lat = gl.allocate_shared_memory(mma_dtype, [N_ROWS, 512], smem_layout)
        q_rope = gl.allocate_shared_memory(mma_dtype, [N_ROWS, 64], smem_layout)
        if not QUERY_IN_CONSUMER:
            _store_query(prog, q_lat, q_rope, gl.num_warps())

        k_lat = gl.allocate_shared_memory(mma_dtype, [STAGES, BLOCK_N, 512], smem_layout)
        k_rope = gl.allocate_shared_memory(mma_dtype, [STAGES, BLOCK_N, 64], smem_layout)
        full_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            # 16-bit: every loader thread arrives when its own copies land (by TMA: one arrival, the bytes'); FP8: one
            # arrival per loader after its casts.
            mbarrier.init(full_bars.index(i), count=(STAGED_LOADERS if N_ROWS < ROWS else 1) if KV_FP8
                          else 1 if kv_lat_desc is not None else LOAD_WARPS * 32)
            mbarrier.init(empty_bars.index(i), count=2 if QK1 else 1)
        ring = Ring(k_lat, k_rope, full_bars, empty_bars, STAGES)
        gl.static_assert(kv_lat_desc is None or ((QK1 or N_ROWS < ROWS) and not KV_FP8),
                         "16-bit TMA copies: the qk1 and narrow forms' loader")
        if N_ROWS < ROWS:
            _run_narrow(q_lat, q_rope, ring, src, prog, STAGED_LOADERS, LOAD_REGS, kv_lat_desc, kv_rope_desc)
        elif QK1:
            _run_qk1(q_lat, q_rope, ring, src, prog, L2_PREFETCH, LOADER_AHEAD, QUERY_REG_COLS, MMA_REGS, LOAD_REGS,
                     WARP_FLAGS, kv_lat_desc, kv_rope_desc, POSITIONS_AHEAD, SUMS_UNROUNDED)
        else:
            _run_token_split(q_lat, q_rope, ring, src, prog, L2_PREFETCH, LOADER_AHEAD, LOAD_REGS)
