"""Register-fed narrow FP8 form of the Hopper kernel (round 65; measurement only, `launch.REGISTER_FED`).

The narrow FP8 form (`hopper._mma_partition_narrow` with `hopper._load_partition_staged`) moves each 64-token tile
through shared memory three times after HBM: `cp.async` into a staging ring, the loader's read-back and fp16 stores
into a slot, and the MMA warps' wgmma operand reads of that slot (the score's `k` and `p @ v`'s `v^T`, both wgmma's A
operand there). Device call 255 put the FP8 forms at 82-84% of the L1/TEX pipe with DRAM at 53% (bench/TRITON_NOTES.md).

Here one warpgroup does it all, with no fp16 copy of the tile: `cp.async` brings the e4m3 bytes into a ring of
`STAGES` tiles (16 bytes a thread, one commit group a tile, `STAGES - 1` tiles ahead), and the warpgroup reads them
back straight into wgmma's A-operand registers, casts them to fp16 there and multiplies:

- scores `s^T = k q^T`: wgmma's A fragment gives a thread two token rows and, of every 16 columns, the four at
  `2c, 2c + 1, 2c + 8, 2c + 9` (`c` = lane % 4). The contraction's order is free, so logical column `k` of a
  128-column segment is byte `m(k)` of the cached row, chosen so that each thread's bytes are 32 contiguous ones
  (`_score_operand`); the query is stored with the same permutation (`_store_query_permuted`).
- `o^T = v^T p^T`: A is `v^T` (latent rows, tokens as the contraction). The latent order is free too (it is
  undone when the output is stored, `_latent_of_row`), so each thread's 16 rows of `v^T` are 16 contiguous bytes of
  one token (`_value_operand`).

The staging ring is XOR-swizzled by 16-byte chunk (`SwizzledSharedLayout(16, 1, 8)`), which keeps both read-backs
free of bank conflicts. Dense and sparse caches, `q_len` 1-4, 16 or 32 rows, any page size: rows are looked up per
token as in `hopper._tile_rows`.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy, fence_async_shared, warpgroup_mma, warpgroup_mma_wait)

from mla_tune.backends.triton_mla.hopper import (
    _cast_e4m3, _copy_tile, _inv_sums, _lse, _rows, _store_out, _tile_positions, _tile_rows)

WARPS = gl.constexpr(4)
thread_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier  # Triton 3.6 / 3.7


def _score_load_layout(width: int) -> gl.DistributedLinearLayout:
    """`[64 tokens, width bytes]` of a staged tile as the score's A fragment wants them, before the column permutation:
    a thread holds `width // 4` contiguous bytes of each of its two token rows (16w + lane // 4 and 8 below it)."""
    per_thread = width // 4
    reg = [[0, 1 << i] for i in range(per_thread.bit_length() - 1)] + [[8, 0]]
    lane = [[0, per_thread], [0, 2 * per_thread], [1, 0], [2, 0], [4, 0]]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lane, warp_bases=[[16, 0], [32, 0]], block_bases=[],
                                      shape=[64, width])


def _value_load_layout() -> gl.DistributedLinearLayout:
    """`[16 tokens, 512 bytes]` (one k-step of `p @ v`) as `v^T`'s A fragment wants them, before the row permutation:
    a thread holds 16 contiguous latent bytes (16 x (lane // 4 + 8 x warp)) of its four tokens (2 x (lane % 4), +1,
    +8, +9)."""
    reg = [[0, 1], [0, 2], [0, 4], [0, 8], [1, 0], [8, 0]]
    lane = [[2, 0], [4, 0], [0, 16], [0, 32], [0, 64]]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lane, warp_bases=[[0, 128], [0, 256]],
                                      block_bases=[], shape=[16, 512])


SCORE_LOAD_128 = gl.constexpr(_score_load_layout(128))
SCORE_LOAD_64 = gl.constexpr(_score_load_layout(64))
VALUE_LOAD = gl.constexpr(_value_load_layout())


