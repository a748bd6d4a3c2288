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


def reads_ds_mla(problem: Problem) -> bool:
    """Whether the kernel reads vLLM's fp8_ds_mla rows for `problem` (what vLLM hands it for that cache dtype)."""
    return problem.kv_cache_dtype == "fp8_ds_mla"


def ds_mla_copies(problem: Problem, backend: str):
    """Where a launch reading fp8_ds_mla rows keeps each input set's packed copy (`DsMlaCopies`); None for the
    caches our kernel reads as they are."""
    if not reads_ds_mla(problem):
        return None
    from mla_tune.backends.vllm_kernels.flashmla import DsMlaCopies

    return DsMlaCopies(backend)


def unit_lengths(problem: Problem, seq_lens: list[int]) -> list[int]:
    """What the splits are chosen from: the requests' lengths (dense) or top-k per request (sparse)."""
    return [problem.topk] * len(seq_lens) if problem.sparse else list(seq_lens)


def launch_facts(problem: Problem, *, lengths: list[int], cc_major: int | None, fp8_query: bool = False) -> dict:
    """What the dispatch chooses a tile from (`dispatch.default_tile`, `candidate_tiles`), for `unit_lengths`
    (`fp8_query`: MLA_TUNE_TRITON_FP8Q's tile)."""
    return dict(num_heads=problem.num_heads, q_len=problem.q_len, batch=len(lengths), max_items=max(max(lengths), 1),
                sparse=problem.sparse, kv_fp8=problem.kv_cache_dtype in ("fp8_e4m3", "fp8_ds_mla"),
                ds_mla=reads_ds_mla(problem), cc_major=cc_major, fp8_query=fp8_query)


def candidate_launches(problem: Problem, *, lengths: list[int], num_sms: int, cc_major: int | None,
                       fp8_query: bool = False) -> list[tuple[Tile, LaunchParams]]:
    """What the tuner times to refine the launch per device: `candidate_tiles` (the default first), each with its
    parameters for `unit_lengths`, without tiles that come to the same parameters. The pre-build lists its builds
    from the same function, before any inputs exist."""
    facts = launch_facts(problem, lengths=lengths, cc_major=cc_major, fp8_query=fp8_query)
    seen, out = set(), []
    for tile in candidate_tiles(**facts):
        params = params_for(tile, **facts, num_sms=num_sms, lengths=lengths)
        if params not in seen:
            seen.add(params)
            out.append((tile, params))
    return out


class PreparedTritonMLA:
    """Outputs, split workspace and launch order (from the inputs' lengths) made once; `run` only enqueues the
    kernels.

    For an fp8_ds_mla problem `adopt` packs each input set's e4m3 cache into vLLM's 656-byte rows (untimed, as
    FLASHMLA_SPARSE's adapter does) and `run` reads those.
    """

    def __init__(self, problem: Problem, inputs: DecodeInputs, params: LaunchParams):
        q = inputs.q
        batch, q_len, num_heads, _ = q.shape
        self.params = params
        self.out = torch.empty(batch, q_len, num_heads, D_LATENT, dtype=q.dtype, device=q.device)
        self.lse = torch.empty(batch, q_len, num_heads, dtype=torch.float32, device=q.device)
        self.workspace = Workspace.for_launch(params, batch=batch, q_len=q_len, num_heads=num_heads,
                                              sparse=problem.sparse, device=q.device,
                                              seq_lens=inputs.seq_lens)
        self.copies = ds_mla_copies(problem, "MLA_TUNE_TRITON_SPARSE")

    def adopt(self, inputs: DecodeInputs) -> None:
        """Pack this input set's FP8 cache into fp8_ds_mla rows (untimed); other caches are read as they are."""
        if self.copies is not None:
            self.copies.adopt(inputs)

    def run(self, inputs: DecodeInputs, *, combine_variants: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        kv_cache, kv_scale = inputs.kv_cache, inputs.kv_scale
        if self.copies is not None:
            kv_cache, kv_scale = self.copies.rows(inputs), None
        launch(inputs.q, kv_cache, inputs.block_table, inputs.seq_lens, self.out, self.lse,
               sm_scale=inputs.sm_scale, kv_scale=kv_scale, topk_indices=inputs.topk_indices, params=self.params,
               workspace=self.workspace, combine_variants=combine_variants)
        return self.out, self.lse

    def prebuild(self, inputs: DecodeInputs) -> None:
        """`run` once, also compiling the combine launch the tuner's real batch may take instead of this one's."""
        self.run(inputs, combine_variants=True)


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
    fp8_query: ClassVar[bool] = False

    def __init__(self, params: LaunchParams | None = None, tile: Tile | None = None):
        self.params = params
        self.tile = tile

    @staticmethod
    def _lengths(problem: Problem, inputs: DecodeInputs) -> list[int]:
        """`unit_lengths` of the inputs (a host sync, untimed)."""
        return unit_lengths(problem, [int(n) for n in inputs.seq_lens.tolist()])

    def choose_params(self, problem: Problem, inputs: DecodeInputs) -> LaunchParams:
        """The launch parameters `prepare` will use."""
        if self.params is not None:
            return self.params
        device, lengths = inputs.q.device, self._lengths(problem, inputs)
        return params_for(self.tile, **launch_facts(problem, lengths=lengths, cc_major=cc_major(device),
                                                    fp8_query=self.fp8_query),
                          num_sms=sm_count(device), lengths=lengths)

    def tile_candidates(self, problem: Problem, inputs: DecodeInputs) -> list[tuple[Tile, LaunchParams]]:
        """`candidate_launches` for these inputs on their GPU."""
        device = inputs.q.device
        return candidate_launches(problem, lengths=self._lengths(problem, inputs), num_sms=sm_count(device),
                                  cc_major=cc_major(device), fp8_query=self.fp8_query)

    def vllm_launch(self, *, max_seq_len: int | None):
        """The launch our vLLM backend makes of this kernel (`mla_tune.vllm_backends.tuned_launch`), an adapter the
        tuner times beside the candidate tiles; `max_seq_len` is vLLM's (dense)."""
        from mla_tune.vllm_backends.tuned_launch import VllmLaunch

        return VllmLaunch(sparse=self.sparse, max_seq_len=max_seq_len)

    def prepare(self, problem: Problem, inputs: DecodeInputs) -> PreparedTritonMLA:
        check_inputs(problem, inputs)
        if problem.sparse != self.sparse:
            kind = "sparse" if problem.sparse else "dense"
            raise ValueError(f"{self.name} does not run {kind} problems (topk={problem.topk})")
        prepared = PreparedTritonMLA(problem, inputs, self.choose_params(problem, inputs))
        prepared.adopt(inputs)
        prepared.run(inputs)  # JIT-compile here, outside any timed region
        return prepared


class TritonMLASparse(TritonMLA):
    """The same kernel gathering each query token's top-k positions (-1 slots skipped); for fp8_ds_mla problems
    on vLLM's 656-byte rows."""

    name: ClassVar[str] = "MLA_TUNE_TRITON_SPARSE"
    sparse: ClassVar[bool] = True


class TritonMLAFp8Query(TritonMLA):
    """The narrow Hopper form on FP8 tensor cores (`LaunchParams.fp8_query`): an e4m3 cache, the query and p rounded
    to e4m3, as FlashMLA does on an FP8 cache. Dense, SM90; a backend of its own, so an operator can leave it out."""

    name: ClassVar[str] = "MLA_TUNE_TRITON_FP8Q"
    fp8_query: ClassVar[bool] = True
    vllm_launch = None  # no vLLM backend runs it
