"""`mla_tune.lookup` on real SQLite files: tuned answers, the static fallback, and every store failure mode."""

from __future__ import annotations

import logging
import os
import sqlite3
from contextlib import closing
import sys
import time
from dataclasses import replace

import pytest

import mla_tune
from mla_tune.backends.device import DeviceInfo
from mla_tune.backends.problem import Problem
from mla_tune.backends.software import current_fingerprint
from mla_tune.runtime import NoDeviceError, NoEligibleBackendError, clear_cache
from mla_tune.store.records import Decision, DecisionKey
from mla_tune.store.repository import Store

H100 = DeviceInfo(name="NVIDIA H100 80GB HBM3", compute_capability=(9, 0), memory_total_mib=81559,
                  pci_device_id="0x233010DE", driver_version="580.65.06", uuid="GPU-1")
H100_ARG = {"name": "NVIDIA H100 80GB HBM3", "compute_capability": (9, 0)}
H200_ARG = {"name": "NVIDIA H200", "compute_capability": (9, 0)}


@pytest.fixture(autouse=True)
def _fresh_memo():
    clear_cache()
    yield
    clear_cache()


def decision_for(device: DeviceInfo, *, heads=64, kv="fp8", winner="FLASHINFER_FA3_MLA", topk=None,
                 fingerprint=None, decided_at="2026-11-22T03:00:00Z") -> Decision:
    key = DecisionKey.of(device.sku, device.compute_capability, Problem(num_heads=heads, kv_cache_dtype=kv,
                                                                         topk=topk))
    return Decision(key=key, winner=winner, static_choice="FLASHMLA",
                    scores={winner: 1.0, "FLASHINFER_FA2_MLA": 1.08, "TRITON_MLA": 1.4},
                    runner_up="FLASHINFER_FA2_MLA", margin=0.08, failures={"FLASHMLA": "vllm is not installed"},
                    fingerprint=fingerprint or current_fingerprint(driver_version=device.driver_version),
                    gpu_uuids=(device.uuid,), decided_at=decided_at)


def tuned_db(path, *decisions) -> str:
    url = f"sqlite:///{path}"
    with Store.open(url) as store:
        for d in decisions:
            store.save_decision(d)
    return url


@pytest.fixture
def h100_db(tmp_path):
    return tuned_db(tmp_path / "tuned.db", decision_for(H100))


# --- answers -----------------------------------------------------------------------------------

def test_tuned_decision_is_returned_with_reasons_for_every_other_backend(h100_db):
    choice = mla_tune.lookup(64, "fp8", device=H100_ARG, db=h100_db)
    assert (choice.backend, choice.source) == ("FLASHINFER_FA3_MLA", "tuned")
    assert choice.runner_up == "FLASHINFER_FA2_MLA" and choice.margin == pytest.approx(0.08)
    assert choice.static_choice == "FLASHMLA"
    assert "+8.0%" in choice.reasons["FLASHINFER_FA2_MLA"][0]
    assert choice.reasons["FLASHMLA"] == ("vllm is not installed",)
    assert "compute capability 9.0 is not supported" in choice.reasons["FLASHINFER_MLA"][0]
    assert "FLASHINFER_FA3_MLA" not in choice.reasons
    assert set(choice.reasons) == {n for n in mla_tune.runtime.candidates() if n != "FLASHINFER_FA3_MLA"}
    assert choice.to_dict()["reasons"]["FLASHMLA"] == ["vllm is not installed"]


def test_every_vllm_spelling_of_the_same_dtype_finds_the_decision(h100_db):
    for spelling in ("fp8", "fp8_e4m3", "FP8", "fp8_inc"):
        assert mla_tune.lookup(64, spelling, device=H100_ARG, db=h100_db).source == "tuned"


def test_full_sku_must_match_when_given(h100_db):
    same = dict(H100_ARG, memory_total_mib=81559, pci_device_id="0x233010DE")
    assert mla_tune.lookup(64, "fp8", device=same, db=h100_db).source == "tuned"
    other_memory = dict(H100_ARG, memory_total_mib=95830)  # an H100 NVL-like memory class
    assert mla_tune.lookup(64, "fp8", device=other_memory, db=h100_db).source == "fallback"
    mig = dict(H100_ARG, mig_profile="3g.40gb")
    assert mla_tune.lookup(64, "fp8", device=mig, db=h100_db).source == "fallback"


