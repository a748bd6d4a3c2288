"""The backend interface: prepare once (untimed), then run many times (timed).

Every runnable backend is an adapter class with a `name` and a `prepare`
method. `prepare(problem, inputs)` does every allocation, `plan()` and JIT
compilation and returns a `Prepared`; `Prepared.run(inputs)` launches one
decode step and nothing else: no allocation, no host synchronisation, so it
can be captured in a CUDA graph. `run` may be given any `DecodeInputs` with
the same metadata (block table, lengths, top-k indices) as the one given to
`prepare`: the timing harness rotates copies of q and the KV cache through it
to keep L2 cold. An adapter that reads the cache in another layout (vLLM's
fp8_ds_mla) also has `adopt(inputs)`: it converts one such copy, untimed, and
`run` then reads the converted copy; `adopt_rotation` calls it on every copy
before a graph is captured.

Tensor layout (vLLM's):
    q:            `[batch, q_len, heads, kv_lora_rank + rope]`, bf16/fp16 (absorbed)
    kv_cache:     `[num_pages, page_size, kv_lora_rank + rope]`, q's dtype or float8_e4m3fn
    block_table:  int32 `[batch, max_pages]`
    seq_lens:     int32 `[batch]` (tokens in the cache, the new query tokens included)
    topk_indices: int32 `[batch, q_len, topk]` token positions, -1 for unused (sparse only)
    out:          `[batch, q_len, heads, kv_lora_rank]` in q's dtype
    lse:          fp32 `[batch, q_len, heads]`, natural log
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

from mla_tune.backends.problem import Problem

if TYPE_CHECKING:
    import torch


@dataclass
class DecodeInputs:
    """One decode step's tensors (see the module docstring for layouts)."""

    q: "torch.Tensor"
    kv_cache: "torch.Tensor"
    block_table: "torch.Tensor"
    seq_lens: "torch.Tensor"
    sm_scale: float
    kv_scale: float | None = None          # real value = stored fp8 value x kv_scale
    topk_indices: "torch.Tensor | None" = None

    def with_data(self, q: "torch.Tensor", kv_cache: "torch.Tensor") -> "DecodeInputs":
        """A copy sharing the metadata but reading other q / KV tensors (L2 rotation)."""
        return DecodeInputs(q, kv_cache, self.block_table, self.seq_lens, self.sm_scale,
                            self.kv_scale, self.topk_indices)


class Prepared(Protocol):
    """A backend ready to run one problem; `run` is the only thing that is timed."""

    def run(self, inputs: DecodeInputs) -> tuple["torch.Tensor", "torch.Tensor"]:
        """Launch one decode step; returns (out, lse), lse None when the kernel gives none in fp32 natural log.

        out and lse are views of preallocated buffers, except where an engine's op allocates its own result and
        takes no buffer (vLLM's FlashMLA lse and FP8 dense output): inside a CUDA graph that memory comes from
        the graph's pool.
        """


def adopt_rotation(prepared, sets) -> None:
    """Let `prepared` convert every rotated input set it will run on (untimed); a no-op for adapters that
    read our layout directly (they have no `adopt`)."""
    adopt = getattr(prepared, "adopt", None)
    if adopt is not None:
        for inputs in sets:
            adopt(inputs)


class Adapter(Protocol):
    name: ClassVar[str]

    def prepare(self, problem: Problem, inputs: DecodeInputs) -> Prepared:
        """Allocate, plan and compile for `problem` on `inputs`; raise with a clear message if it cannot."""


class BackendUnavailable(RuntimeError):
    """A library rejected the problem at prepare time; the message is stored as a reason."""


def check_inputs(problem: Problem, inputs: DecodeInputs) -> None:
    """Raise ValueError naming the tensor when shapes or dtypes do not match `problem`.

    FlashInfer does not check the page-size dimension and silently returns wrong
    numbers on a collapsed cache, so every adapter calls this before any launch.
    """
    import torch

    geo = problem.geometry
    q, kv = inputs.q, inputs.kv_cache
    want_q = {"bf16": torch.bfloat16, "fp16": torch.float16}[problem.query_dtype]
    if q.dim() != 4 or q.shape[1] != problem.q_len or q.shape[2] != problem.num_heads \
            or q.shape[3] != geo.head_size:
        raise ValueError(f"q has shape {tuple(q.shape)}; expected [batch, {problem.q_len}, "
                         f"{problem.num_heads}, {geo.head_size}]")
    if q.dtype != want_q:
        raise ValueError(f"q has dtype {q.dtype}; expected {want_q}")
    if kv.dim() != 3 or kv.shape[1] != problem.page_size or kv.shape[2] != geo.head_size:
        raise ValueError(f"kv_cache has shape {tuple(kv.shape)}; expected [num_pages, "
                         f"{problem.page_size}, {geo.head_size}]")
    # fp8_ds_mla problems get the same per-tensor e4m3 cache; its readers convert it untimed (`adopt`)
    want_kv = torch.float8_e4m3fn if problem.kv_cache_dtype in ("fp8_e4m3", "fp8_ds_mla") else want_q
    if kv.dtype != want_kv:
        raise ValueError(f"kv_cache has dtype {kv.dtype}; expected {want_kv}")
    if want_kv == torch.float8_e4m3fn and inputs.kv_scale is None:
        raise ValueError("kv_scale is required with a float8_e4m3fn kv_cache")
    batch = q.shape[0]
    bt, lens = inputs.block_table, inputs.seq_lens
    if bt.dtype != torch.int32 or bt.dim() != 2 or bt.shape[0] != batch:
        raise ValueError(f"block_table must be int32 [batch={batch}, max_pages], got "
                         f"{bt.dtype} {tuple(bt.shape)}")
    if lens.dtype != torch.int32 or tuple(lens.shape) != (batch,):
        raise ValueError(f"seq_lens must be int32 [batch={batch}], got {lens.dtype} {tuple(lens.shape)}")
    if problem.sparse:
        idx = inputs.topk_indices
        if idx is None:
            raise ValueError("topk_indices is required for a sparse problem")
        if idx.dtype != torch.int32 or tuple(idx.shape) != (batch, problem.q_len, problem.topk):
            raise ValueError(f"topk_indices must be int32 [{batch}, {problem.q_len}, {problem.topk}], "
                             f"got {idx.dtype} {tuple(idx.shape)}")
    for name in ("q", "kv_cache", "block_table", "seq_lens"):
        if getattr(inputs, name).device != q.device:
            raise ValueError(f"{name} is on {getattr(inputs, name).device}, q on {q.device}")

