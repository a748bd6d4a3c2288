"""The whole tune on CPU: real spawned workers, real fake backends, a real SQLite store; only timing is injected."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest
from fake_mla_backends import ADAPTERS

from mla_tune.backends.device import DeviceInfo, SoftwareFingerprint
from mla_tune.store.repository import Store
from mla_tune.tuner.lock import GpuBusy, GpuLock
from mla_tune.tuner.presets import TuneSpec, load_workload
from mla_tune.tuner.run import TuneOptions, tune

HERE = Path(__file__).parent
FP = SoftwareFingerprint(torch="2.13-test", triton="3.6", kernel_hash="cafe")
GPU0 = DeviceInfo("Fake H100", (9, 0), uuid="GPU-fake-0", index=0, memory_total_mib=81559)
GPU1 = DeviceInfo("Fake H100", (9, 0), uuid="GPU-fake-1", index=1, memory_total_mib=81559)


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("MLA_TUNE_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))   # the pre-build's marks go there
    workload = tmp_path / "shapes.json"
    workload.write_text(json.dumps({"shapes": [{"batch_size": 1, "kv_len": 100},
                                               {"batch_size": 3, "kv_len": 200, "weight": 3}]}))
    return tmp_path, load_workload(workload)


def options(*names, **kw):
    return TuneOptions(worker_device="cpu", adapters={n: ADAPTERS[n] for n in names},
                       bench="fake_mla_backends:fake_bench", fingerprint=FP, progress=False,
                       max_seconds=0.1, node="test-node", **kw)


def spec(workload, **kw):
    return TuneSpec(**{"models": ("custom:512/64/128/128:heads=8",), "tps": (2, 4, 8),
                       "kv_cache_dtypes": ("bf16",), "workload": workload, **kw})


def test_tune_stores_decisions_failures_and_skips_what_is_tuned(env, monkeypatch):
    tmp, workload = env
    # The liar is fastest everywhere; OTHER wins batch 1, GOOD wins batch 3 (weighted 3:1).
    monkeypatch.setenv("MLA_TUNE_FAKE_MS", json.dumps({"FAKE_LIAR": 0.1, "FAKE_GOOD": {"1": 2.0, "3": 1.0},
                                                       "FAKE_OTHER": {"1": 1.0, "3": 2.0}}))
    with Store.open(f"sqlite:///{tmp / 'tune.db'}") as store:
        report = tune(spec(workload), store=store, devices=[GPU0],
                      options=options("FAKE_GOOD", "FAKE_OTHER", "FAKE_LIAR", static_choice="FAKE_OTHER",
                                      jit_prefixes=("FAKE_LIAR",)))
        assert report.units_done == 6 and not report.undecided and not report.budget_exhausted
        # The pre-build prepared the one JIT backend (one dtype) once before timing; it gates nothing.
        assert "JIT pre-build (1 builds, 1 workers)" in report.seconds
        assert report.notes[0].startswith("JIT pre-build: 1 build(s) (1 JIT libraries) in 1 parallel worker(s)")
        stored = {d.key.num_heads: d for d in store.decisions()}
        assert sorted(stored) == [1, 2, 4]
        d = stored[4]
        assert d.winner == "FAKE_GOOD" and d.runner_up == "FAKE_OTHER" and d.static_choice == "FAKE_OTHER"
        assert d.margin == pytest.approx(2 ** 0.5 - 1)             # (2^(1/4)) / (2^(-1/4)) - 1 with weights 1:3
        assert d.failures["FAKE_LIAR"].startswith("incorrect at batch")
        assert {(w.batch_size, w.backend) for w in d.per_shape} == {(1, "FAKE_OTHER"), (3, "FAKE_GOOD")}
        assert d.fingerprint.digest == FP.digest and d.gpu_uuids == ("GPU-fake-0",)
        statuses = Counter(m.status for m in store.measurements(key=d.key))
        assert statuses == {"ok": 4, "incorrect": 2}
        assert [r.status for r in store.runs()] == ["done"]

        again = tune(spec(workload), store=store, devices=[GPU0], options=options("FAKE_GOOD", "FAKE_OTHER"))
        assert again.units_done == 0 and len(again.already_tuned) == 3

        forced = tune(spec(workload, level="quick"), store=store, devices=[GPU0],
                      options=options("FAKE_GOOD", "FAKE_OTHER", force=True, budget_s=60))
        assert forced.units_done == 6
        assert len(store.measurements(key=d.key)) == 6 + 4


def test_a_backend_the_operator_skips_is_not_timed_and_cannot_win(env, monkeypatch):
    # `--skip-backends`: e.g. MLA_TUNE_TRITON_FP8Q, whose rounding of the query an operator may not accept
    tmp, workload = env
    monkeypatch.setenv("MLA_TUNE_FAKE_MS", json.dumps({"FAKE_GOOD": 1.0, "FAKE_OTHER": 2.0}))
    with Store.open(f"sqlite:///{tmp / 'tune.db'}") as store:
        report = tune(spec(workload, tps=(8,)), store=store, devices=[GPU0],
                      options=options("FAKE_GOOD", "FAKE_OTHER", static_choice="FAKE_OTHER",
                                      skip_backends=frozenset({"FAKE_GOOD"})))
        (decision,) = store.decisions()
        assert report.units_done == 2 and decision.winner == "FAKE_OTHER"
        assert {m.backend for m in store.measurements(key=decision.key) if m.status == "ok"} == {"FAKE_OTHER"}
        assert "left out by the operator (--skip-backends)" in decision.failures["FAKE_GOOD"]


def test_busy_gpu_lock_stops_a_second_tune_before_anything_is_stored(env):
    tmp, workload = env
    with GpuLock("GPU-fake-0"), Store.open(f"sqlite:///{tmp / 'lock.db'}") as store:
        busy = f"GPU GPU-fake-0 is being timed by another mla-tune process .pid {os.getpid()}"
        with pytest.raises(GpuBusy, match=busy):
            tune(spec(workload), store=store, devices=[GPU0], options=options("FAKE_GOOD"))
        assert store.runs() == [] and store.decisions() == []


def test_identical_gpus_share_one_decision_and_a_slow_one_is_reported(env, monkeypatch):
    tmp, workload = env
    monkeypatch.setenv("MLA_TUNE_FAKE_MS", json.dumps({"FAKE_GOOD": 1.0, "FAKE_OTHER": 1.2}))
    monkeypatch.setenv("MLA_TUNE_FAKE_SLOW_GPU", "GPU-fake-1")
    with Store.open(f"sqlite:///{tmp / 'two.db'}") as store:
        report = tune(spec(workload, tps=(8,)), store=store, devices=[GPU0, GPU1],
                      options=options("FAKE_GOOD", "FAKE_OTHER"))
        (decision,) = store.decisions()
    assert decision.winner == "FAKE_GOOD"
    assert decision.gpu_uuids == ("GPU-fake-0", "GPU-fake-1")   # the first shape is measured on both
    assert report.units_done == 3
    assert any(n.startswith("GPU 1 (GPU-fake-1) is 1.50x slower than its siblings") for n in report.notes)


_RUNNER = textwrap.dedent("""
    import json, sys
    from mla_tune.backends.device import DeviceInfo, SoftwareFingerprint
    from mla_tune.store.repository import Store
    from mla_tune.tuner.presets import TuneSpec, load_workload
    from mla_tune.tuner.run import TuneOptions, tune
    from fake_mla_backends import ADAPTERS

    if __name__ == "__main__":
        db, workload = sys.argv[1], sys.argv[2]
        fp = SoftwareFingerprint(torch="2.13-test", triton="3.6", kernel_hash="cafe")
        device = DeviceInfo("Fake H100", (9, 0), uuid="GPU-fake-0", index=0, memory_total_mib=81559)
        options = TuneOptions(worker_device="cpu", adapters={n: ADAPTERS[n] for n in ("FAKE_GOOD", "FAKE_OTHER")},
                              bench="fake_mla_backends:fake_bench", fingerprint=fp, progress=False, max_seconds=0.1)
        spec = TuneSpec(models=("custom:512/64/128/128:heads=8",), tps=(2, 4, 8), kv_cache_dtypes=("bf16",),
                        workload=load_workload(workload))
        with Store.open(db) as store:
            tune(spec, store=store, devices=[device], options=options)
