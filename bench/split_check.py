"""Proof that splitting the kernel package changed nothing: the old package (loaded from a directory) against the new.

Three checks, each failing loudly (exit status 1, every mismatch listed):

  --ptx       (CPU, no GPU needed) offline sm_90a compiles of every Hopper form and every tl table tile, old and
              new, with the constexprs each package's dispatch gives them; the PTX must be identical once debug
              line information and the module path are stripped.
  --dispatch  (CPU) default launches, candidate tiles and Hopper constexprs compared over a grid of shapes (a
              dense launch without lengths, now sized per request on the device, by its tile and split count).
  (default)   (GPU) both packages' adapters on the same random inputs over a grid (dense BF16/FP8, sparse, heads
              16/32/64/128, several batch and KV shapes): the same launch parameters, bitwise-identical `out` and
              `lse`, and both timed side by side through tuner/timing.py.

The old package is read from `--old` (a copy of `backends/triton_mla` from before the split) and imported under
another name, its own imports rewritten to it.

Example:
    mkdir -p .old && git archive bench-archive backends | tar -x -C .old
    python3 bench/split_check.py --old .old/backends/triton_mla --ptx --dispatch
    python3 bench/split_check.py --old .old/backends/triton_mla --quick
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import itertools
import re
import sys
import tempfile
from pathlib import Path

OLD_NAME = "mla_tune_old_triton_mla"
NEW_NAME = "mla_tune.backends.triton_mla"
HEADS = (16, 32, 64, 128)
KV_DTYPES = ("bf16", "fp8_e4m3")
DENSE_SHAPES = ((1, 4096), (4, 16384), (16, 4096), (64, 4096), (128, 16384), (8, 1024))  # (batch, kv_len)
SPARSE_SHAPES = ((1, 8192), (4, 8192), (16, 8192), (64, 8192), (128, 32768))  # (batch, kv_len), top-k 2048
CPU_SHAPES = [("bf16", 16, 2, 200, None), ("fp8_e4m3", 5, 3, 150, None), ("bf16", 3, 2, 300, 64),
              ("fp8_e4m3", 20, 2, 100, 32)]
QUICK = [("bf16", 16, 4, 4096, None), ("fp8_e4m3", 64, 16, 4096, None), ("bf16", 128, 64, 4096, None),
         ("fp8_e4m3", 128, 8, 1024, None), ("bf16", 16, 16, 8192, 2048), ("fp8_e4m3", 128, 64, 8192, 2048)]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", required=True, type=Path, help="directory of the old backends/triton_mla package")
    p.add_argument("--ptx", action="store_true", help="compare offline sm_90a PTX (CPU)")
    p.add_argument("--dispatch", action="store_true", help="compare launch choices over a grid (CPU)")
    p.add_argument("--quick", action="store_true", help=f"GPU check on {len(QUICK)} shapes only")
    part = p.add_mutually_exclusive_group()
    part.add_argument("--dense-only", action="store_true", help="GPU check on the dense shapes only")
    part.add_argument("--sparse-only", action="store_true", help="GPU check on the sparse shapes only")
    p.add_argument("--ragged", action="store_true", help="ragged request lengths (GPU check)")
    p.add_argument("--max-seconds", type=float, default=0.4, help="timing cap per shape, both packages")
    p.add_argument("--no-timing", action="store_true", help="GPU check without timing")
    p.add_argument("--cpu", action="store_true",
                   help="the output check under the Triton interpreter (TRITON_INTERPRET=1) on small shapes, untimed")
    args = p.parse_args(argv)
    if args.cpu and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("--cpu needs TRITON_INTERPRET=1 in the environment (set before Triton is imported)")
    if not (args.old / "__init__.py").is_file():
        p.error(f"--old {args.old} has no __init__.py; extract the old package first (see the example)")
    return args


def load_old(directory: Path, name: str = OLD_NAME):
    """The package in `directory` imported as `name`, its `mla_tune.backends.triton_mla` imports rewritten."""
    root = Path(tempfile.mkdtemp(prefix="split_check_"))
    (root / name).mkdir()
    for path in sorted(directory.glob("*.py")):
        (root / name / path.name).write_text(path.read_text().replace(NEW_NAME, name))
    sys.path.insert(0, str(root))
    return importlib.import_module(name)


def modules(old_pkg) -> dict:
    """The modules of both packages each check needs, by role."""
    def old(mod):
        return importlib.import_module(f"{old_pkg.__name__}.{mod}")

    def new(mod):
        return importlib.import_module(f"{NEW_NAME}.{mod}")

    return {"old_launch": old("launch"), "old_adapter": old("adapter"), "new_config": new("config"),
            "new_dispatch": new("dispatch"), "new_splits": new("splits"), "new_adapter": new("adapter")}


def grid(quick: bool, *, dense: bool = True, sparse: bool = True) -> list[tuple]:
    """(kv dtype, heads, batch, kv_len, topk or None), in run order."""
    shapes = QUICK if quick else (
        [(kv, h, b, n, None) for kv, h, (b, n) in itertools.product(KV_DTYPES, HEADS, DENSE_SHAPES)]
        + [(kv, h, b, n, 2048) for kv, h, (b, n) in itertools.product(KV_DTYPES, HEADS, SPARSE_SHAPES)])
    return [s for s in shapes if (dense if s[4] is None else sparse)]


# ---------------------------------------------------------------------------------------------- dispatch (CPU)

def _old_constexprs(old_launch, params, **kw) -> dict:
    """The old package's Hopper constexprs under the new names (its measurement switches must be off)."""
    form = dict(old_launch.hopper_form(params, **kw))
    if form.pop("DEBUG") != 0:
        raise AssertionError("the old package has a debug mode set")
    form["QK1"] = form.pop("KSPLIT")
    return form


