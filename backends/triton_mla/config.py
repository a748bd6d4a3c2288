"""Launch parameters and tiles as named, frozen keyword values (like `triton.Config`), and the facts they need.

A `Tile` is what a dispatch table stores and the tuner records; `LaunchParams` is a tile plus the split count
chosen for one shape (`splits.py`). Every combination `LaunchParams` accepts is a launch the kernels can run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from mla_tune.backends.problem import DS_MLA_BYTES

D_LATENT = 512
D_ROPE = 64
E4M3_MAX = 448.0  # e4m3's largest finite value (the FP8-query forms scale each query row to it)
MAX_SPLITS = 64

# The declared tuning space: every combination `LaunchParams` accepts is a valid launch on SM80+
# (split_scores needs split_d; opaque_v_cast needs reload_v and fp16_math, and FP8 KV needs SM89+),
# except warp_specialized, which runs the shapes of `WARP_SPECIALIZED_SHAPES` only and on SM90 only.
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
class HopperShape:
    """The launch shape of one form of the warp-specialised Hopper kernel (`hopper.py`).

    Attributes:
        block_h: query rows per program.
        block_n: KV tokens per shared-memory slot.
        num_warps: the warps the launch names; the kernel adds its worker partitions (`warps_run`).
        num_stages: ring slots.
        warps_run: the most warps the program runs (launch warps plus worker warpgroups).
    """

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    warps_run: int

    def key(self) -> tuple[int, int, int, int]:
        return (self.block_h, self.block_n, self.num_warps, self.num_stages)


# Token-split form: 64 rows over two 8-warp MMA warpgroups, a ring of two 64-token slots, one loader warpgroup.
HOPPER_TOKEN_SPLIT_SHAPE = HopperShape(block_h=64, block_n=64, num_warps=8, num_stages=2, warps_run=12)
# Narrow form for 16 or 32 rows: one MMA warpgroup on transposed products, one or two loader warpgroups.
HOPPER_NARROW_SHAPES = {32: HopperShape(block_h=32, block_n=64, num_warps=4, num_stages=2, warps_run=12),
                        16: HopperShape(block_h=16, block_n=64, num_warps=4, num_stages=2, warps_run=12)}
# The FP8-query forms (`fp8_query`): the narrow form on e4m3 tensor cores for 16-32 rows, whose e4m3 slots and their
# v^T (68 KiB a slot) leave room for three; for 64 rows the wide form (`hopper_fp8_query_wide.py`): launched with 4
# warps (the scorer), the two p @ v warpgroups are workers; three 36 KiB token slots (four: see below).
HOPPER_FP8_QUERY_SHAPES = {**{rows: dataclasses.replace(shape, num_stages=3)
                              for rows, shape in HOPPER_NARROW_SHAPES.items()},
                           64: HopperShape(block_h=64, block_n=64, num_warps=4, num_stages=3, warps_run=12)}
# The wide form with four token slots (226 KiB of shared memory), where it scores each tile during the previous
# tile's softmax (`dispatch.FP8_QUERY_WIDE_AHEAD_MIN_WORK`).
HOPPER_FP8_QUERY_WIDE_AHEAD_SHAPE = HopperShape(block_h=64, block_n=64, num_warps=4, num_stages=4, warps_run=12)
# The qk1 form: launched with 4 warps (warpgroup 0, which scores); warpgroup 1 and the loader are workers.
HOPPER_QK1_SHAPE = HopperShape(block_h=64, block_n=64, num_warps=4, num_stages=2, warps_run=12)
# The Hopper shape by rows bucket (16 and 32: narrow; 64: token-split).
HOPPER_SHAPES = {64: HOPPER_TOKEN_SPLIT_SHAPE, **HOPPER_NARROW_SHAPES}
FP8_QUERY_SHAPES = tuple(s.key() for s in (*HOPPER_FP8_QUERY_SHAPES.values(), HOPPER_FP8_QUERY_WIDE_AHEAD_SHAPE))
WARP_SPECIALIZED_SHAPES = tuple(s.key() for s in (*HOPPER_SHAPES.values(), HOPPER_QK1_SHAPE)) + FP8_QUERY_SHAPES
# 12 warps x 32 threads x 168 registers fill the SM's 64 Ki registers (every form runs 12); `setmaxnreg` then
# rebalances them between its partitions.
HOPPER_MAXNREG = 168
HOPPER_LOAD_REGS = {"16bit": 80, "fp8": 96, "fp8_ahead": 120, "ds_mla": 120, "fp8_query": 112}
# The wide FP8-query form's p @ v warpgroups (a 64 x 256 fp32 accumulator and v^T as their register operand each;
# 168 and 184 spill in the loop, 192 only in the epilogue); the scorer gets the rest.
FP8_QUERY_WIDE_PV_REGS = 192
# The qk1 form's second MMA warpgroup: 168 keeps both warpgroups from spilling (152 spilled).
QK1_WORKER_REGS = 168
HOPPER_CC_MAJORS = (9,)  # wgmma and setmaxnreg: SM90 only
# The 64-row tl tiles need 180-216 KB of shared memory: only Hopper and Blackwell datacenter parts have it.
BIG_TILE_CC_MAJORS = (9, 10)

_TL_ONLY = ("split_d", "reload_v", "hoist_pages", "fp16_math", "max_regs", "split_scores", "opaque_v_cast")


@dataclass(frozen=True, kw_only=True)
class LaunchParams:
    """One point of `PARAM_SPACE` plus the split count it implies for a shape.

    Attributes:
        block_h: query rows (q_len x heads, packed) per program; the MMA M dimension.
        block_n: KV tokens per tile.
        num_warps: warps per program as launched.
        num_stages: software-pipelining depth of the KV loads (ring slots in the Hopper kernel).
        num_splits: programs along the KV axis of one request (flash-decoding).
        split_d: the 512 latent columns as four blocks of 128 (lower register pressure for FP8 casts).
        split_items: KV tokens (dense) or top-k slots (sparse) per split, a multiple of block_n; 0 derives it
            from the block-table capacity (dense) or top-k (sparse) at launch; with split_per_request, the
            shortest split.
        split_per_request: each request's split size derived on the device from its own length (dense), so one
            launch (a captured CUDA graph) suits any lengths up to the block table's capacity.
        reload_v: load the tile a second time for `p @ v`, so each load has one consumer Triton can pipeline.
        hoist_pages: 0, or how many lookups a program loads into registers at a time (a power of 2), so no KV
            address depends on a load inside the tile loop.
        fp16_math: FP8 tiles multiplied in fp16 (one conversion instruction per e4m3 pair).
        max_regs: 0, or the `maxnreg` the tl kernel is launched with.
        split_scores: the score matmul split between the warpgroups, p exchanged through global scratch.
        opaque_v_cast: FP8 V reload cast by an inline-asm `cvt`, so V reaches the MMA through `ldmatrix.trans`.
        warp_specialized: run the Gluon Hopper kernel (`hopper.py`, SM90 only) in the form its shape names
            (`WARP_SPECIALIZED_SHAPES`); the tl-only fields must stay at their defaults.
        fp8_query: (an e4m3 cache) the query and p rounded to e4m3 and every product on FP8 tensor cores: the
            narrow Hopper form for 16-32 rows (`hopper_fp8_query.py`), the wide form for 64
            (`hopper_fp8_query_wide.py`); less accurate, so a backend of its own.
        longest_first: (dense, fixed splits, the lengths known) the programs launched longest first, in an order
            prepared from the lengths (`splits.launch_order`, kept in the workspace).
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
    split_per_request: bool = False
    fp8_query: bool = False
    longest_first: bool = False

    def __post_init__(self):
        if self.split_scores and not self.split_d:
            raise ValueError("split_scores needs split_d")
        if self.opaque_v_cast and not (self.reload_v and self.fp16_math):
            raise ValueError("opaque_v_cast needs reload_v and fp16_math")
        shape = (self.block_h, self.block_n, self.num_warps, self.num_stages)
        if self.warp_specialized:
            tl_only = [name for name in _TL_ONLY if getattr(self, name)]
            if tl_only:
                raise ValueError(f"warp_specialized does not take the tl kernel's {', '.join(tl_only)}")
            if shape not in WARP_SPECIALIZED_SHAPES:
                raise ValueError(f"warp_specialized runs (block_h, block_n, num_warps, num_stages) = "
                                 f"{' or '.join(map(str, WARP_SPECIALIZED_SHAPES))} only (227 KiB of shared memory), "
                                 f"got {shape}")
        if self.fp8_query and not (self.warp_specialized and shape in FP8_QUERY_SHAPES):
            raise ValueError(f"fp8_query runs on the FP8-query Hopper forms only: warp_specialized and "
                             f"(block_h, block_n, num_warps, num_stages) = {' or '.join(map(str, FP8_QUERY_SHAPES))}")
        if self.longest_first and (self.split_per_request or self.split_items <= 0):
            raise ValueError("longest_first orders fixed splits: it needs split_items and not split_per_request")
        if self.warp_specialized and not self.fp8_query and shape in FP8_QUERY_SHAPES:
            raise ValueError(f"{shape} is the FP8-query form's launch shape: its 16-bit slots would not fit")

    def label(self) -> str:
        return (f"h{self.block_h}n{self.block_n}w{self.num_warps}"
                f"s{self.num_stages}{'d' if self.split_d else ''}{'r' if self.reload_v else ''}"
                f"{f'p{self.hoist_pages}' if self.hoist_pages else ''}{'f' if self.fp16_math else ''}"
                f"{f'R{self.max_regs}' if self.max_regs else ''}{'S' if self.split_scores else ''}"
                f"{'o' if self.opaque_v_cast else ''}{'W' if self.warp_specialized else ''}"
                f"{'Q' if self.fp8_query else ''}x{self.num_splits}{'L' if self.split_per_request else ''}"
                f"{'O' if self.longest_first else ''}")

    @property
    def kernel_form(self) -> str:
        """The kernel these parameters run: "tl" (`tl_kernel.py`), or the Hopper kernel's "token_split", "narrow",
        "qk1" or "fp8_query_wide" form (the 16-32 row FP8-query form is "narrow")."""
        if not self.warp_specialized:
            return "tl"
        if self.fp8_query and self.block_h >= HOPPER_TOKEN_SPLIT_SHAPE.block_h:
            return "fp8_query_wide"
        if self.block_h < HOPPER_TOKEN_SPLIT_SHAPE.block_h:
            return "narrow"
        return "qk1" if self.num_warps == HOPPER_QK1_SHAPE.num_warps else "token_split"


