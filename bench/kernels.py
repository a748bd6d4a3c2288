"""Kernel benchmark: every runnable MLA decode backend side by side on one GPU.

For each shape of the grid, one set of random inputs (permuted pages; every
request kv_len tokens long unless --ragged, like REFERENCE.md section 5) is
built once; each eligible backend is prepared on it (plan/JIT untimed),
checked against the float32 reference, then all backends are timed together
by `mla_tune.tuner.timing` (CUDA graphs over L2-rotated input copies, replays
interleaved, medians with 95 % order-statistic CIs). "bw" is the time the KV
bytes take at the copy bandwidth over the measured time; "frac" is the
roofline's, max(KV bytes / copy bandwidth, FLOPs / matmul rate), with the
matmul rate of the backend's operands: e4m3 where it rounds the query to
e4m3, bf16 otherwise. Bandwidth and rates are measured in the same run.

Correctness is checked on the first --check-requests requests of each batch
(the float32 reference is a per-request loop); the table says how many. A
backend that rounds the query to e4m3 with an FP8 cache (FlashMLA) is held to
the gate's FP8-query threshold and its rows say "ok (q in e4m3)".

Examples:
    python3 bench/kernels.py --quick
    python3 bench/kernels.py --reference-shapes
    python3 bench/kernels.py --kv-dtype bf16 --heads 16,128 --backends FLASHINFER_FA3_MLA,MLA_TUNE_TRITON
    python3 bench/kernels.py --sparse-only --kv-len 8192,32768
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import platform
import sys
import time
from pathlib import Path

HEADS = (16, 32, 64, 128)
BATCHES = (1, 4, 16, 64, 128)
KV_LENS = (1024, 4096, 16384, 32768)
SPARSE_KV_LENS = (8192, 32768)
KV_DTYPES = ("bf16", "fp8_e4m3")
TOPK = 2048
# REFERENCE.md section 5 rows (kv dtype, heads, batch, kv_len), measured there on an H200.
REFERENCE_SHAPES = [(kv, h, b, n) for kv in KV_DTYPES for h, b, n in
                    ((16, 1, 1024), (16, 64, 4096), (16, 128, 16384), (64, 64, 4096),
                     (128, 64, 4096), (128, 128, 16384))]
QUICK = [("bf16", 16, 4, 4096, None), ("fp8_e4m3", 64, 16, 4096, None),
         ("bf16", 128, 64, 4096, None), ("bf16", 16, 16, 8192, TOPK),
         ("fp8_e4m3", 128, 4, 8192, TOPK)]


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="five mixed shapes (a smoke test, ~1 minute)")
    p.add_argument("--reference-shapes", action="store_true",
                   help="only the 12 dense shapes of REFERENCE.md section 5")
    p.add_argument("--heads", type=_ints, default=HEADS, help="comma list (default 16,32,64,128)")
    p.add_argument("--batch", type=_ints, default=BATCHES, help="comma list (default 1,4,16,64,128)")
    p.add_argument("--kv-len", type=_ints, default=None,
                   help="comma list (default 1024,4096,16384,32768 dense; 8192,32768 sparse)")
    p.add_argument("--kv-dtype", default="bf16,fp8_e4m3", help="comma list of bf16, fp16, fp8_e4m3")
    p.add_argument("--backends", default=None, help="comma list of backend names (default: all runnable)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--dense-only", action="store_true")
    group.add_argument("--sparse-only", action="store_true")
    p.add_argument("--topk", type=int, default=TOPK, help="sparse top-k (default 2048)")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--ragged", action="store_true", help="ragged lengths up to kv_len instead of uniform")
    p.add_argument("--max-seconds", type=float, default=0.6, help="timing cap per shape (all backends)")
    p.add_argument("--rel-ci", type=float, default=0.01, help="target CI half-width / median")
    p.add_argument("--check-requests", type=int, default=8, help="requests checked against the reference")
    p.add_argument("--time-budget-s", type=float, default=None, help="stop starting new shapes after this")
    p.add_argument("--out", default=None, help="result file (default bench/results/kernels-<gpu>-<date>.txt)")
    return p.parse_args(argv)


def grid(args) -> list[tuple]:
    """(kv dtype, heads, batch, kv_len, topk) tuples, in run order."""
    if args.quick:
        return QUICK
    if args.reference_shapes:
        return [(kv, h, b, n, None) for kv, h, b, n in REFERENCE_SHAPES]
    kvs = [k.strip() for k in args.kv_dtype.split(",") if k.strip()]
    shapes = []
    if not args.sparse_only:
        lens = args.kv_len or KV_LENS
        shapes += [(kv, h, b, n, None) for kv, h, b, n in itertools.product(kvs, args.heads, args.batch, lens)]
    if not args.dense_only:
        lens = args.kv_len or SPARSE_KV_LENS
        shapes += [(kv, h, b, n, args.topk) for kv, h, b, n in itertools.product(kvs, args.heads, args.batch, lens)]
    # REFERENCE.md's shapes first, so that a run cut short by --time-budget-s still has them.
    first = [(kv, h, b, n, None) for kv, h, b, n in REFERENCE_SHAPES]
    return [s for s in first if s in shapes] + [s for s in shapes if s not in first]


def environment() -> dict:
    """GPU (NVML name), driver and software versions for the result header."""
    import torch

    facts = {"gpu": torch.cuda.get_device_name(), "cc": ".".join(map(str, torch.cuda.get_device_capability())),
             "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        name = pynvml.nvmlDeviceGetName(handle)
        facts["gpu"] = name.decode() if isinstance(name, bytes) else name
        driver = pynvml.nvmlSystemGetDriverVersion()
        facts["driver"] = driver.decode() if isinstance(driver, bytes) else driver
    except Exception as exc:  # noqa: BLE001 - the header says what is missing
        facts["nvml"] = f"unavailable ({exc})"
    for module in ("triton", "flashinfer", "vllm"):
        try:
            facts[module] = __import__(module).__version__
        except Exception as exc:  # noqa: BLE001
            facts[module] = f"not importable ({type(exc).__name__})"
    return facts


def runnable_backends(args, device_spec) -> list[str]:
    from mla_tune.backends.registry import BACKENDS

    names = [n for n, info in BACKENDS.items() if info.adapter and n != "TORCH_REFERENCE"]
    if args.backends:
        wanted = [b.strip().upper() for b in args.backends.split(",")]
        unknown = sorted(set(wanted) - set(BACKENDS))
        if unknown:
            sys.exit(f"unknown backend(s): {', '.join(unknown)}")
        names = [n for n in names if n in wanted]
    return names


def subset(inputs, n: int):
    """The first n requests of `inputs` (the reference only needs those)."""
    from mla_tune.backends.interface import DecodeInputs

    idx = None if inputs.topk_indices is None else inputs.topk_indices[:n]
    return DecodeInputs(inputs.q[:n], inputs.kv_cache, inputs.block_table[:n], inputs.seq_lens[:n],
                        inputs.sm_scale, inputs.kv_scale, idx)


def _prepare_and_check(problem, inputs, names, args, env, base: dict, *, extra=()) -> tuple[list[dict], dict]:
    """Prepare every eligible backend on `inputs` and check it against the float32 reference on the first
    --check-requests requests: (rows of those that failed or were wrong, {label: (runner, row)} of the rest).
    `extra`: more (label, backend, make) to check the same way, `make()` giving a prepared runner of `backend`."""
    import torch

    from mla_tune.backends.interface import BackendUnavailable
    from mla_tune.backends.reference import mla_reference
    from mla_tune.backends.registry import backend_reasons, load_adapter
    from mla_tune.tuner.gate import check_output, quantizes_query

    n_check = min(inputs.q.shape[0], args.check_requests)
    sub = subset(inputs, n_check)
    ref_out, ref_lse = mla_reference(sub.q, sub.kv_cache, sub.block_table, sub.seq_lens,
                                     sm_scale=sub.sm_scale, kv_scale=sub.kv_scale,
                                     topk_indices=sub.topk_indices)
    eligible = [(name, name, lambda name=name: load_adapter(name)().prepare(problem, inputs))
                for name in names if not backend_reasons(name, problem, env["spec"])]
    rows, prepared = [], {}
    for label, backend, make in [*eligible, *extra]:
        try:
            runner = make()
            out, lse = runner.run(inputs)
            torch.cuda.synchronize()
        except BackendUnavailable as exc:
            rows.append({**base, "backend": label, "status": f"unavailable: {exc}"[:160]})
            continue
        except Exception as exc:  # noqa: BLE001 - a failure is data
            rows.append({**base, "backend": label, "status": f"failed: {type(exc).__name__}: {exc}"[:160]})
            continue
        fp8_query = quantizes_query(backend, problem.kv_cache_dtype)
        verdict = check_output(out[:n_check], None if lse is None else lse[:n_check], ref_out, ref_lse,
                               kv_cache_dtype=problem.kv_cache_dtype, fp8_query=fp8_query)
        row = {**base, "backend": label, "rel_err": verdict.rel_error, "fp8_query": fp8_query}
        if not verdict.ok:
            rows.append({**row, "status": f"incorrect: {verdict.reason}"})
            continue
        prepared[label] = (runner, row)
    return rows, prepared


def _time_prepared(prepared: dict, inputs, args, env) -> list[dict]:
    """Time every prepared backend together (tuner/timing.py) and add the roofline fraction; one row each."""
    import torch

    from mla_tune.backends.inputs import kv_bytes_read
    from mla_tune.backends.interface import adopt_rotation
    from mla_tune.tuner import timing

    free, _ = torch.cuda.mem_get_info()
    sets = timing.cold_l2_sets(inputs, free_bytes=int(free * 0.5))
    for runner, _ in prepared.values():
        adopt_rotation(runner, sets)  # adapters reading another cache layout convert each copy, untimed
    steps = {name: timing.capture_graph(lambda r=runner, sets=sets: [r.run(s) for s in sets],
                                        iterations_per_replay=len(sets))
             for name, (runner, _) in prepared.items()}
    timings = timing.time_interleaved(steps, rel_ci_target=args.rel_ci, max_seconds=args.max_seconds)
    heads = inputs.q.shape[2]
    kv_bytes = kv_bytes_read(inputs)
    flops = 2 * heads * (kv_bytes / inputs.kv_cache.shape[-1] / inputs.kv_cache.element_size()) * (576 + 512)
    bw_ms = kv_bytes / (env["copy_gbs"] * 1e9) * 1e3
    best = min(t.median_ms for t in timings.values())
    rows = []
    for name, (_, row) in prepared.items():
        t = timings[name]
        rate = env["e4m3_matmul_tflops"] if row.get("fp8_query") else env["matmul_tflops"]
        roof_ms = max(bw_ms, flops / (rate * 1e12) * 1e3)
        status = "ok (q in e4m3)" if row.get("fp8_query") else "ok"
        rows.append({**row, "status": status, "median_us": t.median_ms * 1e3,
                     "ci_us": (t.ci_low_ms * 1e3, t.ci_high_ms * 1e3), "samples": t.samples,
                     "bw": bw_ms / t.median_ms, "frac": roof_ms / t.median_ms, "vs_best": t.median_ms / best})
    return rows


def measure_ceilings(env: dict) -> None:
    """The roofline's measured ceilings into `env`: copy bandwidth, bf16 and e4m3 matmul rates."""
    from mla_tune.tuner import timing

    env["copy_gbs"] = timing.measure_copy_bandwidth_gbs()
    env["matmul_tflops"] = timing.measure_matmul_tflops()
    env["e4m3_matmul_tflops"] = timing.measure_matmul_tflops(e4m3=True)


