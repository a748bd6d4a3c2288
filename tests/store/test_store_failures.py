"""Stores that cannot be used, on real files and servers: one clear StoreError, nothing modified.

Each case is checked for both the writer (`Store.open`) and the read-only
lookup path (`find_decisions`), which must never create or modify anything.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
from store_samples import FP, H100, decision, dump, file_digest, key, measurement

from mla_tune.store.schema import HEAD_REVISION
from mla_tune.store.engine import StoreError
from mla_tune.store.readonly import find_decisions
from mla_tune.store.repository import Store


def _assert_one_line(exc: BaseException) -> str:
    text = str(exc)
    assert text and "\n" not in text and "Traceback" not in text
    return text


def _store_with_data(path) -> str:
    url = f"sqlite:///{path}"
    with Store.open(url) as store:
        for heads in range(8, 136, 8):  # enough rows for a database of several pages
            store.save_decision(decision(key(num_heads=heads)))
            run_id = store.start_run(device=H100, fingerprint=FP, preset="quick", node="n")
            for kv_len in (1024, 4096, 16384, 65536):
                store.add_measurement(run_id, measurement(key(num_heads=heads), kv_len=kv_len))
    return url


@contextlib.contextmanager
def read_only(path):
    """Make a file or directory read-only, also for root (who ignores modes) via `chattr +i`."""
    mode = os.stat(path).st_mode & 0o7777
    os.chmod(path, 0o555 if os.path.isdir(path) else 0o444)
    immutable = False
    try:
        if os.geteuid() == 0:
            chattr = shutil.which("chattr")
            immutable = bool(chattr) and subprocess.run([chattr, "+i", str(path)],
                                                        capture_output=True).returncode == 0
            if not immutable:
                pytest.skip("running as root where `chattr +i` is unavailable: cannot make a path read-only")
        yield
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(path)], check=True)
        os.chmod(path, mode)


def test_missing_file_is_not_created_by_a_read(tmp_path):
    path = tmp_path / "data" / "mla.db"
    with pytest.raises(StoreError, match=f"no database at {path}"):
        find_decisions(f"sqlite:///{path}", sku=H100.sku)
    with pytest.raises(StoreError, match=f"no database at {path}"):
        Store.open(f"sqlite:///{path}", create=False)
    assert not (tmp_path / "data").exists()


def test_empty_file(tmp_path):
    path = tmp_path / "empty.db"
    path.write_bytes(b"")
    with pytest.raises(StoreError, match="is an empty file, not an mla-tune database") as info:
        find_decisions(f"sqlite:///{path}", sku=H100.sku)
    _assert_one_line(info.value)
    assert path.read_bytes() == b""
    # A writer treats an empty file as a new database, as SQLite itself does.
    with Store.open(f"sqlite:///{path}") as store:
        assert store.schema_revision() == HEAD_REVISION


# Seeded random bytes: the ids are the same in every pytest-xdist worker.
@pytest.mark.parametrize("content", [random.Random(7).randbytes(4096), b"name,heads\nTRITON_MLA,16\n" * 50, b"x"],
                         ids=["random-bytes", "csv", "one-byte"])
def test_not_an_sqlite_file_is_left_untouched(tmp_path, content):
    path = tmp_path / "notes.db"
    path.write_bytes(content)
    for attempt in (lambda: find_decisions(f"sqlite:///{path}", sku=H100.sku),
                    lambda: Store.open(f"sqlite:///{path}"),
                    lambda: Store.open(f"sqlite:///{path}", create=False)):
        with pytest.raises(StoreError, match="is not an SQLite database") as info:
            attempt()
        _assert_one_line(info.value)
    assert path.read_bytes() == content
    assert sorted(os.listdir(tmp_path)) == ["notes.db"]


def test_sqlite_database_of_something_else(tmp_path):
    import sqlite3

    path = tmp_path / "other.db"
    with sqlite3.connect(path) as connection:
        connection.execute("CREATE TABLE photos (id INTEGER PRIMARY KEY, name TEXT)")
    with pytest.raises(StoreError, match="has no mla-tune tables"):
        find_decisions(f"sqlite:///{path}", sku=H100.sku)


@pytest.mark.parametrize("cut", ["page_boundary", "mid_page"])
def test_truncated_database_is_left_untouched(tmp_path, cut):
    path = tmp_path / "mla.db"
    url = _store_with_data(path)
    size = path.stat().st_size
    assert size >= 8 * 4096, size
    new_size = (size // 2) // 4096 * 4096 if cut == "page_boundary" else size // 2 + 123
    with open(path, "r+b") as f:
        f.truncate(new_size)
    digest = file_digest(str(path))
    for attempt in (lambda: find_decisions(url, sku=H100.sku), lambda: Store.open(url)):
        with pytest.raises(StoreError, match="truncated") as info:
            attempt()
        _assert_one_line(info.value)
    assert file_digest(str(path)) == digest


def test_corrupt_schema_page_is_left_untouched(tmp_path):
    path = tmp_path / "mla.db"
    url = _store_with_data(path)
    with open(path, "r+b") as f:
        f.seek(100)                       # keep the 100-byte header, garble the schema page
        f.write(os.urandom(4096 - 100))
    digest = file_digest(str(path))
    for attempt in (lambda: find_decisions(url, sku=H100.sku), lambda: Store.open(url)):
        with pytest.raises(StoreError, match="is corrupt or truncated|is not an SQLite database") as info:
            attempt()
        _assert_one_line(info.value)
    assert file_digest(str(path)) == digest


def test_directory_at_the_path(tmp_path):
    path = tmp_path / "mla.db"
    path.mkdir()
    for attempt in (lambda: find_decisions(f"sqlite:///{path}", sku=H100.sku),
                    lambda: Store.open(f"sqlite:///{path}")):
        with pytest.raises(StoreError, match="is a directory, not an SQLite database file"):
            attempt()
    assert os.listdir(path) == []


def test_data_directory_that_cannot_be_created(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the data directory should be")
    monkeypatch.delenv("MLA_TUNE_DB", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(blocker))
    with pytest.raises(StoreError, match="cannot create the data directory") as info:
        Store.open()   # only the default location gets its directory made
    _assert_one_line(info.value)


def test_a_named_path_whose_directory_is_missing_creates_nothing(tmp_path):
    from mla_tune.store.sqlite_file import StorePathError

    with pytest.raises(StorePathError, match="does not exist") as info:
        Store.open(f"sqlite:///{tmp_path}/missing/dir/mla.db")
    _assert_one_line(info.value)
    assert os.listdir(tmp_path) == []


def test_read_only_file_reads_but_refuses_writes(tmp_path):
    path = tmp_path / "mla.db"
    url = _store_with_data(path)
    digest = file_digest(str(path))
    with read_only(path):
        assert len(find_decisions(url, sku=H100.sku)) == 16
        with Store.open(url) as store:               # at head: opening needs no write
            assert len(store.decisions()) == 16
            with pytest.raises(StoreError, match="is read-only") as info:
                store.save_decision(decision(key(num_heads=256)))
            _assert_one_line(info.value)
    assert file_digest(str(path)) == digest


def test_read_only_directory(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    url = _store_with_data(folder / "mla.db")
    digest = file_digest(str(folder / "mla.db"))
    with read_only(folder):
        # The lookup still reads a WAL database it cannot create the -shm file for.
        assert len(find_decisions(url, sku=H100.sku)) == 16
        with pytest.raises(StoreError) as info:
            Store.open(f"sqlite:///{folder}/new.db")
        assert "cannot" in _assert_one_line(info.value)
    assert sorted(os.listdir(folder)) == ["mla.db"]
    assert file_digest(str(folder / "mla.db")) == digest


_HOLD_LOCK = textwrap.dedent("""
    import sqlite3, sys
    connection = sqlite3.connect(sys.argv[1], isolation_level=None)
    connection.execute("BEGIN EXCLUSIVE")
    connection.execute("DELETE FROM decisions")      # uncommitted: nobody else may see this
    print("locked", flush=True)
    sys.stdin.read()                                 # hold until the test closes our stdin
    connection.execute("ROLLBACK")
