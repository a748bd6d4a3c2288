"""Every dispatch table of the kernels, and the functions that read them.

`default_tile` picks a tile from the problem and the GPU; `candidate_tiles` lists what the tuner times around it;
`hopper_constexprs` picks the Hopper kernel's per-form switches. The measurement behind each entry is in
docs/kernels.md ("Dispatch table"); a key `(kind, bucket)` is the KV kind ("16bit" or "fp8") and the packed query
rows rounded up to 16, 32, 64 or 128 (`config.rows_bucket`).
"""

from __future__ import annotations

from dataclasses import dataclass

from mla_tune.backends.triton_mla.config import (
    BIG_TILE_CC_MAJORS, HOPPER_CC_MAJORS, HOPPER_FP8_QUERY_SHAPES, HOPPER_FP8_QUERY_WIDE_AHEAD_SHAPE, HOPPER_LOAD_REGS,
    HOPPER_NARROW_SHAPES, HOPPER_QK1_SHAPE, HOPPER_TOKEN_SPLIT_SHAPE, PARAM_SPACE, QK1_WORKER_REGS,
    FP8_QUERY_WIDE_PV_REGS, LaunchParams, Tile, hopper_tile, packed_rows, rows_bucket)


@dataclass(frozen=True)
class ShortBatch:
    """Dense requests shorter than HOPPER_MIN_ITEMS take the Hopper kernel from `min_batch`, if they have at least
    `min_items` items (shorter ones from HOPPER_SHORT_BATCH_DEFAULT)."""

    min_batch: int
    min_items: int = 0


@dataclass(frozen=True, kw_only=True)
class MinBatch:
    """The smallest batch from which a kernel form replaces the tl tile (None: never), dense and sparse."""

    dense: int | None
    sparse: int | None

    def takes(self, *, batch: int, sparse: bool) -> bool:
        min_batch = self.sparse if sparse else self.dense
        return min_batch is not None and batch >= min_batch


@dataclass(frozen=True, kw_only=True)
class SmallBatch:
    """A tile that replaces the table's tile up to `max_batch` requests."""

    max_batch: int
    tile: Tile


@dataclass(frozen=True, kw_only=True)
class LongerSplits:
    """From `min_batch` requests, splits of at least `min_split_tokens` instead of the tile's own minimum."""

    min_batch: int
    min_split_tokens: int


def _tl(*, block_h, block_n, num_warps, num_stages, per_sm, min_split_tokens, reload_v=False, **flags) -> Tile:
    """A tl-kernel tile; every tl table entry splits the latent columns (`split_d`)."""
    return Tile(block_h=block_h, block_n=block_n, num_warps=num_warps, num_stages=num_stages, split_d=True,
                per_sm=per_sm, reload_v=reload_v, min_split_tokens=min_split_tokens, **flags)


# The tl kernel's tile by (kind, bucket), dense.
TILE_TABLE = {
    ("16bit", 16): _tl(block_h=16, block_n=32, num_warps=4, num_stages=2, per_sm=3, min_split_tokens=64),
    # two 16-row blocks share each KV tile through L2
    ("16bit", 32): _tl(block_h=16, block_n=32, num_warps=4, num_stages=3, per_sm=2, min_split_tokens=128,
                       hoist_pages=64),
    ("16bit", 64): _tl(block_h=64, block_n=64, num_warps=8, num_stages=2, per_sm=1, min_split_tokens=64),
    ("16bit", 128): _tl(block_h=64, block_n=64, num_warps=8, num_stages=2, per_sm=1, min_split_tokens=64,
                        split_scores=True),
    ("fp8", 16): _tl(block_h=16, block_n=32, num_warps=4, num_stages=2, per_sm=2, min_split_tokens=64,
                     reload_v=True, hoist_pages=64, fp16_math=True),
    ("fp8", 32): _tl(block_h=32, block_n=32, num_warps=4, num_stages=2, per_sm=2, min_split_tokens=32,
                     reload_v=True, hoist_pages=64, fp16_math=True, opaque_v_cast=True),
    ("fp8", 64): _tl(block_h=64, block_n=64, num_warps=8, num_stages=2, per_sm=1, min_split_tokens=64,
                     fp16_math=True),
    ("fp8", 128): _tl(block_h=64, block_n=64, num_warps=8, num_stages=2, per_sm=1, min_split_tokens=64,
                      fp16_math=True),
}
# The same for sparse (top-k) decode: a program's rows are the heads of one query token.
SPARSE_TILE_TABLE = {
    ("16bit", 16): _tl(block_h=16, block_n=32, num_warps=4, num_stages=3, per_sm=2, min_split_tokens=64,
                       hoist_pages=64),
    ("16bit", 32): _tl(block_h=32, block_n=32, num_warps=4, num_stages=3, per_sm=2, min_split_tokens=64,
                       hoist_pages=64),
    ("16bit", 64): TILE_TABLE[("16bit", 64)],
    ("16bit", 128): TILE_TABLE[("16bit", 128)],
    ("fp8", 16): _tl(block_h=16, block_n=32, num_warps=4, num_stages=2, per_sm=2, min_split_tokens=64,
                     reload_v=True, fp16_math=True),
    ("fp8", 32): _tl(block_h=32, block_n=32, num_warps=4, num_stages=2, per_sm=2, min_split_tokens=32,
                     reload_v=True, fp16_math=True, opaque_v_cast=True),
    ("fp8", 64): TILE_TABLE[("fp8", 64)],
    ("fp8", 128): TILE_TABLE[("fp8", 128)],
}
# Few requests: a narrower tile's extra programs beat the wider tile's single read of each KV tile.
SMALL_BATCH_TILES = {
    ("fp8", 32): SmallBatch(max_batch=4, tile=_tl(block_h=16, block_n=32, num_warps=4, num_stages=2, per_sm=2,
                                                  min_split_tokens=64, reload_v=True, hoist_pages=64,
                                                  fp16_math=True)),
    ("16bit", 64): SmallBatch(max_batch=1, tile=TILE_TABLE[("16bit", 16)]),
}
SPARSE_SMALL_BATCH_TILES = {
    ("fp8", 32): SmallBatch(max_batch=4, tile=SPARSE_TILE_TABLE[("fp8", 16)]),
    ("16bit", 32): SmallBatch(max_batch=16, tile=_tl(block_h=16, block_n=32, num_warps=4, num_stages=3, per_sm=2,
                                                     min_split_tokens=128)),
}

