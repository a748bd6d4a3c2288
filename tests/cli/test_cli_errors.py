"""Bad input on the command line: one line on stderr, exit status 2, no traceback, nothing written."""

from __future__ import annotations

import pytest

H100 = ["--device-name", "NVIDIA H100 80GB HBM3", "--cc", "9.0"]

BAD = {
    "heads zero": ["lookup", "--heads", "0", "--kv-cache-dtype", "fp8", *H100],
    "heads negative": ["lookup", "--heads", "-2", "--kv-cache-dtype", "fp8", *H100],
    "heads not a number": ["lookup", "--heads", "many", "--kv-cache-dtype", "fp8", *H100],
    "heads missing": ["lookup", "--kv-cache-dtype", "fp8", *H100],
    "dtype unknown": ["lookup", "--heads", "64", "--kv-cache-dtype", "fp7", *H100],
    "dtype missing": ["lookup", "--heads", "64", *H100],
    "query dtype unknown": ["lookup", "--heads", "64", "--kv-cache-dtype", "fp8", "--query-dtype", "fp32", *H100],
    "cc malformed": ["lookup", "--heads", "64", "--kv-cache-dtype", "fp8", "--device-name", "X", "--cc", "nine"],
    "cc without name": ["lookup", "--heads", "64", "--kv-cache-dtype", "fp8", "--cc", "9.0"],
    "name without cc": ["lookup", "--heads", "64", "--kv-cache-dtype", "fp8", "--device-name", "NVIDIA H100"],
    "empty name": ["lookup", "--heads", "64", "--kv-cache-dtype", "fp8", "--device-name", " ", "--cc", "9.0"],
    "format unknown": ["lookup", "--heads", "64", "--kv-cache-dtype", "fp8", *H100, "--format", "xml"],
    "page size zero": ["lookup", "--heads", "64", "--kv-cache-dtype", "fp8", *H100, "--page-size", "0"],
    "unknown command": ["tunez"],
    "unknown option": ["lookup", "--heads", "64", "--kv-cache-dtype", "fp8", *H100, "--fast"],
    "backends bad cc": ["backends", "--cc", "9"],
    "backends bad dtype": ["backends", "--cc", "9.0", "--kv-cache-dtype", "int4"],
    "show bad option": ["show", "--yaml"],
    "db without action": ["db", "downgrade"],
}

BAD_DB_URLS = {
    "not a URL": "just some words",
    "unknown dialect": "mysql://user@host/db",
    "unknown driver": "sqlite+nosuchdriver:///x.db",
    "sqlite without a file": "sqlite://",
    "sqlite with a host": "sqlite://host/x.db",
}


def assert_usage_error(result):
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("mla-tune: error: ")
    assert "Traceback" not in result.output
    assert result.stdout == ""


@pytest.mark.parametrize("args", list(BAD.values()), ids=list(BAD))
def test_bad_arguments(cli, args, tmp_path, files_under):
    db = tmp_path / "store.db"
    before = files_under(tmp_path)
    assert_usage_error(cli("--db", f"sqlite:///{db}", *args))
    assert files_under(tmp_path) == before
    assert not db.exists()


@pytest.mark.parametrize("url", list(BAD_DB_URLS.values()), ids=list(BAD_DB_URLS))
@pytest.mark.parametrize("command", [["lookup", "--heads", "64", "--kv-cache-dtype", "fp8", *H100],
                                     ["show"], ["db", "upgrade"]], ids=["lookup", "show", "db-upgrade"])
def test_malformed_db_url(cli, url, command, tmp_path, files_under, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = files_under(tmp_path)
    result = cli("--db", url, *command)
    assert_usage_error(result)
    assert "--db" in result.stderr
    assert files_under(tmp_path) == before


def test_malformed_db_url_from_the_environment(cli, tmp_path, files_under):
    before = files_under(tmp_path)
    result = cli("show", env={"MLA_TUNE_DB": "mysql://user:pw@host/db"})
    assert_usage_error(result)
    assert "pw" not in result.stderr.replace("mysql", "")
    assert files_under(tmp_path) == before


def test_password_in_a_bad_url_is_masked(cli):
    result = cli("--db", "oracle://scott:tiger-secret@db.example/orcl", "show")
    assert_usage_error(result)
    assert "tiger-secret" not in result.stderr
