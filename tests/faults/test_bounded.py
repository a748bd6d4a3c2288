"""Lookups and commands return in bounded time whatever holds the store: a table lock, a FIFO, a writer."""

from __future__ import annotations

import os
import sqlite3
import time
from contextlib import closing

import pytest
from fault_helpers import export_file, filled_store, one_error_line, run_cli

import mla_tune

DEVICE = {"name": "NVIDIA H100 80GB HBM3", "compute_capability": (9, 0)}


def test_lookup_and_every_command_refuse_a_fifo_at_once(tmp_path):
    fifo = tmp_path / "f.db"
    os.mkfifo(fifo)
    url = f"sqlite:///{fifo}"
    started = time.monotonic()
    choice = mla_tune.lookup(16, "bf16", device=DEVICE, db=url)
    assert choice.source == "fallback" and "FIFO" in choice.why
    assert time.monotonic() - started < 2
    export = tmp_path / "x.json"
    good = export_file(filled_store(f"sqlite:///{tmp_path / 'source.db'}"), tmp_path / "good.json")
    for args, code in ((("show",), 1), (("export", "--out", export), 1), (("db", "upgrade"), 1),
                       (("import", good), 1), (("import", "--check", good), 1),
                       (("lookup", "--heads", 16, "--kv-cache-dtype", "bf16", "--device-name", DEVICE["name"],
                         "--cc", "9.0"), 0)):
        result = run_cli("--db", url, *args, timeout_s=20)   # a hang is a TimeoutExpired
        if code:
            assert "is a FIFO (named pipe), not an SQLite database file" in one_error_line(result, code)
        else:
            assert result.returncode == 0 and "FIFO" in result.stderr
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith(("f.db", "x.json"))) == ["f.db"]


@pytest.mark.postgres
def test_postgres_table_lock_bounds_lookup_and_show(pg_url):
    import psycopg

    filled_store(pg_url)
    with psycopg.connect(pg_url.replace("+psycopg", "")) as holder:
        holder.execute("LOCK TABLE decisions IN ACCESS EXCLUSIVE MODE")   # held until the block ends
        started = time.monotonic()
        choice = mla_tune.lookup(16, "bf16", device=DEVICE, db=pg_url)
        waited_s = time.monotonic() - started
        assert choice.source == "fallback" and "locked" in choice.why, choice.why
        assert waited_s < 3, waited_s
        started = time.monotonic()
        line = one_error_line(run_cli("--db", pg_url, "show", timeout_s=30), 1)
        assert "locked" in line and time.monotonic() - started < 15
    mla_tune.runtime.clear_cache()
    # released: the store is read again (the sample decision was measured with other software than this)
    assert "measured with other software" in mla_tune.lookup(16, "bf16", device=DEVICE, db=pg_url).why


def test_sqlite_exclusive_lock_bounds_lookup(tmp_path):
    path = tmp_path / "mla.db"
    url = filled_store(f"sqlite:///{path}")
    with closing(sqlite3.connect(path, isolation_level=None)) as holder:
        holder.execute("PRAGMA journal_mode = DELETE")   # a rollback journal: an exclusive lock blocks readers
        holder.execute("BEGIN EXCLUSIVE")
        holder.execute("DELETE FROM decisions")
        started = time.monotonic()
        choice = mla_tune.lookup(16, "bf16", device=DEVICE, db=url)
        assert choice.source == "fallback" and "locked" in choice.why, choice.why
        assert time.monotonic() - started < 3.5
        holder.execute("ROLLBACK")


def test_a_writer_waits_the_busy_timeout_once_then_says_so(tmp_path):
    from store_samples import FP

    from mla_tune.store.engine import StoreError
    from mla_tune.store.repository import Store

    path = tmp_path / "mla.db"
    url = filled_store(f"sqlite:///{path}")
    with closing(sqlite3.connect(path, isolation_level=None)) as holder, \
            Store.open(url, busy_timeout_s=1) as store:
        holder.execute("BEGIN IMMEDIATE")
        started = time.monotonic()
        with pytest.raises(StoreError, match="locked by another process after waiting 1 s"):
            store.record_fingerprint(FP)
        assert time.monotonic() - started < 1.9   # one wait of the busy timeout, not two
        holder.execute("ROLLBACK")
