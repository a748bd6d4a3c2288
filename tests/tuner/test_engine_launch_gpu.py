"""On the local GPU: the tune times our kernel as our vLLM backend launches it, the decision scores that launch,
and what vLLM is handed agrees with the numbers."""

from __future__ import annotations

import math

import pytest

from mla_tune.engines import decision_for_engine
from mla_tune.store.repository import Store
from mla_tune.tuner.presets import TuneSpec, Workload
from mla_tune.tuner.run import TuneOptions, tune

pytestmark = pytest.mark.gpu

OURS = ("MLA_TUNE_TRITON", "MLA_TUNE_TRITON_SPARSE")


@pytest.mark.parametrize("engine_max_seq_len", [None, 163840])
def test_a_dense_and_a_sparse_key_are_decided_on_the_launch_vllm_makes(tmp_path, monkeypatch, engine_max_seq_len):
    from mla_tune.tuner.probe import probe_devices

    monkeypatch.setenv("MLA_TUNE_LOCK_DIR", str(tmp_path / "locks"))
    device = probe_devices()[0]
    spec = TuneSpec(models=("deepseek-v3", "deepseek-v3.2"), heads=(16,), kv_cache_dtypes=("bf16",),
                    workload=Workload(shapes=((1, 1024, 1.0), (16, 4096, 1.0))))
    with Store.open(f"sqlite:///{tmp_path / 'gpu.db'}") as store:
        report = tune(spec, store=store, devices=[device],
                      options=TuneOptions(progress=False, max_seconds=0.2, engine_max_seq_len=engine_max_seq_len))
        decisions = store.decisions()
        rows = store.measurements()
    assert not report.undecided, report.undecided
    assert sorted(bool(d.key.topk) for d in decisions) == [False, True]
    for d in decisions:
        ours = OURS[bool(d.key.topk)]
        mine = {(m.batch_size, m.kv_len): m for m in rows if m.key == d.key and m.backend == ours and m.status == "ok"}
        assert len(mine) == 2, [(m.backend, m.status, m.reason) for m in rows if m.key == d.key]
        for m in mine.values():
            assert m.params["engine_reason"] == "" and m.params["engine_median_ms"] > 0, m.params
            want = None if d.key.topk else max(engine_max_seq_len or 4096, m.kv_len)
            assert m.params["engine_max_seq_len"] == want
        best = {(s.batch_size, s.kv_len): s.median_ms for s in d.per_shape}
        expected = math.exp(sum(math.log(mine[s].params["engine_median_ms"] / best[s]) for s in best) / len(best))
        assert d.plugin_scores[ours] == pytest.approx(expected, rel=1e-9)
        got = decision_for_engine(d, "vllm", plugin_missing=None)
        own = (d.engine_best or {}).get("vllm")
        print(f"\n{d.key.label}: winner {d.winner}; {ours} tuned {d.scores.get(ours, float('nan')):.3f}x, as vLLM "
              f"launches it {d.plugin_scores[ours]:.3f}x; vLLM's own best {own} "
              f"{d.scores[own] if own else float('nan'):.3f}x -> vLLM gets {got.engine_backend} ({got.reason})")
        if d.winner != ours:
            assert got.engine_backend != ours
        elif own is None or d.plugin_scores[ours] < d.scores[own]:
            assert (got.engine_backend, got.score) == (ours, d.plugin_scores[ours])
        else:
            assert got.engine_backend == own and f"{d.plugin_scores[ours]:.2f}x" in got.reason
