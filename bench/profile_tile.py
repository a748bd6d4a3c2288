"""Run one TRITON_MLA(_SPARSE) decode a few times, for a profiler (Nsight Compute) to capture, or (--kernel-times)
print the CUDA time of each kernel it launches (stage 1, the split combine) from the PyTorch profiler.

    ncu -k regex:_mla_split_kernel -s 3 -c 1 --section WarpStateStats ... \\
        python3 bench/profile_tile.py --heads 64 --batch 64 --kv-len 4096 --kv-dtype bf16
    python3 bench/profile_tile.py --heads 64 --batch 64 --kv-len 32768 --topk 2048 --kernel-times
    python3 bench/profile_tile.py --kv-dtype fp8_e4m3 --switches qk --kernel-times   (hopper_dev.py's SWITCHES)
    python3 bench/profile_tile.py --kv-dtype fp8_e4m3 --heads 32 --debug mma_only   (hopper.py's measurement modes)
    python3 bench/profile_tile.py --heads 128 --batch 4 --kv-len 32768 --topk 2048 --kernel-times --fa3
        (FlashInfer FA3's kernels too, on the same inputs)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from mla_tune.backends.inputs import make_inputs
from mla_tune.backends.problem import Problem, Shape
from mla_tune.backends.triton_mla.adapter import TritonMLA, TritonMLASparse

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hopper_dev import SWITCHES, switched  # noqa: E402

from mla_tune.backends.triton_mla.hopper import DEBUG_MODES  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--kv-len", type=int, default=4096)
    ap.add_argument("--kv-dtype", default="bf16")
    ap.add_argument("--topk", type=int, default=None)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--switches", default="dflt", choices=sorted(SWITCHES),
                    help="a named set of measurement switches of hopper.py / launch.py (bench/hopper_dev.py's "
                         "SWITCHES; 'dflt': none, the launch's own choices)")
    ap.add_argument("--debug", default=None, choices=sorted(DEBUG_MODES),
                    help="run the Hopper kernel in a measurement mode of hopper.py (its outputs mean nothing)")
    ap.add_argument("--kernel-times", action="store_true",
                    help="print each kernel's mean CUDA time over --runs runs (PyTorch profiler, warm L2)")
    ap.add_argument("--fa3", action="store_true", help="with --kernel-times: FlashInfer FA3's kernels too")
    args = ap.parse_args()
    problem = Problem(args.heads, args.kv_dtype, page_size=64, topk=args.topk)
    inputs = make_inputs(problem, Shape(args.batch, args.kv_len), device="cuda", seed=1, ragged=False)
    with switched({**SWITCHES[args.switches], **({"DEBUG_MODE": DEBUG_MODES[args.debug]} if args.debug else {})}):
        prepared = (TritonMLASparse if args.topk else TritonMLA)().prepare(problem, inputs)
        for _ in range(args.runs):
            prepared.run(inputs)
        torch.cuda.synchronize()
        print("params", prepared.params.label())
        if args.kernel_times:
            print_kernel_times(lambda: prepared.run(inputs), args.runs)
    if args.kernel_times and args.fa3:
        from mla_tune.backends.flashinfer_mla import FlashInferFA3, FlashInferFA3Sparse

        fa3 = (FlashInferFA3Sparse if args.topk else FlashInferFA3)().prepare(problem, inputs)
        print("FlashInfer FA3")
        print_kernel_times(lambda: fa3.run(inputs), args.runs)


def print_kernel_times(run, runs: int) -> None:
    """Each CUDA kernel `run` launches, with its mean time per run (us)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            run()
        torch.cuda.synchronize()
    for event in prof.key_averages():
        if event.device_type.name == "CUDA" and event.count:
            print(f"{event.key[:60]:60s} {event.count // runs} a run, {event.device_time_total / runs:8.1f} us a run")


if __name__ == "__main__":
    main()
