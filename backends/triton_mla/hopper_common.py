"""What every form of the Hopper kernel shares: the values a partition receives, the query, the row bookkeeping
and the epilogue.

A partition receives three values instead of ~40 arguments: `Program` (what the program computes and where it
writes), `KvSource` (where its KV tiles come from) and `Ring` (the shared-memory slots and their barriers).
`gl.warp_specialize` flattens them into its worker captures in field order.
"""

# No `from __future__ import annotations`: the aggregates check their fields against real annotation types.
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy, fence_async_shared, mbarrier
from triton.language.core import _aggregate as aggregate
from triton.language.core import base_value
from triton.language.extra.cuda import gdc_wait

from mla_tune.backends.triton_mla import config

ROWS = gl.constexpr(64)        # query rows per program in the 64-row forms: one wgmma M block
LOAD_WARPS = gl.constexpr(4)   # a loader partition: one warpgroup
E4M3_MAX = gl.constexpr(config.E4M3_MAX)


# Triton 3.9 renamed gl.thread_barrier to gl.barrier
_GL_BARRIER = gl.constexpr(hasattr(gl, "barrier"))
# Triton 3.8 renamed `cp.async`'s builtin to async_load (3.9 removed the old name; 3.6-3.7 have only the old)
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared


# Triton 3.9 made shared_memory_descriptor._reinterpret public as reinterpret
_PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))


@gluon.jit
def _reinterpret(desc, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
    """`desc`'s bytes seen as a `shape` tile of `dtype` in `layout`, under either name Triton gives it."""
    if _PUBLIC_REINTERPRET:
        return desc.reinterpret(dtype, shape, layout)
    else:
        return desc._reinterpret(dtype, shape, layout)


@gluon.jit
def _partition_barrier():
    """The partition's threads meet, under either name Triton gives the barrier."""
    if _GL_BARRIER:
        gl.barrier()
    else:
        gl.thread_barrier()


@gluon.constexpr_function
def _value(x):
    """A field value: a tensor as is, a Python value (an argument Triton specialised, e.g. a stride of 1) as a
    constexpr."""
    return x if isinstance(x, base_value) else gl.constexpr(x)


_PROGRAM_VALUES = ("o_ptr", "lse_ptr", "topk_row", "pid_m", "b", "split", "seq_len", "num_heads", "start", "end",
                   "n_tiles", "store_o", "qk_scale", "out_scale", "stride_ob", "stride_os", "stride_ot", "stride_oh",
                   "stride_lb", "stride_ls", "stride_lt", "stride_lh", "q_ptr", "stride_qb", "stride_qt", "stride_qh",
                   "q_scale", "q_amax_ptr")


@aggregate
class Program:
    """One program's work: its query rows, its split of the KV range, its scales and where it writes.

    Runtime fields are tensors, or constexprs where Triton specialised the argument (a stride of 1).
    """

    o_ptr: base_value
    lse_ptr: base_value
    topk_row: base_value
    pid_m: base_value
    b: base_value
    split: base_value
    seq_len: base_value
    num_heads: base_value
    start: base_value
    end: base_value
    n_tiles: base_value
    store_o: base_value
    qk_scale: base_value
    out_scale: base_value
    stride_ob: base_value
    stride_os: base_value
    stride_ot: base_value
    stride_oh: base_value
    stride_lb: base_value
    stride_ls: base_value
    stride_lt: base_value
    stride_lh: base_value
    q_ptr: base_value
    stride_qb: base_value
    stride_qt: base_value
    stride_qh: base_value
    q_scale: base_value
    q_amax_ptr: base_value  # the FP8-query rows' scales when q_ptr is the rounded query (query_e4m3.py), else None
    Q_LEN: gl.constexpr
    SPARSE: gl.constexpr
    N_ROWS: gl.constexpr
    BLOCK_N: gl.constexpr
    STAGES: gl.constexpr
    KV_FP8: gl.constexpr
    QUERY_IN_CONSUMER: gl.constexpr
    FENCE_SLOTS: gl.constexpr
    EVICT_LAST: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, o_ptr, lse_ptr, topk_row, pid_m, b, split, seq_len, num_heads, start, end, n_tiles, store_o,
                 qk_scale, out_scale, stride_ob, stride_os, stride_ot, stride_oh, stride_lb, stride_ls, stride_lt,
                 stride_lh, q_ptr, stride_qb, stride_qt, stride_qh, q_scale, q_amax_ptr, Q_LEN, SPARSE, N_ROWS, BLOCK_N,
                 STAGES, KV_FP8, QUERY_IN_CONSUMER, FENCE_SLOTS, EVICT_LAST):
        values = locals()
        for name in _PROGRAM_VALUES:
            setattr(self, name, _value(values[name]))
        self.Q_LEN = gl.constexpr(Q_LEN)
        self.SPARSE = gl.constexpr(SPARSE)
        self.N_ROWS = gl.constexpr(N_ROWS)
        self.BLOCK_N = gl.constexpr(BLOCK_N)
        self.STAGES = gl.constexpr(STAGES)
        self.KV_FP8 = gl.constexpr(KV_FP8)
        self.QUERY_IN_CONSUMER = gl.constexpr(QUERY_IN_CONSUMER)
        self.FENCE_SLOTS = gl.constexpr(FENCE_SLOTS)
        self.EVICT_LAST = gl.constexpr(EVICT_LAST)