""")


@pytest.mark.slow
def test_a_killed_tune_resumes_without_measuring_again(env, monkeypatch):
    tmp, workload = env
    db = f"sqlite:///{tmp / 'killed.db'}"
    (tmp / "runner.py").write_text(_RUNNER)
    (tmp / "shapes.json").write_text(json.dumps({"shapes": [{"batch_size": b, "kv_len": 64 * b}
                                                            for b in (1, 2, 3)]}))
    child_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
                 "MLA_TUNE_FAKE_DELAY_S": "0.4"}
    proc = subprocess.Popen([sys.executable, str(tmp / "runner.py"), db, str(tmp / "shapes.json")],
                            env=child_env, start_new_session=True)
    try:
        with Store.open(db) as store:
            deadline = time.monotonic() + 40
            while len(store.measurements()) < 8 and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.1)
            measured_before = len(store.measurements())
    finally:
        os.killpg(proc.pid, signal.SIGKILL)                     # the tune and its worker, mid-run
        proc.wait()
    assert 8 <= measured_before < 18, "the tune was not killed mid-run"
    with Store.open(db) as store:
        before = Counter((m.key.num_heads, m.backend, m.batch_size) for m in store.measurements())
        assert store.decisions() == [] or len(store.decisions()) < 3
        report = tune(spec(load_workload(tmp / "shapes.json")), store=store, devices=[GPU0],
                      options=options("FAKE_GOOD", "FAKE_OTHER", resume=True))
        after = Counter((m.key.num_heads, m.backend, m.batch_size) for m in store.measurements())
        runs = [r.status for r in store.runs()]
        decided = {d.key.num_heads for d in store.decisions()}
    assert set(after.values()) == {1}, "a shape was measured twice"
    assert len(after) == 3 * 2 * 3 and set(before) <= set(after)
    assert report.units_done == 9 - sum(1 for k in {(h, b) for h, _, b in before})
    assert decided == {1, 2, 4} and runs == ["interrupted", "done"]


def test_an_empty_adapter_mapping_times_nothing_rather_than_every_registered_backend():
    from types import SimpleNamespace

    from mla_tune.tuner.run import _candidates

    work = SimpleNamespace(problem=None)
    device = SimpleNamespace(spec=None)
    runnable, ineligible, _ = _candidates(work, device, TuneOptions(adapters={}, static_choice="FAKE_GOOD"))
    assert runnable == () and ineligible == {}
    runnable, ineligible, _ = _candidates(work, device, TuneOptions(adapters={n: ADAPTERS[n] for n in ("FAKE_GOOD",)},
                                                                     static_choice="FAKE_GOOD",
                                                                     skip_backends=frozenset({"FAKE_GOOD"})))
    assert runnable == () and "FAKE_GOOD" in ineligible