CEILINGS = ("copy_gbs", "matmul_tflops", "e4m3_matmul_tflops")


def ceilings_line(env: dict) -> str:
    """The ceilings as a result file's comment line."""
    return (f"# copy bandwidth {env['copy_gbs']:.0f} GB/s (read+write), bf16 matmul {env['matmul_tflops']:.0f} "
            f"TFLOP/s, e4m3 matmul {env['e4m3_matmul_tflops']:.0f} TFLOP/s")


def run_shape(shape, names, args, env) -> list[dict]:
    """Prepare, check and time every eligible backend on one shape; one row per backend."""
    import torch

    from mla_tune.backends.inputs import make_inputs
    from mla_tune.backends.problem import Problem, Shape

    kv, heads, batch, kv_len, topk = shape
    problem = Problem(num_heads=heads, kv_cache_dtype=kv, page_size=args.page_size, topk=topk)
    inputs = make_inputs(problem, Shape(batch, kv_len), device="cuda", seed=heads * 1000 + batch,
                         ragged=args.ragged)
    n_check = min(batch, args.check_requests)
    base = dict(kv=kv, heads=heads, batch=batch, kv_len=kv_len, topk=topk or "-", checked=f"{n_check}/{batch}")
    rows, prepared = _prepare_and_check(problem, inputs, names, args, env, base)
    if prepared:
        rows += _time_prepared(prepared, inputs, args, env)
    del prepared
    torch.cuda.empty_cache()
    return rows


