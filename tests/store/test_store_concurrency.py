"""Several processes open a fresh store and write measurements and decisions for the same keys at once."""

from __future__ import annotations

import multiprocessing
import time

from store_samples import FP, H100, key
from store_workers import MEASUREMENTS_PER_WORKER, SHARED_HEADS, write_concurrently

from mla_tune.store.repository import Store

WORKERS = 4


def test_concurrent_writers_lose_nothing_duplicate_nothing_and_finish(store_url):
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(WORKERS)
    workers = [context.Process(target=write_concurrently, args=(store_url, i, barrier)) for i in range(WORKERS)]
    started = time.monotonic()
    for process in workers:
        process.start()
    for process in workers:
        process.join(timeout=120)
    hung = [p.pid for p in workers if p.is_alive()]
    for process in workers:
        if process.is_alive():
            process.kill()
    assert not hung, f"workers {hung} still running after 120 s (deadlock?)"
    assert [p.exitcode for p in workers] == [0] * WORKERS
    elapsed_s = time.monotonic() - started

    winners = {f"W{i}" for i in range(WORKERS)}
    with Store.open(store_url) as store:
        runs = store.runs()
        assert sorted(r.node for r in runs) == [f"node-{i}" for i in range(WORKERS)]
        assert {r.status for r in runs} == {"done"}
        for run in runs:                                        # no lost rows
            assert len(store.measurements(run_id=run.id)) == MEASUREMENTS_PER_WORKER
        assert len(store.measurements()) == WORKERS * MEASUREMENTS_PER_WORKER
        decisions = store.decisions()                           # no duplicate keys
        assert len(decisions) == len({(d.key, d.fingerprint.digest) for d in decisions})
        assert sorted(d.key.num_heads for d in decisions) == sorted(
            [*SHARED_HEADS, *(1000 + i for i in range(WORKERS))])
        assert all(d.winner in winners for d in decisions)
        assert store.tuned_keys(H100.sku, FP.digest) == {d.key for d in decisions}
        assert store.decision(key(num_heads=1003)).winner == "W3"
        assert [d.uuid for d in store.devices()] == [H100.uuid]
        assert [f.digest for f in store.fingerprints()] == [FP.digest]
    assert elapsed_s < 60, elapsed_s
