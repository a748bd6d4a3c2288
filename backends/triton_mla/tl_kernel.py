"""The portable stage-1 kernel (`tl`, any SM80+ GPU and the CPU interpreter): one split of the KV range a program.

Grid `(m_blocks, batch, num_splits)`, or with ORDERED `(m_blocks, programs)` read from a prepared order (longest
first, `splits.launch_order`): a program owns `BLOCK_H` query rows of one request and one contiguous range of
its KV tokens (dense) or of its top-k list (sparse). Dense rows pack the query block `q_len x heads` into the matrix
M dimension (row `r` is query token `r // heads`, head `r % heads`), so a KV tile read from HBM serves every head and
every MTP token at once; sparse rows are heads of one query token (each token has its own top-k list). Each KV tile
is loaded once as `[BLOCK_N, 576]` and used twice: transposed for the scores `q @ k^T` and as V (its first 512
columns) for `p @ v`. FP8 e4m3 tiles are cast right after the load; the per-tensor scale is folded into the score
scale and applied once to the output, so the cast is exact. vLLM's fp8_ds_mla rows (DS_MLA: 512 e4m3 values,
four float32 scales, one per 128 columns, 64 bf16 RoPE values) are read in place: the e4m3 columns are cast exactly
as above and each group's scores and probabilities are multiplied by its tokens' scales. The m-block is the fastest
grid dimension, so programs that read the same KV range run side by side and the second read hits L2. The partials
are merged by `combine._mla_combine_kernel`.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

@triton.constexpr_function
def scratch_per_program(block_h, block_n):
    """2-byte elements of one program's SPLIT_SCORES scratch: two slots of p, two of alpha (fp32)."""
    return 2 * block_h * (block_n + 2)


@triton.jit
def split_size(n_items, num_splits, shortest, BLOCK_N: tl.constexpr):
    """One request's split under SPLIT_PER_REQUEST: its `n_items` over `num_splits`, rounded up to whole tiles and
    at least `shortest` (a multiple of BLOCK_N), so `num_splits` splits always cover the request."""
    return tl.maximum(tl.cdiv(tl.cdiv(n_items, num_splits), BLOCK_N) * BLOCK_N, shortest)


