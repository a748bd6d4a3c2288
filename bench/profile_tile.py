"""Run one TRITON_MLA(_SPARSE) decode a few times, for a profiler (Nsight Compute) to capture.

    ncu -k regex:_mla_split_kernel -s 3 -c 1 --section WarpStateStats ... \\
        python3 bench/profile_tile.py --heads 64 --batch 64 --kv-len 4096 --kv-dtype bf16
"""

from __future__ import annotations

import argparse

import torch

from mla_tune.backends.inputs import make_inputs
from mla_tune.backends.problem import Problem, Shape
from mla_tune.backends.triton_mla.adapter import TritonMLA, TritonMLASparse


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--kv-len", type=int, default=4096)
    ap.add_argument("--kv-dtype", default="bf16")
    ap.add_argument("--topk", type=int, default=None)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    problem = Problem(args.heads, args.kv_dtype, page_size=64, topk=args.topk)
    inputs = make_inputs(problem, Shape(args.batch, args.kv_len), device="cuda", seed=1, ragged=False)
    prepared = (TritonMLASparse if args.topk else TritonMLA)().prepare(problem, inputs)
    for _ in range(args.runs):
        prepared.run(inputs)
    torch.cuda.synchronize()
    print("params", prepared.params.label())


if __name__ == "__main__":
    main()
