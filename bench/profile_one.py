"""One backend on one shape, launched a fixed number of times and nothing else: the target for Nsight Compute.

    ncu -k regex:KERNEL -s SKIP -c 1 --section SpeedOfLight ... python3 bench/profile_one.py BACKEND --heads 128 ...

The inputs are made and the backend prepared (plan, JIT) before the launches; no reference check, no timing, so
the profiler sees only this backend's kernels (the tuner's correctness gate is `bench/kernels.py`).
"""

from __future__ import annotations

import argparse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("backend")
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--kv-len", type=int, default=8192)
    parser.add_argument("--kv-dtype", default="fp8_e4m3")
    parser.add_argument("--topk", type=int, default=None, help="sparse top-k (default: dense)")
    parser.add_argument("--launches", type=int, default=5)
    parser.add_argument("--uniform", action="store_true", help="every request kv_len tokens (default: ragged)")
    parser.add_argument("--set", dest="switches", default="",
                        help="NAME=EXPR[; ...]: dispatch switches to launch with (as bench/forms_ab.py's --set)")
    args = parser.parse_args()

    import torch

    from mla_tune.backends.inputs import make_inputs
    from mla_tune.backends.problem import Problem, Shape
    from mla_tune.backends.registry import load_adapter

    problem = Problem(num_heads=args.heads, kv_cache_dtype=args.kv_dtype, page_size=64, topk=args.topk)
    inputs = make_inputs(problem, Shape(args.batch, args.kv_len), device="cuda", seed=0,
                         ragged=not args.uniform)
    from forms_ab import parse_switches, switched

    with switched(parse_switches(args.switches)):
        runner = load_adapter(args.backend)().prepare(problem, inputs)
        for _ in range(args.launches):
            runner.run(inputs)
        torch.cuda.synchronize()
    print(f"{args.backend}: {args.launches} launches of heads {args.heads} batch {args.batch} kv {args.kv_len} "
          f"{args.kv_dtype}" + (" uniform" if args.uniform else "") + (f" top-k {args.topk}" if args.topk else "")
          + (f" with {args.switches}" if args.switches else ""))


if __name__ == "__main__":
    main()
