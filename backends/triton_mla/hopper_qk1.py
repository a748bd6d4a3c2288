"""The Hopper kernel's qk1 form: FlashInfer's division of the MMA work between two warpgroups, 12 warps in all.

Launched with 4 warps (warpgroup 0, the default partition); warpgroup 1 and the loader are workers. Warpgroup 0
scores the whole tile (one m64n64 wgmma chain over all 576 columns: the query read once a tile, no partial scores to
exchange), runs the online softmax (rows on M: row max and sums stay inside each quad of lanes) and hands p to
warpgroup 1 in the slot's rope columns (which only its own finished score MMAs read), with the tile's rescale
factors; each then multiplies p by its 256 of the 512 value columns (warpgroup 0 from registers, warpgroup 1 from
shared memory). At the end warpgroup 0 hands over the row sums.

The rescale is lazy: a row's reference max moves only when the tile's max exceeds it by more than LAZY_MAX_LOG2
(exact either way: the sums use the same reference), and warpgroup 1 skips rescaling on tiles where no row's
reference moved; where `dispatch.QK1_WARP_FLAGS_FORMS` says so it learns that from four flags warpgroup 0 reduces
within each warp, not from a reduction across its own warps. Where `dispatch.QK1_QUERY_REG_COLS` says so,
warpgroup 0 keeps the query's rope and first latent columns in registers as the score wgmma's A operand, so it reads
fewer query bytes from shared memory a tile. The loader is `hopper_loaders._load_partition`'s (by TMA where the
launcher gives the cache's descriptors: `dispatch.copies_by_tma`).
"""

# No `from __future__ import annotations`: the aggregates check their fields against real annotation types.
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait)
from triton.language.core import _aggregate as aggregate
from triton.language.core import base_value

from mla_tune.backends.triton_mla.hopper_common import (
    LOAD_WARPS, ROWS, KvSource, Program, Ring, _epilogue, _full_slot, _load_query, _reinterpret, _round_pairs,
    _rows, _store_query, _tile_positions)
from mla_tune.backends.triton_mla.hopper_loaders import _load_partition

LAZY_MAX_LOG2 = gl.constexpr(8.0)  # p stays below 2^8, well inside fp16/bf16 range


@aggregate
class Qk1Exchange:
    """What warpgroup 0 hands warpgroup 1: each slot's rescale factors (`alpha_smem`, signalled by `p_bars` together
    with p in the slot's rope columns) and, with `WARP_FLAGS`, whether each warp's rows moved their reference
    (`moved_smem`, four int32 a slot); at the end, the row sums (`l_smem`, `l_bar`)."""

    alpha_smem: base_value
    l_smem: base_value
    p_bars: base_value
    l_bar: base_value
    moved_smem: base_value

    @gluon.constexpr_function
    def __init__(self, alpha_smem, l_smem, p_bars, l_bar, moved_smem):
        self.alpha_smem = alpha_smem
        self.l_smem = l_smem
        self.p_bars = p_bars
        self.l_bar = l_bar
        self.moved_smem = moved_smem


