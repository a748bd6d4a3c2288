"""The real tune on the local GPU: real backends, CUDA graphs, NVML clocks, a real SQLite store."""

from __future__ import annotations

from collections import Counter

import pytest

from mla_tune.store.repository import Store
from mla_tune.tuner.gate import quantizes_query, rel_error_limit
from mla_tune.tuner.presets import TuneSpec, Workload
from mla_tune.tuner.run import TuneOptions, tune

pytestmark = pytest.mark.gpu


def test_tune_two_keys_on_this_gpu(tmp_path, monkeypatch):
    from mla_tune.tuner.probe import probe_devices

    monkeypatch.setenv("MLA_TUNE_LOCK_DIR", str(tmp_path / "locks"))
    device = probe_devices()[0]
    spec = TuneSpec(models=("deepseek-v3",), heads=(16,), kv_cache_dtypes=("bf16", "fp8"),
                    workload=Workload(shapes=((1, 1024, 1.0), (16, 4096, 1.0))))
    with Store.open(f"sqlite:///{tmp_path / 'gpu.db'}") as store:
        report = tune(spec, store=store, devices=[device], options=TuneOptions(progress=False, max_seconds=0.2))
        decisions = store.decisions()
        rows = store.measurements()
    assert not report.undecided, report.undecided
    assert len(decisions) == 2 and report.units_done == 4
    timed = [m for m in rows if m.status != "ineligible"]
    assert Counter(m.status for m in timed) == {"ok": len(timed)}, [(m.backend, m.reason) for m in timed
                                                                     if m.status != "ok"]
    assert all(m.rel_error <= rel_error_limit(m.key.kv_cache_dtype,
                                              fp8_query=quantizes_query(m.backend, m.key.kv_cache_dtype))
               and m.median_ms > 0 and m.ci_low_ms <= m.median_ms <= m.ci_high_ms for m in timed)
    assert all(m.sm_clock_mhz_before and m.temperature_c_after for m in timed)
    # our Triton kernel was refined: its time is its fastest correct candidate tile, and the tile is recorded
    triton = [m for m in timed if m.backend == "MLA_TUNE_TRITON"]
    assert triton and all(m.params and m.params["tile"] and m.params["candidates"] >= 1 and not m.params["rejected"]
                          for m in triton), [m.params for m in triton]
    if device.compute_capability[0] == 9:  # both kernel families are candidates there
        assert all(m.params["candidates"] >= 2 for m in triton)
    assert report.peak_memory_bytes.get(device.uuid, 0) > 0
    for d in decisions:
        assert d.winner in d.scores and d.scores[d.winner] <= min(d.scores.values()) * 1.02
        assert d.gpu_uuids == (device.uuid,)
