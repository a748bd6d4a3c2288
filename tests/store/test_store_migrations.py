"""Alembic migrations on real SQLite and PostgreSQL databases."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.pool import NullPool
from store_samples import decision, dump, file_digest, key

from mla_tune.store.engine import StoreError, resolve_url
from mla_tune.store.migrate import alembic_config
from mla_tune.store.models import Base
from mla_tune.store.readonly import find_decisions
from mla_tune.store.repository import Store
from mla_tune.store.schema import HEAD_REVISION, KNOWN_REVISIONS

TABLES = {"alembic_version", "devices", "fingerprints", "runs", "measurements", "decisions"}


def _tables(url: str) -> set[str]:
    engine = create_engine(resolve_url(url), poolclass=NullPool)
    try:
        with engine.connect() as connection:
            return set(inspect(connection).get_table_names())
    finally:
        engine.dispose()


def _set_revision(url: str, revision: str) -> None:
    engine = create_engine(resolve_url(url), poolclass=NullPool)
    with engine.begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = :r"), {"r": revision})
    engine.dispose()


def test_known_revisions_match_the_migration_scripts():
    from alembic.script import ScriptDirectory

    scripts = ScriptDirectory.from_config(alembic_config())
    assert scripts.get_heads() == [HEAD_REVISION]
    chain = [s.revision for s in scripts.walk_revisions("base", "heads")]
    assert list(reversed(chain)) == list(KNOWN_REVISIONS)


def test_empty_database_migrates_to_head(store_url):
    with Store.open(store_url) as store:
        assert store.schema_revision() == HEAD_REVISION
    assert _tables(store_url) == TABLES


def test_migrations_produce_exactly_the_models(store_url):
    """No drift between `models.py` and the migration scripts (what autogenerate would find)."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    Store.open(store_url).close()
    engine = create_engine(resolve_url(store_url), poolclass=NullPool)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            assert compare_metadata(context, Base.metadata) == []
    finally:
        engine.dispose()


def test_downgrade_and_upgrade_round_trip(store_url):
    with Store.open(store_url) as store:
        store.downgrade("base")
        assert store.schema_revision() is None
        assert _tables(store_url) == {"alembic_version"}
        store.upgrade()
        assert store.schema_revision() == HEAD_REVISION
        store.save_decision(decision(key()))
        assert store.decision(key()) == decision(key())
    assert _tables(store_url) == TABLES


def test_reopening_a_migrated_store_keeps_its_data(store_url):
    with Store.open(store_url) as store:
        store.save_decision(decision(key()))
    before = dump(store_url)
    with Store.open(store_url) as store:
        store.upgrade()
        assert store.decision(key()) == decision(key())
    assert dump(store_url) == before


def test_newer_schema_is_refused_by_writer_and_reader_and_left_alone(store_url):
    with Store.open(store_url) as store:
        store.save_decision(decision(key()))
    _set_revision(store_url, "9999")
    before = dump(store_url)
    expected = (f"schema revision 9999, which is newer than this mla-tune \\(knows up to {HEAD_REVISION}\\); "
                "upgrade mla-tune")
    with pytest.raises(StoreError, match=expected):
        Store.open(store_url)
    with pytest.raises(StoreError, match=expected):
        find_decisions(store_url, sku=key().sku)
    assert dump(store_url) == before


def test_newer_schema_sqlite_file_bytes_unchanged(tmp_path):
    path = tmp_path / "newer.db"
    url = f"sqlite:///{path}"
    Store.open(url).close()
    _set_revision(url, "0002_from_the_future")
    digest = file_digest(str(path))
    with pytest.raises(StoreError, match="newer than this mla-tune"):
        Store.open(url)
    with pytest.raises(StoreError, match="newer than this mla-tune"):
        Store.open(url, create=False)
    assert file_digest(str(path)) == digest


def test_0003_merges_runs_duplicated_by_interleaved_imports_then_keeps_them_unique(store_url):
    """Two imports of one file used to store its run twice (with every measurement twice): upgrading
    merges them; afterwards the database itself refuses a second copy of a run."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.exc import IntegrityError
    from store_samples import FP, H100, key, measurement

    from mla_tune.store.engine import resolve_url

    with Store.open(store_url) as store:
        store.downgrade("0002")
        run_id = store.start_run(device=H100, fingerprint=FP, preset="quick", node="n")
        for kv_len in (1024, 2048, 4096):
            store.add_measurement(run_id, measurement(key(), kv_len=kv_len))
    engine = create_engine(resolve_url(store_url))
    copy_run = ("INSERT INTO runs (device_id, fingerprint_id, sku, preset, node, status, started_at, finished_at) "
                "SELECT device_id, fingerprint_id, sku, preset, node, status, started_at, finished_at FROM runs")
    with engine.begin() as connection:   # what the interleaved imports left: the run and its rows twice
        connection.execute(text(copy_run))
        second = connection.execute(text("SELECT max(id) FROM runs")).scalar()
        columns = [c for c in connection.execute(text("SELECT * FROM measurements")).keys() if c not in ("id", "run_id")]
        connection.execute(text(f"INSERT INTO measurements (run_id, {', '.join(columns)}) "
                                f"SELECT {second}, {', '.join(columns)} FROM measurements"))
    with Store.open(store_url) as store:
        assert store.schema_revision() == HEAD_REVISION
        assert len(store.runs()) == 1 and len(store.measurements()) == 3
    with pytest.raises(IntegrityError), engine.begin() as connection:
        connection.execute(text(copy_run))
    engine.dispose()
