#!/usr/bin/env python3
"""vLLM's own MLA kernels beside mla-tune's Triton kernel, side by side in one process on one GPU.

For every shape of a small grid each eligible vLLM adapter (FLASHMLA, FLASH_ATTN_MLA, TRITON_MLA dense;
FLASHMLA_SPARSE, FLASH_ATTN_MLA_SPARSE, FLASHINFER_MLA_SPARSE_SM90 sparse) and our MLA_TUNE_TRITON(_SPARSE)
is prepared on the same random inputs (permuted pages, ragged lengths), checked against the float32
reference with the tuner's gate, and timed through tuner/timing.py exactly as the tuner times: CUDA
graphs over cold-L2 rotated input sets (converted layouts adopted untimed), interleaved replays,
medians. Prints the GPU (NVML), the software versions, one line per shape and a geomean per backend
of its time over ours.

Usage (GPU machine; vLLM's kernels from its unpacked wheel, see bench/vllm_site.py):
    python3 bench/vllm_site.py && PYTHONPATH=$PWD/.vsite:$PYTHONPATH python3 bench/vllm_adapters.py
    python3 bench/vllm_adapters.py --dry-run          # the plan only (no GPU needed)
"""

from __future__ import annotations

import argparse
import math
import sys
import time

DENSE = ["FLASHMLA", "FLASH_ATTN_MLA", "TRITON_MLA"]
SPARSE = ["FLASHMLA_SPARSE", "FLASH_ATTN_MLA_SPARSE", "FLASHINFER_MLA_SPARSE_SM90"]
OURS = {False: "MLA_TUNE_TRITON", True: "MLA_TUNE_TRITON_SPARSE"}


def grid(args) -> list[tuple]:
    """(problem, shape) pairs: dense at kv_len, sparse top-k of sparse_kv_len, each KV dtype."""
    from mla_tune.backends.problem import Problem, Shape

    cases = []
    for kv in args.kv_dtypes:
        for heads in args.heads:
            for batch in args.batches:
                cases.append((Problem(heads, kv_cache_dtype=kv), Shape(batch, args.kv_len)))
                if not args.dense_only:
                    cases.append((Problem(heads, kv_cache_dtype=kv, topk=args.topk), Shape(batch, args.sparse_kv_len)))
    return cases


def environment() -> list[str]:
    """GPU name (NVML), driver and versions of what runs, one line each."""
    import importlib.metadata as md

    import torch

    lines = []
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        name = pynvml.nvmlDeviceGetName(handle)
        lines.append(f"GPU (NVML): {name.decode() if isinstance(name, bytes) else name}, driver "
                     f"{pynvml.nvmlSystemGetDriverVersion()}")
    except Exception as exc:  # noqa: BLE001
        lines.append(f"GPU (NVML unavailable: {exc}): {torch.cuda.get_device_name()}")
    versions = [f"torch {torch.__version__} (CUDA {torch.version.cuda})"]
    for module in ("triton", "flashinfer", "vllm"):
        try:
            versions.append(f"{module} {__import__(module).__version__}")
        except Exception as exc:  # noqa: BLE001
            versions.append(f"{module} absent ({type(exc).__name__})")
    try:
        versions.append(f"mla-tune {md.version('mla-tune')}")
    except md.PackageNotFoundError:
        pass
    lines.append("versions: " + ", ".join(versions))
    try:
        from vllm.platforms import current_platform
        from vllm.triton_utils import HAS_TRITON

        lines.append(f"vLLM platform {type(current_platform).__name__}, vllm.triton_utils.HAS_TRITON={HAS_TRITON}")
    except Exception as exc:  # noqa: BLE001
        lines.append(f"vLLM platform: {type(exc).__name__}: {exc}")
    return lines