# The Hopper kernel's tiles: one program per SM, splits of at least 128 tokens.
HOPPER_TOKEN_SPLIT_TILE = hopper_tile(HOPPER_TOKEN_SPLIT_SHAPE)
HOPPER_NARROW_TILES = {rows: hopper_tile(shape) for rows, shape in HOPPER_NARROW_SHAPES.items()}
HOPPER_TILES = {64: HOPPER_TOKEN_SPLIT_TILE, **HOPPER_NARROW_TILES}  # by rows bucket
HOPPER_QK1_TILE = hopper_tile(HOPPER_QK1_SHAPE)
# Where each Hopper form replaces the tl tile on SM90, tried in this order (narrow, qk1, token-split). 16-bit dense
# 32 rows on the narrow form whatever the length, since its tiles go by TMA: H200 (tma-16bit-h200.txt 3), 24-32 heads
# with 1k-3k tokens, over the token-split form (tl below batch 16 at 1k): 0.925 uniform, 0.926 ragged of the time.
HOPPER_NARROW_MIN_BATCH = {
    ("fp8", 16): MinBatch(dense=1, sparse=1), ("fp8", 32): MinBatch(dense=1, sparse=1),
    ("16bit", 16): MinBatch(dense=1, sparse=16), ("16bit", 32): MinBatch(dense=1, sparse=64),
}
HOPPER_QK1_MIN_BATCH = {
    ("16bit", 64): MinBatch(dense=16, sparse=1), ("16bit", 128): MinBatch(dense=4, sparse=1),
    ("fp8", 64): MinBatch(dense=1, sparse=64), ("fp8", 128): MinBatch(dense=16, sparse=64),
}
HOPPER_TOKEN_SPLIT_MIN_BATCH = {  # dense 16-bit 32 rows: the narrow form, at every batch
    ("16bit", 32): MinBatch(dense=None, sparse=4), ("16bit", 64): MinBatch(dense=1, sparse=1),
    ("16bit", 128): MinBatch(dense=1, sparse=1), ("fp8", 64): MinBatch(dense=1, sparse=1),
    ("fp8", 128): MinBatch(dense=1, sparse=1),
}
# Sparse requests on the qk1 form that take longer splits.
HOPPER_QK1_SPARSE_SPLITS = {("16bit", 128): LongerSplits(min_batch=4, min_split_tokens=256)}
# Short requests at small batches stay on the tl tiles (too few tiles a program for the Hopper set-up), dense from the
# batches below. H200 (short-requests-h200.txt), requests of 1k-2k tokens, the Hopper forms' time over the tl tile's:
# bf16 16 heads 0.78-0.92 from batch 1; 24-32 heads 0.70-0.88 from batch 16 (token-split; the narrow form since,
# tma-16bit-h200.txt 3); 64 heads 0.74-0.96 from batch 2 (1.13-1.33 at batch 1); 128 heads 0.76-0.95 at batch 1-2;
# e4m3 16 and 64 heads 0.71-0.91 from batch 1; 32 heads 0.71-0.85 from batch 8 (0.84-1.11 at batch 1-4); 128 heads
# 0.96-1.02 at batch 1.
HOPPER_MIN_ITEMS = 2048
HOPPER_SHORT_BATCH_DEFAULT = 64
# 32 rows from 1024 items: at 256 tokens 1.20x the tl tile's time at batch 32 (bf16, token-split), 1.10x at batch 8
# (e4m3, narrow); 16, 64 and 128 rows 0.68-0.91 there (short-requests-h200.txt).
HOPPER_SHORT_BATCH = {
    ("fp8", 16): ShortBatch(1), ("fp8", 32): ShortBatch(8, min_items=1024), ("fp8", 64): ShortBatch(1),
    ("fp8", 128): ShortBatch(4), ("16bit", 16): ShortBatch(1), ("16bit", 32): ShortBatch(16, min_items=1024),
    ("16bit", 64): ShortBatch(2), ("16bit", 128): ShortBatch(1),
}

