"""The bench scripts that turn result files into the figures we quote: bench/summarize_kernels.py (issue 4's table in
README.md) and bench/ncu_partitions.py (Nsight Compute source reports by partition)."""

from __future__ import annotations

import csv
import re
import subprocess
import sys
from pathlib import Path

from bench_scripts import BENCH, load

ROOT = BENCH.parent


def test_summary_takes_the_median_and_splits_by_heads():
    lines = load("summarize_kernels").summarize(str(ROOT / "bench/results/kernels-h100-dense-call137.txt"))
    fp8 = lines[lines.index(next(x for x in lines if x.startswith("fp8_e4m3"))):]
    assert "= 2.50 (geomean), 2.99 at batch >= 64" in fp8[0] and "60/60" in fp8[0]
    assert fp8[1] == "  by heads (geomean): 16: 3.08, 32: 2.66, 64: 2.14, 128: 2.22"
    # 12 shapes: the mean of the 6th and 7th fractions (0.72, 0.74), not the 7th
    assert "median 0.73, range 0.50-0.89 over 12 shapes" in fp8[2]
    assert "32: 0.66/0.74/0.72/0.75" in fp8[2]


def test_readme_table_matches_the_result_files_it_names():
    summarize = load("summarize_kernels").summarize
    readme = (ROOT / "README.md").read_text()
    header = "| | H100 (dense call 256, sparse call 269) | H200 (dense call 257, sparse call 270"
    table = readme.split(header, 1)[1].split("\n\n", 1)[0]
    for gpu, dense_call, sparse_call in (("h100", 256, 269), ("h200", 257, 270)):
        dense = "\n".join(summarize(str(ROOT / f"bench/results/kernels-{gpu}-dense-call{dense_call}.txt")))
        sparse = "\n".join(summarize(str(ROOT / f"bench/results/kernels-{gpu}-sparse-call{sparse_call}.txt")))
        fp8 = re.search(r"fp8_e4m3: .*? = (\d\.\d\d) \(geomean\), (\d\.\d\d)", dense).groups()
        bf16 = re.search(r"bf16: .*? = (\d\.\d\d) \(geomean\)", dense).group(1)
        median = re.search(r"fp8_e4m3: [^\n]*\n[^\n]*\n  our roofline fraction .*? median (\d\.\d\d)", dense).group(1)
        sparse_fp8 = re.search(r"fp8_e4m3: .*? = (\d\.\d\d) \(geomean\)", sparse).group(1)
        assert f"{fp8[0]}x" in table and f"{fp8[1]}x" in table and f"{bf16}x" in table, (gpu, fp8, bf16)
        assert f"{round(float(median) * 100)}%" in table and f"{sparse_fp8}x" in table, (gpu, median, sparse_fp8)


def test_summary_of_a_missing_file_is_one_line_and_status_2():
    result = subprocess.run([sys.executable, str(ROOT / "bench/summarize_kernels.py"), "no-such-file.txt"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == "summarize_kernels: cannot read no-such-file.txt: No such file or directory"


def _source_report(path: Path, rows: list[tuple[str, int, int, int]]) -> None:
    """A source-level report as Nsight Compute writes it: preamble lines, then the SASS table."""
    with open(path, "w", newline="") as f:
        f.write('"ID","Process ID"\n"0","1"\n')
        out = csv.writer(f, quoting=csv.QUOTE_ALL)
        out.writerow(["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
                      "stall_barrier", "stall_long_sb"])
        for i, (source, samples, barrier, long_sb) in enumerate(rows):
            out.writerow([hex(0x1000 + 16 * i), source, f"{samples:,}", "1,024", barrier, long_sb])


def test_ncu_partitions_splits_at_register_reallocations(tmp_path):
    report = tmp_path / "ncu-source-x-dflt.csv"
    _source_report(report, [
        ("USETMAXREG.DEALLOC.CTAPOOL 0x60", 1, 0, 0),       # the loader
        ("LDG.E.128 R4, desc[UR4][R2.64]", 20, 0, 18),
        ("F2FP.F16.E4M3.UNPACK_B R8, R4", 40, 0, 35),
        ("USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0", 1, 0, 0),  # the MMA warps
        ("HGMMA.64x32x16.F32 R24, gdesc[UR4], R24", 30, 5, 0),
        ("WARPGROUP.DEPBAR.LE gsb0, 0x0", 900, 880, 0),
        ("@!P0 BRA 0x2000", 70, 0, 65),
    ])
    lines = load("ncu_partitions").summarize(str(report), top=2)
    assert lines[1].startswith("  partition 1 LOADER samples       61 instructions        3072  long_sb 53")
    assert lines[2].startswith("  partition 2 MMA    samples     1001 instructions        4096  barrier 885")
    assert lines[3] == "  partition 1 LOADER, its 2 most sampled instructions:"
    assert "F2FP.F16.E4M3.UNPACK_B R8, R4" in lines[4] and lines[4].endswith("mostly long_sb")
    assert "LDG.E.128" in lines[5]
    assert lines[6] == "  partition 1 LOADER, samples by opcode: F2FP 40, LDG 20"
    assert lines[7] == "  partition 2 MMA, its 2 most sampled instructions:"
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x0" in lines[8] and lines[8].endswith("mostly barrier")
    assert "BRA 0x2000" in lines[9] and lines[9].endswith("mostly long_sb")
    assert lines[10] == "  partition 2 MMA, samples by opcode: WARPGROUP 900, BRA 70"


def test_ncu_partitions_refuses_a_report_that_is_not_source_level(tmp_path):
    details = tmp_path / "ncu-details.csv"
    details.write_text('"ID","Kernel Name","Metric Name"\n"0","k","Duration"\n')
    result = subprocess.run([sys.executable, str(ROOT / "bench/ncu_partitions.py"), str(details)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "not a source-level Nsight Compute CSV" in result.stderr
