"""The narrow form on e4m3 tensor cores (`FP8_QUERY`): the query and p rounded to e4m3, every product in FP8.

The narrow form casts each FP8 tile to fp16 in its loaders, since wgmma has no e4m3 x fp16 product; the stores of
those fp16 tiles keep the shared-memory pipe busier than DRAM. Here nothing is cast: the loader copies a tile's
e4m3 bytes into its slot (`cp.async`), the scores `s^T = k q^T` read them as they are, and the loader writes the
slot's latent columns once more, transposed (`v^T`, tokens contiguous: wgmma reads 8-bit operands K-major only), for
`o^T = v^T p^T`. Each query row is scaled so its largest magnitude is e4m3's largest (448) before its rounding, and
p is rounded as `256 x p`, so that p down to 2^-14 stays a normal e4m3 value; the row sums add the rounded p.

Shared memory: the latent columns of a slot and of the query lie in eight blocks of 64 columns (64-byte rows, whose
swizzle depends on the token, so the loader's transposing reads hit every bank), and a slot's tokens (`k_empty`)
are released once the scores have read them, before its `v^T` (`v_empty`), so the next copy starts early.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy, fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait)

from mla_tune.backends.triton_mla.hopper_common import LOAD_WARPS, KvSource, Program, Ring, _rows, _tile_positions
from mla_tune.backends.triton_mla.hopper_loaders import _async_load, _tile_rows
from mla_tune.backends.triton_mla.hopper_narrow import _narrow_epilogue

E4M3_MAX = gl.constexpr(448.0)
P_LOG2_SCALE = gl.constexpr(8.0)  # p is rounded as 2^8 p
BLOCKS = gl.constexpr(8)          # latent column blocks of 64


@gluon.jit
def _store_query_e4m3(prog: Program, q_lat, q_rope, rows_layout: gl.constexpr):
    """The program's query rows, each times `448 / max |q_row|`, rounded to e4m3 into `q_lat` (`[8, rows, 64]`) and
    `q_rope` (fenced for wgmma); returns `max |q_row| / 448` per row in `rows_layout` (1 for a row of zeros or past
    the heads)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    qi, h, ok = _rows(prog.pid_m, prog.num_heads, gl.SliceLayout(1, layout), prog.Q_LEN, prog.SPARSE, prog.N_ROWS)
    q_row = prog.q_ptr + prog.b.to(gl.int64) * prog.stride_qb + qi * prog.stride_qt + h * prog.stride_qh
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, layout))
    lat = gl.load(q_row[:, None] + gl.arange(0, 512, layout=gl.SliceLayout(0, layout))[None, :],
                  mask=ok[:, None], other=0.0).to(gl.float32)
    rope = gl.load(q_row[:, None] + 512 + cols[None, :], mask=ok[:, None], other=0.0).to(gl.float32)
    amax = gl.maximum(gl.max(gl.abs(lat), 1), gl.max(gl.abs(rope), 1))
    amax = gl.where(amax > 0.0, amax, E4M3_MAX)
    scale = E4M3_MAX / amax
    for c in gl.static_range(BLOCKS):  # each block read again (from L1): one register tile a store
        block = gl.load(q_row[:, None] + c * 64 + cols[None, :], mask=ok[:, None], other=0.0).to(gl.float32)
        q_lat.index(c).store((block * scale[:, None]).to(q_lat.dtype))
    q_rope.store((rope * scale[:, None]).to(q_rope.dtype))
    fence_async_shared()
    return gl.convert_layout(amax / E4M3_MAX, rows_layout)


