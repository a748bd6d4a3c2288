"""The Hopper kernel's qk1 form: FlashInfer's division of the MMA work between two warpgroups, 12 warps in all.

Launched with 4 warps (warpgroup 0, the default partition); warpgroup 1 and the loader are workers. Warpgroup 0
scores the whole tile (one m64n64 wgmma chain over all 576 columns: the query read once a tile, no partial scores to
exchange), runs the online softmax (rows on M: row max and sums stay inside each quad of lanes) and hands p to
warpgroup 1 in the slot's rope columns (which only its own finished score MMAs read), with the tile's rescale
factors; each then multiplies p by its 256 of the 512 value columns (warpgroup 0 from registers, warpgroup 1 from
shared memory). At the end warpgroup 0 hands over the row sums.

The rescale is lazy: a row's reference max moves only when the tile's max exceeds it by more than LAZY_MAX_LOG2
(exact either way: the sums use the same reference), and warpgroup 1 skips rescaling on tiles where no row's
reference moved. Where `dispatch.QK1_QUERY_REG_COLS` says so, warpgroup 0 keeps the query's rope and first latent
columns in registers as the score wgmma's A operand, so it reads fewer query bytes from shared memory a tile.

With `QUERY_FP8` (an FP8 cache; `LaunchParams.query_fp8`) both products run on e4m3 wgmma: the query is in e4m3, each
row with its own scale (`hopper_common._store_query_e4m3`, folded into the row's score scale), the slots hold the
cache's bytes as they are, p is rounded to e4m3 (`_p_offset`: against the exact running max, no lazy rescale) and
`p @ v` reads the value columns from the slot's transposed copy (`Ring.v_t`).
"""

# No `from __future__ import annotations`: the aggregates check their fields against real annotation types.
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait)
from triton.language.core import _aggregate as aggregate
from triton.language.core import base_value

from mla_tune.backends.triton_mla.hopper_common import (
    LOAD_WARPS, ROWS, KvSource, Program, Ring, _epilogue, _full_slot, _load_query, _round_pairs, _rows,
    _store_query, _tile_positions)
from mla_tune.backends.triton_mla.hopper_loaders import _load_partition

LAZY_MAX_LOG2 = gl.constexpr(8.0)  # p stays below 2^8, well inside fp16/bf16 range
E4M3_P_LOG2 = 8.0  # e4m3 p at most 2^8, inside e4m3's 448
# Triton 3.9 made shared_memory_descriptor._reinterpret public as reinterpret
_PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))


@gluon.jit
def _reinterpret(desc, dtype: gl.constexpr, rows: gl.constexpr, cols: gl.constexpr, layout: gl.constexpr):
    """`desc` seen as a `[rows, cols]` tile of `dtype` in `layout`, under either name Triton gives it."""
    if _PUBLIC_REINTERPRET:
        return desc.reinterpret(dtype, [rows, cols], layout)
    else:
        return desc._reinterpret(dtype, [rows, cols], layout)


@aggregate
class Qk1Exchange:
    """What warpgroup 0 hands warpgroup 1: each slot's rescale factors (`alpha_smem`, signalled by `p_bars` together
    with p in the slot's rope columns) and, at the end, the row sums (`l_smem`, `l_bar`)."""

    alpha_smem: base_value
    l_smem: base_value
    p_bars: base_value
    l_bar: base_value

    @gluon.constexpr_function
    def __init__(self, alpha_smem, l_smem, p_bars, l_bar):
        self.alpha_smem = alpha_smem
        self.l_smem = l_smem
        self.p_bars = p_bars
        self.l_bar = l_bar


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


@gluon.constexpr_function
def _p_offset(QUERY_FP8):
    """log2 of the factor p carries: e4m3 p is taken against the exact running max and times 2^E4M3_P_LOG2, so p
    lies in (0, 2^8] and the values e4m3 flushes to zero are below 2^-17 of the largest (against 2^-9 at 1)."""
    return gl.constexpr(E4M3_P_LOG2 if QUERY_FP8 else 0.0)


@gluon.jit
def _p_slot(ring: Ring, slot, dtype: gl.constexpr, BLOCK_N: gl.constexpr, QUERY_FP8: gl.constexpr):
    """Where p goes: slot `slot`'s rope columns (read only by its own finished score MMAs) as `[ROWS, BLOCK_N]` of
    `dtype`; with the e4m3 query they already are e4m3 of that shape."""
    if QUERY_FP8:
        return ring.k_rope.index(slot)
    else:
        p_smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        return _reinterpret(ring.k_rope.index(slot), dtype, ROWS, BLOCK_N, p_smem_layout)


