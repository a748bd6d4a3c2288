"""`mla-tune show` and `mla-tune db upgrade`: store problems are one line, exit 1, the file left as it was."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from contextlib import closing

import pytest

from mla_tune.backends.device import DeviceInfo
from mla_tune.backends.problem import Problem
from mla_tune.backends.software import current_fingerprint
from mla_tune.store.records import Decision, DecisionKey
from mla_tune.store.repository import Store

B200 = DeviceInfo(name="NVIDIA B200", compute_capability=(10, 0), memory_total_mib=183359)


def bad_files(tmp_path):
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"\x00\x01 definitely not sqlite " * 300)
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    directory = tmp_path / "dir.db"
    directory.mkdir()
    future = tmp_path / "future.db"
    Store.open(f"sqlite:///{future}").close()
    with closing(sqlite3.connect(future)) as connection, connection:
        connection.execute("UPDATE alembic_version SET version_num = 'ffff_newer'")
    truncated = tmp_path / "truncated.db"
    Store.open(f"sqlite:///{truncated}").close()
    with closing(sqlite3.connect(truncated)) as connection, connection:
        connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    data = truncated.read_bytes()
    truncated.write_bytes(data[: len(data) // 2 + 100])
    return {"garbage": garbage, "empty": empty, "directory": directory, "newer schema": future,
            "truncated": truncated}


# An empty file is an empty SQLite database: `db upgrade` initialises it (tested below), `show` refuses it.
CASES = [(command, kind) for command in (("show",), ("show", "--json"), ("db", "upgrade"))
         for kind in ("garbage", "empty", "directory", "newer schema", "truncated")
         if (command, kind) != (("db", "upgrade"), "empty")]


@pytest.mark.parametrize("command, kind", CASES, ids=[f"{' '.join(c)}-{k}" for c, k in CASES])
def test_unusable_store_is_one_line_and_exit_1(cli, tmp_path, files_under, command, kind):
    path = bad_files(tmp_path)[kind]
    before = files_under(tmp_path)
    result = cli("--db", f"sqlite:///{path}", *command)
    assert result.exit_code == 1, result.output
    # --json asked for JSON on stdout: a failure is a JSON error object there, and one line on stderr
    assert result.stdout == "" if "--json" not in command else json.loads(result.stdout)["exit_status"] == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mla-tune: error: ") and "Traceback" not in result.stderr
    assert str(path) in lines[0] or "ffff_newer" in lines[0]
    assert files_under(tmp_path) == before


def test_show_on_a_missing_store_does_not_create_it(cli, tmp_path):
    path = tmp_path / "none" / "x.db"
    result = cli("--db", f"sqlite:///{path}", "show")
    assert result.exit_code == 1 and "no database at" in result.stderr
    assert not path.parent.exists()


def test_db_upgrade_creates_and_show_lists(cli, tmp_path):
    url = f"sqlite:///{tmp_path / 'new.db'}"
    first = cli("--db", url, "db", "upgrade")
    assert first.exit_code == 0 and "schema at revision" in first.stdout
    assert cli("--db", url, "db", "upgrade").exit_code == 0  # idempotent
    empty = cli("--db", url, "show")
    assert empty.exit_code == 0 and "no decisions stored" in empty.stdout
    key = DecisionKey.of(B200.sku, (10, 0), Problem(num_heads=64, kv_cache_dtype="fp8"))
    with Store.open(url) as store:
        store.save_decision(Decision(key=key, winner="FLASHINFER_MLA", static_choice="FLASHINFER_MLA",
                                     scores={"FLASHINFER_MLA": 1.0, "TRITON_MLA": 1.9}, runner_up="TRITON_MLA",
                                     margin=0.9, anomalies=("TRITON_MLA slower than trend at 64 heads",),
                                     fingerprint=current_fingerprint(), decided_at="2026-11-22T03:00:00Z"))
    table = cli("--db", url, "show")
    assert table.exit_code == 0
    for text in ("NVIDIA B200", "FLASHINFER_MLA", "90.0% over", "slower"):
        assert text in table.stdout
    data = json.loads(cli("--db", url, "show", "--json").stdout)
    assert data[0]["winner"] == "FLASHINFER_MLA" and data[0]["key"]["num_heads"] == 64
    assert data[0]["anomalies"] == ["TRITON_MLA slower than trend at 64 heads"]
    assert data[0]["stale"] == [] and "current" in table.stdout


def test_show_marks_decisions_made_with_other_software_stale(cli, tmp_path):
    url = f"sqlite:///{tmp_path / 'stale.db'}"
    key = DecisionKey.of(B200.sku, (10, 0), Problem(num_heads=16, kv_cache_dtype="bf16"))
    old = dataclasses.replace(current_fingerprint(), triton="3.2.0")
    with Store.open(url) as store:
        store.save_decision(Decision(key=key, winner="TRITON_MLA", static_choice="FLASHINFER_MLA",
                                     scores={"TRITON_MLA": 1.0}, fingerprint=old,
                                     decided_at="2026-11-22T03:00:00Z"))
    assert "STALE: triton" in cli("--db", url, "show").stdout
    (row,) = json.loads(cli("--db", url, "show", "--json").stdout)
    assert any("triton" in problem and "3.2.0" in problem for problem in row["stale"])


def test_db_upgrade_initialises_an_empty_file(cli, tmp_path):
    path = tmp_path / "empty.db"
    path.write_bytes(b"")
    assert cli("--db", f"sqlite:///{path}", "db", "upgrade").exit_code == 0
    assert cli("--db", f"sqlite:///{path}", "show").exit_code == 0


def test_db_url_from_the_environment(cli, tmp_path):
    path = tmp_path / "env.db"
    result = cli("db", "upgrade", env={"MLA_TUNE_DB": f"sqlite:///{path}"})
    assert result.exit_code == 0 and path.exists()


def test_default_store_lives_in_the_user_data_directory(cli, isolated_store):
    result = cli("db", "upgrade")
    assert result.exit_code == 0
    assert (isolated_store / "mla-tune" / "mla-tune.db").exists()


def test_unwritable_data_directory_is_one_line_exit_1(cli, tmp_path, files_under, monkeypatch):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the data directory should be")
    before = files_under(tmp_path)
    explicit = cli("--db", f"sqlite:///{blocker}/mla-tune/x.db", "db", "upgrade")
    assert explicit.exit_code == 2 and explicit.stderr.count("\n") == 1   # a named path: its directory must exist
    assert "does not exist (nothing was created)" in explicit.stderr
    monkeypatch.setenv("XDG_DATA_HOME", str(blocker))  # the default store under an unusable directory
    default = cli("db", "upgrade")
    assert default.exit_code == 1 and default.stderr.startswith("mla-tune: error: ")
    assert "cannot create the data directory" in default.stderr
    lookup = cli("lookup", "--heads", "64", "--kv-cache-dtype", "bf16", "--device-name", "NVIDIA H200", "--cc", "9.0")
    assert lookup.exit_code == 0 and lookup.stdout.startswith("FLASH_ATTN_MLA (fallback)")
    assert files_under(tmp_path) == before