# Per-form switches of the Hopper kernel, keyed by (form, kind, "dense" | "sparse").
# The narrow FP8 form's loader warpgroups, by sparse (two: their lookups and gathers run side by side).
HOPPER_STAGED_LOADERS = {False: 1, True: 2}
# Forms whose query every warp loads before the partitions start (elsewhere the MMA warps load it, while the loader
# already streams). Not the qk1 form: H200 (qk1-h200.txt 15), dense at 64-128 heads, batch 4-128, kv 1k-16k, by the
# MMA warps faster geomean: bf16 1.023 ragged / 1.018 uniform (up to 1.076 at batch 4-16, kv 1k), FP8 1.014 ragged.
QUERY_BEFORE_PARTITIONS = {("token_split", "fp8", "dense")}
# Forms whose FP8 register loader asks the L2 for the next tile's lines before it waits for a slot.
L2_PREFETCH_FORMS = {("token_split", "fp8", "sparse"), ("token_split", "fp8", "dense"), ("qk1", "fp8", "dense"),
                     ("qk1", "fp8", "sparse")}
# Forms whose FP8 loader loads the next tile before it waits for its slot -> the most tiles a program may have.
LOADER_AHEAD_FORMS = {("qk1", "fp8", "sparse"): None, ("qk1", "fp8", "dense"): 8}
# Whether the MMA warps fence a slot again after its loader fenced it: an FP8 loader's stores, a 16-bit TMA loader's
# partial tile (its TMA copies need no fence).
HOPPER_CONSUMER_FENCE = False
# Query columns (rope first) that the qk1 form's scoring warpgroup keeps in registers, by form.
QK1_QUERY_REG_COLS = {("qk1", "16bit", "sparse"): 128}
# The qk1 forms whose warpgroup 0 tells warpgroup 1 by four per-warp flags whether a reference moved, instead of
# warpgroup 1 reducing the rescale factors across its warps. H200 (qk1-h200.txt 7), bf16 dense at 128 heads 0.977-0.998
# of the time (64 heads 0.99-1.02); sparse 1.00-1.02x slower, so dense only.
QK1_WARP_FLAGS_FORMS = {("qk1", "16bit", "dense")}
# The sparse qk1 forms whose warpgroup 0 loads the next tile's top-k positions (its mask) once this tile's p @ v is
# issued, instead of among the tile's score MMAs, whose issue waited for them. H200 (qk1-h200.txt 16), top-k 2048:
# bf16 128 heads 0.927-0.961 of the time (64 heads 0.994-1.003), e4m3 64-128 heads 0.914-0.950.
QK1_POSITIONS_AHEAD_FORMS = {("qk1", "16bit", "sparse"), ("qk1", "fp8", "sparse")}
# The qk1 forms whose warpgroup 0 sums each tile's p in fp32 before rounding it, instead of the rounded values (their
# unpacking sat between p and its hand-over). H200 (qk1-h200.txt 18), bf16 dense: 0.987 uniform (128 heads
# 0.967-0.991, 64 heads b16 1.003-1.006), 0.994 ragged; sparse 1.004 and e4m3 0.998, not taken.
QK1_SUMS_UNROUNDED_FORMS = {("qk1", "16bit", "dense")}
# The 16-bit forms whose loader copies whole tiles by TMA where the cache's rows allow it (launcher.kv_descriptors)
# instead of every loader thread's `cp.async`, from this many packed query rows. H200 (qk1-h200.txt 9), bf16 dense,
# batch 16-128, kv 4k-16k: 128 heads 0.978-0.997 of the time (12 of 12 shapes, uniform and ragged); 64 heads
# 0.996-1.013, so from two row blocks. The narrow form (one TMA loader instead of two cp.async ones), H200
# (tma-16bit-h200.txt), bf16 16-32 heads, batch 16-128, kv 4k-32k: 0.980 uniform (0.933-1.003), 0.988 ragged.
TMA_16BIT_MIN_ROWS = {("qk1", "16bit", "dense"): 65, ("narrow", "16bit", "dense"): 1}

