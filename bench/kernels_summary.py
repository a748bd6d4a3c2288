"""Summarise `bench/kernels.py` result files against vLLM's Hopper kernels: one table per GPU.

For each kind of problem (dense or sparse, bf16 or FP8 cache) and each competitor that ran beside our kernel
(FlashMLA, FlashAttention-3's MLA path), it gives the competitor's time over ours on every shape both passed
the correctness gate: geometric mean, range, and the shapes where ours is slower. Issue goals: never slower,
geometric mean at least 1.15. Where the issue sets its bandwidth goals, batch >= 64 and kv_len >= 4096, it also
gives two fractions of each of our dense backends and of each competitor beside them: of the copy bandwidth
(kernels.py's "bw"; the goal at 16-64 heads: 0.90 FP8, 0.95 bf16) and of the roofline with the matmul rate of the
backend's own operands ("frac", e4m3 where it rounds the query; the goal at 128 heads). Files written before
kernels.py had its "bw" column give "-" there. With --ours naming several of our dense backends, "ours" is the
faster of them at each shape (those of them that ran it).

CPU only; reads the text files kernels.py writes.

Examples:
    python3 bench/kernels_summary.py bench/results/kernels-h100-dense.txt bench/results/kernels-h100-sparse.txt
    python3 bench/kernels_summary.py --ours MLA_TUNE_TRITON,MLA_TUNE_TRITON_FP8Q \
        bench/results/kernels-h200-dense-fp8-ragged.txt
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass

OURS = {False: ("MLA_TUNE_TRITON",), True: ("MLA_TUNE_TRITON_SPARSE",)}
COMPETITORS = {False: ("FLASHMLA", "FLASH_ATTN_MLA"), True: ("FLASHMLA_SPARSE", "FLASH_ATTN_MLA_SPARSE")}
GOAL_GEOMEAN = 1.15
BANDWIDTH_MIN_BATCH = 64
BANDWIDTH_MIN_KV_LEN = 4096


@dataclass(frozen=True)
class Row:
    """One timed, correct row of a kernels.py table."""

    kv: str
    heads: int
    batch: int
    kv_len: int
    sparse: bool
    backend: str
    median_us: float
    frac: float
    bw: float | None = None

    @property
    def shape(self) -> tuple:
        return self.kv, self.heads, self.batch, self.kv_len, self.sparse

    @property
    def kind(self) -> str:
        return f"{'sparse' if self.sparse else 'dense'} {'FP8' if self.kv.startswith('fp8') else self.kv}"


def parse_rows(lines) -> list[Row]:
    """The rows of kernels.py tables that were timed and passed the gate; comments and failures skipped. Columns are
    found by the table's header line."""
    rows, columns = [], None
    for line in lines:
        parts = line.split()
        if not parts or line.startswith("#"):
            continue
        if parts[0] == "kv":  # older files name the column "x best"
            columns = {name: i for i, name in enumerate(line.replace("x best", "x_best").split())}
            continue
        if columns is None or len(parts) <= columns["status"] or parts[columns["status"]] != "ok":
            continue
        get = lambda name: parts[columns[name]]  # noqa: E731
        rows.append(Row(get("kv"), int(get("heads")), int(get("batch")), int(get("kv_len")), get("topk") != "-",
                        get("backend"), float(get("median_us")), float(get("frac")),
                        float(get("bw")) if "bw" in columns else None))
    return rows


def ratios(rows: list[Row], ours_dense: tuple[str, ...] = OURS[False]) -> dict[tuple[str, str], dict[tuple, float]]:
    """{(kind, competitor): {shape: competitor time / our time}} over shapes where both are correct and timed; our
    time is the fastest of `ours_dense` (dense shapes) or of OURS[True] (sparse) that ran the shape."""
    by_shape = defaultdict(dict)
    for r in rows:
        by_shape[r.shape][r.backend] = r
    out = defaultdict(dict)
    for shape, backends in by_shape.items():
        ran = [backends[name] for name in (OURS[True] if shape[4] else ours_dense) if name in backends]
        if not ran:
            continue
        ours = min(ran, key=lambda r: r.median_us)
        for name in COMPETITORS[shape[4]]:
            if name in backends:
                out[(ours.kind, name)][shape] = backends[name].median_us / ours.median_us
    return out


def _label(shape: tuple) -> str:
    _, heads, batch, kv_len, _ = shape
    return f"h{heads} b{batch} kv{kv_len}"


def ratio_table(rows: list[Row], ours_dense: tuple[str, ...] = OURS[False]) -> list[str]:
    """Markdown: one line per (kind, competitor) with the geometric mean, range and the shapes ours loses."""
    lines = ["| kind | competitor | shapes | competitor / ours, geomean (range) | goal | shapes where ours is slower |",
             "|---|---|---|---|---|---|"]
    for (kind, name), per_shape in sorted(ratios(rows, ours_dense).items()):
        values = list(per_shape.values())
        geomean = math.exp(sum(math.log(v) for v in values) / len(values))
        losses = sorted((v, s) for s, v in per_shape.items() if v < 1.0)
        met = "met" if geomean >= GOAL_GEOMEAN and not losses else "missed"
        lost = ", ".join(f"{_label(s)} {v:.2f}" for v, s in losses) or "none"
        lines.append(f"| {kind} | {name} | {len(values)} | {geomean:.2f} ({min(values):.2f}-{max(values):.2f}) "
                     f"| {met} | {lost} |")
    return lines


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})" if values else "-"


def bandwidth_table(rows: list[Row], ours_dense: tuple[str, ...] = OURS[False]) -> list[str]:
    """Markdown: at batch >= 64, kv_len >= 4096, the fractions of the copy bandwidth and of the roofline of each of
    our dense backends, then of each dense competitor that ran beside them, by cache dtype and heads."""
    backends = ours_dense + COMPETITORS[False]
    picked = defaultdict(list)
    for r in rows:
        if (r.backend in backends and not r.sparse and r.batch >= BANDWIDTH_MIN_BATCH
                and r.kv_len >= BANDWIDTH_MIN_KV_LEN):
            picked[(r.kv, r.heads, backends.index(r.backend))].append(r)
    lines = [f"| dense, batch >= {BANDWIDTH_MIN_BATCH}, kv_len >= {BANDWIDTH_MIN_KV_LEN} | heads | shapes "
             f"| fraction of the copy bandwidth, median (min-max) | fraction of the roofline, median (min-max) |",
             "|---|---|---|---|---|"]
    for (kv, heads, index), picks in sorted(picked.items()):
        bws = [r.bw for r in picks if r.bw is not None]
        lines.append(f"| {kv} {backends[index]} | {heads} | {len(picks)} | {_spread(bws)} "
                     f"| {_spread([r.frac for r in picks])} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="kernels.py result files of one GPU")
    p.add_argument("--ours", default=",".join(OURS[False]),
                   help="our dense backends, comma-separated; several: the faster of them at each shape")
    args = p.parse_args(argv)
    ours_dense = tuple(name for name in args.ours.split(",") if name)
    if not ours_dense:
        p.error("--ours names no backend")
    rows = []
    for path in args.files:
        try:
            with open(path) as fh:
                rows += parse_rows(fh)
        except OSError as exc:
            print(f"error: cannot read {path}: {exc.strerror}", file=sys.stderr)
            return 2
    if not rows:
        print(f"error: no timed rows in {', '.join(args.files)}", file=sys.stderr)
        return 2
    print("\n".join(ratio_table(rows, ours_dense) + [""] + bandwidth_table(rows, ours_dense)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
