"""Warp-specialised absorbed-MLA decode for Hopper (SM90), written in Gluon (Triton's tile-level dialect).

Why a second kernel: the `tl` kernel's 64-row tile (`kernel.py`) runs one 8-warp program per SM in
which every warp issues the KV loads, waits for them at a CTA-wide barrier and then computes; Nsight
Compute showed it latency- and barrier-bound at 47 % of the DRAM bandwidth (bench/TRITON_NOTES.md,
"Profile of the shipped tiles"), and Triton 3.6's `tl` has no way to give loading and computing to
different warps. Here they are different warps:

- a loader warpgroup (4 warps, few registers) streams KV tiles into a ring of `STAGES` shared-memory
  slots with `cp.async` (16 bytes a thread, rows gathered through the block table or the top-k list,
  invalid rows zero-filled) and signals each slot on an mbarrier. Row pointers are computed a tile
  ahead, so the block-table (and top-k) loads stay off its path. With an FP8 cache it loads the tile's
  e4m3 bytes into registers once the slot is free, casts them to fp16 and stores them, so the cast never
  sits on the MMA warps' path (a staging ring for `cp.async` does not fit beside 64-token slots; the 4-warp
  launch's sparse form, and its dense one for short programs, loads the next tile's bytes while it waits for the
  slot, `_load_fp8_ahead`);
- two MMA warpgroups (one 8-warp partition) hold the 64 query rows in shared memory and, per tile,
  compute the scores with `wgmma` (each warpgroup half the tile's tokens), the online softmax (the row max
  across both halves through shared memory; the row sums from p once it is in the `p @ v` operand
  layout, where each warpgroup holds whole rows) and `p @ v` (p from registers, each warpgroup 256
  of the 512 output columns), then hand the slot back.

The narrow form (`N_ROWS` 16 or 32): 64 rows on wgmma's M would leave 3/4 (1/2) of every MMA padding, so
one MMA warpgroup computes the products transposed, the tile's 64 tokens on M (`_mma_partition_narrow`). The
query then takes 18-36 KiB instead of 72, which leaves room for an FP8 staging ring of two half tiles
(`_load_partition_staged`: cp.async keeps the next tile's bytes in flight while the loader waits for a slot;
one loader warpgroup for a dense cache, two for a sparse one, each one half of every tile, `STAGED_LOADERS`);
16-bit caches use two plain loaders, one per slot. Device calls 58-59 and 66-69, bench/TRITON_NOTES.md rounds 18
and 20.

The 4-warp launch (`launch.HOPPER_KSPLIT_SHAPE`, named after its first division of the work) divides the MMA work
as FlashInfer's Hopper MLA kernel does (`_mma_partition_qk1`, round 48): warpgroup 0 scores the whole tile (m64n64
over all 576 columns), runs the softmax and hands p to warpgroup 1 over the slot's rope columns; each multiplies p by
half the value columns. Its MMA warps alone took 0.85-0.94 of the then dispatched forms' (BF16, call 170), the
kernel 0.86-0.99 of their time where the MMA warps bound (FP8 dense 64-128 heads, BF16 dense and sparse 128 heads;
bench/TRITON_NOTES.md, device calls 170-173), where `launch.HOPPER_KSPLIT_MIN_BATCH` runs it. It replaced the k-split
division (round 26: each warpgroup scored all 64 tokens over half the 576 columns and the two exchanged fp16 partial
scores), which was within 1% of it at dense BF16 128 heads batch 64-128 and slower everywhere else measured (calls
170 and 173); commit f5c05d3 has that division and round 49's variant of qk1. Where `launch.QK1_QUERY_REG_COLS` says
so (sparse 16-bit caches), warpgroup 0 keeps the query's rope and first latent columns in registers, the score wgmma's
A operand, so it reads fewer query bytes from shared memory a tile (round 62).

A program is the same unit as in `kernel.py`: 64 packed query rows (dense: `q_len x heads`, row `r` is
token `r // heads`, head `r % heads`; sparse: heads of one query token) x one split of the KV range, and
it writes the same `(out, lse)` partials, merged by `kernel._mla_combine_kernel`.

The query: code before `gl.warp_specialize` runs on the MMA warps while the loader waits, so with `QUERY_IN_CONSUMER`
each MMA partition loads the query into shared memory itself (`_store_query`) and the loader streams KV tiles from
the start: 0.91-1.00 of the time with 1-16 tiles a program (round 33). `launch.QUERY_BEFORE_PARTITIONS` keeps the old
order for the FP8 dense wide form (1.02-1.22x slower the other way: its loader's global loads wait longer, device calls
122-130) and the 4-warp launch's dense forms (calls 178 and 260-261).

Shared memory: the query (64 x 576 x 2 bytes = 72 KiB) plus `STAGES x BLOCK_N x 576 x 2` for the ring,
216 KiB for two 64-token slots (`hopper_smem_bytes`); one program per SM. Slots of 32 tokens would leave
room for more of them, but the score wgmma reads the query from shared memory at each of its 36 k-steps
whatever the slot width, so per token they move twice the query bytes: BF16 32-token slots ran 1.4-1.5x
slower with the MMA warps alone, FP8 ones (with a cp.async staging ring) 1.28x slower overall (device
call 39). A form in which each warpgroup scored the whole tile (no exchange, twice the score MMAs) ran up
to 1.4x slower than the split one (call 38); bench/TRITON_NOTES.md, rounds 11-13.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy, fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait)

ROWS = gl.constexpr(64)        # query rows per program: one wgmma M block, shared by both MMA warpgroups
LOAD_WARPS = gl.constexpr(4)   # the loader partition: one warpgroup

# Measurement only (bench/hopper_dev.py): 1 = the loader alone (the MMA warps hand every slot straight
# back), 2 = the MMA warps alone (the loader copies nothing), 3 = (token-split wide form only) no row max across
# the warpgroups and no row sums (wrong results); the token-split wide and the narrow form's MMA warps alone, in parts
# (the loader copies nothing): 4 = without `p @ v`, 5 = the score MMAs alone, 6 = (narrow form only) `p @ v` alone;
# 7 = (token-split wide and narrow forms) decoupled: both sides run in full, but neither waits for the other's barriers
# (wrong results; the time with the two sharing the SM but not waiting on each other); (narrow FP8 form only) decoupled
# with the staged loader doing only its part: 8 = its `cp.async` copies into the staging ring, 9 = its read-back, casts
# and fp16 stores (of whatever the staging ring holds); (4-warp launch only) 10 = every tile moves the running max and
# rescales the output (as before round 52; correct results), 11 = one query token's scores masked after they land, by
# row and column (as before round 55; correct results); (the wide forms) 12 = p and the final outputs rounded by
# Triton's own cast (as before round 56: one value an instruction but in the 8-warp form's p, which it packs too;
# correct results). 0 in production.
DEBUG_MODES = {"loader_only": 1, "mma_only": 2, "no_reductions": 3, "mma_no_pv": 4, "mma_scores": 5, "mma_pv": 6,
               "decoupled": 7, "decoupled_copies": 8, "decoupled_casts": 9, "qk1_eager_rescale": 10,
               "qk1_row_mask": 11, "scalar_cast": 12}
# The 4-warp launch's lazy rescale (round 52): a row's reference max moves only when the tile's max exceeds it by more
# than this many log2 units, so p stays below 2^LAZY_MAX_LOG2 (exact either way: the sums use the same reference), and
# warpgroup 1 skips rescaling its accumulator on tiles where no row's reference moved (warpgroup 0 always rescales: the
# same branch there spilled 56-336 B in offline sm_90a compiles with Triton 3.7.1).
LAZY_MAX_LOG2 = gl.constexpr(8.0)
DEBUG_MODE = 0
# Measurement only (bench/hopper_dev.py): the narrow form's FP8 loaders, 1 or 2, instead of
# `launch.HOPPER_STAGED_LOADERS`. None in production.
STAGED_LOADERS = None
# Measurement only (bench/hopper_dev.py): True / False forces the L2 evict-last hint of the epilogue's output stores
# on / off. None in production: `launch` turns it on where the outputs are split partials (more than one split).
PARTIAL_EVICT_LAST = None
# Measurement only (bench/hopper_dev.py): True / False forces who fills the query's shared memory: the MMA warps once
# the partitions run, while the loader already streams the first KV tiles (True), or every warp before the partitions
# start (False). None in production: by form, `launch.QUERY_BEFORE_PARTITIONS`.
QUERY_IN_CONSUMER = None
# Measurement only (bench/hopper_dev.py): True / False forces whether the FP8 register loader asks the L2 for the next
# tile's lines (`prefetch.global.L2`, one instruction a 128-byte line) before it waits for a free slot. None in
# production: by form, `launch.L2_PREFETCH_FORMS`.
L2_PREFETCH = None
# Measurement only (bench/hopper_dev.py): False drops the MMA warps' proxy fence after a slot's barrier where the loader
# fenced its own stores (FP8: `st.shared`, then `fence.proxy.async`, then the arrival); True keeps it. In production
# (None): `launch.HOPPER_CONSUMER_FENCE`.
CONSUMER_FENCE = None
# Measurement only (bench/hopper_dev.py): True / False forces whether the wide forms' FP8 register loader loads the next
# tile's bytes (as 32-bit words) right after it stored the current one, so they are in flight while it waits for the
# next slot (`_load_fp8_ahead`, round 59). None in production: by form, `launch.LOADER_AHEAD_FORMS`.
LOADER_AHEAD = None
# Measurement only (bench/hopper_dev.py): how many of the query's 576 columns warpgroup 0 of the 4-warp launch keeps in
# registers as the score wgmma's A operand (0, 64: the rope columns, or 64 + a multiple of 64 latent columns), so the
# score MMAs read only the rest of the query from shared memory. None in production: `launch.QK1_QUERY_REG_COLS`.
QUERY_REG_COLS = None


def hopper_smem_bytes(*, block_n: int, stages: int, rows: int = 64, kv_fp8: bool = False, ksplit: bool = False) -> int:
    """Shared memory of one program (without Triton's few KiB of reduction scratch): the query, the ring and,
    in the narrow form, `p` and (FP8) the staging ring of two half tiles of e4m3 bytes; on the 4-warp launch the
    rescale factors a slot and the row sums (p itself goes over the slot's rope columns)."""
    narrow = rows < ROWS.value
    return (rows * 576 * 2 + stages * block_n * 576 * 2 + (rows * block_n * 2 if narrow else 0)
            + (block_n * 576 if narrow and kv_fp8 else 0) + ((stages + 1) * rows * 4 if ksplit else 0))


@gluon.jit
def _rows(pid_m, num_heads, layout: gl.constexpr, Q_LEN: gl.constexpr, SPARSE: gl.constexpr,
          N_ROWS: gl.constexpr = ROWS):
    """(query token, head, valid) of the program's `N_ROWS` rows, in `layout`."""
    rows = gl.arange(0, N_ROWS, layout=layout)
    if SPARSE:
        head_blocks = gl.cdiv(num_heads, N_ROWS)
        h = (pid_m % head_blocks) * N_ROWS + rows
        qi = pid_m // head_blocks + rows * 0
        ok = h < num_heads
    else:
        r = pid_m * N_ROWS + rows
        qi = r // num_heads
        h = r % num_heads
        ok = r < Q_LEN * num_heads
    return qi, h, ok


@gluon.jit
def _load_query(q_ptr, pid_m, b, num_heads, stride_qb, stride_qt, stride_qh, q_scale, col0, layout: gl.constexpr,
                N_COLS: gl.constexpr, Q_LEN: gl.constexpr, SPARSE: gl.constexpr, N_ROWS: gl.constexpr,
                KV_FP8: gl.constexpr):
    """Columns `col0`..`col0 + N_COLS` of the program's `N_ROWS` query rows in `layout` (0 for rows past the heads;
    FP8: scaled by `q_scale`, then rounded to fp16)."""
    qi, h, row_ok = _rows(pid_m, num_heads, gl.SliceLayout(1, layout), Q_LEN, SPARSE, N_ROWS)
    q_row = q_ptr + b.to(gl.int64) * stride_qb + qi * stride_qt + h * stride_qh
    x = gl.load(q_row[:, None] + col0 + gl.arange(0, N_COLS, layout=gl.SliceLayout(0, layout))[None, :],
                mask=row_ok[:, None], other=0.0)
    if KV_FP8:
        x = (x.to(gl.float32) * q_scale).to(gl.float16)
    return x


@gluon.jit
def _store_query(q_ptr, q_lat, q_rope, pid_m, b, num_heads, stride_qb, stride_qt, stride_qh, q_scale,
                 Q_LEN: gl.constexpr, SPARSE: gl.constexpr, N_ROWS: gl.constexpr, KV_FP8: gl.constexpr,
                 WARPS: gl.constexpr):
    """The query's rows into `q_lat` / `q_rope` (`_load_query`), by `WARPS` warps: every load is issued before the
    first store, so the round trips overlap. Fenced for wgmma."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    lat = _load_query(q_ptr, pid_m, b, num_heads, stride_qb, stride_qt, stride_qh, q_scale, 0, layout, 512, Q_LEN,
                      SPARSE, N_ROWS, KV_FP8)
    rope = _load_query(q_ptr, pid_m, b, num_heads, stride_qb, stride_qt, stride_qh, q_scale, 512, layout, 64, Q_LEN,
                       SPARSE, N_ROWS, KV_FP8)
    q_rope.store(rope)
    q_lat.store(lat)
    fence_async_shared()


@gluon.jit
def _tile_positions(n0, end, seq_len, topk_row, layout: gl.constexpr, BLOCK_N: gl.constexpr, SPARSE: gl.constexpr):
    """Token positions `[BLOCK_N]` (in `layout`) of the tile starting at item `n0` and their validity: in the
    split's range, and (sparse) a top-k slot that is not -1 and inside the request."""
    offs = n0 + gl.arange(0, BLOCK_N, layout=layout)
    in_range = offs < end
    if SPARSE:
        pos = gl.load(topk_row + offs, mask=in_range, other=-1)
        ok = in_range & (pos >= 0) & (pos < seq_len)
    else:
        pos = offs
        ok = in_range
    return pos, ok


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
    async_copy.async_copy_global_to_shared(dst_lat, row[:, None] + cols_lat[None, :], mask=ok[:, None])
    cols_rope = gl.arange(0, 64, layout=gl.SliceLayout(0, layout))
    async_copy.async_copy_global_to_shared(dst_rope, 512 + row[:, None] + cols_rope[None, :], mask=ok[:, None])


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
def _prefetch_rows(row, ok, kv_ptr):
    """Ask the L2 for every 128-byte line of a tile's FP8 rows (576 bytes each: the lines at offsets 0, 128, 256, 384,
    512 and 575 cover them), `prefetch.global.L2`: no registers, nothing to wait for. Invalid rows ask for the cache's
    first line. `row` / `ok` in the register loader's row layout."""
    layout: gl.constexpr = gl.BlockedLayout([1, 2], [8, 4], [LOAD_WARPS, 1], [1, 0])
    rows: gl.constexpr = gl.SliceLayout(1, layout)
    offs = gl.minimum(gl.arange(0, 8, layout=gl.SliceLayout(0, layout)) * 128, 575)
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
def _load_fp8_ahead(kv_ptr, bt_row, topk_row, seq_len, start, n_tiles, end, stride_kvp, stride_kvt,
                    k_lat, k_rope, full_bars, empty_bars,
                    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PAGE_SIZE: gl.constexpr, SPARSE: gl.constexpr,
                    DEBUG: gl.constexpr, PREFETCH: gl.constexpr):
    """The FP8 register loader with the next tile's bytes in flight while it waits for that tile's slot (round 59, the
    forms in `launch.LOADER_AHEAD_FORMS`): loaded as 32-bit words (72 registers a thread; as e4m3 bytes LLVM keeps
    each byte in a register of its own) right after the current tile is stored; with `PREFETCH`, the L2 asked for the
    tile after that (`_prefetch_rows`) once those loads are issued. It needs `launch.HOPPER_LOAD_REGS["fp8_ahead"]`:
    with fewer registers its loop spills some of the loads' destinations and so waits for the loads before the slot."""
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [LOAD_WARPS, 1], [1, 0])
    words = kv_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    page_words = stride_kvp // 4
    token_words = stride_kvt // 4
    cols = gl.arange(0, 16, layout=gl.SliceLayout(0, layout))
    row, ok = _tile_rows(start, end, seq_len, topk_row, bt_row, words, page_words, token_words,
                         layout, BLOCK_N, PAGE_SIZE, SPARSE)
    xs = _load_chunks(row, ok & (DEBUG != 2), cols, 16)
    row, ok = _tile_rows(start + BLOCK_N, end, seq_len, topk_row, bt_row, words, page_words, token_words,
                         layout, BLOCK_N, PAGE_SIZE, SPARSE)  # the rows of tile t + 1 from here on
    if PREFETCH and DEBUG != 2:
        if n_tiles > 1:
            _prefetch_rows(row.to(kv_ptr.dtype, bitcast=True), ok, kv_ptr)
    for t in range(n_tiles):
        slot = t % STAGES
        if DEBUG < 7:
            mbarrier.wait(empty_bars.index(slot), ((t // STAGES) & 1) ^ 1)
        if DEBUG != 2:
            for c in gl.static_range(8):
                k_lat.index(slot).slice(c * 64, 64, dim=1).store(_words_to_fp16(xs[c]))
            k_rope.index(slot).store(_words_to_fp16(xs[8]))
            fence_async_shared()
        mbarrier.arrive(full_bars.index(slot))
        xs = _load_chunks(row, ok & (DEBUG != 2) & (t + 1 < n_tiles), cols, 16)
        row, ok = _tile_rows(start + (t + 2) * BLOCK_N, end, seq_len, topk_row, bt_row, words,
                             page_words, token_words, layout, BLOCK_N, PAGE_SIZE, SPARSE)
        if PREFETCH and DEBUG != 2:
            if t + 2 < n_tiles:
                _prefetch_rows(row.to(kv_ptr.dtype, bitcast=True), ok, kv_ptr)


@gluon.jit
def _load_partition(kv_ptr, bt_row, topk_row, seq_len, start, n_tiles, end, stride_kvp, stride_kvt,
                    k_lat, k_rope, full_bars, empty_bars,
                    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PAGE_SIZE: gl.constexpr, SPARSE: gl.constexpr,
                    KV_FP8: gl.constexpr, DEBUG: gl.constexpr, FIRST: gl.constexpr = 0, STRIDE: gl.constexpr = 1,
                    PREFETCH: gl.constexpr = False, AHEAD: gl.constexpr = False):
    """A loader warpgroup: fills ring slot `t % STAGES` with tile `t` once the MMA warps freed it, for tiles
    `FIRST, FIRST + STRIDE, ...` (with `STRIDE` loaders, each has its own tiles and their chains overlap).

    BF16/FP16: `cp.async` straight into the slot, 8 values (16 bytes) a thread, a warp four 128-byte row
    segments at a time; each thread's `cp.async.mbarrier.arrive.noinc` completes the slot's barrier. FP8:
    once the slot is free the tile's e4m3 bytes are loaded into registers (16 bytes a thread, four threads
    a 64-byte row segment), all nine 64-column chunks first (Triton puts a barrier between the chunk
    stores, which would otherwise hold each chunk's load back until the previous chunk is stored), then
    cast to fp16 and stored while the MMA warps work on the other slot. With `PREFETCH` (FP8, the forms in
    `launch.L2_PREFETCH_FORMS`) it asks the L2 for the next tile's lines (`_prefetch_rows`) before it waits for that
    tile's slot (round 35). With `AHEAD` (FP8, `launch.LOADER_AHEAD_FORMS`) the next tile's bytes are loaded before
    the wait instead (`_load_fp8_ahead`).
    """
    if KV_FP8 and AHEAD:
        gl.static_assert(FIRST == 0 and STRIDE == 1, "LOADER_AHEAD: one loader")
        _load_fp8_ahead(kv_ptr, bt_row, topk_row, seq_len, start, n_tiles, end, stride_kvp, stride_kvt, k_lat, k_rope,
                        full_bars, empty_bars, BLOCK_N, STAGES, PAGE_SIZE, SPARSE, DEBUG, PREFETCH)
        return
    if KV_FP8:
        layout: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [LOAD_WARPS, 1], [1, 0])
    else:
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [LOAD_WARPS, 1], [1, 0])
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, layout))
    row, ok = _tile_rows(start + FIRST * BLOCK_N, end, seq_len, topk_row, bt_row, kv_ptr, stride_kvp, stride_kvt,
                         layout, BLOCK_N, PAGE_SIZE, SPARSE)
    for t in range(FIRST, n_tiles, STRIDE):
        slot = t % STAGES
        if DEBUG < 7:  # 7-9: the loader does not wait for the MMA warps (measurement)
            mbarrier.wait(empty_bars.index(slot), ((t // STAGES) & 1) ^ 1)
        if KV_FP8:
            if DEBUG != 2:
                # Written out, not through `_store_chunks`: the same stores through that helper compile to the
                # same PTX but for where two address multiply-adds sit, and ran 1.13-1.20x slower at FP8 64 heads
                # (device calls 79-81, same process, bench/TRITON_NOTES.md round 21).
                xs = _load_chunks(row, ok, cols)
                for c in gl.static_range(8):
                    k_lat.index(slot).slice(c * 64, 64, dim=1).store(xs[c].to(gl.float16))
                k_rope.index(slot).store(xs[8].to(gl.float16))
                fence_async_shared()
            mbarrier.arrive(full_bars.index(slot))
        else:
            if DEBUG != 2:
                _copy_tile(k_lat.index(slot), k_rope.index(slot), row, ok, layout)
            async_copy.mbarrier_arrive(full_bars.index(slot), increment_count=False)
        row, ok = _tile_rows(start + (t + STRIDE) * BLOCK_N, end, seq_len, topk_row, bt_row, kv_ptr,
                             stride_kvp, stride_kvt, layout, BLOCK_N, PAGE_SIZE, SPARSE)
        if PREFETCH and KV_FP8 and DEBUG != 2:
            if t + STRIDE < n_tiles:
                _prefetch_rows(row, ok, kv_ptr)  # the next tile's lines, while this loader waits for a slot
    if DEBUG == 7 and not KV_FP8:
        async_copy.commit_group()  # (mode 7: no MMA warp waited for these copies to land before the program exits)
        async_copy.wait_group(0)


@gluon.jit
def _stage_half(stage, half: gl.constexpr, row, ok, cols):
    """`cp.async` of one half tile's e4m3 rows (nine `[rows, 64]` chunks; zeros where invalid) into staging
    half `half`, as one commit group."""
    ptrs = row[:, None] + cols[None, :]
    for c in gl.static_range(9):
        async_copy.async_copy_global_to_shared(stage.index(half * 9 + c), ptrs + c * 64, mask=ok[:, None])
    async_copy.commit_group()


@gluon.jit
def _load_partition_staged(kv_ptr, bt_row, topk_row, seq_len, start, n_tiles, end, stride_kvp, stride_kvt,
                           k_lat, k_rope, stage, full_bars, empty_bars,
                           BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PAGE_SIZE: gl.constexpr,
                           SPARSE: gl.constexpr, DEBUG: gl.constexpr, FIRST_HALF: gl.constexpr = 0,
                           N_HALVES: gl.constexpr = 2):
    """An FP8 loader of the narrow form, for halves `FIRST_HALF .. FIRST_HALF + N_HALVES - 1` of every tile
    (one loader both halves, or two loaders one half each, each arriving once on the slot's barrier): the
    e4m3 bytes go to a staging ring of two half tiles with `cp.async` (16 bytes a thread), one tile ahead of
    the casts, so the HBM reads do not wait for a free slot (the register-staged loader has one tile in
    flight at a time). Per half: wait for its copies, load the bytes (each thread reads back the bytes it
    copied, so no barrier between the loader's threads), cast them to fp16, refill the staging half with the
    half one tile on, store the fp16 values into the slot.
    """
    layout: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [LOAD_WARPS, 1], [1, 0])
    HALF: gl.constexpr = BLOCK_N // 2
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, layout))
    for j in gl.static_range(FIRST_HALF, FIRST_HALF + N_HALVES):
        row, ok = _tile_rows(start + j * HALF, end, seq_len, topk_row, bt_row, kv_ptr, stride_kvp, stride_kvt,
                             layout, HALF, PAGE_SIZE, SPARSE)
        if DEBUG != 2:
            _stage_half(stage, j, row, ok, cols)
    for t in range(n_tiles):
        slot = t % STAGES
        if DEBUG < 7:  # 7-9: the loader does not wait for the MMA warps (measurement)
            mbarrier.wait(empty_bars.index(slot), ((t // STAGES) & 1) ^ 1)
        for j in gl.static_range(FIRST_HALF, FIRST_HALF + N_HALVES):
            # rows of the half one tile on (a lookup ahead of its copy, as in `_load_partition`)
            row, ok = _tile_rows(start + (2 * t + 2 + j) * HALF, end, seq_len, topk_row, bt_row, kv_ptr,
                                 stride_kvp, stride_kvt, layout, HALF, PAGE_SIZE, SPARSE)
            if DEBUG == 8:  # (measurement) the copies alone
                async_copy.wait_group(N_HALVES - 1)
                _stage_half(stage, j, row, ok, cols)
            elif DEBUG == 9:  # (measurement) the read-back, casts and stores alone (written as call 167 ran it)
                _store_chunks(k_lat.index(slot).slice(j * HALF, HALF, dim=0),
                              k_rope.index(slot).slice(j * HALF, HALF, dim=0),
                              _cast_chunks(_staged_chunks(stage, j, layout)))
            elif DEBUG != 2:
                async_copy.wait_group(N_HALVES - 1)  # this half's group; a later half's may still be in flight
                xs = _cast_chunks(_staged_chunks(stage, j, layout))
                _stage_half(stage, j, row, ok, cols)  # after the casts used the bytes it overwrites
                _store_chunks(k_lat.index(slot).slice(j * HALF, HALF, dim=0),
                              k_rope.index(slot).slice(j * HALF, HALF, dim=0), xs)
        fence_async_shared()
        mbarrier.arrive(full_bars.index(slot))
    async_copy.wait_group(0)  # the copies past the end (zero-filled, no reads) before the program exits


@gluon.jit
def _full_slot(full_bars, t, STAGES: gl.constexpr, FENCE_SLOTS: gl.constexpr, DEBUG: gl.constexpr = 0):
    """(ring slot, barrier phase) of tile `t`, once its loader has filled the slot; fenced for wgmma where
    `FENCE_SLOTS` (cp.async wrote it through the generic proxy, and wgmma reads it asynchronously). Measurement modes
    7-9: without the wait."""
    slot = t % STAGES
    phase = (t // STAGES) & 1
    if DEBUG < 7 or DEBUG > 9:
        mbarrier.wait(full_bars.index(slot), phase)
    if FENCE_SLOTS:
        fence_async_shared()
    return slot, phase


@gluon.jit
def _hand_back(full_bars, empty_bars, n_tiles, STAGES: gl.constexpr):
    """Measurement mode 1 (loader alone): the MMA warps hand every slot back as soon as it is full."""
    for t in range(n_tiles):
        mbarrier.wait(full_bars.index(t % STAGES), (t // STAGES) & 1)
        mbarrier.arrive(empty_bars.index(t % STAGES))


@gluon.jit
def _inv_sums(l_i, out_scale):
    """`out_scale / l` per row, 0 for a row that saw nothing (its output is zeros)."""
    return gl.where(l_i > 0.0, out_scale / gl.where(l_i > 0.0, l_i, 1.0), 0.0)


@gluon.jit
def _lse(m_i, l_i):
    """Natural-log LSE from the base-2 running max and sum; -inf for a row that saw nothing."""
    return gl.where(l_i > 0.0, (m_i + gl.log2(gl.where(l_i > 0.0, l_i, 1.0))) * 0.6931471805599453, float("-inf"))


@gluon.jit
def _round_pairs(x, dtype: gl.constexpr, SCALAR: gl.constexpr = False):
    """fp32 `x` rounded to `dtype`; bf16 two values an instruction (`cvt.rn.bf16x2.f32`, round 56): from the scalar cast
    ptxas makes one `F2F.BF16.F32` a value (fp16 casts it packs into `F2FP.F16.F32.PACK_AB` by itself). `SCALAR`
    (measurement mode 12): the scalar cast."""
    if dtype == gl.bfloat16 and not SCALAR:
        return gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [x], dtype=gl.bfloat16,
                                         is_pure=True, pack=2)
    else:
        return x.to(dtype)


@gluon.jit
def _store_out(ptrs, values, mask, EVICT_LAST: gl.constexpr):
    """The epilogue's output store; `EVICT_LAST` (split partials): with an L2 evict-last hint, meant to keep them
    in L2 for the combine. Measured on an H100 (same-process A/Bs, bench/hopper_dev.py): 0.968 (BF16) / 0.975 (FP8)
    of the time at 32/64 heads, batch 4-64 (call 115), 0.93-1.02 per shape where there are splits and up to 1.045x on
    final outputs, one split (call 114); a warm-L2 profile (call 119) showed the gain in this kernel, not in the
    combine, for reasons not established."""
    if EVICT_LAST:
        gl.store(ptrs, values, mask=mask, eviction_policy="evict_last")
    else:
        gl.store(ptrs, values, mask=mask)


@gluon.jit
def _epilogue(acc, m_i, l_i, o_ptr, lse_ptr, pid_m, b, split, num_heads, store_o, out_scale, stride_ob, stride_os,
              stride_ot, stride_oh, stride_lb, stride_ls, stride_lt, stride_lh, o_layout: gl.constexpr,
              rows_m: gl.constexpr, Q_LEN: gl.constexpr, SPARSE: gl.constexpr, EVICT_LAST: gl.constexpr,
              COL0: gl.constexpr, N_COLS: gl.constexpr, WRITE_LSE: gl.constexpr, SCALAR_CAST: gl.constexpr = False):
    """The wide forms' epilogue (the program's rows on M): output columns `COL0 .. COL0 + N_COLS - 1` of `acc` (in
    `o_layout`) normalised by the row sums (the partial or final output) and, with `WRITE_LSE`, the LSE from the
    base-2 running max `m_i` (in `rows_m`); `l_i` in any row layout."""
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    qi_o, h_o, ok_o = _rows(pid_m, num_heads, rows_o, Q_LEN, SPARSE)
    cols_o = COL0 + gl.arange(0, N_COLS, layout=gl.SliceLayout(0, o_layout))
    o_row = o_ptr + b.to(gl.int64) * stride_ob + split * stride_os + qi_o * stride_ot + h_o * stride_oh
    inv_l = _inv_sums(gl.convert_layout(l_i, rows_o), out_scale)
    values = _round_pairs(acc * inv_l[:, None], o_ptr.dtype.element_ty, SCALAR_CAST)
    _store_out(o_row[:, None] + cols_o[None, :], values, (ok_o & store_o)[:, None] & (cols_o[None, :] < 512),
               EVICT_LAST)
    if WRITE_LSE:
        qi_l, h_l, ok_l = _rows(pid_m, num_heads, rows_m, Q_LEN, SPARSE)
        lse = _lse(m_i, gl.convert_layout(l_i, rows_m))
        gl.store(lse_ptr + b.to(gl.int64) * stride_lb + split * stride_ls + qi_l * stride_lt + h_l * stride_lh,
                 lse, mask=ok_l)


@gluon.jit
def _mma_partition(q_lat, q_rope, k_lat, k_rope, full_bars, empty_bars, o_ptr, lse_ptr, topk_row,
                   pid_m, b, split, seq_len, num_heads, start, end, n_tiles, store_o, qk_scale, out_scale,
                   stride_ob, stride_os, stride_ot, stride_oh, stride_lb, stride_ls, stride_lt, stride_lh,
                   q_ptr, stride_qb, stride_qt, stride_qh, q_scale,
                   BLOCK_N: gl.constexpr, STAGES: gl.constexpr, Q_LEN: gl.constexpr, SPARSE: gl.constexpr,
                   DEBUG: gl.constexpr, KV_FP8: gl.constexpr, QUERY_IN_CONSUMER: gl.constexpr,
                   FENCE_SLOTS: gl.constexpr, EVICT_LAST: gl.constexpr = False):
    """The two MMA warpgroups: scores, online softmax and `p @ v` over the program's tiles, then the epilogue.

    `warps_per_cta [4, 2]`: each warpgroup scores half of a tile's tokens (m64n32 wgmma) and owns half of
    the 512 output columns (m64n256).
    """
    if QUERY_IN_CONSUMER:
        _store_query(q_ptr, q_lat, q_rope, pid_m, b, num_heads, stride_qb, stride_qt, stride_qh, q_scale, Q_LEN,
                     SPARSE, ROWS, KV_FP8, 8)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, BLOCK_N // 2, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, 256, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    cols_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    rows_p: gl.constexpr = gl.SliceLayout(1, p_layout)

    qi, _, _ = _rows(pid_m, num_heads, rows_s, Q_LEN, SPARSE)
    visible_len = seq_len - Q_LEN + 1 + qi  # MTP: query token i sees the first seq_len - q_len + 1 + i keys
    acc = gl.zeros([ROWS, 512], gl.float32, o_layout)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, rows_s)
    l_i = gl.zeros([ROWS], gl.float32, rows_p)
    zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    s_sum = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)  # (measurement mode 5 only)
    if DEBUG == 1:
        _hand_back(full_bars, empty_bars, n_tiles, STAGES)
    for t in range(n_tiles if DEBUG != 1 else 0):
        pos, ok = _tile_positions(start + t * BLOCK_N, end, seq_len, topk_row, cols_s, BLOCK_N, SPARSE)
        slot, phase = _full_slot(full_bars, t, STAGES, FENCE_SLOTS, DEBUG)
        kl = k_lat.index(slot)
        s = warpgroup_mma(q_rope, k_rope.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s = warpgroup_mma(q_lat, kl.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        if DEBUG == 5:  # the score MMAs alone (kept alive by a sum in registers, reduced once after the loop)
            s_sum = s_sum + s
        else:
            visible = ok[None, :] & (pos[None, :] < visible_len[:, None])
            s = gl.where(visible, s * qk_scale, float("-inf"))
            if DEBUG == 3:
                m_new = m_i
            else:
                m_new = gl.maximum(m_i, gl.max(s, 1))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
            alpha = gl.exp2(m_i - m_safe)
            p = gl.exp2(s - m_safe[:, None])
            m_i = m_new
            p_op = gl.convert_layout(_round_pairs(p, kl.dtype, DEBUG == 12), p_layout)
            alpha_o = gl.convert_layout(alpha, rows_o)
            if DEBUG != 3:
                # Row sums from p in the `p @ v` operand layout, where each warpgroup holds whole rows: no exchange
                # between the warpgroups (the sums are of the rounded p that `p @ v` multiplies).
                l_i = l_i * gl.convert_layout(alpha_o, rows_p) + gl.sum(p_op.to(gl.float32), 1)
            acc = acc * alpha_o[:, None]
            if DEBUG != 4:  # 4: no `p @ v`
                acc = warpgroup_mma(p_op, kl, acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty_bars.index(slot))
    if DEBUG == 5:
        m_i = gl.max(s_sum, 1)

    _epilogue(acc, m_i, l_i, o_ptr, lse_ptr, pid_m, b, split, num_heads, store_o, out_scale, stride_ob, stride_os,
              stride_ot, stride_oh, stride_lb, stride_ls, stride_lt, stride_lh, o_layout, rows_s, Q_LEN, SPARSE,
              EVICT_LAST, 0, 512, True, DEBUG == 12)


@gluon.jit
def _mma_partition_narrow(q_lat, q_rope, k_lat, k_rope, p_smem, full_bars, empty_bars, o_ptr, lse_ptr, topk_row,
                          pid_m, b, split, seq_len, num_heads, start, end, n_tiles, store_o, qk_scale, out_scale,
                          stride_ob, stride_os, stride_ot, stride_oh, stride_lb, stride_ls, stride_lt, stride_lh,
                          q_ptr, stride_qb, stride_qt, stride_qh, q_scale,
                          N_ROWS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, Q_LEN: gl.constexpr,
                          SPARSE: gl.constexpr, DEBUG: gl.constexpr, KV_FP8: gl.constexpr,
                          QUERY_IN_CONSUMER: gl.constexpr, FENCE_SLOTS: gl.constexpr,
                          EVICT_LAST: gl.constexpr = False):
    """One MMA warpgroup for `N_ROWS` (16 or 32) rows, the products transposed so the tokens are wgmma's M:
    `s^T = k q^T` (m64, n = N_ROWS) and `o^T = v^T p^T` (m512 as eight m64 blocks, v^T read from the slot
    in its transposed form, p^T from shared memory). With 64 rows on M, 16 heads would waste 3/4 of every
    MMA (the wide kernel's form); here each MMA does only the rows there are, and the softmax (over the
    tokens, dim 0) needs no exchange with another warpgroup.
    """
    if QUERY_IN_CONSUMER:
        _store_query(q_ptr, q_lat, q_rope, pid_m, b, num_heads, stride_qb, stride_qt, stride_qh, q_scale, Q_LEN,
                     SPARSE, N_ROWS, KV_FP8, 4)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, N_ROWS, 16])
    toks_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    rows_s: gl.constexpr = gl.SliceLayout(0, s_layout)

    qi, _, _ = _rows(pid_m, num_heads, rows_s, Q_LEN, SPARSE, N_ROWS)
    visible_len = seq_len - Q_LEN + 1 + qi
    acc = gl.zeros([512, N_ROWS], gl.float32, s_layout)
    m_i = gl.full([N_ROWS], float("-inf"), gl.float32, rows_s)
    l_acc = gl.zeros([BLOCK_N, N_ROWS], gl.float32, s_layout)
    zero_s = gl.zeros([BLOCK_N, N_ROWS], gl.float32, s_layout)
    s_sum = gl.zeros([BLOCK_N, N_ROWS], gl.float32, s_layout)  # (measurement mode 5 only)
    if DEBUG == 1:
        _hand_back(full_bars, empty_bars, n_tiles, STAGES)
    for t in range(n_tiles if DEBUG != 1 else 0):
        pos, ok = _tile_positions(start + t * BLOCK_N, end, seq_len, topk_row, toks_s, BLOCK_N, SPARSE)
        slot, phase = _full_slot(full_bars, t, STAGES, FENCE_SLOTS, DEBUG)
        kl = k_lat.index(slot)
        if DEBUG == 6:  # `o^T = v^T p^T` alone (p^T: whatever `p_smem` holds)
            acc = warpgroup_mma(kl.permute((1, 0)), p_smem.permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        else:
            s = warpgroup_mma(k_rope.index(slot), q_rope.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            s = warpgroup_mma(kl, q_lat.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            if DEBUG == 5:  # the score MMAs alone (kept alive by a sum in registers, reduced once after the loop)
                s_sum = s_sum + s
            else:
                visible = ok[:, None] & (pos[:, None] < visible_len[None, :])
                s = gl.where(visible, s * qk_scale, float("-inf"))
                m_new = gl.maximum(m_i, gl.max(s, 0))
                m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
                alpha = gl.exp2(m_i - m_safe)
                # (round 56's packed cast here: 0-2.6% slower at sparse 16-32 heads batch 64, device call 204)
                p = gl.exp2(s - m_safe[None, :]).to(kl.dtype)
                m_i = m_new
                # The row sums of the rounded p that `o^T = v^T p^T` multiplies, kept per token and reduced over the
                # tokens (across the four warps) once, after the loop, not per tile (round 21: 0.93-0.95 of the time
                # at FP8 batch 128 kv 16k, device call 77).
                l_acc = l_acc * alpha[None, :] + p.to(gl.float32)
                p_smem.permute((1, 0)).store(p)
                fence_async_shared()
                acc = acc * alpha[None, :]
                if DEBUG != 4:  # 4: no `p @ v`
                    acc = warpgroup_mma(kl.permute((1, 0)), p_smem.permute((1, 0)), acc, is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty_bars.index(slot))
    if DEBUG == 5:
        m_i = gl.max(s_sum, 0)

    # Epilogue: the partial (or final) output, transposed (each lane's values of one row are 8 columns apart
    # from its neighbours', so the stores still fill 32-byte sectors), and the LSE.
    l_i = gl.sum(l_acc, 0)
    qi, h, ok = _rows(pid_m, num_heads, rows_s, Q_LEN, SPARSE, N_ROWS)
    cols = gl.arange(0, 512, layout=toks_s)
    o_row = o_ptr + b.to(gl.int64) * stride_ob + split * stride_os + qi * stride_ot + h * stride_oh
    inv_l = _inv_sums(l_i, out_scale)
    _store_out(o_row[None, :] + cols[:, None], (acc * inv_l[None, :]).to(o_ptr.dtype.element_ty),
               (ok & store_o)[None, :] & (cols[:, None] < 512), EVICT_LAST)
    lse = _lse(m_i, l_i)
    gl.store(lse_ptr + b.to(gl.int64) * stride_lb + split * stride_ls + qi * stride_lt + h * stride_lh,
             lse, mask=ok)


@gluon.jit
def _qk1_scores(q_lat, q_rope, q_regs, k_lat, k_rope, slot, zero_s, REG_COLS: gl.constexpr = 0):
    """`_mma_partition_qk1`'s score MMAs of ring slot `slot` (m64n64 over all 576 columns), issued, not waited for.
    With `REG_COLS` the query's first `REG_COLS` columns (rope first, then latent) come from registers (`q_regs`: the
    rope columns and, above 64, the first latent ones, `_qk1_query_regs`)."""
    if REG_COLS == 0:
        s = warpgroup_mma(q_rope, k_rope.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        return warpgroup_mma(q_lat, k_lat.index(slot).permute((1, 0)), s, is_async=True)
    else:
        q_rope_regs, q_lat_regs = q_regs
        s = warpgroup_mma(q_rope_regs, k_rope.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        LAT: gl.constexpr = REG_COLS - 64
        if LAT > 0:
            s = warpgroup_mma(q_lat_regs, k_lat.index(slot).slice(0, LAT, dim=1).permute((1, 0)), s, is_async=True)
        # the other latent columns in power-of-two slices, each aligned to its width
        gl.static_assert(LAT == 0 or LAT == 64 or LAT == 128 or LAT == 256, "QUERY_REG_COLS: 64, 128, 192 or 320")
        kl = k_lat.index(slot)
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
def _qk1_query_regs(q_ptr, pid_m, b, num_heads, stride_qb, stride_qt, stride_qh, q_scale, s_layout: gl.constexpr,
                    REG_COLS: gl.constexpr, Q_LEN: gl.constexpr, SPARSE: gl.constexpr, KV_FP8: gl.constexpr):
    """The query's columns that `_qk1_scores` takes from registers, loaded from global memory (so no barrier orders
    them after the shared-memory copy): (rope, the first `REG_COLS - 64` latent columns, or the rope again where
    there are none), in the score wgmma's A-operand layout; (0, 0) without `REG_COLS`."""
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    if REG_COLS == 0:
        return 0, 0
    else:
        rope = _load_query(q_ptr, pid_m, b, num_heads, stride_qb, stride_qt, stride_qh, q_scale, 512, a_layout, 64,
                           Q_LEN, SPARSE, ROWS, KV_FP8)
        if REG_COLS > 64:
            return rope, _load_query(q_ptr, pid_m, b, num_heads, stride_qb, stride_qt, stride_qh, q_scale, 0,
                                     a_layout, REG_COLS - 64, Q_LEN, SPARSE, ROWS, KV_FP8)
        else:
            return rope, rope


@gluon.jit
def _qk1_tile(s, acc, m_i, l_i, t, k_lat, k_rope, alpha_smem, p_bars, topk_row, start, end, seq_len,
              visible_len, qk_scale, s_layout: gl.constexpr, o_layout: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, SPARSE: gl.constexpr, DEBUG: gl.constexpr, Q_LEN: gl.constexpr):
    """Warpgroup 0 of `_mma_partition_qk1` on tile `t`, once its score MMAs `s` are issued: waits for them, runs the
    online softmax, hands p (over the slot's rope columns, whose last reader was that score MMA) and the rescale
    factors to warpgroup 1, rescales its output columns and issues `p @ v` on value columns 0-255 (one wgmma group,
    not waited for). Returns (the output accumulator, running max, running sum)."""
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    p_smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    slot = t % STAGES
    kl = k_lat.index(slot)
    pos, ok = _tile_positions(start + t * BLOCK_N, end, seq_len, topk_row, gl.SliceLayout(0, s_layout), BLOCK_N,
                              SPARSE)
    # One query token (round 55): it sees the whole request, which `ok` already checks (dense: end <= seq_len; sparse:
    # pos < seq_len), so its mask is a column bias, computed while the score MMAs run: one FMA an element after them.
    COLUMN_BIAS: gl.constexpr = Q_LEN == 1 and DEBUG != 11
    if COLUMN_BIAS:
        bias = gl.where(ok, 0.0, float("-inf"))
    scores = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    if COLUMN_BIAS:
        scores = scores * qk_scale + bias[None, :]
    else:
        visible = ok[None, :] & (pos[None, :] < visible_len[:, None])
        scores = gl.where(visible, scores * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(scores, 1))
    if DEBUG != 10:  # lazy: keep the old reference unless the row's max grew by more than LAZY_MAX_LOG2
        m_new = gl.where(m_new > m_i + LAZY_MAX_LOG2, m_new, m_i)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    # lazy: 1 also where nothing was visible before (its output and sum are still 0), so no rescale is needed there
    alpha = gl.exp2(m_i - m_safe) if DEBUG == 10 else gl.where(m_i == float("-inf"), 1.0, gl.exp2(m_i - m_safe))
    p = gl.exp2(scores - m_safe[:, None])
    p = _round_pairs(p, kl.dtype, DEBUG == 12)
    l_i = l_i * alpha + gl.sum(p.to(gl.float32), 1)  # the sums of the rounded p that `p @ v` multiplies
    k_rope.index(slot)._reinterpret(kl.dtype, [ROWS, BLOCK_N], p_smem_layout).store(p)
    alpha_smem.index(slot).store(alpha)
    fence_async_shared()
    mbarrier.arrive(p_bars.index(slot))
    acc = acc * gl.convert_layout(alpha, rows_o)[:, None]
    acc = warpgroup_mma(gl.convert_layout(p, p_layout), kl.slice(0, 256, dim=1), acc, is_async=True)
    return acc, m_new, l_i


@gluon.jit
def _mma_partition_qk1(q_lat, q_rope, k_lat, k_rope, alpha_smem, l_smem, full_bars, empty_bars, p_bars, l_bar,
                       o_ptr, lse_ptr, topk_row, pid_m, b, split, seq_len, num_heads, start, end, n_tiles, store_o,
                       qk_scale, out_scale, stride_ob, stride_os, stride_ot, stride_oh, stride_lb, stride_ls,
                       stride_lt, stride_lh, q_ptr, stride_qb, stride_qt, stride_qh, q_scale,
                       BLOCK_N: gl.constexpr, STAGES: gl.constexpr, Q_LEN: gl.constexpr, SPARSE: gl.constexpr,
                       DEBUG: gl.constexpr, WG: gl.constexpr, KV_FP8: gl.constexpr, QUERY_IN_CONSUMER: gl.constexpr,
                       FENCE_SLOTS: gl.constexpr, EVICT_LAST: gl.constexpr = False, REG_COLS: gl.constexpr = 0):
    """One of the 4-warp launch's two MMA warpgroups, which divide a tile's work as FlashInfer's Hopper MLA kernel
    does. Warpgroup 0 scores all 64 tokens over all 576 columns (one
    m64n64 wgmma chain: the query read once a tile, no partial scores to exchange), runs the online softmax (rows on
    M: the row max and sums stay inside each quad of lanes) and hands p to warpgroup 1 in the slot's rope columns
    (which only its own finished score MMAs read) with the tile's rescale factors; each then multiplies p by its
    256 of the 512 value columns (warpgroup 0 from registers, warpgroup 1 from shared memory). Warpgroup 1 never
    scores, so the softmax runs once a tile, not twice; at the end warpgroup 0 hands over the row sums.
    """
    if QUERY_IN_CONSUMER:
        if WG == 0:
            _store_query(q_ptr, q_lat, q_rope, pid_m, b, num_heads, stride_qb, stride_qt, stride_qh, q_scale, Q_LEN,
                         SPARSE, ROWS, KV_FP8, 4)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 256, 16])
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    p_smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    acc = gl.zeros([ROWS, 256], gl.float32, o_layout)
    if WG == 0:
        qi, _, _ = _rows(pid_m, num_heads, rows_s, Q_LEN, SPARSE)
        visible_len = seq_len - Q_LEN + 1 + qi  # MTP: query token i sees the first seq_len - q_len + 1 + i keys
        m_i = gl.full([ROWS], float("-inf"), gl.float32, rows_s)
        l_i = gl.zeros([ROWS], gl.float32, rows_s)
        zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
        q_regs = _qk1_query_regs(q_ptr, pid_m, b, num_heads, stride_qb, stride_qt, stride_qh, q_scale, s_layout,
                                 REG_COLS, Q_LEN, SPARSE, KV_FP8)
        if DEBUG == 1:
            _hand_back(full_bars, empty_bars, n_tiles, STAGES)
        for t in range(n_tiles if DEBUG != 1 else 0):
            slot, phase = _full_slot(full_bars, t, STAGES, FENCE_SLOTS)
            acc, m_i, l_i = _qk1_tile(_qk1_scores(q_lat, q_rope, q_regs, k_lat, k_rope, slot, zero_s, REG_COLS),
                                      acc, m_i, l_i, t,
                                      k_lat, k_rope, alpha_smem, p_bars, topk_row, start, end, seq_len,
                                      visible_len, qk_scale, s_layout, o_layout, BLOCK_N, STAGES, SPARSE, DEBUG,
                                      Q_LEN)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty_bars.index(slot))
        l_smem.store(l_i)
        mbarrier.arrive(l_bar)
        _epilogue(acc, m_i, l_i, o_ptr, lse_ptr, pid_m, b, split, num_heads, store_o, out_scale, stride_ob,
                  stride_os, stride_ot, stride_oh, stride_lb, stride_ls, stride_lt, stride_lh, o_layout, rows_s, Q_LEN,
                  SPARSE, EVICT_LAST, 0, 256, True, DEBUG == 12)
    else:
        if DEBUG == 1:
            _hand_back(full_bars, empty_bars, n_tiles, STAGES)
        for t in range(n_tiles if DEBUG != 1 else 0):
            slot, phase = _full_slot(full_bars, t, STAGES, FENCE_SLOTS)
            mbarrier.wait(p_bars.index(slot), phase)
            kl = k_lat.index(slot)
            alpha = alpha_smem.index(slot).load(rows_o)
            if DEBUG == 10:
                acc = acc * alpha[:, None]
            elif gl.min(alpha, 0) < 1.0:  # some row's reference moved (round 52)
                acc = acc * alpha[:, None]
            acc = warpgroup_mma(k_rope.index(slot)._reinterpret(kl.dtype, [ROWS, BLOCK_N], p_smem_layout),
                                kl.slice(256, 256, dim=1), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty_bars.index(slot))
        mbarrier.wait(l_bar, 0)
        l_i = l_smem.load(rows_o)
        _epilogue(acc, l_i, l_i, o_ptr, lse_ptr, pid_m, b, split, num_heads, store_o, out_scale, stride_ob,
                  stride_os, stride_ot, stride_oh, stride_lb, stride_ls, stride_lt, stride_lh, o_layout, rows_o, Q_LEN,
                  SPARSE, EVICT_LAST, 256, 256, False, DEBUG == 12)


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
    DEBUG: gl.constexpr = 0, N_ROWS: gl.constexpr = ROWS, STAGED_LOADERS: gl.constexpr = 1,
    KSPLIT: gl.constexpr = False, MMA_REGS: gl.constexpr = 0, PARTIAL_EVICT_LAST: gl.constexpr = False,
    QUERY_IN_CONSUMER: gl.constexpr = False, L2_PREFETCH: gl.constexpr = False, CONSUMER_FENCE: gl.constexpr = True,
    LOADER_AHEAD: gl.constexpr = False, QUERY_REG_COLS: gl.constexpr = 0,
):
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
    # Split 0 always stores (zeros, lse -inf for an empty request); other empty splits store only lse.
    store_o = (start < n_items) | (split == 0)

    if KV_SCALE_IS_PTR:
        kv_scale = gl.load(kv_scale_ptr).to(gl.float32)
    qk_scale = sm_scale_log2 * kv_scale
    if KV_FP8:
        qk_scale = qk_scale / q_scale  # the query was scaled by q_scale before its fp16 rounding

    # The query's shared memory (FP8: scaled by q_scale, then rounded to fp16), filled here by every warp before the
    # partitions start or (QUERY_IN_CONSUMER) by the MMA warps themselves, while the loader already streams KV tiles.
    mma_dtype: gl.constexpr = gl.float16 if KV_FP8 else q_ptr.dtype.element_ty
    smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_lat = gl.allocate_shared_memory(mma_dtype, [N_ROWS, 512], smem_layout)
    q_rope = gl.allocate_shared_memory(mma_dtype, [N_ROWS, 64], smem_layout)
    if not QUERY_IN_CONSUMER:
        _store_query(q_ptr, q_lat, q_rope, pid_m, b, num_heads, stride_qb, stride_qt, stride_qh, q_scale, Q_LEN,
                     SPARSE, N_ROWS, KV_FP8, gl.num_warps())

    # Whether the MMA warps fence a full slot for wgmma: always after cp.async (16-bit caches); the FP8 loaders store
    # through registers and fence their own stores before they arrive, so there only with CONSUMER_FENCE (round 36).
    FENCE_SLOTS: gl.constexpr = CONSUMER_FENCE or not KV_FP8
    k_lat = gl.allocate_shared_memory(mma_dtype, [STAGES, BLOCK_N, 512], smem_layout)
    k_rope = gl.allocate_shared_memory(mma_dtype, [STAGES, BLOCK_N, 64], smem_layout)
    full_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        # BF16: every loader thread arrives when its own copies land; FP8: one arrival per loader after its casts.
        mbarrier.init(full_bars.index(i), count=(STAGED_LOADERS if N_ROWS < ROWS else 1) if KV_FP8
                      else LOAD_WARPS * 32)
        mbarrier.init(empty_bars.index(i), count=2 if KSPLIT else 1)

    bt_row = block_table_ptr + b.to(gl.int64) * stride_btb
    if N_ROWS < ROWS:  # the narrow form: p^T for `o^T = v^T p^T`, and (FP8) the staging ring of two half tiles
        p_smem = gl.allocate_shared_memory(mma_dtype, [N_ROWS, BLOCK_N], smem_layout)
        if KV_FP8:
            stage = gl.allocate_shared_memory(kv_ptr.dtype.element_ty, [18, BLOCK_N // 2, 64],
                                              gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    # (The argument tuples are written out in the calls: a tuple bound to a name loses its constexprs.)
    # Measurement modes by form (`DEBUG_MODES`): 1-2 in every form, 3-5 and 7 in the token-split wide form, 4-7 in the
    # narrow form, 8-9 in the narrow FP8 form (its staged loader), 10-11 in the 4-warp launch, 12 in both wide forms; in
    # modes 4-6 the loaders copy nothing (as in mode 2).
    NARROW: gl.constexpr = N_ROWS < ROWS
    gl.static_assert(DEBUG <= 2 or (NARROW and DEBUG >= 4 and (DEBUG <= 7 or (KV_FP8 and DEBUG <= 9)))
                     or (not NARROW and not KSPLIT and DEBUG != 6 and DEBUG <= 7)
                     or (KSPLIT and DEBUG >= 10 and DEBUG <= 11) or (not NARROW and DEBUG == 12),
                     "this form of the Hopper kernel has no such measurement mode (hopper.DEBUG_MODES)")
    LOADER_DEBUG: gl.constexpr = 2 if DEBUG >= 4 and DEBUG <= 6 else 0 if DEBUG >= 10 else DEBUG
    if N_ROWS < ROWS and KV_FP8 and STAGED_LOADERS == 2:
        gl.warp_specialize([
            (_mma_partition_narrow, (q_lat, q_rope, k_lat, k_rope, p_smem, full_bars, empty_bars, o_ptr, lse_ptr,
                                     topk_row, pid_m, b, split, seq_len, num_heads, start, end, n_tiles, store_o,
                                     qk_scale, kv_scale, stride_ob, stride_os, stride_ot, stride_oh, stride_lb,
                                     stride_ls, stride_lt, stride_lh, q_ptr, stride_qb, stride_qt, stride_qh, q_scale,
                                     N_ROWS, BLOCK_N, STAGES, Q_LEN, SPARSE, DEBUG, KV_FP8, QUERY_IN_CONSUMER,
                                     FENCE_SLOTS, PARTIAL_EVICT_LAST)),
            (_load_partition_staged, (kv_ptr, bt_row, topk_row, seq_len, start, n_tiles, end, stride_kvp,
                                      stride_kvt, k_lat, k_rope, stage, full_bars, empty_bars, BLOCK_N, STAGES,
                                      PAGE_SIZE, SPARSE, LOADER_DEBUG, 0, 1)),
            (_load_partition_staged, (kv_ptr, bt_row, topk_row, seq_len, start, n_tiles, end, stride_kvp,
                                      stride_kvt, k_lat, k_rope, stage, full_bars, empty_bars, BLOCK_N, STAGES,
                                      PAGE_SIZE, SPARSE, LOADER_DEBUG, 1, 1))],
            [LOAD_WARPS, LOAD_WARPS], [LOAD_REGS, LOAD_REGS])
    elif N_ROWS < ROWS and KV_FP8:
        gl.warp_specialize([
            (_mma_partition_narrow, (q_lat, q_rope, k_lat, k_rope, p_smem, full_bars, empty_bars, o_ptr, lse_ptr,
                                     topk_row, pid_m, b, split, seq_len, num_heads, start, end, n_tiles, store_o,
                                     qk_scale, kv_scale, stride_ob, stride_os, stride_ot, stride_oh, stride_lb,
                                     stride_ls, stride_lt, stride_lh, q_ptr, stride_qb, stride_qt, stride_qh, q_scale,
                                     N_ROWS, BLOCK_N, STAGES, Q_LEN, SPARSE, DEBUG, KV_FP8, QUERY_IN_CONSUMER,
                                     FENCE_SLOTS, PARTIAL_EVICT_LAST)),
            (_load_partition_staged, (kv_ptr, bt_row, topk_row, seq_len, start, n_tiles, end, stride_kvp,
                                      stride_kvt, k_lat, k_rope, stage, full_bars, empty_bars, BLOCK_N, STAGES,
                                      PAGE_SIZE, SPARSE, LOADER_DEBUG))],
            [LOAD_WARPS], [LOAD_REGS])
    elif N_ROWS < ROWS:
        gl.warp_specialize([
            (_mma_partition_narrow, (q_lat, q_rope, k_lat, k_rope, p_smem, full_bars, empty_bars, o_ptr, lse_ptr,
                                     topk_row, pid_m, b, split, seq_len, num_heads, start, end, n_tiles, store_o,
                                     qk_scale, kv_scale, stride_ob, stride_os, stride_ot, stride_oh, stride_lb,
                                     stride_ls, stride_lt, stride_lh, q_ptr, stride_qb, stride_qt, stride_qh, q_scale,
                                     N_ROWS, BLOCK_N, STAGES, Q_LEN, SPARSE, DEBUG, KV_FP8, QUERY_IN_CONSUMER,
                                     FENCE_SLOTS, PARTIAL_EVICT_LAST)),
            (_load_partition, (kv_ptr, bt_row, topk_row, seq_len, start, n_tiles, end, stride_kvp, stride_kvt,
                               k_lat, k_rope, full_bars, empty_bars, BLOCK_N, STAGES, PAGE_SIZE, SPARSE, KV_FP8,
                               LOADER_DEBUG, 0, 2)),
            (_load_partition, (kv_ptr, bt_row, topk_row, seq_len, start, n_tiles, end, stride_kvp, stride_kvt,
                               k_lat, k_rope, full_bars, empty_bars, BLOCK_N, STAGES, PAGE_SIZE, SPARSE, KV_FP8,
                               LOADER_DEBUG, 1, 2))],
            [LOAD_WARPS, LOAD_WARPS], [LOAD_REGS, LOAD_REGS])
    elif KSPLIT:
        # the 4-warp launch (FlashInfer's division): warpgroup 0 the default partition, warpgroup 1 a worker
        alpha_smem = gl.allocate_shared_memory(gl.float32, [STAGES, ROWS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        l_smem = gl.allocate_shared_memory(gl.float32, [ROWS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        p_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        l_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(p_bars.index(i), count=1)
        mbarrier.init(l_bar, count=1)
        gl.warp_specialize([
            (_mma_partition_qk1, (q_lat, q_rope, k_lat, k_rope, alpha_smem, l_smem, full_bars, empty_bars, p_bars,
                                  l_bar, o_ptr, lse_ptr, topk_row, pid_m, b, split, seq_len, num_heads, start, end,
                                  n_tiles, store_o, qk_scale, kv_scale, stride_ob, stride_os, stride_ot, stride_oh,
                                  stride_lb, stride_ls, stride_lt, stride_lh, q_ptr, stride_qb, stride_qt, stride_qh,
                                  q_scale, BLOCK_N, STAGES, Q_LEN, SPARSE, DEBUG, 0, KV_FP8, QUERY_IN_CONSUMER,
                                  FENCE_SLOTS, PARTIAL_EVICT_LAST, QUERY_REG_COLS)),
            (_mma_partition_qk1, (q_lat, q_rope, k_lat, k_rope, alpha_smem, l_smem, full_bars, empty_bars, p_bars,
                                  l_bar, o_ptr, lse_ptr, topk_row, pid_m, b, split, seq_len, num_heads, start, end,
                                  n_tiles, store_o, qk_scale, kv_scale, stride_ob, stride_os, stride_ot, stride_oh,
                                  stride_lb, stride_ls, stride_lt, stride_lh, q_ptr, stride_qb, stride_qt, stride_qh,
                                  q_scale, BLOCK_N, STAGES, Q_LEN, SPARSE, DEBUG, 1, KV_FP8, QUERY_IN_CONSUMER,
                                  FENCE_SLOTS, PARTIAL_EVICT_LAST, QUERY_REG_COLS)),
            (_load_partition, (kv_ptr, bt_row, topk_row, seq_len, start, n_tiles, end, stride_kvp, stride_kvt,
                               k_lat, k_rope, full_bars, empty_bars, BLOCK_N, STAGES, PAGE_SIZE, SPARSE, KV_FP8,
                               LOADER_DEBUG, 0, 1, L2_PREFETCH, LOADER_AHEAD))],
            [4, LOAD_WARPS], [MMA_REGS, LOAD_REGS])
    else:
        gl.warp_specialize([
            (_mma_partition, (q_lat, q_rope, k_lat, k_rope, full_bars, empty_bars, o_ptr, lse_ptr, topk_row,
                              pid_m, b, split, seq_len, num_heads, start, end, n_tiles, store_o, qk_scale,
                              kv_scale, stride_ob, stride_os, stride_ot, stride_oh, stride_lb, stride_ls,
                              stride_lt, stride_lh, q_ptr, stride_qb, stride_qt, stride_qh, q_scale, BLOCK_N,
                              STAGES, Q_LEN, SPARSE, DEBUG, KV_FP8, QUERY_IN_CONSUMER, FENCE_SLOTS,
                              PARTIAL_EVICT_LAST)),
            (_load_partition, (kv_ptr, bt_row, topk_row, seq_len, start, n_tiles, end, stride_kvp, stride_kvt,
                               k_lat, k_rope, full_bars, empty_bars, BLOCK_N, STAGES, PAGE_SIZE, SPARSE, KV_FP8,
                               LOADER_DEBUG, 0, 1, L2_PREFETCH, LOADER_AHEAD))],
            [LOAD_WARPS], [LOAD_REGS])