Q_FP16_SCALE = 0.00390625  # 2^-8: the query scale of FP16_MATH, passed as `q_scale` (see _load_q)


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr):
    """`acc + a @ b`; UPCAST (CPU interpreter only, whose bf16 `tl.dot` is wrong) in fp32."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _kv_rows(n0, end, seq_len, topk_row, bt_row, kv_ptr, stride_kvp, stride_kvt, entries, slots, first,
             BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, SPARSE: tl.constexpr,
             HOIST_PAGES: tl.constexpr):
    """Token positions `[BLOCK_N]`, their validity, and row pointers into the paged cache.

    With HOIST_PAGES the tile looks its rows up in what `_chunk_table` loaded into
    registers for the chunk, so the tile's address depends on no load inside the
    loop and Triton's pipeliner can keep a tile in flight.
    """
    offs_n = n0 + tl.arange(0, BLOCK_N)
    in_range = offs_n < end
    if SPARSE and HOIST_PAGES > 0:
        j = tl.where(in_range, offs_n - first, 0)
        pos = tl.gather(entries, j, 0)
        tok_ok = in_range & (pos >= 0)
        # The strides multiply after the gather, so Triton still knows the rows are 16-byte
        # aligned (a gathered byte offset loses that, and the tile loads become scalar).
        slot = tl.gather(slots, j, 0)
        kv_row = kv_ptr + (slot // PAGE_SIZE).to(tl.int64) * stride_kvp + (slot % PAGE_SIZE) * stride_kvt
    else:
        if SPARSE:
            pos = tl.load(topk_row + offs_n, mask=in_range, other=-1)
            tok_ok = in_range & (pos >= 0) & (pos < seq_len)
        else:
            pos = offs_n
            tok_ok = in_range
        if HOIST_PAGES > 0:
            page = tl.gather(entries, tl.where(tok_ok, pos // PAGE_SIZE - first, 0), 0)
        else:
            page = tl.load(bt_row + pos // PAGE_SIZE, mask=tok_ok, other=0)
        kv_row = kv_ptr + page.to(tl.int64) * stride_kvp + (pos % PAGE_SIZE) * stride_kvt
    return pos, tok_ok, kv_row


@triton.jit
def _chunk_table(bt_row, topk_row, seq_len, c0, c_end,
                 PAGE_SIZE: tl.constexpr, HOIST_PAGES: tl.constexpr, SPARSE: tl.constexpr):
    """What the tiles of items `c0 .. c_end - 1` look their rows up in, loaded once into
    registers as `(entries, slots, first)` (placeholders without HOIST_PAGES).

    Dense: `entries` = the chunk's `HOIST_PAGES` block-table entries from page `first`.
    Sparse: `entries` = the top-k positions of slots `first = c0 ...` (-1 where unused or
    out of range) and `slots` = their rows' indices `page x PAGE_SIZE + pos % PAGE_SIZE` in
    the cache, so a tile gathers both instead of two dependent loads (top-k slot, then
    block table).
    """
    offs_p = tl.arange(0, max(HOIST_PAGES, 1))
    entries = offs_p
    slots = offs_p
    first = c0
    if HOIST_PAGES > 0:
        if SPARSE:
            pos = tl.load(topk_row + c0 + offs_p, mask=c0 + offs_p < c_end, other=-1)
            ok = (pos >= 0) & (pos < seq_len)
            page = tl.load(bt_row + pos // PAGE_SIZE, mask=ok, other=0)
            slots = tl.where(ok, page * PAGE_SIZE + pos % PAGE_SIZE, 0)
            entries = tl.where(ok, pos, -1)
        else:
            first = c0 // PAGE_SIZE
            entries = tl.load(bt_row + first + offs_p, mask=(first + offs_p) * PAGE_SIZE < c_end, other=0)
    return entries, slots, first


@triton.jit
def _load_kv(kv_row, col0, offs, tok_ok, dtype: tl.constexpr, KV_CAST: tl.constexpr,
             LAST_USE: tl.constexpr = False, OPAQUE_CAST: tl.constexpr = False):
    """Columns `col0 + offs` of the tile, zero for invalid tokens; FP8 cast to `dtype` (exact).

    OPAQUE_CAST (FP8 to fp16 only): the cast is an inline-asm `cvt` marked impure, which
    Triton cannot move past the change to the MMA operand layout. So the fp16 tile goes
    through shared memory and reaches the V operand by `ldmatrix.trans`; with the plain
    cast Triton moves the 8-bit tile instead, and 8-bit values have no transposing
    `ldmatrix`: a 16-row tile then reads V with 128 byte loads per thread and tile.
    """
    if LAST_USE:  # a distinct load (not merged with an identical earlier one), evicted first
        k = tl.load(kv_row[:, None] + col0 + offs[None, :], mask=tok_ok[:, None], other=0.0,
                    eviction_policy="evict_first")
    else:
        k = tl.load(kv_row[:, None] + col0 + offs[None, :], mask=tok_ok[:, None], other=0.0)
    if KV_CAST and OPAQUE_CAST and dtype == tl.float16:
        k = tl.inline_asm_elementwise("cvt.rn.f16x2.e4m3x2 $0, $1;", "=r,h", [k.to(tl.int8, bitcast=True)],
                                      dtype=tl.float16, is_pure=False, pack=2)
    elif KV_CAST:  # the per-tensor scale is applied outside the matmuls
        k = k.to(dtype)
    return k


@triton.jit
def _ds_mla_scales(kv_row, tok_ok, D_LATENT: tl.constexpr):
    """An fp8_ds_mla tile's four float32 group scales `[BLOCK_N]` each (bytes `D_LATENT ..`; 0 for invalid tokens)."""
    s_row = (kv_row + D_LATENT).to(tl.pointer_type(tl.float32), bitcast=True)
    s0 = tl.load(s_row, mask=tok_ok, other=0.0)
    s1 = tl.load(s_row + 1, mask=tok_ok, other=0.0)
    s2 = tl.load(s_row + 2, mask=tok_ok, other=0.0)
    s3 = tl.load(s_row + 3, mask=tok_ok, other=0.0)
    return s0, s1, s2, s3


@triton.jit
def _ds_mla_rope(kv_row, offs_r, tok_ok, dtype: tl.constexpr, D_LATENT: tl.constexpr):
    """An fp8_ds_mla tile's bf16 RoPE columns (bytes `D_LATENT + 16 ..`), converted to the product dtype."""
    r_row = (kv_row + D_LATENT + 16).to(tl.pointer_type(tl.bfloat16), bitcast=True)
    return tl.load(r_row[:, None] + offs_r[None, :], mask=tok_ok[:, None], other=0.0).to(dtype)


