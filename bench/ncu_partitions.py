"""Warp-stall samples of a source-level Nsight Compute report (`REPORT=source bash bench/ncu_ab.sh`), by partition of
the warp-specialised Hopper kernel, by instruction and by opcode (MMA and loader partitions).

The SASS of a partition runs from one `USETMAXREG` (its register reallocation) to the next; a partition with HGMMA
instructions is an MMA one, one with F2FP (the FP8 casts) or LDGSTS (`cp.async`) a loader.

Usage: python3 bench/ncu_partitions.py [--top 12] OUT/ncu-source-NAME-A.csv OUT/ncu-source-NAME-B.csv
"""

from __future__ import annotations

import argparse
import csv
from collections import Counter

SAMPLES = "Warp Stall Sampling (All Samples)"


def number(cell: str) -> float:
    try:
        return float(cell.replace(",", ""))
    except ValueError:
        return 0.0


def read(path: str) -> list[dict]:
    """The report's SASS rows (the table after the header row that starts with `Address`)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    start = next(i for i, row in enumerate(rows) if row and row[0] == "Address")
    header = rows[start]
    return [dict(zip(header, row)) for row in rows[start + 1:] if len(row) == len(header)]


def opcode(source: str) -> str:
    words = source.split()
    if words and words[0].startswith("@"):  # a predicate
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def summarize(path: str, top: int) -> list[str]:
    rows = read(path)
    stalls = [name for name in rows[0] if name.startswith("stall_") and "Not Issued" not in name] if rows else []
    partition, parts = 0, []
    for row in rows:
        if opcode(row["Source"]) == "USETMAXREG":
            partition += 1
        parts.append(partition)
    totals: dict[int, Counter] = {}
    opcodes: dict[int, set] = {}
    for part, row in zip(parts, rows):
        totals.setdefault(part, Counter())
        opcodes.setdefault(part, set()).add(opcode(row["Source"]))
        for name in stalls:
            totals[part][name[6:]] += number(row[name])
        totals[part]["(samples)"] += number(row[SAMPLES])
        totals[part]["(instructions)"] += number(row["Instructions Executed"])
    lines = [path]
    kinds = {}
    for part, total in sorted(totals.items()):
        kinds[part] = ("MMA" if "HGMMA" in opcodes[part] else
                       "LOADER" if opcodes[part] & {"F2FP", "LDGSTS"} else "other")
        if total["(samples)"] < 50:
            continue
        reasons = sorted(((v, k) for k, v in total.items() if not k.startswith("(")), reverse=True)[:7]
        lines.append(f"  partition {part} {kinds[part]:6s} samples {total['(samples)']:8.0f} instructions "
                     f"{total['(instructions)']:11.0f}  " + ", ".join(f"{k} {v:.0f}" for v, k in reasons))
    for part in sorted(p for p, kind in kinds.items() if kind != "other" and totals[p]["(samples)"] >= 50):
        hot = sorted(((number(row[SAMPLES]), row) for p, row in zip(parts, rows) if p == part),
                     key=lambda item: item[0], reverse=True)[:top]
        lines.append(f"  partition {part} {kinds[part]}, its {top} most sampled instructions:")
        for samples, row in hot:
            reason = max(stalls, key=lambda name: number(row[name]))[6:] if stalls else ""
            lines.append(f"    {samples:6.0f}  {row['Address']:>6s}  {row['Source'][:70]:70s}  mostly {reason}")
        by_opcode = Counter()
        for p, row in zip(parts, rows):
            if p == part:
                by_opcode[opcode(row["Source"])] += number(row[SAMPLES])
        lines.append(f"  partition {part} {kinds[part]}, samples by opcode: "
                     + ", ".join(f"{op} {v:.0f}" for op, v in by_opcode.most_common(top)))
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", metavar="CSV")
    ap.add_argument("--top", type=int, default=12, help="instructions listed per MMA partition")
    args = ap.parse_args()
    for path in args.files:
        try:
            print("\n".join(summarize(path, args.top)))
        except (OSError, StopIteration) as exc:
            ap.exit(2, f"ncu_partitions: {path}: not a source-level Nsight Compute CSV ({type(exc).__name__})\n")


if __name__ == "__main__":
    main()
