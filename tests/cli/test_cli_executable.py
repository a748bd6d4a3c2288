"""The installed `mla-tune` console script, run as a real subprocess."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def executable() -> str:
    beside = Path(sys.executable).with_name("mla-tune")
    found = str(beside) if beside.exists() else shutil.which("mla-tune")
    if found is None:
        pytest.fail("the `mla-tune` console script is not installed (pip install -e '.[test]')")
    return found


def run(*args, env=None):
    return subprocess.run([executable(), *map(str, args)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_version():
    from mla_tune import __version__

    result = run("--version")
    assert result.returncode == 0 and result.stdout == f"mla-tune {__version__}\n"


def test_store_round_trip_through_the_executable(tmp_path):
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    upgrade = run("--db", url, "db", "upgrade")
    assert upgrade.returncode == 0, upgrade.stderr
    lookup = run("lookup", "--heads", "128", "--kv-cache-dtype", "fp8", "--device-name", "NVIDIA B200",
                 "--cc", "10.0", "--format", "json", env={"MLA_TUNE_DB": url})
    assert lookup.returncode == 0, lookup.stderr
    data = json.loads(lookup.stdout)
    assert (data["backend"], data["source"]) == ("FLASHINFER_MLA", "fallback")
    assert lookup.stderr == ""  # a migrated, empty store is not a problem: just nothing tuned


def test_usage_error_is_one_line_exit_2_and_writes_nothing(tmp_path):
    db = tmp_path / "never.db"
    result = run("--db", f"sqlite:///{db}", "lookup", "--heads", "0", "--kv-cache-dtype", "fp8")
    assert result.returncode == 2
    assert result.stdout == "" and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert not db.exists()


def test_main_job_without_gpu(tmp_path, no_gpu):
    result = run(env={"XDG_DATA_HOME": str(tmp_path / "data")})
    assert result.returncode == 0, result.stderr
    assert "No NVIDIA GPU here" in result.stdout and "FLASH_ATTN_MLA" in result.stdout
    assert not (tmp_path / "data").exists()