@triton.jit
def _ds_mla_scores(q_pe, k_pe, q0, k0, q1, k1, q2, k2, q3, k3, s0, s1, s2, s3, zero, DOT_UPCAST: tl.constexpr):
    """`q @ k^T` of an fp8_ds_mla tile: each 128-column group's product scaled by its tokens' scales."""
    qk = _dot(q_pe, tl.trans(k_pe), zero, DOT_UPCAST)
    qk += _dot(q0, tl.trans(k0), zero, DOT_UPCAST) * s0[None, :]
    qk += _dot(q1, tl.trans(k1), zero, DOT_UPCAST) * s1[None, :]
    qk += _dot(q2, tl.trans(k2), zero, DOT_UPCAST) * s2[None, :]
    qk += _dot(q3, tl.trans(k3), zero, DOT_UPCAST) * s3[None, :]
    return qk


@triton.jit
def _load_q(ptrs, row_ok, q_scale, FP16_MATH: tl.constexpr):
    """Query columns; with FP16_MATH (FP8 KV) multiplied by `q_scale` and rounded to fp16.

    On SM89+ an e4m3 pair converts to fp16 in one instruction but to bf16 in three,
    so FP8 tiles are multiplied in fp16. With `q_scale` = 2^-8 any query below 2^24
    stays finite and every bf16 value above 2^-9 converts exactly; the scale is taken
    back out of the scores. It is a runtime argument on purpose: with a constant
    power of two, LLVM rounds to fp16 first and scales after, which overflows
    (measured on the H100: queries of 1e5 gave empty rows).
    """
    q = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    if FP16_MATH:
        q = (q.to(tl.float32) * q_scale).to(tl.float16)
    return q


@triton.jit
def _exchange(p, alpha, p_slot, a_slot, parity, INTERPRETED: tl.constexpr):
    """`p` and `alpha` through global memory and back (SPLIT_SCORES).

    Triton 3.6 gives a score matmul whose result reaches another matmul both
    warpgroups' worth of rows (each computes all 64 x BLOCK_N scores); with the
    probabilities and the rescale factor re-read from memory nothing links the
    two matmuls, and the score matmul is split between the warpgroups (half the
    tokens each). A program alternates between two slots, so one barrier per tile
    suffices: a slot is rewritten only after every thread passed the next tile's
    barrier, i.e. after its reads. The barrier is inline `bar.sync` because
    `tl.debug_barrier` in the loop stops Triton pipelining the KV loads; the
    reloads use its result, so they cannot be hoisted above it.
    """
    tl.store(p_slot, p)
    tl.store(a_slot, alpha)
    if INTERPRETED:  # programs run one at a time: nothing to synchronise
        zero = 0
    else:
        sync = tl.inline_asm_elementwise("bar.sync 0;\n\tmov.u32 $0, 0;", "=r,r", [parity + tl.zeros([1], tl.int32)],
                                         dtype=tl.int32, is_pure=False, pack=1)
        zero = tl.sum(sync, 0)
    return tl.load(p_slot + zero), tl.load(a_slot + zero)


