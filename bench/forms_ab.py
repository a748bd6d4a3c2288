"""Our kernel against itself with dispatch switches changed, side by side in one process, vLLM's kernels beside.

Variant A launches with the dispatch as it is. Each --set is one more variant (B, C, ...) that is prepared and
launched with `dispatch.NAME` replaced by the value of a Python expression in dispatch's namespace (--set
"NAME=EXPR; NAME2=EXPR2" changes two), also while its CUDA graphs are captured, so each graph keeps its own kernel.
All are checked against the float32 reference, then timed together with the other --backends by `bench/kernels.py`'s
timing (`mla_tune.tuner.timing`: CUDA graphs over L2-rotated copies, interleaved replays). Shapes where the default
tile is not of --form are skipped. The table goes to stdout, and with --out to that file as well (no file without it).

    python3 bench/forms_ab.py --form qk1 --heads 64,128 \\
        --set "QK1_QUERY_REG_COLS={}"   # B: no query columns in registers
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels  # noqa: E402 - bench/kernels.py, beside this script

def variant_name(i: int, ours: str | None = None) -> str:
    """The i-th --set's backend column: MLA_TUNE_TRITON:B, :C, ... (or --ours's name)."""
    return f"{ours or 'MLA_TUNE_TRITON'}:{chr(ord('B') + i)}"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", dest="switches", action="append", required=True,
                   help="NAME=EXPR[; NAME=EXPR ...]: one variant's dispatch switches (repeat for more variants)")
    p.add_argument("--form", default="qk1", help="only shapes whose default tile is of this kernel form (any: all)")
    p.add_argument("--ours", default=None, help="the backend of variant A and the --set variants (default: "
                   "MLA_TUNE_TRITON, or MLA_TUNE_TRITON_SPARSE on sparse shapes)")
    p.add_argument("--uniform", action="store_true", help="every request kv_len tokens (default: ragged, as a tune)")
    p.add_argument("--others", default="FLASHMLA,FLASH_ATTN_MLA", help="vLLM's kernels timed beside (dense names; "
                   "the sparse ones are added for sparse shapes)")
    args, rest = p.parse_known_args(argv)
    args.variants = [parse_switches(text) for text in args.switches]
    grid_args = kernels.parse_args(rest)
    for key, value in vars(args).items():
        setattr(grid_args, key, value)
    return grid_args


def parse_switches(text: str) -> list[tuple[str, object]]:
    """"NAME=EXPR; NAME2=EXPR2" -> [(NAME, value), ...], each EXPR a Python expression evaluated in the dispatch
    module's namespace (so `MinBatch(dense=1, sparse=16)` and comprehensions work)."""
    from mla_tune.backends.triton_mla import dispatch

    switches = []
    for part in filter(str.strip, text.split(";")):
        name, _, expr = part.partition("=")
        # eval: the operator's own expression, run in their own process
        switches.append((name.strip(), eval(expr.strip(), vars(dispatch).copy())))  # noqa: S307
    return switches


@contextlib.contextmanager
def switched(switches: list[tuple[str, object]]):
    from mla_tune.backends.triton_mla import dispatch

    olds = []
    for name, _ in switches:
        if not hasattr(dispatch, name):
            raise SystemExit(f"dispatch has no {name}")
        olds.append((name, getattr(dispatch, name)))
    try:
        for name, value in switches:
            setattr(dispatch, name, value)
        yield
    finally:
        for name, old in reversed(olds):
            setattr(dispatch, name, old)


class SwitchedRunner:
    """A prepared runner of our kernel that launches with the switches set."""

    def __init__(self, runner, switches: list[tuple[str, object]]):
        self.runner, self.switches = runner, switches

    @classmethod
    def prepare(cls, backend: str, problem, inputs, switches: list[tuple[str, object]]) -> SwitchedRunner:
        """`backend` prepared with the switches set too (the tile is chosen at prepare time)."""
        from mla_tune.backends.registry import load_adapter

        with switched(switches):
            return cls(load_adapter(backend)().prepare(problem, inputs), switches)

    def run(self, inputs):
        with switched(self.switches):
            return self.runner.run(inputs)

    def adopt(self, inputs):
        adopt = getattr(self.runner, "adopt", None)
        if adopt is not None:
            adopt(inputs)


