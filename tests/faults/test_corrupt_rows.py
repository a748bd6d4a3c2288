"""Rows changed behind mla-tune's back: lookup falls back and says why; show, export, import say one line."""

from __future__ import annotations

import pytest
from fault_helpers import export_file, filled_store

import mla_tune

DEVICE = {"name": "NVIDIA H100 80GB HBM3", "compute_capability": (9, 0)}

# (SET clause on the 16-head decision, what the message names); each broke lookup, show, export or import
SQLITE_ROWS = [
    ("margin = 'notanumber'", "margin"),
    ("margin = X'DEADBEEF'", "margin"),
    ("noise_margin = 'wide'", "noise_margin"),
    ("failures = '{\"FLASHMLA\": 5}'", "failures"),
    ("scores = '{not json'", "scores"),
    ("scores = '[1,2]'", "scores"),
    ("num_heads = 'abc'", "num_heads"),
    ("per_shape = '[{\"batch_size\": \"x\"}]'", "per_shape"),
    ("anomalies = '[1]'", "anomalies"),
]
POSTGRES_ROWS = [
    ("scores = '[1,2]'::json", "scores"),
    ("failures = '{\"FLASHMLA\": 5}'::json", "failures"),
    ("per_shape = '{\"a\": 1}'::json", "per_shape"),
    ("winner = NULL", "winner"),
]


def _corrupt(url: str, assignment: str) -> None:
    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    from mla_tune.store.engine import resolve_url

    engine = create_engine(resolve_url(url), poolclass=NullPool)
    with engine.begin() as connection:
        if engine.dialect.name == "postgresql":
            connection.execute(text("ALTER TABLE decisions ALTER COLUMN winner DROP NOT NULL"))
        connection.execute(text(f"UPDATE decisions SET {assignment} WHERE num_heads = 16"))
    engine.dispose()


def _check(url, assignment, column, cli, tmp_path):
    good = export_file(filled_store(url), tmp_path / "good.json")
    _corrupt(url, assignment)
    choice = mla_tune.lookup(16, "bf16", device=DEVICE, db=url)
    if column == "num_heads":   # the row no longer has the key looked up: nothing tuned for it
        assert choice.source == "fallback" and "no tuned decision" in choice.why
    else:
        assert choice.source == "fallback" and "corrupt row" in choice.why and column in choice.why, choice.why
    for args in (("show",), ("show", "--json"), ("export", "--out", tmp_path / "x.json"),
                 ("import", "--check", good), ("import", good)):
        result = cli("--db", url, *args)
        assert result.exit_code == 1, (args, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "corrupt row" in lines[0] and column in lines[0], (args, result.stderr)
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("assignment, column", SQLITE_ROWS, ids=[c for _, c in SQLITE_ROWS])
def test_sqlite_corrupt_value(assignment, column, cli, tmp_path):
    _check(f"sqlite:///{tmp_path / 'mla.db'}", assignment, column, cli, tmp_path)


@pytest.mark.postgres
@pytest.mark.parametrize("assignment, column", POSTGRES_ROWS, ids=[c for _, c in POSTGRES_ROWS])
def test_postgres_corrupt_value(assignment, column, pg_url, cli, tmp_path):
    _check(pg_url, assignment, column, cli, tmp_path)


@pytest.fixture
def cli():
    from click.testing import CliRunner

    from mla_tune.cli.main import main

    runner = CliRunner()
    return lambda *args: runner.invoke(main, [str(a) for a in args], catch_exceptions=False)
