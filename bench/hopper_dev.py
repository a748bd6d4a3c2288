"""Warp-specialised Hopper kernel (`backends/triton_mla/hopper.py`) against the shipped `tl` tiles.

Same process, same inputs (uniform lengths, as in the official grid, unless --ragged), every output
checked against `mla_reference` before it is timed (CUDA graph over L2-rotated copies; a shape's kernels are
captured first and their replays interleaved, `triton_dev.time_steps`).
Each candidate (`candidate`) is a tile of the Hopper kernel (`HOPPER_TILE`, optionally with another minimum
split; the k-split or narrow form; or the dispatched tile with measurement switches), timed on BF16 or FP8
shapes; its splits come from the same split model as the shipped tiles (`params_from_tile` with the real
lengths). Prints one line per (shape, kernel) and, per
candidate, the geometric mean of its time over the tl tiles' and over the first candidate's of its KV kind,
with the best and worst shape.

    python3 bench/hopper_dev.py --out bench/results/hopper_ab_h100.txt
    python3 bench/hopper_dev.py --kv bf16 --heads 64 --candidates 16bit,16bit:m256 --fa3
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import triton_dev  # noqa: E402
from triton_dev import Case, fmt_line, log, measure_machine  # noqa: E402

from mla_tune.backends.problem import Problem, Shape  # noqa: E402
from mla_tune.backends.triton_mla.adapter import TritonMLA, TritonMLASparse  # noqa: E402
from mla_tune.backends.triton_mla import hopper, launch  # noqa: E402
from mla_tune.backends.triton_mla.hopper import DEBUG_MODES  # noqa: E402
from mla_tune.backends.triton_mla.launch import (  # noqa: E402
    HOPPER_KSPLIT_TILE, HOPPER_TILE, HOPPER_TILES, default_tile, packed_rows, params_for, params_from_tile,
    rows_bucket)

DENSE_SHAPES = [(1, 4096), (4, 16384), (16, 4096), (64, 4096), (128, 16384)]
SPARSE_SHAPES = [(4, 32768), (64, 32768), (128, 32768)]
SHAPE_SETS = {"default": (DENSE_SHAPES, SPARSE_SHAPES), "big": ([(64, 4096), (128, 16384)], [(128, 32768)]),
              # the dense shapes of the roofline median (batch >= 64, kv_len >= 4096) and the sparse ones at batch >= 64
              "median": ([(64, 4096), (64, 16384), (128, 4096), (128, 16384)], [(64, 32768), (128, 32768)]),
              "mid": ([(4, 16384), (16, 4096), (16, 16384)], [(16, 32768), (64, 32768)]),
              "small": ([(1, 4096), (1, 16384), (4, 4096), (4, 16384), (16, 4096)],
                        [(1, 32768), (4, 32768), (16, 32768)]),
              # a few requests of 2-6k tokens, where the split model gives programs of two to four tiles
              "few": ([(2, 4096), (3, 4096), (4, 2048), (4, 4096), (4, 6144), (6, 4096), (8, 3072)], []),
              # short requests, where `launch.HOPPER_MIN_ITEMS` / `HOPPER_SHORT_BATCH` keep the tl tiles
              "short": ([(1, 1024), (4, 1024), (16, 1024), (32, 1024), (16, 1536)], []),
              # 64-row programs at 128 heads, one split each from batch 64: 256 programs on 132 SMs at batch 128,
              # two full waves at 132 (and 128 / 132 programs of two splits at batch 64 / 66)
              "waves": ([], [(64, 32768), (66, 32768), (128, 32768), (132, 32768)])}


# Narrow-form candidates: the measurement switches of hopper.py each sets for its runs.
NARROW = {"narrow": {}, "narrow1": {"STAGED_LOADERS": 1}, "narrow2": {"STAGED_LOADERS": 2}}
# Candidates of the dispatched tile (`default_params` on this GPU) with measurement switches of hopper.py or launch.py.
SWITCHES = {"dflt": {}, "evl": {"PARTIAL_EVICT_LAST": True}, "noevl": {"PARTIAL_EVICT_LAST": False},
            **{f"cmb{n}": {"COMBINE_SPLITS_AT_ONCE": n} for n in (1, 8, 16, 32, 64)},
            "qk": {"QUERY_IN_CONSUMER": False}, "qc": {"QUERY_IN_CONSUMER": True},
            "pf0": {"L2_PREFETCH": False}, "pf1": {"L2_PREFETCH": True},
            "pf1qc": {"L2_PREFETCH": True, "QUERY_IN_CONSUMER": True},
            "cf0": {"CONSUMER_FENCE": False}, "cf0pf1": {"CONSUMER_FENCE": False, "L2_PREFETCH": True},
            "cf0qc": {"CONSUMER_FENCE": False, "QUERY_IN_CONSUMER": True},
            "cf1": {"CONSUMER_FENCE": True}, "cf1pf0": {"CONSUMER_FENCE": True, "L2_PREFETCH": False},
            "ahead": {"LOADER_AHEAD": True}, "aheadpf0": {"LOADER_AHEAD": True, "L2_PREFETCH": False},
            "ahead0": {"LOADER_AHEAD": False},
            **{f"qr{n}": {"QUERY_REG_COLS": n} for n in (0, 64, 128, 192)}}


DISPATCHED = "dispatched"  # a candidate's tile: whatever `launch.default_params` picks on this GPU


def candidate(spec: str):
    """'16bit', 'fp8', 'fp8:m256', 'fp8:ks' (or 'ks' + a key of `SWITCHES`: 'fp8:kspf1'), 'fp8:dm256' (the dispatched
    tile with splits of at least 256 tokens), a key of `SWITCHES`
    ('fp8:dflt', 'fp8:evl', 'fp8:cmb1', ...; with 'x' and n, the split model's splits for n programs an SM:
    'fp8:dfltx2') or of `NARROW` ('fp8:narrow', 'fp8:narrow1', ...), optionally with
    '@' and a measurement mode of hopper.py for its runs alone ('fp8:dflt@decoupled') -> (KV kind it is
    timed on, rows bucket -> Tile, DISPATCHED or None, measurement switches for its runs): `HOPPER_TILE` [with
    min_split_tokens 256], the 4-warp launch `HOPPER_KSPLIT_TILE` ('ks', 64 rows and up; 'ksm64': with min_split_tokens
    64), the tile `launch` dispatches on this GPU with the switches
    (`SWITCHES`), or the narrow form for 16 and 32 rows (None above) as `launch` dispatches it ('narrow'), with
    one staged FP8 loader ('narrow1') or two ('narrow2', one half tile each)."""
    kind, _, rest = spec.partition(":")
    if "@" in rest:  # a measurement mode of hopper.py for this candidate alone ('fp8:dflt@decoupled')
        rest, _, mode = rest.partition("@")
        ckind, tile_for, switches = candidate(f"{kind}:{rest}")
        return ckind, tile_for, {**switches, "DEBUG_MODE": DEBUG_MODES[mode]}
    if rest in SWITCHES:
        return kind, lambda bucket: DISPATCHED, SWITCHES[rest]
    if rest[-2:-1] == "x" and rest[:-2] in SWITCHES:  # the dispatched tile's splits for n programs an SM ('fp8:dfltx2')
        return kind, lambda bucket: f"{DISPATCHED}::{int(rest[-1])}", SWITCHES[rest[:-2]]
    if rest.startswith("dm"):  # the dispatched tile with another minimum split ('fp8:dm256')
        return kind, lambda bucket: f"{DISPATCHED}:{int(rest[2:])}", {}
    if rest in NARROW:
        return kind, lambda bucket: HOPPER_TILES.get(bucket) if bucket <= 32 else None, NARROW[rest]
    ks = rest.startswith("ks")  # the 4-warp launch ('ks' [+ a key of `SWITCHES`] [or + 'm' and a minimum split])
    if ks and rest[2:] in ("", *SWITCHES):
        return kind, lambda bucket: HOPPER_KSPLIT_TILE if bucket >= 64 else None, SWITCHES[rest[2:] or "dflt"]
    tile, rest = (HOPPER_KSPLIT_TILE, rest[2:]) if ks else (HOPPER_TILE, rest)
    if rest.startswith("m"):
        tile = tile._replace(min_split_tokens=int(rest[1:]))
    return kind, lambda bucket: tile if bucket >= 64 or not ks else None, {}


@contextlib.contextmanager
def switched(switches: dict):
    """The measurement `switches` (hopper.py's or, where hopper.py has no such name, launch.py's) set inside the block,
    restored after it."""
    modules = {name: hopper if hasattr(hopper, name) else launch for name in switches}
    saved = {name: getattr(modules[name], name) for name in switches}
    for name, value in switches.items():
        setattr(modules[name], name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(modules[name], name, value)


def checked_step(case, adapter, *, switches: dict) -> tuple[object, dict]:
    """(captured CUDA graph or None, result without times): `adapter` checked (`triton_dev.check`; not in a measurement
    mode of hopper.py, whose outputs mean nothing) and captured with the measurement `switches` set (`switched`), so
    its graph keeps the kernel they select when it is replayed beside the other candidates'."""
    with switched(switches):
        mode = switches.get("DEBUG_MODE")
        prepared, result = triton_dev.check(case, adapter, verify=not mode)
        if prepared is None:
            return None, result
        if mode:
            name = next(name for name, number in DEBUG_MODES.items() if number == mode)
            result = {**result, "info": f"{result['info']} debug {name}"}
        try:
            return triton_dev.capture(prepared.run, case.sets), result
        except Exception as exc:  # a failure is data
            return None, triton_dev.failed(exc)


