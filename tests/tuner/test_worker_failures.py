"""Real spawned workers running fake CPU backends that abort, segfault, hang, raise and lie."""

from __future__ import annotations

import json

import pytest
from fake_mla_backends import ADAPTERS

from mla_tune.backends.problem import Problem, Shape
from mla_tune.tuner.measure import ShapeTask
from mla_tune.tuner.worker import Worker

BENCH = "fake_mla_backends:fake_bench"


@pytest.mark.slow
def test_crashes_hangs_and_lies_are_recorded_and_the_good_backends_are_still_timed(monkeypatch, tmp_path):
    monkeypatch.setenv("MLA_TUNE_FAKE_MS", json.dumps({"FAKE_GOOD": 1.5, "FAKE_OTHER": 2.5}))
    names = ("FAKE_ABORT", "FAKE_GOOD", "FAKE_LIAR", "FAKE_SEGFAULT", "FAKE_HANG", "FAKE_RAISE", "FAKE_OTHER",
             "FAKE_LATE_ABORT")
    task = ShapeTask(Problem(num_heads=4, kv_cache_dtype="fp8"), Shape(2, 100), names,
                     adapters=tuple(ADAPTERS.items()))
    with Worker(device="cpu", bench=BENCH, timeouts_s={"prepare": 3.0}, log_dir=tmp_path) as worker:
        result = worker.run_shape(task)
    out = result.outcomes
    assert set(out) == set(names)
    assert out["FAKE_ABORT"].status == "failed"
    assert "SIGABRT" in out["FAKE_ABORT"].reason and "device-side assertion failed" in out["FAKE_ABORT"].reason
    assert out["FAKE_SEGFAULT"].status == "failed" and "SIGSEGV" in out["FAKE_SEGFAULT"].reason
    assert out["FAKE_HANG"].status == "timeout" and "no progress for 3 s during prepare" in out["FAKE_HANG"].reason
    assert out["FAKE_RAISE"].status == "failed"
    assert "RuntimeError: fake library cannot plan this problem" in out["FAKE_RAISE"].reason
    assert out["FAKE_LIAR"].status == "incorrect" and out["FAKE_LIAR"].rel_error > 0.05
    assert "exceeds 0.02 for a fp8_e4m3 KV cache" in out["FAKE_LIAR"].reason
    assert (out["FAKE_GOOD"].status, out["FAKE_GOOD"].median_ms) == ("ok", 1.5)
    assert (out["FAKE_OTHER"].status, out["FAKE_OTHER"].median_ms) == ("ok", 2.5)
    assert out["FAKE_GOOD"].rel_error < 1e-6
    # Passed the gate, then aborted inside the interleaved timing: the others were timed again
    # alone, so only it is recorded as failed.
    assert out["FAKE_LATE_ABORT"].status == "failed" and "SIGABRT" in out["FAKE_LATE_ABORT"].reason
    assert "during timing" in out["FAKE_LATE_ABORT"].reason
    assert result.restarts == 4                               # after abort, segfault, hang, interleaved timing


def test_the_worker_measures_the_task_as_sent_without_refining_when_told_not_to(monkeypatch, tmp_path):
    monkeypatch.setenv("MLA_TUNE_FAKE_MS", json.dumps({"FAKE_TILED": 2.0, "FAKE_TILED#0": 2.0, "FAKE_TILED#3": 1.0}))
    task = ShapeTask(Problem(num_heads=4, kv_cache_dtype="bf16"), Shape(2, 100), ("FAKE_TILED",),
                     adapters=tuple(ADAPTERS.items()), refine_tiles=False)
    with Worker(device="cpu", bench=BENCH, log_dir=tmp_path) as worker:
        outcome = worker.run_shape(task).outcomes["FAKE_TILED"]
    # Refined, the 1.0 ms candidate would win and its tile would be recorded.
    assert (outcome.status, outcome.median_ms, outcome.params) == ("ok", 2.0, None)
