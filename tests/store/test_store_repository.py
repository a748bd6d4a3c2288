"""Round trips through the repository API, on a real SQLite file and a real PostgreSQL database."""

from __future__ import annotations

import dataclasses

import pytest
from store_samples import FP, FP_NEW, H100, H100_B, H200, decision, dump, key, measurement

from mla_tune.store.schema import HEAD_REVISION
from mla_tune.store.repository import Store


@pytest.fixture
def store(store_url):
    with Store.open(store_url) as opened:
        yield opened


def test_open_creates_sqlite_file_and_migrates(tmp_path):
    path = tmp_path / "mla.db"
    with Store.open(f"sqlite:///{path}") as store:
        assert store.schema_revision() == HEAD_REVISION
        assert store.where == str(path)
        assert store.decisions() == []
    assert path.is_file()
    # WAL mode is a property of the file: a second open sees it.
    import sqlite3

    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_run_with_measurements_round_trips(store):
    k = key()
    run_id = store.start_run(device=H100, fingerprint=FP, preset="quick", node="node-7")
    ok = measurement(k, "FLASHMLA", median_ms=0.0713)
    failed = measurement(k, "CUTLASS_MLA", ok=False)
    store.add_measurement(run_id, ok)
    store.add_measurement(run_id, failed)
    store.finish_run(run_id, "done")

    assert store.measurements(run_id=run_id) == [ok, failed]
    assert store.measurements(key=k) == [ok, failed]
    assert store.measurements(sku=H200.sku) == []
    assert store.measurements(key=key(num_heads=128)) == []
    [run] = store.runs()
    assert (run.id, run.sku, run.gpu_uuid, run.fingerprint_digest, run.preset, run.node, run.status) == (
        run_id, H100.sku, H100.uuid, FP.digest, "quick", "node-7", "done")
    assert run.finished_at is not None and run.finished_at >= run.started_at
    assert store.devices() == [H100]
    assert store.fingerprints() == [FP]


def test_failed_measurement_keeps_its_reason(store):
    run_id = store.start_run(device=H100, fingerprint=FP, preset="quick", node="n")
    store.add_measurement(run_id, measurement(key(), "CUTLASS_MLA", ok=False))
    [stored] = store.measurements(run_id=run_id)
    assert stored.status == "failed" and stored.median_ms is None
    assert stored.reason == "CUDA error: an illegal memory access was encountered"


def test_decision_round_trips_every_field(store):
    d = decision(key())
    store.save_decision(d, node="node-7")
    assert store.decision(d.key) == d
    assert store.decision(d.key, fingerprint=FP) == d
    assert store.decision(d.key, fingerprint=FP.digest) == d
    assert store.decision(d.key, fingerprint=FP_NEW) is None
    assert store.decision(key(num_heads=32)) is None


def test_save_decision_upserts_per_key_and_fingerprint(store):
    k = key()
    store.save_decision(decision(k, "FLASHMLA"))
    store.save_decision(decision(k, "FLASHINFER_FA3_MLA"))           # same key + fingerprint: replaced
    store.save_decision(decision(k, "TRITON_MLA", fingerprint=FP_NEW,
                                 decided_at="2026-11-23T00:00:00.000+00:00"))  # new software: a second row
    assert sorted(d.winner for d in store.decisions()) == ["FLASHINFER_FA3_MLA", "TRITON_MLA"]
    assert store.decision(k, fingerprint=FP).winner == "FLASHINFER_FA3_MLA"
    assert store.decision(k).winner == "TRITON_MLA"                   # newest without a fingerprint


def test_decisions_filter_by_sku_in_key_order(store):
    for heads in (128, 16, 64):
        store.save_decision(decision(key(num_heads=heads)))
    store.save_decision(decision(key(device=H200)))
    assert [d.key.num_heads for d in store.decisions(sku=H100.sku)] == [16, 64, 128]
    assert [d.key.sku for d in store.decisions(sku=H200.sku)] == [H200.sku]
    assert len(store.decisions()) == 4


def test_tuned_keys_are_per_sku_and_fingerprint(store):
    store.save_decision(decision(key(num_heads=16)))
    store.save_decision(decision(key(num_heads=64, kv_cache_dtype="fp8_e4m3")))
    store.save_decision(decision(key(num_heads=32), fingerprint=FP_NEW))
    store.save_decision(decision(key(device=H200)))
    assert store.tuned_keys(H100.sku, FP.digest) == {key(num_heads=16), key(num_heads=64, kv_cache_dtype="fp8_e4m3")}
    assert store.tuned_keys(H100.sku, FP_NEW.digest) == {key(num_heads=32)}
    assert store.tuned_keys(H100.sku, "0" * 16) == set()


def test_devices_are_one_row_per_uuid_and_refreshed(store):
    store.record_device(H100)
    store.record_device(H100_B)
    newer_driver = dataclasses.replace(H100, driver_version="590.10")
    first = store.record_device(newer_driver)
    assert store.record_device(newer_driver) == first
    assert sorted(d.uuid for d in store.devices()) == [H100.uuid, H100_B.uuid]
    assert [d.driver_version for d in store.devices() if d.uuid == H100.uuid] == ["590.10"]
    store.record_device(H200)
    assert [d for d in store.devices() if d.uuid == H200.uuid] == [H200]


def test_fingerprints_are_unique_by_digest(store):
    first = store.record_fingerprint(FP)
    assert store.record_fingerprint(FP) == first
    assert store.record_fingerprint(FP_NEW) != first
    assert sorted(f.digest for f in store.fingerprints()) == sorted([FP.digest, FP_NEW.digest])


def test_runs_filter_by_status_and_sku(store):
    a = store.start_run(device=H100, fingerprint=FP, preset="quick", node="n1")
    b = store.start_run(device=H200, fingerprint=FP, preset="thorough", node="n2")
    store.finish_run(a, "interrupted")
    assert [r.id for r in store.runs(status="running")] == [b]
    assert [r.id for r in store.runs(sku=H100.sku)] == [a]


def test_bad_arguments_are_value_errors_and_write_nothing(store, store_url):
    run_id = store.start_run(device=H100, fingerprint=FP, preset="quick", node="n")
    before = dump(store_url)
    with pytest.raises(ValueError, match="no run with id 999"):
        store.add_measurement(999, measurement(key()))
    with pytest.raises(ValueError, match="run status 'exploded' not in"):
        store.finish_run(run_id, "exploded")
    with pytest.raises(ValueError, match="no run with id 998"):
        store.finish_run(998, "done")
    assert dump(store_url) == before


def test_batch_is_all_or_nothing(store, store_url):
    store.save_decision(decision(key(num_heads=8)))
    before = dump(store_url)
    with pytest.raises(RuntimeError, match="import rejected"):
        with store.batch():
            store.record_device(H200)
            store.save_decision(decision(key(num_heads=16)))
            store.add_measurement(None, measurement(key(num_heads=16)))
            raise RuntimeError("import rejected halfway")
    assert dump(store_url) == before
    with store.batch():
        store.save_decision(decision(key(num_heads=16)))
        store.add_measurement(None, measurement(key(num_heads=16)))
    assert len(store.decisions()) == 2 and len(store.measurements()) == 1


def test_measurement_is_committed_before_the_call_returns(store, store_url):
    """A killed tune loses at most the measurement in flight: another connection sees each one at once."""
    run_id = store.start_run(device=H100, fingerprint=FP, preset="quick", node="n")
    store.add_measurement(run_id, measurement(key()))
    with Store.open(store_url) as other:
        assert len(other.measurements(run_id=run_id)) == 1