# Splits whose partials the combine loads together.
COMBINE_SPLITS_AT_ONCE = 32
# Up to this many splits (a power of two) the combine loads the partials of a row's splits at once, before their LSEs
# arrive (one round trip to L2 instead of two). H200, ragged, launches of 2-16 splits over waiting for the LSEs:
# bf16 0.982 (0.919-1.012), FP8-query backend 0.981 (0.933-1.007); up to 8 alike (combine-launch-h200.txt 3).
COMBINE_AHEAD_MAX_SPLITS = 16
# On SM90+: the combine launched as stage 1's programmatic dependent, which every stage-1 program lets start at once,
# where the SMs stage 1 leaves idle hold its programs at COMBINE_EARLY_PER_IDLE_SM or fewer each: they wait there for
# stage 1's writes and run as soon as it ends (0.5-0.7 us less at shapes of 9-12 us). Where they would crowd onto a
# few idle SMs and run there, they are launched after stage 1 as before (up to 3.2 us more otherwise; the launch as
# a dependent without the early start was 0.1-0.6 us slower than none: bench/results/combine-launch-h200.txt).
COMBINE_AFTER_STAGE1 = True
COMBINE_EARLY_PER_IDLE_SM = 4
# The waves split model's cost of one split partial, in KV tokens of one program's time per packed query row.
PARTIAL_ROW_TOKENS = 0.02
# With per-request lengths (prepare): how the split model schedules the programs, by "dense" / "sparse"
# ("longest_first": each on the next free slot, longest first; "waves": in waves as long as their longest; every
# sparse request has top-k items, where waves are exact and the sparse entries above were measured), what one
# program costs beyond its tokens (in KV tokens), and the dense launch order ("longest_first": splits.launch_order;
# "grid": request, then split).
SPLIT_MODEL = {"dense": "longest_first", "sparse": "waves"}
PROGRAM_TOKENS = 64
# What one packed query row's split partial costs in KV tokens, once written by its program and once read by the
# combine: 512 fp32 values (2 KiB) against a 576-byte e4m3 token (from 64 heads BF16 and FP8 launches take about as
# long on the H200: bench/results/split-order-h200.txt).
PARTIAL_ROW_KV_TOKENS = 3.5
LAUNCH_ORDER = "longest_first"
# The tuner's refinement: the default's minimum split scaled by these, at most REFINE_MAX_TILES tiles in all.
REFINE_SPLIT_FACTORS = (2.0, 0.5)
REFINE_MAX_TILES = 4


def _kind(kv_fp8: bool) -> str:
    return "fp8" if kv_fp8 else "16bit"


def short_requests(*, kind: str, bucket: int, batch: int, max_items: int, sparse: bool) -> bool:
    """Too few tiles per program for the warp-specialised kernel (see HOPPER_SHORT_BATCH)."""
    rule = None if sparse else HOPPER_SHORT_BATCH.get((kind, bucket))
    min_batch = rule.min_batch if rule and max_items >= rule.min_items else HOPPER_SHORT_BATCH_DEFAULT
    return max_items < HOPPER_MIN_ITEMS and batch < min_batch


def _hopper_tile(kind: str, bucket: int, *, batch: int, sparse: bool) -> Tile | None:
    """The first Hopper form whose table takes (kind, bucket) at this batch, or None."""
    for table, tile in ((HOPPER_NARROW_MIN_BATCH, HOPPER_TILES.get(bucket)), (HOPPER_QK1_MIN_BATCH, HOPPER_QK1_TILE),
                        (HOPPER_TOKEN_SPLIT_MIN_BATCH, HOPPER_TOKEN_SPLIT_TILE)):
        entry = table.get((kind, bucket))
        if entry is not None and entry.takes(batch=batch, sparse=sparse):
            longer = HOPPER_QK1_SPARSE_SPLITS.get((kind, bucket)) if sparse and tile == HOPPER_QK1_TILE else None
            if longer and batch >= longer.min_batch:
                return tile.replace(min_split_tokens=longer.min_split_tokens)
            return tile
    return None


