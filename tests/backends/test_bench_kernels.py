"""bench/kernels.py on the CPU: its help, grid and table rows (the timing needs a GPU)."""

from __future__ import annotations

import subprocess
import sys

import pytest

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
    assert len(dense) == 4 * 5 * 4 * 2 and len(sparse) == 4 * 5 * 2 * 2
    assert {s[3] for s in dense} == {1024, 4096, 16384, 32768}  # the issue's 1k-32k
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
                           "samples": 40, "vs_best": 1.0, "frac": 0.91, "bw": 0.83, "rel_err": 3e-3})
    assert "15.4" in ok and "15.2-15.6" in ok and "0.91" in ok and "0.83" in ok and ok.endswith("ok")
    bad = bench.format_row({**base, "status": "unavailable: no", "rel_err": None})
    assert bad.endswith("unavailable: no")


def test_summary_compares_with_vllm_kernels_on_correct_rows(tmp_path):
    bench, summary = load("kernels"), load("kernels_summary")
    base = dict(kv="fp8_e4m3", heads=128, kv_len=4096, topk="-", ci_us=(1.0, 2.0), samples=5, vs_best=1.0,
                rel_err=2e-3, checked="8/64")
    rows = []
    for batch, ours_us, flashmla_us in ((64, 100.0, 80.0), (128, 100.0, 150.0)):
        rows.append({**base, "batch": batch, "backend": "MLA_TUNE_TRITON", "status": "ok", "median_us": ours_us,
                     "frac": 0.5, "bw": 0.4})
        rows.append({**base, "batch": batch, "backend": "FLASHMLA", "status": "ok (q in e4m3)",
                     "median_us": flashmla_us, "frac": 0.6, "bw": 0.3})
    rows.append({**base, "batch": 16, "backend": "FLASHMLA", "status": "incorrect: relative error 0.1",
                 "rel_err": 0.1})
    path = tmp_path / "k.txt"
    path.write_text("\n".join([bench.HEADER] + [bench.format_row(r) for r in rows]) + "\n")

    parsed = summary.parse_rows(path.read_text().splitlines())
    assert len(parsed) == 4 and {r.kind for r in parsed} == {"dense FP8"}
    table = summary.ratio_table(parsed)
    # sqrt(0.8 * 1.5) = 1.10; ours loses at batch 64 only
    assert table[2] == "| dense FP8 | FLASHMLA | 2 | 1.10 (0.80-1.50) | missed | h128 b64 kv4096 0.80 |"
    # ours first, then the competitor beside it
    assert summary.bandwidth_table(parsed)[2:] == [
        "| fp8_e4m3 MLA_TUNE_TRITON | 128 | 2 | 0.40 (0.40-0.40) | 0.50 (0.50-0.50) |",
        "| fp8_e4m3 FLASHMLA | 128 | 2 | 0.30 (0.30-0.30) | 0.60 (0.60-0.60) |"]
    # a file from before the "bw" column: its header names the columns it has
    old = [line.replace("   bw", "").replace("  0.40", "").replace("  0.30", "") for line in
           path.read_text().splitlines()]
    assert "bw" not in old[0].split() and len(old[1].split()) == len(path.read_text().splitlines()[1].split()) - 1
    assert summary.bandwidth_table(summary.parse_rows(old))[2:] == [
        "| fp8_e4m3 MLA_TUNE_TRITON | 128 | 2 | - | 0.50 (0.50-0.50) |",
        "| fp8_e4m3 FLASHMLA | 128 | 2 | - | 0.60 (0.60-0.60) |"]
    assert summary.main([str(path)]) == 0
    assert summary.main([str(tmp_path / "missing.txt")]) == 2


