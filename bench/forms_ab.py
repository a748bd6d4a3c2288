"""Our kernel against itself with one dispatch switch changed, side by side in one process, vLLM's kernels beside.

Variant A launches with the dispatch as it is. Variant B launches with `dispatch.NAME` replaced by a Python literal
(--set NAME=LITERAL), also while its CUDA graphs are captured, so each graph keeps its own kernel. Both are checked
against the float32 reference, then timed together with the other --backends by `bench/kernels.py`'s timing
(`mla_tune.tuner.timing`: CUDA graphs over L2-rotated copies, interleaved replays). Shapes where the default tile
is not of --form are skipped.

    python3 bench/forms_ab.py --form qk1 --heads 64,128 \\
        --set "QK1_QUERY_REG_COLS={}"   # B: no query columns in registers
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels  # noqa: E402 - bench/kernels.py, beside this script

VARIANT = "MLA_TUNE_TRITON:B"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", dest="switch", required=True, help="NAME=LITERAL: the dispatch switch of variant B")
    p.add_argument("--form", default="qk1", help="only shapes whose default tile is of this kernel form")
    p.add_argument("--others", default="FLASHMLA,FLASH_ATTN_MLA", help="vLLM's kernels timed beside (dense names; "
                   "the sparse ones are added for sparse shapes)")
    args, rest = p.parse_known_args(argv)
    name, _, literal = args.switch.partition("=")
    args.switch_name, args.switch_value = name.strip(), ast.literal_eval(literal.strip())
    grid_args = kernels.parse_args(rest)
    for key, value in vars(args).items():
        setattr(grid_args, key, value)
    return grid_args


@contextlib.contextmanager
def switched(name: str, value):
    from mla_tune.backends.triton_mla import dispatch

    if not hasattr(dispatch, name):
        raise SystemExit(f"dispatch has no {name}")
    old = getattr(dispatch, name)
    setattr(dispatch, name, value)
    try:
        yield
    finally:
        setattr(dispatch, name, old)


class SwitchedRunner:
    """A prepared runner of our kernel that launches with the switch set."""

    def __init__(self, runner, name: str, value):
        self.runner, self.name, self.value = runner, name, value

    def run(self, inputs):
        with switched(self.name, self.value):
            return self.runner.run(inputs)

    def adopt(self, inputs):
        adopt = getattr(self.runner, "adopt", None)
        if adopt is not None:
            adopt(inputs)


def ours_of(shape) -> str:
    return "MLA_TUNE_TRITON_SPARSE" if shape[4] else "MLA_TUNE_TRITON"


def run_shape(shape, args, env) -> list[dict]:
    import torch

    from mla_tune.backends.inputs import make_inputs
    from mla_tune.backends.problem import Problem, Shape
    from mla_tune.backends.registry import load_adapter

    kv, heads, batch, kv_len, topk = shape
    problem = Problem(num_heads=heads, kv_cache_dtype=kv, page_size=args.page_size, topk=topk)
    ours = ours_of(shape)
    others = [n.strip() + ("_SPARSE" if topk else "") for n in args.others.split(",") if n.strip()]
    inputs = make_inputs(problem, Shape(batch, kv_len), device="cuda", seed=heads * 1000 + batch)
    base = dict(kv=kv, heads=heads, batch=batch, kv_len=kv_len, topk=topk or "-",
                checked=f"{min(batch, args.check_requests)}/{batch}")
    variant = (VARIANT, ours, lambda: SwitchedRunner(load_adapter(ours)().prepare(problem, inputs),
                                                     args.switch_name, args.switch_value))
    rows, prepared = kernels._prepare_and_check(problem, inputs, [ours, *others], args, env, base, extra=[variant])
    if ours not in prepared or prepared[ours][0].params.kernel_form != args.form:
        return []
    rows += kernels._time_prepared(prepared, inputs, args, env)
    torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from mla_tune.backends.problem import DeviceSpec
    from mla_tune.tuner import timing

    env = kernels.environment()
    env["spec"] = DeviceSpec(torch.cuda.get_device_name(), torch.cuda.get_device_capability())
    env["copy_gbs"] = timing.measure_copy_bandwidth_gbs()
    env["matmul_tflops"] = timing.measure_matmul_tflops()
    print(f"# forms_ab: variant B = {VARIANT} with dispatch.{args.switch_name} = {args.switch_value!r}")
    print("# command: python3 bench/forms_ab.py " + " ".join(repr(a) if " " in a else a for a in sys.argv[1:]))
    print("# " + ", ".join(f"{k} {v}" for k, v in env.items() if k not in ("spec", "copy_gbs", "matmul_tflops")))
    print(kernels.HEADER)
    logs = []
    for shape in kernels.grid(args):
        rows = run_shape(shape, args, env)
        for r in rows:
            print(kernels.format_row(r), flush=True)
        times = {r["backend"]: r["median_us"] for r in rows if r.get("median_us")}
        if VARIANT in times and ours_of(shape) in times:
            logs.append(math.log(times[ours_of(shape)] / times[VARIANT]))
            print(f"# {shape}: A / B = {math.exp(logs[-1]):.3f}", flush=True)
    if logs:
        print(f"# A / B over {len(logs)} shapes: geomean {math.exp(sum(logs) / len(logs)):.3f}, "
              f"range {math.exp(min(logs)):.3f}-{math.exp(max(logs)):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