@triton.jit
def _online_softmax(qk, pos, tok_ok, visible_len, qk_scale, m_i, l_i):
    """Mask, scale and exponentiate one score tile (log2 domain).

    Returns the new running max and sum, the probabilities `p` and the factor
    `alpha` by which the accumulators must be rescaled.
    """
    visible = tok_ok[None, :] & (pos[None, :] < visible_len[:, None])
    qk = tl.where(visible, qk * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    return m_new, l_i, p, alpha


@triton.jit
def _inv_l(l_i, kv_scale):
    """Output normalisation `kv_scale / l`, 0 for rows that saw no key (never NaN)."""
    return tl.where(l_i > 0.0, kv_scale / tl.where(l_i > 0.0, l_i, 1.0), 0.0)


@triton.jit
def _program_rows(pid_m, b, seq_len, num_heads, topk, topk_ptr, stride_tkb, stride_tkt, rows,
                  Q_LEN: tl.constexpr, BLOCK_H: tl.constexpr, SPARSE: tl.constexpr):
    """(query token, head, valid) of the program's rows, the items its range is cut from and its top-k row."""
    if SPARSE:
        head_blocks = tl.cdiv(num_heads, BLOCK_H)
        q_tok = pid_m // head_blocks
        h = (pid_m % head_blocks) * BLOCK_H + rows
        qi = q_tok + rows * 0
        row_ok = h < num_heads
        n_items = topk
        topk_row = topk_ptr + b.to(tl.int64) * stride_tkb + q_tok * stride_tkt
    else:
        r = pid_m * BLOCK_H + rows
        qi = r // num_heads
        h = r % num_heads
        row_ok = r < Q_LEN * num_heads
        n_items = seq_len
        topk_row = topk_ptr
    return qi, h, row_ok, n_items, topk_row


@triton.jit
def _attend_split_d(q_row, q_pe, kv_ptr, bt_row, topk_row, o_ptr, p_scratch_ptr, pid_m, b, split, qi, h, seq_len,
                    start, end, visible_len, row_ok, o_ok, rows, offs_r, stride_kvp, stride_kvt, stride_ob, stride_os,
                    stride_ot, stride_oh, q_scale, qk_scale, kv_scale, m_i, l_i, CHUNK, D_LATENT: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, SPARSE: tl.constexpr,
                    KV_CAST: tl.constexpr, DOT_UPCAST: tl.constexpr, RELOAD_V: tl.constexpr, HOIST_PAGES: tl.constexpr,
                    FP16_MATH: tl.constexpr, SPLIT_SCORES: tl.constexpr, OPAQUE_V_CAST: tl.constexpr,
                    DS_MLA: tl.constexpr = False):
    """The program's range with the latent dimension in four column blocks of 128 (four `[BLOCK_H, 128]`
    accumulators), outputs stored: each FP8 block is cast on its own, so no whole `[BLOCK_N, 512]` tile sits in
    registers next to the accumulators. Returns (running max, running sum).

    DS_MLA: the tile is an fp8_ds_mla row (e4m3 latent, four float32 group scales, bf16 RoPE); each group's
    scores are scaled by its tokens' scales and its `p` by them (over `q_scale`, which keeps fp16 `p` normal)."""
    DC: tl.constexpr = D_LATENT // 4
    offs_c = tl.arange(0, DC)
    q0 = _load_q(q_row[:, None] + offs_c[None, :], row_ok, q_scale, FP16_MATH)
    q1 = _load_q(q_row[:, None] + DC + offs_c[None, :], row_ok, q_scale, FP16_MATH)
    q2 = _load_q(q_row[:, None] + 2 * DC + offs_c[None, :], row_ok, q_scale, FP16_MATH)
    q3 = _load_q(q_row[:, None] + 3 * DC + offs_c[None, :], row_ok, q_scale, FP16_MATH)
    acc0 = tl.zeros([BLOCK_H, DC], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_H, DC], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_H, DC], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_H, DC], dtype=tl.float32)
    if SPLIT_SCORES:  # this program's two exchange slots (see _exchange)
        prog = (tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(0) + pid_m
        p_base = p_scratch_ptr + prog.to(tl.int64) * scratch_per_program(BLOCK_H, BLOCK_N)
        p_slots = (p_base.to(tl.pointer_type(q0.dtype), bitcast=True)
                   + rows[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :])
        a_slots = (p_base + 2 * BLOCK_H * BLOCK_N).to(tl.pointer_type(tl.float32), bitcast=True) + rows
        parity = 0
    for c0 in range(start, end, CHUNK):
        c_end = tl.minimum(c0 + CHUNK, end)
        entries, slots, first = _chunk_table(bt_row, topk_row, seq_len, c0, c_end, PAGE_SIZE,
                                             HOIST_PAGES, SPARSE)
        for n0 in range(c0, c_end, BLOCK_N):
            pos, tok_ok, kv_row = _kv_rows(n0, c_end, seq_len, topk_row, bt_row, kv_ptr, stride_kvp,
                                           stride_kvt, entries, slots, first, BLOCK_N, PAGE_SIZE,
                                           SPARSE, HOIST_PAGES)
            k0 = _load_kv(kv_row, 0, offs_c, tok_ok, q0.dtype, KV_CAST)
            k1 = _load_kv(kv_row, DC, offs_c, tok_ok, q0.dtype, KV_CAST)
            k2 = _load_kv(kv_row, 2 * DC, offs_c, tok_ok, q0.dtype, KV_CAST)
            k3 = _load_kv(kv_row, 3 * DC, offs_c, tok_ok, q0.dtype, KV_CAST)
            if DS_MLA:
                k_pe = _ds_mla_rope(kv_row, offs_r, tok_ok, q0.dtype, D_LATENT)
                s0, s1, s2, s3 = _ds_mla_scales(kv_row, tok_ok, D_LATENT)
            else:
                k_pe = _load_kv(kv_row, D_LATENT, offs_r, tok_ok, q0.dtype, KV_CAST)
            if DS_MLA:
                qk = _ds_mla_scores(q_pe, k_pe, q0, k0, q1, k1, q2, k2, q3, k3, s0, s1, s2, s3,
                                    tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32), DOT_UPCAST)
            elif SPLIT_SCORES:  # five independent dots, so that no dot feeds another
                # (a zero Triton cannot prove zero, or it fuses the sum back into a dot chain)
                zero = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32) + (n0 * 0.0)
                qk = (_dot(q_pe, tl.trans(k_pe), zero, DOT_UPCAST) + _dot(q0, tl.trans(k0), zero, DOT_UPCAST)
                      + _dot(q1, tl.trans(k1), zero, DOT_UPCAST) + _dot(q2, tl.trans(k2), zero, DOT_UPCAST)
                      + _dot(q3, tl.trans(k3), zero, DOT_UPCAST))
            else:
                qk = _dot(q_pe, tl.trans(k_pe), tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32), DOT_UPCAST)
                qk = _dot(q0, tl.trans(k0), qk, DOT_UPCAST)
                qk = _dot(q1, tl.trans(k1), qk, DOT_UPCAST)
                qk = _dot(q2, tl.trans(k2), qk, DOT_UPCAST)
                qk = _dot(q3, tl.trans(k3), qk, DOT_UPCAST)
            m_i, l_i, p, alpha = _online_softmax(qk, pos, tok_ok, visible_len, qk_scale, m_i, l_i)
            if DS_MLA:  # p of each group: p x its tokens' scale / q_scale (the output is scaled back by q_scale)
                p_scale = 1.0 / q_scale
                p0 = (p * (s0 * p_scale)[None, :]).to(q0.dtype)
                p1 = (p * (s1 * p_scale)[None, :]).to(q0.dtype)
                p2 = (p * (s2 * p_scale)[None, :]).to(q0.dtype)
                p3 = (p * (s3 * p_scale)[None, :]).to(q0.dtype)
            p = p.to(q0.dtype)
            if SPLIT_SCORES:
                p, alpha = _exchange(p, alpha, p_slots + parity * (BLOCK_H * BLOCK_N),
                                     a_slots + parity * BLOCK_H, parity, DOT_UPCAST)
                parity = 1 - parity
            if RELOAD_V:  # one consumer per load (see _attend_whole)
                k0 = _load_kv(kv_row, 0, offs_c, tok_ok, q0.dtype, KV_CAST, True, OPAQUE_V_CAST)
                k1 = _load_kv(kv_row, DC, offs_c, tok_ok, q0.dtype, KV_CAST, True, OPAQUE_V_CAST)
                k2 = _load_kv(kv_row, 2 * DC, offs_c, tok_ok, q0.dtype, KV_CAST, True, OPAQUE_V_CAST)
                k3 = _load_kv(kv_row, 3 * DC, offs_c, tok_ok, q0.dtype, KV_CAST, True, OPAQUE_V_CAST)
            if DS_MLA:
                acc0 = _dot(p0, k0, acc0 * alpha[:, None], DOT_UPCAST)
                acc1 = _dot(p1, k1, acc1 * alpha[:, None], DOT_UPCAST)
                acc2 = _dot(p2, k2, acc2 * alpha[:, None], DOT_UPCAST)
                acc3 = _dot(p3, k3, acc3 * alpha[:, None], DOT_UPCAST)
            else:
                acc0 = _dot(p, k0, acc0 * alpha[:, None], DOT_UPCAST)
                acc1 = _dot(p, k1, acc1 * alpha[:, None], DOT_UPCAST)
                acc2 = _dot(p, k2, acc2 * alpha[:, None], DOT_UPCAST)
                acc3 = _dot(p, k3, acc3 * alpha[:, None], DOT_UPCAST)
    if DS_MLA:
        kv_scale = kv_scale * q_scale
    inv_l = _inv_l(l_i, kv_scale)
    o_row = o_ptr + b.to(tl.int64) * stride_ob + split * stride_os + qi * stride_ot + h * stride_oh
    o_ptrs = o_row[:, None] + offs_c[None, :]
    tl.store(o_ptrs, acc0 * inv_l[:, None], mask=o_ok[:, None])
    tl.store(o_ptrs + DC, acc1 * inv_l[:, None], mask=o_ok[:, None])
    tl.store(o_ptrs + 2 * DC, acc2 * inv_l[:, None], mask=o_ok[:, None])
    tl.store(o_ptrs + 3 * DC, acc3 * inv_l[:, None], mask=o_ok[:, None])
    return m_i, l_i