DISPATCH_GRID = ((1, 3, 16, 20, 32, 33, 64, 100, 128), (1, 2, 4), (1, 2, 4, 8, 16, 33, 64, 128),
                 (256, 1024, 2048, 4096, 32768), (False, True), (False, True), (None, 8, 9, 12), (132,))
QUICK_DISPATCH_GRID = ((16, 128), (1,), (1, 4, 64), (1024, 4096), (False, True), (False, True), (None, 9), (132,))


def _as_old(params) -> dict:
    """`params` as the old package states a launch: a per-request launch (no lengths on the host, sized on the
    device) compares as the old capacity launch of the same tile and split count (split_items 0)."""
    fields = {k: v for k, v in vars(params).items() if k != "split_per_request"}
    return {**fields, "split_items": 0} if params.split_per_request else fields


def check_dispatch(mods: dict, grid_axes: tuple = DISPATCH_GRID) -> list[str]:
    """Mismatches between the packages' default launches, candidates and Hopper constexprs over `grid_axes`
    (heads, q_len, batch, max_items, sparse, kv_fp8, cc_major, SMs)."""
    old_launch, dispatch, splits = mods["old_launch"], mods["new_dispatch"], mods["new_splits"]
    bad, n = [], 0
    for heads, q_len, batch, items, sparse, fp8, cc, sms in itertools.product(*grid_axes):
        facts = dict(num_heads=heads, q_len=q_len, batch=batch, max_items=items, sparse=sparse, kv_fp8=fp8,
                     cc_major=cc)
        lengths = [max(1, items - 37 * i) for i in range(batch)] if batch % 2 else None
        old = old_launch.default_params(**facts, num_sms=sms, lengths=lengths)
        new = splits.default_params(**facts, num_sms=sms, lengths=lengths)
        old_tiles = [dict(t._asdict()) for t in old_launch.candidate_tiles(**facts)]
        new_tiles = [t.as_dict() for t in dispatch.candidate_tiles(**facts)]
        n += 1
        if vars(old) != _as_old(new) or old_tiles != new_tiles:
            bad.append(f"dispatch {facts} sms {sms}: {old.label()} / {new.label()}, tiles differ: "
                       f"{old_tiles != new_tiles}")
        if new.warp_specialized:
            for n_splits, tiles, words in ((1, None, True), (4, 4, True), (2, 16, True), (1, 8, False)):
                kw = dict(kv_fp8=fp8, sparse=sparse, tiles=tiles, kv_words=words)
                # the new package reads the split count from the launch's params, the old took it as an argument
                form = dispatch.hopper_constexprs(dataclasses.replace(new, num_splits=n_splits), **kw)
                if form.pop("DS_MLA") or _old_constexprs(old_launch, old, splits=n_splits, **kw) != form:  # DS_MLA: new
                    bad.append(f"constexprs {facts} {kw}")
    print(f"dispatch: {n} shapes compared, {len(bad)} mismatches")
    return bad


