"""Launch parameters, the default heuristic, workspace sizing and the launcher.

The tunable space is small and declared as data (`PARAM_SPACE`); the tuner
may try any point of it per device, and `default_params` picks one from the
problem and the GPU's multiprocessor count alone.

Workspace bound (allocated once by `Workspace.for_launch`, never per call): the
split partials need `batch x num_splits x rows x 512` float32 values plus
`batch x num_splits x rows` LSEs, where `rows = q_len x heads`. The heuristic
keeps `num_splits <= max(1, floor(waves x SMs / (batch x m_blocks)))` with
`waves <= 4` (and `balanced_splits` caps the count the same way), so
`batch x num_splits <= batch + 4 x SMs` and the partials never
exceed `(batch + 4 x SMs) x rows x 2052` bytes (about 139 MB at 128 heads,
q_len 2, 132 SMs and batch 1; twice the fp32 output size plus that at large batches).
With one split the kernel writes `out`/`lse` directly and needs no partials.
With `split_scores` every program also owns `2 x block_h x (block_n + 2)` 2-byte
scratch elements (16.5 KiB for a 64 x 64 tile; programs = `m_blocks x batch x
num_splits`, so at most `(batch + 4 x SMs) x m_blocks x 16.5 KiB`, about 22 MB
at 128 heads and batch 128).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton

from mla_tune.backends.triton_mla.kernel import (
    LOG2E, Q_FP16_SCALE, _mla_combine_kernel, _mla_split_kernel, scratch_per_program)

# The Hopper kernel (`hopper.py`): (block_h, block_n, num_warps, num_stages) = 64 rows, 64-token slots, 8 MMA
# warps, 2 slots; plus a 4-warp loader. Launched at `maxnreg` 168 registers (12 warps x 32 x 168 fits the
# SM's 64 Ki registers); `setmaxnreg` then gives the loader LOAD_REGS and the MMA warps the rest (208/200).
HOPPER_SHAPE = (64, 64, 8, 2)
# Its narrow form for 16 or 32 rows: one MMA warpgroup with the products transposed (tokens on wgmma's M);
# FP8: one or two loader warpgroups with a cp.async staging ring (8 or 12 warps, `staged_loaders`), 16-bit: two
# loader warpgroups, one per slot (12 warps).
HOPPER_SHAPES = {64: HOPPER_SHAPE, 32: (32, 64, 4, 2), 16: (16, 64, 4, 2)}
# Its 4-warp launch (named after its first division, the k-split): 64 rows as two 4-warp MMA partitions, the first
# scoring the whole tile and handing p to the second (`hopper._mma_partition_qk1`), told apart from the wide form by
# its 4 launch warps (the first MMA warpgroup; the second and the loader are workers).
HOPPER_KSPLIT_SHAPE = (64, 64, 4, 2)
WARP_SPECIALIZED_SHAPES = (*HOPPER_SHAPES.values(), HOPPER_KSPLIT_SHAPE)  # every launch shape the kernel has
HOPPER_MAXNREG = 168
HOPPER_LOAD_REGS = {"16bit": 80, "fp8": 96, "fp8_ahead": 120}

D_LATENT = 512
D_ROPE = 64
MAX_SPLITS = 64

# The declared tuning space: every combination `LaunchParams` accepts is a valid launch on SM80+
# (split_scores needs split_d; opaque_v_cast needs reload_v and fp16_math, and FP8 KV needs SM89+),
# except warp_specialized, which runs the shapes of HOPPER_SHAPES only and on SM90 only.
PARAM_SPACE = {
    "block_h": (16, 32, 64),
    "block_n": (16, 32, 64),
    "num_warps": (4, 8),
    "num_stages": (1, 2, 3),
    "min_split_tokens": (64, 128, 256, 512, 1024),
    "per_sm": (1, 2, 3, 4),
    "reload_v": (False, True),
    "split_d": (False, True),
    "hoist_pages": (0, 64),
    "fp16_math": (False, True),
    "max_regs": (0, 128, 168),
    "split_scores": (False, True),
    "opaque_v_cast": (False, True),
    "warp_specialized": (False, True),
}


@dataclass(frozen=True)
class LaunchParams:
    """One point of `PARAM_SPACE` (plus the split count it implies for a shape).

    Attributes:
        block_h: query rows (q_len x heads, packed) per program; the MMA M dimension.
        block_n: KV tokens per tile.
        num_warps: warps per program.
        num_stages: software-pipelining depth of the KV loads.
        num_splits: programs along the KV axis of one request (flash-decoding).
        split_d: handle the 512 latent columns as four blocks of 128 (four accumulators;
            FP8 tiles are cast one block at a time, which lowers register pressure).
        reload_v: load the tile a second time for `p @ v` (an L1/L2 hit): with one consumer
            per load Triton pipelines both through shared memory, which it does not do for
            an FP8 tile cast for two different MMA operand layouts.
        split_items: KV tokens (dense) or top-k slots (sparse) per split, a multiple of
            block_n; `num_splits x split_items` must cover the longest request. 0 derives it
            from the block-table capacity (dense) or top-k (sparse) at launch.
        hoist_pages: 0, or how many lookups a program loads into registers at a time (a
            power of 2): dense, block-table entries; sparse, top-k slots with their
            block-table entries (a multiple of block_n). Then no KV address depends on a
            load inside the tile loop, and Triton can keep a tile in flight during the
            compute of the previous one (without it the tile loads are not overlapped).
        opaque_v_cast: FP8 with `fp16_math` and `reload_v`: the V reload is cast to fp16 by an
            inline-asm `cvt` Triton cannot reorder, so V reaches the MMA through `ldmatrix.trans`
            on the fp16 tile instead of byte loads of the FP8 tile (see `_load_kv`).
        warp_specialized: run the Hopper kernel of `hopper.py` (SM90 only): 64 rows, 8 MMA warps
            plus a loader warpgroup, a ring of two 64-token slots (`HOPPER_SHAPE`, all that fits
            beside the query in shared memory); an FP8 cache is cast by the loader. With block_h 16
            or 32 its narrow form (`HOPPER_SHAPES`): 4 MMA warps on transposed products; with block_h 64
            and 4 warps its k-split form (`HOPPER_KSPLIT_SHAPE`). The `tl`-only
            fields (split_d, reload_v, hoist_pages, fp16_math, max_regs, split_scores,
            opaque_v_cast) must stay at their defaults.
    """

    block_h: int = 64
    block_n: int = 32
    num_warps: int = 8
    num_stages: int = 2
    num_splits: int = 1
    split_d: bool = False
    split_items: int = 0
    reload_v: bool = False
    hoist_pages: int = 0
    fp16_math: bool = False
    max_regs: int = 0
    split_scores: bool = False
    opaque_v_cast: bool = False
    warp_specialized: bool = False

    def __post_init__(self):
        if self.split_scores and not self.split_d:
            raise ValueError("split_scores needs split_d")
        if self.opaque_v_cast and not (self.reload_v and self.fp16_math):
            raise ValueError("opaque_v_cast needs reload_v and fp16_math")
        if self.warp_specialized:
            tl_only = [name for name in ("split_d", "reload_v", "hoist_pages", "fp16_math", "max_regs",
                                         "split_scores", "opaque_v_cast") if getattr(self, name)]
            if tl_only:
                raise ValueError(f"warp_specialized does not take the tl kernel's {', '.join(tl_only)}")
            shape = (self.block_h, self.block_n, self.num_warps, self.num_stages)
            if shape not in WARP_SPECIALIZED_SHAPES:
                raise ValueError(f"warp_specialized runs (block_h, block_n, num_warps, num_stages) = "
                                 f"{' or '.join(map(str, WARP_SPECIALIZED_SHAPES))} only (227 KiB of shared memory), "
                                 f"got {shape}")

    def label(self) -> str:
        return (f"h{self.block_h}n{self.block_n}w{self.num_warps}"
                f"s{self.num_stages}{'d' if self.split_d else ''}{'r' if self.reload_v else ''}"
                f"{f'p{self.hoist_pages}' if self.hoist_pages else ''}{'f' if self.fp16_math else ''}"
                f"{f'R{self.max_regs}' if self.max_regs else ''}{'S' if self.split_scores else ''}"
                f"{'o' if self.opaque_v_cast else ''}{'W' if self.warp_specialized else ''}"
                f"x{self.num_splits}")


def sm_count(device: torch.device) -> int:
    """Multiprocessors of `device` (4 for CPU tensors under the Triton interpreter)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def cc_major(device: torch.device) -> int | None:
    """Compute-capability major of `device`; None for CPU tensors (the interpreter)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).major


def packed_rows(num_heads: int, q_len: int, *, sparse: bool) -> int:
    """Rows in one program's M dimension group: q_len x heads dense, heads sparse."""
    return num_heads if sparse else q_len * num_heads