@gluon.jit
def _qk1_scores(q_lat, q_rope, q_regs, ring: Ring, slot, zero_s, REG_COLS: gl.constexpr = 0):
    """The score MMAs of ring slot `slot` (m64n64 over all 576 columns), issued, not waited for. With `REG_COLS` the
    query's first `REG_COLS` columns (rope first, then latent) come from registers (`q_regs`, `_qk1_query_regs`)."""
    if REG_COLS == 0:
        s = warpgroup_mma(q_rope, ring.k_rope.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        return warpgroup_mma(q_lat, ring.k_lat.index(slot).permute((1, 0)), s, is_async=True)
    else:
        q_rope_regs, q_lat_regs = q_regs
        s = warpgroup_mma(q_rope_regs, ring.k_rope.index(slot).permute((1, 0)), zero_s, use_acc=False,
                          is_async=True)
        LAT: gl.constexpr = REG_COLS - 64
        if LAT > 0:
            s = warpgroup_mma(q_lat_regs, ring.k_lat.index(slot).slice(0, LAT, dim=1).permute((1, 0)), s,
                              is_async=True)
        # the other latent columns in power-of-two slices, each aligned to its width
        gl.static_assert(LAT == 0 or LAT == 64 or LAT == 128 or LAT == 256, "QUERY_REG_COLS: 64, 128, 192 or 320")
        kl = ring.k_lat.index(slot)
        if LAT == 0:
            return warpgroup_mma(q_lat, kl.permute((1, 0)), s, is_async=True)
        else:
            if LAT == 64:
                s = warpgroup_mma(q_lat.slice(64, 64, dim=1), kl.slice(64, 64, dim=1).permute((1, 0)), s,
                                  is_async=True)
            if LAT <= 128:
                s = warpgroup_mma(q_lat.slice(128, 128, dim=1), kl.slice(128, 128, dim=1).permute((1, 0)), s,
                                  is_async=True)
            return warpgroup_mma(q_lat.slice(256, 256, dim=1), kl.slice(256, 256, dim=1).permute((1, 0)), s,
                                 is_async=True)


@gluon.jit
def _qk1_query_regs(prog: Program, s_layout: gl.constexpr, REG_COLS: gl.constexpr):
    """The query's columns that `_qk1_scores` takes from registers, loaded from global memory (so no barrier orders
    them after the shared-memory copy): (rope, the first `REG_COLS - 64` latent columns, or the rope again where
    there are none), in the score wgmma's A-operand layout; (0, 0) without `REG_COLS`."""
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    if REG_COLS == 0:
        return 0, 0
    else:
        rope = _load_query(prog, 512, a_layout, 64)
        if REG_COLS > 64:
            return rope, _load_query(prog, 0, a_layout, REG_COLS - 64)
        else:
            return rope, rope


@gluon.jit
def _qk1_positions(prog: Program, t, layout: gl.constexpr):
    """Tile `t`'s token positions and their validity (`_tile_positions`) in `layout`."""
    return _tile_positions(prog.start + t * prog.BLOCK_N, prog.end, prog.seq_len, prog.topk_row, layout, prog.BLOCK_N,
                           prog.SPARSE)


@gluon.jit
def _qk1_tile(s, acc, m_i, l_i, t, ring: Ring, exch: Qk1Exchange, prog: Program, visible_len, pos, ok,
              s_layout: gl.constexpr, o_layout: gl.constexpr, WARP_FLAGS: gl.constexpr = False,
              SUMS_UNROUNDED: gl.constexpr = False):
    """Warpgroup 0 on tile `t` (its positions `pos` and their validity `ok`, `_tile_positions`), once its score MMAs
    `s` are issued: waits for them, runs the online softmax, hands p (over the slot's rope columns) and the rescale
    factors to warpgroup 1, rescales its output columns and issues `p @ v` on value columns 0-255 (not waited for).
    Returns (output accumulator, running max, running sum)."""
    BLOCK_N: gl.constexpr = prog.BLOCK_N
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    p_smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    slot = t % ring.STAGES
    kl = ring.k_lat.index(slot)
    # One query token sees the whole request, which `ok` already checks: its mask is a column bias, computed while
    # the score MMAs run, one FMA an element after them.
    COLUMN_BIAS: gl.constexpr = prog.Q_LEN == 1
    if COLUMN_BIAS:
        bias = gl.where(ok, 0.0, float("-inf"))
    scores = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    if COLUMN_BIAS:
        scores = scores * prog.qk_scale + bias[None, :]
    else:
        visible = ok[None, :] & (pos[None, :] < visible_len[:, None])
        scores = gl.where(visible, scores * prog.qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(scores, 1))
    m_new = gl.where(m_new > m_i + LAZY_MAX_LOG2, m_new, m_i)  # lazy: keep the reference unless it grew enough
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    # 1 also where nothing was visible before (its output and sum are still 0), so no rescale is needed there
    alpha = gl.where(m_i == float("-inf"), 1.0, gl.exp2(m_i - m_safe))
    p = gl.exp2(scores - m_safe[:, None])
    if SUMS_UNROUNDED:  # the fp32 p: no rounded value widened again between p and its hand-over
        l_i = l_i * alpha + gl.sum(p, 1)
    p = _round_pairs(p, kl.dtype)
    if not SUMS_UNROUNDED:
        l_i = l_i * alpha + gl.sum(p.to(gl.float32), 1)  # the sums of the rounded p that `p @ v` multiplies
    _reinterpret(ring.k_rope.index(slot), kl.dtype, [ROWS, BLOCK_N], p_smem_layout).store(p)
    exch.alpha_smem.index(slot).store(alpha)
    if WARP_FLAGS:  # whether any of each warp's 16 rows moved its reference: a reduction within the warp
        exch.moved_smem.index(slot).store(gl.max(gl.reshape(gl.where(alpha < 1.0, 1, 0), [4, 16]), 1))
    fence_async_shared()
    mbarrier.arrive(exch.p_bars.index(slot))
    acc = acc * gl.convert_layout(alpha, rows_o)[:, None]
    acc = warpgroup_mma(gl.convert_layout(p, p_layout), kl.slice(0, 256, dim=1), acc, is_async=True)
    return acc, m_new, l_i


@gluon.jit
def _qk1_scorer(q_lat, q_rope, ring: Ring, exch: Qk1Exchange, prog: Program, REG_COLS: gl.constexpr = 0,
                WARP_FLAGS: gl.constexpr = False, POSITIONS_AHEAD: gl.constexpr = False,
                SUMS_UNROUNDED: gl.constexpr = False):
    """Warpgroup 0 (the default partition): scores, softmax, p to warpgroup 1, value columns 0-255. With
    `POSITIONS_AHEAD` (sparse: the top-k row holds them) it loads the next tile's positions once this tile's
    `p @ v` is issued, not among its score MMAs."""
    if prog.QUERY_IN_CONSUMER:
        _store_query(prog, q_lat, q_rope, 4)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, prog.BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 256, 16])
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    acc = gl.zeros([ROWS, 256], gl.float32, o_layout)
    qi, _, _ = _rows(prog.pid_m, prog.num_heads, rows_s, prog.Q_LEN, prog.SPARSE)
    visible_len = prog.seq_len - prog.Q_LEN + 1 + qi  # MTP: query token i sees the first seq_len - q_len + 1 + i keys
    m_i = gl.full([ROWS], float("-inf"), gl.float32, rows_s)
    l_i = gl.zeros([ROWS], gl.float32, rows_s)
    zero_s = gl.zeros([ROWS, prog.BLOCK_N], gl.float32, s_layout)
    q_regs = _qk1_query_regs(prog, s_layout, REG_COLS)
    cols_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    if POSITIONS_AHEAD:
        pos, ok = _qk1_positions(prog, 0, cols_s)
    for t in range(prog.n_tiles):
        slot, phase = _full_slot(ring, t, prog.FENCE_SLOTS)
        s = _qk1_scores(q_lat, q_rope, q_regs, ring, slot, zero_s, REG_COLS)
        if not POSITIONS_AHEAD:
            pos, ok = _qk1_positions(prog, t, cols_s)
        acc, m_i, l_i = _qk1_tile(s, acc, m_i, l_i, t, ring, exch, prog, visible_len, pos, ok, s_layout, o_layout,
                                  WARP_FLAGS, SUMS_UNROUNDED)
        if POSITIONS_AHEAD:
            pos, ok = _qk1_positions(prog, t + 1, cols_s)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(ring.empty_bars.index(slot))
    exch.l_smem.store(l_i)
    mbarrier.arrive(exch.l_bar)
    _epilogue(acc, m_i, l_i, prog, o_layout, rows_s, 0, 256, True)


