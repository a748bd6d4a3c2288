"""TRITON_MLA and TRITON_MLA_SPARSE behind the backend interface (`backends/interface.py`)."""

from __future__ import annotations

from typing import ClassVar

import torch

from mla_tune.backends.interface import DecodeInputs, check_inputs
from mla_tune.backends.problem import Problem
from mla_tune.backends.triton_mla.launch import (
    D_LATENT, PARAM_SPACE, LaunchParams, Workspace, cc_major, default_params, launch, sm_count)


class PreparedTritonMLA:
    """Outputs and split workspace allocated once; `run` only enqueues the kernels."""

    def __init__(self, problem: Problem, inputs: DecodeInputs, params: LaunchParams):
        q = inputs.q
        batch, q_len, num_heads, _ = q.shape
        self.params = params
        self.out = torch.empty(batch, q_len, num_heads, D_LATENT, dtype=q.dtype, device=q.device)
        self.lse = torch.empty(batch, q_len, num_heads, dtype=torch.float32, device=q.device)
        self.workspace = Workspace.for_launch(params, batch=batch, q_len=q_len, num_heads=num_heads,
                                              sparse=problem.sparse, device=q.device)

    def run(self, inputs: DecodeInputs) -> tuple[torch.Tensor, torch.Tensor]:
        launch(inputs.q, inputs.kv_cache, inputs.block_table, inputs.seq_lens, self.out, self.lse,
               sm_scale=inputs.sm_scale, kv_scale=inputs.kv_scale,
               topk_indices=inputs.topk_indices, params=self.params, workspace=self.workspace)
        return self.out, self.lse


class TritonMLA:
    """mla-tune's Triton absorbed-MLA decode (dense paged KV; FP8 dequantised on load).

    Args:
        params: launch parameters; None picks `default_params` for the problem,
            the longest sequence of the inputs and the GPU's multiprocessor count.
    """

    name: ClassVar[str] = "TRITON_MLA"
    param_space: ClassVar[dict] = PARAM_SPACE
    sparse: ClassVar[bool] = False

    def __init__(self, params: LaunchParams | None = None):
        self.params = params

    def choose_params(self, problem: Problem, inputs: DecodeInputs) -> LaunchParams:
        """The launch parameters `prepare` will use (reads the lengths: a host sync, untimed)."""
        if self.params is not None:
            return self.params
        batch = inputs.q.shape[0]
        lengths = [problem.topk] * batch if self.sparse else [int(n) for n in inputs.seq_lens.tolist()]
        return default_params(num_heads=problem.num_heads, q_len=problem.q_len, batch=batch,
                              max_items=max(max(lengths), 1), num_sms=sm_count(inputs.q.device),
                              sparse=self.sparse, kv_fp8=problem.kv_cache_dtype == "fp8_e4m3",
                              lengths=lengths, cc_major=cc_major(inputs.q.device))

    def prepare(self, problem: Problem, inputs: DecodeInputs) -> PreparedTritonMLA:
        check_inputs(problem, inputs)
        if problem.sparse != self.sparse:
            kind = "sparse" if problem.sparse else "dense"
            raise ValueError(f"{self.name} does not run {kind} problems (topk={problem.topk})")
        prepared = PreparedTritonMLA(problem, inputs, self.choose_params(problem, inputs))
        prepared.run(inputs)  # JIT-compile here, outside any timed region
        return prepared


class TritonMLASparse(TritonMLA):
    """The same kernel gathering each query token's top-k positions (-1 slots skipped)."""

    name: ClassVar[str] = "TRITON_MLA_SPARSE"
    sparse: ClassVar[bool] = True
