"""The tuner's per-device refinement of our Triton kernel's launch: every candidate tile of a backend that has
them is gated and timed, the backend's result is its fastest correct candidate, and the measurement records
which tile that was (and why the others were left out)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_mla_backends import ADAPTERS, fake_bench

from mla_tune.backends.problem import Problem, Shape
from mla_tune.tuner.measure import ShapeTask, measure_shape


def _results(task: ShapeTask, bench=fake_bench) -> dict:
    events = []
    measure_shape(task, events.append, device="cpu", bench=bench)
    return {e[1]: e[2] for e in events if e[0] == "result"}


def test_the_fastest_correct_candidate_is_the_result_and_the_others_are_accounted_for(monkeypatch):
    # 0: default, 2.0 ms; 1: 0.5 ms but 10% wrong; 2: raises at prepare; 3: 1.0 ms, the fastest correct one
    monkeypatch.setenv("MLA_TUNE_FAKE_MS", json.dumps({"FAKE_TILED#0": 2.0, "FAKE_TILED#1": 0.5,
                                                       "FAKE_TILED#3": 1.0, "FAKE_GOOD": 1.5}))
    task = ShapeTask(Problem(num_heads=4, kv_cache_dtype="bf16"), Shape(2, 100), ("FAKE_GOOD", "FAKE_TILED"),
                     adapters=tuple(ADAPTERS.items()))
    out = _results(task)
    assert set(out) == {"FAKE_GOOD", "FAKE_TILED"}
    assert (out["FAKE_GOOD"].median_ms, out["FAKE_GOOD"].params) == (1.5, None)
    tiled = out["FAKE_TILED"]
    assert (tiled.status, tiled.median_ms) == ("ok", 1.0)
    assert tiled.params["tile"] == {"block_h": 16, "block_n": 32}
    assert (tiled.params["label"], tiled.params["default_label"], tiled.params["default_median_ms"]) == \
        ("h16n32", "h64n64", 2.0)
    assert tiled.params["candidates"] == 4
    assert set(tiled.params["rejected"]) == {"h64n32", "h32n32"}
    assert "exceeds" in tiled.params["rejected"]["h64n32"]
    assert "fake tile does not fit" in tiled.params["rejected"]["h32n32"]


def test_without_refinement_only_the_default_is_timed(monkeypatch):
    monkeypatch.setenv("MLA_TUNE_FAKE_MS", json.dumps({"FAKE_TILED": 2.0}))
    task = ShapeTask(Problem(num_heads=4, kv_cache_dtype="bf16"), Shape(2, 100), ("FAKE_TILED",),
                     adapters=tuple(ADAPTERS.items()), refine_tiles=False)
    out = _results(task)
    assert (out["FAKE_TILED"].median_ms, out["FAKE_TILED"].params) == (2.0, None)


def test_a_backend_whose_every_candidate_fails_reports_its_default_failure_once(monkeypatch):
    from fake_mla_backends import FakeTiled

    monkeypatch.setattr(FakeTiled, "TILES", ((32, 32), (32, 32)))
    task = ShapeTask(Problem(num_heads=4, kv_cache_dtype="bf16"), Shape(2, 100), ("FAKE_TILED",),
                     adapters=tuple(ADAPTERS.items()))
    events = []
    measure_shape(task, events.append, device="cpu", bench=fake_bench)
    results = [e for e in events if e[0] == "result"]
    assert len(results) == 1 and results[0][2].status == "failed"
    assert "fake tile does not fit" in results[0][2].reason


def _interpreted_refinement(kv: str) -> dict:
    """Subprocess entry (TRITON_INTERPRET=1): refine the real kernel at one small shape, then run `mla_decode`
    with the tile the measurement recorded; JSON of what the test checks."""
    import torch

    from mla_tune.backends.inputs import make_inputs
    from mla_tune.backends.reference import mla_reference
    from mla_tune.backends.triton_mla import mla_decode
    from mla_tune.backends.triton_mla.config import tile_from_dict
    from mla_tune.backends.triton_mla.dispatch import candidate_tiles
    from mla_tune.tuner.timing import Timing

    def real_runs(steps, **_):  # runs each step once (the real kernel); made-up times, the last one fastest
        return {name: (step(), Timing(2.0 - 0.1 * i, 2.0 - 0.1 * i, 2.0 - 0.1 * i, 3, 1, ()))[1]
                for i, (name, step) in enumerate(sorted(steps.items()))}

    problem = Problem(num_heads=3, kv_cache_dtype=kv, page_size=16)
    shape = Shape(2, 300)
    tiles = candidate_tiles(num_heads=3, q_len=1, batch=2, max_items=300, kv_fp8=kv == "fp8_e4m3")
    out = _results(ShapeTask(problem, shape, ("MLA_TUNE_TRITON",)), bench=real_runs)["MLA_TUNE_TRITON"]
    inputs = make_inputs(problem, shape, device=torch.device("cpu"), seed=1)
    got, _ = mla_decode(inputs.q, inputs.kv_cache, inputs.block_table, inputs.seq_lens, sm_scale=inputs.sm_scale,
                        kv_scale=inputs.kv_scale, tile=out.params["tile"])
    ref, _ = mla_reference(inputs.q, inputs.kv_cache, inputs.block_table, inputs.seq_lens, sm_scale=inputs.sm_scale,
                           kv_scale=inputs.kv_scale)
    return {"status": out.status, "rel_error": out.rel_error, "params": out.params,
            "tiles": [t.as_dict() for t in tiles],
            "tile_ok": tile_from_dict(out.params["tile"]) in tiles,
            "decode_rel_err": float((got.float() - ref.float()).norm() / ref.float().norm())}


@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3"])
def test_our_triton_kernel_is_refined_under_the_interpreter(kv):
    # The real kernel on CPU (TRITON_INTERPRET=1, set before Triton is imported, so in a subprocess): each
    # candidate tile is run and gated against the reference; the result records the tile it was timed with,
    # and `mla_decode(tile=...)` takes it back.
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"import test_refine_tiles as t; print(json.dumps(t._interpreted_refinement({kv!r})))")
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    tol = 2e-2 if kv == "fp8_e4m3" else 1e-2
    assert r["status"] == "ok" and r["rel_error"] < tol, r
    assert len(r["tiles"]) >= 2 and not any(t["warp_specialized"] for t in r["tiles"])  # no SM90 here
    assert r["params"]["candidates"] == len(r["tiles"]) and not r["params"]["rejected"]
    assert r["params"]["tile"] == r["tiles"][-1] and r["tile_ok"]  # the one made fastest
    assert r["params"]["default_label"] != r["params"]["label"]
    assert r["decode_rel_err"] < tol, r


def test_a_stored_tile_with_an_unknown_or_impossible_field_is_refused():
    from mla_tune.backends.triton_mla.config import tile_from_dict
    from mla_tune.backends.triton_mla.dispatch import HOPPER_TOKEN_SPLIT_TILE as HOPPER_TILE

    assert tile_from_dict(HOPPER_TILE.as_dict()) == HOPPER_TILE
    with pytest.raises(ValueError, match="unknown tile field 'evil'"):
        tile_from_dict({**HOPPER_TILE.as_dict(), "evil": 1})
    with pytest.raises(ValueError, match="incomplete tile"):
        tile_from_dict({"block_h": 64})
    with pytest.raises(ValueError, match="warp_specialized"):
        tile_from_dict({**HOPPER_TILE.as_dict(), "block_h": 16, "num_warps": 8})