@aggregate
class KvSource:
    """Where a program's KV tiles come from: the paged cache (`DS_MLA`: vLLM's fp8_ds_mla rows, an FP8 kind), its
    block-table row, (sparse) its top-k row, and the program's range of items."""

    kv_ptr: base_value
    bt_row: base_value
    topk_row: base_value
    seq_len: base_value
    start: base_value
    n_tiles: base_value
    end: base_value
    stride_kvp: base_value
    stride_kvt: base_value
    BLOCK_N: gl.constexpr
    PAGE_SIZE: gl.constexpr
    SPARSE: gl.constexpr
    KV_FP8: gl.constexpr
    DS_MLA: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, kv_ptr, bt_row, topk_row, seq_len, start, n_tiles, end, stride_kvp, stride_kvt, BLOCK_N,
                 PAGE_SIZE, SPARSE, KV_FP8, DS_MLA):
        values = locals()
        for name in ("kv_ptr", "bt_row", "topk_row", "seq_len", "start", "n_tiles", "end", "stride_kvp", "stride_kvt"):
            setattr(self, name, _value(values[name]))
        self.BLOCK_N = gl.constexpr(BLOCK_N)
        self.PAGE_SIZE = gl.constexpr(PAGE_SIZE)
        self.SPARSE = gl.constexpr(SPARSE)
        self.KV_FP8 = gl.constexpr(KV_FP8)
        self.DS_MLA = gl.constexpr(DS_MLA)


@aggregate
class Ring:
    """The KV slots in shared memory (latent and rope parts) and their barriers: `full_bars[s]` when slot `s` holds
    a tile, `empty_bars[s]` when its readers are done with it."""

    k_lat: base_value
    k_rope: base_value
    full_bars: base_value
    empty_bars: base_value
    STAGES: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, k_lat, k_rope, full_bars, empty_bars, STAGES):
        self.k_lat = k_lat
        self.k_rope = k_rope
        self.full_bars = full_bars
        self.empty_bars = empty_bars
        self.STAGES = gl.constexpr(STAGES)


def hopper_smem_bytes(*, block_n: int, stages: int, rows: int = 64, kv_fp8: bool = False, qk1: bool = False,
                      ds_mla: bool = False, fp8_query: bool = False) -> int:
    """Shared memory of one program (without Triton's few KiB of reduction scratch): the query, the ring and, in the
    narrow form, `p` and (FP8 but not fp8_ds_mla) the staging ring of two half tiles of e4m3 bytes; in the qk1 form
    the rescale factors and four per-warp flags a slot and the row sums (p itself goes over the slot's rope
    columns); with `fp8_query`, e4m3 query, slots, v^T (narrow: one a slot; wide: none, it is a register operand
    there) and p (wide: two, with their rescale factors)."""
    if fp8_query:
        narrow = rows < ROWS.value
        v_slots, p_bufs = (stages, 1) if narrow else (0, 2)
        return (rows * 576 + stages * block_n * 576 + v_slots * 512 * block_n + p_bufs * rows * block_n
                + (0 if narrow else (p_bufs + 1) * rows * 4))
    narrow = rows < ROWS.value
    return (rows * 576 * 2 + stages * block_n * 576 * 2 + (rows * block_n * 2 if narrow else 0)
            + (block_n * 576 if narrow and kv_fp8 and not ds_mla else 0)
            + ((stages + 1) * rows * 4 + stages * 4 * 4 if qk1 else 0))