def test_another_gpu_or_key_gets_the_static_fallback_with_why(h100_db):
    h200 = mla_tune.lookup(64, "fp8", device=H200_ARG, db=h100_db)
    assert h200.source == "fallback" and "no tuned decision" in h200.why
    other_heads = mla_tune.lookup(32, "fp8", device=H100_ARG, db=h100_db)
    assert other_heads.source == "fallback" and "32 heads" in other_heads.why
    assert other_heads.warnings == ()
    sparse = mla_tune.lookup(64, "fp8", device=H100_ARG, db=h100_db, sparse=True)
    assert sparse.source == "fallback" and sparse.key["topk"] == 2048


def test_fallback_reasons_explain_each_eligible_backend(h100_db):
    choice = mla_tune.lookup(16, "bf16", device=H100_ARG, db=h100_db)
    assert choice.source == "fallback" and choice.backend == choice.static_choice
    for name, texts in choice.reasons.items():
        assert texts and all(isinstance(t, str) and t for t in texts), name
    assert "not in vLLM's static priority list" in choice.reasons["FLASHINFER_FA3_MLA"][0]


def test_stale_fingerprint_falls_back_and_names_the_difference(tmp_path):
    old = replace(current_fingerprint(driver_version=H100.driver_version), torch="2.9.0+cu128")
    url = tuned_db(tmp_path / "stale.db", decision_for(H100, fingerprint=old))
    choice = mla_tune.lookup(64, "fp8", device=H100_ARG, db=url)
    assert choice.source == "fallback"
    assert "torch" in choice.why and "2.9.0+cu128" in choice.why and "re-run `mla-tune`" in choice.why


def test_newest_compatible_decision_wins(tmp_path):
    old = replace(current_fingerprint(driver_version=H100.driver_version), triton="3.4.0")
    url = tuned_db(tmp_path / "two.db", decision_for(H100, fingerprint=old, winner="TRITON_MLA",
                                                      decided_at="2026-11-23T00:00:00Z"))
    with Store.open(url) as store:
        store.save_decision(decision_for(H100))
    assert mla_tune.lookup(64, "fp8", device=H100_ARG, db=url).backend == "FLASHINFER_FA3_MLA"


def test_driver_is_compared_only_when_known(tmp_path):
    url = tuned_db(tmp_path / "drv.db", decision_for(H100))
    assert mla_tune.lookup(64, "fp8", device=dict(H100_ARG, driver_version="580.65.06"), db=url).source == "tuned"
    clear_cache()
    newer = mla_tune.lookup(64, "fp8", device=dict(H100_ARG, driver_version="590.1"), db=url)
    assert newer.source == "fallback" and "driver" in newer.why


def test_memoised_returns_the_same_object(h100_db):
    first = mla_tune.lookup(64, "fp8", device=H100_ARG, db=h100_db)
    assert mla_tune.lookup(64, "fp8", device=dict(H100_ARG), db=h100_db) is first
    with pytest.raises(TypeError):
        first.reasons["X"] = ("mutated",)  # a memoised answer cannot be changed by one caller


def test_lookup_imports_no_gpu_library(h100_db):
    mla_tune.lookup(64, "fp8", device=H100_ARG, db=h100_db)
    # torch may be loaded by conftest in this process; the subprocess test in test_import_cost.py
    # checks a clean interpreter. Here: the lookup did not need flashinfer.
    assert "flashinfer" not in sys.modules


