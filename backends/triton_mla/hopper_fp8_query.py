"""The narrow form on e4m3 tensor cores (`FP8_QUERY`): the query and p rounded to e4m3, every product in FP8. Its
MMA warpgroup is `hopper_narrow._narrow_mma` with `FP8_QUERY`; this module holds its slots and loaders.

The narrow form casts each FP8 tile to fp16 in its loaders, since wgmma has no e4m3 x fp16 product; the stores of
those fp16 tiles keep the shared-memory pipe busier than DRAM. Here nothing is cast: the loader copies a tile's
e4m3 bytes into its slot (by TMA, `tma_tile`, or `cp.async`), the scores `s^T = k q^T` read them as they are, and
the loader writes the slot's latent columns once more, transposed (`v^T`, tokens contiguous: wgmma reads 8-bit
operands K-major only), for `o^T = v^T p^T`. Each query row is scaled so its largest magnitude is e4m3's largest
(448) before its rounding, and p is rounded as `256 x p`, so that p down to 2^-14 stays a normal e4m3 value. The
row sums add the rounded p, so the output is a weighted mean of v; the LSE reads the same sums, which p's rounding
moves by at most `log(1 + 2^-4)` (each p but the row's largest, which is exact, by at most 2^-4 of itself). Sums of
p before its rounding as well would take 16 more registers a thread, which the 32-row loop does not have.

e4m3 slots and their `v^T` take 68 KiB each, so three fit beside the query.

Both FP8-query forms copy a tile inside the program's range by TMA where the launcher gives the cache's descriptors
(`launcher.kv_descriptors`), and by `cp.async` otherwise and for a partial tile, whose rows past the range it zeroes:
stale bytes there (an e4m3 NaN) would meet p = 0 in `p @ v`.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy, fence_async_shared, mbarrier

from mla_tune.backends.triton_mla.hopper_common import (
    LOAD_WARPS, KvSource, Program, Ring, _partition_barrier)
from mla_tune.backends.triton_mla.hopper_loaders import _async_load, _tile_rows
from mla_tune.backends.triton_mla.hopper_narrow import _narrow_mma
from mla_tune.backends.triton_mla.hopper_tma import tma_reads, tma_tile


# The layout in which a loader reads each copied 128-column block back for its v^T: 4 tokens x 16 columns a thread,
# lanes and warps placed so that Triton writes v^T with stmatrix and the 16-byte reads from the slot (128-byte
# swizzle) are at most two-way bank conflicted (in the copy's own layout the 4-byte transposed stores were four-way).
_TRANSPOSE_LAYOUT = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[1, 0], [2, 0], [0, 1], [0, 2], [0, 4], [0, 8]],
    lane_bases=[[4, 0], [8, 0], [0, 32], [16, 0], [32, 0]],
    warp_bases=[[0, 16], [0, 64]], block_bases=[], shape=[64, 128]))


# 16-byte copies, eight lanes over 128 bytes of one token (fewer global lines an instruction than four lanes over 64
# bytes), conflict-free in the slot's 128-byte swizzle; the rope's 64 bytes of a token to four lanes
_COPY_LAYOUT = gl.constexpr(gl.BlockedLayout([4, 16], [4, 8], [LOAD_WARPS.value, 1], [1, 0]))
_ROPE_COPY_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 16], [8, 4], [LOAD_WARPS.value, 1], [1, 0]))
# The rope with the same rows a thread as `_COPY_LAYOUT` (8-byte copies), so the rows need no layout conversion
_ROPE_SAME_ROWS = gl.constexpr(gl.BlockedLayout([4, 8], [4, 8], [LOAD_WARPS.value, 1], [1, 0]))


@gluon.jit
def _fp8q_copy(ring: Ring, t, row, ok, ONE_COPY: gl.constexpr):
    """`cp.async` of tile `t`'s e4m3 rows (`row`, `ok` in `_COPY_LAYOUT`'s rows) into its slot, as one commit group.
    `ONE_COPY` (the wide form's choice, measured there): the latent columns as one copy (Triton orders copies into
    slices of one buffer by a barrier each) and the rope in the same rows a thread (no layout conversion); otherwise
    (the narrow form's, measured there) four 128-column copies and the rope four lanes a token."""
    slot = t % ring.STAGES
    COLS: gl.constexpr = 512 if ONE_COPY else 128
    rope_layout: gl.constexpr = _ROPE_SAME_ROWS if ONE_COPY else _ROPE_COPY_LAYOUT
    cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, _COPY_LAYOUT))
    rope_cols = gl.arange(0, 64, layout=gl.SliceLayout(0, rope_layout))
    k_lat = ring.k_lat.index(slot)
    for c in gl.static_range(512 // COLS):
        _async_load(k_lat.slice(c * COLS, COLS, dim=1), row[:, None] + c * COLS + cols[None, :], mask=ok[:, None])
    rope_row = gl.convert_layout(row, gl.SliceLayout(1, rope_layout))
    rope_ok = gl.convert_layout(ok, gl.SliceLayout(1, rope_layout))
    _async_load(ring.k_rope.index(slot), rope_row[:, None] + 512 + rope_cols[None, :], mask=rope_ok[:, None])
    async_copy.commit_group()


@gluon.jit
def _next_rows(src: KvSource, t):
    """Row pointers and validity of tile `t` of the program's range, in `_COPY_LAYOUT`'s rows."""
    return _tile_rows(src.start + t * src.BLOCK_N, src.end, src.seq_len, src.topk_row, src.bt_row, src.kv_ptr,
                      src.stride_kvp, src.stride_kvt, _COPY_LAYOUT, src.BLOCK_N, src.PAGE_SIZE, src.SPARSE)


@gluon.jit
def _store_v_t(k_lat, v_t, COL0: gl.constexpr = 0, N_COLS: gl.constexpr = 512):
    """A slot's latent columns `COL0 .. COL0 + N_COLS - 1` (`k_lat`, `[tokens, 512]`, landed and seen by this
    partition's threads) read back in `_TRANSPOSE_LAYOUT` and stored transposed into `v_t` (`[N_COLS, tokens]`)."""
    for c in gl.static_range(N_COLS // 128):
        x = k_lat.slice(COL0 + c * 128, 128, dim=1).load(_TRANSPOSE_LAYOUT)
        v_t.slice(c * 128, 128, dim=0).store(x.permute((1, 0)))


@gluon.jit
def _copied_by_all(ring: Ring, t, row, ok):
    """`_fp8q_copy` of tile `t` (four 128-column copies), landed for every thread of the loader (the read-back takes
    bytes other threads copied)."""
    _fp8q_copy(ring, t, row, ok, False)
    async_copy.wait_group(0)
    _partition_barrier()


@gluon.jit
def _fp8q_load_partition(src: KvSource, ring: Ring, v_t, landed, lat_desc, rope_desc, FIRST: gl.constexpr,
                         STRIDE: gl.constexpr, TMA: gl.constexpr):
    """A loader for tiles `FIRST, FIRST + STRIDE, ...`: once the slot is free, the tile's e4m3 rows copied into it
    (with `TMA`, a tile inside the range by `tma_tile`, landing on the slot's `landed` barrier; otherwise
    `cp.async`, then the loader's warps meet at a barrier); then the latent columns read back
    (`_TRANSPOSE_LAYOUT`) and stored once more, transposed, into `v_t`."""
    row, ok = _next_rows(src, FIRST)
    for t in range(FIRST, src.n_tiles, STRIDE):
        slot = t % ring.STAGES
        mbarrier.wait(ring.empty_bars.index(slot), ((t // ring.STAGES) & 1) ^ 1)
        if TMA:
            if tma_reads(src, t):
                tma_tile(ring, src, t, landed.index(slot), lat_desc, rope_desc)
                mbarrier.wait(landed.index(slot), (t // ring.STAGES) & 1)
            else:
                part_row, part_ok = _next_rows(src, t)
                _copied_by_all(ring, t, part_row, part_ok)
        else:
            _copied_by_all(ring, t, row, ok)
            row, ok = _next_rows(src, t + STRIDE)
        _store_v_t(ring.k_lat.index(slot), v_t.index(slot))
        fence_async_shared()
        mbarrier.arrive(ring.full_bars.index(slot))


@gluon.jit
def _run_fp8q(src: KvSource, prog: Program, LOAD_REGS: gl.constexpr, lat_desc, rope_desc, TMA: gl.constexpr):
    """This form's shared memory (e4m3 query, slots, each slot's `v^T`, p^T), its barriers and partitions: the MMA
    warpgroup as the default partition, two loaders (one every other tile)."""
    BLOCK_N: gl.constexpr = prog.BLOCK_N
    N_ROWS: gl.constexpr = prog.N_ROWS
    STAGES: gl.constexpr = prog.STAGES
    dtype: gl.constexpr = src.kv_ptr.dtype.element_ty
    lat_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 512], dtype)  # 128-byte swizzle
    narrow_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 64], dtype)  # 64-byte swizzle
    q_lat = gl.allocate_shared_memory(dtype, [N_ROWS, 512], lat_layout)
    q_rope = gl.allocate_shared_memory(dtype, [N_ROWS, 64], narrow_layout)
    k_lat = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, 512], lat_layout)
    k_rope = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, 64], narrow_layout)
    v_t = gl.allocate_shared_memory(dtype, [STAGES, 512, BLOCK_N], narrow_layout)
    p_smem = gl.allocate_shared_memory(dtype, [N_ROWS, BLOCK_N], narrow_layout)
    full_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    landed = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(full_bars.index(i), count=1)
        mbarrier.init(empty_bars.index(i), count=1)
        mbarrier.init(landed.index(i), count=1)
    ring = Ring(k_lat, k_rope, full_bars, empty_bars, STAGES)
    gl.warp_specialize([
        (_narrow_mma, (q_lat, q_rope, ring, p_smem, prog, v_t, True)),
        (_fp8q_load_partition, (src, ring, v_t, landed, lat_desc, rope_desc, 0, 2, TMA)),
        (_fp8q_load_partition, (src, ring, v_t, landed, lat_desc, rope_desc, 1, 2, TMA))],
        [LOAD_WARPS, LOAD_WARPS], [LOAD_REGS, LOAD_REGS])
