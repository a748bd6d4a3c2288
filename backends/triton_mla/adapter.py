"""MLA_TUNE_TRITON and MLA_TUNE_TRITON_SPARSE, mla-tune's own kernels, behind the backend interface
(`backends/interface.py`)."""

from __future__ import annotations

from typing import ClassVar

import torch

from mla_tune.backends.interface import DecodeInputs, check_inputs
from mla_tune.backends.problem import Problem
from mla_tune.backends.triton_mla.config import D_LATENT, PARAM_SPACE, LaunchParams, Tile, cc_major, sm_count
from mla_tune.backends.triton_mla.dispatch import candidate_tiles
from mla_tune.backends.triton_mla.launcher import launch
from mla_tune.backends.triton_mla.splits import params_for
from mla_tune.backends.triton_mla.workspace import Workspace


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
        params: launch parameters; None derives them from `tile` (or `dispatch.default_tile`),
            with the splits chosen for the inputs' lengths and the GPU's multiprocessor count.
        tile: a `Tile` (e.g. one the tuner stored for this device), ignored when `params` is given.
    """

    name: ClassVar[str] = "MLA_TUNE_TRITON"
    param_space: ClassVar[dict] = PARAM_SPACE
    sparse: ClassVar[bool] = False

    def __init__(self, params: LaunchParams | None = None, tile: Tile | None = None):
        self.params = params
        self.tile = tile

    def _shape(self, problem: Problem, inputs: DecodeInputs) -> tuple[dict, dict]:
        """(what a tile is chosen from, what its splits are chosen from), from the inputs' lengths (a host sync,
        untimed) and the GPU."""
        batch, device = inputs.q.shape[0], inputs.q.device
        lengths = [problem.topk] * batch if self.sparse else [int(n) for n in inputs.seq_lens.tolist()]
        facts = dict(num_heads=problem.num_heads, q_len=problem.q_len, batch=batch, max_items=max(max(lengths), 1),
                     sparse=self.sparse, kv_fp8=problem.kv_cache_dtype == "fp8_e4m3", cc_major=cc_major(device))
        return facts, dict(num_sms=sm_count(device), lengths=lengths)

    def choose_params(self, problem: Problem, inputs: DecodeInputs) -> LaunchParams:
        """The launch parameters `prepare` will use."""
        if self.params is not None:
            return self.params
        facts, splits = self._shape(problem, inputs)
        return params_for(self.tile, **facts, **splits)

    def tile_candidates(self, problem: Problem, inputs: DecodeInputs) -> list[tuple[Tile, LaunchParams]]:
        """What the tuner times to refine the launch per device: `candidate_tiles` (the default first), each with
        its parameters for these inputs, without tiles that come to the same parameters."""
        facts, splits = self._shape(problem, inputs)
        seen, out = set(), []
        for tile in candidate_tiles(**facts):
            params = params_for(tile, **facts, **splits)
            if params not in seen:
                seen.add(params)
                out.append((tile, params))
        return out

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

    name: ClassVar[str] = "MLA_TUNE_TRITON_SPARSE"
    sparse: ClassVar[bool] = True