def time_entries(case, entries) -> dict:
    """key -> result with times: every (key, adapter, switches) entry checked and captured (`checked_step`), then all
    timed together (`triton_dev.time_steps`). The graphs are gone when this returns, so none outlives its shape's
    inputs (`case.free()`)."""
    steps, results = {}, {}
    for key, adapter, switches in entries:
        graph, results[key] = checked_step(case, adapter, switches=switches)
        if graph is not None:
            steps[key] = graph
    for key, times in triton_dev.time_steps(steps).items():
        results[key] = triton_dev.with_times(results[key], times)
    torch.cuda.synchronize()
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", default="bf16,fp8_e4m3")
    ap.add_argument("--heads", default="16,32,64,128")
    ap.add_argument("--candidates", default="16bit,fp8")
    ap.add_argument("--dense-only", action="store_true")
    ap.add_argument("--sparse-only", action="store_true")
    ap.add_argument("--ragged", action="store_true")
    ap.add_argument("--q-len", type=int, default=1, help="query tokens per request (MTP; dense rows = q_len x heads)")
    ap.add_argument("--shapes", default="default", choices=sorted(SHAPE_SETS))
    ap.add_argument("--topk", default="2048", help="top-k of the sparse shapes, a comma list (one shape set each)")
    ap.add_argument("--fa3", action="store_true", help="also time FlashInfer FA3 (JIT on first use)")
    ap.add_argument("--debug", default=None, choices=sorted(DEBUG_MODES),
                    help="time the candidates in a measurement mode of hopper.py (no correctness check: "
                         "those modes compute nothing meaningful)")
    ap.add_argument("--budget-s", type=float, default=500.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    triton_dev.RESULT_FILE = args.out
    log(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {__import__('triton').__version__}")
    log(f"# {' '.join(sys.argv)}")
    bw, mm = measure_machine()
    log(f"# copy {bw / 1e12:.2f} TB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s")
    names = args.candidates.split(",")
    cands = [candidate(c) for c in names]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = []
    for kv in args.kv.split(","):
        for heads in (int(h) for h in args.heads.split(",")):
            dense, sparse = SHAPE_SETS[args.shapes]
            if not args.sparse_only:
                shapes += [(kv, heads, b, n, None) for b, n in dense]
            if not args.dense_only:
                shapes += [(kv, heads, b, n, int(k)) for k in args.topk.split(",") for b, n in sparse]
    ratios = {c: [] for c in range(len(cands))}
    t0 = time.time()
    for kv, heads, batch, kv_len, topk in shapes:
        if time.time() - t0 > args.budget_s:
            log("# budget reached")
            break
        kind = "fp8" if kv == "fp8_e4m3" else "16bit"
        case = Case(Problem(heads, kv, page_size=64, q_len=args.q_len, topk=topk), Shape(batch, kv_len),
                    ragged=args.ragged)
        rows = packed_rows(heads, args.q_len, sparse=bool(topk))
        roof = case.roofline_us(bw, mm)
        adapter_cls = TritonMLASparse if topk else TritonMLA
        def dispatched(cc_major, min_split=None, per_sm=None):
            shape = dict(num_heads=heads, q_len=args.q_len, batch=batch, max_items=case.max_items, sparse=bool(topk),
                         kv_fp8=kind == "fp8", cc_major=cc_major)
            tile = default_tile(**shape)
            tile = tile if min_split is None else tile._replace(min_split_tokens=min_split)
            return params_for(tile if per_sm is None else tile._replace(per_sm=per_sm), **shape, num_sms=sms,
                              lengths=case.lengths)

        # Every entry of the shape is checked and captured first, then all are timed together (`time_steps`:
        # replays interleaved); then one line each, in this order: the tl tiles as shipped before the Hopper kernel
        # (cc_major None: no warp-specialised dispatch), the candidates, FA3.
        entries = [("tl", adapter_cls(dispatched(None)), {})]
        for i, (ckind, tile_for, switches) in enumerate(cands):
            tile = tile_for(rows_bucket(rows))
            if ckind != kind or tile is None:
                continue
            if tile == DISPATCHED:
                params = dispatched(torch.cuda.get_device_capability()[0])
            elif isinstance(tile, str):  # the dispatched tile with another minimum split [and programs an SM]
                min_split, _, per_sm = tile.partition(":")[2].partition(":")
                params = dispatched(torch.cuda.get_device_capability()[0], int(min_split) if min_split else None,
                                    int(per_sm) if per_sm else None)
            else:
                params = params_from_tile(tile, rows=rows, q_len=args.q_len, batch=batch,
                                          max_items=case.max_items, num_sms=sms, sparse=bool(topk),
                                          lengths=case.lengths)
            if args.debug:
                switches = {**switches, "DEBUG_MODE": DEBUG_MODES[args.debug]}
            entries.append((i, adapter_cls(params), switches))
        if args.fa3:
            from mla_tune.backends.flashinfer_mla import FlashInferFA3, FlashInferFA3Sparse
            entries.append(("fa3", (FlashInferFA3Sparse if topk else FlashInferFA3)(), {}))
        results = time_entries(case, entries)
        base = results["tl"]
        log(fmt_line(case, "tl " + (base["params"].label() if base.get("params") else ""), base, roof))
        for key, _, _ in entries[1:]:
            r = results[key]
            if key == "fa3":
                log(fmt_line(case, "fa3", r, roof))
                continue
            tag = ""
            if r["status"] == "ok" and base["status"] == "ok":
                ratios[key].append((r["us"] / base["us"], case.label()))
                tag = f"x{r['us'] / base['us']:.3f}"
            label = r["params"].label() if r.get("params") else ""
            log(fmt_line(case, f"{names[key]} {label}", r, roof, tag))
        case.free()
        torch.cuda.empty_cache()
    firsts = {}  # KV kind -> index of its first candidate, the reference of the "vs first" line
    for i, (kind, *_) in enumerate(cands):
        firsts.setdefault(kind, i)
    for i, (kind, *_) in enumerate(cands):
        rs = ratios[i]
        first = dict((label, x) for x, label in ratios[firsts[kind]])
        vs_first = [(x / first[label], label) for x, label in rs if label in first]
        if vs_first and i != firsts[kind]:
            log(f"# {names[i]}: time / {names[firsts[kind]]} {ratio_summary(vs_first)}")
        if rs:
            log(f"# {names[i]}: time / tl tiles {ratio_summary(rs)}")


def ratio_summary(ratios: list) -> str:
    """'geomean G over N shapes, best B (shape), worst W (shape)' of (time ratio, shape label) pairs."""
    gm = math.exp(sum(math.log(x) for x, _ in ratios) / len(ratios))
    (best, best_label), (worst, worst_label) = min(ratios), max(ratios)
    return (f"geomean {gm:.3f} over {len(ratios)} shapes, best {best:.3f} ({best_label}), "
            f"worst {worst:.3f} ({worst_label})")


if __name__ == "__main__":
    main()
