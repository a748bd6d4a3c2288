"""The read-only lookup path: finds the same decisions the repository stored, writes nothing, stays cheap."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from store_samples import FP, FP_NEW, H100, H200, decision, dump, file_digest, key

from mla_tune.store.engine import StoreError
from mla_tune.store.readonly import find_decisions
from mla_tune.store.repository import Store


@pytest.fixture
def filled(store_url):
    with Store.open(store_url) as store:
        store.save_decision(decision(key(num_heads=16)))
        store.save_decision(decision(key(num_heads=16), "TRITON_MLA", fingerprint=FP_NEW,
                                     decided_at="2026-11-24T00:00:00.000+00:00"))
        store.save_decision(decision(key(num_heads=64, kv_cache_dtype="fp8_e4m3")))
        store.save_decision(decision(key(num_heads=16, device=H200)))
    return store_url


def test_finds_decisions_by_sku_and_key_fields_newest_first(filled):
    found = find_decisions(filled, sku=H100.sku, key_fields={"num_heads": 16, "kv_cache_dtype": "bf16"})
    assert [(d.winner, d.fingerprint) for d in found] == [("TRITON_MLA", FP_NEW), ("FLASHINFER_FA3_MLA", FP)]
    assert found[1] == decision(key(num_heads=16))          # every field survives the raw path
    assert find_decisions(filled, sku=H100.sku, key_fields={"num_heads": 128}) == []
    assert len(find_decisions(filled, sku=H100.sku)) == 3
    assert len(find_decisions(filled)) == 4


def test_finds_decisions_by_device_name_when_the_sku_is_not_known(filled):
    found = find_decisions(filled, device_name="NVIDIA H200", key_fields={"num_heads": 16})
    assert [d.key.sku for d in found] == [H200.sku]
    assert find_decisions(filled, device_name="NVIDIA H20", key_fields={"num_heads": 16}) == []


def test_reads_change_nothing(filled):
    before = dump(filled)
    for _ in range(3):
        find_decisions(filled, sku=H100.sku)
    assert dump(filled) == before


def test_sqlite_file_bytes_unchanged_by_reads(tmp_path):
    path = tmp_path / "mla.db"
    with Store.open(f"sqlite:///{path}") as store:
        store.save_decision(decision(key()))
    digest = file_digest(str(path))
    assert len(find_decisions(f"sqlite:///{path}", sku=H100.sku)) == 1
    assert file_digest(str(path)) == digest


def test_unknown_key_field_is_a_value_error(filled):
    with pytest.raises(ValueError, match="unknown decision key field 'heads'"):
        find_decisions(filled, key_fields={"heads": 16})


def test_unmigrated_database_is_a_store_error(tmp_path):
    import sqlite3

    path = tmp_path / "mla.db"
    with Store.open(f"sqlite:///{path}") as store:
        store.downgrade("base")
    with pytest.raises(StoreError, match="no mla-tune schema revision"):
        find_decisions(f"sqlite:///{path}")
    sqlite3.connect(path).execute("DROP TABLE alembic_version")
    with pytest.raises(StoreError, match="has no mla-tune tables"):
        find_decisions(f"sqlite:///{path}")


@pytest.mark.postgres
def test_postgres_database_without_tables_is_a_store_error(pg_url):
    with pytest.raises(StoreError, match="has no mla-tune tables") as info:
        find_decisions(pg_url)
    assert "pg-s3cret-Pw" not in str(info.value)


def test_sqlite_lookup_imports_no_sqlalchemy_alembic_or_torch(tmp_path):
    path = tmp_path / "mla.db"
    with Store.open(f"sqlite:///{path}") as store:
        store.save_decision(decision(key()))
    code = (
        "import json, sys\n"
        "from mla_tune.store.readonly import find_decisions\n"
        f"found = find_decisions({f'sqlite:///{path}'!r}, sku={H100.sku!r}, key_fields={{'num_heads': 16}})\n"
        "heavy = sorted(m for m in sys.modules\n"
        "               if m.split('.')[0] in ('sqlalchemy', 'alembic', 'torch', 'triton', 'psycopg'))\n"
        "print(json.dumps({'winners': [d.winner for d in found], 'heavy': heavy}))\n")
    env = {k: v for k, v in os.environ.items() if k != "MLA_TUNE_DB"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert json.loads(result.stdout) == {"winners": ["FLASHINFER_FA3_MLA"], "heavy": []}


@pytest.mark.parametrize("by", ["sku", "device_name"])
def test_lookup_query_searches_an_index(tmp_path, by):
    """Lookups stay fast on a fleet-sized table: SQLite searches an index, never scans decisions."""
    import sqlite3

    from mla_tune.store.readonly import _ORDER, _SELECT, _query

    path = tmp_path / "mla.db"
    Store.open(f"sqlite:///{path}").close()
    fields = {"num_heads": 16, "kv_cache_dtype": "bf16", "query_dtype": "bf16", "page_size": 64}
    sql, params = _query(_SELECT, _ORDER, "d", sku=H100.sku if by == "sku" else None, device_name=H100.name,
                         key_fields=fields)
    plan = " ".join(row[3] for row in sqlite3.connect(path).execute("EXPLAIN QUERY PLAN " + sql, params))
    assert "SEARCH d USING INDEX" in plan, plan


@pytest.mark.postgres
def test_postgres_lookup_imports_no_sqlalchemy_and_accepts_plain_urls(pg_url):
    with Store.open(pg_url) as store:
        store.save_decision(decision(key()))
    plain = pg_url.replace("postgresql+psycopg://", "postgresql://", 1)
    code = (
        "import json, sys\n"
        "from mla_tune.store.readonly import find_decisions\n"
        f"found = [d.winner for url in ({pg_url!r}, {plain!r}) for d in find_decisions(url, sku={H100.sku!r})]\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('sqlalchemy', 'alembic', 'torch'))\n"
        "print(json.dumps({'winners': found, 'heavy': heavy}))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(result.stdout) == {"winners": ["FLASHINFER_FA3_MLA"] * 2, "heavy": []}
