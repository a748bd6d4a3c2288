"""Issue 4's figures from a `bench/kernels.py` result file: our Triton kernel against FlashInfer.

For each KV dtype: the geometric mean over shapes of FlashInfer's time / ours (the faster of
FA2/FA3 for FP8, FA3 for bf16; > 1 means ours is faster), the same at batch >= 64 and
kv_len >= 4096, how many shapes ours wins, and our fraction of the roofline (the file's `frac`
column) at batch >= 64, kv_len >= 4096, heads <= 64.

Usage: python3 bench/summarize_kernels.py bench/results/kernels-h100-dense-20261122.txt
       python3 bench/summarize_kernels.py OLD.txt+NEWER.txt   (NEWER's shapes replace OLD's)
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections import defaultdict


def read(path: str):
    """{(kv, heads, batch, kv_len): {backend: (median_us, frac)}} for every `ok` row.

    `A+B`: the rows of A, with every shape that B measured taken from B instead.
    """
    if "+" in path:
        base, _, newer = path.rpartition("+")
        rows = read(base)
        rows.update(read(newer))
        return rows
    rows = defaultdict(dict)
    for line in open(path):
        cells = line.split()
        if line.startswith(("#", "kv ")) or len(cells) < 13 or cells[-1] != "ok":
            continue
        key = (cells[0], int(cells[1]), int(cells[2]), int(cells[3]))
        rows[key][cells[5].removesuffix("_SPARSE")] = (float(cells[6]), float(cells[10]))
    return rows


def geomean(values) -> float:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


def summarize(path: str) -> list[str]:
    lines = []
    rows = read(path)
    for kv in ("bf16", "fp8_e4m3"):
        ratios, large, fracs = [], [], []
        by_heads = defaultdict(list)  # heads -> ratios
        fracs_by_heads = defaultdict(list)  # heads -> roofline fractions at the large shapes
        for (k, heads, batch, kv_len), times in sorted(rows.items()):
            if k != kv or "TRITON_MLA" not in times or "FLASHINFER_FA3_MLA" not in times:
                continue
            flashinfer = [times[name][0] for name in ("FLASHINFER_FA2_MLA", "FLASHINFER_FA3_MLA") if name in times]
            theirs = min(flashinfer) if kv.startswith("fp8") else times["FLASHINFER_FA3_MLA"][0]
            ratio = theirs / times["TRITON_MLA"][0]
            ratios.append(ratio)
            by_heads[heads].append(ratio)
            if batch >= 64 and kv_len >= 4096:
                large.append(ratio)
                if heads <= 64:
                    fracs.append(times["TRITON_MLA"][1])
                    fracs_by_heads[heads].append(times["TRITON_MLA"][1])
        if not ratios:
            continue
        versus = "the faster of FA2/FA3" if kv.startswith("fp8") else "FA3"
        wins = sum(r > 1 for r in ratios)
        lines.append(f"{kv}: {len(ratios)} shapes; FlashInfer ({versus}) / ours = {geomean(ratios):.2f} "
                     f"(geomean), {geomean(large):.2f} at batch >= 64 and kv_len >= 4096; ours faster on "
                     f"{wins}/{len(ratios)}")
        lines.append("  by heads (geomean): " + ", ".join(f"{h}: {geomean(r):.2f}"
                                                       for h, r in sorted(by_heads.items())))
        if fracs:
            lines.append(f"  our roofline fraction at batch >= 64, kv_len >= 4096, heads <= 64: median "
                         f"{statistics.median(fracs):.2f}, range {min(fracs):.2f}-{max(fracs):.2f} over {len(fracs)} "
                         f"shapes; by heads: " + ", ".join(f"{h}: {'/'.join(f'{x:.2f}' for x in xs)}"
                                                           for h, xs in sorted(fracs_by_heads.items())))
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", metavar="FILE", help="a bench/kernels.py result file, or OLD+NEWER")
    args = ap.parse_args()
    for result_file in args.files:
        try:
            lines = summarize(result_file)
        except OSError as exc:
            ap.exit(2, f"summarize_kernels: cannot read {result_file}: {exc.strerror}\n")
        print(result_file)
        print("\n".join(lines))


if __name__ == "__main__":
    main()
