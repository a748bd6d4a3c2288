"""CLI test set-up: a private data directory and store per test, a fresh lookup memo, helpers."""

from __future__ import annotations

import pytest

from mla_tune.runtime import clear_cache


@pytest.fixture(autouse=True)
def isolated_store(tmp_path, monkeypatch):
    """Point the default store and the user's data directory into `tmp_path`; never touch the real ones."""
    data = tmp_path / "xdg-data"
    monkeypatch.setenv("XDG_DATA_HOME", str(data))
    monkeypatch.delenv("MLA_TUNE_DB", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    clear_cache()
    yield data
    clear_cache()


@pytest.fixture
def cli():
    """Invoke `mla-tune ARGS...` in-process; returns click's Result (stdout and stderr separate)."""
    from click.testing import CliRunner

    from mla_tune.cli.main import main

    runner = CliRunner()

    def invoke(*args, env=None):
        return runner.invoke(main, [str(a) for a in args], env=env, catch_exceptions=False)

    return invoke


@pytest.fixture
def files_under():
    """files_under(path) -> {relative path: bytes} of every file and directory under `path`.

    SQLite's `-shm` file and an empty `-wal` are left out: any reader of a WAL
    database may create them, and they hold no stored data.
    """
    def stored(p) -> bool:
        return not (p.name.endswith("-shm") or (p.name.endswith("-wal") and p.stat().st_size == 0))

    def snapshot(path) -> dict:
        return {str(p.relative_to(path)): (p.read_bytes() if p.is_file() else "<dir>")
                for p in sorted(path.rglob("*")) if stored(p)}
    return snapshot
