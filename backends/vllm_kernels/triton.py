"""TRITON_MLA: vLLM's own Triton MLA decode kernel, called as vLLM 0.33.0's TritonMLAImpl.forward_mqa calls it.

`decode_attention_fwd(q, kv_cache[:, :, None], kv_cache[:, :, None, :512], o, lse, block_table, seq_lens,
attn_logits, num_kv_splits, sm_scale, page_size, k_scale=k_scale, v_scale=k_scale, is_mla=True)` with
o and lse zeroed per call (vLLM allocates them with torch.zeros in forward_mqa; `run` zeroes the
preallocated ones), a float32 split-KV workspace `[rows, heads, splits, 513]`, and
`num_kv_splits` from vLLM's `_compute_num_kv_splits(max_seq_len, sm_count)`. With q_len > 1 vLLM
flattens the tokens into rows and repeats each request's block table, shortening the causal lengths;
that metadata is built in `prepare`.

vLLM's kernel writes lse in q's dtype (bf16), so `run` returns no lse: the output alone is checked.

On a machine where vLLM's `vllm.triton_utils` cannot read vLLM's version (its unpacked wheel without
dist-info), vLLM replaces Triton with placeholders and this kernel is not a kernel; `prepare` then says
so (bench/vllm_site.py writes the metadata that makes vLLM see Triton).
"""

from __future__ import annotations

from typing import ClassVar

from mla_tune.backends.interface import BackendUnavailable, DecodeInputs
from mla_tune.backends.problem import Problem
from mla_tune.backends.vllm_kernels import check_problem, load

# vLLM's triton_mla.py: _MIN_WORK_PER_SPLIT and _SPLIT_OCCUPANCY_MULTIPLIER (tests check they agree).
MIN_WORK_PER_SPLIT = 512
SPLIT_OCCUPANCY_MULTIPLIER = 2


def num_kv_splits(max_seq_len: int, sm_count: int) -> int:
    """vLLM's split count: its own `_compute_num_kv_splits` where its backend module imports, else the same rule.

    The backend module needs vLLM's whole dependency set (pydantic, transformers, ...); on a machine
    that only carries vLLM's kernel files it does not import, and the rule is applied here.
    """
    try:
        from vllm.v1.attention.backends.mla.triton_mla import _compute_num_kv_splits

        return int(_compute_num_kv_splits(max_seq_len, sm_count))
    except Exception:  # noqa: BLE001 - not importable, or vLLM's Triton placeholder: the same rule here
        ideal = 1 << max(0, (max(1, max_seq_len // MIN_WORK_PER_SPLIT) - 1).bit_length())
        return min(ideal, sm_count * SPLIT_OCCUPANCY_MULTIPLIER)


def load_triton_kernel():
    """vLLM's Triton decode module, refusing when vLLM has replaced Triton with placeholders."""
    module = load("vllm.v1.attention.ops.triton_decode_attention")
    utils = load("vllm.triton_utils")
    if not getattr(utils, "HAS_TRITON", False):
        raise BackendUnavailable(
            "vLLM's Triton MLA decode kernel is a placeholder here: vllm.triton_utils.HAS_TRITON is False "
            "(vLLM disables Triton when it cannot read its own version from the vllm dist-info, or when "
            "Triton sees no single active GPU driver)")
    return module


def causal_rows(block_table, seq_lens, q_len: int):
    """Per-row block table and lengths for q_len tokens per request (vLLM's repeat_interleave rule)."""
    import torch

    if q_len == 1:
        return block_table, seq_lens
    offsets = torch.arange(1 - q_len, 1, device=seq_lens.device, dtype=seq_lens.dtype)
    rows = (seq_lens.unsqueeze(1) + offsets).flatten().clamp(min=0)
    return block_table.repeat_interleave(q_len, dim=0).contiguous(), rows.contiguous()


class _Prepared:
    def __init__(self, problem: Problem, inputs: DecodeInputs, kernel, *, sm_count: int):
        import torch

        self.kernel = kernel
        q = inputs.q
        batch, q_len, heads, _ = q.shape
        rank = problem.geometry.kv_lora_rank
        self.rows = batch * q_len
        self.block_table, self.seq_lens = causal_rows(inputs.block_table, inputs.seq_lens, q_len)
        self.splits = num_kv_splits(int(inputs.seq_lens.max()), sm_count)
        self.o = torch.zeros(self.rows, heads, rank, dtype=q.dtype, device=q.device)
        self.lse = torch.zeros(self.rows, heads, dtype=q.dtype, device=q.device)
        self.attn_logits = torch.empty(self.rows, heads, self.splits, rank + 1, dtype=torch.float32,
                                       device=q.device)
        scale = 1.0 if inputs.kv_scale is None else float(inputs.kv_scale)
        self.k_scale = torch.tensor(scale, dtype=torch.float32, device=q.device)   # vLLM's layer._k_scale
        self.sm_scale, self.page_size, self.rank = inputs.sm_scale, problem.page_size, rank
        self.shape = (batch, q_len, heads)

    def run(self, inputs: DecodeInputs):
        self.o.zero_()                                # vLLM: torch.zeros for o and lse on every call
        self.lse.zero_()
        kv = inputs.kv_cache.unsqueeze(2)             # [pages, page_size, 1, 576]
        self.kernel.decode_attention_fwd(
            inputs.q.view(self.rows, *inputs.q.shape[2:]), kv, kv[..., :self.rank], self.o, self.lse,
            self.block_table, self.seq_lens, self.attn_logits, self.splits, self.sm_scale, self.page_size,
            k_scale=self.k_scale, v_scale=self.k_scale, is_mla=True)
        return self.o.view(*self.shape, self.rank), None


class VllmTritonMLA:
    """TRITON_MLA: vLLM's Triton split-KV MLA decode kernel."""

    name: ClassVar[str] = "TRITON_MLA"

    def prepare(self, problem: Problem, inputs: DecodeInputs) -> _Prepared:
        import torch

        check_problem(self.name, problem, inputs, sparse=False)
        kernel = load_triton_kernel()
        try:
            sm_count = torch.cuda.get_device_properties(inputs.q.device).multi_processor_count
            prepared = _Prepared(problem, inputs, kernel, sm_count=sm_count)
            prepared.run(inputs)                      # compiles
            torch.cuda.synchronize(inputs.q.device)
        except (RuntimeError, ValueError, TypeError, AssertionError) as exc:
            raise BackendUnavailable(f"vLLM's Triton MLA kernel rejected the problem: "
                                     f"{type(exc).__name__}: {exc}") from exc
        return prepared
