"""The wide FP8-query form: 64 query rows on e4m3 tensor cores, the scores and `p @ v` in different warpgroups.

The narrow FP8-query form (`hopper_fp8_query.py`) runs 64 and 128 heads as two and four 32-row programs, each
copying and transposing every KV tile and running its scores, softmax and `p @ v` one after the other in one
warpgroup. Here one program takes 64 rows in 12 warps, with no loader partition (a 64 x 512 fp32 output takes half
the register file, so 16 warps, at most 128 registers each, cannot hold it beside anything else):

- the scorer (the default partition, warpgroup 0) rounds the query to e4m3 (a scale per row, as the narrow form),
  scores tile t with the rows on M (`s = q k^T`, one m64n64 chain over 576 columns: the row max and sums stay within
  a quad of lanes; where the launch packs 17-32 rows they lie in the first 8 of each warp's 16, and the softmax
  takes those alone, `HALF_ROWS`), or where the launch packs 16 rows transposed (`s^T = k q^T`, m64n16 over the
  tokens: with the rows on M, 3/4 of those products would be padding), and hands p (`2^8 p` in e4m3) and the tile's
  rescale factors over one of two shared buffers; with four token slots and TMA copies it issues tile t's score MMAs
  before tile t - 1's softmax, which runs while they do;
- two p @ v warpgroups each read their 256 of the tile's latent columns from the slot into registers, release it,
  and transpose them there as wgmma's register operand of `o^T = v^T p^T` (8-bit wgmma reads shared operands
  K-major only; p^T is the K-major shared operand p's buffer already is), over p's first 16 or 32 rows where the
  launch packs no more (`PV_ROWS`); at the end they write those output columns with the scorer's row sums, fp32
  split partials whole 32-byte sectors a warp instruction.

Copies: where the launcher gives TMA descriptors, the scorer copies the first tile of each slot, and then each p @ v
warpgroup, once its p @ v of tile t is done, copies its half of tile `t + slots` into that slot
(`hopper_tma.tma_tile`; where one box takes a tile, its block-table entry read an iteration before); a partial
last tile is the scorer's zero-filling `cp.async` copy. Otherwise the
scorer copies every tile by `cp.async`, `slots - 1` ahead.

Shared memory: the query (36 KiB), three or four token slots (36 KiB each), two p buffers (8 KiB).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy, fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait)

from mla_tune.backends.triton_mla.hopper_common import (
    ROWS, KvSource, Program, Ring, _epilogue, _full_slot, _partition_barrier, _rows, _store_lse, _store_query_e4m3,
    _tile_positions)
from mla_tune.backends.triton_mla.hopper_fp8_query import _fp8q_copy, _next_rows
from mla_tune.backends.triton_mla.hopper_tma import tile_row, tma_reads, tma_tile

P_BUFFERS = gl.constexpr(2)
P_LOG2_SCALE = gl.constexpr(8.0)  # p is rounded as 2^8 p: down to 2^-14 it stays a normal e4m3 value
# Each p @ v warpgroup multiplies o^T = v^T p^T with v^T as wgmma's register operand, read from the slot in
# `_V_T_LOAD_LAYOUT` (thread (warp w, lane 4g + q): tokens 4q + j + 16k, j and k < 4, of columns 64w + 8g to
# 64w + 8g + 7, 8-byte loads) and transposed in registers (byte permutes), no v^T stores. Accumulator row
# m = 64b + 16w + 8h + g holds latent column 64w + 8g + 2b + h: the rows wgmma gives thread (w, g) in its four M
# blocks are then its own 8 columns.
_V_T_LOAD_LAYOUT = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [1, 0], [2, 0], [16, 0], [32, 0]],
    lane_bases=[[4, 0], [8, 0], [0, 8], [0, 16], [0, 32]],
    warp_bases=[[0, 64], [0, 128]], block_bases=[], shape=[64, 256]))


# Where a launch packs 32 rows (`HALF_ROWS`), they are the first 8 of each warp's 16 score rows (on M; the other 8
# are zeros), which the m64n64 accumulator holds as every other pair of registers: their scores as `[32, 64]`, 16 a
# thread, all the softmax computes
_HALF_S_LAYOUT = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 8], [0, 16], [0, 32]],
    lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[8, 0], [16, 0]], block_bases=[], shape=[32, 64]))


@gluon.jit
def _softmax_rows(s, HALF_ROWS: gl.constexpr):
    """The scores the softmax takes: all of `s`, or with `HALF_ROWS` the query's 32 rows of its 64 (rows
    `16 (i // 8) + i % 8`) in `_HALF_S_LAYOUT`."""
    if HALF_ROWS:
        lo, _hi = gl.split(gl.reshape(s, [4, 2, 8, s.shape[1]]).permute((0, 2, 3, 1)))
        s = gl.convert_layout(gl.reshape(lo, [32, s.shape[1]]), _HALF_S_LAYOUT)
    return s


@gluon.constexpr_function
def _o_t_store_layout(rows):
    """That accumulator of `rows` rows as `[rows, 256 columns]`, a thread's 8 adjacent columns first (bf16: 16-byte
    stores, a warp's lanes over whole sectors)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [1, 0]] + [[r, 0] for r in (8, 16, 32) if r < rows],
        lane_bases=[[2, 0], [4, 0], [0, 8], [0, 16], [0, 32]],
        warp_bases=[[0, 64], [0, 128]], block_bases=[], shape=[rows, 256])