def run_shape(problem, shape, names, *, max_seconds: float) -> dict[str, str | float]:
    """name -> median microseconds, or the reason it was not timed."""
    import torch

    from mla_tune.backends.inputs import make_inputs
    from mla_tune.backends.interface import BackendUnavailable, adopt_rotation
    from mla_tune.backends.reference import TorchReference
    from mla_tune.backends.registry import backend_reasons, load_adapter
    from mla_tune.backends.problem import DeviceSpec
    from mla_tune.tuner import timing
    from mla_tune.tuner.gate import check_output, quantizes_query

    device = DeviceSpec(torch.cuda.get_device_name(), torch.cuda.get_device_capability())
    inputs = make_inputs(problem, shape, device="cuda", seed=shape.batch_size + problem.num_heads)
    ref_out, ref_lse = TorchReference().prepare(problem, inputs).run(inputs)
    free, _ = torch.cuda.mem_get_info()
    sets = timing.cold_l2_sets(inputs, free_bytes=int(free * 0.5))
    result: dict[str, str | float] = {}
    steps = {}
    for name in names:
        reasons = backend_reasons(name, problem, device)
        if reasons:
            result[name] = "ineligible: " + "; ".join(reasons)
            continue
        try:
            prepared = load_adapter(name)().prepare(problem, inputs)
            out, lse = prepared.run(inputs)
            torch.cuda.synchronize()
            verdict = check_output(out, lse, ref_out, ref_lse, kv_cache_dtype=problem.kv_cache_dtype,
                                   fp8_query=quantizes_query(name, problem.kv_cache_dtype))
            if not verdict.ok:
                result[name] = f"incorrect: {verdict.reason}"
                continue
            adopt_rotation(prepared, sets)
            steps[name] = timing.capture_graph(lambda p=prepared: [p.run(s) for s in sets],
                                               iterations_per_replay=len(sets))
            result[name] = f"rel_err {verdict.rel_error:.2g}"
        except BackendUnavailable as exc:
            result[name] = f"refused: {exc}"
        except Exception as exc:  # noqa: BLE001 - a failure is a result here
            result[name] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    timings = timing.time_interleaved(steps, max_seconds=max_seconds)
    for name, t in timings.items():
        result[name] = t.median_ms * 1e3
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 128])
    ap.add_argument("--kv-len", type=int, default=4096)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--sparse-kv-len", type=int, default=32768)
    ap.add_argument("--kv-dtypes", nargs="+", default=["bf16", "fp8_e4m3"])
    ap.add_argument("--dense-only", action="store_true")
    ap.add_argument("--max-seconds", type=float, default=1.0, help="timing cap per shape")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU)")
    args = ap.parse_args()
    cases = grid(args)
    if args.dry_run:
        for problem, shape in cases:
            names = (SPARSE if problem.sparse else DENSE) + [OURS[problem.sparse]]
            print(f"{problem.kv_cache_dtype} h{problem.num_heads} b{shape.batch_size} kv{shape.kv_len}"
                  f"{f' topk{problem.topk}' if problem.sparse else ''}: {', '.join(names)}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA GPU (torch.cuda.is_available() is False); --dry-run prints the plan", file=sys.stderr)
        return 2
    print("\n".join(environment()), flush=True)
    ratios: dict[str, list[float]] = {}
    started = time.perf_counter()
    for problem, shape in cases:
        names = (SPARSE if problem.sparse else DENSE) + [OURS[problem.sparse]]
        result = run_shape(problem, shape, names, max_seconds=args.max_seconds)
        ours = result.get(OURS[problem.sparse])
        cells = []
        for name in names:
            value = result.get(name)
            if isinstance(value, float):
                cell = f"{name} {value:.1f} us"
                if isinstance(ours, float) and name != OURS[problem.sparse]:
                    ratios.setdefault(f"{name} {problem.kv_cache_dtype}", []).append(value / ours)
                    cell += f" ({value / ours:.2f}x ours)"
            else:
                cell = f"{name} -- {value}"
            cells.append(cell)
        label = (f"{problem.kv_cache_dtype} h{problem.num_heads} b{shape.batch_size} kv{shape.kv_len}"
                 f"{f' topk{problem.topk}' if problem.sparse else ''}")
        print(f"{label}: " + " | ".join(cells), flush=True)
        torch.cuda.empty_cache()
    print(f"\ntime / MLA_TUNE_TRITON(_SPARSE) time, geomean (range) over shapes; {time.perf_counter() - started:.0f} s")
    for key, values in sorted(ratios.items()):
        geo = math.exp(sum(math.log(v) for v in values) / len(values))
        print(f"  {key}: {geo:.2f} ({min(values):.2f}-{max(values):.2f}) over {len(values)} shapes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