@triton.jit
def _attend_whole(q_row, q_pe, kv_ptr, bt_row, topk_row, o_ptr, b, split, qi, h, seq_len, start, end, visible_len,
                  row_ok, o_ok, offs_r, stride_kvp, stride_kvt, stride_ob, stride_os, stride_ot, stride_oh, q_scale,
                  qk_scale, kv_scale, m_i, l_i, CHUNK, D_LATENT: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, SPARSE: tl.constexpr,
                  KV_CAST: tl.constexpr, DOT_UPCAST: tl.constexpr, RELOAD_V: tl.constexpr, HOIST_PAGES: tl.constexpr,
                  FP16_MATH: tl.constexpr, OPAQUE_V_CAST: tl.constexpr):
    """The program's range with all 512 latent columns in one accumulator, outputs stored. Returns (running max,
    running sum)."""
    offs_c = tl.arange(0, D_LATENT)
    q_nope = _load_q(q_row[:, None] + offs_c[None, :], row_ok, q_scale, FP16_MATH)
    acc = tl.zeros([BLOCK_H, D_LATENT], dtype=tl.float32)
    for c0 in range(start, end, CHUNK):
        c_end = tl.minimum(c0 + CHUNK, end)
        entries, slots, first = _chunk_table(bt_row, topk_row, seq_len, c0, c_end, PAGE_SIZE,
                                             HOIST_PAGES, SPARSE)
        for n0 in range(c0, c_end, BLOCK_N):
            pos, tok_ok, kv_row = _kv_rows(n0, c_end, seq_len, topk_row, bt_row, kv_ptr, stride_kvp,
                                           stride_kvt, entries, slots, first, BLOCK_N, PAGE_SIZE,
                                           SPARSE, HOIST_PAGES)
            k = _load_kv(kv_row, 0, offs_c, tok_ok, q_nope.dtype, KV_CAST)
            k_pe = _load_kv(kv_row, D_LATENT, offs_r, tok_ok, q_nope.dtype, KV_CAST)
            qk = _dot(q_nope, tl.trans(k), tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32), DOT_UPCAST)
            qk = _dot(q_pe, tl.trans(k_pe), qk, DOT_UPCAST)
            m_i, l_i, p, alpha = _online_softmax(qk, pos, tok_ok, visible_len, qk_scale, m_i, l_i)
            if RELOAD_V:
                # A second load of the same rows (an L1/L2 hit) gives each load a single
                # consumer, which Triton can pipeline through shared memory.
                k = _load_kv(kv_row, 0, offs_c, tok_ok, q_nope.dtype, KV_CAST, True, OPAQUE_V_CAST)
            acc = _dot(p.to(k.dtype), k, acc * alpha[:, None], DOT_UPCAST)
    inv_l = _inv_l(l_i, kv_scale)
    o_row = o_ptr + b.to(tl.int64) * stride_ob + split * stride_os + qi * stride_ot + h * stride_oh
    tl.store(o_row[:, None] + offs_c[None, :], acc * inv_l[:, None], mask=o_ok[:, None])
    return m_i, l_i


