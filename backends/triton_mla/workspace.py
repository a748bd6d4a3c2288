"""The split workspace and launch order, allocated once per prepared launch (never per call).

Bound: the partials need `batch x num_splits x rows x 512` float32 values plus `batch x num_splits x rows` LSEs,
`rows = q_len x heads`. The split model keeps `batch x num_splits <= batch + 4 x SMs` (`splits.py`), so the
partials never exceed `(batch + 4 x SMs) x rows x 2052` bytes (about 139 MB at 128 heads, q_len 2, 132 SMs and
batch 1). With one split the kernel writes `out`/`lse` directly and needs no partials. With `split_scores` every
program also owns `2 x block_h x (block_n + 2)` 2-byte scratch elements (16.5 KiB for a 64 x 64 tile; about 22 MB
at 128 heads and batch 128). A `longest_first` launch also keeps its order (`splits.launch_order`,
4 bytes a program). A launch of the wide FP8-query form also keeps its query rounded to e4m3 (`query_e4m3.py`:
580 bytes a query row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_tune.backends.triton_mla import dispatch
from mla_tune.backends.triton_mla.config import D_LATENT, D_ROPE, LaunchParams
from mla_tune.backends.triton_mla.splits import launch_order, m_blocks_of
from mla_tune.backends.triton_mla.tl_kernel import scratch_per_program


@dataclass
class Workspace:
    """Split partials: `o_part` fp32 `[batch, splits, q_len, heads, 512]`, `lse_part` fp32 `[..., heads]`
    (None with one split); `p_scratch`: the split_scores exchange slots (None without it); `order`: int32, the
    (request, split) each program runs (`splits.launch_order`, from the prepared lengths: a run on longer requests
    would miss splits; None: the grid's own); `q8` / `q_amax`: the rounded query of a launch of a form in
    `dispatch.rounds_query_before` (`query_e4m3.round_query`), `[batch, q_len, heads, 576]` e4m3 and
    `[batch, q_len, heads]` fp32."""

    o_part: torch.Tensor | None
    lse_part: torch.Tensor | None
    p_scratch: torch.Tensor | None = None
    order: torch.Tensor | None = None
    q8: torch.Tensor | None = None
    q_amax: torch.Tensor | None = None

    @classmethod
    def for_launch(cls, params: LaunchParams, *, batch: int, q_len: int, num_heads: int, sparse: bool,
                   device: torch.device, seq_lens: torch.Tensor | None = None) -> Workspace | None:
        """What a launch with `params` needs, allocated now (None if nothing); `seq_lens`: the requests' lengths,
        which a `longest_first` launch is ordered by (read on the host for such a launch only)."""
        o_part = lse_part = p_scratch = order = q8 = q_amax = None
        if params.num_splits > 1:
            shape = (batch, params.num_splits, q_len, num_heads)
            o_part = torch.empty(*shape, D_LATENT, dtype=torch.float32, device=device)
            lse_part = torch.empty(*shape, dtype=torch.float32, device=device)
        if params.split_scores:
            programs = m_blocks_of(params, num_heads=num_heads, q_len=q_len, sparse=sparse) * batch * params.num_splits
            p_scratch = torch.empty(programs * scratch_per_program(params.block_h, params.block_n),
                                    dtype=torch.int16, device=device)
        if params.longest_first:
            if seq_lens is None or sparse:
                raise ValueError("a longest_first launch is ordered by its requests' lengths: dense, with lengths")
            lengths = [int(n) for n in seq_lens.tolist()]
            order = torch.tensor(launch_order(lengths, split_items=params.split_items), dtype=torch.int32,
                                 device=device)
        if dispatch.rounds_query_before(params):
            q8 = torch.empty(batch, q_len, num_heads, D_LATENT + D_ROPE, dtype=torch.float8_e4m3fn, device=device)
            q_amax = torch.empty(batch, q_len, num_heads, dtype=torch.float32, device=device)
        if o_part is None and p_scratch is None and order is None and q8 is None:
            return None
        return cls(o_part, lse_part, p_scratch, order, q8, q_amax)