@gluon.jit
def _rows(pid_m, num_heads, layout: gl.constexpr, Q_LEN: gl.constexpr, SPARSE: gl.constexpr,
          N_ROWS: gl.constexpr = ROWS):
    """(query token, head, valid) of the program's `N_ROWS` rows, in `layout`."""
    return _rows_at(gl.arange(0, N_ROWS, layout=layout), pid_m, num_heads, Q_LEN, SPARSE, N_ROWS)


@gluon.jit
def _rows_at(rows, pid_m, num_heads, Q_LEN: gl.constexpr, SPARSE: gl.constexpr, N_ROWS: gl.constexpr):
    """`_rows` of the program's rows `rows` (of `N_ROWS` a program)."""
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
def _load_query(prog: Program, col0, layout: gl.constexpr, N_COLS: gl.constexpr, AS_STORED: gl.constexpr = False):
    """Columns `col0`..`col0 + N_COLS` of the program's query rows in `layout` (0 for rows past the heads; FP8,
    unless `AS_STORED`: scaled by `q_scale`, then rounded to fp16)."""
    qi, h, row_ok = _rows(prog.pid_m, prog.num_heads, gl.SliceLayout(1, layout), prog.Q_LEN, prog.SPARSE, prog.N_ROWS)
    q_row = prog.q_ptr + prog.b.to(gl.int64) * prog.stride_qb + qi * prog.stride_qt + h * prog.stride_qh
    x = gl.load(q_row[:, None] + col0 + gl.arange(0, N_COLS, layout=gl.SliceLayout(0, layout))[None, :],
                mask=row_ok[:, None], other=0.0)
    if prog.KV_FP8 and not AS_STORED:
        x = (x.to(gl.float32) * prog.q_scale).to(gl.float16)
    return x