@triton.jit
def _mla_split_kernel(
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
    Q_LEN: tl.constexpr, PAGE_SIZE: tl.constexpr,
    D_LATENT: tl.constexpr, D_ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    SPARSE: tl.constexpr, KV_CAST: tl.constexpr, KV_SCALE_IS_PTR: tl.constexpr,
    DOT_UPCAST: tl.constexpr, SPLIT_D: tl.constexpr, RELOAD_V: tl.constexpr,
    SPLIT_PER_REQUEST: tl.constexpr = False,
    HOIST_PAGES: tl.constexpr = 0, FP16_MATH: tl.constexpr = False,
    p_scratch_ptr=None, SPLIT_SCORES: tl.constexpr = False, OPAQUE_V_CAST: tl.constexpr = False,
    DS_MLA: tl.constexpr = False, order_ptr=None, ORDERED: tl.constexpr = False,
    LAUNCH_COMBINE_EARLY: tl.constexpr = False,
):
    if LAUNCH_COMBINE_EARLY:  # the combine (its programmatic dependent) may start as SMs free up
        gdc_launch_dependents()
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)
    if ORDERED:  # grid (m_blocks, programs): the (request, split) this one runs (splits.launch_order)
        piece = tl.load(order_ptr + b)
        b = piece & 0xFFFF
        split = piece >> 16

    seq_len = tl.load(seq_lens_ptr + b)
    rows = tl.arange(0, BLOCK_H)
    qi, h, row_ok, n_items, topk_row = _program_rows(pid_m, b, seq_len, num_heads, topk, topk_ptr, stride_tkb,
                                                     stride_tkt, rows, Q_LEN, BLOCK_H, SPARSE)
    # MTP causal rule: query token i sees the first seq_len - q_len + 1 + i keys.
    visible_len = seq_len - Q_LEN + 1 + qi

    # Fixed-size splits (split_items is a multiple of BLOCK_N): a short request leaves its last
    # splits empty; those store only lse = -inf, and the combine skips them. Split 0 always
    # stores (zeros for an empty request), which is what the one-split direct path needs.
    if SPLIT_PER_REQUEST:  # this request's size from its length; split_items is the shortest split
        split_items = split_size(n_items, tl.num_programs(2), split_items, BLOCK_N)
    start = split * split_items
    end = tl.minimum(start + split_items, n_items)
    o_ok = row_ok & ((start < n_items) | (split == 0))
    # With HOIST_PAGES the range is walked in chunks whose lookups are loaded once into
    # registers (dense: a chunk spans at most HOIST_PAGES pages; sparse: HOIST_PAGES top-k
    # slots); otherwise in one.
    if HOIST_PAGES > 0 and SPARSE:
        CHUNK: tl.constexpr = HOIST_PAGES
    elif HOIST_PAGES > 0:
        CHUNK: tl.constexpr = (HOIST_PAGES - 1) * PAGE_SIZE // BLOCK_N * BLOCK_N
    else:
        CHUNK = split_items

    if KV_SCALE_IS_PTR:
        kv_scale = tl.load(kv_scale_ptr).to(tl.float32)
    qk_scale = sm_scale_log2 * kv_scale
    if FP16_MATH:
        qk_scale = qk_scale / q_scale
    q_row = q_ptr + b.to(tl.int64) * stride_qb + qi * stride_qt + h * stride_qh
    bt_row = block_table_ptr + b.to(tl.int64) * stride_btb
    offs_r = tl.arange(0, D_ROPE)
    q_pe = _load_q(q_row[:, None] + D_LATENT + offs_r[None, :], row_ok, q_scale, FP16_MATH)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    if SPLIT_D:
        m_i, l_i = _attend_split_d(q_row, q_pe, kv_ptr, bt_row, topk_row, o_ptr, p_scratch_ptr, pid_m, b, split, qi, h,
                                   seq_len, start, end, visible_len, row_ok, o_ok, rows, offs_r, stride_kvp,
                                   stride_kvt, stride_ob, stride_os, stride_ot, stride_oh, q_scale, qk_scale, kv_scale,
                                   m_i, l_i, CHUNK, D_LATENT, BLOCK_H, BLOCK_N, PAGE_SIZE, SPARSE, KV_CAST,
                                   DOT_UPCAST, RELOAD_V, HOIST_PAGES, FP16_MATH, SPLIT_SCORES, OPAQUE_V_CAST, DS_MLA)
    else:
        m_i, l_i = _attend_whole(q_row, q_pe, kv_ptr, bt_row, topk_row, o_ptr, b, split, qi, h, seq_len, start, end,
                                 visible_len, row_ok, o_ok, offs_r, stride_kvp, stride_kvt, stride_ob, stride_os,
                                 stride_ot, stride_oh, q_scale, qk_scale, kv_scale, m_i, l_i, CHUNK, D_LATENT,
                                 BLOCK_H, BLOCK_N, PAGE_SIZE, SPARSE, KV_CAST, DOT_UPCAST, RELOAD_V, HOIST_PAGES,
                                 FP16_MATH, OPAQUE_V_CAST)

    lse = tl.where(l_i > 0.0, (m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    tl.store(lse_ptr + b.to(tl.int64) * stride_lb + split * stride_ls + qi * stride_lt + h * stride_lh,
             lse, mask=row_ok)


