"""GPU development benchmark of the Triton MLA kernel: check, sweep launch parameters, compare.

Every variant is checked against `mla_reference` on the same random inputs
before it is timed. Timing: CUDA graph of `copies` back-to-back launches that
rotate through copies of q and the KV cache (cold L2: the copies together
exceed the L2 many times over), median of the replays, per launch.
The roofline uses the copy bandwidth and bf16 matmul rate measured in the
same process.

    python bench/triton_dev.py sweep --out results.txt
    python bench/triton_dev.py grid --flashinfer --out results.txt
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time

import torch

from mla_tune.backends.inputs import make_inputs
from mla_tune.backends.problem import Problem, Shape
from mla_tune.backends.reference import mla_reference
from mla_tune.tuner import timing
from mla_tune.tuner.gate import check_output
from mla_tune.backends.triton_mla.adapter import TritonMLA, TritonMLASparse
from mla_tune.backends.triton_mla.launch import launch, params_from_tile, rows_bucket

T0 = time.time()


RESULT_FILE = None


def log(*args):
    print(*args, flush=True)
    if RESULT_FILE is not None:
        with open(RESULT_FILE, "a") as f:
            print(*args, file=f)


def capture(run, input_sets):
    """`run` over every input set once, captured in a CUDA graph by `tuner.timing` (no repeats inside the graph)."""
    return timing.capture_graph(lambda: [run(s) for s in input_sets], iterations_per_replay=len(input_sets),
                                warmup=1, min_replay_ms=0)


def time_steps(steps: dict, *, replays: int = 12) -> dict:
    """name -> (median, min, max) microseconds per launch over `replays` replays of each captured graph in `steps`,
    the candidates' replays interleaved round-robin in a rotating order (`tuner.timing.time_interleaved`), so clock
    and thermal drift favour no one. Until device call 235 the dev tools timed each candidate's 12 replays in one
    burst, one candidate after another."""
    results = timing.time_interleaved(steps, rel_ci_target=0.0, max_seconds=math.inf, min_samples=replays,
                                      max_samples=replays, warmup=2)
    return {name: (r.median_ms * 1e3, min(r.all_ms) * 1e3, max(r.all_ms) * 1e3) for name, r in results.items()}


def time_graph(run, input_sets, *, replays: int = 12) -> tuple[float, float, float]:
    """(median, min, max) microseconds per launch of `run` alone (`capture`, `time_steps`)."""
    return time_steps({"run": capture(run, input_sets)}, replays=replays)["run"]


def measure_machine() -> tuple[float, float]:
    """(copy bandwidth in bytes/s counting read + write, bf16 matmul FLOP/s), as `bench/kernels.py` measures them
    (`tuner.timing`; before device call 230 the dev tools timed a float32 copy and the matmul in CUDA graphs here)."""
    return timing.measure_copy_bandwidth_gbs() * 1e9, timing.measure_matmul_tflops() * 1e12


class Case:
    """One problem + shape with its input copies and float32 reference."""

    def __init__(self, problem: Problem, shape: Shape, *, ragged: bool = True):
        self.problem, self.shape = problem, shape
        base = make_inputs(problem, shape, device="cuda", seed=1, ragged=ragged)
        # the tuner's rotation (calls up to 218 rotated max(2, min(64, 400 MiB / allocated bytes)) sets, which left
        # sparse shapes of 1-16 requests partly in L2: their top-k rows are a few percent of the cache)
        self.sets = timing.cold_l2_sets(base, free_bytes=int(torch.cuda.mem_get_info()[0] * 0.5))
        self.ref, self.ref_lse = mla_reference(base.q, base.kv_cache, base.block_table, base.seq_lens,
                                    sm_scale=base.sm_scale, kv_scale=base.kv_scale,
                                    topk_indices=base.topk_indices)
        lens = base.seq_lens.long()
        if problem.sparse:
            tokens = int((base.topk_indices >= 0).sum())
            self.kv_bytes = tokens * 576 * base.kv_cache.element_size()
            self.flops = 2 * tokens * problem.num_heads * 1088
        else:
            tokens = int(lens.sum())
            self.kv_bytes = tokens * 576 * base.kv_cache.element_size()
            self.flops = 2 * tokens * problem.num_heads * problem.q_len * 1088
        self.max_items = problem.topk if problem.sparse else int(lens.max())
        self.lengths = [problem.topk] * shape.batch_size if problem.sparse else [int(n) for n in lens.tolist()]

    def roofline_us(self, bw: float, mm: float) -> float:
        return max(self.kv_bytes / bw, self.flops / mm) * 1e6

    def label(self) -> str:
        p = self.problem
        kind = f"topk{p.topk}" if p.sparse else "dense"
        return (f"{p.kv_cache_dtype:8s} {kind:9s} h{p.num_heads:<3d} q{p.q_len} b{self.shape.batch_size:<3d} "
                f"kv{self.shape.kv_len:<5d}")

    def free(self):
        self.sets.clear()
        self.ref = self.ref_lse = None


def failed(exc: Exception) -> dict:
    """The result of a kernel that raised (a failure is data: the run goes on)."""
    return {"status": "failed", "why": f"{type(exc).__name__}: {str(exc)[:200]}"}


def check(case: Case, adapter, *, verify: bool = True) -> tuple[object, dict]:
    """(prepared adapter or None, result without times): `adapter` prepared for `case`, run once and, with `verify`,
    checked against the float32 reference (hopper.py's measurement modes compute nothing meaningful: no check)."""
    try:
        prepared = adapter.prepare(case.problem, case.sets[0])
        out, lse = prepared.run(case.sets[0])
        torch.cuda.synchronize()
        err = float("nan")
        if verify:
            verdict = check_output(out, lse, case.ref, case.ref_lse, kv_cache_dtype=case.problem.kv_cache_dtype)
            err = verdict.rel_error
            if not verdict.ok:
                return None, {"status": "incorrect", "err": err, "reason": verdict.reason}
        info = ""
        if hasattr(prepared, "workspace"):
            s0 = case.sets[0]
            k = launch(s0.q, s0.kv_cache, s0.block_table, s0.seq_lens, prepared.out, prepared.lse,
                       sm_scale=s0.sm_scale, kv_scale=s0.kv_scale, topk_indices=s0.topk_indices,
                       params=prepared.params, workspace=prepared.workspace)
            if hasattr(k, "n_regs"):
                info = f" regs {k.n_regs} spills {k.n_spills} smem {k.metadata.shared // 1024}K"
        return prepared, {"status": "ok", "err": err, "params": getattr(prepared, "params", None), "info": info}
    except Exception as exc:  # a failure is data
        return None, failed(exc)


def with_times(result: dict, times: tuple[float, float, float]) -> dict:
    med, lo, hi = times
    return {**result, "us": med, "lo": lo, "hi": hi}


def check_and_time(case: Case, adapter) -> dict:
    """`check`, then `time_graph` alone."""
    prepared, result = check(case, adapter)
    if prepared is None:
        return result
    try:
        return with_times(result, time_graph(prepared.run, case.sets))
    except Exception as exc:  # a failure is data
        return failed(exc)


# rows bucket (q_len x heads, rounded up) -> candidate (block_h, block_n, num_warps, num_stages), prior first
# rows bucket -> candidate tiles (block_h, block_n, num_warps, num_stages, split_d, per_sm, reload_v,
# min_split_tokens), prior first. (Device calls 2 and 3 ran with the sixth field meaning "waves"
# of a split rule that targeted waves x SMs programs; see bench/TRITON_NOTES.md.)
_BIG = [(64, 64, 8, 2, True, 2, False, 512), (64, 32, 8, 2, True, 2, False, 512)]
BUCKET_CONFIGS = {
    16: [(16, 32, 4, 2, True, 2, False, 256), (16, 32, 4, 2, False, 2, False, 256)],
    32: [(32, 32, 4, 2, False, 2, False, 256), (16, 32, 4, 2, True, 2, False, 256)],
    64: _BIG,
    128: _BIG,
}


def bucket(rows: int) -> int:
    return rows_bucket(rows)


def kv_kind(kv_dtype: str) -> str:
    return "fp8" if kv_dtype == "fp8_e4m3" else "16bit"


def params_for(tile, case):
    """The tile's launch parameters for `case`, splits balanced exactly as the adapter does."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return params_from_tile(tile, rows=case.problem.num_heads, q_len=1, batch=case.shape.batch_size,
                            max_items=case.max_items, num_sms=sms, lengths=case.lengths,
                            sparse=case.problem.sparse)


def sweep(args, bw, mm):
    """Time each bucket's candidate tiles at batch 64, kv_len 4096 (then the winner's wave
    count 1 and 4 at batch 16); return {(kv kind, bucket): best tile}."""
    best = {}
    for heads in [int(x) for x in args.sweep_heads.split(",")]:
        for kv_dtype in ("bf16", "fp8_e4m3"):
            case = Case(Problem(heads, kv_dtype, page_size=64), Shape(64, 4096))
            roof = case.roofline_us(bw, mm)
            timed = []
            for tile in BUCKET_CONFIGS[bucket(heads)]:
                if time.time() - T0 > args.budget_s:
                    log("# sweep budget reached")
                    break
                params = params_for(tile, case)
                r = check_and_time(case, TritonMLA(params))
                log("sweep " + fmt_line(case, params.label(), r, roof, str(tile)))
                if r["status"] == "ok":
                    timed.append((r["us"], tile))
            case.free()
            if not timed:
                continue
            winner = min(timed)[1]
            if not args.sweep_waves:
                best[(kv_kind(kv_dtype), bucket(heads))] = winner
                continue
            # wave count: matters when batch x m_blocks is small against the SM count
            case = Case(Problem(heads, kv_dtype, page_size=64), Shape(16, 4096))
            roof = case.roofline_us(bw, mm)
            waves_timed = []
            for waves in (1, 2, 4):
                tile = winner[:5] + (waves,) + winner[6:]
                params = params_for(tile, case)
                r = check_and_time(case, TritonMLA(params))
                log("sweep " + fmt_line(case, params.label(), r, roof, str(tile)))
                if r["status"] == "ok":
                    waves_timed.append((r["us"], tile))
            case.free()
            best[(kv_kind(kv_dtype), bucket(heads))] = min(waves_timed)[1] if waves_timed else winner
    for kind in ("16bit", "fp8"):  # 128 heads run the 64-row tiles too
        if (kind, 64) in best and (kind, 128) not in best:
            best[(kind, 128)] = best[(kind, 64)]
    log(f"# sweep winners: {best}")
    return best


# (heads, batch, kv_len) -> candidate tiles per KV kind; the first is the call-2 default
COMPARE_SHAPES = [(16, 64, 4096), (64, 64, 4096), (128, 64, 4096), (32, 64, 4096), (16, 1, 4096),
                  (64, 1, 4096), (64, 4, 16384), (128, 1, 16384), (16, 16, 16384)]
OLD = {("16bit", 16): (16, 32, 4, 2, True, 2, False, 256), ("16bit", 32): (32, 32, 4, 2, False, 2, False, 256),
       ("16bit", 64): (64, 64, 8, 2, True, 2, False, 512), ("fp8", 16): (16, 32, 4, 2, False, 2, False, 256),
       ("fp8", 32): (32, 32, 4, 2, False, 2, False, 256), ("fp8", 64): (64, 64, 8, 2, True, 2, False, 512)}
OLD[("16bit", 128)], OLD[("fp8", 128)] = OLD[("16bit", 64)], OLD[("fp8", 64)]
NEW_CANDIDATES = {
    ("16bit", 16): [(16, 32, 4, 2, True, 2, False, 128)],
    ("16bit", 32): [(16, 32, 4, 2, True, 2, False, 128)],
    ("16bit", 64): [(64, 64, 8, 2, True, 2, False, 256), (64, 64, 8, 2, True, 2, True, 256)],
    ("fp8", 16): [(16, 16, 4, 2, True, 2, True, 128), (16, 32, 4, 2, True, 2, True, 128),
                  (16, 32, 4, 2, False, 2, True, 128)],
    ("fp8", 32): [(16, 16, 4, 2, True, 2, True, 128), (32, 32, 4, 2, True, 2, True, 128)],
    ("fp8", 64): [(64, 64, 8, 2, True, 2, True, 256), (64, 32, 8, 2, True, 2, True, 256)],
}
NEW_CANDIDATES[("16bit", 128)] = NEW_CANDIDATES[("16bit", 64)]
NEW_CANDIDATES[("fp8", 128)] = NEW_CANDIDATES[("fp8", 64)]


def compare(args, bw, mm):
    """Old default tile vs new candidates on a few shapes, side by side in one process."""
    for heads, batch, kv_len in COMPARE_SHAPES:
        for kv_dtype in ("fp8_e4m3", "bf16"):
            if time.time() - T0 > args.budget_s:
                log("# compare budget reached")
                return
            case = Case(Problem(heads, kv_dtype, page_size=64), Shape(batch, kv_len))
            roof = case.roofline_us(bw, mm)
            key = (kv_kind(kv_dtype), bucket(heads))
            for i, tile in enumerate([OLD[key]] + NEW_CANDIDATES[key]):
                params = params_for(tile, case)
                r = check_and_time(case, TritonMLA(params))
                log("cmp " + fmt_line(case, params.label(), r, roof, ("old " if i == 0 else "new ") + str(tile)))
            case.free()


# Round 2: the shipped tile per (KV kind, rows bucket) against tiles with the block table hoisted
# into registers (`hoist_pages`, the 9th field), which lets Triton keep a KV tile in flight.
HOIST_SHAPES = {16: [(16, 64, 4096), (16, 1, 4096), (16, 16, 16384)], 32: [(32, 64, 4096), (32, 4, 16384)],
                64: [(64, 64, 4096), (64, 1, 4096), (64, 4, 16384), (64, 16, 4096)],
                128: [(128, 64, 4096), (128, 1, 16384), (128, 16, 4096)]}
_H16 = [(16, 32, 4, 2, True, 3, False, 128, 64), (16, 16, 4, 3, True, 3, False, 128, 64),
        (16, 32, 4, 3, True, 2, False, 128, 64)]
_H64 = [(64, 32, 8, 3, True, 1, False, 256, 64), (64, 64, 8, 2, True, 1, False, 256, 64)]
_F64 = [(64, 32, 8, 3, True, 1, False, 256, 64), (64, 32, 8, 3, True, 1, True, 256, 64)]
HOIST_CANDIDATES = {
    ("16bit", 16): _H16, ("16bit", 32): _H16, ("16bit", 64): _H64, ("16bit", 128): _H64,
    ("fp8", 16): [(16, 32, 4, 2, True, 2, True, 128, 64), (16, 16, 4, 3, True, 3, True, 128, 64)],
    ("fp8", 32): [(32, 32, 4, 2, True, 2, True, 128, 64), (16, 16, 4, 3, True, 3, True, 128, 64)],
    ("fp8", 64): _F64, ("fp8", 128): _F64,
}


# Round 2, second call: smaller minimum splits for the 64-row tiles (small batches are
# latency bound: fewer tiles per program), and the hoisted FP8 16-row tile (0.971 in call 4).
_S64 = [(64, 64, 8, 2, True, 1, False, 128), (64, 64, 8, 2, True, 1, False, 64)]
SPLIT_SHAPES = {16: [(16, 1, 1024), (16, 4, 4096), (16, 64, 4096)],
                64: [(64, 1, 1024), (64, 1, 4096), (64, 4, 1024), (64, 4, 16384), (64, 64, 4096)],
                128: [(128, 1, 1024), (128, 4, 4096), (128, 16, 4096)]}
SPLIT_CANDIDATES = {("fp8", 16): [(16, 32, 4, 2, True, 2, True, 128, 64), (16, 32, 4, 2, True, 2, True, 64, 64)],
                    ("16bit", 16): [(16, 32, 4, 2, True, 3, False, 64)],
                    ("16bit", 64): _S64, ("16bit", 128): _S64, ("fp8", 64): _S64, ("fp8", 128): _S64}


# Round 3: FP8 tiles multiplied in fp16 (one cvt per e4m3 pair instead of three), the shipped
# tile first, then the same tile with fp16 math, then fp16 candidates. Shapes are
# (heads, batch, kv_len[, topk]); the sparse one checks the same tile on the top-k path.
FP16_SHAPES = {16: [(16, 64, 4096), (16, 1, 4096), (16, 16, 16384), (16, 128, 1024), (16, 64, 8192, 2048)],
               32: [(32, 64, 4096), (32, 4, 16384), (32, 16, 1024), (32, 64, 8192, 2048)],
               64: [(64, 64, 4096), (64, 1, 4096), (64, 4, 16384), (64, 16, 4096), (64, 64, 8192, 2048)],
               128: [(128, 64, 4096), (128, 1, 16384), (128, 16, 4096), (128, 4, 8192, 2048)]}
_F16_64 = [(64, 64, 8, 2, True, 1, False, 64, 0, True), (64, 64, 8, 2, True, 1, True, 64, 0, True),
           (64, 32, 8, 3, True, 1, False, 64, 64, True)]
FP16_CANDIDATES = {
    ("fp8", 16): [(16, 32, 4, 2, True, 2, True, 64, 64, True), (16, 32, 8, 2, True, 1, True, 64, 64, True),
                  (16, 16, 4, 2, True, 2, True, 64, 64, True)],
    ("fp8", 32): [(32, 32, 4, 2, True, 2, True, 128, 64, True), (32, 32, 8, 2, True, 1, True, 128, 64, True),
                  (16, 32, 8, 2, True, 1, True, 128, 64, True)],
    ("fp8", 64): _F16_64, ("fp8", 128): _F16_64,
}


# Round 3, second call: a register cap (Triton's maxnreg) for 8-warp 16/32-row tiles, so two
# programs (16 warps) fit on an SM instead of one 4-warp program of 255 registers x 2.
REGS_SHAPES = {16: [(16, 64, 4096), (16, 1, 4096), (16, 16, 16384), (16, 128, 1024), (16, 16, 8192, 2048)],
               32: [(32, 64, 4096), (32, 4, 16384), (32, 16, 1024), (32, 16, 8192, 2048)]}
REGS_CANDIDATES = {
    ("fp8", 16): [(16, 32, 8, 2, True, 2, True, 64, 64, True, 128), (16, 32, 8, 3, True, 2, True, 64, 64, True, 128)],
    ("fp8", 32): [(32, 32, 4, 2, True, 2, True, 128, 64, True), (32, 32, 8, 2, True, 2, True, 128, 64, True, 128),
                  (16, 32, 8, 2, True, 2, True, 128, 64, True, 128)],
    ("16bit", 16): [(16, 32, 8, 2, True, 2, False, 64, 0, False, 128),
                    (16, 32, 8, 3, True, 2, False, 64, 64, False, 128)],
    ("16bit", 32): [(16, 32, 8, 2, True, 2, False, 128, 64, False, 128),
                    (16, 32, 8, 3, True, 2, False, 128, 64, False, 128)],
}


# Round 3, third call: the score matmul split between the warpgroups of the 64-row tiles
# (split_scores: p and alpha exchanged through a global scratch, see kernel._exchange).
SCORES_SHAPES = {64: [(64, 64, 4096), (64, 1, 4096), (64, 4, 16384), (64, 16, 4096), (64, 128, 1024),
                      (64, 64, 8192, 2048)],
                 128: [(128, 64, 4096), (128, 1, 16384), (128, 16, 4096), (128, 128, 1024), (128, 4, 8192, 2048)]}
_S16 = [(64, 64, 8, 2, True, 1, False, 64, 0, False, 0, True), (64, 32, 8, 2, True, 1, False, 64, 0, False, 0, True),
        (64, 32, 8, 3, True, 1, False, 64, 64, False, 0, True)]
_S8 = [(64, 64, 8, 2, True, 1, False, 64, 0, True, 0, True), (64, 32, 8, 2, True, 1, False, 64, 0, True, 0, True)]
SCORES_CANDIDATES = {("16bit", 64): _S16, ("16bit", 128): _S16, ("fp8", 64): _S8, ("fp8", 128): _S8}

# Round 4: sparse tiles look their rows up a chunk of top-k slots at a time (`hoist_pages` for
# sparse), against SPARSE_TILE_TABLE; the shapes of the official sparse benchmark (top-k 2048,
# kv 32768) where Triton lost in round 3 (batch >= 16) plus batch 4.
SPARSE_SHAPES = {h: [(h, b, 32768, 2048) for b in (4, 16, 128)] + ([(h, 64, 32768, 2048)] if h == 64 else [])
                 for h in (16, 32, 64, 128)}
SPARSE_CANDIDATES = {  # call 10 ran the stages-2 entries with byte offsets gathered (scalar loads, see notes)
    ("16bit", 16): [(16, 32, 4, 3, True, 2, False, 64, 64), (16, 32, 4, 2, True, 3, False, 64, 64),
                    (16, 16, 4, 3, True, 3, False, 64, 64)],
    ("16bit", 32): [(16, 32, 4, 3, True, 2, False, 128, 64), (16, 16, 4, 3, True, 3, False, 128, 64)],
    ("16bit", 64): [(64, 32, 8, 3, True, 1, False, 64, 64), (64, 64, 8, 2, True, 1, False, 64, 64)],
    ("16bit", 128): [(64, 32, 8, 3, True, 1, False, 64, 64), (64, 64, 8, 2, True, 1, False, 64, 64, False, 0, True)],
    ("fp8", 16): [(16, 32, 4, 3, True, 2, True, 64, 64, True), (16, 32, 4, 2, True, 2, True, 64, 64, True)],
    ("fp8", 32): [(32, 32, 4, 3, True, 2, True, 128, 64), (32, 32, 4, 2, True, 2, True, 128, 64)],
    ("fp8", 64): [(64, 32, 8, 3, True, 1, False, 64, 64, True), (64, 64, 8, 2, True, 1, False, 64, 64, True)],
    ("fp8", 128): [(64, 32, 8, 3, True, 1, False, 64, 64, True), (64, 64, 8, 2, True, 1, False, 64, 64, True)],
}


# Round 2, third call: the cost of the fp32 split partials in the split-size model
# (launch.PARTIAL_ROW_TOKENS), on shapes where it changes the split count.
PARTIAL_COSTS = (0.0, 0.005, 0.02)
PARTIAL_SHAPES = [(128, 128, 1024), (64, 128, 1024), (128, 16, 4096), (64, 64, 4096), (64, 4, 16384),
                  (16, 64, 4096), (32, 128, 1024), (128, 64, 16384)]


def partials_compare(args, bw, mm):
    """Time the default tiles with each PARTIAL_COSTS value; return the winning value.

    A nonzero value wins only if its geometric-mean time ratio against 0 over all shapes
    and both KV dtypes is below 0.97 and no shape gets more than 10% slower.
    """
    from mla_tune.backends.triton_mla.launch import TILE_TABLE
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    times = {c: [] for c in PARTIAL_COSTS}
    for heads, batch, kv_len in PARTIAL_SHAPES:
        for kv_dtype in ("bf16", "fp8_e4m3"):
            if time.time() - T0 > args.budget_s:
                log("# partials budget reached")
                break
            case = Case(Problem(heads, kv_dtype, page_size=64), Shape(batch, kv_len))
            roof = case.roofline_us(bw, mm)
            tile = TILE_TABLE[(kv_kind(kv_dtype), bucket(heads))]
            for c in PARTIAL_COSTS:
                params = params_from_tile(tile, rows=heads, q_len=1, batch=batch, max_items=case.max_items,
                                          num_sms=sms, lengths=case.lengths, partial_row_tokens=c)
                r = check_and_time(case, TritonMLA(params))
                log("partials " + fmt_line(case, params.label(), r, roof, f"c={c}"))
                times[c].append(r["us"] if r["status"] == "ok" else None)
            case.free()
    base, best, best_gm = times[0.0], 0.0, 0.97
    for c in PARTIAL_COSTS[1:]:
        if any(t is None for t in times[c]) or any(b is None for b in base):
            continue
        ratios = [t / b for t, b in zip(times[c], base)]
        gm = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
        log(f"# partials c={c}: time ratio vs 0 {gm:.3f} (max {max(ratios):.3f})")
        if gm < best_gm and max(ratios) < 1.10:
            best, best_gm = c, gm
    log(f"# partials winner: {best}")
    return best


def apply_partial_cost(value, path="backends/triton_mla/launch.py"):
    import re
    text, n = re.subn(r"^PARTIAL_ROW_TOKENS = .*$", f"PARTIAL_ROW_TOKENS = {value!r}", open(path).read(), flags=re.M)
    assert n == 1
    open(path, "w").write(text)
    log(f"# applied PARTIAL_ROW_TOKENS = {value!r} to {path}")

# Round 4b: smaller minimum splits for the FP8 32-row tile, the one bucket that still loses to FlashInfer
# (dense h32 b1 kv1k; sparse h32 b1): more programs at batch 1-4; larger batches keep their split.
SMALL_SHAPES = {32: [(32, 1, 1024), (32, 1, 4096), (32, 4, 1024), (32, 4, 16384), (32, 64, 4096)]}
SMALL_CANDIDATES = {("fp8", 32): [(32, 32, 4, 2, True, 2, True, 64, 64), (32, 32, 4, 2, True, 2, True, 32, 64)]}
SMALL_SPARSE_SHAPES = {32: [(32, b, 32768, 2048) for b in (1, 4, 16, 128)]}
SMALL_SPARSE_CANDIDATES = {("fp8", 32): [(32, 32, 4, 2, True, 2, True, 64), (32, 32, 4, 2, True, 2, True, 32)]}

# Round 4c: minimum split 32 tokens for the other 32-token tiles (the 64-row tiles use 64-token tiles,
# so 64 is already their floor), on batch 1-16 shapes, where programs are few; batch 64 as a guard.
SMALL2_SHAPES = {bkt: [(bkt, b, kv) for b, kv in ((1, 1024), (1, 4096), (1, 16384), (4, 4096), (16, 4096), (64, 4096))]
                 for bkt in (16, 32)}
SMALL2_CANDIDATES = {
    ("16bit", 16): [(16, 32, 4, 2, True, 3, False, 32)],
    ("16bit", 32): [(16, 32, 4, 3, True, 2, False, 32, 64)],
    ("fp8", 16): [(16, 32, 4, 2, True, 2, True, 32, 64, True)],
}


# Round 5: FP8 32 and 64 heads as two / four blocks of the FP8 16-row tile (the way BF16 32 heads runs):
# the 16-row tile reaches 46% of the roofline at 16 heads, the 32-row and 64-row FP8 tiles 30%.
BLOCKS16_SHAPES = {
    32: [(32, b, kv) for b, kv in ((1, 1024), (1, 16384), (4, 4096), (16, 4096), (64, 4096), (128, 16384))],
    64: [(64, b, kv) for b, kv in ((1, 4096), (16, 4096), (64, 4096), (128, 1024))],
}
BLOCKS16_CANDIDATES = {
    ("fp8", 32): [(16, 32, 4, 2, True, 2, True, 64, 64, True), (16, 32, 4, 2, True, 2, True, 128, 64, True)],
    ("fp8", 64): [(16, 32, 4, 2, True, 2, True, 64, 64, True)],
}
BLOCKS16_SPARSE_SHAPES = {32: [(32, b, 32768, 2048) for b in (1, 4, 16, 64, 128)]}
BLOCKS16_SPARSE_CANDIDATES = {
    ("fp8", 32): [(16, 32, 4, 2, True, 2, True, 64, 0, True), (16, 32, 4, 2, True, 2, True, 128, 0, True)],
}

# Round 5b: the same at batch 1-16 for 64 and 128 heads (four / eight 16-row blocks against the 64-row
# tile): measured only; a win would go into launch.SMALL_BATCH_TILES.
BLOCKS16_SMALL_SHAPES = {bkt: [(bkt, b, kv) for b, kv in ((1, 4096), (1, 16384), (4, 16384), (16, 4096))]
                         for bkt in (64, 128)}
BLOCKS16_SMALL_CANDIDATES = {
    ("16bit", 64): [(16, 32, 4, 2, True, 3, False, 64)],
    ("16bit", 128): [(16, 32, 4, 2, True, 3, False, 64)],
    ("fp8", 64): [(16, 32, 4, 2, True, 2, True, 64, 64, True)],
    ("fp8", 128): [(16, 32, 4, 2, True, 2, True, 64, 64, True)],
}

# Round 6: a 32-row BF16 tile (the FP8 32-row tile's shape, no cast) against two 16-row blocks for 32 heads.
ROWS32_SHAPES = {32: [(32, b, kv) for b, kv in ((1, 4096), (4, 16384), (16, 4096), (64, 4096), (128, 4096))]}
ROWS32_CANDIDATES = {("16bit", 32): [(32, 32, 4, 2, True, 2, False, 64, 64), (32, 32, 4, 2, True, 2, False, 64)]}
ROWS32_SPARSE_SHAPES = {32: [(32, b, 32768, 2048) for b in (4, 16, 64, 128)]}
ROWS32_SPARSE_CANDIDATES = {("16bit", 32): [(32, 32, 4, 2, True, 2, False, 64), (32, 32, 4, 3, True, 2, False, 64, 64)]}

# Round 7: the FP8 V reload cast to fp16 by an opaque inline-asm cvt (`opaque_v_cast`), so V reaches the
# MMA through ldmatrix.trans on fp16 instead of byte loads of the FP8 tile (offline sm_90 compile of the
# 16-row tile: 255 registers with 48 B spilled -> 168, no spills; 128 ld.shared.b8 -> 16 ldmatrix.x4.trans).
VCAST_SHAPES = {b: [(b, n, kv) for n, kv in
                    ((1, 4096), (4, 16384), (16, 4096), (64, 4096), (128, 16384))] for b in (16, 32)}
VCAST_CANDIDATES = {("fp8", 16): [(16, 32, 4, 2, True, 2, True, 64, 64, True, 0, False, True),
                                  (16, 32, 4, 3, True, 2, True, 64, 64, True, 0, False, True)],
                    ("fp8", 32): [(32, 32, 4, 2, True, 2, True, 32, 64, True, 0, False, True),
                                  (32, 32, 4, 2, True, 1, True, 32, 64, True, 0, False, True)]}
VCAST_SPARSE_SHAPES = {b: [(h, n, 32768, 2048) for h in ((16,) if b == 16 else (32,)) for n in (4, 16, 64, 128)]
                       for b in (16, 32)}
VCAST_SPARSE_CANDIDATES = {("fp8", 16): [(16, 32, 4, 2, True, 2, True, 64, 0, True, 0, False, True),
                                         (16, 32, 4, 2, True, 2, True, 64, 64, True, 0, False, True)],
                           ("fp8", 32): [(32, 32, 4, 2, True, 2, True, 32, 0, True, 0, False, True),
                                         (32, 32, 4, 2, True, 2, True, 32, 64, True, 0, False, True)]}

# After call 26 (the shipped 32-row FP8 tiles now carry fp16_math + opaque_v_cast): what each flag gave (fp16 math
# alone against both), and the 16-row small-batch tiles against the new 32-row tiles at batch 1-16.
VCAST_SPLIT_SHAPES = {32: VCAST_SHAPES[32]}
VCAST_SPLIT_CANDIDATES = {("fp8", 32): [(32, 32, 4, 2, True, 2, True, 32, 64, True)]}
VCAST_SPLIT_SPARSE_SHAPES = {32: VCAST_SPARSE_SHAPES[32]}
VCAST_SPLIT_SPARSE_CANDIDATES = {("fp8", 32): [(32, 32, 4, 2, True, 2, True, 32, 0, True)]}
VCAST_SMALL_SHAPES = {32: [(32, b, kv) for b, kv in ((1, 1024), (1, 4096), (4, 4096), (4, 16384), (16, 4096))]}
VCAST_SMALL_CANDIDATES = {("fp8", 32): [(16, 32, 4, 2, True, 2, True, 64, 64, True)]}
VCAST_SMALL_SPARSE_SHAPES = {32: [(32, b, 32768, 2048) for b in (1, 4, 16)]}
VCAST_SMALL_SPARSE_CANDIDATES = {("fp8", 32): [(16, 32, 4, 2, True, 2, True, 64, 0, True)]}


def hoist_compare(args, bw, mm, candidates=None, shapes=None, table="TILE_TABLE"):
    """Shipped tile (of launch.py's `table`) vs candidates per bucket; returns {(kind, bucket): winner tile}.

    A candidate replaces the shipped tile when its geometric-mean time ratio over the
    bucket's shapes is below 0.97 and no shape of the bucket gets more than 10% slower.
    """
    from mla_tune.backends.triton_mla import launch as launch_module
    shipped = getattr(launch_module, table)
    candidates, shapes = candidates or HOIST_CANDIDATES, shapes or HOIST_SHAPES
    winners = {}
    for (kind, bkt), cands in candidates.items():
        tiles = [shipped[(kind, bkt)]] + cands
        times = {t: [] for t in tiles}
        for heads, batch, kv_len, *topk in shapes[bkt]:
            if time.time() - T0 > args.budget_s:
                log("# hoist budget reached")
                return winners
            kv_dtype = "fp8_e4m3" if kind == "fp8" else "bf16"
            case = Case(Problem(heads, kv_dtype, page_size=64, topk=topk[0] if topk else None), Shape(batch, kv_len))
            roof = case.roofline_us(bw, mm)
            for i, tile in enumerate(tiles):
                params = params_for(tile, case)
                r = check_and_time(case, (TritonMLASparse if topk else TritonMLA)(params))
                log("hoist " + fmt_line(case, params.label(), r, roof, ("old " if i == 0 else "new ") + str(tile)))
                times[tile].append(r["us"] if r["status"] == "ok" else None)
            case.free()
        base = times[tiles[0]]
        best, best_gm = tiles[0], 0.97
        for tile in cands:
            pairs = [(t, b) for t, b in zip(times[tile], base) if b]
            if not pairs or any(t is None for t, _ in pairs) or len(pairs) < len(base):
                continue
            ratios = [t / b for t, b in pairs]
            gm = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
            log(f"# hoist {kind} {bkt}: {tile} time ratio vs shipped {gm:.3f} (max {max(ratios):.3f})")
            if gm < best_gm and max(ratios) < 1.10:
                best, best_gm = tile, gm
        winners[(kind, bkt)] = best
        log(f"# hoist winner {kind} {bkt}: {best}")
    return winners


def apply_tiles(winners, path="backends/triton_mla/launch.py", table="TILE_TABLE"):
    """Rewrite `table`'s entries in launch.py in place with the winners (the device copy)."""
    import re
    text = open(path).read()
    head, _, rest = text.partition("\n" + table + " = {")
    body, end, tail = rest.partition("\n}")
    for (kind, bkt), tile in winners.items():
        pattern = re.compile(r'^(\s*\("' + kind + r'", ' + str(bkt) + r'\): )\([^)]*\)', re.M)
        body, n = pattern.subn(lambda m, tile=tile: m.group(1) + repr(tuple(tile)), body)
        assert n == 1, (kind, bkt)
    open(path, "w").write(head + "\n" + table + " = {" + body + end + tail)
    log(f"# applied to {path}: {winners}")


def fmt_line(case, name, r, roof, tag=""):
    if r["status"] != "ok":
        return f"{case.label()} {name:22s} {r['status']:9s} {r.get('err', r.get('why', ''))} {tag}"
    return (f"{case.label()} {name:22s} {r['us']:9.1f} us [{r['lo']:.1f}-{r['hi']:.1f}] "
            f"roof {roof:8.1f} ({100 * roof / r['us']:5.1f}%) err {r['err']:.1e}{r.get('info', '')} {tag}")


def grid(args, bw, mm, table=None):
    """The issue-4 grid: heads x batch x kv_len, both dtypes, Triton vs FlashInfer.

    `table` maps (dtype, rows bucket) to the sweep's tile config; splits always
    come from the heuristic. Without a table the shipped default is used.
    """
    heads_list = [int(x) for x in args.heads.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    lens = [int(x) for x in args.kv_lens.split(",")]
    rows, summary = [], []
    order = sorted(itertools.product(lens, batches, heads_list, args.dtypes.split(",")),
                   key=lambda t: ({4096: 0, 16384: 1, 1024: 2}.get(t[0], 3), {64: 0, 16: 1, 128: 2, 4: 3}.get(t[1], 4)))
    for kv_len, batch, heads, kv_dtype in order:
        if time.time() - T0 > args.grid_budget_s:
            log("# grid budget reached")
            break
        if True:
            adapters = {"triton": TritonMLA()}
            if table and (kv_kind(kv_dtype), bucket(heads)) in table:
                tile = table[(kv_kind(kv_dtype), bucket(heads))]
                adapters["triton"] = ("tile", tile)
            if args.flashinfer:
                from mla_tune.backends.flashinfer_mla import FlashInferFA2, FlashInferFA3
                adapters["fa3"] = FlashInferFA3()
                if kv_dtype == "fp8_e4m3" or args.fa2_bf16:
                    adapters["fa2"] = FlashInferFA2()
            case = Case(Problem(heads, kv_dtype, page_size=64), Shape(batch, kv_len))
            if isinstance(adapters["triton"], tuple):
                adapters["triton"] = TritonMLA(params_for(adapters["triton"][1], case))
            roof = case.roofline_us(bw, mm)
            res = {name: check_and_time(case, a) for name, a in adapters.items()}
            for name, r in res.items():
                label = name if name != "triton" or r.get("params") is None else f"triton {r['params'].label()}"
                line = fmt_line(case, label, r, roof)
                log(line)
                rows.append(line)
            summary.append((kv_dtype, heads, batch, kv_len, roof, {n: r.get("us") for n, r in res.items()}))
            case.free()
    rows += summarize(summary)
    return rows


def sparse_bench(args, bw, mm):
    adapters = {"triton": TritonMLASparse()}
    if args.flashinfer:
        from mla_tune.backends.flashinfer_mla import FlashInferFA2Sparse, FlashInferFA3Sparse
        adapters.update(fa2=FlashInferFA2Sparse(), fa3=FlashInferFA3Sparse())
    rows = []
    for kv_dtype in args.dtypes.split(","):
        for heads, batch in itertools.product((16, 64, 128, 32), (64, 4)):
            if time.time() - T0 > args.sparse_budget_s:
                log("# sparse budget reached")
                return rows
            case = Case(Problem(heads, kv_dtype, page_size=64, topk=2048), Shape(batch, 8192))
            roof = case.roofline_us(bw, mm)
            for name, a in adapters.items():
                r = check_and_time(case, a)
                label = name if r.get("params") is None else f"triton {r['params'].label()}"
                line = fmt_line(case, label, r, roof)
                log(line)
                rows.append(line)
            case.free()
    return rows


def summarize(summary):
    out = ["", "summary (geometric means of time ratios; >1 means Triton is faster)"]
    for kv_dtype in sorted({s[0] for s in summary}):
        sel = [s for s in summary if s[0] == kv_dtype and s[5].get("triton")]
        if not sel:
            continue
        def gm(xs):
            xs = [x for x in xs if x]
            return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")
        roof_frac = gm([s[4] / s[5]["triton"] for s in sel])
        out.append(f"{kv_dtype}: triton at {100 * roof_frac:.1f}% of roofline (geomean over {len(sel)} shapes)")
        big = [s for s in sel if s[2] >= 64 and s[3] >= 4096 and s[1] <= 64]
        if big:
            out.append(f"{kv_dtype}: roofline fraction at batch>=64, kv>=4096, heads<=64: "
                       + ", ".join(f"h{s[1]}b{s[2]}kv{s[3]} {100 * s[4] / s[5]['triton']:.0f}%" for s in big))
        if all(s[5].get("fa3") for s in sel):
            out.append(f"{kv_dtype}: FA3 / triton = {gm([s[5]['fa3'] / s[5]['triton'] for s in sel]):.2f}")
            best = [min(s[5].get("fa2") or 1e30, s[5]["fa3"] or 1e30) / s[5]["triton"] for s in sel]
            out.append(f"{kv_dtype}: min(FA2, FA3) / triton = {gm(best):.2f}")
            b2 = [min(s[5].get("fa2") or 1e30, s[5]["fa3"]) / s[5]["triton"]
                  for s in sel if s[2] >= 64 and s[3] >= 4096]
            if b2:
                out.append(f"{kv_dtype}: min(FA2, FA3) / triton at batch>=64, kv>=4096 = {gm(b2):.2f}")
            losses = [s for s in sel if s[5]["triton"] > min(s[5].get("fa2") or 1e30, s[5]["fa3"])]
            out.append(f"{kv_dtype}: triton loses to FlashInfer on {len(losses)} of {len(sel)} shapes: "
                       + ", ".join(f"h{s[1]}b{s[2]}kv{s[3]}" for s in losses))
    for line in out:
        log(line)
    return out


# mode -> (candidates, shapes[, table name]) for `hoist_compare`
ROUNDS = {"hoist": (HOIST_CANDIDATES, HOIST_SHAPES), "splits": (SPLIT_CANDIDATES, SPLIT_SHAPES),
          "fp16": (FP16_CANDIDATES, FP16_SHAPES), "regs": (REGS_CANDIDATES, REGS_SHAPES),
          "scores": (SCORES_CANDIDATES, SCORES_SHAPES),
          "sparse_hoist": (SPARSE_CANDIDATES, SPARSE_SHAPES, "SPARSE_TILE_TABLE"),
          "small": (SMALL_CANDIDATES, SMALL_SHAPES), "small2": (SMALL2_CANDIDATES, SMALL2_SHAPES),
          "small_sparse": (SMALL_SPARSE_CANDIDATES, SMALL_SPARSE_SHAPES, "SPARSE_TILE_TABLE"),
          "blocks16": (BLOCKS16_CANDIDATES, BLOCKS16_SHAPES),
          "blocks16_small": (BLOCKS16_SMALL_CANDIDATES, BLOCKS16_SMALL_SHAPES),
          "rows32": (ROWS32_CANDIDATES, ROWS32_SHAPES),
          "rows32_sparse": (ROWS32_SPARSE_CANDIDATES, ROWS32_SPARSE_SHAPES, "SPARSE_TILE_TABLE"),
          "blocks16_sparse": (BLOCKS16_SPARSE_CANDIDATES, BLOCKS16_SPARSE_SHAPES, "SPARSE_TILE_TABLE"),
          "vcast": (VCAST_CANDIDATES, VCAST_SHAPES),
          "vcast_sparse": (VCAST_SPARSE_CANDIDATES, VCAST_SPARSE_SHAPES, "SPARSE_TILE_TABLE"),
          "vcast_split": (VCAST_SPLIT_CANDIDATES, VCAST_SPLIT_SHAPES),
          "vcast_split_sparse": (VCAST_SPLIT_SPARSE_CANDIDATES, VCAST_SPLIT_SPARSE_SHAPES, "SPARSE_TILE_TABLE"),
          "vcast_small": (VCAST_SMALL_CANDIDATES, VCAST_SMALL_SHAPES),
          "vcast_small_sparse": (VCAST_SMALL_SPARSE_CANDIDATES, VCAST_SMALL_SPARSE_SHAPES, "SPARSE_TILE_TABLE")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["sweep", "grid", "sparse", "all", "compare", "partials", *ROUNDS])
    ap.add_argument("--flashinfer", action="store_true")
    ap.add_argument("--dtypes", default="bf16,fp8_e4m3")
    ap.add_argument("--heads", default="16,32,64,128")
    ap.add_argument("--batches", default="1,4,16,64,128")
    ap.add_argument("--kv-lens", default="1024,4096,16384")
    ap.add_argument("--out", default=None)
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop the sweep after this many seconds")
    ap.add_argument("--grid-budget-s", type=float, default=1e9, help="stop the grid after this many seconds")
    ap.add_argument("--sparse-budget-s", type=float, default=1e9, help="stop the sparse runs after this")
    ap.add_argument("--fa2-bf16", action="store_true", help="also time FA2 with bf16 KV")
    ap.add_argument("--sweep-heads", default="64,16,128,32")
    ap.add_argument("--apply", action="store_true", help="hoist/splits: write the winners into launch.py")
    ap.add_argument("--sweep-waves", action="store_true", help="also try 1 and 4 waves for each winner")
    args = ap.parse_args()
    name = torch.cuda.get_device_name(0)
    import triton
    bw, mm = measure_machine()
    head = [f"# {name}, torch {torch.__version__}, triton {triton.__version__}, "
            f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 mm {mm / 1e12:.0f} TFLOP/s, "
            f"command: python bench/triton_dev.py {' '.join(sys.argv[1:])}"]
    global RESULT_FILE
    RESULT_FILE = args.out
    log(head[0])
    table = None
    if args.mode == "compare":
        compare(args, bw, mm)
    if args.mode == "partials":
        value = partials_compare(args, bw, mm)
        if args.apply:
            apply_partial_cost(value)
    if args.mode in ROUNDS:
        winners = hoist_compare(args, bw, mm, *ROUNDS[args.mode])
        if args.apply:
            apply_tiles(winners, table=(ROUNDS[args.mode] + ("TILE_TABLE",))[2])
    if args.mode in ("sweep", "all"):
        table = sweep(args, bw, mm)
    if args.mode in ("grid", "all"):
        grid(args, bw, mm, table)
    if args.mode in ("sparse", "all"):
        sparse_bench(args, bw, mm)
    log(f"# done in {time.time() - T0:.0f} s")


if __name__ == "__main__":
    main()
