"""CUTLASS_MLA (Blackwell; untested on hardware): vLLM's `ops.sm100_cutlass_mla_decode`, called as vLLM 0.33.0's
CutlassMLAImpl._sm100_cutlass_mla_decode calls it.

`sm100_cutlass_mla_decode(out [batch, 128, 512], lse, q_nope, q_pe, kv_cache, seq_lens, page_table,
workspace, sm_scale, num_kv_splits=-1)`: heads padded to 128 in the output, page size 128, the block
table's width a multiple of 128 / page_size, q, q_pe and the cache of one dtype, and no q or KV scale
(vLLM raises NotImplementedError for a scale other than 1, so an FP8 cache with kv_scale != 1 is refused).
The workspace is sized by `ops.sm100_cutlass_mla_get_workspace_size`. Both ops are `torch.ops._C.*`
(what `vllm._custom_ops` calls), registered by `vllm._C_stable_libtorch`.
"""

from __future__ import annotations

from typing import ClassVar

from mla_tune.backends.interface import BackendUnavailable, DecodeInputs
from mla_tune.backends.problem import Problem
from mla_tune.backends.vllm_kernels import check_problem, load

MAX_HEADS = 128
PAGE_SIZE = 128
NUM_KV_SPLITS = -1        # vLLM's default: the op picks the split count
WORKSPACE_BYTES = 128 * 1024 * 1024


def cutlass_refusal(problem: Problem, kv_scale: float | None) -> str | None:
    """Why vLLM's CUTLASS MLA cannot run `problem` (its own asserts and NotImplementedError), or None."""
    if problem.page_size != PAGE_SIZE:
        return f"vLLM's CUTLASS MLA forces page size {PAGE_SIZE}, got {problem.page_size}"
    if problem.num_heads > MAX_HEADS:
        return f"vLLM's CUTLASS MLA runs at most {MAX_HEADS} heads, got {problem.num_heads}"
    if problem.q_len != 1:
        return f"vLLM's CUTLASS MLA takes one query token per request (3-D q), got q_len {problem.q_len}"
    if kv_scale is not None and float(kv_scale) != 1.0:
        return (f"vLLM's CUTLASS MLA raises NotImplementedError for a KV scale other than 1, got "
                f"kv_scale {float(kv_scale):.6g}")
    return None


def cutlass_arguments(problem: Problem, inputs: DecodeInputs, *, workspace) -> dict:
    """Everything but `out`/`lse` that `sm100_cutlass_mla_decode` takes, in vLLM's order and layout."""
    rank = problem.geometry.kv_lora_rank
    q = inputs.q[:, 0]                       # [batch, heads, 576]
    return dict(q_nope=q[..., :rank], q_pe=q[..., rank:], kv_c_and_k_pe_cache=inputs.kv_cache,
                seq_lens=inputs.seq_lens, page_table=inputs.block_table, workspace=workspace,
                sm_scale=inputs.sm_scale, num_kv_splits=NUM_KV_SPLITS)


class _Prepared:
    def __init__(self, ops, kwargs: dict, out, lse, heads: int):
        self.ops, self.kwargs, self.out, self.lse, self.heads = ops, kwargs, out, lse, heads

    def run(self, inputs: DecodeInputs):
        k = self.kwargs
        q = inputs.q[:, 0]
        rank = self.out.shape[-1]
        self.ops.sm100_cutlass_mla_decode(self.out, self.lse, q[..., :rank], q[..., rank:], inputs.kv_cache,
                                          k["seq_lens"], k["page_table"], k["workspace"], k["sm_scale"],
                                          k["num_kv_splits"])
        return self.out[:, :self.heads].unsqueeze(1), None


class CutlassMLA:
    """CUTLASS_MLA: vLLM's SM100 CUTLASS MLA decode op."""

    name: ClassVar[str] = "CUTLASS_MLA"

    def prepare(self, problem: Problem, inputs: DecodeInputs) -> _Prepared:
        import torch

        check_problem(self.name, problem, inputs, sparse=False)
        reason = cutlass_refusal(problem, inputs.kv_scale)
        if reason:
            raise BackendUnavailable(reason)
        load("vllm._C_stable_libtorch")
        ops = torch.ops._C
        batch, dev = inputs.q.shape[0], inputs.q.device
        try:
            sm_count = torch.cuda.get_device_properties(dev).multi_processor_count
            # vLLM's SM100Workspace: 128 MiB, grown to get_workspace_size(max_query_len x 128, batch, SMs, -1).
            size = ops.sm100_cutlass_mla_get_workspace_size(problem.q_len * PAGE_SIZE, batch, sm_count,
                                                            NUM_KV_SPLITS)
            workspace = torch.empty(max(int(size), WORKSPACE_BYTES), dtype=torch.uint8, device=dev)
            out_dtype = torch.bfloat16 if inputs.kv_cache.dtype == torch.float8_e4m3fn else inputs.q.dtype
            out = torch.empty(batch, MAX_HEADS, problem.geometry.kv_lora_rank, dtype=out_dtype, device=dev)
            lse = torch.Tensor()                     # vLLM passes an empty lse outside DCP
            prepared = _Prepared(ops, cutlass_arguments(problem, inputs, workspace=workspace), out, lse,
                                 problem.num_heads)
            prepared.run(inputs)
            torch.cuda.synchronize(dev)
        except (RuntimeError, ValueError, TypeError, AssertionError) as exc:
            raise BackendUnavailable(f"vLLM's CUTLASS MLA rejected the problem: {type(exc).__name__}: {exc}") from exc
        return prepared
