"""FlashInfer's Blackwell MLA decode paths (untested on hardware: no SM100/SM120 GPU here).

FLASHINFER_MLA: `flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla` with
`backend="trtllm-gen"` on SM100/103, the kernel vLLM's FLASHINFER_MLA calls.
FLASHINFER_MLA_SPARSE: the same function with `sparse_mla_top_k`, the block
table replaced by `[batch, q_len, topk]` global token slots (vLLM's
FlashInferMLASparse layout: slot = page * page_size + offset, -1 unused).

The arguments follow FlashInfer 0.7.2's checks (`_check_trtllm_gen_mla_shape`
and the trtllm-gen branch of `_trtllm_batch_decode_with_kv_cache_mla_impl`):
`out` must be bf16 (so the query must be bf16), page size 32 or 64, no head
count in 65..127, and with an FP8 cache the query is FP8 too (vLLM quantises
it; we copy it into an FP8 buffer inside `run`, query scale 1) with
bmm1_scale = kv_scale x sm_scale and bmm2_scale = kv_scale.

FLASHINFER_MLA_SPARSE_SM120 (`XqaSparseMLA`): FlashInfer 0.7.2's SM120/121
sparse path (`backend="sparse"`) reads only the packed 656-byte-per-token
fp8_ds_mla cache, which mla-tune's input generator does not produce, so the
adapter refuses every problem with that sentence.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from mla_tune.backends.flashinfer_mla import sparse_token_slots
from mla_tune.backends.interface import BackendUnavailable, DecodeInputs, check_inputs
from mla_tune.backends.problem import Problem

if TYPE_CHECKING:
    import torch

WORKSPACE_BYTES = 128 * 1024 * 1024
TRTLLM_PAGE_SIZES = (32, 64)


def padded_block_table(block_table: "torch.Tensor", *, page_size: int) -> "torch.Tensor":
    """The block table with columns padded (with page 0) to a multiple of 128 / page_size.

    FlashInfer's shape check asks for `block_num % (128 / block_size) == 0` on
    the cute-dsl path; padding makes every path accept the same table.
    """
    import torch

    multiple = max(1, 128 // page_size)
    width = block_table.shape[1]
    target = -(-width // multiple) * multiple
    if target == width:
        return block_table.contiguous()
    pad = torch.zeros(block_table.shape[0], target - width, dtype=block_table.dtype,
                      device=block_table.device)
    return torch.cat([block_table, pad], dim=1).contiguous()


def packed_sparse_slots(block_table: "torch.Tensor", seq_lens: "torch.Tensor",
                        topk_indices: "torch.Tensor", *, page_size: int) -> "torch.Tensor":
    """int32 `[batch, q_len, topk]` global token slots, valid ones first, then -1.

    Slots a query position may not see (beyond L - q_len + 1 + i) are dropped
    like -1 entries; the order among valid slots is kept.
    """
    import torch

    slots, valid = sparse_token_slots(block_table, seq_lens, topk_indices, page_size=page_size)
    order = torch.sort((~valid).to(torch.int8), dim=-1, stable=True).indices
    return torch.gather(slots, -1, order).to(torch.int32)


def bmm_scales(*, sm_scale: float, kv_scale: float | None) -> tuple[float, float]:
    """(bmm1_scale, bmm2_scale) for trtllm-gen with a query scale of 1."""
    scale = 1.0 if kv_scale is None else float(kv_scale)
    return sm_scale * scale, scale


def trtllm_arguments(problem: Problem, inputs: DecodeInputs, query: "torch.Tensor") -> dict:
    """Keyword arguments of `trtllm_batch_decode_with_kv_cache_mla`, minus the buffers.

    Args:
        problem: the decode problem.
        inputs: its tensors (block table, lengths and top-k are read on the host).
        query: `[batch, q_len, heads, D]` in the dtype the kernel reads (FP8 with an FP8 cache).

    Returns:
        A dict with query, kv_cache, qk_nope_head_dim, kv_lora_rank,
        qk_rope_head_dim, block_tables, seq_lens, max_seq_len, sparse_mla_top_k,
        bmm1_scale, bmm2_scale, backend, return_lse_base.
    """
    geo = problem.geometry
    device = inputs.q.device
    if problem.sparse:
        tables = packed_sparse_slots(inputs.block_table, inputs.seq_lens, inputs.topk_indices,
                                     page_size=problem.page_size).to(device)
    else:
        tables = padded_block_table(inputs.block_table, page_size=problem.page_size)
    bmm1, bmm2 = bmm_scales(sm_scale=inputs.sm_scale, kv_scale=inputs.kv_scale)
    return dict(query=query, kv_cache=inputs.kv_cache, qk_nope_head_dim=geo.qk_nope_head_dim,
                kv_lora_rank=geo.kv_lora_rank, qk_rope_head_dim=geo.qk_rope_head_dim,
                block_tables=tables, seq_lens=inputs.seq_lens,
                max_seq_len=int(inputs.seq_lens.max()),
                sparse_mla_top_k=problem.topk or 0, bmm1_scale=bmm1, bmm2_scale=bmm2,
                backend="trtllm-gen", return_lse_base="basee")


def trtllm_refusal(problem: Problem, compute_capability: tuple[int, int] | None) -> str | None:
    """Why trtllm-gen cannot run `problem` (FlashInfer 0.7.2's own checks), or None."""
    if compute_capability is not None and compute_capability[0] != 10:
        return (f"trtllm-gen MLA needs compute capability 10.x (SM100/103), got "
                f"{compute_capability[0]}.{compute_capability[1]}")
    if problem.query_dtype != "bf16":
        return f"trtllm-gen MLA writes a bf16 output and needs a bf16 query, got {problem.query_dtype}"
    if problem.page_size not in TRTLLM_PAGE_SIZES:
        return f"trtllm-gen MLA needs page_size 32 or 64, got {problem.page_size}"
    if 64 < problem.num_heads < 128:
        return f"trtllm-gen MLA cannot run num_heads {problem.num_heads} (64 < heads < 128)"
    return None


class _PreparedTrtllm:
    def __init__(self, problem: Problem, kwargs: dict, workspace, out, lse, q_buffer):
        self.problem = problem
        self.kwargs = kwargs
        self.workspace, self.out, self._lse, self.q_buffer = workspace, out, lse, q_buffer
        self.lse = lse.view(out.shape[:-1])

    def run(self, inputs: DecodeInputs):
        from flashinfer.decode import trtllm_batch_decode_with_kv_cache_mla

        query = inputs.q
        if self.q_buffer is not None:
            self.q_buffer.copy_(inputs.q)          # bf16 -> e4m3, query scale 1
            query = self.q_buffer
        trtllm_batch_decode_with_kv_cache_mla(
            **{**self.kwargs, "query": query, "kv_cache": inputs.kv_cache},
            workspace_buffer=self.workspace, out=self.out, lse=self._lse, return_lse=True)
        return self.out, self.lse


class TrtllmGenMLA:
    """FLASHINFER_MLA (dense) through trtllm-gen."""

    name: ClassVar[str] = "FLASHINFER_MLA"
    sparse: ClassVar[bool] = False

    def prepare(self, problem: Problem, inputs: DecodeInputs) -> _PreparedTrtllm:
        import torch

        check_inputs(problem, inputs)
        if problem.sparse != self.sparse:
            raise BackendUnavailable(f"{self.name} does not run "
                                     f"{'sparse' if problem.sparse else 'dense'} problems")
        q = inputs.q
        cc = torch.cuda.get_device_capability(q.device) if q.is_cuda else None
        reason = trtllm_refusal(problem, cc) if q.is_cuda else \
            f"{self.name} needs CUDA tensors on an SM100/103 GPU, got q on {q.device}"
        if reason:
            raise BackendUnavailable(reason)
        try:
            q_buffer = None
            if inputs.kv_cache.dtype == torch.float8_e4m3fn:
                q_buffer = torch.empty(q.shape, dtype=torch.float8_e4m3fn, device=q.device)
            kwargs = trtllm_arguments(problem, inputs, q if q_buffer is None else q_buffer)
            workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
            out = torch.empty(*q.shape[:-1], problem.geometry.kv_lora_rank,
                              dtype=torch.bfloat16, device=q.device)
            lse = torch.empty(q.shape[0] * q.shape[1], q.shape[2], dtype=torch.float32,
                              device=q.device)
            prepared = _PreparedTrtllm(problem, kwargs, workspace, out, lse, q_buffer)
            prepared.run(inputs)
            torch.cuda.synchronize(q.device)
        except (ImportError, RuntimeError, ValueError, TypeError, NotImplementedError) as exc:
            raise BackendUnavailable(f"FlashInfer trtllm-gen rejected the problem: "
                                     f"{type(exc).__name__}: {exc}") from exc
        return prepared


class TrtllmGenSparseMLA(TrtllmGenMLA):
    """FLASHINFER_MLA_SPARSE: trtllm-gen with `sparse_mla_top_k` and token-slot tables."""

    name: ClassVar[str] = "FLASHINFER_MLA_SPARSE"
    sparse: ClassVar[bool] = True


XQA_SPARSE_REFUSAL = (
    "FlashInfer 0.7.2's SM120 sparse MLA path (trtllm_batch_decode_with_kv_cache_mla with "
    "backend='sparse') reads only the packed fp8_ds_mla cache (656 bytes per token, uint8), "
    "which mla-tune's input generator does not produce; got kv_cache_dtype {kv}")


class XqaSparseMLA:
    """FLASHINFER_MLA_SPARSE_SM120: refused with a reason (see the module docstring)."""

    name: ClassVar[str] = "FLASHINFER_MLA_SPARSE_SM120"

    def prepare(self, problem: Problem, inputs: DecodeInputs):
        raise BackendUnavailable(XQA_SPARSE_REFUSAL.format(kv=problem.kv_cache_dtype))