# --------------------------------------------------------------------------------------------------- PTX (CPU)

_POINTERS = {"q_ptr": "*bf16", "block_table_ptr": "*i32", "seq_lens_ptr": "*i32", "topk_ptr": "*i32",
             "kv_scale_ptr": "*fp32", "o_ptr": "*fp32", "lse_ptr": "*fp32"}


def _compile(kernel, const: dict, *, fp8: bool, gluon: bool, options: dict, o_fp32: bool = False) -> str:
    """PTX for sm_90a of `kernel` with these constexprs (pointers 16-byte aligned, strides divisible by 16)."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    const = {**{p.name: p.default for p in kernel.params
                if p.is_constexpr and p.default is not inspect.Parameter.empty}, **const}
    pointers = {**_POINTERS, "kv_ptr": "*fp8e4nv" if fp8 else "*bf16", "o_ptr": "*fp32" if o_fp32 else "*bf16"}
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in const:
            signature[name] = "constexpr"
        elif name in pointers or name == "p_scratch_ptr":
            signature[name] = pointers.get(name, "*i16")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32" if name in ("sm_scale_log2", "kv_scale", "q_scale") else "i32"
            if name.startswith("stride") and name not in ("stride_qh", "stride_lh"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = (GluonASTSource if gluon else ASTSource)(kernel, signature, constexprs=const, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def normalized_ptx(ptx: str) -> str:
    """PTX without debug line information, debug sections, source paths or debug-only labels."""
    ptx = ptx.split("\t.section\t.debug", 1)[0]
    keep = []
    for line in ptx.splitlines():
        stripped = line.strip()
        debug_label = re.fullmatch(r"\$L__(tmp|func_begin|func_end)\d+:", stripped)
        if not stripped or debug_label or stripped.startswith((".loc", ".file", "//")):
            continue
        keep.append(line)
    return "\n".join(keep)


def _hopper_cases(dispatch, config) -> list[tuple]:
    """(label, new LaunchParams, constexpr kwargs) for every Hopper form, KV kind, dense/sparse and switch."""
    forms = {"token_split": dispatch.HOPPER_TOKEN_SPLIT_TILE, "narrow32": dispatch.HOPPER_TILES[32],
             "narrow16": dispatch.HOPPER_TILES[16], "qk1": dispatch.HOPPER_QK1_TILE}
    cases = []
    for (name, tile), fp8, sparse in itertools.product(forms.items(), (False, True), (False, True)):
        for q_len, splits, tiles in ((1, 1, None), (2, 4, 4)):
            params = config.LaunchParams(**tile.launch_fields(), num_splits=splits)
            cases.append((f"{name} {'fp8' if fp8 else 'bf16'} {'sparse' if sparse else 'dense'} q_len {q_len} "
                          f"splits {splits}", params, q_len, dict(kv_fp8=fp8, sparse=sparse, tiles=tiles)))
    return cases


def check_ptx(mods: dict, old_pkg) -> list[str]:
    """Mismatches between the old and new PTX of every Hopper form and tl table tile."""
    old_launch, dispatch, config = mods["old_launch"], mods["new_dispatch"], mods["new_config"]
    old_hopper = importlib.import_module(f"{old_pkg.__name__}.hopper")
    old_tl = importlib.import_module(f"{old_pkg.__name__}.kernel")
    new_hopper = importlib.import_module(f"{NEW_NAME}.hopper")
    new_tl = importlib.import_module(f"{NEW_NAME}.tl_kernel")
    bad, n = [], 0
    for label, params, q_len, kw in _hopper_cases(dispatch, config):
        base = dict(Q_LEN=q_len, PAGE_SIZE=64, BLOCK_N=params.block_n, SPARSE=kw["sparse"], KV_SCALE_IS_PTR=False)
        options = {"num_warps": params.num_warps, "maxnreg": config.HOPPER_MAXNREG}
        old_const = {**base, **old_launch.hopper_form(params, splits=params.num_splits, **kw)}
        new_const = {**base, **dispatch.hopper_constexprs(params, **kw)}
        same = dict(fp8=kw["kv_fp8"], gluon=True, options=options, o_fp32=params.num_splits > 1)
        old_ptx = _compile(old_hopper._mla_hopper_kernel, old_const, **same)
        new_ptx = _compile(new_hopper._mla_hopper_kernel, new_const, **same)
        n += 1
        _compare(bad, f"hopper {label}", old_ptx, new_ptx)
    for (kind, bucket), sparse in itertools.product(dispatch.TILE_TABLE, (False, True)):
        tile = (dispatch.SPARSE_TILE_TABLE if sparse else dispatch.TILE_TABLE)[(kind, bucket)]
        fp8 = kind == "fp8"
        const = dict(Q_LEN=1, PAGE_SIZE=64, D_LATENT=512, D_ROPE=64, BLOCK_H=tile.block_h, BLOCK_N=tile.block_n,
                     SPARSE=sparse, KV_CAST=fp8, KV_SCALE_IS_PTR=False, DOT_UPCAST=False, SPLIT_D=tile.split_d,
                     RELOAD_V=tile.reload_v, HOIST_PAGES=tile.hoist_pages, FP16_MATH=tile.fp16_math and fp8,
                     OPAQUE_V_CAST=tile.opaque_v_cast, SPLIT_SCORES=tile.split_scores)
        if not tile.split_scores:
            const["p_scratch_ptr"] = None
        options = {"num_warps": tile.num_warps, "num_stages": tile.num_stages}
        old_ptx = _compile(old_tl._mla_split_kernel, const, fp8=fp8, gluon=False, options=options)
        new_ptx = _compile(new_tl._mla_split_kernel, const, fp8=fp8, gluon=False, options=options)
        n += 1
        _compare(bad, f"tl {kind} rows {bucket} {'sparse' if sparse else 'dense'} {tile}", old_ptx, new_ptx)
    print(f"ptx: {n} compiles compared (old and new), {len(bad)} mismatches")
    return bad


def _compare(bad: list, label: str, old_ptx: str, new_ptx: str) -> None:
    old, new = normalized_ptx(old_ptx), normalized_ptx(new_ptx)
    if old == new:
        print(f"  same PTX ({len(new.splitlines())} lines): {label}", flush=True)
        return
    import difflib

    diff = list(difflib.unified_diff(old.splitlines(), new.splitlines(), "old", "new", n=0, lineterm=""))
    bad.append(f"PTX differs: {label} ({len(diff)} diff lines)\n    " + "\n    ".join(diff[:12]))
    print(bad[-1], flush=True)


# ------------------------------------------------------------------------------------------------- GPU check

def run_shape(shape: tuple, mods: dict, args) -> dict:
    """Both packages' adapters on one set of random inputs: launch labels, bitwise equality and (unless
    --no-timing) both medians from tuner/timing.py."""
    import torch

    from mla_tune.backends.inputs import make_inputs
    from mla_tune.backends.problem import Problem, Shape
    from mla_tune.tuner import timing

    kv, heads, batch, kv_len, topk = shape
    device = "cpu" if args.cpu else "cuda"
    problem = Problem(num_heads=heads, kv_cache_dtype=kv, page_size=16 if args.cpu else 64, topk=topk)
    inputs = make_inputs(problem, Shape(batch, kv_len), device=device, seed=heads * 1000 + batch, ragged=args.ragged)
    sparse = topk is not None
    runners = {}
    for name, module in (("old", mods["old_adapter"]), ("new", mods["new_adapter"])):
        adapter = module.TritonMLASparse() if sparse else module.TritonMLA()
        runners[name] = adapter.prepare(problem, inputs)
    outs = {name: [t.clone() for t in runner.run(inputs)] for name, runner in runners.items()}
    row = dict(kv=kv, heads=heads, batch=batch, kv_len=kv_len, topk=topk or "-",
               old_label=runners["old"].params.label(), new_label=runners["new"].params.label(),
               out_equal=torch.equal(outs["old"][0], outs["new"][0]),
               lse_equal=torch.equal(outs["old"][1], outs["new"][1]))
    if not (args.no_timing or args.cpu):
        free, _ = torch.cuda.mem_get_info()
        sets = timing.cold_l2_sets(inputs, free_bytes=int(free * 0.4))
        steps = {name: timing.capture_graph(lambda r=runner: [r.run(s) for s in sets], iterations_per_replay=len(sets))
                 for name, runner in runners.items()}
        timings = timing.time_interleaved(steps, rel_ci_target=0.01, max_seconds=args.max_seconds)
        row.update(old_us=timings["old"].median_ms * 1e3, new_us=timings["new"].median_ms * 1e3,
                   old_ci=timings["old"].rel_ci_half_width, new_ci=timings["new"].rel_ci_half_width)
        del sets, steps
    del runners, outs
    if not args.cpu:
        torch.cuda.empty_cache()
    return row


def format_row(r: dict) -> str:
    same = r["out_equal"] and r["lse_equal"] and r["old_label"] == r["new_label"]
    timing = (f"{r['old_us']:>9.1f}{r['new_us']:>9.1f}{r['new_us'] / r['old_us']:>8.3f}"
              f"{max(r['old_ci'], r['new_ci']) * 100:>7.2f}" if "old_us" in r else f"{'-':>9}{'-':>9}{'-':>8}{'-':>7}")
    return (f"{r['kv']:<9}{r['heads']:>5}{r['batch']:>6}{r['kv_len']:>7}{str(r['topk']):>5}  {r['new_label']:<22}"
            f"{timing}  {'identical' if same else 'MISMATCH'}"
            + ("" if same else f" (labels {r['old_label']} / {r['new_label']}, out {r['out_equal']}, "
                                 f"lse {r['lse_equal']})"))


def check_gpu(mods: dict, args, argv) -> list[str]:
    """The GPU check over the grid; prints the environment, the command and one line per shape."""
    import torch

    if not (args.cpu or torch.cuda.is_available()):
        sys.exit("the GPU check needs a CUDA GPU (torch.cuda.is_available() is False); --ptx, --dispatch and --cpu "
                 "run on CPU")
    from kernels import environment  # bench/kernels.py: NVML name, driver and versions

    if args.cpu:
        import triton

        env = {"device": "CPU (Triton interpreter)", "torch": torch.__version__, "triton": triton.__version__}
    else:
        env = environment()
    print("# split check: old package", args.old, "against", NEW_NAME)
    print("# command: python3 bench/split_check.py " + " ".join(sys.argv[1:] if argv is None else argv))
    print("# " + ", ".join(f"{k} {v}" for k, v in env.items()))
    print(f"# page_size {16 if args.cpu else 64}, q_len 1, {'ragged' if args.ragged else 'uniform'} lengths, CUDA graphs over L2-rotated "
          f"copies, cap {args.max_seconds}s/shape; ratio = new / old median, ci = the larger half-width in %")
    print(f"{'kv':<9}{'heads':>5}{'batch':>6}{'kv_len':>7}{'topk':>5}  {'launch':<22}{'old_us':>9}{'new_us':>9}"
          f"{'ratio':>8}{'ci%':>7}  outputs", flush=True)
    bad, ratios = [], []
    shapes = CPU_SHAPES if args.cpu else grid(args.quick, dense=not args.sparse_only, sparse=not args.dense_only)
    for shape in shapes:
        r = run_shape(shape, mods, args)
        print(format_row(r), flush=True)
        if not (r["out_equal"] and r["lse_equal"] and r["old_label"] == r["new_label"]):
            bad.append(f"GPU mismatch: {format_row(r)}")
        if "old_us" in r:
            ratios.append(r["new_us"] / r["old_us"])
    if ratios:
        import math

        geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
        print(f"# new / old time: geomean {geo:.4f}, min {min(ratios):.3f}, max {max(ratios):.3f} over {len(ratios)}")
    return bad


def main(argv=None) -> int:
    args = parse_args(argv)
    old_pkg = load_old(args.old)
    mods = modules(old_pkg)
    bad = []
    if args.dispatch:
        bad += check_dispatch(mods)
    if args.ptx:
        bad += check_ptx(mods, old_pkg)
    if not (args.dispatch or args.ptx):
        bad += check_gpu(mods, args, argv)
    if bad:
        print(f"\nFAILED: {len(bad)} mismatches", file=sys.stderr)
        for line in bad[:50]:
            print(line, file=sys.stderr)
        return 1
    print("all checks identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
