"""The Hopper kernel's token-split form: 64 query rows, two MMA warpgroups (one 8-warp partition), one loader.

Per tile each warpgroup scores half the tile's tokens (m64n32 wgmma over all 576 columns), the row max is taken
across both halves through shared memory, and each warpgroup multiplies p by its 256 of the 512 value columns
(m64n256). The row sums come from p in the `p @ v` operand layout, where each warpgroup holds whole rows, so they
need no exchange.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from mla_tune.backends.triton_mla.hopper_common import (
    LOAD_WARPS, ROWS, KvSource, Program, Ring, _epilogue, _full_slot, _round_pairs, _rows, _store_query,
    _tile_positions)
from mla_tune.backends.triton_mla.hopper_loaders import _load_partition


@gluon.jit
def _token_split_mma(q_lat, q_rope, ring: Ring, prog: Program):
    """The two MMA warpgroups: scores, online softmax and `p @ v` over the program's tiles, then the epilogue.

    `warps_per_cta [4, 2]`: each warpgroup scores half of a tile's tokens (m64n32 wgmma) and owns half of
    the 512 output columns (m64n256).
    """
    if prog.QUERY_IN_CONSUMER:
        _store_query(prog, q_lat, q_rope, 8)
    BLOCK_N: gl.constexpr = prog.BLOCK_N
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, BLOCK_N // 2, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, 256, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    cols_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    rows_p: gl.constexpr = gl.SliceLayout(1, p_layout)

    qi, _, _ = _rows(prog.pid_m, prog.num_heads, rows_s, prog.Q_LEN, prog.SPARSE)
    visible_len = prog.seq_len - prog.Q_LEN + 1 + qi  # MTP: query token i sees the first seq_len - q_len + 1 + i keys
    acc = gl.zeros([ROWS, 512], gl.float32, o_layout)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, rows_s)
    l_i = gl.zeros([ROWS], gl.float32, rows_p)
    zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    for t in range(prog.n_tiles):
        pos, ok = _tile_positions(prog.start + t * BLOCK_N, prog.end, prog.seq_len, prog.topk_row, cols_s, BLOCK_N,
                                  prog.SPARSE)
        slot, phase = _full_slot(ring, t, prog.FENCE_SLOTS)
        kl = ring.k_lat.index(slot)
        s = warpgroup_mma(q_rope, ring.k_rope.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s = warpgroup_mma(q_lat, kl.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        visible = ok[None, :] & (pos[None, :] < visible_len[:, None])
        s = gl.where(visible, s * prog.qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - m_safe[:, None])
        m_i = m_new
        p_op = gl.convert_layout(_round_pairs(p, kl.dtype), p_layout)
        alpha_o = gl.convert_layout(alpha, rows_o)
        # the sums of the rounded p that `p @ v` multiplies, in its operand layout (whole rows per warpgroup)
        l_i = l_i * gl.convert_layout(alpha_o, rows_p) + gl.sum(p_op.to(gl.float32), 1)
        acc = acc * alpha_o[:, None]
        acc = warpgroup_mma(p_op, kl, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(ring.empty_bars.index(slot))
    _epilogue(acc, m_i, l_i, prog, o_layout, rows_s, 0, 512, True)


@gluon.jit
def _run_token_split(q_lat, q_rope, ring: Ring, src: KvSource, prog: Program, L2_PREFETCH: gl.constexpr,
                     LOADER_AHEAD: gl.constexpr, LOAD_REGS: gl.constexpr):
    """The token-split form's partitions: the MMA warps as the default partition, one loader warpgroup."""
    gl.warp_specialize([
        (_token_split_mma, (q_lat, q_rope, ring, prog)),
        (_load_partition, (src, ring, 0, 1, L2_PREFETCH, LOADER_AHEAD))],
        [LOAD_WARPS], [LOAD_REGS])