def ours_of(shape, args) -> str:
    return args.ours or ("MLA_TUNE_TRITON_SPARSE" if shape[4] else "MLA_TUNE_TRITON")


def run_shape(shape, args, env) -> list[dict]:
    import torch

    from mla_tune.backends.inputs import make_inputs
    from mla_tune.backends.problem import Problem, Shape

    kv, heads, batch, kv_len, topk = shape
    problem = Problem(num_heads=heads, kv_cache_dtype=kv, page_size=args.page_size, topk=topk)
    ours = ours_of(shape, args)
    others = [n.strip() + ("_SPARSE" if topk else "") for n in args.others.split(",") if n.strip()]
    inputs = make_inputs(problem, Shape(batch, kv_len), device="cuda", seed=heads * 1000 + batch,
                         ragged=not args.uniform)
    base = dict(kv=kv, heads=heads, batch=batch, kv_len=kv_len, topk=topk or "-",
                checked=f"{min(batch, args.check_requests)}/{batch}")
    variants = [(variant_name(i, args.ours), ours, lambda s=switches: SwitchedRunner.prepare(ours, problem, inputs, s))
                for i, switches in enumerate(args.variants)]
    rows, prepared = kernels._prepare_and_check(problem, inputs, [ours, *others], args, env, base, extra=variants)
    if ours not in prepared or args.form not in ("any", prepared[ours][0].params.kernel_form):
        return []
    rows += kernels._time_prepared(prepared, inputs, args, env)
    torch.cuda.empty_cache()
    return rows


class Lines:
    """What main prints, also written to `path` (--out) when one is given."""

    def __init__(self, path: str | None):
        self.file = open(path, "w") if path else None  # closed by close()

    def __call__(self, line: str) -> None:
        print(line, flush=True)
        if self.file:
            self.file.write(line + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file:
            self.file.close()


def main(argv=None) -> int:
    args = parse_args(argv)
    emit = Lines(args.out)
    try:
        return _run(args, emit)
    finally:
        emit.close()


def _run(args, emit: Lines) -> int:
    import torch

    from mla_tune.backends.problem import DeviceSpec

    env = kernels.environment()
    env["spec"] = DeviceSpec(torch.cuda.get_device_name(), torch.cuda.get_device_capability())
    kernels.measure_ceilings(env)
    for i, switches in enumerate(args.variants):
        emit(f"# forms_ab: variant {variant_name(i, args.ours)}: "
             + "; ".join(f"dispatch.{n} = {v!r}" for n, v in switches))
    emit("# command: python3 bench/forms_ab.py " + " ".join(repr(a) if " " in a else a for a in sys.argv[1:]))
    emit("# lengths: every request kv_len tokens (--uniform)" if args.uniform else
         "# lengths: ragged, up to kv_len (make_inputs' default; bench/kernels.py times uniform ones unless --ragged)")
    emit("# " + ", ".join(f"{k} {v}" for k, v in env.items() if k != "spec" and k not in kernels.CEILINGS))
    emit(kernels.ceilings_line(env))
    emit(kernels.HEADER)
    logs = {variant_name(i, args.ours): [] for i in range(len(args.variants))}
    for shape in kernels.grid(args):
        rows = run_shape(shape, args, env)
        for r in rows:
            emit(kernels.format_row(r))
        times = {r["backend"]: r["median_us"] for r in rows if r.get("median_us")}
        for name, log in logs.items():
            if name in times and ours_of(shape, args) in times:
                log.append(math.log(times[ours_of(shape, args)] / times[name]))
                emit(f"# {shape}: A / {name[-1]} = {math.exp(log[-1]):.3f}")
    for name, log in logs.items():
        if log:
            emit(f"# A / {name[-1]} over {len(log)} shapes: geomean {math.exp(sum(log) / len(log)):.3f}, "
                 f"range {math.exp(min(log)):.3f}-{math.exp(max(log)):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