@gluon.jit
def _score_operand(staged, a_layout: gl.constexpr, load_layout: gl.constexpr, WIDTH: gl.constexpr,
                   CAST_BITS: gl.constexpr = 0, CHUNK: gl.constexpr = 0):
    """A `[64, WIDTH]` segment of staged e4m3 bytes as the score wgmma's fp16 A operand: logical column
    `k = 16 j + 8 h + 2 c + e` is byte `m = (WIDTH // 4) c + 4 j + 2 h + e` of the segment."""
    x = _cast_e4m3(staged.load(load_layout), CAST_BITS, CHUNK)
    x = x.reshape(64, 4, WIDTH // 16, 2, 2).permute(0, 2, 3, 1, 4).reshape(64, WIDTH)
    return gl.convert_layout(x, a_layout)


@gluon.jit
def _value_operand(staged, a_layout: gl.constexpr, CAST_BITS: gl.constexpr = 0, CHUNK: gl.constexpr = 0):
    """Sixteen staged tokens' latent bytes `[16, 512]` as `v^T`'s fp16 A operand `[512, 16]`: logical row
    `r = 64 i + 16 w + 8 e + l` is latent column `128 w + 16 l + 2 i + e` (`_latent_of_row`)."""
    y = _cast_e4m3(staged.load(VALUE_LOAD), CAST_BITS, CHUNK).permute(1, 0)
    y = y.reshape(4, 8, 8, 2, 16).permute(2, 0, 3, 1, 4).reshape(512, 16)
    return gl.convert_layout(y, a_layout)


@gluon.jit
def _latent_of_row(r):
    """The latent column of `o^T`'s logical row `r` (`_value_operand`'s permutation)."""
    return ((r >> 4) & 3) * 128 + (r & 7) * 16 + (r >> 6) * 2 + ((r >> 3) & 1)


@gluon.jit
def _query_column(k, WIDTH: gl.constexpr):
    """The byte (query column) of a `WIDTH`-column segment that the score's logical column `k` multiplies."""
    return ((k >> 1) & 3) * (WIDTH // 4) + (k >> 4) * 4 + ((k >> 3) & 1) * 2 + (k & 1)


@gluon.jit
def _store_query_permuted(q_ptr, q_lat, q_rope, pid_m, b, num_heads, stride_qb, stride_qt, stride_qh, q_scale,
                          Q_LEN: gl.constexpr, SPARSE: gl.constexpr, N_ROWS: gl.constexpr, SEG: gl.constexpr):
    """The query's rows, scaled by `q_scale` and rounded to fp16, into `q_lat` / `q_rope` with the score's column
    permutation (per `SEG`-column latent segment, `_query_column`). Fenced for wgmma."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    qi, h, row_ok = _rows(pid_m, num_heads, gl.SliceLayout(1, layout), Q_LEN, SPARSE, N_ROWS)
    q_row = q_ptr + b.to(gl.int64) * stride_qb + qi * stride_qt + h * stride_qh
    k = gl.arange(0, 512, layout=gl.SliceLayout(0, layout))
    lat_cols = (k // SEG) * SEG + _query_column(k % SEG, SEG)
    lat = gl.load(q_row[:, None] + lat_cols[None, :], mask=row_ok[:, None], other=0.0)
    kr = gl.arange(0, 64, layout=gl.SliceLayout(0, layout))
    rope = gl.load(q_row[:, None] + 512 + _query_column(kr, 64)[None, :], mask=row_ok[:, None], other=0.0)
    q_lat.store((lat.to(gl.float32) * q_scale).to(gl.float16))
    q_rope.store((rope.to(gl.float32) * q_scale).to(gl.float16))
    fence_async_shared()


@gluon.jit
def _mla_regfed_kernel(
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
    Q_LEN: gl.constexpr, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, SPARSE: gl.constexpr,
    KV_SCALE_IS_PTR: gl.constexpr, N_ROWS: gl.constexpr, STAGES: gl.constexpr, EVICT_LAST: gl.constexpr = False,
    SEG: gl.constexpr = 128, PV_OUTSTANDING: gl.constexpr = 0, CAST_BITS: gl.constexpr = 0,
):
    gl.static_assert(BLOCK_N == 64, "the register-fed form reads 64-token tiles")
    gl.static_assert(STAGES >= 2, "the register-fed form needs a tile in flight")
    pid_m = gl.program_id(0)
    b = gl.program_id(1)
    split = gl.program_id(2)
    seq_len = gl.load(seq_lens_ptr + b)
    if SPARSE:
        n_items = topk
        topk_row = topk_ptr + b.to(gl.int64) * stride_tkb + (pid_m // gl.cdiv(num_heads, N_ROWS)) * stride_tkt
    else:
        n_items = seq_len
        topk_row = topk_ptr
    start = split * split_items
    end = gl.minimum(start + split_items, n_items)
    n_tiles = gl.maximum(gl.cdiv(end - start, BLOCK_N), 0)
    store_o = (start < n_items) | (split == 0)  # as in hopper._mla_hopper_kernel
    if KV_SCALE_IS_PTR:
        kv_scale = gl.load(kv_scale_ptr).to(gl.float32)
    qk_scale = sm_scale_log2 * kv_scale / q_scale

    nvmma: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_lat = gl.allocate_shared_memory(gl.float16, [N_ROWS, 512], nvmma)
    q_rope = gl.allocate_shared_memory(gl.float16, [N_ROWS, 64], nvmma)
    p_smem = gl.allocate_shared_memory(gl.float16, [N_ROWS, BLOCK_N], nvmma)
    kv_dtype: gl.constexpr = kv_ptr.dtype.element_ty
    stage_lat = gl.allocate_shared_memory(kv_dtype, [STAGES, BLOCK_N, 512], gl.SwizzledSharedLayout(16, 1, 8, [1, 0]))
    stage_rope = gl.allocate_shared_memory(kv_dtype, [STAGES, BLOCK_N, 64], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))

    bt_row = block_table_ptr + b.to(gl.int64) * stride_btb
    copy_layout: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [WARPS, 1], [1, 0])
    for i in gl.static_range(STAGES - 1):
        row, ok = _tile_rows(start + i * BLOCK_N, end, seq_len, topk_row, bt_row, kv_ptr, stride_kvp, stride_kvt,
                             copy_layout, BLOCK_N, PAGE_SIZE, SPARSE)
        _copy_tile(stage_lat.index(i), stage_rope.index(i), row, ok, copy_layout)
        async_copy.commit_group()
    _store_query_permuted(q_ptr, q_lat, q_rope, pid_m, b, num_heads, stride_qb, stride_qt, stride_qh, q_scale,
                          Q_LEN, SPARSE, N_ROWS, SEG)

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, N_ROWS, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    toks_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    rows_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    qi, _, _ = _rows(pid_m, num_heads, rows_s, Q_LEN, SPARSE, N_ROWS)
    visible_len = seq_len - Q_LEN + 1 + qi
    acc = gl.zeros([512, N_ROWS], gl.float32, s_layout)
    m_i = gl.full([N_ROWS], float("-inf"), gl.float32, rows_s)
    l_acc = gl.zeros([BLOCK_N, N_ROWS], gl.float32, s_layout)
    for t in range(n_tiles):
        async_copy.wait_group(STAGES - 2)  # this thread's copies of tile t
        thread_barrier()  # everyone's copies of tile t, and everyone done with the stage refilled next
        row, ok = _tile_rows(start + (t + STAGES - 1) * BLOCK_N, end, seq_len, topk_row, bt_row, kv_ptr, stride_kvp,
                             stride_kvt, copy_layout, BLOCK_N, PAGE_SIZE, SPARSE)
        refill = (t + STAGES - 1) % STAGES
        _copy_tile(stage_lat.index(refill), stage_rope.index(refill), row, ok, copy_layout)
        async_copy.commit_group()

        slot = t % STAGES
        kl = stage_lat.index(slot)
        a_rope = _score_operand(stage_rope.index(slot), a_layout, SCORE_LOAD_64, 64, CAST_BITS, 0)
        s = warpgroup_mma(a_rope, q_rope.permute((1, 0)), gl.zeros([BLOCK_N, N_ROWS], gl.float32, s_layout),
                          use_acc=False, is_async=True)
        a_prev = a_rope
        seg_layout: gl.constexpr = SCORE_LOAD_128 if SEG == 128 else SCORE_LOAD_64
        for seg in gl.static_range(512 // SEG):
            a = _score_operand(kl.slice(seg * SEG, SEG, dim=1), a_layout, seg_layout, SEG, CAST_BITS, seg + 1)
            s = warpgroup_mma(a, q_lat.slice(seg * SEG, SEG, dim=1).permute((1, 0)), s, is_async=True)
            s, a_prev, a = warpgroup_mma_wait(num_outstanding=1, deps=(s, a_prev, a))
            a_prev = a
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, a_prev))[0]

        pos, ok_s = _tile_positions(start + t * BLOCK_N, end, seq_len, topk_row, toks_s, BLOCK_N, SPARSE)
        visible = ok_s[:, None] & (pos[:, None] < visible_len[None, :])
        s = gl.where(visible, s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 0))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - m_safe[None, :]).to(gl.float16)
        m_i = m_new
        l_acc = l_acc * alpha[None, :] + p.to(gl.float32)
        p_smem.permute((1, 0)).store(p)
        fence_async_shared()
        acc = acc * alpha[None, :]
        for kb in gl.static_range(BLOCK_N // 16):
            v = _value_operand(kl.slice(kb * 16, 16, dim=0), a_layout, CAST_BITS, kb)
            acc = warpgroup_mma(v, p_smem.slice(kb * 16, 16, dim=1).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=PV_OUTSTANDING, deps=(acc, v))[0]
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    async_copy.wait_group(0)  # the copies past the end (zero-filled, no reads) before the program exits

    l_i = gl.sum(l_acc, 0)
    qi, h, ok = _rows(pid_m, num_heads, rows_s, Q_LEN, SPARSE, N_ROWS)
    cols = _latent_of_row(gl.arange(0, 512, layout=toks_s))
    o_row = o_ptr + b.to(gl.int64) * stride_ob + split * stride_os + qi * stride_ot + h * stride_oh
    inv_l = _inv_sums(l_i, kv_scale)
    _store_out(o_row[None, :] + cols[:, None], (acc * inv_l[None, :]).to(o_ptr.dtype.element_ty),
               (ok & store_o)[None, :] & (cols[:, None] < 512), EVICT_LAST)
    lse = _lse(m_i, l_i)
    gl.store(lse_ptr + b.to(gl.int64) * stride_lb + split * stride_ls + qi * stride_lt + h * stride_lh,
             lse, mask=ok)
