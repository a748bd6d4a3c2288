"""FLASH_ATTN_MLA and FLASH_ATTN_MLA_SPARSE: vLLM's FlashAttention 3 build, called as vLLM 0.33.0's
FlashAttnMLAImpl and FlashAttnMLASparseImpl do.

Dense: `flash_attn_varlen_func(q=q_pe, k=k_pe_cache[..., None, :], v=kv_c_cache[..., None, :], q_v=q_nope,
cu_seqlens_q, seqused_k, block_table, causal=True, fa_version=3, scheduler_metadata, num_splits)`, the
scheduler from `get_scheduler_metadata` (built in `prepare`, as vLLM's metadata builder does per step)
and `num_splits` = 32, vLLM's `flash_attn_max_num_splits_for_cuda_graph` default under full CUDA graphs.
Sparse: the cache rows as pages of one token, the top-k global rows (valid first) as the block table and
their count as `seqused_k`, one query row per token.
"""

from __future__ import annotations

from typing import ClassVar

from mla_tune.backends.interface import BackendUnavailable, DecodeInputs
from mla_tune.backends.problem import Problem
from mla_tune.backends.vllm_kernels import check_problem, global_slots, load

# vLLM's AttentionConfig.flash_attn_max_num_splits_for_cuda_graph (tests/backends/test_vllm_real.py checks it).
MAX_NUM_SPLITS_FOR_CUDA_GRAPH = 32


def load_fa3():
    """vLLM's FA3 interface module; BackendUnavailable names what did not load."""
    load("vllm.vllm_flash_attn._vllm_fa3_C")
    return load("vllm.vllm_flash_attn.flash_attn_interface")


def split_query(q, kv_lora_rank: int):
    """(q_nope, q_pe) views of `[tokens, heads, 576]`, as vLLM's `torch.split(q, [512, 64], dim=-1)`."""
    return q[..., :kv_lora_rank], q[..., kv_lora_rank:]


def dense_arguments(problem: Problem, inputs: DecodeInputs, *, cu_seqlens_q, scheduler_metadata) -> dict:
    """Keyword arguments of `flash_attn_varlen_func` for one dense decode step, minus q and the cache."""
    return dict(max_seqlen_q=problem.q_len, cu_seqlens_q=cu_seqlens_q,
                max_seqlen_k=int(inputs.seq_lens.max()), seqused_k=inputs.seq_lens,
                block_table=inputs.block_table, softmax_scale=inputs.sm_scale, causal=True,
                return_softmax_lse=False, fa_version=3, scheduler_metadata=scheduler_metadata,
                num_splits=MAX_NUM_SPLITS_FOR_CUDA_GRAPH)


class _Prepared:
    def __init__(self, problem: Problem, inputs: DecodeInputs, fa, kwargs: dict, *, sparse: bool):
        import torch

        self.problem, self.fa, self.kwargs, self.sparse = problem, fa, kwargs, sparse
        self.rank = problem.geometry.kv_lora_rank
        batch, q_len, heads, _ = inputs.q.shape
        # vLLM lets FA3 allocate the output; a preallocated `out=` runs the same kernel.
        self.out = torch.empty(batch * q_len, heads, self.rank, dtype=inputs.q.dtype, device=inputs.q.device)

    def run(self, inputs: DecodeInputs):
        batch, q_len, heads, width = inputs.q.shape
        q_nope, q_pe = split_query(inputs.q.view(batch * q_len, heads, width), self.rank)
        kv = inputs.kv_cache
        if self.sparse:
            kv = kv.view(-1, 1, width)                # cache rows as pages of one token
        out = self.fa.flash_attn_varlen_func(
            q=q_pe, k=kv[..., self.rank:].unsqueeze(-2), v=kv[..., :self.rank].unsqueeze(-2), q_v=q_nope,
            out=self.out, **self.kwargs)
        return out.unflatten(0, (batch, q_len)), None   # vLLM asks FA3 for no lse outside DCP


class FlashAttnMLA:
    """FLASH_ATTN_MLA: FA3 with q_v over the paged cache."""

    name: ClassVar[str] = "FLASH_ATTN_MLA"
    sparse: ClassVar[bool] = False

    def _kwargs(self, problem: Problem, inputs: DecodeInputs, fa) -> dict:
        import torch

        batch, geo = inputs.q.shape[0], problem.geometry
        cu = torch.arange(0, (batch + 1) * problem.q_len, problem.q_len, dtype=torch.int32, device=inputs.q.device)
        meta = fa.get_scheduler_metadata(
            batch_size=batch, max_seqlen_q=problem.q_len, max_seqlen_k=int(inputs.seq_lens.max()),
            num_heads_q=problem.num_heads, num_heads_kv=1, headdim=geo.qk_rope_head_dim,
            cache_seqlens=inputs.seq_lens, qkv_dtype=inputs.kv_cache.dtype, headdim_v=geo.kv_lora_rank,
            page_size=problem.page_size, cu_seqlens_q=cu, causal=True, num_splits=MAX_NUM_SPLITS_FOR_CUDA_GRAPH)
        return dense_arguments(problem, inputs, cu_seqlens_q=cu, scheduler_metadata=meta)

    def prepare(self, problem: Problem, inputs: DecodeInputs) -> _Prepared:
        import torch

        check_problem(self.name, problem, inputs, sparse=self.sparse)
        fa = load_fa3()
        try:
            prepared = _Prepared(problem, inputs, fa, self._kwargs(problem, inputs, fa), sparse=self.sparse)
            prepared.run(inputs)
            torch.cuda.synchronize(inputs.q.device)
        except (RuntimeError, ValueError, TypeError, AssertionError) as exc:
            raise BackendUnavailable(f"vLLM's FlashAttention 3 rejected the problem: "
                                     f"{type(exc).__name__}: {exc}") from exc
        return prepared


class FlashAttnMLASparse(FlashAttnMLA):
    """FLASH_ATTN_MLA_SPARSE: FA3 with q_v, the top-k global rows as a page-size-1 block table."""

    name: ClassVar[str] = "FLASH_ATTN_MLA_SPARSE"
    sparse: ClassVar[bool] = True

    def _kwargs(self, problem: Problem, inputs: DecodeInputs, fa) -> dict:
        import torch

        slots, counts = global_slots(problem, inputs)
        tokens = slots.shape[0] * slots.shape[1]
        # vLLM's cu_seqlens_q_buffer: one query row per token.
        cu = torch.arange(tokens + 1, dtype=torch.int32, device=inputs.q.device)
        return dict(max_seqlen_q=1, cu_seqlens_q=cu, max_seqlen_k=problem.topk,
                    seqused_k=counts.view(tokens).contiguous(), block_table=slots.view(tokens, -1),
                    softmax_scale=inputs.sm_scale, causal=True, fa_version=3)