""")


@contextlib.contextmanager
def locked_by_another_process(path):
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        yield
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


def test_locked_database_writers_wait_then_fail_readers_still_read(tmp_path):
    path = tmp_path / "mla.db"
    url = _store_with_data(path)
    before = dump(url)
    with locked_by_another_process(path):
        assert len(find_decisions(url, sku=H100.sku)) == 16   # WAL: readers see the last commit
        with Store.open(url, busy_timeout_s=0.5) as store:
            assert len(store.decisions()) == 16
            started = time.monotonic()
            with pytest.raises(StoreError, match="is locked by another process after waiting 0.5 s") as info:
                store.save_decision(decision(key(num_heads=256)))
            waited_s = time.monotonic() - started
            _assert_one_line(info.value)
    assert 0.4 <= waited_s < 5, waited_s
    assert dump(url) == before


def test_writer_waits_for_a_short_lock(tmp_path):
    """Writers queue on the busy timeout: a lock released in time is no error."""
    path = tmp_path / "mla.db"
    url = _store_with_data(path)
    with Store.open(url, busy_timeout_s=10) as store:
        with locked_by_another_process(path):
            import threading

            done = []
            writer = threading.Thread(target=lambda: done.append(store.save_decision(decision(key(num_heads=512)))))
            writer.start()
            time.sleep(0.5)
            assert not done
        writer.join(timeout=15)
        assert done and store.decision(key(num_heads=512)) is not None


def test_failing_write_leaves_the_database_as_before(store_url):
    with Store.open(store_url) as store:
        store.save_decision(decision(key(num_heads=8)))
        before = dump(store_url)
        broken = measurement(key(num_heads=16))
        object.__setattr__(broken, "batch_size", None)   # NOT NULL in the schema
        with pytest.raises(StoreError) as info:
            with store.batch():
                store.save_decision(decision(key(num_heads=16)))
                store.add_measurement(None, broken)
        _assert_one_line(info.value)
        with pytest.raises(StoreError):
            store.add_measurement(None, broken)
        assert dump(store_url) == before
        assert [d.key.num_heads for d in store.decisions()] == [8]


@contextlib.contextmanager
def _postgres_port(kind: str):
    """A local port with nothing listening, or with a silent server that accepts and never answers."""
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        if kind == "silent":
            listener.listen(16)   # the kernel completes the handshake; nobody ever replies
        port = listener.getsockname()[1]
        if kind == "nothing":
            listener.close()
        yield port


@pytest.mark.parametrize("kind, least_s", [("nothing", 0.0), ("silent", 1.5)])
def test_unreachable_postgres_fails_within_the_connect_timeout(kind, least_s):
    with _postgres_port(kind) as port:
        url = f"postgresql://tuner:Sup3r-Secret@127.0.0.1:{port}/mla"
        for attempt in (lambda: Store.open(url), lambda: find_decisions(url, sku=H100.sku)):
            started = time.monotonic()
            with pytest.raises(StoreError, match="cannot reach the PostgreSQL server at") as info:
                attempt()
            assert least_s <= time.monotonic() - started < 4
            text = _assert_one_line(info.value)
            assert "Sup3r-Secret" not in text and "tuner:***@" in text


@pytest.mark.postgres
def test_wrong_postgres_password_is_not_printed(pg_url):
    from sqlalchemy.engine import make_url

    url = make_url(pg_url).set(password="Wr0ng-Passw0rd").render_as_string(hide_password=False)
    for attempt in (lambda: Store.open(url), lambda: find_decisions(url, sku=H100.sku)):
        with pytest.raises(StoreError) as info:
            attempt()
        text = _assert_one_line(info.value)
        assert "Wr0ng-Passw0rd" not in text and "pg-s3cret-Pw" not in text
        assert "password authentication failed" in text


@pytest.mark.postgres
def test_postgres_password_from_the_environment_or_a_pgpass_file(pg_url, tmp_path, monkeypatch):
    """Credentials need not be in the URL: libpq reads PGPASSWORD and PGPASSFILE."""
    from sqlalchemy.engine import make_url

    parsed = make_url(pg_url)
    bare = parsed.set(password=None).render_as_string(hide_password=False)
    monkeypatch.setenv("PGPASSWORD", parsed.password)
    with Store.open(bare) as store:
        store.save_decision(decision(key()))
    monkeypatch.delenv("PGPASSWORD")
    passfile = tmp_path / "pgpass"
    passfile.write_text(f"{parsed.host}:{parsed.port}:{parsed.database}:{parsed.username}:{parsed.password}\n")
    passfile.chmod(0o600)
    monkeypatch.setenv("PGPASSFILE", str(passfile))
    assert [d.winner for d in find_decisions(bare, sku=H100.sku)] == ["FLASHINFER_FA3_MLA"]


@pytest.mark.postgres
def test_missing_postgres_database_is_named(pg_url):
    from sqlalchemy.engine import make_url

    url = make_url(pg_url).set(database="no_such_db").render_as_string(hide_password=False)
    for attempt in (lambda: Store.open(url), lambda: find_decisions(url, sku=H100.sku)):
        with pytest.raises(StoreError, match="has no such database .*no_such_db.* does not exist") as info:
            attempt()
        assert "pg-s3cret-Pw" not in _assert_one_line(info.value)