def default_tile(*, num_heads: int, q_len: int, batch: int, max_items: int, sparse: bool = False,
                 kv_fp8: bool = False, cc_major: int | None = None, ds_mla: bool = False,
                 fp8_query: bool = False) -> Tile:
    """The heuristic's tile: on SM90 the first Hopper form whose table takes the shape (unless the requests are
    short), otherwise the tl kernel's tile for the rows bucket.

    Args:
        max_items: the longest KV length (dense) or the top-k (sparse) of the batch.
        cc_major: the GPU's compute-capability major (None: the CPU interpreter).
        ds_mla: the cache is vLLM's fp8_ds_mla (the FP8 kind's tiles).
        fp8_query: the FP8-query backend's tile (`fp8_query_tile`).
    """
    if fp8_query:
        return fp8_query_tile(num_heads=num_heads, q_len=q_len, batch=batch, max_items=max_items)
    kind, bucket = _kind(kv_fp8 or ds_mla), rows_bucket(packed_rows(num_heads, q_len, sparse=sparse))
    short = short_requests(kind=kind, bucket=bucket, batch=batch, max_items=max_items, sparse=sparse)
    if cc_major in HOPPER_CC_MAJORS and not short:
        tile = _hopper_tile(kind, bucket, batch=batch, sparse=sparse)
        if tile is not None:
            return tile
    return table_tile(kind, bucket, batch=batch, sparse=sparse, cc_major=cc_major)


def table_tile(kind: str, bucket: int, *, batch: int, sparse: bool, cc_major: int | None) -> Tile:
    """The tl kernel's tile for a KV kind and rows bucket (16-row tiles where the 64-row ones do not fit)."""
    if cc_major is not None and cc_major not in BIG_TILE_CC_MAJORS and bucket > 32:
        bucket = 16
    small = (SPARSE_SMALL_BATCH_TILES if sparse else SMALL_BATCH_TILES).get((kind, bucket))
    if small is not None and batch <= small.max_batch:
        return small.tile
    return (SPARSE_TILE_TABLE if sparse else TILE_TABLE)[(kind, bucket)]


