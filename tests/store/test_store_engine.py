"""Store URLs: defaults, validation (one clear line, nothing created), password masking."""

from __future__ import annotations

import os

import pytest

from mla_tune.store.engine import default_url, mask_url, resolve_url
from mla_tune.store.repository import Store


def test_default_url_is_an_sqlite_file_in_the_user_data_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("MLA_TUNE_DB", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert default_url() == f"sqlite:///{tmp_path / 'xdg' / 'mla-tune' / 'mla-tune.db'}"
    assert not (tmp_path / "xdg").exists()  # naming the default creates nothing


def test_env_var_selects_the_store(monkeypatch, tmp_path):
    monkeypatch.setenv("MLA_TUNE_DB", f"sqlite:///{tmp_path}/env.db")
    assert default_url() == f"sqlite:///{tmp_path}/env.db"
    assert resolve_url(None) == f"sqlite:///{tmp_path}/env.db"
    with Store.open() as store:
        assert store.where == str(tmp_path / "env.db")
    assert (tmp_path / "env.db").is_file()


@pytest.mark.parametrize("url, canonical", [
    ("sqlite:////abs/x.db", "sqlite:////abs/x.db"),
    ("sqlite+pysqlite:////abs/x.db", "sqlite+pysqlite:////abs/x.db"),
    ("postgresql://u:pw@db.internal:5433/mla", "postgresql+psycopg://u:pw@db.internal:5433/mla"),
    ("postgresql+psycopg://u@db.internal/mla", "postgresql+psycopg://u@db.internal/mla"),
])
def test_resolve_url_normalises_supported_urls(url, canonical):
    assert resolve_url(url) == canonical


def test_relative_sqlite_path_becomes_absolute(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert resolve_url("sqlite:///rel/x.db") == f"sqlite:///{tmp_path}/rel/x.db"


@pytest.mark.parametrize("url, message", [
    ("not a url", "malformed database URL 'not a url'"),
    ("mysql://u@h/db", "unsupported database 'mysql'"),
    ("oracle+cx_oracle://u@h/db", "unsupported database 'oracle'"),
    ("postgresql+asyncpg://u:hunter2@h/db", "unsupported driver 'asyncpg' for postgresql"),
    ("sqlite://", "names no file"),
    ("sqlite:///:memory:", "names no file"),
    ("sqlite://host/x.db", "malformed SQLite URL"),
    ("postgresql:///db", "names no host"),
])
def test_bad_urls_are_one_line_value_errors_that_create_nothing(url, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=message) as info:
        Store.open(url)
    assert "\n" not in str(info.value)
    assert "hunter2" not in str(info.value)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("url, masked", [
    ("postgresql+psycopg://tuner:s3cret@db:5432/mla", "postgresql+psycopg://tuner:***@db:5432/mla"),
    ("postgresql://tuner:p%40ss@db/mla", "postgresql://tuner:***@db/mla"),
    ("postgresql://tuner@db/mla", "postgresql://tuner@db/mla"),
    ("sqlite:////tmp/x.db", "sqlite:////tmp/x.db"),
])
def test_mask_url_hides_passwords(url, masked):
    assert mask_url(url) == masked


def test_postgres_without_psycopg_says_what_to_install(monkeypatch):
    import sys

    from mla_tune.store.engine import StoreError
    from mla_tune.store.readonly import find_decisions

    monkeypatch.setitem(sys.modules, "psycopg", None)   # as if not installed
    for attempt in (lambda: Store.open("postgresql://tuner@db.internal/mla"),
                    lambda: find_decisions("postgresql://tuner@db.internal/mla")):
        with pytest.raises(StoreError, match=r"PostgreSQL stores need psycopg 3 .*pip install 'mla-tune\[postgres\]'"):
            attempt()
