"""The Hopper kernel's narrow form: 16 or 32 query rows, one MMA warpgroup on transposed products.

With 64 rows on wgmma's M, 16 heads would leave 3/4 of every MMA padding. Here the tile's 64 tokens are M:
`s^T = k q^T` (m64, n = rows) and `o^T = v^T p^T` (m512 as eight m64 blocks, v^T read from the slot transposed,
p^T from shared memory), and the softmax over the tokens needs no exchange with another warpgroup. The query takes
18-36 KiB instead of 72, which leaves room for an FP8 staging ring (`hopper_loaders._load_partition_staged`): one
loader warpgroup for a dense cache, two for a sparse one (their lookups and gathers run side by side); 16-bit
caches and fp8_ds_mla rows use two plain loaders, one per slot, or, where the launcher gives a 16-bit cache's
descriptors (`dispatch.copies_by_tma`), one TMA loader.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait)

from mla_tune.backends.triton_mla.hopper_common import (
    LOAD_WARPS, KvSource, Program, Ring, _full_slot, _inv_sums, _lse, _rows, _store_out, _store_query,
    _store_query_e4m3, _tile_positions)
from mla_tune.backends.triton_mla.hopper_loaders import _load_partition, _load_partition_staged


@gluon.jit
def _narrow_epilogue(acc, m_i, l_acc, prog: Program, s_layout: gl.constexpr):
    """The partial (or final) output, transposed (each lane's values of one row are 8 columns apart from its
    neighbours', so the stores still fill 32-byte sectors), and the LSE; `l_acc`: the per-token row sums."""
    toks_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    rows_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    l_i = gl.sum(l_acc, 0)
    qi, h, ok = _rows(prog.pid_m, prog.num_heads, rows_s, prog.Q_LEN, prog.SPARSE, prog.N_ROWS)
    cols = gl.arange(0, 512, layout=toks_s)
    o_row = (prog.o_ptr + prog.b.to(gl.int64) * prog.stride_ob + prog.split * prog.stride_os + qi * prog.stride_ot
             + h * prog.stride_oh)
    inv_l = _inv_sums(l_i, prog.out_scale)
    _store_out(o_row[None, :] + cols[:, None], (acc * inv_l[None, :]).to(prog.o_ptr.dtype.element_ty),
               (ok & prog.store_o)[None, :] & (cols[:, None] < 512), prog.EVICT_LAST)
    lse = _lse(m_i, l_i)
    gl.store(prog.lse_ptr + prog.b.to(gl.int64) * prog.stride_lb + prog.split * prog.stride_ls + qi * prog.stride_lt
             + h * prog.stride_lh, lse, mask=ok)


@gluon.jit
def _narrow_mma(q_lat, q_rope, ring: Ring, p_smem, prog: Program, v_t=None, FP8_QUERY: gl.constexpr = False):
    """One MMA warpgroup for `N_ROWS` (16 or 32) rows, the products transposed so the tokens are wgmma's M.

    With `FP8_QUERY` (`hopper_fp8_query.py`) every operand is e4m3: these warps round the query with a scale per row
    (`_store_query_e4m3`), p is rounded as `2^8 p` (down to 2^-14 it stays a normal e4m3 value) and v^T is read from
    `v_t`, the loaders' transposed copy of each slot's value columns."""
    if prog.QUERY_IN_CONSUMER and not FP8_QUERY:  # FP8_QUERY: stored below, with its scales in the row layout
        _store_query(prog, q_lat, q_rope, 4)
    N_ROWS: gl.constexpr = prog.N_ROWS
    BLOCK_N: gl.constexpr = prog.BLOCK_N
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, N_ROWS, 32 if FP8_QUERY else 16])
    toks_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    rows_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    if FP8_QUERY:
        score_scale = _store_query_e4m3(prog, q_lat, q_rope, rows_s) * prog.qk_scale
    P_LOG2_SCALE: gl.constexpr = 8.0 if FP8_QUERY else 0.0

    qi, _, _ = _rows(prog.pid_m, prog.num_heads, rows_s, prog.Q_LEN, prog.SPARSE, N_ROWS)
    visible_len = prog.seq_len - prog.Q_LEN + 1 + qi
    acc = gl.zeros([512, N_ROWS], gl.float32, s_layout)
    m_i = gl.full([N_ROWS], float("-inf"), gl.float32, rows_s)
    l_acc = gl.zeros([BLOCK_N, N_ROWS], gl.float32, s_layout)
    zero_s = gl.zeros([BLOCK_N, N_ROWS], gl.float32, s_layout)
    for t in range(prog.n_tiles):
        pos, ok = _tile_positions(prog.start + t * BLOCK_N, prog.end, prog.seq_len, prog.topk_row, toks_s, BLOCK_N,
                                  prog.SPARSE)
        slot, phase = _full_slot(ring, t, prog.FENCE_SLOTS)
        kl = ring.k_lat.index(slot)
        s = warpgroup_mma(ring.k_rope.index(slot), q_rope.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s = warpgroup_mma(kl, q_lat.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        visible = ok[:, None] & (pos[:, None] < visible_len[None, :])
        if FP8_QUERY:
            s = gl.where(visible, s * score_scale[None, :], float("-inf"))
        else:
            s = gl.where(visible, s * prog.qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 0))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        alpha = gl.exp2(m_i - m_safe)
        if FP8_QUERY:
            p = gl.exp2(s - (m_safe - P_LOG2_SCALE)[None, :]).to(p_smem.dtype)
        else:
            p = gl.exp2(s - m_safe[None, :]).to(kl.dtype)  # the packed bf16 cast was slower here
        m_i = m_new
        # Row sums of the rounded p, kept per token and reduced over the tokens once after the loop, not per tile.
        l_acc = l_acc * alpha[None, :] + p.to(gl.float32)
        p_smem.permute((1, 0)).store(p)
        fence_async_shared()
        acc = acc * alpha[None, :]
        if FP8_QUERY:
            acc = warpgroup_mma(v_t.index(slot), p_smem.permute((1, 0)), acc, is_async=True)
        else:
            acc = warpgroup_mma(kl.permute((1, 0)), p_smem.permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(ring.empty_bars.index(slot))
    if FP8_QUERY:  # acc and the row sums both carry p's 2^8
        _narrow_epilogue(acc * (1.0 / 256.0), m_i, l_acc * (1.0 / 256.0), prog, s_layout)
    else:
        _narrow_epilogue(acc, m_i, l_acc, prog, s_layout)


@gluon.jit
def _run_narrow(q_lat, q_rope, ring: Ring, src: KvSource, prog: Program, STAGED_LOADERS: gl.constexpr,
                LOAD_REGS: gl.constexpr, lat_desc=None, rope_desc=None):
    """The narrow form's partitions: p^T's shared memory, (FP8) the staging ring of two half tiles, the MMA
    warpgroup as the default partition and the loaders (`STAGED_LOADERS` staged FP8 loaders, or two plain ones, one
    per slot, for a 16-bit cache or fp8_ds_mla rows, whose loaders also ask the L2 for their tile after next; with
    the launcher's descriptors one TMA loader)."""
    mma_dtype: gl.constexpr = gl.float16 if prog.KV_FP8 else prog.q_ptr.dtype.element_ty
    smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    p_smem = gl.allocate_shared_memory(mma_dtype, [prog.N_ROWS, prog.BLOCK_N], smem_layout)
    if prog.KV_FP8 and not src.DS_MLA:
        stage = gl.allocate_shared_memory(src.kv_ptr.dtype.element_ty, [18, prog.BLOCK_N // 2, 64],
                                          gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        if STAGED_LOADERS == 2:
            gl.warp_specialize([
                (_narrow_mma, (q_lat, q_rope, ring, p_smem, prog)),
                (_load_partition_staged, (src, ring, stage, 0, 1)),
                (_load_partition_staged, (src, ring, stage, 1, 1))],
                [LOAD_WARPS, LOAD_WARPS], [LOAD_REGS, LOAD_REGS])
        else:
            gl.warp_specialize([
                (_narrow_mma, (q_lat, q_rope, ring, p_smem, prog)),
                (_load_partition_staged, (src, ring, stage))],
                [LOAD_WARPS], [LOAD_REGS])
    elif lat_desc is not None:
        gl.warp_specialize([
            (_narrow_mma, (q_lat, q_rope, ring, p_smem, prog)),
            (_load_partition, (src, ring, 0, 1, False, False, lat_desc, rope_desc))],
            [LOAD_WARPS], [LOAD_REGS])
    else:
        gl.warp_specialize([
            (_narrow_mma, (q_lat, q_rope, ring, p_smem, prog)),
            (_load_partition, (src, ring, 0, 2, src.DS_MLA)),
            (_load_partition, (src, ring, 1, 2, src.DS_MLA))],
            [LOAD_WARPS, LOAD_WARPS], [LOAD_REGS, LOAD_REGS])
