"""TMA copies of whole KV tiles into a ring slot, for every Hopper form that takes the launcher's descriptors
(`launcher.kv_descriptors`): the FP8-query forms (e4m3 bytes) and, with a 16-bit cache, the qk1 and narrow forms.

A tile inside the program's range goes by TMA; a partial last tile goes by the form's `cp.async` copy, which zeroes
its rows past the range: stale bytes there (a NaN) would meet p = 0 in `p @ v`. A slot's 512 latent columns lie as
blocks of 128 bytes (128 e4m3 or 64 16-bit columns), the 128-byte swizzle's order, so one 3-d box
`[column block, row, 128 bytes]` takes a tile's rows where a page holds the whole tile.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from mla_tune.backends.triton_mla.hopper_common import KvSource, Ring, _reinterpret

# Triton 3.9 renamed tma.async_copy_global_to_shared to async_load (a TMA copy of a descriptor's box into shared
# memory)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gluon.jit
def tma_reads(src: KvSource, t):
    """Whether tile `t` lies inside the program's range, so that TMA copies it."""
    return src.start + (t + 1) * src.BLOCK_N <= src.end


@gluon.jit
def _cache_row(src: KvSource, item, ok=None):
    """The cache row of the program's item `item`, through its block-table row (with `ok`: 0 where it is False)."""
    if ok is None:
        page = gl.load(src.bt_row + item // src.PAGE_SIZE)
    else:
        page = gl.load(src.bt_row + item // src.PAGE_SIZE, mask=ok, other=0)
    return page * src.PAGE_SIZE + item % src.PAGE_SIZE


@gluon.jit
def tile_row(src: KvSource, t):
    """The cache row of tile `t`'s first token (0 for a tile past the program's range, which no copy reads), for a
    TMA copy of one box a tile read ahead of it (`tma_tile`'s `first_row`)."""
    return _cache_row(src, src.start + t * src.BLOCK_N, tma_reads(src, t))


@gluon.jit
def tma_tile(ring: Ring, src: KvSource, t, bar, lat_desc, rope_desc, BLOCK0: gl.constexpr = 0,
             N_BLOCKS: gl.constexpr = 0, ROPE: gl.constexpr = True, first_row=None):
    """Tile `t`'s rows by TMA into its slot, all completing `bar`: per page's rows (or the tile's, for pages as long
    as a tile or longer) a box of the latent column blocks `BLOCK0 .. BLOCK0 + N_BLOCKS - 1` (128 bytes each, all of
    them for `N_BLOCKS` 0; `[N_BLOCKS, rows, 128 bytes]`, a tile's rows; else one box per block) and, with `ROPE`,
    one of the rope; `first_row`: the tile's cache row (`tile_row`), read before, where one box takes the tile."""
    BOX: gl.constexpr = rope_desc.block_type.shape[0]
    WHOLE: gl.constexpr = len(lat_desc.block_type.shape) == 3  # the column blocks of a tile's rows as one box
    COLS: gl.constexpr = lat_desc.block_type.shape[len(lat_desc.block_type.shape) - 1]  # a block's columns
    ALL_BLOCKS: gl.constexpr = 512 // COLS
    BLOCKS: gl.constexpr = ALL_BLOCKS if N_BLOCKS == 0 else N_BLOCKS
    ELEMENT_BYTES: gl.constexpr = 128 // COLS
    LAT_LAYOUT: gl.constexpr = lat_desc.layout
    if WHOLE:
        gl.static_assert(lat_desc.block_type.shape[0] == BLOCKS, "the descriptor's box takes N_BLOCKS blocks")
    slot = t % ring.STAGES
    mbarrier.expect(bar, src.BLOCK_N * (BLOCKS * COLS + (64 if ROPE else 0)) * ELEMENT_BYTES)
    n0 = src.start + t * src.BLOCK_N
    for j in gl.static_range(src.BLOCK_N // BOX):
        item = n0 + j * BOX
        if first_row is None:
            row = _cache_row(src, item)
        else:
            gl.static_assert(BOX == src.BLOCK_N, "first_row: one box takes the tile")
            row = first_row
        if WHOLE:
            blocks = _reinterpret(ring.k_lat.index(slot), ring.k_lat.dtype, [ALL_BLOCKS, BOX, COLS], LAT_LAYOUT)
            if BLOCKS < ALL_BLOCKS:
                blocks = blocks.slice(BLOCK0, BLOCKS, dim=0)
            _tma_load(lat_desc, [BLOCK0, row, 0], bar, blocks)
        else:
            rows_lat = ring.k_lat.index(slot).slice(j * BOX, BOX, dim=0)
            for c in gl.static_range(BLOCK0, BLOCK0 + BLOCKS):
                _tma_load(lat_desc, [row, c * COLS], bar, rows_lat.slice(c * COLS, COLS, dim=1))
        if ROPE:
            _tma_load(rope_desc, [row, 512], bar, ring.k_rope.index(slot).slice(j * BOX, BOX, dim=0))
