"""Stage 2: the exact merge of the per-split `(out, lse)` partials, in float32.

`lse = logsumexp(lse_s)`, `out = sum_s exp(lse_s - lse) out_s`. Empty splits carry `lse_s = -inf` and `out_s = 0`;
a row with no visible key at all gets `out = 0`, `lse = -inf` (never NaN).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait


@triton.jit
def _mla_combine_kernel(
    o_part_ptr, lse_part_ptr, out_ptr, lse_ptr,
    stride_pb, stride_ps, stride_pt, stride_ph,
    stride_qb, stride_qs, stride_qt, stride_qh,
    stride_ob, stride_ot, stride_oh,
    stride_lb, stride_lt, stride_lh,
    num_heads, num_splits, seq_lens_ptr, split_items,
    D_LATENT: tl.constexpr, BLOCK_S: tl.constexpr, SPLITS_AT_ONCE: tl.constexpr = 1,
    SPLITS_OF_LENGTHS: tl.constexpr = False, AFTER_STAGE1: tl.constexpr = False, LOADS_AHEAD: tl.constexpr = False,
):
    """One (query token, head) row: the softmax-weighted sum of its splits' partials, `SPLITS_AT_ONCE` splits'
    partials loaded together (1: one split after the other). SPLITS_OF_LENGTHS: only the request's splits of
    `split_items` that hold tokens were run (the others' partials are stale). AFTER_STAGE1: launched as stage 1's
    programmatic dependent (SM90+), it waits for stage 1's writes before reading a partial. LOADS_AHEAD: the splits'
    partials loaded at once, without waiting for the LSEs to say which were written."""
    row = tl.program_id(0)  # q_len * heads
    b = tl.program_id(1).to(tl.int64)
    if SPLITS_OF_LENGTHS:
        num_splits = tl.minimum(tl.maximum(tl.cdiv(tl.load(seq_lens_ptr + b), split_items), 1), num_splits)
    qi = row // num_heads
    h = row % num_heads
    offs_s = tl.arange(0, BLOCK_S)
    lse_base = lse_part_ptr + b * stride_qb + qi * stride_qt + h * stride_qh
    offs_c = tl.arange(0, D_LATENT)
    o_base = o_part_ptr + b * stride_pb + qi * stride_pt + h * stride_ph
    if AFTER_STAGE1:
        gdc_wait()
    if LOADS_AHEAD:  # every split's partial that may hold tokens, issued before the LSEs that say which were written
        parts = tl.load(o_base + offs_s[:, None] * stride_ps + offs_c[None, :],
                        mask=(offs_s < num_splits)[:, None], other=0.0)
    lse_s = tl.load(lse_base + offs_s * stride_qs, mask=offs_s < num_splits, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp(lse_s - m_safe), 0)
    inv_total = tl.where(total > 0.0, 1.0 / tl.where(total > 0.0, total, 1.0), 0.0)

    acc = tl.zeros([D_LATENT], dtype=tl.float32)
    if LOADS_AHEAD:  # an unwritten (stale, maybe NaN) partial weighs nothing and is dropped, not multiplied
        weight = tl.exp(lse_s - m_safe) * inv_total
        acc = tl.sum(weight[:, None] * tl.where((lse_s > float("-inf"))[:, None], parts, 0.0), 0)
    else:
        for s0 in range(0, num_splits, SPLITS_AT_ONCE):
            offs = s0 + tl.arange(0, SPLITS_AT_ONCE)
            lse_some = tl.load(lse_base + offs * stride_qs, mask=offs < num_splits, other=float("-inf"))
            weight = tl.exp(lse_some - m_safe) * inv_total
            # empty splits (lse -inf) never wrote their partial: do not read it
            written = lse_some > float("-inf")
            part = tl.load(o_base + offs[:, None] * stride_ps + offs_c[None, :], mask=written[:, None], other=0.0)
            acc += tl.sum(weight[:, None] * part, 0)
    tl.store(out_ptr + b * stride_ob + qi * stride_ot + h * stride_oh + offs_c, acc)
    lse = tl.where(total > 0.0, m_safe + tl.log(tl.where(total > 0.0, total, 1.0)), float("-inf"))
    tl.store(lse_ptr + b * stride_lb + qi * stride_lt + h * stride_lh, lse)