def test_summary_takes_the_faster_of_several_of_ours_at_each_shape(tmp_path):
    bench, summary = load("kernels"), load("kernels_summary")
    base = dict(kv="fp8_e4m3", heads=64, kv_len=4096, topk="-", ci_us=(1.0, 2.0), samples=5, vs_best=1.0,
                rel_err=2e-3, checked="8/64", status="ok")
    rows = []
    # batch 64: the FP8-query backend is the faster (80 us); batch 128: only MLA_TUNE_TRITON ran (200 us)
    for batch, times in ((64, {"MLA_TUNE_TRITON": 120.0, "MLA_TUNE_TRITON_FP8Q": 80.0, "FLASHMLA": 100.0}),
                         (128, {"MLA_TUNE_TRITON": 200.0, "FLASHMLA": 180.0})):
        for backend, us in times.items():
            rows.append({**base, "batch": batch, "backend": backend, "median_us": us,
                         "frac": 0.7 if backend.endswith("FP8Q") else 0.5, "bw": 0.6})
    path = tmp_path / "k.txt"
    path.write_text("\n".join([bench.HEADER] + [bench.format_row(r) for r in rows]) + "\n")
    parsed = summary.parse_rows(path.read_text().splitlines())
    both = ("MLA_TUNE_TRITON", "MLA_TUNE_TRITON_FP8Q")
    # sqrt(100 / 80 * 180 / 200) = 1.06
    assert summary.ratio_table(parsed, both)[2] == \
        "| dense FP8 | FLASHMLA | 2 | 1.06 (0.90-1.25) | missed | h64 b128 kv4096 0.90 |"
    assert summary.ratio_table(parsed)[2] == "| dense FP8 | FLASHMLA | 2 | 0.87 (0.83-0.90) | missed | " \
        "h64 b64 kv4096 0.83, h64 b128 kv4096 0.90 |"
    assert summary.bandwidth_table(parsed, both)[2:] == [
        "| fp8_e4m3 MLA_TUNE_TRITON | 64 | 2 | 0.60 (0.60-0.60) | 0.50 (0.50-0.50) |",
        "| fp8_e4m3 MLA_TUNE_TRITON_FP8Q | 64 | 1 | 0.60 (0.60-0.60) | 0.70 (0.70-0.70) |",
        "| fp8_e4m3 FLASHMLA | 64 | 2 | 0.60 (0.60-0.60) | 0.50 (0.50-0.50) |"]
    assert summary.main(["--ours", ",".join(both), str(path)]) == 0
    with pytest.raises(SystemExit) as exc:
        summary.main(["--ours", "", str(path)])
    assert exc.value.code == 2


def test_forms_ab_switches_each_variants_dispatch_values_only_while_it_launches():
    ab = load("forms_ab")
    args = ab.parse_args(["--set", "L2_PREFETCH_FORMS={('qk1', 'fp8', 'dense')}", "--heads", "128",
                          "--set", "HOPPER_STAGED_LOADERS={False: 0, True: 2}; COMBINE_SPLITS_AT_ONCE=4 * 2",
                          "--dense-only", "--kv-dtype", "fp8_e4m3"])
    assert args.variants == [[("L2_PREFETCH_FORMS", {("qk1", "fp8", "dense")})],
                             [("HOPPER_STAGED_LOADERS", {False: 0, True: 2}), ("COMBINE_SPLITS_AT_ONCE", 8)]]
    assert [ab.variant_name(i) for i in range(2)] == ["MLA_TUNE_TRITON:B", "MLA_TUNE_TRITON:C"]
    assert {s[1] for s in ab.kernels.grid(args)} == {128}
    from mla_tune.backends.triton_mla import dispatch

    seen = []

    class Runner:
        def run(self, inputs):
            seen.append((set(dispatch.L2_PREFETCH_FORMS), dict(dispatch.HOPPER_STAGED_LOADERS),
                         dispatch.COMBINE_SPLITS_AT_ONCE))
            return inputs

    before = (set(dispatch.L2_PREFETCH_FORMS), dict(dispatch.HOPPER_STAGED_LOADERS), dispatch.COMBINE_SPLITS_AT_ONCE)
    assert ab.SwitchedRunner(Runner(), args.variants[0]).run("x") == "x"
    assert ab.SwitchedRunner(Runner(), args.variants[1]).run("y") == "y"
    assert seen == [({("qk1", "fp8", "dense")}, before[1], before[2]), (before[0], {False: 0, True: 2}, 8)]
    assert (set(dispatch.L2_PREFETCH_FORMS), dict(dispatch.HOPPER_STAGED_LOADERS),
            dispatch.COMBINE_SPLITS_AT_ONCE) == before
    with pytest.raises(SystemExit, match="dispatch has no NOPE"):
        ab.SwitchedRunner(Runner(), [("NOPE", 1)]).run("z")


def test_forms_ab_writes_what_it_prints_to_out(tmp_path, capsys):
    ab = load("forms_ab")
    assert ab.parse_args(["--set", "COMBINE_SPLITS_AT_ONCE=8", "--out", str(tmp_path / "ab.txt")]).out
    emit = ab.Lines(str(tmp_path / "ab.txt"))
    emit("# A / B over 1 shapes: geomean 0.963")
    emit.close()
    assert (tmp_path / "ab.txt").read_text() == "# A / B over 1 shapes: geomean 0.963\n"
    assert capsys.readouterr().out == "# A / B over 1 shapes: geomean 0.963\n"
    ab.Lines(None)("stdout only")
    assert capsys.readouterr().out == "stdout only\n"