HEADER = (f"{'kv':<9}{'heads':>5}{'batch':>6}{'kv_len':>7}{'topk':>5}  {'backend':<26}{'median_us':>10}"
          f"{'ci95_us':>18}{'n':>4}{'x_best':>7}{'frac':>6}{'bw':>6}{'rel_err':>9}{'checked':>9}  status")


def format_row(r: dict) -> str:
    if r.get("median_us") is not None:
        lo, hi = r["ci_us"]
        timing = (f"{r['median_us']:>10.1f}{f'{lo:.1f}-{hi:.1f}':>18}{r['samples']:>4}"
                  f"{r['vs_best']:>7.2f}{r['frac']:>6.2f}{r['bw']:>6.2f}")
    else:
        timing = f"{'-':>10}{'-':>18}{'-':>4}{'-':>7}{'-':>6}{'-':>6}"
    err = f"{r['rel_err']:.1e}" if r.get("rel_err") is not None else "-"
    return (f"{r['kv']:<9}{r['heads']:>5}{r['batch']:>6}{r['kv_len']:>7}{str(r['topk']):>5}  {r['backend']:<26}"
            f"{timing}{err:>9}{r['checked']:>9}  {r['status']}")


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench/kernels.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    from mla_tune.backends.problem import DeviceSpec

    env = environment()
    env["spec"] = DeviceSpec(torch.cuda.get_device_name(), torch.cuda.get_device_capability())
    measure_ceilings(env)
    names = runnable_backends(args, env["spec"])
    slug = "".join(c if c.isalnum() else "-" for c in env["gpu"]).strip("-").lower()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M")
    out_path = Path(args.out or Path(__file__).parent / "results" / f"kernels-{slug}-{stamp}.txt")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    header = [f"# mla-tune kernel benchmark, {stamp} UTC",
              f"# command: python3 bench/kernels.py {' '.join(sys.argv[1:] if argv is None else argv)}",
              "# " + ", ".join(f"{k} {v}" for k, v in env.items() if k != "spec" and k not in CEILINGS),
              ceilings_line(env),
              f"# page_size {args.page_size}, q_len 1, {'ragged' if args.ragged else 'uniform'} lengths, "
              f"CUDA graphs over L2-rotated copies, rel-CI target {args.rel_ci}, cap {args.max_seconds}s/shape",
              f"# backends tried where eligible: {', '.join(names)}", HEADER]
    with open(out_path, "w") as fh:
        for line in header:
            print(line, flush=True)
            fh.write(line + "\n")
        t0 = time.perf_counter()
        for shape in grid(args):
            if args.time_budget_s and time.perf_counter() - t0 > args.time_budget_s:
                line = f"# stopped: --time-budget-s {args.time_budget_s} reached before shape {shape}"
                print(line, flush=True)
                fh.write(line + "\n")
                break
            try:
                rows = run_shape(shape, names, args, env)
            except torch.OutOfMemoryError as exc:
                torch.cuda.empty_cache()
                rows = []
                line = f"# shape {shape} skipped: out of memory ({str(exc).splitlines()[0]})"
                print(line, flush=True)
                fh.write(line + "\n")
            for r in rows:
                line = format_row(r)
                print(line, flush=True)
                fh.write(line + "\n")
            fh.flush()
    print(f"# wrote {out_path} ({os.path.getsize(out_path)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