# The FP8-query backend's wide form (64 rows a program: a scorer and two p @ v warpgroups) from this many packed rows
# (16-48 heads: the rows past the heads masked) and, by rows bucket, this much work, packed rows x batch x the longest
# request's tokens; below, the narrow form (16 rows, or 32-row blocks over each KV tile, which launch two to four
# times the programs). H200 (fp8-query-wide-h200.txt 29), ragged / uniform lengths, against the rule before (from 33
# rows and 2^22): 32 heads batch 16 kv 16k 0.92 / 0.89, batch 64 kv 4k 0.96; 128 heads from 2^21: batch 1 kv 16k
# 0.96 / 0.95, batch 4 kv 4k 1.01 / 0.90; at 2^21, 32 heads 1.03-1.08x slower (3 of 3 shapes), 64 heads 1.03 and
# 1.05x (2 of 3); 32 heads from 2^23 1.11x slower at batch 128 kv 1k. 16 heads (30): from 2^24 over the 16-row
# narrow form, batch 64 kv 16k 0.98 / 0.96, batch 128 kv 16k (four slots) 0.97 / 0.94; at 2^22-2^23 up to 1.07x
# slower with ragged lengths. 20 and 24 heads (30, ragged) over the 32-row blocks: 0.83-0.98 from 2^22. With the
# p @ v products over the rows bucket (FP8Q_WIDE_PV_ROWS; 31), 16 heads from 2^22 over 2^24: batch 16 kv 16k 0.92 /
# 0.90, batch 64 kv 4k 0.95 / 0.89, batch 128 kv 4k 0.93 / 0.87; from 2^21 only batch 128 kv 1k measured (0.95,
# ragged). With the softmax over 32 packed rows alone (FP8Q_WIDE_HALF_ROWS), 32 heads from 2^21 over 2^22, ragged
# (42): batch 4 kv 16k 0.92, batch 16 kv 4k 0.90, batch 64 kv 1k 0.96; from 2^19 over 2^21 (43), 20 and 32 heads at
# batch 1-16: 0.90-0.96 at the five shapes it moves (32 heads batch 1 kv 16k 0.90), 0.99-1.01 at the other 13; from
# 2^20 0.93 at the two of them it moves.
FP8_QUERY_WIDE_MIN_ROWS = 16
FP8_QUERY_WIDE_MIN_WORK = {16: 1 << 22, 32: 1 << 19, 64: 1 << 22, 128: 1 << 21}
# The wide FP8-query form's p @ v products over the launch's packed rows bucket (16 or 32 of its 64 rows) where
# there are no more, instead of all 64.
FP8Q_WIDE_PV_ROWS = True
# And in these rows buckets its scores transposed (`s^T = k q^T`: m64 over the tokens, the bucket's rows on N) instead
# of the rows on M with 48 or 32 of every 64 padding. H200 (fp8-query-wide-h200.txt 34), A / B against the rows on
# M, batch 16-128 kv 4k-16k: 16 rows 0.94-0.97 (uniform and ragged); 32 rows 1.03-1.10 and 1.26 at batch 128 kv 16k
# (20 and 24 heads, ragged), so not there.
FP8Q_WIDE_SCORES_T_ROWS = frozenset({16})
# With TMA and one box a tile, each p @ v warpgroup reads the block-table entry of the tile it copies next an iteration
# ahead, so that the copy does not wait for it. H200 (fp8-query-wide-h200.txt 37), against reading it as the copy is
# issued: 0.992 uniform (0.972-1.000, 22 shapes of 16-128 heads), 0.998 ragged (0.989-1.007); the copy issued before
# the products instead of after them was 1.02-1.03x slower (36).
FP8Q_WIDE_ROW_AHEAD = True
# In these rows buckets (with the query rounded before stage 1) the wide form's scorer copies the packed rows into the
# first 8 of each warp's 16 score rows, and its softmax takes those rows alone, not all 64. H200
# (fp8-query-wide-h200.txt 39), 20 and 32 heads, batch 16-128, kv 4k-16k: 0.926 uniform (0.908-0.942), 0.939 ragged
# (0.927-0.947).
FP8Q_WIDE_HALF_ROWS = frozenset({32})
# The wide form's scorer sums each tile's rounded p within a thread in fp16, then adds the sums to its fp32 row sums,
# not each value in fp32. H200 (fp8-query-wide-h200.txt 41), 32-128 heads: 0.981 uniform (0.952-1.007), 0.983 ragged
# (0.958-1.001); 64-128 heads 0.95-0.99, 32 heads (half the rows already) 0.995-1.007.
FP8Q_WIDE_F16_SUMS = True
# The FP8-query forms copy whole tiles by TMA where the cache's rows allow it (launcher.kv_descriptors).
FP8Q_TMA = True
# The kernel forms whose query is rounded to e4m3 once, before stage 1 (query_e4m3.py), and copied as it is by every
# program; the other FP8-query forms round their rows in each program. Stage 1 is launched as the rounding kernel's
# programmatic dependent (FP8Q_ROUNDED_QUERY_PDL): its programs start (barriers, the first tiles' copies) while the
# query is rounded and wait for it only before copying the rounded rows. H200 (fp8-query-wide-h200.txt 20), 12
# ragged shapes of 64/128 heads: 0.971x the time of rounding in each program (0.927-0.997 at the 10 that run the
# wide form), 0.967x an ordinary launch; every form's query rounded before took 1.04x at 16-64 heads, where the
# narrow form's 16-32 rows round quickly.
FP8Q_ROUNDED_QUERY_FORMS = frozenset({"fp8_query_wide"})
FP8Q_ROUNDED_QUERY_PDL = True


def rounds_query_before(params: LaunchParams) -> bool:
    """Whether a launch with `params` rounds its query before stage 1 (FP8Q_ROUNDED_QUERY_FORMS)."""
    return params.fp8_query and params.kernel_form in FP8Q_ROUNDED_QUERY_FORMS


# From this much work the wide form runs four token slots and issues each tile's score MMAs before the previous
# tile's softmax (HOPPER_FP8_QUERY_WIDE_AHEAD_SHAPE, constexpr SCORES_AHEAD); below, three slots, one tile at a
# time. H200, ragged (fp8-query-wide-h200.txt 29): from 2^24 1.06, 1.03 and 1.03x the time at 64 heads batch 64 kv
# 4k, 32 and 64 heads batch 16 kv 16k; from 2^26 1.16x at 32 heads batch 64 kv 16k. From 32 rows (32 heads batch
# 64 / 128 kv 16k: 0.86 / 0.83 of 32-row narrow programs, 25).
FP8_QUERY_WIDE_AHEAD_MIN_WORK = 1 << 25


