"""The tuner times our kernel as our vLLM backend launches it, beside its candidate tiles: the measurement keeps the
fastest candidate's time and records the vLLM launch's time (or why it has none), and the decision scores it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_mla_backends import ADAPTERS, FakeVllmLaunch, fake_bench

from mla_tune.backends.problem import Problem, Shape
from mla_tune.tuner.measure import ShapeTask, measure_shape


def _results(task: ShapeTask, bench=fake_bench) -> dict:
    events = []
    measure_shape(task, events.append, device="cpu", bench=bench)
    return {e[1]: e[2] for e in events if e[0] == "result"}


def _task(problem=None, *, engine_max_seq_len=None, shape=Shape(2, 100)) -> ShapeTask:
    return ShapeTask(problem or Problem(num_heads=4, kv_cache_dtype="bf16"), shape, ("FAKE_GOOD", "FAKE_TILED"),
                     adapters=tuple(ADAPTERS.items()), engine_max_seq_len=engine_max_seq_len)


def test_the_vllm_launch_is_timed_with_the_candidates_and_recorded_beside_the_tuned_time(monkeypatch):
    monkeypatch.setenv("MLA_TUNE_FAKE_MS", json.dumps({"FAKE_TILED#0": 2.0, "FAKE_TILED#3": 1.0,
                                                       "FAKE_TILED@vllm": 2.3, "FAKE_GOOD": 1.5}))
    timed = []

    def bench(steps, **kw):
        timed.append(sorted(steps))
        return fake_bench(steps, **kw)

    tiled = _results(_task(engine_max_seq_len=4096), bench=bench)["FAKE_TILED"]
    # one interleaved timing of every step that passed the gate (#1 lies, #2 raises)
    assert timed == [["FAKE_GOOD", "FAKE_TILED#0", "FAKE_TILED#3", "FAKE_TILED@vllm"]]
    assert (tiled.status, tiled.median_ms, tiled.params["label"]) == ("ok", 1.0, "h16n32")
    assert tiled.params["candidates"] == 4 and "vLLM launch" not in tiled.params["rejected"]
    assert (tiled.params["engine_median_ms"], tiled.params["engine_max_seq_len"], tiled.params["engine_reason"]) == \
        (2.3, 4096, "")


def test_vllms_max_seq_len_is_never_shorter_than_the_shape_and_the_sparse_launch_takes_none(monkeypatch):
    monkeypatch.setenv("MLA_TUNE_FAKE_MS", json.dumps({}))
    dense = _results(_task(engine_max_seq_len=None, shape=Shape(2, 150)))["FAKE_TILED"]
    assert dense.params["engine_max_seq_len"] == 150
    shorter = _results(_task(engine_max_seq_len=64, shape=Shape(2, 150)))["FAKE_TILED"]
    assert shorter.params["engine_max_seq_len"] == 150
    sparse = _results(_task(Problem(num_heads=4, kv_cache_dtype="bf16", topk=32), engine_max_seq_len=4096))
    assert sparse["FAKE_TILED"].params["engine_max_seq_len"] is None
    assert sparse["FAKE_TILED"].params["engine_median_ms"] == 1.0


def test_a_wrong_vllm_launch_keeps_the_tuned_time_and_records_why_it_has_none(monkeypatch):
    monkeypatch.setenv("MLA_TUNE_FAKE_MS", json.dumps({"FAKE_TILED#0": 2.0, "FAKE_TILED#3": 1.0}))
    monkeypatch.setattr(FakeVllmLaunch, "SCALE", 1.1)
    tiled = _results(_task())["FAKE_TILED"]
    assert (tiled.status, tiled.median_ms) == ("ok", 1.0)
    assert tiled.params["engine_median_ms"] is None
    assert "relative error" in tiled.params["engine_reason"] and "exceeds" in tiled.params["engine_reason"]


def test_a_backend_whose_candidates_all_fail_is_not_saved_by_its_vllm_launch(monkeypatch):
    from fake_mla_backends import FakeTiled

    monkeypatch.setattr(FakeTiled, "TILES", ((32, 32),))
    events = []
    measure_shape(_task(), events.append, device="cpu", bench=fake_bench)
    (result,) = [e[2] for e in events if e[0] == "result" and e[1] == "FAKE_TILED"]
    assert result.status == "failed" and "fake tile does not fit" in result.reason


def test_a_tune_decides_on_the_vllm_launch_with_vllms_max_seq_len_the_longest_kv_len(tmp_path, monkeypatch):
    from test_tune_run import FP, GPU0, options, spec

    from mla_tune.store.repository import Store
    from mla_tune.tuner.presets import load_workload
    from mla_tune.tuner.run import tune

    monkeypatch.setenv("MLA_TUNE_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    workload = tmp_path / "shapes.json"
    workload.write_text(json.dumps({"shapes": [{"batch_size": 1, "kv_len": 100}, {"batch_size": 3, "kv_len": 200}]}))
    monkeypatch.setenv("MLA_TUNE_FAKE_MS", json.dumps({"FAKE_GOOD": 1.5, "FAKE_TILED#0": 1.2, "FAKE_TILED#3": 1.0,
                                                       "FAKE_TILED@vllm": 1.8}))
    with Store.open(f"sqlite:///{tmp_path / 'tune.db'}") as store:
        report = tune(spec(load_workload(workload), tps=(4,)), store=store, devices=[GPU0],
                      options=options("FAKE_GOOD", "FAKE_TILED", static_choice="FAKE_GOOD", prewarm=False))
        (decision,) = report.decisions
        tiled = [m for m in store.measurements() if m.backend == "FAKE_TILED"]
    assert decision.fingerprint.digest == FP.digest
    assert decision.winner == "FAKE_TILED" and decision.scores["FAKE_TILED"] == pytest.approx(1.0)
    assert decision.plugin_scores == {"FAKE_TILED": pytest.approx(1.8)}
    assert sorted(m.params["engine_max_seq_len"] for m in tiled) == [200, 200]


def _interpreted(kind: str) -> dict:
    """Subprocess entry (TRITON_INTERPRET=1): tune the real kernel at one small shape, the vLLM launch beside its
    candidates; JSON of the measurement."""
    from mla_tune.tuner.timing import Timing

    def real_runs(steps, **_):  # runs each step once (the real kernels); made-up times
        return {name: (step(), Timing(1.0 + i, 1.0 + i, 1.0 + i, 3, 1, ()))[1]
                for i, (name, step) in enumerate(sorted(steps.items()))}

    name, problem, shape = {
        "dense": ("MLA_TUNE_TRITON", Problem(num_heads=3, kv_cache_dtype="bf16", page_size=16), Shape(2, 70)),
        "dense-fp8": ("MLA_TUNE_TRITON", Problem(num_heads=3, kv_cache_dtype="fp8_e4m3", page_size=16, q_len=2),
                      Shape(2, 40)),
        "sparse": ("MLA_TUNE_TRITON_SPARSE", Problem(num_heads=3, kv_cache_dtype="bf16", page_size=64, topk=32),
                   Shape(2, 150)),
        "sparse-ds-mla": ("MLA_TUNE_TRITON_SPARSE", Problem(num_heads=3, kv_cache_dtype="fp8_ds_mla", page_size=64,
                                                             topk=32), Shape(2, 150)),
    }[kind]
    out = _results(ShapeTask(problem, shape, (name,), engine_max_seq_len=1000), bench=real_runs)[name]
    return {"status": out.status, "reason": out.reason, "params": out.params}


@pytest.mark.parametrize("kind", ["dense", "dense-fp8", "sparse", "sparse-ds-mla"])
def test_the_real_vllm_launch_is_gated_and_timed_under_the_interpreter(kind):
    # Our vLLM backend's own launch functions (`vllm_backends.launch`) on the tuner's inputs in vLLM's layouts, in
    # Triton's interpreter (set before Triton is imported, so in a subprocess); the gate passes it.
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"import test_engine_launch as t; print(json.dumps(t._interpreted({kind!r})))")
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["status"] == "ok", r
    params = r["params"]
    assert params["engine_reason"] == "" and params["engine_median_ms"] > 0, params
    assert params["engine_max_seq_len"] == (None if kind.startswith("sparse") else 1000)