@dataclass(frozen=True, kw_only=True)
class Tile:
    """A `LaunchParams` without the per-shape split count, plus what the split model needs.

    Attributes:
        per_sm: programs of this tile resident on one SM (the split model's wave size).
        min_split_tokens: the shortest split the split model makes.
        Others: as in `LaunchParams`.
    """

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    split_d: bool
    per_sm: int
    reload_v: bool
    min_split_tokens: int
    hoist_pages: int = 0
    fp16_math: bool = False
    max_regs: int = 0
    split_scores: bool = False
    opaque_v_cast: bool = False
    warp_specialized: bool = False
    fp8_query: bool = False

    def replace(self, **changes) -> Tile:
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        """The stored form (what `tile_from_dict` reads back)."""
        return dataclasses.asdict(self)

    def launch_fields(self) -> dict:
        """The fields this tile shares with `LaunchParams` (all but per_sm and min_split_tokens)."""
        return {name: getattr(self, name) for name in TILE_FIELDS if name in LAUNCH_FIELDS}


TILE_FIELDS = tuple(f.name for f in dataclasses.fields(Tile))
LAUNCH_FIELDS = tuple(f.name for f in dataclasses.fields(LaunchParams))


def hopper_tile(shape: HopperShape, *, min_split_tokens: int = 128) -> Tile:
    """The `Tile` that runs `shape` on the Hopper kernel, one program per SM."""
    return Tile(block_h=shape.block_h, block_n=shape.block_n, num_warps=shape.num_warps,
                num_stages=shape.num_stages, split_d=False, per_sm=1, reload_v=False,
                min_split_tokens=min_split_tokens, warp_specialized=True)