def fp8_query_tile(*, num_heads: int, q_len: int, batch: int, max_items: int) -> Tile:
    """The tile of the FP8-query backend (`LaunchParams.fp8_query`), dense: from FP8_QUERY_WIDE_MIN_ROWS the wide
    form where the shape has FP8_QUERY_WIDE_MIN_WORK (128 rows: two row blocks over each KV tile), with four slots
    and the scores a tile ahead from FP8_QUERY_WIDE_AHEAD_MIN_WORK; otherwise the narrow form, 16 rows for up to 16
    packed rows, 32-row blocks above."""
    rows = packed_rows(num_heads, q_len, sparse=False)
    work = rows * batch * max_items
    wide = rows >= FP8_QUERY_WIDE_MIN_ROWS
    form = ("ahead" if wide and work >= FP8_QUERY_WIDE_AHEAD_MIN_WORK
            else "wide" if wide and work >= FP8_QUERY_WIDE_MIN_WORK[rows_bucket(rows)] else "narrow")
    return fp8_query_form_tile(form, rows)


# The FP8-query forms from FP8_QUERY_WIDE_MIN_ROWS packed rows, by name: the narrow form (32-row blocks; 16 rows up
# to 16), the wide form with three slots, and with four and the scores ahead.
FP8_QUERY_FORMS = {"narrow": HOPPER_FP8_QUERY_SHAPES[32], "wide": HOPPER_FP8_QUERY_SHAPES[64],
                   "ahead": HOPPER_FP8_QUERY_WIDE_AHEAD_SHAPE}


def fp8_query_form_tile(form: str, rows: int = 32) -> Tile:
    """The FP8-query tile of `form` (a key of FP8_QUERY_FORMS) for `rows` packed rows."""
    shape = HOPPER_FP8_QUERY_SHAPES[16] if form == "narrow" and rows <= 16 else FP8_QUERY_FORMS[form]
    return hopper_tile(shape).replace(fp8_query=True)


def other_fp8_query_forms(tile: Tile, rows: int) -> list[Tile]:
    """The FP8-query tiles for `rows` packed rows of the forms (FP8_QUERY_FORMS) `tile` is not."""
    return [t for t in (fp8_query_form_tile(form, rows) for form in FP8_QUERY_FORMS) if t != tile]


def candidate_tiles(*, num_heads: int, q_len: int, batch: int, max_items: int, sparse: bool = False,
                    kv_fp8: bool = False, cc_major: int | None = None, ds_mla: bool = False,
                    fp8_query: bool = False) -> list[Tile]:
    """The tiles the tuner times for one shape, the default first, no duplicates: on SM90 the other kernel family
    at the same rows (both Hopper forms for 16-32 rows, both 64-row forms for 64+ rows; FP8-query: all three of its
    forms from FP8_QUERY_WIDE_MIN_ROWS), then the default with its minimum split scaled by REFINE_SPLIT_FACTORS
    (clamped to `PARAM_SPACE`); at most REFINE_MAX_TILES."""
    default = default_tile(num_heads=num_heads, q_len=q_len, batch=batch, max_items=max_items, sparse=sparse,
                           kv_fp8=kv_fp8, cc_major=cc_major, ds_mla=ds_mla, fp8_query=fp8_query)
    rows = packed_rows(num_heads, q_len, sparse=sparse)
    bucket = rows_bucket(rows)
    wide = HOPPER_TOKEN_SPLIT_SHAPE.block_h
    family = []
    if fp8_query and rows >= FP8_QUERY_WIDE_MIN_ROWS:
        family += other_fp8_query_forms(default, rows)
    if cc_major in HOPPER_CC_MAJORS and not fp8_query:  # the FP8-query forms are refined in their splits
        if default.warp_specialized:
            family.append(table_tile(_kind(kv_fp8 or ds_mla), bucket, batch=batch, sparse=sparse, cc_major=cc_major))
        family += [HOPPER_TILES[b] for b in sorted({min(bucket, wide), wide})]
        if bucket >= wide:
            family.append(HOPPER_QK1_TILE)
    splits = PARAM_SPACE["min_split_tokens"]
    scaled = [default.replace(min_split_tokens=min(max(int(default.min_split_tokens * f), splits[0]), splits[-1]))
              for f in REFINE_SPLIT_FACTORS]
    tiles = []
    for tile in [default, *family, *scaled]:
        if tile not in tiles and len(tiles) < REFINE_MAX_TILES:
            tiles.append(tile)
    return tiles


def staged_loaders(*, kv_fp8: bool, rows: int, sparse: bool, ds_mla: bool = False) -> int:
    """The Hopper kernel's `STAGED_LOADERS` (also the arrivals that fill a narrow FP8 slot): `HOPPER_STAGED_LOADERS`
    in the narrow FP8 form, 1 elsewhere and for fp8_ds_mla rows (two plain loaders, one arrival a tile)."""
    if not kv_fp8 or ds_mla or rows >= HOPPER_TOKEN_SPLIT_SHAPE.block_h:
        return 1
    return HOPPER_STAGED_LOADERS[sparse]