@gluon.jit
def _issue_copy(ring: Ring, t, row, ok):
    """Once the slot of tile `t` is released, `_fp8q_copy` of its rows (`row`, `ok`: read a tile ahead, none past
    the range)."""
    mbarrier.wait(ring.empty_bars.index(t % ring.STAGES), ((t // ring.STAGES) & 1) ^ 1)
    _fp8q_copy(ring, t, row, ok, True)


@gluon.jit
def _copied(ring: Ring, slot, AHEAD: gl.constexpr, ARRIVALS: gl.constexpr = 1):
    """The scorer's `cp.async` copies of the slot's tile landed (each thread's, then all threads' at a barrier): the
    slot is full for the scores and the p @ v warpgroups (`ARRIVALS`: the full barrier's count)."""
    async_copy.wait_group(AHEAD)
    fence_async_shared()
    _partition_barrier()
    mbarrier.arrive(ring.full_bars.index(slot), count=ARRIVALS)


@gluon.jit
def _tma_landed(ring: Ring, src: KvSource, t):
    """With TMA: tile `t` is in its slot (TMA boxes, or the scorer's `cp.async` copy of a partial tile, which then
    arrives for both halves the p @ v warpgroups would copy)."""
    slot = t % ring.STAGES
    if tma_reads(src, t):
        mbarrier.wait(ring.full_bars.index(slot), (t // ring.STAGES) & 1)
    else:
        _copied(ring, slot, 0, 2)


@gluon.jit
def _partial_copy(ring: Ring, src: KvSource, t):
    """With TMA: where tile `t + STAGES` is the program's partial last tile, its zero-filling `cp.async` copy into
    tile `t`'s slot once the p @ v warpgroups release it (they copy every other tile by TMA)."""
    u = t + ring.STAGES
    if (u < src.n_tiles) & (src.start + (u + 1) * src.BLOCK_N > src.end):
        mbarrier.wait(ring.empty_bars.index(t % ring.STAGES), (t // ring.STAGES) & 1)
        row, ok = _next_rows(src, u)
        _fp8q_copy(ring, u, row, ok, True)


@gluon.jit
def _scores(q_lat, q_rope, ring: Ring, slot, zero_s, SCORES_T: gl.constexpr):
    """The score MMAs of the tile in `slot`, issued asynchronously: rows on M (one m64n64 chain over 576 columns),
    or with `SCORES_T` transposed, `s^T = k q^T`, the tokens on M and only the rows bucket's rows (`zero_s`'s
    columns) on N."""
    if SCORES_T:
        R: gl.constexpr = zero_s.shape[1]
        s = warpgroup_mma(ring.k_rope.index(slot), q_rope.slice(0, R).permute((1, 0)), zero_s, use_acc=False,
                          is_async=True)
        s = warpgroup_mma(ring.k_lat.index(slot), q_lat.slice(0, R).permute((1, 0)), s, is_async=True)
    else:
        s = warpgroup_mma(q_rope, ring.k_rope.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s = warpgroup_mma(q_lat, ring.k_lat.index(slot).permute((1, 0)), s, is_async=True)
    return s


@gluon.jit
def _softmax_to_p(s, t, m_i, l_i, score_scale, visible_len, interior_end, p_smem, alpha_smem, p_full, p_empty,
                  prog: Program, s_layout: gl.constexpr, F16_SUMS: gl.constexpr = False):
    """Tile `t`'s online softmax on its raw scores `s`: p (`2^8 p` in e4m3) and the rescale factors into buffer
    `t % P_BUFFERS` for the p @ v warpgroups; returns the running max and each thread's part of the row sums."""
    BLOCK_N: gl.constexpr = prog.BLOCK_N
    s = s * score_scale[:, None]
    if prog.start + (t + 1) * BLOCK_N > interior_end:  # a tile some rows do not see whole
        pos, ok = _tile_positions(prog.start + t * BLOCK_N, prog.end, prog.seq_len, prog.topk_row,
                                  gl.SliceLayout(0, s_layout), BLOCK_N, prog.SPARSE)
        s = gl.where(ok[None, :] & (pos[None, :] < visible_len[:, None]), s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s - (m_safe - P_LOG2_SCALE)[:, None]).to(p_smem.dtype)
    # the sums of the rounded p that `p @ v` multiplies, over each thread's columns (`[rows, 8, 8]`: the column
    # blocks of 8 a thread holds are registers), reduced across the quad of lanes after the loop
    # with F16_SUMS a tile's 8 blocks summed in fp16 (2^8 p <= 256: up to 2048, within 2^-11), then taken to fp32
    sum_dtype: gl.constexpr = gl.float16 if F16_SUMS else gl.float32
    tile_sums = gl.sum(gl.reshape(p.to(sum_dtype), [p.shape[0], 8, p.shape[1] // 8]), 1).to(gl.float32)
    l_i = l_i * gl.convert_layout(alpha, gl.SliceLayout(1, l_i.type.layout))[:, None] + tile_sums
    buf = t % P_BUFFERS
    mbarrier.wait(p_empty.index(buf), ((t // P_BUFFERS) & 1) ^ 1)
    p_smem.index(buf).slice(0, p.shape[0]).store(p)
    alpha_smem.index(buf).slice(0, p.shape[0]).store(alpha)
    fence_async_shared()
    mbarrier.arrive(p_full.index(buf))
    return m_new, l_i


@gluon.jit
def _softmax_t_to_p(s, t, m_i, l_acc, score_scale, visible_len, interior_end, p_smem, alpha_smem, p_full, p_empty,
                    prog: Program, s_layout: gl.constexpr):
    """`_softmax_to_p` on transposed scores (`s^T`, `[tokens, rows]`): the max over the tokens (across the
    warpgroup's warps), p^T stored as p into the buffer's first rows; the row sums kept per token (`l_acc`) and
    reduced once after the loop."""
    BLOCK_N: gl.constexpr = prog.BLOCK_N
    R: gl.constexpr = s.shape[1]
    s = s * score_scale[None, :]
    if prog.start + (t + 1) * BLOCK_N > interior_end:  # a tile some rows do not see whole
        pos, ok = _tile_positions(prog.start + t * BLOCK_N, prog.end, prog.seq_len, prog.topk_row,
                                  gl.SliceLayout(1, s_layout), BLOCK_N, prog.SPARSE)
        s = gl.where(ok[:, None] & (pos[:, None] < visible_len[None, :]), s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 0))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s - (m_safe - P_LOG2_SCALE)[None, :]).to(p_smem.dtype)
    l_acc = l_acc * alpha[None, :] + p.to(gl.float32)
    buf = t % P_BUFFERS
    mbarrier.wait(p_empty.index(buf), ((t // P_BUFFERS) & 1) ^ 1)
    p_smem.index(buf).slice(0, R).permute((1, 0)).store(p)
    alpha_smem.index(buf).slice(0, R).store(alpha)
    fence_async_shared()
    mbarrier.arrive(p_full.index(buf))
    return m_new, l_acc


# The scorer's 64 rows, the layout their factors are read in before the transposed scorer takes its R of them
_ROWS_64 = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))


@gluon.jit
def _first_copies(ring: Ring, src: KvSource, prog: Program, lat_desc, rope_desc, TMA: gl.constexpr):
    """The scorer's copies before its loop: with TMA the first STAGES tiles (in halves, as the p @ v warpgroups copy
    them later: two arrivals a tile), otherwise `cp.async` of the first STAGES - 1; returns the next tile's rows."""
    copy_row, copy_ok = _next_rows(src, 0)
    if TMA:
        for t in gl.static_range(ring.STAGES):
            if t < prog.n_tiles:
                if tma_reads(src, t):
                    tma_tile(ring, src, t, ring.full_bars.index(t), lat_desc, rope_desc, 0, 2, True)
                    tma_tile(ring, src, t, ring.full_bars.index(t), lat_desc, rope_desc, 2, 2, False)
                else:
                    part_row, part_ok = _next_rows(src, t)
                    _fp8q_copy(ring, t, part_row, part_ok, True)
    else:
        for t in gl.static_range(ring.STAGES - 1):
            _issue_copy(ring, t, copy_row, copy_ok)
            copy_row, copy_ok = _next_rows(src, t + 1)
    return copy_row, copy_ok


@gluon.jit
def _softmax(s, t, m_i, l_i, score_scale, visible_len, interior_end, p_smem, alpha_smem, p_full, p_empty,
             prog: Program, s_layout: gl.constexpr, SCORES_T: gl.constexpr, F16_SUMS: gl.constexpr = False):
    """`_softmax_t_to_p` on transposed scores, `_softmax_to_p` otherwise."""
    if SCORES_T:
        m_i, l_i = _softmax_t_to_p(s, t, m_i, l_i, score_scale, visible_len, interior_end, p_smem, alpha_smem,
                                   p_full, p_empty, prog, s_layout)
    else:
        m_i, l_i = _softmax_to_p(s, t, m_i, l_i, score_scale, visible_len, interior_end, p_smem, alpha_smem, p_full,
                                 p_empty, prog, s_layout, F16_SUMS)
    return m_i, l_i


@gluon.jit
def _wide_scorer(q_lat, q_rope, ring: Ring, src: KvSource, p_smem, alpha_smem, p_full, p_empty, l_smem, l_bar,
                 prog: Program, lat_desc, rope_desc, TMA: gl.constexpr, SCORES_AHEAD: gl.constexpr,
                 SCORES_T: gl.constexpr, R: gl.constexpr, HALF_ROWS: gl.constexpr = False,
                 F16_SUMS: gl.constexpr = False):
    """Warpgroup 0: the e4m3 query; per tile the scores, the online softmax and p with its rescale factors into
    buffer `t % P_BUFFERS`; at the end the row sums for the p @ v warpgroups, and the LSE. With `TMA` it copies the
    first STAGES tiles and a partial last tile (the p @ v warpgroups the others); otherwise every tile, by
    `cp.async`, `STAGES - 1` ahead. `SCORES_AHEAD` (with `TMA`): tile t's score MMAs run while tile t - 1's
    softmax does. `SCORES_T`: transposed scores over the launch's `R` (16 or 32) packed rows, m64nR MMAs where rows
    on M leave 48 or 32 of every 64 padding. `HALF_ROWS`: the rows on M, the `R` = 32 packed rows in every warp's
    first 8 of 16, the softmax over those alone."""
    BLOCK_N: gl.constexpr = prog.BLOCK_N
    AHEAD: gl.constexpr = ring.STAGES - 1  # tiles whose copies are in flight while one is scored
    if SCORES_T:
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, R, 32])
        sm_layout: gl.constexpr = s_layout
        rows_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    else:
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 32])
        sm_layout: gl.constexpr = _HALF_S_LAYOUT if HALF_ROWS else s_layout  # the softmax's scores
        rows_s: gl.constexpr = gl.SliceLayout(1, sm_layout)
    copy_row, copy_ok = _first_copies(ring, src, prog, lat_desc, rope_desc, TMA)
    if SCORES_T:
        # the rounded query's factors as the 64-row copy gives them, then the first R in the transposed row layout
        l_smem.store(_store_query_e4m3(prog, q_lat, q_rope, _ROWS_64))
        _partition_barrier()
        score_scale = l_smem.slice(0, R).load(rows_s) * prog.qk_scale
        N_ROWS: gl.constexpr = R
    else:
        score_scale = _store_query_e4m3(prog, q_lat, q_rope, rows_s, HALF_ROWS) * prog.qk_scale
        N_ROWS: gl.constexpr = R if HALF_ROWS else ROWS
    qi, _h, _ok = _rows(prog.pid_m, prog.num_heads, rows_s, prog.Q_LEN, prog.SPARSE, N_ROWS)
    visible_len = prog.seq_len - prog.Q_LEN + 1 + qi
    interior_end = gl.minimum(prog.end, prog.seq_len - prog.Q_LEN + 1)  # tiles ending here every row sees whole
    m_i = gl.full([N_ROWS], float("-inf"), gl.float32, rows_s)
    if SCORES_T:
        zero_s = gl.zeros([BLOCK_N, R], gl.float32, s_layout)
        l_i = zero_s  # per token (`_softmax_t_to_p`)
    else:
        zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
        l_i = gl.sum(gl.reshape(_softmax_rows(zero_s, HALF_ROWS), [N_ROWS, 8, BLOCK_N // 8]), 1)  # a thread's part
    if TMA and SCORES_AHEAD:
        s_prev = _softmax_rows(zero_s, HALF_ROWS)
        for t in range(prog.n_tiles):
            _tma_landed(ring, src, t)
            s_new = _scores(q_lat, q_rope, ring, t % ring.STAGES, zero_s, SCORES_T)
            if t > 0:  # the previous tile's softmax while this tile's score MMAs run
                m_i, l_i = _softmax(s_prev, t - 1, m_i, l_i, score_scale, visible_len, interior_end, p_smem,
                                    alpha_smem, p_full, p_empty, prog, sm_layout, SCORES_T, F16_SUMS)
                _partial_copy(ring, src, t - 1)
            s_prev = _softmax_rows(warpgroup_mma_wait(num_outstanding=0, deps=(s_new,)), HALF_ROWS)
        if prog.n_tiles > 0:
            m_i, l_i = _softmax(s_prev, prog.n_tiles - 1, m_i, l_i, score_scale, visible_len, interior_end, p_smem,
                                alpha_smem, p_full, p_empty, prog, sm_layout, SCORES_T, F16_SUMS)
    else:
        for t in range(prog.n_tiles):
            slot = t % ring.STAGES
            if TMA:
                _tma_landed(ring, src, t)
            else:
                _issue_copy(ring, t + AHEAD, copy_row, copy_ok)
                copy_row, copy_ok = _next_rows(src, t + AHEAD + 1)  # the block table read a tile before its copy
                _copied(ring, slot, AHEAD)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(_scores(q_lat, q_rope, ring, slot, zero_s, SCORES_T),))
            s = _softmax_rows(s, HALF_ROWS)
            m_i, l_i = _softmax(s, t, m_i, l_i, score_scale, visible_len, interior_end, p_smem, alpha_smem, p_full,
                                p_empty, prog, sm_layout, SCORES_T, F16_SUMS)
            if TMA:
                _partial_copy(ring, src, t)
    async_copy.wait_group(0)  # the copies past the range (none read memory) land before the program ends
    # with p's 2^8, as the p @ v accumulators: their quotient is the output
    if SCORES_T:
        l_i = gl.sum(l_i, 0)
        _partition_barrier()  # every thread has read the factors from l_smem before the sums overwrite them
        l_smem.slice(0, R).store(l_i)
    else:
        l_i = gl.convert_layout(gl.sum(l_i, 1), rows_s)
        l_smem.slice(0, N_ROWS).store(l_i)
    mbarrier.arrive(l_bar)
    _store_lse(m_i, l_i * (1.0 / 256.0), prog, rows_s, N_ROWS)


@gluon.jit
def _v_t_operand(k_lat, COL0: gl.constexpr, o_layout: gl.constexpr):
    """Latent columns `COL0 .. COL0 + 255` of a slot (`[64 tokens, 512]`) as v^T, wgmma's register operand for
    `o^T = v^T p^T`, its rows in `_V_T_LOAD_LAYOUT`'s order."""
    x = k_lat.slice(COL0, 256, dim=1).load(_V_T_LOAD_LAYOUT).permute((1, 0))
    x = gl.reshape(gl.reshape(x, [4, 8, 4, 2, 64]).permute((2, 0, 3, 1, 4)), [256, 64])
    return gl.convert_layout(x, gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4))


# 16 of those rows with 4 adjacent columns a thread and a lane pair over 8: fp32 partials whole 32-byte sectors a
# warp instruction (each thread's own 8 columns, two 16-byte stores, fill half of each sector: twice the sectors)
_O_T_PARTIAL_LAYOUT = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 8], [1, 0], [8, 0]],
    lane_bases=[[2, 0], [4, 0], [0, 4], [0, 16], [0, 32]],
    warp_bases=[[0, 64], [0, 128]], block_bases=[], shape=[16, 256]))


@gluon.jit
def _partial_rows(x, l_smem, prog: Program, ROW0: gl.constexpr, COL0: gl.constexpr):
    """Rows `ROW0 .. ROW0 + 15` of the fp32 split partial, columns `COL0 .. COL0 + 255` (`x`, their unnormalised
    output), through lane-pair shuffles into `_O_T_PARTIAL_LAYOUT` (16 rows at a time: all 64 at once spilled)."""
    rows_l: gl.constexpr = gl.SliceLayout(1, _O_T_PARTIAL_LAYOUT)
    l_i = l_smem.slice(ROW0, 16).load(rows_l)
    _epilogue(gl.convert_layout(x, _O_T_PARTIAL_LAYOUT), l_i, l_i, prog, _O_T_PARTIAL_LAYOUT, rows_l, COL0, 256, False,
              ROW0)


@gluon.jit
def _wide_pv(ring: Ring, p_smem, alpha_smem, p_full, p_empty, l_smem, l_bar, prog: Program, HALF: gl.constexpr,
             src: KvSource, lat_desc, rope_desc, TMA: gl.constexpr, PV_ROWS: gl.constexpr,
             ROW_AHEAD: gl.constexpr = False):
    """A p @ v warpgroup: per tile, latent columns `256 HALF .. 256 HALF + 255` read into registers, the token slot
    released, then `o^T += v^T p^T` over the first `PV_ROWS` rows (the rest are past the launch's packed rows); at
    the end those output columns. With `ROW_AHEAD` and one TMA box a tile, the block-table entry of each tile it
    copies is read an iteration before the copy."""
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, PV_ROWS, 32])
    acc = gl.zeros([256, PV_ROWS], gl.float32, o_layout)
    if TMA:
        ROWS_READ_AHEAD: gl.constexpr = ROW_AHEAD and len(lat_desc.block_type.shape) == 3
    else:
        ROWS_READ_AHEAD: gl.constexpr = False
    row_next = tile_row(src, ring.STAGES) if ROWS_READ_AHEAD else 0
    for t in range(prog.n_tiles):
        if ROWS_READ_AHEAD:  # the next iteration's copy: its block-table entry loads while this one runs
            row_after = tile_row(src, t + 1 + ring.STAGES)
        buf = t % P_BUFFERS
        mbarrier.wait(p_full.index(buf), (t // P_BUFFERS) & 1)  # p (the scores have read the slot), its rescale
        acc = acc * alpha_smem.index(buf).slice(0, PV_ROWS).load(gl.SliceLayout(0, o_layout))[None, :]
        slot, _phase = _full_slot(ring, t, False)
        v_t = _v_t_operand(ring.k_lat.index(slot), HALF * 256, o_layout)
        _partition_barrier()  # every thread's reads are done before the slot is released
        mbarrier.arrive(ring.empty_bars.index(slot))
        acc = warpgroup_mma(v_t, p_smem.index(buf).slice(0, PV_ROWS).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(p_empty.index(buf))
        if TMA:  # this half of tile t + STAGES into the slot, which the scores and these reads are done with
            if tma_reads(src, t + ring.STAGES):
                if ROWS_READ_AHEAD:
                    tma_tile(ring, src, t + ring.STAGES, ring.full_bars.index(slot), lat_desc, rope_desc, 2 * HALF,
                             2, HALF == 0, row_next)
                else:
                    tma_tile(ring, src, t + ring.STAGES, ring.full_bars.index(slot), lat_desc, rope_desc, 2 * HALF,
                             2, HALF == 0)
        if ROWS_READ_AHEAD:
            row_next = row_after
    mbarrier.wait(l_bar, 0)
    store_layout: gl.constexpr = _o_t_store_layout(PV_ROWS)
    out = gl.reshape(gl.reshape(acc, [4, 4, 2, 8, PV_ROWS]).permute((4, 1, 3, 0, 2)), [PV_ROWS, 256])
    out = gl.convert_layout(out, store_layout)
    if prog.o_ptr.dtype.element_ty == gl.float32:  # split partials (or an fp32 output), in 16-row pieces
        if PV_ROWS == 64:  # rows 32 a + 16 b + r: (a, b) as trailing dims
            lo, hi = gl.split(gl.reshape(out, [2, 2, 16, 256]).permute((2, 3, 0, 1)))
            lo0, lo1 = gl.split(lo)
            hi0, hi1 = gl.split(hi)
            _partial_rows(lo0, l_smem, prog, 0, HALF * 256)
            _partial_rows(hi0, l_smem, prog, 16, HALF * 256)
            _partial_rows(lo1, l_smem, prog, 32, HALF * 256)
            _partial_rows(hi1, l_smem, prog, 48, HALF * 256)
        elif PV_ROWS == 32:  # rows 16 b + r
            lo, hi = gl.split(gl.reshape(out, [2, 16, 256]).permute((1, 2, 0)))
            _partial_rows(lo, l_smem, prog, 0, HALF * 256)
            _partial_rows(hi, l_smem, prog, 16, HALF * 256)
        else:
            _partial_rows(out, l_smem, prog, 0, HALF * 256)
    else:
        l_i = l_smem.slice(0, PV_ROWS).load(gl.SliceLayout(1, store_layout))
        _epilogue(out, l_i, l_i, prog, store_layout, gl.SliceLayout(1, store_layout), HALF * 256, 256, False)


@gluon.jit
def _run_fp8q_wide(src: KvSource, prog: Program, PV_REGS: gl.constexpr, lat_desc, rope_desc, TMA: gl.constexpr,
                   SCORES_AHEAD: gl.constexpr = False, PV_ROWS: gl.constexpr = ROWS, SCORES_T: gl.constexpr = False,
                   ROW_AHEAD: gl.constexpr = False, HALF_ROWS: gl.constexpr = False,
                   F16_SUMS: gl.constexpr = False):
    """This form's shared memory and barriers, and its partitions: the scorer by default (`SCORES_T`: on transposed
    scores over the `PV_ROWS` rows), the two p @ v warpgroups (`PV_REGS` registers a thread; `PV_ROWS`: the rows
    they multiply, 16 or 32 where the launch packs no more) as workers."""
    gl.static_assert(PV_ROWS == 16 or PV_ROWS == 32 or PV_ROWS == ROWS, "PV_ROWS: 16, 32 or 64")
    gl.static_assert(not SCORES_T or PV_ROWS < ROWS, "SCORES_T: 16 or 32 rows")
    gl.static_assert(not HALF_ROWS or (PV_ROWS == 32 and not SCORES_T), "HALF_ROWS: 32 rows on M")
    BLOCK_N: gl.constexpr = prog.BLOCK_N
    STAGES: gl.constexpr = prog.STAGES
    dtype: gl.constexpr = src.kv_ptr.dtype.element_ty
    lat_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 512], dtype)  # 128-byte swizzle
    narrow_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 64], dtype)  # 64-byte swizzle
    vector_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    q_lat = gl.allocate_shared_memory(dtype, [ROWS, 512], lat_layout)
    q_rope = gl.allocate_shared_memory(dtype, [ROWS, 64], narrow_layout)
    k_lat = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, 512], lat_layout)
    k_rope = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, 64], narrow_layout)
    p_smem = gl.allocate_shared_memory(dtype, [P_BUFFERS, ROWS, BLOCK_N], narrow_layout)
    alpha_smem = gl.allocate_shared_memory(gl.float32, [P_BUFFERS, ROWS], vector_layout)
    l_smem = gl.allocate_shared_memory(gl.float32, [ROWS], vector_layout)
    full_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    p_full = gl.allocate_shared_memory(gl.int64, [P_BUFFERS, 1], mbarrier.MBarrierLayout())
    p_empty = gl.allocate_shared_memory(gl.int64, [P_BUFFERS, 1], mbarrier.MBarrierLayout())
    l_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        # with TMA, each p @ v warpgroup's copy of its half (the scorer's first tiles and partial tiles arrive twice)
        mbarrier.init(full_bars.index(i), count=2 if TMA else 1)
        # each p @ v warpgroup after its read-back; the scorer, which copies into the slot next, has its scores
        mbarrier.init(empty_bars.index(i), count=2)
    for i in gl.static_range(P_BUFFERS):
        mbarrier.init(p_full.index(i), count=1)
        mbarrier.init(p_empty.index(i), count=2)
    mbarrier.init(l_bar, count=1)
    ring = Ring(k_lat, k_rope, full_bars, empty_bars, STAGES)
    gl.warp_specialize([
        (_wide_scorer, (q_lat, q_rope, ring, src, p_smem, alpha_smem, p_full, p_empty, l_smem, l_bar, prog, lat_desc,
                        rope_desc, TMA, SCORES_AHEAD, SCORES_T, PV_ROWS, HALF_ROWS, F16_SUMS)),
        (_wide_pv, (ring, p_smem, alpha_smem, p_full, p_empty, l_smem, l_bar, prog, 0, src, lat_desc, rope_desc, TMA,
                    PV_ROWS, ROW_AHEAD)),
        (_wide_pv, (ring, p_smem, alpha_smem, p_full, p_empty, l_smem, l_bar, prog, 1, src, lat_desc, rope_desc, TMA,
                    PV_ROWS, ROW_AHEAD))],
        [4, 4], [PV_REGS, PV_REGS])
