"""The launch our vLLM backends make, behind the tuner's adapter interface (`backends/interface.py`).

vLLM hands our kernel to `launch.dense_forward` / `launch.sparse_forward` with its own metadata: a block table
as wide as its max_seq_len allows and no host copy of the lengths (dense: the split count is fixed by the table's
width, each request's split size is set on the device), or (sparse) global cache rows read through an identity
page table. That launch is not the one the tuner refines (the fastest candidate tile, sized from the host
lengths), so the tuner times it as a step of its own: `prepare` builds vLLM's layouts from the tuner's inputs
(untimed) and `run` calls the same function `forward_mqa` calls, nothing re-implemented.
"""

from __future__ import annotations

import torch

from mla_tune.backends.interface import BackendUnavailable, DecodeInputs, check_inputs
from mla_tune.backends.problem import Problem
from mla_tune.backends.triton_mla.adapter import ds_mla_copies
from mla_tune.vllm_backends.capabilities import DENSE, SPARSE, refusal_reasons, vllm_dtype
from mla_tune.vllm_backends.launch import IdentityPages, dense_forward, sparse_forward

def vllm_block_table(block_table: torch.Tensor, *, page_size: int, max_seq_len: int) -> torch.Tensor:
    """`block_table` padded with page 0 to vLLM's width for `max_seq_len` (never narrower than it is)."""
    pages = -(-int(max_seq_len) // page_size)
    if pages <= block_table.shape[1]:
        return block_table
    wide = block_table.new_zeros(block_table.shape[0], pages)
    wide[:, :block_table.shape[1]] = block_table
    return wide


def global_rows(topk_indices: torch.Tensor, block_table: torch.Tensor, *, page_size: int) -> torch.Tensor:
    """int32 `[batch x q_len, topk]` global cache rows (`block x page_size + offset`) of token positions
    `[batch, q_len, topk]`, -1 kept: what vLLM's `triton_convert_req_index_to_global_index` gives our backend."""
    batch, q_len, topk = topk_indices.shape
    pos = topk_indices.clamp(min=0).long().view(batch, q_len * topk)
    blocks = block_table.long().gather(1, pos // page_size)
    rows = (blocks * page_size + pos % page_size).view(batch, q_len, topk)
    return torch.where(topk_indices < 0, -1, rows).to(torch.int32).view(batch * q_len, topk).contiguous()


class PreparedVllmLaunch:
    """vLLM's layouts of one input set, built once; `run` is `forward_mqa`'s launch and nothing else."""

    def __init__(self, problem: Problem, inputs: DecodeInputs, *, max_seq_len: int | None):
        self.problem, self.max_seq_len = problem, max_seq_len
        self.copies = ds_mla_copies(problem, "MLA_TUNE_TRITON_SPARSE@vllm")
        dev = inputs.q.device
        # vLLM's layer._k_scale for an e4m3 cache; fp8_ds_mla rows carry their own scales
        self.k_scale = (torch.tensor([inputs.kv_scale], dtype=torch.float32, device=dev)
                        if inputs.kv_scale is not None and self.copies is None else None)
        if problem.sparse:
            self.rows = global_rows(inputs.topk_indices, inputs.block_table, page_size=problem.page_size)
            self.identity = IdentityPages(self.rows.shape[0])
        else:
            self.table = vllm_block_table(inputs.block_table, page_size=problem.page_size, max_seq_len=max_seq_len)

    def adopt(self, inputs: DecodeInputs) -> None:
        """Pack this input set's e4m3 cache into vLLM's fp8_ds_mla rows (untimed); other caches are read as they are."""
        if self.copies is not None:
            self.copies.adopt(inputs)

    def run(self, inputs: DecodeInputs) -> tuple[torch.Tensor, torch.Tensor]:
        batch, q_len, num_heads, width = inputs.q.shape
        q = inputs.q.view(batch * q_len, num_heads, width)   # vLLM's tokens, request-major
        kv_cache = inputs.kv_cache if self.copies is None else self.copies.rows(inputs)
        rank = self.problem.geometry.kv_lora_rank
        if self.problem.sparse:
            out, lse = sparse_forward(q, kv_cache, self.rows, block_size=self.problem.page_size,
                                      scale=inputs.sm_scale, identity=self.identity, kv_lora_rank=rank,
                                      k_scale=self.k_scale)
        else:
            out, lse = dense_forward(q, kv_cache, self.table, inputs.seq_lens, max_seq_len=self.max_seq_len,
                                     scale=inputs.sm_scale, kv_lora_rank=rank, k_scale=self.k_scale)
        return out.view(batch, q_len, num_heads, -1), lse.view(batch, q_len, num_heads)


class VllmLaunch:
    """Our kernel as our vLLM backend (MLA_TUNE_TRITON or MLA_TUNE_TRITON_SPARSE) launches it.

    Args:
        sparse: the sparse backend (`sparse_forward`) or the dense one (`dense_forward`).
        max_seq_len: vLLM's `attn_metadata.max_seq_len` (dense; the sparse launch does not take it).
    """

    def __init__(self, *, sparse: bool, max_seq_len: int | None):
        self.caps = SPARSE if sparse else DENSE
        self.max_seq_len = None if sparse else max_seq_len

    def prepare(self, problem: Problem, inputs: DecodeInputs) -> PreparedVllmLaunch:
        check_inputs(problem, inputs)
        rank, rope = problem.geometry.kv_lora_rank, problem.geometry.qk_rope_head_dim
        refused = refusal_reasons(self.caps, sparse=problem.sparse, head_size=rank + rope, kv_lora_rank=rank,
                                  model_dtype=vllm_dtype(problem.query_dtype), num_heads=problem.num_heads,
                                  kv_cache_dtype=vllm_dtype(problem.kv_cache_dtype),
                                  block_size=problem.page_size,
                                  capability=torch.cuda.get_device_capability(inputs.q.device)
                                  if inputs.q.is_cuda else None)
        if refused:
            raise BackendUnavailable("; ".join(refused))
        if not problem.sparse and self.max_seq_len is None:
            raise ValueError("the dense vLLM launch needs vLLM's max_seq_len")
        prepared = PreparedVllmLaunch(problem, inputs, max_seq_len=self.max_seq_len)
        prepared.adopt(inputs)
        prepared.run(inputs)  # JIT-compile here, outside any timed region
        return prepared
