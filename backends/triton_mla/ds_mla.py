"""Top-k MLA decode over vLLM's fp8_ds_mla cache (DeepSeek-V3.2), read in place.

One token of the cache is 656 bytes: 512 e4m3 latent values, 4 float32 scales (one per 128 latent values),
64 bf16 RoPE values. The kernel gathers each query token's top-k rows (global rows `block x block_size +
offset`, vLLM's `triton_convert_req_index_to_global_index`; -1 skipped), dequantises the latent with its
tile scales, and runs the absorbed-MLA softmax with bf16 tensor-core products and float32 accumulation.

A first, correct version: one program per (token, 16..64 heads), no split of the top-k axis and no
warp specialisation, so it is not yet tuned against FlashMLA; `mla_tune`'s vLLM sparse backend does not
offer it yet. Self-contained: it shares no code with the dense/sparse kernel of this package.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

DS_MLA_BYTES = 656      # bytes per token
D_LATENT = 512
D_ROPE = 64
SCALE_TILE = 128        # latent values per float32 scale
LOG2E = 1.4426950408889634


@triton.jit
def _ds_mla_kernel(q_ptr, cache_ptr, rows_ptr, out_ptr, lse_ptr, sm_scale_log2,
                   stride_qt, stride_qh, stride_row, stride_rt, stride_ot, stride_oh, stride_lt,
                   num_heads, topk, num_rows,
                   BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr):
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = offs_h < num_heads
    offs_d = tl.arange(0, 512)
    offs_r = tl.arange(0, 64)
    q_row = q_ptr + t.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh
    q_lat = tl.load(q_row + offs_d[None, :], mask=head_ok[:, None], other=0.0)
    q_rope = tl.load(q_row + 512 + offs_r[None, :], mask=head_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, 512], tl.float32)
    for n0 in range(0, topk, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        row = tl.load(rows_ptr + t.to(tl.int64) * stride_rt + offs_n, mask=offs_n < topk, other=-1)
        ok = (row >= 0) & (row < num_rows)
        base = cache_ptr + tl.where(ok, row, 0).to(tl.int64) * stride_row        # uint8 pointers [BLOCK_N]
        lat8 = tl.load(base[:, None] + offs_d[None, :], mask=ok[:, None], other=0)
        scale_ptr = (base + 512).to(tl.pointer_type(tl.float32))
        scales = tl.load(scale_ptr[:, None] + (offs_d // 128)[None, :], mask=ok[:, None], other=0.0)
        lat_f32 = lat8.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scales
        rope_ptr = (base + 528).to(tl.pointer_type(tl.bfloat16))
        rope = tl.load(rope_ptr[:, None] + offs_r[None, :], mask=ok[:, None], other=0.0).to(q_rope.dtype)
        if DOT_F32:  # Triton's CPU interpreter: every product in float32, the dequantised latent unrounded
            s = tl.dot(q_lat.to(tl.float32), tl.trans(lat_f32)) \
                + tl.dot(q_rope.to(tl.float32), tl.trans(rope.to(tl.float32)))
        else:
            lat = lat_f32.to(q_lat.dtype)
            s = tl.dot(q_lat, tl.trans(lat)) + tl.dot(q_rope, tl.trans(rope))
        s = tl.where(ok[None, :], s * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p, lat_f32)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat)
        m_i = m_new
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
    o_row = out_ptr + t.to(tl.int64) * stride_ot + offs_h[:, None] * stride_oh
    tl.store(o_row + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
    tl.store(lse_ptr + t.to(tl.int64) * stride_lt + offs_h, lse, mask=head_ok)


def _check(q: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor) -> None:
    if q.dim() != 3 or q.shape[-1] != D_LATENT + D_ROPE or q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"q must be bf16/fp16 [tokens, heads, 576], got {q.dtype} {tuple(q.shape)}")
    if q.stride(-1) != 1:
        raise ValueError("q needs a contiguous last dimension")
    if cache.dtype != torch.uint8 or cache.shape[-1] != DS_MLA_BYTES or cache.stride(-1) != 1:
        raise ValueError(f"cache must be uint8 [..., {DS_MLA_BYTES}] with contiguous bytes, got {cache.dtype} "
                         f"{tuple(cache.shape)}")
    if cache.dim() == 3 and cache.stride(1) != DS_MLA_BYTES and cache.shape[1] > 1:
        raise ValueError(f"the cache's tokens must be {DS_MLA_BYTES} bytes apart, got a stride of {cache.stride(1)}")
    if cache.dim() == 3 and cache.stride(0) % DS_MLA_BYTES:
        raise ValueError(f"the cache's block stride {cache.stride(0)} is not a whole number of {DS_MLA_BYTES}-byte "
                         "rows")
    if rows.dtype != torch.int32 or rows.dim() != 2 or rows.shape[0] != q.shape[0] or rows.stride(-1) != 1:
        raise ValueError(f"rows must be int32 [tokens={q.shape[0]}, topk] with a contiguous last dimension, got "
                         f"{rows.dtype} {tuple(rows.shape)}")
    for name, tensor in (("cache", cache), ("rows", rows)):
        if tensor.device != q.device:
            raise ValueError(f"{name} is on {tensor.device}; expected q's device {q.device}")


def ds_mla_sparse_decode(q: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor, *, sm_scale: float,
                         block_h: int | None = None, block_n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k absorbed-MLA attention of each query token over an fp8_ds_mla cache.

    Args:
        q: `[tokens, heads, 576]` bf16/fp16 (latent 512 then RoPE 64).
        cache: uint8 `[num_blocks, block_size, 656]` (blocks may lie further apart than block_size rows, as
            `flat_kv_row_view` allows) or `[rows, 656]`.
        rows: int32 `[tokens, topk]` global rows, -1 (or >= the cache's rows) for none.
        sm_scale: softmax scale.
        block_h: heads per program (16, 32 or 64); None picks the smallest that covers the heads, up to 64.
        block_n: top-k rows per tile.

    Returns:
        `out` `[tokens, heads, 512]` in q's dtype, `lse` float32 `[tokens, heads]` (natural log; -inf and a
        zero output for a token with no valid row).
    """
    _check(q, cache, rows)
    tokens, num_heads, _ = q.shape
    if cache.dim() == 3:
        row_stride = DS_MLA_BYTES
        num_rows = (cache.shape[0] - 1) * (cache.stride(0) // DS_MLA_BYTES) + cache.shape[1]
    else:
        row_stride, num_rows = cache.stride(0), cache.shape[0]
    if block_h is None:
        block_h = min(64, max(16, triton.next_power_of_2(num_heads)))
    out = torch.empty(tokens, num_heads, D_LATENT, dtype=q.dtype, device=q.device)
    lse = torch.empty(tokens, num_heads, dtype=torch.float32, device=q.device)
    grid = (tokens, triton.cdiv(num_heads, block_h))
    _ds_mla_kernel[grid](q, cache, rows, out, lse, sm_scale * LOG2E,
                         q.stride(0), q.stride(1), row_stride, rows.stride(0), out.stride(0), out.stride(1),
                         lse.stride(0), num_heads, rows.shape[1], num_rows,
                         BLOCK_H=block_h, BLOCK_N=block_n, DOT_F32=q.device.type != "cuda",
                         num_warps=4 if block_h <= 16 else 8)
    return out, lse


def pack_fp8_ds_mla(kv: torch.Tensor) -> torch.Tensor:
    """fp8_ds_mla bytes `[..., 656]` of float values `[..., 576]`: each 128-value latent tile scaled by its
    absolute maximum over 448 (e4m3's largest), RoPE rounded to bf16 (as vLLM's cache writer stores it)."""
    latent = kv[..., :D_LATENT].float()
    tiles = latent.unflatten(-1, (D_LATENT // SCALE_TILE, SCALE_TILE))
    scales = (tiles.abs().amax(-1) / 448.0).clamp(min=1e-12)
    quantized = (tiles / scales.unsqueeze(-1)).to(torch.float8_e4m3fn).flatten(-2)
    packed = torch.empty(*kv.shape[:-1], DS_MLA_BYTES, dtype=torch.uint8, device=kv.device)
    packed[..., :D_LATENT] = quantized.view(torch.uint8)
    packed[..., D_LATENT:D_LATENT + 16] = scales.to(torch.float32).contiguous().view(torch.uint8)
    packed[..., D_LATENT + 16:] = kv[..., D_LATENT:].to(torch.bfloat16).contiguous().view(torch.uint8)
    return packed


def unpack_fp8_ds_mla(packed: torch.Tensor) -> torch.Tensor:
    """The float32 values `[..., 576]` an fp8_ds_mla cache holds (the reference's view of it)."""
    latent = packed[..., :D_LATENT].contiguous().view(torch.float8_e4m3fn).float()
    scales = packed[..., D_LATENT:D_LATENT + 16].contiguous().view(torch.float32)
    rope = packed[..., D_LATENT + 16:].contiguous().view(torch.bfloat16).float()
    latent = (latent.unflatten(-1, (D_LATENT // SCALE_TILE, SCALE_TILE)) * scales.unsqueeze(-1)).flatten(-2)
    return torch.cat([latent, rope], dim=-1)


def ds_mla_reference(q: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor, *,
                     sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 top-k MLA over the dequantised cache: `out` `[tokens, heads, 512]`, `lse` `[tokens, heads]`."""
    if cache.dim() == 3:  # global rows block x (block stride in rows) + offset, as the kernel reads them
        num_rows = (cache.shape[0] - 1) * (cache.stride(0) // DS_MLA_BYTES) + cache.shape[1]
        cache = cache.as_strided((num_rows, DS_MLA_BYTES), (DS_MLA_BYTES, 1))
    flat = unpack_fp8_ds_mla(cache)
    ok = (rows >= 0) & (rows < flat.shape[0])
    keys = flat[rows.clamp(0, flat.shape[0] - 1).long()]                     # [T, K, 576]
    logits = torch.einsum("thd,tkd->thk", q.float(), keys) * sm_scale
    logits = logits.masked_fill(~ok.unsqueeze(1), -math.inf)
    lse = torch.logsumexp(logits, dim=-1)
    seen = torch.isfinite(lse)
    probs = torch.where(seen.unsqueeze(-1), torch.exp(logits - torch.where(seen, lse, 0.0).unsqueeze(-1)), 0.0)
    return torch.einsum("thk,tkd->thd", probs, keys[..., :D_LATENT]), lse