@gluon.jit
def _fp8q_mma(q_lat, q_rope, ring: Ring, v_t, v_empty, p_smem, prog: Program):
    """One MMA warpgroup for `N_ROWS` (16 or 32) rows, as `hopper_narrow._narrow_mma`, every product e4m3."""
    N_ROWS: gl.constexpr = prog.N_ROWS
    BLOCK_N: gl.constexpr = prog.BLOCK_N
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, N_ROWS, 32])
    toks_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    rows_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    col_scale = _store_query_e4m3(prog, q_lat, q_rope, rows_s) * prog.qk_scale

    qi, _, _ = _rows(prog.pid_m, prog.num_heads, rows_s, prog.Q_LEN, prog.SPARSE, N_ROWS)
    visible_len = prog.seq_len - prog.Q_LEN + 1 + qi
    acc = gl.zeros([512, N_ROWS], gl.float32, s_layout)
    m_i = gl.full([N_ROWS], float("-inf"), gl.float32, rows_s)
    l_acc = gl.zeros([BLOCK_N, N_ROWS], gl.float32, s_layout)
    zero_s = gl.zeros([BLOCK_N, N_ROWS], gl.float32, s_layout)
    for t in range(prog.n_tiles):
        pos, ok = _tile_positions(prog.start + t * BLOCK_N, prog.end, prog.seq_len, prog.topk_row, toks_s, BLOCK_N,
                                  prog.SPARSE)
        slot = t % ring.STAGES
        mbarrier.wait(ring.full_bars.index(slot), (t // ring.STAGES) & 1)
        s = warpgroup_mma(ring.k_rope.index(slot), q_rope.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        for c in gl.static_range(BLOCKS):
            s = warpgroup_mma(ring.k_lat.index(slot).slice(c * BLOCK_N, BLOCK_N, dim=0), q_lat.index(c).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        mbarrier.arrive(ring.empty_bars.index(slot))  # the tokens: the next copy may land
        visible = ok[:, None] & (pos[:, None] < visible_len[None, :])
        s = gl.where(visible, s * col_scale[None, :], float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 0))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - (m_safe - P_LOG2_SCALE)[None, :]).to(p_smem.dtype)
        m_i = m_new
        l_acc = l_acc * alpha[None, :] + p.to(gl.float32)
        p_smem.permute((1, 0)).store(p)
        fence_async_shared()
        acc = acc * alpha[None, :]
        acc = warpgroup_mma(v_t.index(slot), p_smem.permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(v_empty.index(slot))
    # acc and the row sums both carry p's 2^8 (the lse reads the sums alone)
    _narrow_epilogue(acc * (1.0 / 256.0), m_i, l_acc * (1.0 / 256.0), prog, s_layout)


@gluon.jit
def _fp8q_load_partition(src: KvSource, ring: Ring, v_t, v_empty, FIRST: gl.constexpr, STRIDE: gl.constexpr):
    """A loader for tiles `FIRST, FIRST + STRIDE, ...`: once the slot's tokens are free, `cp.async` of the tile's
    e4m3 rows into it; once they landed and the slot's `v^T` is free, the latent columns stored once more,
    transposed, into `v_t`, four tokens of a column to a 32-bit store (each thread reads back the bytes it copied,
    so no barrier between the loader's threads).

    A thread holds 4 tokens x 16 columns of two blocks at a time; of a warp's lanes, four pick the token group (16 of
    them) and one the column half: the copies and the reads are two-way bank conflicted at most, and so are the
    transposed stores."""
    # rows (block, token), 64 columns: 4 tokens x 16 columns a thread, a warp one block's tokens x 32 columns
    layout: gl.constexpr = gl.BlockedLayout([4, 16], [16, 2], [LOAD_WARPS, 1], [1, 0])
    rope_layout: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [LOAD_WARPS, 1], [1, 0])
    BLOCK_N: gl.constexpr = src.BLOCK_N
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, layout))
    rope_cols = gl.arange(0, 64, layout=gl.SliceLayout(0, rope_layout))
    lat, lat_ok, rope, rope_ok = _block_rows(src, src.start + FIRST * BLOCK_N, layout, rope_layout)
    for t in range(FIRST, src.n_tiles, STRIDE):
        slot = t % ring.STAGES
        phase = ((t // ring.STAGES) & 1) ^ 1
        mbarrier.wait(ring.empty_bars.index(slot), phase)
        k_lat = ring.k_lat.index(slot)
        _async_load(k_lat, lat[:, None] + cols[None, :], mask=lat_ok[:, None])
        _async_load(ring.k_rope.index(slot), rope[:, None] + rope_cols[None, :], mask=rope_ok[:, None])
        async_copy.commit_group()
        lat, lat_ok, rope, rope_ok = _block_rows(src, src.start + (t + STRIDE) * BLOCK_N, layout, rope_layout)
        async_copy.wait_group(0)
        mbarrier.wait(v_empty.index(slot), phase)
        x = k_lat.load(layout)                                          # [(block, token), column]
        v_t.index(slot).store(x.reshape([BLOCKS, BLOCK_N, 64]).permute((0, 2, 1)).reshape([BLOCKS * 64, BLOCK_N]))
        fence_async_shared()
        mbarrier.arrive(ring.full_bars.index(slot))


@gluon.jit
def _block_rows(src: KvSource, n0, layout: gl.constexpr, rope_layout: gl.constexpr):
    """Where the dense tile at item `n0` lies: for each (block, token) row of a slot (in `layout`'s rows) the address
    of the token's block of 64 latent columns, for each token (in `rope_layout`'s rows) that of its RoPE columns, and
    their validity."""
    BLOCK_N: gl.constexpr = src.BLOCK_N
    r = gl.arange(0, BLOCKS * BLOCK_N, layout=gl.SliceLayout(1, layout))
    pos = n0 + r % BLOCK_N
    lat_ok = pos < src.end
    page = gl.load(src.bt_row + pos // src.PAGE_SIZE, mask=lat_ok, other=0)
    lat = src.kv_ptr + page.to(gl.int64) * src.stride_kvp + (pos % src.PAGE_SIZE) * src.stride_kvt + r // BLOCK_N * 64
    rope, rope_ok = _tile_rows(n0, src.end, src.seq_len, src.topk_row, src.bt_row, src.kv_ptr, src.stride_kvp,
                               src.stride_kvt, rope_layout, BLOCK_N, src.PAGE_SIZE, False)
    return lat, lat_ok, rope + 512, rope_ok


@gluon.jit
def _run_fp8q(src: KvSource, prog: Program, LOAD_REGS: gl.constexpr):
    """This form's shared memory (e4m3 query, slots of eight latent blocks and RoPE, each slot's `v^T`, p^T), its
    barriers and partitions: the MMA warpgroup as the default partition, two loaders (one every other tile)."""
    BLOCK_N: gl.constexpr = prog.BLOCK_N
    N_ROWS: gl.constexpr = prog.N_ROWS
    STAGES: gl.constexpr = prog.STAGES
    dtype: gl.constexpr = src.kv_ptr.dtype.element_ty
    blocks: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 64], dtype)  # 64-byte rows
    q_lat = gl.allocate_shared_memory(dtype, [BLOCKS, N_ROWS, 64], blocks)
    q_rope = gl.allocate_shared_memory(dtype, [N_ROWS, 64], blocks)
    k_lat = gl.allocate_shared_memory(dtype, [STAGES, BLOCKS * BLOCK_N, 64], blocks)  # rows: (block, token)
    k_rope = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, 64], blocks)
    v_t = gl.allocate_shared_memory(dtype, [STAGES, 512, BLOCK_N], blocks)
    p_smem = gl.allocate_shared_memory(dtype, [N_ROWS, BLOCK_N], blocks)
    full_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(full_bars.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=1)
    ring = Ring(k_lat, k_rope, full_bars, k_empty, STAGES)
    gl.warp_specialize([
        (_fp8q_mma, (q_lat, q_rope, ring, v_t, v_empty, p_smem, prog)),
        (_fp8q_load_partition, (src, ring, v_t, v_empty, 0, 2)),
        (_fp8q_load_partition, (src, ring, v_t, v_empty, 1, 2))],
        [LOAD_WARPS, LOAD_WARPS], [LOAD_REGS, LOAD_REGS])