# --- invalid arguments ---------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, text", [
    (dict(num_heads=0, kv_cache_dtype="fp8"), "num_heads"),
    (dict(num_heads=-4, kv_cache_dtype="fp8"), "num_heads"),
    (dict(num_heads=64.0, kv_cache_dtype="fp8"), "num_heads"),
    (dict(num_heads="64", kv_cache_dtype="fp8"), "num_heads"),
    (dict(num_heads=True, kv_cache_dtype="fp8"), "num_heads"),
    (dict(num_heads=64, kv_cache_dtype="fp7"), "unknown kv_cache_dtype"),
    (dict(num_heads=64, kv_cache_dtype=None), "kv_cache_dtype"),
    (dict(num_heads=64, kv_cache_dtype="fp8", query_dtype="fp32"), "query dtype"),
    (dict(num_heads=64, kv_cache_dtype="fp8", page_size=0), "page_size"),
    (dict(num_heads=64, kv_cache_dtype="fp8", device={"name": "X", "compute_capability": "nine"}),
     "compute capability"),
    (dict(num_heads=64, kv_cache_dtype="fp8", device={"name": "X", "compute_capability": (9, 0, 1)}),
     "compute capability"),
    (dict(num_heads=64, kv_cache_dtype="fp8", device={"compute_capability": (9, 0)}), "name"),
    (dict(num_heads=64, kv_cache_dtype="fp8", device={"name": "X"}), "compute_capability"),
    (dict(num_heads=64, kv_cache_dtype="fp8", device={"name": "X", "compute_capability": (9, 0), "colour": 1}),
     "colour"),
    (dict(num_heads=64, kv_cache_dtype="fp8", device="H100"), "device"),
    (dict(num_heads=64, kv_cache_dtype="fp8", sparse="yes"), "sparse"),
])
def test_invalid_arguments_raise_value_error(kwargs, text, tmp_path):
    kwargs.setdefault("device", H100_ARG)
    with pytest.raises(ValueError, match=text):
        mla_tune.lookup(db=f"sqlite:///{tmp_path / 'none.db'}", **kwargs)
    assert not (tmp_path / "none.db").exists()


def test_bool_heads_is_not_served_from_the_memo_of_one(h100_db):
    mla_tune.lookup(1, "bf16", device=H100_ARG, db=h100_db)
    with pytest.raises(ValueError):
        mla_tune.lookup(True, "bf16", device=H100_ARG, db=h100_db)


def test_no_gpu_and_no_device_is_a_clear_value_error(no_gpu):
    with pytest.raises(NoDeviceError, match="pass device=") as info:
        mla_tune.lookup(64, "fp8")
    assert isinstance(info.value, ValueError) and "no NVIDIA GPU found" in info.value.detail


def test_device_none_probes_the_local_gpu(monkeypatch, h100_db):
    import nvml_fake

    fake = nvml_fake.FakeNVML([nvml_fake.gpu()], driver=H100.driver_version)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    choice = mla_tune.lookup(64, "fp8", db=h100_db)
    assert (choice.backend, choice.source) == ("FLASHINFER_FA3_MLA", "tuned")
    mla_tune.lookup(16, "fp8", db=h100_db)
    assert fake.initialized == 1  # probed once per process


def test_nothing_eligible_lists_every_backend(tmp_path):
    a100 = {"name": "NVIDIA A100-SXM4-80GB", "compute_capability": (8, 0)}
    with pytest.raises(NoEligibleBackendError) as info:
        mla_tune.lookup(128, "bf16", sparse=True, device=a100, db=f"sqlite:///{tmp_path / 'x.db'}")
    for name in ("FLASH_ATTN_MLA", "FLASHMLA", "FLASHINFER_MLA", "TRITON_MLA", "FLASHMLA_SPARSE"):
        assert name in str(info.value)


# --- store failure modes: fallback, one warning, nothing written ---------------------------------------

def _fallback_with_warning(url, caplog, text):
    with caplog.at_level(logging.WARNING, logger="mla_tune"):
        choice = mla_tune.lookup(64, "fp8", device=H100_ARG, db=url)
        again = mla_tune.lookup(32, "fp8", device=H100_ARG, db=url)
    assert choice.source == again.source == "fallback"
    assert choice.backend == choice.static_choice
    assert choice.warnings and text in choice.warnings[0], choice.warnings
    assert text in choice.why
    records = [r for r in caplog.records if r.name == "mla_tune"]
    assert len(records) == 1, "a store problem is logged once per process"
    assert "\n" not in records[0].getMessage()
    return choice


def snapshot(path):
    """The stored bytes at `path`: the file, its WAL and journal (an empty WAL, which SQLite creates
    for any reader of a WAL database, counts as none)."""
    return {p: (open(p, "rb").read() or None if os.path.isfile(p) else None)
            for p in (str(path), f"{path}-wal", f"{path}-journal")}


def test_missing_file_is_not_created(tmp_path, caplog):
    path = tmp_path / "sub" / "missing.db"
    _fallback_with_warning(f"sqlite:///{path}", caplog, "no database at")
    assert not path.exists() and not path.parent.exists()


