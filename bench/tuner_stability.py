"""Decision stability between two tunes of the same grid (`mla-tune show --json` of each).

For every key decided in both:
- the first tune's winner, scored with the second tune's measurements, must be
  within 2% of the second tune's best score ("the stored winner's score is
  within 2% of the best" on a re-measurement);
- the winners should agree on at least 95% of keys, and every disagreement must
  be within the noise margin (the first winner's re-measured score within
  the second decision's noise margin of its winner's score).

    python3 bench/tuner_stability.py first.json second.json

Prints one line per key and a summary; exits 1 when a criterion fails.
"""

from __future__ import annotations

import json
import sys

WITHIN_BEST = 0.02
AGREEMENT = 0.95


def _key(d: dict) -> tuple:
    k = d["key"]
    return (k["sku"], k["kv_cache_dtype"], k["num_heads"], k["geometry"], k["page_size"], k["topk"], k["q_len"])


def compare(first: list[dict], second: list[dict]) -> tuple[list[str], bool]:
    """Lines to print and whether every criterion held."""
    a = {_key(d): d for d in first}
    b = {_key(d): d for d in second}
    common = sorted(set(a) & set(b))
    lines, agree, within, noisy_ok = [], 0, 0, True
    for key in common:
        d1, d2 = a[key], b[key]
        w1, w2 = d1["winner"], d2["winner"]
        best2 = min(d2["scores"].values())
        re_score = d2["scores"].get(w1)
        ratio = re_score / best2 if re_score else float("inf")
        ok_best = ratio <= 1 + WITHIN_BEST
        within += ok_best
        same = w1 == w2
        agree += same
        in_noise = same or (re_score is not None and re_score <= d2["scores"][w2] * (1 + max(d2["noise_margin"], 0.0))
                            + 1e-12)
        noisy_ok &= in_noise
        label = f"{key[1]} kv, {key[2]} heads" + (f", top-k {key[5]}" if key[5] else "") + \
                (f", q_len {key[6]}" if key[6] != 1 else "")
        lines.append(f"{label:32s} first {w1:20s} second {w2:20s} first winner re-scored {ratio:.4f}x best"
                     f"{'' if ok_best else '  > 2%!'}{'' if in_noise else '  disagreement beyond noise!'}")
    n = len(common)
    if n == 0:
        return ["no key was decided in both tunes"], False
    agreement = agree / n
    summary = (f"{n} keys in both: winners agree on {agree} ({agreement:.0%}, need >= {AGREEMENT:.0%}); "
               f"first winner within 2% of the re-measured best on {within}/{n}; "
               f"every disagreement within noise: {noisy_ok}")
    passed = agreement >= AGREEMENT and within == n and noisy_ok
    return lines + [summary, "PASS" if passed else "FAIL"], passed


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__.strip().splitlines()[-3].strip(), file=sys.stderr)
        return 2
    with open(argv[1]) as f1, open(argv[2]) as f2:
        lines, passed = compare(json.load(f1), json.load(f2))
    print("\n".join(lines))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
