"""FLASHINFER_MLA_SPARSE_SM90: FlashInfer's SM90 MLA wrapper as vLLM 0.33.0's FlashInferMLASparseSM90Impl drives it.

vLLM builds `BatchMLAPagedAttentionWrapper(workspace, qo_indptr, kv_indptr, kv_indices, kv_len_arr,
use_cuda_graph=True, backend="fa3")`, plans it per step with one query row per token, page size 1
(the top-k global slots are the page list), causal False, a bf16 query and the cache's dtype, and
per layer calls `wrapper.run(q_nope, q_pe, ckv, kpe[, ckv_scale=, kpe_scale=])` on the cache rows.
The plan (and vLLM's per-step index packing) happens in `prepare`.

vLLM passes `kpe_scale=1.0` with an FP8 cache, which is exact only for its default KV scale of 1;
our FP8 cache scales RoPE too, so `run` passes kv_scale for both (the kernel and its cost are the same).
"""

from __future__ import annotations

from typing import ClassVar

from mla_tune.backends.interface import BackendUnavailable, DecodeInputs
from mla_tune.backends.problem import Problem
from mla_tune.backends.vllm_kernels import check_problem, global_slots, load

WORKSPACE_BYTES = 128 * 1024 * 1024


def plan_arrays(problem: Problem, inputs: DecodeInputs):
    """(qo_indptr, kv_indptr, kv_indices, kv_len_arr) on the host: one query row per token, its valid slots."""
    import torch

    slots, counts = global_slots(problem, inputs)
    slots, counts = slots.cpu(), counts.cpu().flatten()
    if int(counts.min()) == 0:
        raise BackendUnavailable("a query token has no valid top-k slot; FlashInfer cannot attend to an empty set")
    tokens = counts.numel()
    kv_indptr = torch.zeros(tokens + 1, dtype=torch.int32)
    torch.cumsum(counts, 0, out=kv_indptr[1:])
    valid = slots.view(tokens, -1) >= 0
    return (torch.arange(tokens + 1, dtype=torch.int32), kv_indptr,
            slots.view(tokens, -1)[valid].to(torch.int32), counts.to(torch.int32))


class _Prepared:
    def __init__(self, problem: Problem, inputs: DecodeInputs, wrapper, scales: dict):
        import torch

        self.wrapper, self.scales = wrapper, scales
        self.rank = problem.geometry.kv_lora_rank
        batch, q_len, heads, _ = inputs.q.shape
        # vLLM lets run() allocate the output; a preallocated `out=` runs the same kernel.
        self.out = torch.empty(batch * q_len, heads, self.rank, dtype=inputs.q.dtype, device=inputs.q.device)

    def run(self, inputs: DecodeInputs):
        batch, q_len, heads, width = inputs.q.shape
        q = inputs.q.view(batch * q_len, heads, width)
        flat = inputs.kv_cache.reshape(-1, 1, width)
        out = self.wrapper.run(q[..., :self.rank], q[..., self.rank:], flat[..., :self.rank],
                               flat[..., self.rank:], out=self.out, **self.scales)
        return out.unflatten(0, (batch, q_len)), None   # vLLM asks for no lse


class FlashInferSparseSM90:
    """FLASHINFER_MLA_SPARSE_SM90 (Hopper): FlashInfer fa3 MLA over the top-k slots."""

    name: ClassVar[str] = "FLASHINFER_MLA_SPARSE_SM90"

    def prepare(self, problem: Problem, inputs: DecodeInputs) -> _Prepared:
        import torch

        check_problem(self.name, problem, inputs, sparse=True)
        if problem.query_dtype != "bf16":
            raise BackendUnavailable(f"{self.name} plans a bf16 query, got {problem.query_dtype}")
        mla = load("flashinfer.mla")
        qo, kv_indptr, kv_indices, kv_lens = plan_arrays(problem, inputs)
        dev = inputs.q.device
        geo = problem.geometry
        try:
            workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
            wrapper = mla.BatchMLAPagedAttentionWrapper(
                workspace, qo_indptr=torch.empty_like(qo, device=dev),
                kv_indptr=torch.empty_like(kv_indptr, device=dev),
                kv_indices=torch.empty_like(kv_indices, device=dev),
                kv_len_arr=torch.empty_like(kv_lens, device=dev), use_cuda_graph=True, backend="fa3")
            wrapper.plan(qo, kv_indptr, kv_indices, kv_lens, problem.num_heads, geo.kv_lora_rank,
                         geo.qk_rope_head_dim, 1, False, inputs.sm_scale,
                         q_data_type=torch.bfloat16, kv_data_type=inputs.kv_cache.dtype)
            scales = {} if inputs.kv_scale is None else {"ckv_scale": float(inputs.kv_scale),
                                                         "kpe_scale": float(inputs.kv_scale)}
            prepared = _Prepared(problem, inputs, wrapper, scales)
            prepared.run(inputs)
            torch.cuda.synchronize(dev)
        except (RuntimeError, ValueError, TypeError, NotImplementedError, OSError) as exc:
            raise BackendUnavailable(f"FlashInfer's SM90 MLA wrapper rejected the problem: "
                                     f"{type(exc).__name__}: {exc}") from exc
        return prepared
