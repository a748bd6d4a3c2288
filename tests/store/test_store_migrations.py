"""Alembic migrations on real SQLite and PostgreSQL databases."""

from __future__ import annotations

from dataclasses import replace

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


def test_our_kernels_stored_under_vllms_triton_name_are_renamed_and_never_handed_to_vllm(store_url):
    """Before revision 0004 our Triton kernel was stored as TRITON_MLA, vLLM's name for its own kernel."""
    import json

    with Store.open(store_url) as store:
        store.downgrade("0002")
    engine = create_engine(resolve_url(store_url), poolclass=NullPool)
    old = {"TRITON_MLA": 1.0, "FLASHINFER_FA3_MLA": 1.2}
    with engine.begin() as connection:
        connection.execute(text("INSERT INTO fingerprints (digest, torch, triton, flashinfer, cuda_runtime, driver, "
                                "mla_tune, kernel_hash) VALUES ('d1', '', '', '', '', '', '', '')"))
        keys = "sku, compute_capability, query_dtype, kv_cache_dtype, num_heads, geometry, page_size, topk, q_len"
        values = "'NVIDIA H100 80GB HBM3 | 9.0 | 80GiB | 0x2330', '9.0', 'bf16', 'bf16', 16, '512/64/128/128', 64, 0, 1"
        connection.execute(text(f"INSERT INTO measurements ({keys}, backend, batch_size, kv_len, status, samples, "
                                f"reason, gpu_uuid, measured_at) VALUES ({values}, 'TRITON_MLA', 1, 1024, 'ok', 5, "
                                f"'', 'GPU-1', '2026-11-20T00:00:00Z')"))
        connection.execute(text(
            f"INSERT INTO decisions ({keys}, fingerprint_digest, winner, runner_up, margin, static_choice, "
            f"static_score, noise_margin, kept_static, scores, per_shape, anomalies, failures, gpu_uuids, "
            f"decided_at, node, updated_at) VALUES ({values}, 'd1', 'TRITON_MLA', 'FLASHINFER_FA3_MLA', 0.2, "
            f"'TRITON_MLA', 1.0, 0.02, :f, :scores, :per_shape, '[]', :failures, '[]', '2026-11-20T00:00:00Z', "
            f"'', '2026-11-20T00:00:00Z')"),
            {"f": False, "scores": json.dumps(old),
             "per_shape": json.dumps([{"batch_size": 1, "kv_len": 1024, "backend": "TRITON_MLA", "median_ms": 0.1}]),
             "failures": json.dumps({"TRITON_MLA_SPARSE": "dense key"})})
    engine.dispose()
    with Store.open(store_url) as store:
        assert store.schema_revision() == HEAD_REVISION
        (d,) = store.decisions()
        (m,) = store.measurements()
    assert (d.winner, d.runner_up, m.backend) == ("MLA_TUNE_TRITON", "FLASHINFER_FA3_MLA", "MLA_TUNE_TRITON")
    assert d.scores == {"MLA_TUNE_TRITON": 1.0, "FLASHINFER_FA3_MLA": 1.2}
    assert d.per_shape[0].backend == "MLA_TUNE_TRITON" and d.failures == {"MLA_TUNE_TRITON_SPARSE": "dense key"}
    # vLLM's static choice keeps vLLM's name, but the score was our kernel's, not vLLM's Triton kernel's.
    assert (d.static_choice, d.static_score) == ("TRITON_MLA", None)
    assert d.engine_best is None     # never timed vLLM's kernels: no engine is handed this decision

    from mla_tune.engines import decision_for_engine

    handed = decision_for_engine(d, "vllm", plugin_missing=None)
    assert (handed.engine_backend, handed.basis) == (None, "stale")


def test_0005_leaves_a_stored_decision_without_plugin_scores_which_keeps_our_kernel_from_vllm(store_url):
    """A decision stored at 0004 never timed the launch our vLLM plugin makes: after upgrading, its plugin_scores is
    None, and vLLM gets its own fastest backend with a reason to tune again."""
    import json

    with Store.open(store_url) as store:
        store.downgrade("0004")
    engine = create_engine(resolve_url(store_url), poolclass=NullPool)
    keys = "sku, compute_capability, query_dtype, kv_cache_dtype, num_heads, geometry, page_size, topk, q_len"
    values = "'NVIDIA H100 80GB HBM3 | 9.0 | 80GiB | 0x2330', '9.0', 'bf16', 'bf16', 16, '512/64/128/128', 64, 0, 1"
    with engine.begin() as connection:
        connection.execute(text("INSERT INTO fingerprints (digest, torch, triton, flashinfer, cuda_runtime, driver, "
                                "mla_tune, kernel_hash) VALUES ('d1', '', '', '', '', '', '', '')"))
        connection.execute(text(
            f"INSERT INTO decisions ({keys}, fingerprint_digest, winner, runner_up, margin, static_choice, "
            f"static_score, noise_margin, kept_static, scores, per_shape, anomalies, failures, gpu_uuids, "
            f"engine_best, decided_at, node, updated_at) VALUES ({values}, 'd1', 'MLA_TUNE_TRITON', 'FLASHMLA', 0.1, "
            f"'FLASHMLA', 1.1, 0.02, :f, :scores, '[]', '[]', '{{}}', '[]', :best, '2026-11-27T00:00:00Z', '', "
            f"'2026-11-27T00:00:00Z')"),
            {"f": False, "scores": json.dumps({"MLA_TUNE_TRITON": 1.0, "FLASHMLA": 1.1}),
             "best": json.dumps({"vllm": "FLASHMLA", "sglang": "MLA_TUNE_TRITON"})})
    engine.dispose()
    with pytest.raises(StoreError, match="older than the 0005 this read needs; run `mla-tune db upgrade`"):
        find_decisions(store_url)
    with Store.open(store_url) as store:
        assert store.schema_revision() == HEAD_REVISION == "0005"
        (d,) = store.decisions()
    assert (d.winner, d.engine_best, d.plugin_scores) == ("MLA_TUNE_TRITON", {"vllm": "FLASHMLA",
                                                                             "sglang": "MLA_TUNE_TRITON"}, None)
    (read,) = find_decisions(store_url)
    assert read.plugin_scores is None

    from mla_tune.engines import decision_for_engine

    handed = decision_for_engine(d, "vllm", plugin_missing=None)
    assert (handed.engine_backend, handed.basis) == ("FLASHMLA", "engine_best")
    assert "re-run `mla-tune`" in handed.reason
    with Store.open(store_url) as store:   # a decision saved after the upgrade keeps its plugin scores
        store.save_decision(replace(d, plugin_scores={"MLA_TUNE_TRITON": 1.04}))
        assert store.decision(d.key, fingerprint=d.fingerprint).plugin_scores == {"MLA_TUNE_TRITON": 1.04}


def test_0003_merges_runs_duplicated_by_interleaved_imports_then_keeps_them_unique(store_url):
    """A database before 0003 can hold one file's run twice (two interleaved imports, every measurement twice):
    upgrading merges them; afterwards the database itself refuses a second copy of a run."""
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
