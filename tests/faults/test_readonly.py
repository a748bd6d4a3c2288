"""Commands that read write nothing: no tables created, no WAL switch, no header rewrite, no migration."""

from __future__ import annotations

import os
import sqlite3
import subprocess
from contextlib import closing

import pytest
from fault_helpers import export_file, filled_store, one_error_line, run_cli
from store_samples import file_digest

import mla_tune

DEVICE = {"name": "NVIDIA H100 80GB HBM3", "compute_capability": (9, 0)}


def _state(path) -> tuple:
    """Bytes and modification time of the file, and its companion files that hold data. A reader of a WAL
    database may create `-shm` (the shared-memory index) and an empty `-wal`: SQLite's own, holding nothing."""
    folder = os.path.dirname(path)
    companions = sorted(p for p in os.listdir(folder) if p.startswith(os.path.basename(path)) and not (
        p.endswith("-shm") or (p.endswith("-wal") and os.path.getsize(os.path.join(folder, p)) == 0)))
    return file_digest(str(path)), os.stat(path).st_mtime_ns, companions


def _read_commands(tmp_path, good):
    return [("show",), ("show", "--json"), ("export", "--out", tmp_path / "out.json"), ("import", "--check", good)]


@pytest.fixture
def good_export(tmp_path):
    return export_file(filled_store(f"sqlite:///{tmp_path / 'source.db'}"), tmp_path / "good.json")


def test_another_applications_sqlite_database_is_left_byte_for_byte(tmp_path, good_export):
    path = tmp_path / "other.db"
    with closing(sqlite3.connect(path)) as connection, connection:
        connection.execute("CREATE TABLE accounts (id INTEGER PRIMARY KEY, name TEXT)")
        connection.execute("INSERT INTO accounts (name) VALUES ('alice')")
    before = _state(path)
    for args in _read_commands(tmp_path, good_export):
        line = one_error_line(run_cli("--db", f"sqlite:///{path}", *args), 1)
        assert "has no mla-tune tables" in line, line
    assert _state(path) == before
    with closing(sqlite3.connect(path)) as connection:
        assert connection.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
        assert [r[0] for r in connection.execute("SELECT name FROM sqlite_master WHERE type='table'")] == ["accounts"]
    assert not (tmp_path / "out.json").exists()


def test_a_rollback_journal_store_is_read_without_rewriting_its_header(tmp_path, good_export):
    path = tmp_path / "mla.db"
    filled_store(f"sqlite:///{path}")
    with closing(sqlite3.connect(path)) as connection:
        connection.execute("PRAGMA journal_mode = DELETE")
    before = _state(path)
    for args in _read_commands(tmp_path, good_export):
        result = run_cli("--db", f"sqlite:///{path}", *args)
        assert result.returncode == 0, (args, result.stderr)
    assert _state(path) == before


def test_open_without_create_does_not_migrate_an_older_store(tmp_path):
    from mla_tune.store.engine import StoreError
    from mla_tune.store.repository import Store

    path = tmp_path / "old.db"
    with Store.open(f"sqlite:///{path}") as store:
        store.downgrade("0001")
    before = _state(path)
    with pytest.raises(StoreError, match="older than this mla-tune's .*run `mla-tune db upgrade`"):
        Store.open(f"sqlite:///{path}", create=False)
    assert _state(path) == before


@pytest.mark.postgres
def test_another_applications_postgres_database_gets_no_tables(pg_url, tmp_path, good_export):
    import psycopg

    conninfo = pg_url.replace("+psycopg", "")
    with psycopg.connect(conninfo, autocommit=True) as connection:
        connection.execute("CREATE TABLE accounts (id serial PRIMARY KEY, name text)")

    def catalog():
        with psycopg.connect(conninfo) as connection:
            return sorted(r[0] for r in connection.execute(
                "SELECT schemaname || '.' || tablename FROM pg_tables WHERE schemaname NOT IN "
                "('pg_catalog', 'information_schema')"))
    before = catalog()
    for args in _read_commands(tmp_path, good_export):
        line = one_error_line(run_cli("--db", pg_url, *args), 1)
        assert "has no mla-tune tables" in line, line
    assert catalog() == before == ["public.accounts"]


@pytest.mark.postgres
def test_postgres_read_commands_run_in_read_only_sessions(pg_url, tmp_path, good_export):
    from mla_tune.store.repository import Store

    filled_store(pg_url)
    with Store.open(pg_url, create=False) as store:
        with pytest.raises(Exception, match="read-only"):
            store.record_fingerprint(store.fingerprints()[0].__class__(torch="9"))


@pytest.fixture
def read_only_mount(tmp_path):
    """A directory on a tmpfs remounted read-only (root ignores directory modes); skipped where mounts fail."""
    mount = tmp_path / "ro"
    mount.mkdir()
    if os.geteuid() != 0:
        yield mount, lambda: os.chmod(mount, 0o555)
        os.chmod(mount, 0o755)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN) to make a read-only directory")
    try:
        yield mount, lambda: subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_wal_store_in_a_read_only_directory_is_read(read_only_mount):
    from store_samples import decision, key

    from mla_tune.backends.software import current_fingerprint
    from mla_tune.store.repository import Store

    folder, make_read_only = read_only_mount
    path = folder / "mla.db"
    with Store.open(f"sqlite:///{path}") as store:
        store.save_decision(decision(key(num_heads=16), fingerprint=current_fingerprint()))
    assert sorted(os.listdir(folder)) == ["mla.db"]    # WAL mode, checkpointed and closed: no -wal, no -shm
    make_read_only()
    choice = mla_tune.lookup(16, "bf16", device=DEVICE, db=f"sqlite:///{path}")
    assert choice.source == "tuned", choice.why
    result = run_cli("--db", f"sqlite:///{path}", "show")
    assert result.returncode == 0 and "FLASHINFER_FA3_MLA" in result.stdout, result.stderr
