"""Races: concurrent imports of one file, an export while a tune writes, a long import beside a writer."""

from __future__ import annotations

import subprocess
import threading
import time

import pytest
from fault_helpers import CLI, export_file, filled_store, run_cli

from mla_tune.store.repository import Store

MEASUREMENTS_PER_KEY = 150   # 8 keys: 1,200 measurements, enough for the two imports to overlap


def _counts(url: str) -> tuple[int, int, int]:
    with Store.open(url, create=False) as store:
        return len(store.runs()), len(store.measurements()), len(store.decisions())


@pytest.mark.time_limit(120)
def test_two_concurrent_imports_of_one_file_store_it_once(store_url, tmp_path):
    source = filled_store(f"sqlite:///{tmp_path / 'source.db'}", heads=(8, 16, 24, 32, 40, 48, 56, 64),
                          measurements_per_key=MEASUREMENTS_PER_KEY)
    export = export_file(source, tmp_path / "node.json")
    Store.open(store_url).close()            # migrated: both imports race on the data, not the schema
    procs = [subprocess.Popen([*CLI, "--db", store_url, "import", str(export)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=90) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert _counts(store_url) == _counts(source) == (1, 8 * MEASUREMENTS_PER_KEY, 8)
    added = sorted(int(out.split("added ")[1].split(" run")[0]) for out, _ in outputs)
    assert added == [0, 1], outputs    # one import added the run; the other, planning again under the lock, none


@pytest.mark.time_limit(90)
def test_export_is_a_snapshot_while_a_tune_writes(store_url, tmp_path):
    from store_samples import FP, H100, key, measurement

    from mla_tune.store.exchange import read_export

    filled_store(store_url)
    stop = threading.Event()
    written = []

    def tune():  # a run and its measurements per transaction, as fast as it can
        with Store.open(store_url) as store:
            i = 0
            while not stop.is_set():
                with store.batch():
                    run_id = store.start_run(device=H100, fingerprint=FP, preset="quick", node=f"n{i}")
                    for kv in range(8):
                        store.add_measurement(run_id, measurement(key(num_heads=16), kv_len=2048 + kv))
                written.append(i)
                i += 1

    writer = threading.Thread(target=tune)
    writer.start()
    try:
        orphans = []
        for n in range(3):
            result = run_cli("--db", store_url, "export", "--out", tmp_path / f"e{n}.json", timeout_s=60)
            assert result.returncode == 0, result.stderr
            content = read_export(tmp_path / f"e{n}.json")["content"]
            orphans.append(sum(m["run"] is None for m in content["measurements"]))
    finally:
        stop.set()
        writer.join(timeout=30)
    assert len(written) > 3, "the writer did not run alongside the exports"
    assert orphans == [0] * 3      # every measurement was written with its run


@pytest.mark.slow
@pytest.mark.time_limit(120)
def test_a_long_sqlite_import_holds_the_write_lock_briefly(tmp_path):
    """The import plans from a snapshot without the lock and writes in one short transaction: a writer
    beside it (a tune, here with a 1 s busy timeout) never waits as long as that."""
    from store_samples import FP, H100, key, measurement

    source = filled_store(f"sqlite:///{tmp_path / 'source.db'}", heads=tuple(range(8, 136, 8)),
                          measurements_per_key=1000)        # 16,000 measurements
    export = export_file(source, tmp_path / "big.json")
    url = f"sqlite:///{tmp_path / 'target.db'}"
    Store.open(url).close()
    importer = subprocess.Popen([*CLI, "--db", url, "import", str(export)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    waits = []
    with Store.open(url, busy_timeout_s=1) as store:
        run_id = store.start_run(device=H100, fingerprint=FP, preset="quick", node="tuning-here")
        while importer.poll() is None:   # a tune of a key the file does not hold, one measurement at a time
            started = time.monotonic()
            store.add_measurement(run_id, measurement(key(num_heads=4), kv_len=1 + len(waits)))   # waits 1 s at most
            waits.append(time.monotonic() - started)
            time.sleep(0.05)
    out, err = importer.communicate(timeout=10)
    assert importer.returncode == 0, err
    assert _counts(url)[1] == 16_000 + len(waits)
    assert waits and max(waits) < 1, max(waits)
    print(f"longest wait of a writer beside the import: {max(waits):.2f} s over {len(waits)} writes")
