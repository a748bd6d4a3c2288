"""The wide FP8-query form's query, rounded to e4m3 once per launch, before stage 1 (as FlashMLA rounds its query).

Each query row is scaled so its largest magnitude is e4m3's largest (448), then rounded; `q_amax` keeps
`max |q_row| / 448` (1 for a row of zeros), the factor the row's scores take back. Every program of the row's
request then copies the rounded row (576 bytes) into shared memory instead of loading the bf16 row and rounding it
again, which at a few tiles a program was a large part of its time. Stage 1 is launched as this kernel's
programmatic dependent and waits for it only before copying the rows (docs/kernels.md, the wide FP8-query form).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from mla_tune.backends.triton_mla import config
from mla_tune.backends.triton_mla.config import D_LATENT, cc_major

E4M3_MAX = tl.constexpr(config.E4M3_MAX)
ROWS_PER_PROGRAM = 16


@triton.jit
def _round_query_kernel(q_ptr, q8_ptr, amax_ptr, n_rows, num_heads, q_len, stride_qb, stride_qt, stride_qh,
                        D_LATENT: tl.constexpr, D_ROPE: tl.constexpr, BLOCK_R: tl.constexpr,
                        LAUNCH_DEPENDENTS: tl.constexpr = False):
    """`BLOCK_R` rows of `q` (`[batch, q_len, heads, 576]`, rows in that order) into `q8` (contiguous, e4m3) and
    their `max |q_row| / 448` into `amax` (contiguous fp32)."""
    if LAUNCH_DEPENDENTS:  # stage 1 (its programmatic dependent) may start; it waits before reading the rows
        gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < n_rows
    h = rows % num_heads
    t = (rows // num_heads) % q_len
    b = (rows // num_heads // q_len).to(tl.int64)
    q_row = q_ptr + b * stride_qb + t * stride_qt + h * stride_qh
    lat_cols = tl.arange(0, D_LATENT)
    rope_cols = D_LATENT + tl.arange(0, D_ROPE)
    lat = tl.load(q_row[:, None] + lat_cols[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    rope = tl.load(q_row[:, None] + rope_cols[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(lat), 1), tl.max(tl.abs(rope), 1))
    amax = tl.where(amax > 0.0, amax, E4M3_MAX)
    scale = E4M3_MAX / amax
    out_row = q8_ptr + rows.to(tl.int64) * (D_LATENT + D_ROPE)
    tl.store(out_row[:, None] + lat_cols[None, :], (lat * scale[:, None]).to(q8_ptr.dtype.element_ty),
             mask=ok[:, None])
    tl.store(out_row[:, None] + rope_cols[None, :], (rope * scale[:, None]).to(q8_ptr.dtype.element_ty),
             mask=ok[:, None])
    tl.store(amax_ptr + rows, amax / E4M3_MAX, mask=ok)


def round_query(q: torch.Tensor, q8: torch.Tensor, q_amax: torch.Tensor) -> None:
    """Enqueue the rounding of `q` (`[batch, q_len, heads, 576]`, last dim contiguous) into `q8` (the same shape,
    contiguous, float8_e4m3fn) and `q_amax` (`[batch, q_len, heads]`, contiguous fp32); no allocation, no sync."""
    batch, q_len, heads, width = q.shape
    if q8.shape != q.shape or not q8.is_contiguous() or q8.dtype != torch.float8_e4m3fn:
        raise ValueError(f"q8 must be a contiguous float8_e4m3fn tensor of q's shape {tuple(q.shape)}, got "
                         f"{q8.dtype} {tuple(q8.shape)}")
    if q_amax.shape != q.shape[:3] or not q_amax.is_contiguous() or q_amax.dtype != torch.float32:
        raise ValueError(f"q_amax must be a contiguous float32 tensor of shape {tuple(q.shape[:3])}, got "
                         f"{q_amax.dtype} {tuple(q_amax.shape)}")
    n_rows = batch * q_len * heads
    _round_query_kernel[(triton.cdiv(n_rows, ROWS_PER_PROGRAM),)](
        q, q8, q_amax, n_rows, heads, q_len, q.stride(0), q.stride(1), q.stride(2),
        D_LATENT=D_LATENT, D_ROPE=width - D_LATENT, BLOCK_R=ROWS_PER_PROGRAM,
        LAUNCH_DEPENDENTS=(cc_major(q.device) or 0) >= 9, num_warps=4)


def round_query_reference(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q8, q_amax) as `round_query` computes them, in torch (the tests' reference)."""
    x = q.float()
    amax = x.abs().amax(-1)
    top = config.E4M3_MAX
    amax = torch.where(amax > 0, amax, torch.full_like(amax, top))
    q8 = (x * (top / amax)[..., None]).to(torch.float8_e4m3fn)
    return q8, amax / top