def choose_splits(*, batch: int, m_blocks: int, max_items: int, num_sms: int,
                  min_split_tokens: int = 256, waves: int = 2) -> int:
    """Flash-decoding split count: about `waves` waves of programs, splits >= min_split_tokens."""
    programs = batch * m_blocks
    wanted = (waves * num_sms) // programs
    by_length = max(1, max_items // min_split_tokens)
    return int(max(1, min(wanted, by_length, MAX_SPLITS)))


def rows_bucket(rows: int) -> int:
    """Packed query rows rounded up to the tile table's buckets: 16, 32, 64 or 128."""
    return 16 if rows <= 16 else 32 if rows <= 32 else 64 if rows <= 64 else 128


class Tile(NamedTuple):
    """One row of `TILE_TABLE`: a `LaunchParams` without the per-shape split count."""

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    split_d: bool
    per_sm: int  # programs of this tile that fit on one SM (for the split model)
    reload_v: bool
    min_split_tokens: int
    hoist_pages: int = 0
    fp16_math: bool = False
    max_regs: int = 0
    split_scores: bool = False
    opaque_v_cast: bool = False
    warp_specialized: bool = False


# (KV kind, rows bucket) -> tile, a `Tile`'s fields in order: block_h, block_n, num_warps,
# num_stages, split_d, per_sm, reload_v, min_split_tokens[, hoist_pages, fp16_math, max_regs,
# split_scores, opaque_v_cast]. Chosen from measurements on one
# H100 with bench/triton_dev.py; bench/TRITON_NOTES.md has the numbers behind each entry.
TILE_TABLE = {
    ("16bit", 16): (16, 32, 4, 2, True, 3, False, 64),
    ("16bit", 32): (16, 32, 4, 3, True, 2, False, 128, 64),   # two 16-row blocks share the tile via L2
    ("16bit", 64): (64, 64, 8, 2, True, 1, False, 64),
    ("16bit", 128): (64, 64, 8, 2, True, 1, False, 64, 0, False, 0, True),
    ("fp8", 16): (16, 32, 4, 2, True, 2, True, 64, 64, True),
    # fp16 math + opaque V cast (round 7, call 26 A/B): 0.90, batch 128 kv 16k 1019 -> 882 us
    ("fp8", 32): (32, 32, 4, 2, True, 2, True, 32, 64, True, 0, False, True),
    ("fp8", 64): (64, 64, 8, 2, True, 1, False, 64, 0, True),
    ("fp8", 128): (64, 64, 8, 2, True, 1, False, 64, 0, True),
}

# The same for sparse (top-k) decode, where a program's rows are the heads of one query
# token and every tile gathers its rows through the top-k list and the block table.
SPARSE_TILE_TABLE = {
    ("16bit", 16): (16, 32, 4, 3, True, 2, False, 64, 64),
    ("16bit", 32): (32, 32, 4, 3, True, 2, False, 64, 64),
    ("16bit", 64): (64, 64, 8, 2, True, 1, False, 64),
    ("16bit", 128): (64, 64, 8, 2, True, 1, False, 64, 0, False, 0, True),
    ("fp8", 16): (16, 32, 4, 2, True, 2, True, 64, 0, True),
    # fp16 math + opaque V cast (round 7, call 26 A/B): 0.87, batch 128 200 -> 167 us
    ("fp8", 32): (32, 32, 4, 2, True, 2, True, 32, 0, True, 0, False, True),
    ("fp8", 64): (64, 64, 8, 2, True, 1, False, 64, 0, True),
    ("fp8", 128): (64, 64, 8, 2, True, 1, False, 64, 0, True),
}

# The warp-specialised Hopper kernel (`hopper.py`) for both KV kinds: HOPPER_SHAPE, one program per SM
# (per_sm 1 for the split model), splits of at least 128 tokens (256 and 512 changed nothing, call 41). FP8
# uses 64-token slots too (its loader casts from registers): with 32-token slots and a staging ring the
# query's shared-memory traffic per token doubles, and the kernel ran 1.28x slower (device call 39, A/B
# geomean 1.006 against 0.788 of the tl tile).
HOPPER_TILE = Tile(*HOPPER_SHAPE, False, 1, False, 128, warp_specialized=True)
# The same for each rows bucket the kernel has a form for (16 and 32: the narrow one).
HOPPER_TILES = {rows: HOPPER_TILE._replace(block_h=shape[0], num_warps=shape[2])
                for rows, shape in HOPPER_SHAPES.items()}
# The k-split wide form (`HOPPER_KSPLIT_SHAPE`) and, as in `HOPPER_MIN_BATCH`, the smallest (dense, sparse) batch from
# which it replaces the wide form, by (KV kind, rows bucket). Same-process A/Bs (time over the wide form's): dense 128
# heads, uniform lengths (bench/results/ks_ab-h100-call99.txt, ks_ab-h200-call98.txt; H100 / H200): BF16 0.95 /
# 0.93-0.94 at batch 4 kv 16k and batch 16 kv 4k, 0.91 / 0.91-0.93 at batch 64-128; FP8 0.90 / 0.88 at batch 64 kv 4k
# (one split of 64 tiles), 0.85 / 0.85 at batch 128 kv 16k (256 tiles), but 1.01-1.02 at batch 4-16 (splits of 16
# tiles: its 4-warp query load shows). Ragged lengths, where the splits are shorter (ks_ab_ragged-h100-call105.txt,
# H100): BF16 0.93 / 0.96 at batch 128 / 64, 0.99 at 16, 1.02 at 4; FP8 1.01-1.08 at every batch (5-6 splits at batch
# 64-128). So BF16 takes it from batch 16 and FP8 not by default: the tuner's refinement times both wide forms at
# dense 128 rows and keeps the k-split one where it measured faster. Not at 64 heads (BF16 0.99-1.01 on the H100, 0.95
# at batch 64-128 on the H200; FP8 1.02-1.03 / 1.00-1.04) nor sparse (1.01-1.12 slower: it spills there and loads the
# top-k positions in both warpgroups). 128 packed rows of 64 heads and two query tokens take it too (two row blocks);
# measured there (ks_q2-h100-call108.txt, ks_q2_ragged-h100-call108.txt, H100): BF16 0.91-0.94 at batch 64-128 uniform,
# 0.94-0.97 ragged, 0.97 / 1.01 at batch 16, 0.95 / 1.02 at 4; FP8 0.84-0.88 uniform at batch 64-128, 1.01-1.06 ragged.
# Since round 48 this launch runs FlashInfer's division of the MMA work (`hopper._mma_partition_qk1`), and the table
# is that division's: same process over the dispatched form (bench/results/qk-default-h100-call172.txt, H100, uniform
# lengths): FP8 dense 128 heads 0.87-0.94 from batch 4 (0.995 at 1), 64 heads 0.93-0.94 at batch 64-128 and
# 0.99-1.01 at 1-16; BF16 dense 128 heads 0.90-0.99 from batch 4 (1.03 at 1); sparse BF16 128 heads 0.86-0.88 at
# batch 64-128, 1.05 at 4; not sparse FP8 (1.04-1.08), nor BF16 64 heads (1.00, HBM-bound). Ragged lengths
# (qk-ragged-h100-call173.txt): BF16 dense 128 heads 0.87-0.98 from batch 4, sparse BF16 128 heads 0.85-0.87 at batch
# 64-128, FP8 dense 128 heads 1.03 at batch 4, 0.90-0.97 from 16, FP8 dense 64 heads 1.02 at batch 4-16, 0.95-1.00 at
# 64-128. So FP8 dense 128 heads from batch 16 and 64 heads from 64, BF16 as measured uniform. Sparse BF16 128 heads
# with the query loaded by warpgroup 0 (`QUERY_BEFORE_PARTITIONS`; qk1-query-h100-call178.txt): 0.98 / 0.96 / 0.89 /
# 0.87 of the wide form's time at batch 4 / 16 / 64 / 128, and at batch 1 0.983 on an H100 and 0.986 on an H200
# (sparse-small-splits-{h100-call183,h200-call181}.txt), so from batch 1. With round 52's lazy rescale (same process
# over the dispatched form, H100, qk1-lazy-dispatch-{uniform,ragged}-h100-call191.txt): FP8 dense 64 heads batch 1-16
# 0.972-0.979 uniform, 0.989-1.002 ragged, so from batch 1 there; FP8 128 heads batch 4 still 0.89 uniform but 1.015
# ragged, BF16 128 heads batch 1 1.02-1.03, BF16 64 heads 0.995-1.03 uniform (ragged 0.97-0.99 from batch 4, 1.05 at
# 1): unchanged. BF16 64 heads again after rounds 52-56 (ks64-bf16-{h200-call223,h100-call224}.txt, same process, the
# 4-warp launch over the wide form): H200 sparse batch 1 / 4 / 16 / 64 / 128 0.94 / 0.94 / 0.98 / 0.81 / 0.90, dense
# 1.03 at batch 1, 0.97-0.98 at 4-16, 0.89 / 0.86 at batch 64 kv 4k / 128 kv 16k; H100 sparse 0.94 / 0.97 / 0.99 /
# 0.985 / 1.009, dense 0.99-1.03 (batch 2-8 at kv 2-6k 1.012 in geometric mean). So sparse from batch 1 and dense from
# 16: the H100 at 0.94-1.009 of the time, the H200 at 0.81-0.98 (grids: calls 225 and 227). Sparse FP8 stays on
# the wide form (4-warp launch 1.035-1.060x slower on an H200, ks-fp8-sparse-h200-call228.txt), but for batch 64 and
# up since it runs with the L2 prefetch of the wide form's FP8 loader (`L2_PREFETCH_FORMS`): same process over the
# wide form, 64 heads batch 64 / 128 0.979 / 0.980 and 128 heads 0.973 / 0.988 on an H100, 0.976 / 0.977 and 0.981 /
# 0.971 on an H200; at batch 1-4 1.01-1.04 and at 16 0.99-1.01 on both (dev-timing-ab-h100-call230.txt,
# ks-fp8-sparse-{small-h200-call231,h200-call232}.txt, waves-fp8-small-h100-call235.txt).
HOPPER_KSPLIT_TILE = Tile(*HOPPER_KSPLIT_SHAPE, False, 1, False, 128, warp_specialized=True)
HOPPER_KSPLIT_MIN_BATCH = {("16bit", 64): (16, 1), ("16bit", 128): (4, 1), ("fp8", 64): (1, 64),
                           ("fp8", 128): (16, 64)}
# Sparse requests on the 4-warp launch: (KV kind, rows bucket) -> (smallest batch, minimum split in tokens) replacing
# its 128. Sparse BF16 128 heads, top-k 2048, same process, splits of at least 256 over 128 (sparse128-ksm256-h100-
# call{206,207}.txt, H100): batch 4 0.946 / 0.944 of the time (8 splits instead of 16), batch 1 1.24 / 1.25 (so not
# there), batch 16 the same launch (4 splits); on an H200 0.967 at batch 4 (sparse-small-splits-h200-call181.txt). From
# batch 8 the split model picks splits of 256 tokens or more by itself. Elsewhere the same minimum split lost but at
# dense 64 heads batch 4 kv 4k (0.93-0.95; split256-small-h100-call211.txt), where the tuner's refinement can find it.
HOPPER_KSPLIT_SPARSE_MIN_SPLIT = {("16bit", 128): (4, 256)}
# (KV kind, rows bucket) -> (smallest dense batch, smallest sparse batch) from which an SM90 GPU runs the
# warp-specialised kernel's wide form (64 rows) instead of the tl tiles (None or no entry: never, unless the
# narrow form's table below takes the case). From same-process A/Bs on one H100
# (bench/results/hopper_ab_h100_call{37,38,39,40}.txt; time ratio against the tl tile): BF16 64/128 heads
# 0.60-0.98 at every batch; BF16 32 heads 1.26 at batch 1, 0.73-0.97 from batch 4 (but batch 4 kv 4k ran 1.08x
# the tl time in the official grid of call 40 against call 33, two processes, so dense from 16); FP8 64/128 heads
# 0.58-1.00 at every batch. (The wide form's measurements at 16/32 heads, where the narrow form runs now, are in
# bench/TRITON_NOTES.md, rounds 14-17.)
HOPPER_MIN_BATCH = {
    ("16bit", 32): (16, 4), ("16bit", 64): (1, 1), ("16bit", 128): (1, 1), ("fp8", 64): (1, 1), ("fp8", 128): (1, 1),
}
# The same for the narrow form (16/32 rows; it takes precedence where both apply). Same-process A/Bs on one
# H100 (time ratio against the wide kernel): FP8 16 heads 0.73-0.95 at every batch, dense and sparse (against
# the tl tile 0.63-0.93), FP8 32 heads dense 0.83-0.97 (bench/results/hopper_ab_narrow_h100_call59.txt); FP8 32
# heads sparse, with two loaders, 0.963 at batch 4, 0.881 at 16, 0.79-0.80 at 64-128 (batch 1 not measured;
# hopper_ab_sparse_narrow_h100_call69.txt). 16-bit (two plain loaders): dense 0.89-1.02 (call 58), not used, and
# dense BF16 16 heads keeps the tl tile (the wide form tied with it on the H100 and lost 6-13% on an H200, official
# grid of call 43 against call 36); sparse 16 heads 0.967 at batch 16 and 0.97-0.98 at 64 (call 69), 0.964 at 128
# (call 58; call 69 measured 0.76 there, with the wide kernel 1.26x slower than in call 58 and the grids), on an
# H200 0.86-0.97 at batch 16-128 (hopper_ab_sparse_narrow_h200_call73.txt), and at batch 4 1.04x the tl tile;
# sparse 32 heads 1.00-1.01 at batch 4-16 and 1.00 / 0.97 at batch 64 / 128 (call 69), on an H200 1.00-1.01 and
# 0.94 / 0.86 (call 73).
HOPPER_NARROW_MIN_BATCH = {("fp8", 16): (1, 1), ("fp8", 32): (1, 1), ("16bit", 16): (None, 16),
                           ("16bit", 32): (None, 64)}
# The narrow form's FP8 loaders, by sparse: one staged loader for both halves of every tile (dense), or two
# loader warpgroups, one half each (sparse: their top-k and block-table lookups and row gathers run side by
# side). Same-process A/B on one H100 (bench/results/hopper_ab_narrow2_h100_call66.txt, time with two loaders
# over time with one, 16 and 32 heads): sparse 0.86-0.98 (batch 4-128), dense 1.01-1.06 (batch 1-128; the
# loader alone took the same time either way, 423 against 424 us at batch 128 kv 16k).
HOPPER_STAGED_LOADERS = {False: 1, True: 2}


def staged_loaders(*, kv_fp8: bool, rows: int, sparse: bool) -> int:
    """The Hopper kernel's `STAGED_LOADERS`: in the narrow FP8 form `HOPPER_STAGED_LOADERS`, 1 otherwise (no other
    form reads it)."""
    if not kv_fp8 or rows >= HOPPER_SHAPE[0]:
        return 1
    return HOPPER_STAGED_LOADERS[sparse]


# Short requests at small batches stay on the tl tiles: a batch whose longest request is shorter than
# HOPPER_MIN_ITEMS tokens (or top-k slots) and that has fewer requests than HOPPER_SHORT_BATCH gives the
# warp-specialised kernel too few tiles per program for its set-up (the query load, the first tile's wait).
# Same-process A/Bs of the current kernels against the tl tiles at kv 1024 (batch 1-32) and 1536 (batch 16),
# dense (bench/results/hopper_ab_short_{h100,h200}_call{89,90}.txt, H100 / H200 time ratios): at batch 1-4 it
# loses or ties (up to 1.43x at bf16 64 heads batch 1; at best 0.95 / 0.97, FP8 16 heads batch 1) but for 128 heads
# at batch 4 (0.85-0.92, so from batch 4 there; batch 1 1.04-1.06); from batch 16 the form the
# tables choose wins for FP8 16 heads (narrow, 0.79-0.88), FP8 32 heads (narrow, 0.66-0.73), FP8 64 heads and bf16
# 64 heads (wide, 0.80-0.94) and 128 heads (wide, 0.71-0.83), not for bf16 32 heads (wide, 1.07 / 1.01 at batch 16,
# 1.00 / 0.90 at 32); bf16 16 heads dense stays on the tl tile anyway. So dense short requests take it from batch
# 16 where it won, and from HOPPER_SHORT_BATCH_DEFAULT otherwise (sparse too: top-k below 2048 was not measured;
# kv 1024 at batch 1-16 ran 1.04-1.45x slower in the official grids of calls 40/43, batch 64 did not lose).
HOPPER_MIN_ITEMS = 2048
HOPPER_SHORT_BATCH_DEFAULT = 64
HOPPER_SHORT_BATCH = {("fp8", 16): 16, ("fp8", 32): 16, ("fp8", 64): 16, ("fp8", 128): 4,
                      ("16bit", 64): 16, ("16bit", 128): 4}  # dense, (KV kind, rows bucket) -> smallest batch


def short_requests(*, kind: str, bucket: int, batch: int, max_items: int, sparse: bool) -> bool:
    """Too few tiles per program for the warp-specialised kernel (see HOPPER_SHORT_BATCH)."""
    min_batch = HOPPER_SHORT_BATCH_DEFAULT if sparse else HOPPER_SHORT_BATCH.get((kind, bucket),
                                                                                 HOPPER_SHORT_BATCH_DEFAULT)
    return max_items < HOPPER_MIN_ITEMS and batch < min_batch


HOPPER_CC_MAJORS = (9,)  # wgmma and setmaxnreg: SM90 only

# Small batches: (KV kind, rows bucket) -> (largest batch, tile) replacing the table's tile up to that
# batch, where a narrower tile's extra programs beat the wider tile's single read of each KV tile (H100;
# bench/TRITON_NOTES.md, rounds 5-6). FP8 32 heads as two 16-row blocks: same-process A/B (call 19, ragged)
# batch 1-16 9-28% faster, batch 64-128 13-20% slower; official grid (call 20 against call 18) batch 16
# 9-15% slower at kv 4k-16k, so dense stops at batch 4; sparse A/B batch 1-4 6-18% faster, batch 16+ slower.
# BF16 64 heads as four 16-row blocks: A/B (call 20) batch 1 5-6% faster; official grid (call 21 against
# call 18) batch 1 7-26% faster, batch 4 kv 16k 33% slower, so batch 1 only.
SMALL_BATCH_TILES = {("fp8", 32): (4, (16, 32, 4, 2, True, 2, True, 64, 64, True)),
                     ("16bit", 64): (1, (16, 32, 4, 2, True, 3, False, 64))}
# Sparse BF16 32 heads: the table's 32-row tile against two 16-row blocks, same-process A/B (call 24): batch
# 64-128 10-15% faster, batch 4-16 2-4% slower (official rows, call 24 against call 21: batch 1-16 6-8% slower),
# so the 16-row blocks stay up to batch 16.
SPARSE_SMALL_BATCH_TILES = {("fp8", 32): (4, (16, 32, 4, 2, True, 2, True, 64, 0, True)),
                            ("16bit", 32): (16, (16, 32, 4, 3, True, 2, False, 128))}

# The combine loads this many splits' partials of a row together (1: one after the other, as before round 32; 8 from
# round 32 to 53). Same-process A/B on one H100 (bench/results/combine-at-once-*-h100-call197.txt), 32 over 8: 0.981
# (dense, 25 shapes) and 0.984 (sparse, 10) in geometric mean where a row has 16-64 splits, 0.957-1.004 per shape;
# with 8 or fewer splits the program is the same (0.996-1.003: the noise of that A/B).
COMBINE_SPLITS_AT_ONCE = 32

# Modelled cost of one split partial, in KV tokens of one program's time per packed query row:
# writing `rows x 512` fp32 values and reading them back in the combine is memory traffic
# that the makespan model below otherwise ignores (0.02: measured in device call 6, see
# bench/TRITON_NOTES.md; 0 ignores it).
PARTIAL_ROW_TOKENS = 0.02


def balanced_splits(*, lengths: list[int], m_blocks: int, num_sms: int, per_sm: int, block_n: int,
                    min_split_tokens: int, block_h: int = 64,
                    partial_row_tokens: float | None = None) -> tuple[int, int]:
    """(num_splits, split_items) that minimise the modelled makespan of a ragged batch.

    Splits have a fixed size `s` (a multiple of block_n), so long requests get
    more of them. The model: `m_blocks x sum(ceil(len / s))` programs run in
    waves of `num_sms x per_sm` resident programs and a wave lasts as long as
    its longest program (`s` tokens), so the cost is `waves x s`; ties go to
    the larger `s` (fewer partials to combine). With more than one split, every
    program adds `partial_row_tokens x block_h` for its partial (PARTIAL_ROW_TOKENS by
    default). The workspace bound holds: `batch x num_splits <= batch + 4 x SMs`.
    """
    row_cost = PARTIAL_ROW_TOKENS if partial_row_tokens is None else partial_row_tokens
    batch, max_len = len(lengths), max(max(lengths), 1)
    cap = max(1, min(MAX_SPLITS, (batch + 4 * num_sms) // batch))
    slots = num_sms * per_sm
    lo = triton.cdiv(max(min_split_tokens, block_n), block_n) * block_n
    hi = triton.cdiv(max_len, block_n) * block_n
    best_cost, best_s = None, triton.cdiv(triton.cdiv(max_len, cap), block_n) * block_n
    step = block_n * max(1, (hi // block_n) // 256)  # at most ~256 candidates
    for s in range(lo, max(hi, lo) + 1, step):
        if triton.cdiv(max_len, s) > cap:
            continue
        programs = m_blocks * sum(max(1, triton.cdiv(n, s)) for n in lengths)
        cost = triton.cdiv(programs, slots) * s
        if triton.cdiv(max_len, s) > 1:
            cost += row_cost * block_h * programs
        if best_cost is None or cost <= best_cost:
            best_cost, best_s = cost, s
    best_s = max(best_s, triton.cdiv(triton.cdiv(max_len, cap), block_n) * block_n)
    return triton.cdiv(max_len, best_s), best_s


def _launch_fields(tile: Tile) -> dict:
    """The fields a `Tile` shares with `LaunchParams` (all but the split model's per_sm and min_split_tokens)."""
    return {name: getattr(tile, name) for name in LaunchParams.__dataclass_fields__ if name in Tile._fields}


def params_from_tile(tile: tuple, *, rows: int, q_len: int, batch: int, max_items: int, num_sms: int,
                     sparse: bool = False, lengths: list[int] | None = None,
                     partial_row_tokens: float | None = None) -> LaunchParams:
    """Launch parameters for one `TILE_TABLE` entry (a `Tile` or its fields), the splits
    chosen for this shape.

    With `lengths` (the per-request lengths, known in `prepare`) splits follow
    `balanced_splits`; without them (no host sync allowed) every request gets
    the same split count over `max_items`, the block table's capacity.
    """
    t = Tile(*tile)
    block_h, block_n, per_sm, min_split = t.block_h, t.block_n, t.per_sm, t.min_split_tokens
    fixed = _launch_fields(t)
    m_blocks = triton.cdiv(rows, block_h) * (q_len if sparse else 1)
    if lengths is not None:
        splits, split_items = balanced_splits(lengths=lengths, m_blocks=m_blocks, num_sms=num_sms,
                                              per_sm=per_sm, block_n=block_n, min_split_tokens=min_split,
                                              block_h=block_h, partial_row_tokens=partial_row_tokens)
        return LaunchParams(num_splits=splits, split_items=split_items, **fixed)
    splits = choose_splits(batch=batch, m_blocks=m_blocks, max_items=max_items, num_sms=num_sms,
                           min_split_tokens=min_split, waves=min(per_sm, 4))
    return LaunchParams(num_splits=splits, **fixed)


# The 64-row tiles need 180-216 KB of shared memory and were tuned for wgmma: only
# Hopper (and Blackwell datacenter parts, same 228 KB) get them; every other GPU
# (A100's 164 KB, SM89/SM120's ~100 KB) runs 16-row tiles (55 KB) for those buckets.
BIG_TILE_CC_MAJORS = (9, 10)


def default_tile(*, num_heads: int, q_len: int, batch: int, max_items: int, sparse: bool = False,
                 kv_fp8: bool = False, cc_major: int | None = None) -> Tile:
    """The heuristic's tile: on SM90 the warp-specialised kernel where `HOPPER_NARROW_MIN_BATCH` (its narrow form),
    `HOPPER_KSPLIT_MIN_BATCH` (its k-split wide form; sparse with `HOPPER_KSPLIT_SPARSE_MIN_SPLIT`) or
    `HOPPER_MIN_BATCH` (the wide form) says it wins, the first that does (and the requests are not short,
    `short_requests`), otherwise the tile of `TILE_TABLE` for the head rows (`SMALL_BATCH_TILES` for few requests).

    Args:
        max_items: the longest KV length (dense) or the top-k (sparse) of the batch.
        cc_major: the GPU's compute-capability major (None: the CPU interpreter).
    """
    rows = packed_rows(num_heads, q_len, sparse=sparse)
    kind, bucket = "fp8" if kv_fp8 else "16bit", rows_bucket(rows)
    short = short_requests(kind=kind, bucket=bucket, batch=batch, max_items=max_items, sparse=sparse)
    if cc_major in HOPPER_CC_MAJORS and not short:
        for table, tile in ((HOPPER_NARROW_MIN_BATCH, HOPPER_TILES.get(bucket)),
                            (HOPPER_KSPLIT_MIN_BATCH, HOPPER_KSPLIT_TILE), (HOPPER_MIN_BATCH, HOPPER_TILE)):
            min_batch = table.get((kind, bucket), (None, None))[1 if sparse else 0]
            if min_batch is not None and batch >= min_batch:
                longer = sparse and tile == HOPPER_KSPLIT_TILE and HOPPER_KSPLIT_SPARSE_MIN_SPLIT.get((kind, bucket))
                if longer and batch >= longer[0]:
                    return tile._replace(min_split_tokens=longer[1])
                return tile
    return _table_tile(kind, bucket, batch=batch, sparse=sparse, cc_major=cc_major)


def _table_tile(kind: str, bucket: int, *, batch: int, sparse: bool, cc_major: int | None) -> Tile:
    """The `tl` kernel's tile for a KV kind and rows bucket (16-row tiles where the 64-row ones do not fit)."""
    if cc_major is not None and cc_major not in BIG_TILE_CC_MAJORS and bucket > 32:
        bucket = 16
    tile = (SPARSE_TILE_TABLE if sparse else TILE_TABLE)[(kind, bucket)]
    max_batch, small_tile = (SPARSE_SMALL_BATCH_TILES if sparse else SMALL_BATCH_TILES).get((kind, bucket), (0, None))
    return Tile(*(small_tile if batch <= max_batch else tile))


def params_for(tile: Tile | None, *, num_heads: int, q_len: int, batch: int, max_items: int, num_sms: int,
               sparse: bool = False, kv_fp8: bool = False, lengths: list[int] | None = None,
               cc_major: int | None = None) -> LaunchParams:
    """`tile` (None: `default_tile`) with its splits for this shape, from batch x length x SMs (`lengths`: the
    per-request lengths (dense) or top-k per request (sparse), when known)."""
    if tile is None:
        tile = default_tile(num_heads=num_heads, q_len=q_len, batch=batch, max_items=max_items, sparse=sparse,
                            kv_fp8=kv_fp8, cc_major=cc_major)
    return params_from_tile(tile, rows=packed_rows(num_heads, q_len, sparse=sparse), q_len=q_len, batch=batch,
                            max_items=max_items, num_sms=num_sms, sparse=sparse, lengths=lengths)


def default_params(*, num_heads: int, q_len: int, batch: int, max_items: int, num_sms: int,
                   sparse: bool = False, kv_fp8: bool = False, lengths: list[int] | None = None,
                   cc_major: int | None = None) -> LaunchParams:
    """The heuristic's launch: `default_tile` with its splits (`params_for`)."""
    return params_for(None, num_heads=num_heads, q_len=q_len, batch=batch, max_items=max_items, num_sms=num_sms,
                      sparse=sparse, kv_fp8=kv_fp8, lengths=lengths, cc_major=cc_major)


# The tuner's refinement per device (`candidate_tiles`): besides the default tile it times the other kernel
# family at the same rows (on SM90: the tl tile where the default is the warp-specialised kernel, and the other
# way round, both forms of it for 16-32 rows, both wide forms for dense 128 rows) and the default with its
# minimum split scaled by these factors (clamped to `PARAM_SPACE`), then keeps the fastest correct one per shape.
# At most REFINE_MAX_TILES in all.
REFINE_SPLIT_FACTORS = (2.0, 0.5)
REFINE_MAX_TILES = 4


def candidate_tiles(*, num_heads: int, q_len: int, batch: int, max_items: int, sparse: bool = False,
                    kv_fp8: bool = False, cc_major: int | None = None) -> list[Tile]:
    """The tiles the tuner times for one shape, the default first, no duplicates (see REFINE_SPLIT_FACTORS)."""
    default = default_tile(num_heads=num_heads, q_len=q_len, batch=batch, max_items=max_items, sparse=sparse,
                           kv_fp8=kv_fp8, cc_major=cc_major)
    bucket = rows_bucket(packed_rows(num_heads, q_len, sparse=sparse))
    family = []
    if cc_major in HOPPER_CC_MAJORS:
        if default.warp_specialized:
            family.append(_table_tile("fp8" if kv_fp8 else "16bit", bucket, batch=batch, sparse=sparse,
                                      cc_major=cc_major))
        family += [HOPPER_TILES[b] for b in sorted({min(bucket, HOPPER_SHAPE[0]), HOPPER_SHAPE[0]})]
        if bucket >= HOPPER_SHAPE[0]:  # both wide forms, whichever the default is
            family.append(HOPPER_KSPLIT_TILE)
    splits = PARAM_SPACE["min_split_tokens"]
    scaled = [default._replace(min_split_tokens=min(max(int(default.min_split_tokens * f), splits[0]), splits[-1]))
              for f in REFINE_SPLIT_FACTORS]
    tiles = []
    for tile in [default, *family, *scaled]:
        if tile not in tiles and len(tiles) < REFINE_MAX_TILES:
            tiles.append(tile)
    return tiles


def tile_from_dict(values: dict) -> Tile:
    """A `Tile` from its stored fields (`Tile._asdict()`); ValueError if they do not make a valid launch."""
    unknown = sorted(set(values) - set(Tile._fields))
    if unknown:
        raise ValueError(f"unknown tile field {unknown[0]!r}")
    try:
        tile = Tile(**values)
    except TypeError as exc:
        raise ValueError(f"incomplete tile: {exc}") from None
    LaunchParams(**_launch_fields(tile))  # raises ValueError for an impossible combination
    return tile


def m_blocks_of(params: LaunchParams, *, num_heads: int, q_len: int, sparse: bool) -> int:
    rows = packed_rows(num_heads, q_len, sparse=sparse)
    return triton.cdiv(rows, params.block_h) * (q_len if sparse else 1)


@dataclass
class Workspace:
    """Split partials: `o_part` fp32 `[batch, splits, q_len, heads, 512]`, `lse_part` fp32 `[..., heads]`
    (None with one split); `p_scratch`: the SPLIT_SCORES exchange slots (None without it)."""

    o_part: torch.Tensor | None
    lse_part: torch.Tensor | None
    p_scratch: torch.Tensor | None = None

    @classmethod
    def for_launch(cls, params: LaunchParams, *, batch: int, q_len: int, num_heads: int, sparse: bool,
                   device: torch.device) -> Workspace | None:
        """What a launch with `params` needs, allocated now (None if nothing)."""
        o_part = lse_part = p_scratch = None
        if params.num_splits > 1:
            shape = (batch, params.num_splits, q_len, num_heads)
            o_part = torch.empty(*shape, D_LATENT, dtype=torch.float32, device=device)
            lse_part = torch.empty(*shape, dtype=torch.float32, device=device)
        if params.split_scores:
            programs = m_blocks_of(params, num_heads=num_heads, q_len=q_len, sparse=sparse) * batch * params.num_splits
            p_scratch = torch.empty(programs * scratch_per_program(params.block_h, params.block_n),
                                    dtype=torch.int16, device=device)
        if o_part is None and p_scratch is None:
            return None
        return cls(o_part, lse_part, p_scratch)


def launch(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
           seq_lens: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, *,
           sm_scale: float, kv_scale, topk_indices: torch.Tensor | None,
           params: LaunchParams, workspace: Workspace | None):
    """Enqueue stage 1 (and the combine when `params.num_splits > 1`); no allocation, no sync.

    Returns the compiled stage-1 kernel (its `n_regs`, `n_spills`, `metadata`).

    Args:
        q: `[batch, q_len, heads, 576]`, last dim contiguous.
        kv_cache: `[num_pages, page_size, 576]`, last dim contiguous.
        out: `[batch, q_len, heads, 512]` in q's dtype (written).
        lse: fp32 `[batch, q_len, heads]` (written).
        kv_scale: None, a float, or a 0-d fp32 tensor on q's device.
    """
    batch, q_len, num_heads, _ = q.shape
    page_size = kv_cache.shape[1]
    sparse = topk_indices is not None
    kv_cast = kv_cache.dtype != q.dtype
    scale_is_ptr = isinstance(kv_scale, torch.Tensor)
    scale_value = 1.0 if kv_scale is None or scale_is_ptr else float(kv_scale)
    scale_ptr = kv_scale if scale_is_ptr else seq_lens
    topk_ptr = topk_indices if sparse else seq_lens
    topk = topk_indices.shape[2] if sparse else 0
    tk_strides = (topk_indices.stride(0), topk_indices.stride(1)) if sparse else (0, 0)

    if sparse and params.hoist_pages % params.block_n:
        raise ValueError(f"sparse hoist_pages {params.hoist_pages} is not a multiple of block_n {params.block_n}")
    splits = params.num_splits
    split_items = params.split_items
    if split_items <= 0:
        capacity = topk if sparse else block_table.shape[1] * page_size
        split_items = triton.cdiv(triton.cdiv(capacity, splits), params.block_n) * params.block_n
    if splits > 1:
        o_dst, l_dst = workspace.o_part, workspace.lse_part
        o_strides = (o_dst.stride(0), o_dst.stride(1), o_dst.stride(2), o_dst.stride(3))
        l_strides = (l_dst.stride(0), l_dst.stride(1), l_dst.stride(2), l_dst.stride(3))
    else:
        o_dst, l_dst = out, lse
        o_strides = (out.stride(0), 0, out.stride(1), out.stride(2))
        l_strides = (lse.stride(0), 0, lse.stride(1), lse.stride(2))

    # FP8 tiles multiplied in fp16, the bf16 query scaled by Q_FP16_SCALE first (kernel._load_q): the tl kernel
    # where params.fp16_math says so, the Hopper kernel always (an fp16 query needs no scale).
    fp16_math = kv_cast and q.dtype == torch.bfloat16 and (params.fp16_math or params.warp_specialized)
    # The arguments both stage-1 kernels take, in their order (hopper.py copies kernel.py's signature).
    args = (q, kv_cache, block_table, seq_lens, topk_ptr, scale_ptr, o_dst, l_dst,
            sm_scale * LOG2E, scale_value, Q_FP16_SCALE if fp16_math else 1.0,
            q.stride(0), q.stride(1), q.stride(2), kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0),
            *tk_strides, *o_strides, *l_strides, num_heads, topk, split_items)
    grid = (m_blocks_of(params, num_heads=num_heads, q_len=q_len, sparse=sparse), batch, splits)
    common = dict(Q_LEN=q_len, PAGE_SIZE=page_size, BLOCK_N=params.block_n, SPARSE=sparse,
                  KV_SCALE_IS_PTR=scale_is_ptr)
    if params.warp_specialized:
        compiled = _launch_hopper(args, grid, common, q=q, kv_cache=kv_cache, params=params,
                                  tiles=triton.cdiv(split_items, params.block_n))
    else:
        compiled = _mla_split_kernel[grid](
            *args, **common, D_LATENT=D_LATENT, D_ROPE=D_ROPE, BLOCK_H=params.block_h, KV_CAST=kv_cast,
            DOT_UPCAST=q.device.type != "cuda", SPLIT_D=params.split_d, RELOAD_V=params.reload_v,
            HOIST_PAGES=params.hoist_pages, FP16_MATH=fp16_math, OPAQUE_V_CAST=params.opaque_v_cast and q.is_cuda,
            p_scratch_ptr=workspace.p_scratch if params.split_scores else None, SPLIT_SCORES=params.split_scores,
            num_warps=params.num_warps, num_stages=params.num_stages,
            **({"maxnreg": params.max_regs} if params.max_regs and q.is_cuda else {}))
    if splits > 1:
        o_part, lse_part = workspace.o_part, workspace.lse_part
        _mla_combine_kernel[(q_len * num_heads, batch)](
            o_part, lse_part, out, lse,
            *o_strides, *l_strides,
            out.stride(0), out.stride(1), out.stride(2),
            lse.stride(0), lse.stride(1), lse.stride(2),
            num_heads, splits,
            D_LATENT=D_LATENT, BLOCK_S=triton.next_power_of_2(splits),
            SPLITS_AT_ONCE=min(triton.next_power_of_2(splits), COMBINE_SPLITS_AT_ONCE), num_warps=4,
        )
    return compiled


def kv_cache_in_words(kv_cache: torch.Tensor) -> bool:
    """Whether `kv_cache` can be read as 32-bit words: its base address and page and token strides in bytes are
    multiples of 4 (a view with an odd row stride is not; `hopper._load_fp8_ahead` divides the strides by 4)."""
    size = kv_cache.element_size()
    return (kv_cache.data_ptr() % 4 == 0 and (kv_cache.stride(0) * size) % 4 == 0
            and (kv_cache.stride(1) * size) % 4 == 0)


def _launch_hopper(args: tuple, grid: tuple, common: dict, *, q, kv_cache, params: LaunchParams, tiles: int):
    """Stage 1 on the warp-specialised Hopper kernel (`hopper.py`); `tiles`: the most KV tiles a program has."""
    if not q.is_cuda:
        raise ValueError("warp_specialized runs on a CUDA GPU only (Gluon has no interpreter)")
    from mla_tune.backends.triton_mla import hopper

    form = hopper_form(params, kv_fp8=kv_cache.dtype == torch.float8_e4m3fn, sparse=common["SPARSE"],
                       splits=grid[2], tiles=tiles, kv_words=kv_cache_in_words(kv_cache))
    return hopper._mla_hopper_kernel[grid](*args, **common, **form, num_warps=params.num_warps,
                                           maxnreg=HOPPER_MAXNREG)


# Forms of the Hopper kernel (form, KV kind, dense / sparse) whose query every warp loads before the partitions start;
# in the others the MMA warps load it themselves, so the loader streams KV tiles from the start (round 33, H100 device
# call 122, same-process A/B: 0.91-1.00 of the time with 1-16 tiles a program, 0.94-1.01 with 32-256). Kept before: the
# FP8 dense wide form, which ran 1.02-1.22x slower with 8-256 tiles a program though its MMA warps alone and its loader
# alone ran as fast either way (calls 123 and 130: its loader's global loads waited longer; call 135 later showed the
# MMA warps' proxy fence waiting behind an early loader, removed in round 36; since then the query by the MMA warps read
# 0.97-1.005 there against 0.93-0.95 for the L2 prefetch, call 136; both together not measured), and the k-split form
# (BF16 dense 1.02-1.03x at batch 64-128; FP8 and sparse, which only the tuner ran, not measured). With its qk1
# division (round 48) sparse BF16 loads it in warpgroup 0: 0.97 / 0.97 / 0.99 / 0.99 of the time at 128 heads batch
# 4 / 16 / 64 / 128 (qk1-query-h100-call178.txt). Its FP8 forms (calls 260-261, H100, two runs, the second with the
# candidates' order reversed): sparse 0.986-0.996 inside at 64 and 128 heads batch 64-128 (six of six faster), so
# sparse FP8 loads it inside too; dense mixed, 0.94-1.004 at 2-3 tiles a program, 1.027 / 1.036 at 8 tiles
# (intervals apart), 0.98-1.008 at 16-256 tiles, so dense FP8 keeps it before.
QUERY_BEFORE_PARTITIONS = {("wide", "fp8", "dense"), ("ksplit", "16bit", "dense"), ("ksplit", "fp8", "dense")}


# Forms (as in QUERY_BEFORE_PARTITIONS) whose FP8 register loader asks the L2 for the next tile's lines before it waits
# for a slot (round 35, `hopper._prefetch_rows`). Same-process A/Bs: sparse wide 0.89-0.92 of the time at batch 64-128,
# 0.97-1.01 at batch 4 (H100 call 132; H200 call 134: 0.91-0.93); dense wide, once the consumer fence was gone too
# (round 36, call 136), 0.93-0.95 at 64 heads batch 4-128 against neither change, 0.94-1.00 against the fence's removal
# alone (with the fence, the prefetch had made that form 1.04-1.09x slower at batch 64-128, call 132). The dense k-split
# form (the tuner's for FP8) too: 0.926-0.939 at 64 heads batch 4-128, 0.98-1.01 at 128 heads, 1.00-1.01 at batch 1
# (H100 call 140). Its sparse form too since calls 230-232: 0.91-0.95 of the time without it at batch 64-128 (which
# took sparse FP8 from batch 64 onto the 4-warp launch, `HOPPER_KSPLIT_MIN_BATCH`), 0.95-0.99 at batch 1-16.
L2_PREFETCH_FORMS = {("wide", "fp8", "sparse"), ("wide", "fp8", "dense"), ("ksplit", "fp8", "dense"),
                     ("ksplit", "fp8", "sparse")}


# The forms whose FP8 register loader loads the next tile's bytes (as 32-bit words) before it waits for that tile's slot
# (`hopper._load_fp8_ahead`, round 59), with the L2 prefetch of the tile after; form -> the most tiles a program may
# have (None: any). It needs 120 registers (`HOPPER_LOAD_REGS["fp8_ahead"]`): at 96 the loop spilled some of its
# loads' destinations, so it waited for its loads before the slot (1.19x slower, H100 call 244); offline sm_90a at
# 120 neither wide form spills. Same process over the loader without it (H100 calls 245, 252-253; H200 call 246):
# - the sparse 4-warp launch (batch 64 and up): 0.943-0.958 (H100), 0.926-0.966 (H200);
# - the sparse wide form (batch 1-16): 0.98-1.02, so left;
# - the dense 4-warp launch, by tiles a program: 8 tiles 0.950-0.963 at 64 heads, 2-4 tiles 0.98-1.00, 128 heads at
#   4-8 tiles 0.99-1.00; from 16 tiles 1.02-1.12 (SM-bound, both sides wait longer: ncu-ahead-h100-call250.txt).
#   In the grids the three 8-tile shapes took 0.944-0.946 (H100, call 256) and 0.969-0.986 (H200, call 257).
# The narrow forms keep their staged loaders (this loader there, round 60: 1.04-1.19x slower, call 251).
LOADER_AHEAD_FORMS = {("ksplit", "fp8", "sparse"): None, ("ksplit", "fp8", "dense"): 8}


# Whether the MMA warps fence an FP8 slot for wgmma after its barrier (16-bit slots, written by cp.async, always are).
# The FP8 loaders fence their own stores before they arrive, so it repeats theirs, and with the loader ahead its fence
# waited behind the loader's stores (call 135). Without it (round 36, H100 call 136, same-process A/B): dense FP8 128
# heads 0.86 / 0.90 at batch 128 kv 16k / 64 kv 4k, 64 heads 0.98-1.00, 16 heads 0.99-1.00, sparse 0.99-1.01.
HOPPER_CONSUMER_FENCE = False


def _switched(name: str, default):
    """`default`, unless hopper.py's measurement switch `name` (bench/hopper_dev.py) is set."""
    from mla_tune.backends.triton_mla import hopper

    forced = getattr(hopper, name)
    return default if forced is None else forced


def hopper_form(params: LaunchParams, *, kv_fp8: bool, sparse: bool, splits: int, tiles: int | None = None,
                kv_words: bool = True) -> dict:
    """The Hopper kernel's constexprs that pick its form and registers for `params` (with hopper.py's measurement
    switches applied): what `_launch_hopper` launches and the offline compile tests build. `tiles`: the most KV tiles
    a program has (None: not known, as for an offline compile); `kv_words`: the cache's base and strides are whole
    32-bit words, which the loader ahead reads it as (`kv_cache_in_words`)."""
    from mla_tune.backends.triton_mla import hopper

    ksplit = params.block_h >= HOPPER_SHAPE[0] and params.num_warps == HOPPER_KSPLIT_SHAPE[2]
    writes_partials = splits > 1  # the outputs are partials the combine reads back
    form = ("ksplit" if ksplit else "narrow" if params.block_h < HOPPER_SHAPE[0] else "wide",
            "fp8" if kv_fp8 else "16bit", "sparse" if sparse else "dense")
    max_tiles = LOADER_AHEAD_FORMS.get(form, 0)
    by_form = form in LOADER_AHEAD_FORMS and (max_tiles is None or (tiles is not None and tiles <= max_tiles))
    ahead = bool(_switched("LOADER_AHEAD", by_form)) and kv_fp8 and form[0] != "narrow" and kv_words
    load_regs = HOPPER_LOAD_REGS["fp8_ahead" if ahead else "fp8" if kv_fp8 else "16bit"]
    return dict(
        STAGES=params.num_stages, KV_FP8=kv_fp8, N_ROWS=params.block_h, LOAD_REGS=load_regs, DEBUG=hopper.DEBUG_MODE,
        STAGED_LOADERS=_switched("STAGED_LOADERS", staged_loaders(kv_fp8=kv_fp8, rows=params.block_h, sparse=sparse)),
        PARTIAL_EVICT_LAST=_switched("PARTIAL_EVICT_LAST", writes_partials),
        KSPLIT=ksplit, MMA_REGS=QK1_WORKER_REGS if ksplit else 0,
        QUERY_IN_CONSUMER=_switched("QUERY_IN_CONSUMER", form not in QUERY_BEFORE_PARTITIONS),
        L2_PREFETCH=_switched("L2_PREFETCH", form in L2_PREFETCH_FORMS),
        CONSUMER_FENCE=_switched("CONSUMER_FENCE", HOPPER_CONSUMER_FENCE), LOADER_AHEAD=ahead,
        QUERY_REG_COLS=_switched("QUERY_REG_COLS", QK1_QUERY_REG_COLS.get(form, 0)) if ksplit else 0)


# Registers of the 4-warp launch's second MMA warpgroup (`hopper._mma_partition_qk1`: its 64 x 256 accumulator and
# little else), so that the first (scores, softmax, its own accumulator) gets the rest of the three warpgroups'
# `HOPPER_MAXNREG`: 168 and up keep them from spilling (offline sm_90a: 152 spills 370-670 B, 160-176 none but the FP8
# kernel's 8 B).
QK1_WORKER_REGS = 168
# The 4-warp launch's query columns that warpgroup 0 keeps in registers for its score MMAs (`hopper.QUERY_REG_COLS`),
# by form; none elsewhere. The sparse 16-bit form (64 heads at every batch, 128 heads from batch 1): 128 columns (the
# rope and 64 latent) took 0.964-1.007 of the time of none, same process (H100, calls 266-268); 192 took 0.976-0.992
# of 128's on an H200 (call 275) and 0.980-1.007 on the H100 (calls 267, 273), too little to move. Dense BF16 ran
# 1.00-1.02x slower with them, dense FP8 0.99-1.03x, and sparse FP8 1.27-1.29x slower (not investigated).
QK1_QUERY_REG_COLS = {("ksplit", "16bit", "sparse"): 128}
