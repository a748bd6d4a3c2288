"""bench/kernels.py on the CPU: its help, grid and table rows (the timing needs a GPU)."""

from __future__ import annotations

import subprocess
import sys

from bench_scripts import BENCH, load

SCRIPT = BENCH / "kernels.py"


def test_help_runs_without_a_gpu():
    result = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0
    assert "--reference-shapes" in result.stdout and "--kv-dtype" in result.stdout


def test_grid_covers_the_issue_and_subsets():
    bench = load("kernels")
    full = bench.grid(bench.parse_args([]))
    dense = [s for s in full if s[4] is None]
    sparse = [s for s in full if s[4] is not None]
    assert len(dense) == 4 * 5 * 3 * 2 and len(sparse) == 4 * 5 * 2 * 2
    assert max(s[3] for s in sparse) == 32768 and {s[4] for s in sparse} == {2048}
    small = bench.grid(bench.parse_args(["--heads", "16", "--kv-dtype", "fp8_e4m3", "--dense-only",
                                         "--batch", "1,4", "--kv-len", "1024"]))
    assert small == [("fp8_e4m3", 16, 1, 1024, None), ("fp8_e4m3", 16, 4, 1024, None)]
    assert len(bench.grid(bench.parse_args(["--reference-shapes"]))) == 12
    assert full[:12] == [(kv, h, b, n, None) for kv, h, b, n in bench.REFERENCE_SHAPES]
    assert len(set(full)) == len(full)


def test_rows_format_both_outcomes():
    bench = load("kernels")
    base = dict(kv="bf16", heads=16, batch=4, kv_len=1024, topk="-", checked="4/4",
                backend="FLASHINFER_FA3_MLA")
    ok = bench.format_row({**base, "status": "ok", "median_us": 15.4, "ci_us": (15.2, 15.6),
                           "samples": 40, "vs_best": 1.0, "frac": 0.91, "rel_err": 3e-3})
    assert "15.4" in ok and "15.2-15.6" in ok and "0.91" in ok and ok.endswith("ok")
    bad = bench.format_row({**base, "status": "unavailable: no", "rel_err": None})
    assert bad.endswith("unavailable: no")
