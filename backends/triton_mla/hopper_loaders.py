"""The Hopper kernel's loader partitions: one warpgroup (or two) that fills the ring's slots with KV tiles.

BF16/FP16 caches go straight into a slot with `cp.async`. FP8 caches are cast to fp16 on the way (wgmma has no
e4m3 x fp16 product): `_load_partition` loads a tile into registers once its slot is free, casts and stores it;
`_load_fp8_ahead` has the next tile's bytes in flight while it waits for the slot; `_load_partition_staged` (the
narrow form, whose smaller query leaves room) stages the bytes in shared memory with `cp.async` a tile ahead.
vLLM's fp8_ds_mla rows (`_load_ds_mla`) are dequantised on the way: each 128-value group times its float32 scale,
the bf16 RoPE columns converted, all into fp16 slots, so the MMA warps see an FP8 cache's tile with scale 1.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy, fence_async_shared, mbarrier

from mla_tune.backends.problem import DS_MLA_BYTES
from mla_tune.backends.triton_mla.hopper_common import (
    LOAD_WARPS, KvSource, Ring, _async_load, _partition_barrier, _tile_positions)
from mla_tune.backends.triton_mla.hopper_tma import tma_reads, tma_tile

DS_MLA_WORDS = gl.constexpr(DS_MLA_BYTES // 4)  # one fp8_ds_mla row in 32-bit words: 128 e4m3, 4 scales, 32 RoPE
DS_MLA_MAX_SCALE = gl.constexpr(146.0)  # 448 x 146 = 65408: the largest group scale whose values fp16 holds
# A 16-bit tile's cp.async copies: 8 values (16 bytes) a thread, a warp four 128-byte row segments at a time
_COPY_16BIT_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [LOAD_WARPS.value, 1], [1, 0]))


@gluon.jit
def _tile_rows(n0, end, seq_len, topk_row, bt_row, kv_ptr, stride_kvp, stride_kvt,
               layout: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr, SPARSE: gl.constexpr):
    """Row pointers `[BLOCK_N]` of one tile in the paged cache (in `layout`'s rows) and their validity."""
    pos, ok = _tile_positions(n0, end, seq_len, topk_row, gl.SliceLayout(1, layout), BLOCK_N, SPARSE)
    page = gl.load(bt_row + pos // PAGE_SIZE, mask=ok, other=0)
    row = kv_ptr + page.to(gl.int64) * stride_kvp + (pos % PAGE_SIZE) * stride_kvt
    return row, ok


@gluon.jit
def _copy_tile(dst_lat, dst_rope, row, ok, layout: gl.constexpr):
    """Asynchronous copy of one tile's rows (zeros for invalid rows) into `dst_lat` / `dst_rope`.

    One layout for both parts, so each thread copies the same rows of both (no layout conversion).
    """
    cols_lat = gl.arange(0, 512, layout=gl.SliceLayout(0, layout))
    _async_load(dst_lat, row[:, None] + cols_lat[None, :], mask=ok[:, None])
    cols_rope = gl.arange(0, 64, layout=gl.SliceLayout(0, layout))
    _async_load(dst_rope, 512 + row[:, None] + cols_rope[None, :], mask=ok[:, None])


@gluon.jit
def _load_chunks(row, ok, cols, STEP: gl.constexpr = 64):
    """One tile's rows as nine `[rows, STEP]` register chunks (eight latent, one rope), `STEP` elements of the row
    apart: 64 for e4m3 values, 16 for them as 32-bit words (`_load_fp8_ahead`); zeros where invalid."""
    ptrs = row[:, None] + cols[None, :]
    mask = ok[:, None]
    return (gl.load(ptrs, mask=mask, other=0.0), gl.load(ptrs + STEP, mask=mask, other=0.0),
            gl.load(ptrs + 2 * STEP, mask=mask, other=0.0), gl.load(ptrs + 3 * STEP, mask=mask, other=0.0),
            gl.load(ptrs + 4 * STEP, mask=mask, other=0.0), gl.load(ptrs + 5 * STEP, mask=mask, other=0.0),
            gl.load(ptrs + 6 * STEP, mask=mask, other=0.0), gl.load(ptrs + 7 * STEP, mask=mask, other=0.0),
            gl.load(ptrs + 8 * STEP, mask=mask, other=0.0))


@gluon.jit
def _staged_chunks(stage, half: gl.constexpr, layout: gl.constexpr):
    """Staging half `half` back in registers as nine `[rows, 64]` e4m3 chunks (as `_load_chunks` gives them)."""
    return (stage.index(half * 9).load(layout), stage.index(half * 9 + 1).load(layout),
            stage.index(half * 9 + 2).load(layout), stage.index(half * 9 + 3).load(layout),
            stage.index(half * 9 + 4).load(layout), stage.index(half * 9 + 5).load(layout),
            stage.index(half * 9 + 6).load(layout), stage.index(half * 9 + 7).load(layout),
            stage.index(half * 9 + 8).load(layout))


@gluon.jit
def _cast_chunks(xs):
    """Nine e4m3 chunks cast to fp16 (`cvt.rn.f16x2.e4m3x2`)."""
    return (xs[0].to(gl.float16), xs[1].to(gl.float16), xs[2].to(gl.float16), xs[3].to(gl.float16),
            xs[4].to(gl.float16), xs[5].to(gl.float16), xs[6].to(gl.float16), xs[7].to(gl.float16),
            xs[8].to(gl.float16))


@gluon.jit
def _store_chunks(dst_lat, dst_rope, xs):
    """Nine fp16 chunks (`_cast_chunks`) into a slot's latent and rope parts."""
    for c in gl.static_range(8):
        dst_lat.slice(c * 64, 64, dim=1).store(xs[c])
    dst_rope.store(xs[8])


@gluon.jit
def _prefetch_rows(row, ok, kv_ptr, ROW_BYTES: gl.constexpr = 576):
    """Ask the L2 for every 128-byte line of a tile's FP8 rows (`ROW_BYTES` each, at most 8 lines: the lines at
    offsets 0, 128, ... and ROW_BYTES - 1 cover them), `prefetch.global.L2`: no registers, nothing to wait for.
    Invalid rows ask for the cache's first line. `row` / `ok` in the register loader's row layout."""
    layout: gl.constexpr = gl.BlockedLayout([1, 2], [8, 4], [LOAD_WARPS, 1], [1, 0])
    rows: gl.constexpr = gl.SliceLayout(1, layout)
    offs = gl.minimum(gl.arange(0, 8, layout=gl.SliceLayout(0, layout)) * 128, ROW_BYTES - 1)
    base = gl.where(gl.convert_layout(ok, rows), gl.convert_layout(row, rows), kv_ptr)
    gl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [base[:, None] + offs[None, :]],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _words_to_fp16(w):
    """`[rows, 16]` words of four e4m3 values each -> `[rows, 64]` fp16 (exact), two `cvt.rn.f16x2.e4m3x2` a word."""
    a, b, c, d = gl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; .reg .b32 x, y; mov.b32 {lo, hi}, $4; cvt.rn.f16x2.e4m3x2 x, lo; "
        "cvt.rn.f16x2.e4m3x2 y, hi; mov.b32 {$0, $1}, x; mov.b32 {$2, $3}, y; }",
        "=h,=h,=h,=h,r", [w], dtype=(gl.float16, gl.float16, gl.float16, gl.float16), is_pure=True, pack=1)
    x = gl.join(gl.join(a, c), gl.join(b, d))  # join adds the last axis: [w, i, j] = (a, c)[i] then (b, d)[i]
    return x.reshape(w.shape[0], 4 * w.shape[1])


@gluon.jit
def _load_fp8_ahead(src: KvSource, ring: Ring, PREFETCH: gl.constexpr):
    """The FP8 register loader with the next tile's bytes in flight while it waits for that tile's slot: loaded as
    32-bit words (72 registers a thread; as e4m3 bytes LLVM keeps each byte in a register of its own) right after the
    current tile is stored; with `PREFETCH`, the L2 asked for the tile after that (`_prefetch_rows`). It needs
    `config.HOPPER_LOAD_REGS["fp8_ahead"]`: with fewer registers its loop spills the loads' destinations and so waits
    for the loads before the slot."""
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [LOAD_WARPS, 1], [1, 0])
    BLOCK_N: gl.constexpr = src.BLOCK_N
    kv_ptr = src.kv_ptr
    words = kv_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    page_words = src.stride_kvp // 4
    token_words = src.stride_kvt // 4
    cols = gl.arange(0, 16, layout=gl.SliceLayout(0, layout))
    row, ok = _tile_rows(src.start, src.end, src.seq_len, src.topk_row, src.bt_row, words, page_words, token_words,
                         layout, BLOCK_N, src.PAGE_SIZE, src.SPARSE)
    xs = _load_chunks(row, ok, cols, 16)
    row, ok = _tile_rows(src.start + BLOCK_N, src.end, src.seq_len, src.topk_row, src.bt_row, words, page_words,
                         token_words, layout, BLOCK_N, src.PAGE_SIZE, src.SPARSE)  # the rows of tile t + 1 on
    if PREFETCH:
        if src.n_tiles > 1:
            _prefetch_rows(row.to(kv_ptr.dtype, bitcast=True), ok, kv_ptr)
    for t in range(src.n_tiles):
        slot = t % ring.STAGES
        mbarrier.wait(ring.empty_bars.index(slot), ((t // ring.STAGES) & 1) ^ 1)
        for c in gl.static_range(8):
            ring.k_lat.index(slot).slice(c * 64, 64, dim=1).store(_words_to_fp16(xs[c]))
        ring.k_rope.index(slot).store(_words_to_fp16(xs[8]))
        fence_async_shared()
        mbarrier.arrive(ring.full_bars.index(slot))
        xs = _load_chunks(row, ok & (t + 1 < src.n_tiles), cols, 16)
        row, ok = _tile_rows(src.start + (t + 2) * BLOCK_N, src.end, src.seq_len, src.topk_row, src.bt_row, words,
                             page_words, token_words, layout, BLOCK_N, src.PAGE_SIZE, src.SPARSE)
        if PREFETCH:
            if t + 2 < src.n_tiles:
                _prefetch_rows(row.to(kv_ptr.dtype, bitcast=True), ok, kv_ptr)


@gluon.jit
def _load_partition(src: KvSource, ring: Ring, FIRST: gl.constexpr = 0, STRIDE: gl.constexpr = 1,
                    PREFETCH: gl.constexpr = False, AHEAD: gl.constexpr = False, lat_desc=None, rope_desc=None):
    """A loader warpgroup: fills ring slot `t % STAGES` with tile `t` once the MMA warps freed it, for tiles
    `FIRST, FIRST + STRIDE, ...` (with `STRIDE` loaders, each has its own tiles and their chains overlap).

    BF16/FP16: `cp.async` straight into the slot, 8 values (16 bytes) a thread, a warp four 128-byte row segments at
    a time; each thread's `cp.async.mbarrier.arrive.noinc` completes the slot's barrier. FP8: once the slot is free
    the tile's e4m3 bytes are loaded into registers (16 bytes a thread), all nine 64-column chunks first (Triton puts
    a barrier between the chunk stores, which would otherwise hold each chunk's load back until the previous chunk is
    stored), then cast to fp16 and stored while the MMA warps work on the other slot. With `PREFETCH` (FP8) it asks
    the L2 for the next tile's lines before it waits for that tile's slot; with `AHEAD` (FP8) it loads the next
    tile's bytes before the wait instead (`_load_fp8_ahead`). With the launcher's descriptors (16-bit, one loader):
    `_load_tma`.
    """
    if lat_desc is not None:
        gl.static_assert(FIRST == 0 and STRIDE == 1 and not src.KV_FP8, "TMA: one loader, a 16-bit cache")
        _load_tma(src, ring, lat_desc, rope_desc)
        return
    if src.DS_MLA:
        _load_ds_mla(src, ring, FIRST, STRIDE, PREFETCH)
        return
    if src.KV_FP8 and AHEAD:
        gl.static_assert(FIRST == 0 and STRIDE == 1, "LOADER_AHEAD: one loader")
        _load_fp8_ahead(src, ring, PREFETCH)
        return
    if src.KV_FP8:
        layout: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [LOAD_WARPS, 1], [1, 0])
    else:
        layout: gl.constexpr = _COPY_16BIT_LAYOUT
    BLOCK_N: gl.constexpr = src.BLOCK_N
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, layout))
    row, ok = _tile_rows(src.start + FIRST * BLOCK_N, src.end, src.seq_len, src.topk_row, src.bt_row, src.kv_ptr,
                         src.stride_kvp, src.stride_kvt, layout, BLOCK_N, src.PAGE_SIZE, src.SPARSE)
    for t in range(FIRST, src.n_tiles, STRIDE):
        slot = t % ring.STAGES
        mbarrier.wait(ring.empty_bars.index(slot), ((t // ring.STAGES) & 1) ^ 1)
        if src.KV_FP8:
            # Written out: the same stores through `_store_chunks` place two address multiply-adds differently
            # and ran 1.13-1.20x slower at FP8 64 heads.
            xs = _load_chunks(row, ok, cols)
            for c in gl.static_range(8):
                ring.k_lat.index(slot).slice(c * 64, 64, dim=1).store(xs[c].to(gl.float16))
            ring.k_rope.index(slot).store(xs[8].to(gl.float16))
            fence_async_shared()
            mbarrier.arrive(ring.full_bars.index(slot))
        else:
            _copy_tile(ring.k_lat.index(slot), ring.k_rope.index(slot), row, ok, layout)
            async_copy.mbarrier_arrive(ring.full_bars.index(slot), increment_count=False)
        row, ok = _tile_rows(src.start + (t + STRIDE) * BLOCK_N, src.end, src.seq_len, src.topk_row, src.bt_row,
                             src.kv_ptr, src.stride_kvp, src.stride_kvt, layout, BLOCK_N, src.PAGE_SIZE, src.SPARSE)
        if PREFETCH and src.KV_FP8:
            if t + STRIDE < src.n_tiles:
                _prefetch_rows(row, ok, src.kv_ptr)  # the next tile's lines, while this loader waits for a slot


@gluon.jit
def _load_tma(src: KvSource, ring: Ring, lat_desc, rope_desc):
    """The 16-bit loader by TMA: once a slot is free, a tile inside the program's range is copied into it by one
    thread (`hopper_tma.tma_tile`, completing the slot's barrier, whose one arrival is that thread's byte count); the
    partial last tile by every thread's `cp.async`, its rows past the range zeroed, fenced for wgmma by this loader,
    then one arrival once all landed.
    """
    layout: gl.constexpr = _COPY_16BIT_LAYOUT
    for t in range(src.n_tiles):
        slot = t % ring.STAGES
        mbarrier.wait(ring.empty_bars.index(slot), ((t // ring.STAGES) & 1) ^ 1)
        if tma_reads(src, t):
            tma_tile(ring, src, t, ring.full_bars.index(slot), lat_desc, rope_desc)
        else:
            row, ok = _tile_rows(src.start + t * src.BLOCK_N, src.end, src.seq_len, src.topk_row, src.bt_row,
                                 src.kv_ptr, src.stride_kvp, src.stride_kvt, layout, src.BLOCK_N, src.PAGE_SIZE,
                                 src.SPARSE)
            _copy_tile(ring.k_lat.index(slot), ring.k_rope.index(slot), row, ok, layout)
            async_copy.commit_group()
            async_copy.wait_group(0)
            fence_async_shared()  # the MMA warps do not fence the slot: the TMA copies need no fence
            _partition_barrier()
            mbarrier.arrive(ring.full_bars.index(slot))


@gluon.jit
def _stage_half(stage, half: gl.constexpr, row, ok, cols):
    """`cp.async` of one half tile's e4m3 rows (nine `[rows, 64]` chunks; zeros where invalid) into staging
    half `half`, as one commit group."""
    ptrs = row[:, None] + cols[None, :]
    for c in gl.static_range(9):
        _async_load(stage.index(half * 9 + c), ptrs + c * 64, mask=ok[:, None])
    async_copy.commit_group()


@gluon.jit
def _load_partition_staged(src: KvSource, ring: Ring, stage, FIRST_HALF: gl.constexpr = 0,
                           N_HALVES: gl.constexpr = 2):
    """An FP8 loader of the narrow form, for halves `FIRST_HALF .. FIRST_HALF + N_HALVES - 1` of every tile (one
    loader both halves, or two loaders one half each, each arriving once on the slot's barrier): the e4m3 bytes go to
    a staging ring of two half tiles with `cp.async` (16 bytes a thread), one tile ahead of the casts, so the HBM
    reads do not wait for a free slot. Per half: wait for its copies, load the bytes (each thread reads back the
    bytes it copied, so no barrier between the loader's threads), cast them to fp16, refill the staging half with the
    half one tile on, store the fp16 values into the slot.
    """
    layout: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [LOAD_WARPS, 1], [1, 0])
    HALF: gl.constexpr = src.BLOCK_N // 2
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, layout))
    for j in gl.static_range(FIRST_HALF, FIRST_HALF + N_HALVES):
        row, ok = _tile_rows(src.start + j * HALF, src.end, src.seq_len, src.topk_row, src.bt_row, src.kv_ptr,
                             src.stride_kvp, src.stride_kvt, layout, HALF, src.PAGE_SIZE, src.SPARSE)
        _stage_half(stage, j, row, ok, cols)
    for t in range(src.n_tiles):
        slot = t % ring.STAGES
        mbarrier.wait(ring.empty_bars.index(slot), ((t // ring.STAGES) & 1) ^ 1)
        for j in gl.static_range(FIRST_HALF, FIRST_HALF + N_HALVES):
            # rows of the half one tile on (a lookup ahead of its copy, as in `_load_partition`)
            row, ok = _tile_rows(src.start + (2 * t + 2 + j) * HALF, src.end, src.seq_len, src.topk_row, src.bt_row,
                                 src.kv_ptr, src.stride_kvp, src.stride_kvt, layout, HALF, src.PAGE_SIZE, src.SPARSE)
            async_copy.wait_group(N_HALVES - 1)  # this half's group; a later half's may still be in flight
            xs = _cast_chunks(_staged_chunks(stage, j, layout))
            _stage_half(stage, j, row, ok, cols)  # after the casts used the bytes it overwrites
            _store_chunks(ring.k_lat.index(slot).slice(j * HALF, HALF, dim=0),
                          ring.k_rope.index(slot).slice(j * HALF, HALF, dim=0), xs)
        fence_async_shared()
        mbarrier.arrive(ring.full_bars.index(slot))
    async_copy.wait_group(0)  # the copies past the end (zero-filled, no reads) before the program exits


@gluon.jit
def _ds_mla_rows(src: KvSource, n0, layout: gl.constexpr):
    """Word pointers to the fp8_ds_mla rows of the tile starting at item `n0` (in `layout`'s rows) and their
    validity; the rows are DS_MLA_WORDS words apart (`launcher._check_ds_mla`)."""
    words = src.kv_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    return _tile_rows(n0, src.end, src.seq_len, src.topk_row, src.bt_row, words, src.stride_kvp // 4, DS_MLA_WORDS,
                      layout, src.BLOCK_N, src.PAGE_SIZE, src.SPARSE)


@gluon.jit
def _ds_mla_load(row, ok, cols, rope_cols):
    """One tile's fp8_ds_mla rows in registers, as 32-bit words (zeros where invalid): eight `[rows, 16]` latent
    chunks of four e4m3 values a word, the four float32 group scales `[rows]`, the RoPE as `[rows, 32]` bf16 pairs;
    every load issued before any is used."""
    ptrs = row[:, None] + cols[None, :]
    mask = ok[:, None]
    return (gl.load(ptrs, mask=mask, other=0), gl.load(ptrs + 16, mask=mask, other=0),
            gl.load(ptrs + 32, mask=mask, other=0), gl.load(ptrs + 48, mask=mask, other=0),
            gl.load(ptrs + 64, mask=mask, other=0), gl.load(ptrs + 80, mask=mask, other=0),
            gl.load(ptrs + 96, mask=mask, other=0), gl.load(ptrs + 112, mask=mask, other=0),
            gl.load(row + 128, mask=ok, other=0), gl.load(row + 129, mask=ok, other=0),
            gl.load(row + 130, mask=ok, other=0), gl.load(row + 131, mask=ok, other=0),
            gl.load(row[:, None] + 132 + rope_cols[None, :], mask=mask, other=0))


@gluon.jit
def _scale_pairs(scale_bits):
    """The rows' float32 group scales (`[rows]`, their bits) as two fp16 pairs `[rows]` for `_scaled_words_to_fp16`:
    the scale rounded to fp16 and what that rounding left off, each in both halves of a word. Capped at
    DS_MLA_MAX_SCALE, so that 448 (e4m3's largest) times it stays finite in fp16."""
    s = gl.minimum(scale_bits.to(gl.float32, bitcast=True), DS_MLA_MAX_SCALE)
    return gl.inline_asm_elementwise(
        "{ .reg .b16 hi, lo; .reg .f32 h; cvt.rn.f16.f32 hi, $2; cvt.f32.f16 h, hi; sub.f32 h, $2, h; "
        "cvt.rn.f16.f32 lo, h; mov.b32 $0, {hi, hi}; mov.b32 $1, {lo, lo}; }",
        "=r,=r,r", [s], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)


@gluon.jit
def _scaled_words_to_fp16(w, scale_hi, scale_lo):
    """`[rows, 16]` words of four e4m3 values each times the rows' group scale (`_scale_pairs`) -> `[rows, 64]`
    fp16, two values an instruction: the e4m3 -> fp16 cast is exact, then `fma(x, hi, x * lo)` rounds once more.
    The low part keeps the scale's own fp16 rounding, the same for the group's 128 values, out of every score."""
    w, hi = gl.broadcast(w, gl.expand_dims(scale_hi, 1))
    w, lo = gl.broadcast(w, gl.expand_dims(scale_lo, 1))
    a, b, c, d = gl.inline_asm_elementwise(
        "{ .reg .b16 l, h; .reg .b32 x, y, u, v; mov.b32 {l, h}, $4; cvt.rn.f16x2.e4m3x2 x, l; "
        "cvt.rn.f16x2.e4m3x2 y, h; mul.rn.f16x2 u, x, $6; mul.rn.f16x2 v, y, $6; fma.rn.f16x2 x, x, $5, u; "
        "fma.rn.f16x2 y, y, $5, v; mov.b32 {$0, $1}, x; mov.b32 {$2, $3}, y; }",
        "=h,=h,=h,=h,r,r,r", [w, hi, lo], dtype=(gl.float16, gl.float16, gl.float16, gl.float16), is_pure=True,
        pack=1)
    x = gl.join(gl.join(a, c), gl.join(b, d))  # as in `_words_to_fp16`: a word's four values in order
    return x.reshape(w.shape[0], 4 * w.shape[1])


@gluon.jit
def _bf16_words_to_fp16(w):
    """`[rows, n]` words of two bf16 values each -> `[rows, 2n]` fp16 (bf16 -> fp32 is a shift; one saturating
    rounding to fp16)."""
    a, b = gl.inline_asm_elementwise(
        "{ .reg .b32 lo, hi, x; shl.b32 lo, $2, 16; and.b32 hi, $2, 0xffff0000; "
        "cvt.rn.satfinite.f16x2.f32 x, hi, lo; mov.b32 {$0, $1}, x; }",
        "=h,=h,r", [w], dtype=(gl.float16, gl.float16), is_pure=True, pack=1)
    return gl.join(a, b).reshape(w.shape[0], 2 * w.shape[1])


@gluon.jit
def _store_ds_mla(ring: Ring, slot, tile):
    """A tile from `_ds_mla_load` into ring slot `slot`: latent chunk `c` times its group's scale (`c // 2`)."""
    hi0, lo0 = _scale_pairs(tile[8])
    hi1, lo1 = _scale_pairs(tile[9])
    hi2, lo2 = _scale_pairs(tile[10])
    hi3, lo3 = _scale_pairs(tile[11])
    his = (hi0, hi1, hi2, hi3)
    los = (lo0, lo1, lo2, lo3)
    for c in gl.static_range(8):
        ring.k_lat.index(slot).slice(c * 64, 64, dim=1).store(
            _scaled_words_to_fp16(tile[c], his[c // 2], los[c // 2]))
    ring.k_rope.index(slot).store(_bf16_words_to_fp16(tile[12]))


@gluon.jit
def _load_ds_mla(src: KvSource, ring: Ring, FIRST: gl.constexpr, STRIDE: gl.constexpr, PREFETCH: gl.constexpr):
    """The loader of vLLM's fp8_ds_mla rows (656 bytes: 512 e4m3 values, a float32 scale per 128, 64 bf16 RoPE
    values), for tiles `FIRST, FIRST + STRIDE, ...`: the next tile's words are in flight while it waits for that
    tile's slot (as in `_load_fp8_ahead`, 88 registers of them); once the slot is free each 128-value group is
    multiplied by its scale in fp16 and the tile stored; with `PREFETCH` it asks the L2 for the lines of the tile
    after the next one (`_prefetch_rows`). Needs `config.HOPPER_LOAD_REGS["ds_mla"]`."""
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [LOAD_WARPS, 1], [1, 0])
    BLOCK_N: gl.constexpr = src.BLOCK_N
    cols = gl.arange(0, 16, layout=gl.SliceLayout(0, layout))
    rope_cols = gl.arange(0, 32, layout=gl.SliceLayout(0, layout))
    row, ok = _ds_mla_rows(src, src.start + FIRST * BLOCK_N, layout)
    tile = _ds_mla_load(row, ok, cols, rope_cols)
    row, ok = _ds_mla_rows(src, src.start + (FIRST + STRIDE) * BLOCK_N, layout)
    if PREFETCH:
        if FIRST + STRIDE < src.n_tiles:
            _prefetch_rows(row.to(src.kv_ptr.dtype, bitcast=True), ok, src.kv_ptr, DS_MLA_WORDS * 4)
    for t in range(FIRST, src.n_tiles, STRIDE):
        slot = t % ring.STAGES
        mbarrier.wait(ring.empty_bars.index(slot), ((t // ring.STAGES) & 1) ^ 1)
        _store_ds_mla(ring, slot, tile)
        fence_async_shared()
        mbarrier.arrive(ring.full_bars.index(slot))
        tile = _ds_mla_load(row, ok & (t + STRIDE < src.n_tiles), cols, rope_cols)
        row, ok = _ds_mla_rows(src, src.start + (t + 2 * STRIDE) * BLOCK_N, layout)
        if PREFETCH:
            if t + 2 * STRIDE < src.n_tiles:
                _prefetch_rows(row.to(src.kv_ptr.dtype, bitcast=True), ok, src.kv_ptr, DS_MLA_WORDS * 4)