def test_empty_file(tmp_path, caplog):
    path = tmp_path / "empty.db"
    path.write_bytes(b"")
    _fallback_with_warning(f"sqlite:///{path}", caplog, "empty file")
    assert path.read_bytes() == b""


def test_not_an_sqlite_file(tmp_path, caplog):
    path = tmp_path / "garbage.db"
    data = os.urandom(8192)
    path.write_bytes(data)
    _fallback_with_warning(f"sqlite:///{path}", caplog, "not an SQLite database")
    assert path.read_bytes() == data


def test_truncated_database(tmp_path, caplog):
    path = tmp_path / "truncated.db"
    tuned_db(path, *[decision_for(H100, heads=h) for h in (16, 32, 64, 128)])
    with closing(sqlite3.connect(path)) as connection, connection:  # fold the WAL into the file, then cut it
        connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    for suffix in ("-wal", "-shm"):
        if os.path.exists(f"{path}{suffix}"):
            os.remove(f"{path}{suffix}")
    before = snapshot(path)
    _fallback_with_warning(f"sqlite:///{path}", caplog, "truncated")
    assert snapshot(path) == before


def test_directory_at_the_path(tmp_path, caplog):
    path = tmp_path / "adir.db"
    path.mkdir()
    _fallback_with_warning(f"sqlite:///{path}", caplog, "is a directory")
    assert path.is_dir() and not any(path.iterdir())


def test_sqlite_file_of_something_else(tmp_path, caplog):
    path = tmp_path / "other.db"
    with closing(sqlite3.connect(path)) as connection, connection:
        connection.execute("CREATE TABLE notes (text TEXT)")
    before = snapshot(path)
    _fallback_with_warning(f"sqlite:///{path}", caplog, "no mla-tune tables")
    assert snapshot(path) == before


def test_newer_schema(tmp_path, caplog):
    path = tmp_path / "future.db"
    tuned_db(path, decision_for(H100))
    with closing(sqlite3.connect(path)) as connection, connection:
        connection.execute("UPDATE alembic_version SET version_num = '9999_from_the_future'")
    before = snapshot(path)
    choice = _fallback_with_warning(f"sqlite:///{path}", caplog, "9999_from_the_future")
    assert "newer" in choice.warnings[0] or "upgrade" in choice.warnings[0]
    assert snapshot(path) == before


def test_read_only_file_still_serves_and_is_not_modified(tmp_path):
    path = tmp_path / "ro.db"
    tuned_db(path, decision_for(H100))
    with closing(sqlite3.connect(path)) as connection, connection:
        connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    os.chmod(path, 0o444)
    before = snapshot(path)
    try:
        choice = mla_tune.lookup(64, "fp8", device=H100_ARG, db=f"sqlite:///{path}")
    finally:
        os.chmod(path, 0o644)
    assert choice.source == "tuned"
    assert snapshot(path) == before