@gluon.jit
def _value_cols(ring: Ring, slot, COL0: gl.constexpr, QUERY_FP8: gl.constexpr):
    """The `p @ v` B operand: value columns `COL0 .. COL0 + 255` of slot `slot`, `[BLOCK_N, 256]`; with the e4m3
    query from the slot's transposed copy (K-major, as 8-bit wgmma needs)."""
    if QUERY_FP8:
        return ring.v_t.index(slot).slice(COL0, 256, dim=0).permute((1, 0))
    else:
        return ring.k_lat.index(slot).slice(COL0, 256, dim=1)


@gluon.jit
def _qk1_tile(s, acc, m_i, l_i, t, ring: Ring, exch: Qk1Exchange, prog: Program, visible_len, score_scale,
              s_layout: gl.constexpr, o_layout: gl.constexpr, QUERY_FP8: gl.constexpr):
    """Warpgroup 0 on tile `t`, once its score MMAs `s` are issued: waits for them, scales them (`score_scale`: one
    value, or `[ROWS, 1]` with the e4m3 query's row scales), runs the online softmax, hands p (over the slot's rope
    columns) and the rescale factors to warpgroup 1, rescales its output columns and issues `p @ v` on value columns
    0-255 (not waited for). Returns (output accumulator, running max, running sum)."""
    BLOCK_N: gl.constexpr = prog.BLOCK_N
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    slot = t % ring.STAGES
    kl = ring.k_lat.index(slot)
    p_dtype: gl.constexpr = gl.float8e4nv if QUERY_FP8 else kl.dtype
    pos, ok = _tile_positions(prog.start + t * BLOCK_N, prog.end, prog.seq_len, prog.topk_row,
                              gl.SliceLayout(0, s_layout), BLOCK_N, prog.SPARSE)
    # One query token sees the whole request, which `ok` already checks: its mask is a column bias, computed while
    # the score MMAs run, one FMA an element after them.
    COLUMN_BIAS: gl.constexpr = prog.Q_LEN == 1
    if COLUMN_BIAS:
        bias = gl.where(ok, 0.0, float("-inf"))
    scores = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    if COLUMN_BIAS:
        scores = scores * score_scale + bias[None, :]
    else:
        visible = ok[None, :] & (pos[None, :] < visible_len[:, None])
        scores = gl.where(visible, scores * score_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(scores, 1))
    if not QUERY_FP8:
        m_new = gl.where(m_new > m_i + LAZY_MAX_LOG2, m_new, m_i)  # lazy: keep the reference unless it grew enough
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    # 1 also where nothing was visible before (its output and sum are still 0), so no rescale is needed there
    alpha = gl.where(m_i == float("-inf"), 1.0, gl.exp2(m_i - m_safe))
    p = gl.exp2(scores - (m_safe - _p_offset(QUERY_FP8))[:, None])
    p = _round_pairs(p, p_dtype)
    l_i = l_i * alpha + gl.sum(p.to(gl.float32), 1)  # the sums of the rounded p that `p @ v` multiplies
    _p_slot(ring, slot, p_dtype, BLOCK_N, QUERY_FP8).store(p)
    exch.alpha_smem.index(slot).store(alpha)
    fence_async_shared()
    mbarrier.arrive(exch.p_bars.index(slot))
    acc = acc * gl.convert_layout(alpha, rows_o)[:, None]
    if QUERY_FP8:
        # e4m3 p from the slot, as warpgroup 1 reads it: converted to the A-operand layout in registers, Triton 3.6
        # computed the softmax in that layout and got rows 0-7 of every 16 wrong (tests/backends, GPU)
        a = _p_slot(ring, slot, p_dtype, BLOCK_N, QUERY_FP8)
    else:
        a = gl.convert_layout(p, gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
    acc = warpgroup_mma(a, _value_cols(ring, slot, 0, QUERY_FP8), acc, is_async=True)
    return acc, m_new, l_i


@gluon.jit
def _qk1_scorer(q_lat, q_rope, q_scales, ring: Ring, exch: Qk1Exchange, prog: Program, REG_COLS: gl.constexpr = 0,
                QUERY_FP8: gl.constexpr = False):
    """Warpgroup 0 (the default partition): scores, softmax, p to warpgroup 1, value columns 0-255 (`q_scales`:
    the e4m3 query's row scales)."""
    if prog.QUERY_IN_CONSUMER:
        _store_query(prog, q_lat, q_rope, 4)
    MMA_K: gl.constexpr = 32 if QUERY_FP8 else 16
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, prog.BLOCK_N, MMA_K])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 256, MMA_K])
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    if QUERY_FP8:
        score_scale = (q_scales.load(rows_s) * prog.qk_scale)[:, None]
    else:
        score_scale = prog.qk_scale
    acc = gl.zeros([ROWS, 256], gl.float32, o_layout)
    qi, _, _ = _rows(prog.pid_m, prog.num_heads, rows_s, prog.Q_LEN, prog.SPARSE)
    visible_len = prog.seq_len - prog.Q_LEN + 1 + qi  # MTP: query token i sees the first seq_len - q_len + 1 + i keys
    m_i = gl.full([ROWS], float("-inf"), gl.float32, rows_s)
    l_i = gl.zeros([ROWS], gl.float32, rows_s)
    zero_s = gl.zeros([ROWS, prog.BLOCK_N], gl.float32, s_layout)
    q_regs = _qk1_query_regs(prog, s_layout, REG_COLS)
    for t in range(prog.n_tiles):
        slot, phase = _full_slot(ring, t, prog.FENCE_SLOTS)
        acc, m_i, l_i = _qk1_tile(_qk1_scores(q_lat, q_rope, q_regs, ring, slot, zero_s, REG_COLS), acc, m_i, l_i, t,
                                  ring, exch, prog, visible_len, score_scale, s_layout, o_layout, QUERY_FP8)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(ring.empty_bars.index(slot))
    exch.l_smem.store(l_i)
    mbarrier.arrive(exch.l_bar)
    _epilogue(acc, m_i - _p_offset(QUERY_FP8), l_i, prog, o_layout, rows_s, 0, 256, True)


