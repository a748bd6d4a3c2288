"""The float32 MLA decode reference: the oracle every backend is checked against.

Runs on CPU or GPU tensors, dense or sparse (top-k), any head count, q_len >= 1.
It is plain PyTorch, one request at a time, written for clarity rather than
speed; TORCH_REFERENCE wraps it as an adapter but is never a candidate winner.

Masking rule (vLLM's, for MTP): query position i of a request with L cached
tokens (the q_len new ones included) sees the first `L - q_len + 1 + i`
tokens. Sparse: only the listed top-k positions, restricted the same way;
-1 slots are ignored. A row that sees no key at all returns out 0 and lse
-inf (the softmax over an empty set has no mass).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

from mla_tune.backends.interface import DecodeInputs, check_inputs
from mla_tune.backends.problem import Problem

if TYPE_CHECKING:
    import torch


def _request_kv(kv_cache: "torch.Tensor", pages: "torch.Tensor", length: int,
                kv_scale) -> "torch.Tensor":
    """The first `length` tokens of one request as float32 `[length, D]`, dequantised."""
    page_size = kv_cache.shape[1]
    needed = math.ceil(length / page_size)
    rows = kv_cache[pages[:needed].long()].reshape(needed * page_size, kv_cache.shape[-1])[:length]
    rows = rows.float()
    if kv_scale is not None:
        rows = rows * float(kv_scale)
    return rows


def mla_reference(q: "torch.Tensor", kv_cache: "torch.Tensor", block_table: "torch.Tensor",
                  seq_lens: "torch.Tensor", *, sm_scale: float, kv_lora_rank: int = 512,
                  kv_scale=None, topk_indices: "torch.Tensor | None" = None
                  ) -> tuple["torch.Tensor", "torch.Tensor"]:
    """Absorbed MLA decode attention in float32.

    Args:
        q: `[batch, q_len, heads, D]` or `[batch, heads, D]` (q_len 1), any float dtype.
        kv_cache: `[num_pages, page_size, D]`; the first `kv_lora_rank` columns are V.
        block_table: int `[batch, max_pages]`.
        seq_lens: int `[batch]`, the new query tokens included.
        sm_scale: softmax scale applied to q.k.
        kv_lora_rank: width of the latent (V) part.
        kv_scale: per-tensor dequantisation scale (real = stored x scale), a
            float or 0-d tensor; None for an unquantised cache.
        topk_indices: int `[batch, q_len, topk]` token positions, -1 unused (sparse).

    Returns:
        `(out, lse)`: float32 `[..., heads, kv_lora_rank]` and `[..., heads]`
        (natural log), with q's leading shape. Rows without a visible key give
        out 0 and lse -inf.
    """
    import torch

    squeeze = q.dim() == 3
    if squeeze:
        q = q.unsqueeze(1)
    if q.dim() != 4:
        raise ValueError(f"q must be [batch, q_len, heads, D] or [batch, heads, D], got {tuple(q.shape)}")
    batch, q_len, heads, _ = q.shape
    if isinstance(kv_scale, torch.Tensor):
        kv_scale = float(kv_scale)
    out = torch.zeros(batch, q_len, heads, kv_lora_rank, dtype=torch.float32, device=q.device)
    lse = torch.full((batch, q_len, heads), -math.inf, dtype=torch.float32, device=q.device)
    lengths = [int(n) for n in seq_lens.tolist()]
    positions = torch.arange(q_len, device=q.device)
    for b, length in enumerate(lengths):
        if length <= 0:
            continue
        kv = _request_kv(kv_cache, block_table[b], length, kv_scale)        # [L, D]
        visible = length - q_len + 1 + positions                             # [q_len]
        qb = q[b].float()                                                    # [q_len, H, D]
        if topk_indices is None:
            keys = kv.unsqueeze(0).expand(q_len, -1, -1)                     # [q_len, L, D]
            key_pos = torch.arange(length, device=q.device).unsqueeze(0).expand(q_len, -1)
            valid = key_pos < visible.unsqueeze(1)
        else:
            idx = topk_indices[b].long()                                     # [q_len, K]
            valid = (idx >= 0) & (idx < visible.unsqueeze(1))
            keys = kv[idx.clamp(0, length - 1)]                              # [q_len, K, D]
        logits = torch.einsum("qhd,qkd->qhk", qb, keys) * sm_scale
        logits = logits.masked_fill(~valid.unsqueeze(1), -math.inf)
        row_lse = torch.logsumexp(logits, dim=-1)                            # [q_len, H]
        seen = torch.isfinite(row_lse)
        probs = torch.exp(logits - torch.where(seen, row_lse, 0.0).unsqueeze(-1))
        probs = torch.where(seen.unsqueeze(-1), probs, 0.0)
        out[b] = torch.einsum("qhk,qkd->qhd", probs, keys[..., :kv_lora_rank])
        lse[b] = row_lse
    if squeeze:
        return out.squeeze(1), lse.squeeze(1)
    return out, lse


class _PreparedReference:
    def __init__(self, problem: Problem):
        self.kv_lora_rank = problem.geometry.kv_lora_rank

    def run(self, inputs: DecodeInputs):
        out, lse = mla_reference(inputs.q, inputs.kv_cache, inputs.block_table, inputs.seq_lens,
                                 sm_scale=inputs.sm_scale, kv_lora_rank=self.kv_lora_rank,
                                 kv_scale=inputs.kv_scale, topk_indices=inputs.topk_indices)
        return out.to(inputs.q.dtype), lse


class TorchReference:
    """TORCH_REFERENCE as an adapter (out in q's dtype). It allocates and syncs in
    `run`, so it is neither CUDA-graph capturable nor ever timed as a candidate."""

    name: ClassVar[str] = "TORCH_REFERENCE"

    def prepare(self, problem: Problem, inputs: DecodeInputs) -> _PreparedReference:
        check_inputs(problem, inputs)
        return _PreparedReference(problem)