@gluon.jit
def _qk1_second(ring: Ring, exch: Qk1Exchange, prog: Program, WARP_FLAGS: gl.constexpr = False):
    """Warpgroup 1 (a worker): rescales where a reference moved and multiplies p by value columns 256-511; writes
    those output columns with warpgroup 0's row sums. `WARP_FLAGS`: whether a reference moved is read from warpgroup
    0's four per-warp flags, each thread all four, instead of reduced over the 64 rescale factors across its warps."""
    flags_layout: gl.constexpr = gl.BlockedLayout([4], [32], [4], [0])  # every thread holds all four
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 256, 16])
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    p_smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    acc = gl.zeros([ROWS, 256], gl.float32, o_layout)
    for t in range(prog.n_tiles):
        slot, phase = _full_slot(ring, t, prog.FENCE_SLOTS)
        mbarrier.wait(exch.p_bars.index(slot), phase)
        kl = ring.k_lat.index(slot)
        alpha = exch.alpha_smem.index(slot).load(rows_o)
        if WARP_FLAGS:
            if gl.max(exch.moved_smem.index(slot).load(flags_layout), 0) > 0:
                acc = acc * alpha[:, None]
        elif gl.min(alpha, 0) < 1.0:  # some row's reference moved
            acc = acc * alpha[:, None]
        acc = warpgroup_mma(_reinterpret(ring.k_rope.index(slot), kl.dtype, [ROWS, prog.BLOCK_N], p_smem_layout),
                            kl.slice(256, 256, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(ring.empty_bars.index(slot))
    mbarrier.wait(exch.l_bar, 0)
    l_i = exch.l_smem.load(rows_o)
    _epilogue(acc, l_i, l_i, prog, o_layout, rows_o, 256, 256, False)


@gluon.jit
def _run_qk1(q_lat, q_rope, ring: Ring, src: KvSource, prog: Program, L2_PREFETCH: gl.constexpr,
             LOADER_AHEAD: gl.constexpr, QUERY_REG_COLS: gl.constexpr, MMA_REGS: gl.constexpr,
             LOAD_REGS: gl.constexpr, WARP_FLAGS: gl.constexpr = False, lat_desc=None, rope_desc=None,
             POSITIONS_AHEAD: gl.constexpr = False, SUMS_UNROUNDED: gl.constexpr = False):
    """The qk1 form's exchange buffers and partitions: warpgroup 0 by default, warpgroup 1 and the loader as
    workers (`MMA_REGS` and `LOAD_REGS` registers a thread; with the launcher's descriptors the loader copies by
    TMA)."""
    alpha_smem = gl.allocate_shared_memory(gl.float32, [ring.STAGES, ROWS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    l_smem = gl.allocate_shared_memory(gl.float32, [ROWS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    p_bars = gl.allocate_shared_memory(gl.int64, [ring.STAGES, 1], mbarrier.MBarrierLayout())
    l_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    moved_smem = gl.allocate_shared_memory(gl.int32, [ring.STAGES, 4], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    for i in gl.static_range(ring.STAGES):
        mbarrier.init(p_bars.index(i), count=1)
    mbarrier.init(l_bar, count=1)
    exch = Qk1Exchange(alpha_smem, l_smem, p_bars, l_bar, moved_smem)
    gl.warp_specialize([
        (_qk1_scorer, (q_lat, q_rope, ring, exch, prog, QUERY_REG_COLS, WARP_FLAGS, POSITIONS_AHEAD,
                       SUMS_UNROUNDED)),
        (_qk1_second, (ring, exch, prog, WARP_FLAGS)),
        (_load_partition, (src, ring, 0, 1, L2_PREFETCH, LOADER_AHEAD, lat_desc, rope_desc))],
        [4, LOAD_WARPS], [MMA_REGS, LOAD_REGS])