def tile_from_dict(values: dict) -> Tile:
    """A `Tile` from its stored fields (`Tile.as_dict()`); ValueError if they do not make a valid launch."""
    unknown = sorted(set(values) - set(TILE_FIELDS))
    if unknown:
        raise ValueError(f"unknown tile field {unknown[0]!r}")
    try:
        tile = Tile(**values)
    except TypeError as exc:
        raise ValueError(f"incomplete tile: {exc}") from None
    LaunchParams(**tile.launch_fields())  # raises ValueError for an impossible combination
    return tile


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


def is_ds_mla(kv_cache: torch.Tensor) -> bool:
    """Whether `kv_cache` holds vLLM's fp8_ds_mla rows (uint8, DS_MLA_BYTES per token)."""
    return kv_cache.dtype == torch.uint8 and kv_cache.shape[-1] == DS_MLA_BYTES


def packed_rows(num_heads: int, q_len: int, *, sparse: bool) -> int:
    """Rows in one program's M dimension group: q_len x heads dense, heads sparse."""
    return num_heads if sparse else q_len * num_heads


def rows_bucket(rows: int) -> int:
    """Packed query rows rounded up to the tile table's buckets: 16, 32, 64 or 128."""
    return 16 if rows <= 16 else 32 if rows <= 32 else 64 if rows <= 64 else 128
