"""bench/split_check.py on CPU: its arguments, and its dispatch comparison against the archived package."""

from __future__ import annotations

import subprocess
import tarfile
from io import BytesIO
from pathlib import Path

import pytest

from bench_scripts import BENCH, load

pytest.importorskip("torch")
pytest.importorskip("triton")
ARCHIVE = "bench-archive"  # the tag of the last tree with the unsplit package


def test_it_needs_the_old_package(tmp_path, capsys):
    check = load("split_check")
    with pytest.raises(SystemExit):
        check.parse_args([])
    with pytest.raises(SystemExit):
        check.parse_args(["--old", str(tmp_path)])
    assert "has no __init__.py" in capsys.readouterr().err
    (tmp_path / "__init__.py").write_text("")
    args = check.parse_args(["--old", str(tmp_path), "--ptx", "--dispatch"])
    assert args.ptx and args.dispatch and not args.quick


def _archived_package(tmp_path: Path) -> Path:
    repo = BENCH.parent
    try:
        tar = subprocess.run(["git", "-C", str(repo), "archive", ARCHIVE, "backends/triton_mla"], capture_output=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip(f"git tag {ARCHIVE} is not available in this checkout")
    with tarfile.open(fileobj=BytesIO(tar)) as archive:
        archive.extractall(tmp_path, filter="data")
    return tmp_path / "backends" / "triton_mla"


def test_the_split_package_dispatches_as_the_archived_one(tmp_path):
    check = load("split_check")
    old = check.load_old(_archived_package(tmp_path), name="mla_tune_old_triton_mla_test")
    assert check.check_dispatch(check.modules(old), check.QUICK_DISPATCH_GRID) == []


def test_a_mismatch_fails_loudly(tmp_path, monkeypatch, capsys):
    check = load("split_check")
    row = dict(kv="bf16", heads=16, batch=4, kv_len=4096, topk="-", old_label="h64n64w8s2Wx1",
               new_label="h64n64w8s2Wx1", out_equal=True, lse_equal=False, old_us=10.0, new_us=10.1, old_ci=0.01,
               new_ci=0.01)
    assert "MISMATCH" in check.format_row(row) and "lse False" in check.format_row(row)
    assert "identical" in check.format_row({**row, "lse_equal": True})
    (tmp_path / "__init__.py").write_text("")
    monkeypatch.setattr(check, "load_old", lambda directory: None)
    monkeypatch.setattr(check, "modules", lambda old: {})
    monkeypatch.setattr(check, "check_dispatch", lambda mods: ["dispatch {...}: h16 / h64"])
    assert check.main(["--old", str(tmp_path), "--dispatch"]) == 1
    assert "FAILED: 1 mismatches" in capsys.readouterr().err