def test_a_writer_holding_the_lock_does_not_block_readers_in_wal(tmp_path):
    path = tmp_path / "busy.db"
    url = tuned_db(path, decision_for(H100))
    writer = sqlite3.connect(path, isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")
    writer.execute("UPDATE decisions SET winner = winner")
    try:
        started = time.monotonic()
        choice = mla_tune.lookup(64, "fp8", device=H100_ARG, db=url)
        assert time.monotonic() - started < 1.0
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    assert choice.source == "tuned"


def test_exclusively_locked_rollback_journal_database_falls_back(tmp_path, caplog):
    path = tmp_path / "locked.db"
    tuned_db(path, decision_for(H100))
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("PRAGMA journal_mode = DELETE")
    holder.execute("PRAGMA locking_mode = EXCLUSIVE")
    holder.execute("BEGIN EXCLUSIVE")
    holder.execute("UPDATE decisions SET winner = winner")
    try:
        started = time.monotonic()
        _fallback_with_warning(f"sqlite:///{path}", caplog, "locked")
        assert time.monotonic() - started < 10
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def test_unreachable_postgresql_falls_back_quickly_without_leaking_the_password(caplog):
    pytest.importorskip("psycopg")
    url = "postgresql://tuner:s3cret-pw@127.0.0.1:9/mla"  # port 9 (discard): nothing listens
    started = time.monotonic()
    choice = _fallback_with_warning(url, caplog, "PostgreSQL")
    assert time.monotonic() - started < 6  # two lookups, each bounded by the 2 s connect timeout
    assert "s3cret-pw" not in choice.warnings[0] and "s3cret-pw" not in caplog.text


def test_malformed_url_in_python_is_a_store_warning_not_an_exception(caplog):
    with caplog.at_level(logging.WARNING, logger="mla_tune"):
        choice = mla_tune.lookup(64, "fp8", device=H100_ARG, db="mysql://somewhere/db")
    assert choice.source == "fallback" and choice.warnings


def test_tuned_choice_reports_the_stored_key_and_skips_unknown_winners(tmp_path):
    url = tuned_db(tmp_path / "k.db", decision_for(H100))
    choice = mla_tune.lookup(64, "fp8", device=H100_ARG, db=url)
    assert choice.key["sku"] == H100.sku  # the full SKU it was tuned on, though only name and cc were given
    with closing(sqlite3.connect(tmp_path / "k.db")) as connection, connection:
        connection.execute("UPDATE decisions SET winner = 'SOME_FUTURE_MLA'")
    clear_cache()
    choice = mla_tune.lookup(64, "fp8", device=H100_ARG, db=url)
    assert choice.source == "fallback" and "SOME_FUTURE_MLA" in choice.why


def test_packages_missing_from_the_looking_up_process_are_not_judged(tmp_path, monkeypatch):
    # An init container or a CLI venv without torch looks up for the engine beside it: what it
    # cannot know is not compared, while what it knows (our kernel sources) still must match.
    stored = replace(current_fingerprint(driver_version=H100.driver_version), torch="2.11.0+cu130",
                     triton="3.6.0", flashinfer="0.7.2.post1")
    url = tuned_db(tmp_path / "initc.db", decision_for(H100, fingerprint=stored))
    here = replace(stored, torch="", triton="", flashinfer="")
    monkeypatch.setattr("mla_tune.backends.software.current_fingerprint", lambda **_: here)
    assert mla_tune.lookup(64, "fp8", device=H100_ARG, db=url).source == "tuned"
    clear_cache()
    monkeypatch.setattr("mla_tune.backends.software.current_fingerprint",
                        lambda **_: replace(here, kernel_hash="0" * 16))
    stale = mla_tune.lookup(64, "fp8", device=H100_ARG, db=url)
    assert stale.source == "fallback" and "kernel_hash" in stale.why


# --- stored values changed behind mla-tune's back ----------------------------------------------

@pytest.mark.parametrize("assignment", ["margin = 'notanumber'", "margin = X'DEADBEEF'", "noise_margin = 'x'",
                                        "failures = '{\"FLASHMLA\": 7}'", "scores = '{not json'",
                                        "kept_static = 'maybe'", "winner = X'00'"])
def test_a_corrupt_stored_value_falls_back_and_says_which(h100_db, assignment, caplog):
    path = h100_db.removeprefix("sqlite:///")
    with closing(sqlite3.connect(path)) as connection, connection:
        connection.execute(f"UPDATE decisions SET {assignment}")
    column = assignment.split(" = ")[0]
    with caplog.at_level(logging.WARNING, logger="mla_tune"):
        choice = mla_tune.lookup(64, "fp8", device=H100_ARG, db=h100_db)
    assert choice.source == "fallback" and "corrupt row" in choice.why and column in choice.why, choice.why
    assert len(caplog.records) == 1


def test_the_logged_warning_escapes_control_characters(tmp_path, caplog):
    path = tmp_path / "tuned.db"
    url = tuned_db(path, decision_for(H100))
    with closing(sqlite3.connect(path)) as connection, connection:
        connection.execute("UPDATE decisions SET margin = ?", ("\x1b[2J\nmla-tune: error: forged",))
    with caplog.at_level(logging.WARNING, logger="mla_tune"):
        choice = mla_tune.lookup(64, "fp8", device=H100_ARG, db=url)
    assert choice.source == "fallback"
    assert choice.source == "fallback" and len(caplog.records) == 1
    logged = caplog.records[0].getMessage()
    assert "\x1b" not in logged and "\n" not in logged and "\\x1b[2J" in logged