@gluon.jit
def _store_query(prog: Program, q_lat, q_rope, WARPS: gl.constexpr):
    """The query's rows into `q_lat` / `q_rope` (`_load_query`), by `WARPS` warps: every load is issued before the
    first store, so the round trips overlap. Fenced for wgmma."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    lat = _load_query(prog, 0, layout, 512)
    rope = _load_query(prog, 512, layout, 64)
    q_rope.store(rope)
    q_lat.store(lat)
    fence_async_shared()


# The rounded query's copy into shared memory: 16 bytes a thread, 8 lanes over a row's 128 latent bytes (its
# 128-byte swizzle spreads them over all banks) or 8 lanes over 8 bytes each of the 64 rope bytes.
_QUERY_LAT_COPY = gl.constexpr(gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0]))
_QUERY_ROPE_COPY = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))


@gluon.jit
def _store_query_e4m3(prog: Program, q_lat, q_rope, rows_layout: gl.constexpr, SPREAD: gl.constexpr = False):
    """The query's rows, each times `448 / max |q_row|`, rounded to e4m3 into `q_lat` / `q_rope` by the 4 MMA warps
    (fenced for wgmma); returns `max |q_row| / 448` per row in `rows_layout` (1 for a row of zeros or past the
    heads), the factor its scores take back. Where `prog.q_amax_ptr` is given the rows were rounded before the
    launch (`query_e4m3.round_query`): they are copied as they are and the factors read. `SPREAD` (with the rows
    rounded before): 32 rows, row i in shared-memory row `16 (i // 8) + i % 8`, the rows between them zeros."""
    gl.static_assert(not SPREAD or prog.q_amax_ptr is not None, "SPREAD: the query rounded before the launch")
    if prog.q_amax_ptr is not None:
        factors = _copy_query_e4m3(prog, q_lat, q_rope, rows_layout, SPREAD)
    else:
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        # 128 columns at a time, read twice (the second read from cache), so that a thread holds 64 values, not 288
        rope = _load_query(prog, 512, layout, 64, True).to(gl.float32)
        amax = gl.max(gl.abs(rope), 1)
        for c in gl.static_range(4):
            amax = gl.maximum(amax, gl.max(gl.abs(_load_query(prog, c * 128, layout, 128, True).to(gl.float32)), 1))
        amax = gl.where(amax > 0.0, amax, E4M3_MAX)
        scale = E4M3_MAX / amax
        q_rope.store((rope * scale[:, None]).to(q_rope.dtype))
        for c in gl.static_range(4):
            lat = _load_query(prog, c * 128, layout, 128, True).to(gl.float32)
            q_lat.slice(c * 128, 128, dim=1).store((lat * scale[:, None]).to(q_lat.dtype))
        fence_async_shared()
        factors = gl.convert_layout(amax / E4M3_MAX, rows_layout)
    return factors


@gluon.jit
def _copy_query_e4m3(prog: Program, q_lat, q_rope, rows_layout: gl.constexpr, SPREAD: gl.constexpr = False):
    """`_store_query_e4m3` from the rounded query: its rows (zeros past the heads) copied by `cp.async`, landed for
    every thread of the partition and fenced for wgmma; their factors read from `prog.q_amax_ptr`. Waits for the
    rounding kernel first, as stage 1 may be launched as its programmatic dependent."""
    gdc_wait()
    N_ROWS: gl.constexpr = q_lat.shape[0]
    lat_row, lat_ok = _query_rows(prog, gl.SliceLayout(1, _QUERY_LAT_COPY), N_ROWS, SPREAD)
    lat_cols = gl.arange(0, 512, layout=gl.SliceLayout(0, _QUERY_LAT_COPY))
    _async_load(q_lat, lat_row[:, None] + lat_cols[None, :], mask=lat_ok[:, None])
    rope_row, rope_ok = _query_rows(prog, gl.SliceLayout(1, _QUERY_ROPE_COPY), N_ROWS, SPREAD)
    rope_cols = gl.arange(0, 64, layout=gl.SliceLayout(0, _QUERY_ROPE_COPY))
    _async_load(q_rope, rope_row[:, None] + 512 + rope_cols[None, :], mask=rope_ok[:, None])
    async_copy.commit_group()
    FACTORS: gl.constexpr = N_ROWS // 2 if SPREAD else N_ROWS
    qi, h, ok = _rows(prog.pid_m, prog.num_heads, rows_layout, prog.Q_LEN, prog.SPARSE, FACTORS)
    amax = gl.load(prog.q_amax_ptr + (prog.b * prog.Q_LEN + qi) * prog.num_heads + h, mask=ok, other=1.0)
    async_copy.wait_group(0)
    _partition_barrier()  # every thread's copies are in before this warpgroup's wgmma reads them
    fence_async_shared()
    return amax


@gluon.jit
def _query_rows(prog: Program, layout: gl.constexpr, N_ROWS: gl.constexpr, SPREAD: gl.constexpr = False):
    """Pointers to the program's `N_ROWS` query rows and whether each is a row of the problem, in `layout`; with
    `SPREAD` the query rows `N_ROWS / 2` of them hold (`_store_query_e4m3`), the others none."""
    if SPREAD:
        r = gl.arange(0, N_ROWS, layout=layout)
        qi, h, ok = _rows_at((r // 16) * 8 + r % 8, prog.pid_m, prog.num_heads, prog.Q_LEN, prog.SPARSE, N_ROWS // 2)
        ok = ok & ((r // 8) % 2 == 0)
    else:
        qi, h, ok = _rows(prog.pid_m, prog.num_heads, layout, prog.Q_LEN, prog.SPARSE, N_ROWS)
    return prog.q_ptr + prog.b.to(gl.int64) * prog.stride_qb + qi * prog.stride_qt + h * prog.stride_qh, ok


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
def _full_slot(ring: Ring, t, FENCE_SLOTS: gl.constexpr):
    """(ring slot, barrier phase) of tile `t`, once its loader has filled the slot; fenced for wgmma where
    `FENCE_SLOTS` (cp.async wrote it through the generic proxy, and wgmma reads it asynchronously)."""
    slot = t % ring.STAGES
    phase = (t // ring.STAGES) & 1
    mbarrier.wait(ring.full_bars.index(slot), phase)
    if FENCE_SLOTS:
        fence_async_shared()
    return slot, phase


@gluon.jit
def _inv_sums(l_i, out_scale):
    """`out_scale / l` per row, 0 for a row that saw nothing (its output is zeros)."""
    return gl.where(l_i > 0.0, out_scale / gl.where(l_i > 0.0, l_i, 1.0), 0.0)


@gluon.jit
def _lse(m_i, l_i):
    """Natural-log LSE from the base-2 running max and sum; -inf for a row that saw nothing."""
    return gl.where(l_i > 0.0, (m_i + gl.log2(gl.where(l_i > 0.0, l_i, 1.0))) * 0.6931471805599453, float("-inf"))


@gluon.jit
def _round_pairs(x, dtype: gl.constexpr):
    """fp32 `x` rounded to `dtype`; bf16 two values an instruction (`cvt.rn.bf16x2.f32`): from the scalar cast ptxas
    makes one `F2F.BF16.F32` a value (fp16 casts it packs into `F2FP.F16.F32.PACK_AB` by itself)."""
    if dtype == gl.bfloat16:
        return gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [x], dtype=gl.bfloat16,
                                         is_pure=True, pack=2)
    else:
        return x.to(dtype)


@gluon.jit
def _store_out(ptrs, values, mask, EVICT_LAST: gl.constexpr):
    """The epilogue's output store; `EVICT_LAST` (split partials): with an L2 evict-last hint, meant to keep them
    in L2 for the combine."""
    if EVICT_LAST:
        gl.store(ptrs, values, mask=mask, eviction_policy="evict_last")
    else:
        gl.store(ptrs, values, mask=mask)


@gluon.jit
def _epilogue(acc, m_i, l_i, prog: Program, o_layout: gl.constexpr, rows_m: gl.constexpr, COL0: gl.constexpr,
              N_COLS: gl.constexpr, WRITE_LSE: gl.constexpr, ROW0: gl.constexpr = 0):
    """The 64-row forms' epilogue (the program's rows on M): output columns `COL0 .. COL0 + N_COLS - 1` of `acc` (in
    `o_layout`) normalised by the row sums (the partial or final output) and, with `WRITE_LSE`, the LSE from the
    base-2 running max `m_i` (in `rows_m`); `l_i` in any row layout. An `acc` of fewer rows (dense) is the program's
    rows `ROW0 ..` (a piece of a larger output; no LSE)."""
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    N_ROWS: gl.constexpr = acc.shape[0]
    if N_ROWS == ROWS:
        qi_o, h_o, ok_o = _rows(prog.pid_m, prog.num_heads, rows_o, prog.Q_LEN, prog.SPARSE)
    else:  # the piece as the (ROWS / N_ROWS x pid_m + ROW0 / N_ROWS)-th block of N_ROWS rows
        gl.static_assert(not prog.SPARSE and not WRITE_LSE, "row pieces: dense, without the LSE")
        qi_o, h_o, ok_o = _rows(prog.pid_m * (ROWS // N_ROWS) + ROW0 // N_ROWS, prog.num_heads, rows_o, prog.Q_LEN,
                                prog.SPARSE, N_ROWS)
    cols_o = COL0 + gl.arange(0, N_COLS, layout=gl.SliceLayout(0, o_layout))
    o_row = (prog.o_ptr + prog.b.to(gl.int64) * prog.stride_ob + prog.split * prog.stride_os + qi_o * prog.stride_ot
             + h_o * prog.stride_oh)
    inv_l = _inv_sums(gl.convert_layout(l_i, rows_o), prog.out_scale)
    values = _round_pairs(acc * inv_l[:, None], prog.o_ptr.dtype.element_ty)
    _store_out(o_row[:, None] + cols_o[None, :], values, (ok_o & prog.store_o)[:, None] & (cols_o[None, :] < 512),
               prog.EVICT_LAST)
    if WRITE_LSE:
        _store_lse(m_i, gl.convert_layout(l_i, rows_m), prog, rows_m)


@gluon.jit
def _store_lse(m_i, l_i, prog: Program, rows_m: gl.constexpr, N_ROWS: gl.constexpr = ROWS):
    """The 64-row forms' LSE of their first `N_ROWS` rows from the base-2 running max `m_i` and the row sums `l_i`
    (both in `rows_m`)."""
    qi, h, ok = _rows(prog.pid_m, prog.num_heads, rows_m, prog.Q_LEN, prog.SPARSE, N_ROWS)
    gl.store(prog.lse_ptr + prog.b.to(gl.int64) * prog.stride_lb + prog.split * prog.stride_ls + qi * prog.stride_lt
             + h * prog.stride_lh, _lse(m_i, l_i), mask=ok)
