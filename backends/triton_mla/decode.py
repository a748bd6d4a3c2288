"""`mla_decode`: the public one-call entry point (allocates its outputs and workspace)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mla_tune.backends.triton_mla.config import (
    D_LATENT, D_ROPE, DS_MLA_BYTES, LaunchParams, Tile, cc_major, is_ds_mla, sm_count, tile_from_dict)
from mla_tune.backends.triton_mla.launcher import launch
from mla_tune.backends.triton_mla.splits import params_for
from mla_tune.backends.triton_mla.workspace import Workspace


def _validate(q, kv_cache, block_table, seq_lens, kv_lora_rank, kv_scale, topk_indices) -> None:
    if kv_lora_rank != D_LATENT:
        raise ValueError(f"kv_lora_rank {kv_lora_rank} is not supported; the kernel is built for {D_LATENT}")
    named = {"kv_cache": kv_cache, "block_table": block_table, "seq_lens": seq_lens, "topk_indices": topk_indices}
    for name, tensor in named.items():
        if tensor is not None and tensor.device != q.device:
            raise ValueError(f"{name} is on {tensor.device}; expected q's device {q.device}")
    if q.dim() != 4 or q.shape[-1] != D_LATENT + D_ROPE:
        raise ValueError(f"q has shape {tuple(q.shape)}; expected [batch, q_len, heads, {D_LATENT + D_ROPE}]")
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"q has dtype {q.dtype}; expected bfloat16 or float16")
    if not 1 <= q.shape[1] <= 4:
        raise ValueError(f"q_len {q.shape[1]} is not in 1..4")
    if not 1 <= q.shape[2] <= 128:
        raise ValueError(f"heads {q.shape[2]} is not in 1..128")
    if is_ds_mla(kv_cache):
        _validate_ds_mla(q, kv_cache, kv_scale)
    elif kv_cache.dim() != 3 or kv_cache.shape[-1] != D_LATENT + D_ROPE:
        raise ValueError(f"kv_cache has shape {tuple(kv_cache.shape)}; expected "
                         f"[num_pages, page_size, {D_LATENT + D_ROPE}] (or uint8 fp8_ds_mla rows of {DS_MLA_BYTES})")
    elif kv_cache.dtype == torch.float8_e4m3fn:
        if q.dtype != torch.bfloat16 and q.dtype != torch.float16:
            raise ValueError(f"FP8 KV needs a bf16 or fp16 query, got {q.dtype}")
    elif kv_cache.dtype != q.dtype:
        raise ValueError(f"kv_cache has dtype {kv_cache.dtype}; expected q's {q.dtype} or float8_e4m3fn")
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("q and kv_cache need a contiguous last dimension")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != q.shape[0]:
        raise ValueError(f"block_table must be int32 [batch={q.shape[0]}, max_pages], got "
                         f"{block_table.dtype} {tuple(block_table.shape)}")
    if (seq_lens.dtype != torch.int32 or tuple(seq_lens.shape) != (q.shape[0],)
            or not seq_lens.is_contiguous()):
        raise ValueError(f"seq_lens must be contiguous int32 [batch={q.shape[0]}], got "
                         f"{seq_lens.dtype} {tuple(seq_lens.shape)}")
    if topk_indices is not None:
        if (topk_indices.dtype != torch.int32 or topk_indices.dim() != 3
                or tuple(topk_indices.shape[:2]) != tuple(q.shape[:2]) or topk_indices.stride(-1) != 1):
            raise ValueError(f"topk_indices must be int32 [batch, q_len, topk] with a contiguous last "
                             f"dimension, got {topk_indices.dtype} {tuple(topk_indices.shape)}")
    if isinstance(kv_scale, torch.Tensor) and (kv_scale.dim() != 0 or kv_scale.device != q.device):
        raise ValueError(f"kv_scale tensor must be 0-d on {q.device}, got shape {tuple(kv_scale.shape)} "
                         f"on {kv_scale.device}")


def _validate_ds_mla(q, kv_cache, kv_scale) -> None:
    if kv_cache.dim() != 3:
        raise ValueError(f"an fp8_ds_mla kv_cache must be uint8 [num_pages, page_size, {DS_MLA_BYTES}], got shape "
                         f"{tuple(kv_cache.shape)}")
    if q.dtype != torch.bfloat16:
        raise ValueError(f"an fp8_ds_mla kv_cache needs a bf16 query (its RoPE columns are bf16), got {q.dtype}")
    if kv_scale is not None:
        raise ValueError("an fp8_ds_mla kv_cache carries its own scales; pass kv_scale=None")


def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, *, sm_scale: float, kv_lora_rank: int = 512,
               kv_scale=None, topk_indices: torch.Tensor | None = None,
               params: LaunchParams | None = None,
               tile: Tile | Mapping | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed-MLA decode over a paged latent KV cache (dense or top-k sparse).

    Args:
        q: `[batch, q_len, heads, 576]` or `[batch, heads, 576]`, bf16/fp16.
        kv_cache: `[num_pages, page_size, 576]` in q's dtype, or float8_e4m3fn with `kv_scale`, or vLLM's
            fp8_ds_mla rows (uint8 `[num_pages, page_size, 656]`: 512 e4m3 values, a float32 scale per 128 of them,
            64 bf16 RoPE values; bf16 query, no `kv_scale`), read in place by the tl kernel.
        block_table: int32 `[batch, max_pages]`.
        seq_lens: int32 `[batch]`, tokens in the cache including the new query tokens.
        sm_scale: softmax scale.
        kv_lora_rank: latent width; only 512 is supported.
        kv_scale: None, a float, or a 0-d fp32 tensor (real value = stored value x kv_scale).
        topk_indices: int32 `[batch, q_len, topk]` token positions, -1 for unused (sparse).
        params: launch parameters; None derives them from `tile` (or `dispatch.default_tile`), the split
            count from the block-table capacity (top-k for sparse) and, dense, each request's split size from its
            length on the device, so no host sync and one captured CUDA graph suits any lengths. Parameters with
            `longest_first` (chosen for known lengths) read `seq_lens` on the host for their launch order.
        tile: a `Tile` or its fields as a dict, e.g. the tuner's choice for this device from
            `mla_tune.kernel_tile(...)`; ignored when `params` is given.

    Returns:
        `out` `[..., heads, 512]` in q's dtype and `lse` fp32 `[..., heads]` (natural log).
        This convenience call allocates both plus the split workspace; the adapters
        preallocate them in `prepare` instead.
    """
    squeeze = q.dim() == 3
    if squeeze:
        q = q.unsqueeze(1)
    _validate(q, kv_cache, block_table, seq_lens, kv_lora_rank, kv_scale, topk_indices)
    if kv_cache.dtype == torch.float8_e4m3fn and kv_scale is None:
        raise ValueError("kv_scale is required with a float8_e4m3fn kv_cache")
    batch, q_len, num_heads, _ = q.shape
    sparse = topk_indices is not None
    if params is None:
        max_items = topk_indices.shape[2] if sparse else block_table.shape[1] * kv_cache.shape[1]
        if tile is not None and not isinstance(tile, Tile):
            tile = tile_from_dict(dict(tile))  # a dict or mapping, e.g. `mla_tune.kernel_tile(...).tile`
        ds_mla = is_ds_mla(kv_cache)
        params = params_for(tile, num_heads=num_heads, q_len=q_len, batch=batch, max_items=max_items,
                            num_sms=sm_count(q.device), sparse=sparse,
                            kv_fp8=ds_mla or kv_cache.dtype == torch.float8_e4m3fn, cc_major=cc_major(q.device),
                            ds_mla=ds_mla)
    out = torch.empty(batch, q_len, num_heads, D_LATENT, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, q_len, num_heads, dtype=torch.float32, device=q.device)
    workspace = Workspace.for_launch(params, batch=batch, q_len=q_len, num_heads=num_heads, sparse=sparse,
                                     device=q.device, seq_lens=seq_lens)
    launch(q, kv_cache, block_table, seq_lens, out, lse, sm_scale=sm_scale, kv_scale=kv_scale,
           topk_indices=topk_indices, params=params, workspace=workspace)
    if squeeze:
        return out.squeeze(1), lse.squeeze(1)
    return out, lse