@gluon.jit
def _qk1_second(ring: Ring, exch: Qk1Exchange, prog: Program, QUERY_FP8: gl.constexpr = False):
    """Warpgroup 1 (a worker): rescales where a reference moved and multiplies p by value columns 256-511; writes
    those output columns with warpgroup 0's row sums."""
    MMA_K: gl.constexpr = 32 if QUERY_FP8 else 16
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 256, MMA_K])
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    p_dtype: gl.constexpr = gl.float8e4nv if QUERY_FP8 else ring.k_lat.dtype
    acc = gl.zeros([ROWS, 256], gl.float32, o_layout)
    for t in range(prog.n_tiles):
        slot, phase = _full_slot(ring, t, prog.FENCE_SLOTS)
        mbarrier.wait(exch.p_bars.index(slot), phase)
        alpha = exch.alpha_smem.index(slot).load(rows_o)
        if gl.min(alpha, 0) < 1.0:  # some row's reference moved
            acc = acc * alpha[:, None]
        acc = warpgroup_mma(_p_slot(ring, slot, p_dtype, prog.BLOCK_N, QUERY_FP8),
                            _value_cols(ring, slot, 256, QUERY_FP8), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(ring.empty_bars.index(slot))
    mbarrier.wait(exch.l_bar, 0)
    l_i = exch.l_smem.load(rows_o)
    _epilogue(acc, l_i, l_i, prog, o_layout, rows_o, 256, 256, False)


@gluon.jit
def _run_qk1(q_lat, q_rope, q_scales, ring: Ring, src: KvSource, prog: Program, L2_PREFETCH: gl.constexpr,
             LOADER_AHEAD: gl.constexpr, QUERY_REG_COLS: gl.constexpr, MMA_REGS: gl.constexpr,
             LOAD_REGS: gl.constexpr, QUERY_FP8: gl.constexpr, PREFETCH_TILES: gl.constexpr = 1):
    """The qk1 form's exchange buffers and partitions: warpgroup 0 by default, warpgroup 1 and the loader as
    workers (`MMA_REGS` and `LOAD_REGS` registers a thread); `q_scales`: the e4m3 query's row scales."""
    alpha_smem = gl.allocate_shared_memory(gl.float32, [ring.STAGES, ROWS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    l_smem = gl.allocate_shared_memory(gl.float32, [ROWS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    p_bars = gl.allocate_shared_memory(gl.int64, [ring.STAGES, 1], mbarrier.MBarrierLayout())
    l_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(ring.STAGES):
        mbarrier.init(p_bars.index(i), count=1)
    mbarrier.init(l_bar, count=1)
    exch = Qk1Exchange(alpha_smem, l_smem, p_bars, l_bar)
    gl.warp_specialize([
        (_qk1_scorer, (q_lat, q_rope, q_scales, ring, exch, prog, QUERY_REG_COLS, QUERY_FP8)),
        (_qk1_second, (ring, exch, prog, QUERY_FP8)),
        (_load_partition, (src, ring, 0, 1, L2_PREFETCH, LOADER_AHEAD, QUERY_FP8, PREFETCH_TILES))],
        [4, LOAD_WARPS], [MMA_REGS, LOAD_REGS])