def copies_by_tma(params: LaunchParams, *, kv_fp8: bool, sparse: bool, page_size: int, query_rows: int) -> bool:
    """Whether the launch's loaders copy whole tiles by TMA where the cache allows it: the FP8-query forms
    (FP8Q_TMA), and the 16-bit forms of TMA_16BIT_MIN_ROWS from their packed query rows (`q_len x heads`) where one
    box takes a tile (with a box per page of 16 rows the loader spilled registers)."""
    if params.fp8_query:
        return FP8Q_TMA
    min_rows = TMA_16BIT_MIN_ROWS.get((params.kernel_form, _kind(kv_fp8), "sparse" if sparse else "dense"))
    return min_rows is not None and query_rows >= min_rows and page_size % params.block_n == 0


def hopper_constexprs(params: LaunchParams, *, kv_fp8: bool, sparse: bool, tiles: int | None = None,
                      kv_words: bool = True, ds_mla: bool = False, query_rows: int | None = None) -> dict:
    """The Hopper kernel's constexprs that pick its form, registers and per-form switches for `params`.

    Args:
        ds_mla: the cache is vLLM's fp8_ds_mla rows (`kv_fp8` too): their own loader, which in every form loads
            the next tile ahead and asks the L2 for the one after.
        tiles: the most KV tiles a program has (None: not known, as for an offline compile).
        kv_words: the cache's base and strides are whole 32-bit words (`launcher.kv_cache_in_words`), which the
            loader ahead reads it as.
        query_rows: the launch's query rows (`q_len x heads`; None: not known), which the wide FP8-query form's
            p @ v warpgroups need no more of than their rows bucket (FP8Q_WIDE_PV_ROWS).
    """
    kv_fp8 = kv_fp8 or ds_mla
    form = (params.kernel_form, _kind(kv_fp8), "sparse" if sparse else "dense")
    qk1 = form[0] == "qk1"
    max_tiles = LOADER_AHEAD_FORMS.get(form, 0)
    by_form = form in LOADER_AHEAD_FORMS and (max_tiles is None or (tiles is not None and tiles <= max_tiles))
    ahead = by_form and kv_fp8 and form[0] != "narrow" and kv_words and not ds_mla
    wide = form[0] == "fp8_query_wide"
    scores_ahead = wide and params.num_stages == HOPPER_FP8_QUERY_WIDE_AHEAD_SHAPE.num_stages
    pv_rows = (min(HOPPER_FP8_QUERY_SHAPES[64].block_h, rows_bucket(query_rows))
               if wide and FP8Q_WIDE_PV_ROWS and query_rows else HOPPER_FP8_QUERY_SHAPES[64].block_h)
    load_regs = HOPPER_LOAD_REGS["fp8_query" if params.fp8_query else "ds_mla" if ds_mla else "fp8_ahead" if ahead
                                 else "fp8" if kv_fp8 else "16bit"]
    return dict(
        STAGES=params.num_stages, KV_FP8=kv_fp8, N_ROWS=params.block_h, LOAD_REGS=load_regs,
        STAGED_LOADERS=staged_loaders(kv_fp8=kv_fp8, rows=params.block_h, sparse=sparse, ds_mla=ds_mla),
        PARTIAL_EVICT_LAST=params.num_splits > 1, QK1=qk1,
        MMA_REGS=QK1_WORKER_REGS if qk1 else FP8_QUERY_WIDE_PV_REGS if wide else 0,
        QUERY_IN_CONSUMER=form not in QUERY_BEFORE_PARTITIONS, L2_PREFETCH=form in L2_PREFETCH_FORMS or ds_mla,
        CONSUMER_FENCE=HOPPER_CONSUMER_FENCE, LOADER_AHEAD=ahead,
        QUERY_REG_COLS=QK1_QUERY_REG_COLS.get(form, 0) if qk1 else 0, DS_MLA=ds_mla, FP8_QUERY=params.fp8_query,
        SCORES_AHEAD=scores_ahead, PV_ROWS=pv_rows,
        SCORES_T=wide and pv_rows in FP8Q_WIDE_SCORES_T_ROWS, ROW_AHEAD=wide and FP8Q_WIDE_ROW_AHEAD,
        HALF_ROWS=wide and pv_rows in FP8Q_WIDE_HALF_ROWS and rounds_query_before(params),
        F16_SUMS=wide and FP8Q_WIDE_F16_SUMS, WARP_FLAGS=form in QK1_WARP_FLAGS_FORMS,
        POSITIONS_AHEAD=form in QK1_POSITIONS_AHEAD_FORMS, SUMS_UNROUNDED=form in QK1_SUMS_UNROUNDED_FORMS)
