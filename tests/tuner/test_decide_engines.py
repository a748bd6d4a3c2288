"""The decision rule's engine part: each engine's fastest own backend, and a static choice that loses."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mla_tune.store.records import DecisionKey, Measurement
from mla_tune.tuner.decide import decide, with_anomalies

KEY = DecisionKey(sku="NVIDIA H100 80GB HBM3 | 9.0 | 80GiB | 0x2330", compute_capability="9.0",
                  query_dtype="bf16", kv_cache_dtype="fp8_e4m3", num_heads=64, topk=2048)


def _times(**ms_by_backend) -> list[Measurement]:
    return [Measurement(key=KEY, backend=backend, batch_size=b, kv_len=32768, status="ok", median_ms=ms * b,
                        ci_low_ms=ms * b * 0.995, ci_high_ms=ms * b * 1.005, samples=20)
            for backend, ms in ms_by_backend.items() for b in (1, 16, 128)]


def test_engine_best_is_the_fastest_backend_the_engine_runs_under_its_own_name():
    d = decide(KEY, _times(MLA_TUNE_TRITON_SPARSE=1.0, FLASHMLA_SPARSE=1.45, FLASH_ATTN_MLA_SPARSE=1.2,
                           FLASHINFER_FA3_MLA_SPARSE=1.1), static_choice="FLASHMLA_SPARSE")
    assert d.winner == "MLA_TUNE_TRITON_SPARSE"          # the fastest kernel overall
    assert d.engine_best["vllm"] == "FLASH_ATTN_MLA_SPARSE"   # ours and FlashInfer's wrapper are not vLLM's


def test_a_static_choice_slower_than_vllms_own_best_is_an_anomaly():
    d = decide(KEY, _times(MLA_TUNE_TRITON_SPARSE=1.0, FLASHMLA_SPARSE=1.45, FLASH_ATTN_MLA_SPARSE=1.2),
               static_choice="FLASHMLA_SPARSE")
    (flagged,) = with_anomalies([d])
    assert any("vLLM's static choice FLASHMLA_SPARSE takes 1.21x the time of vLLM's fastest backend "
               "FLASH_ATTN_MLA_SPARSE at 64 heads" in a for a in flagged.anomalies)
    close = decide(KEY, _times(MLA_TUNE_TRITON_SPARSE=1.0, FLASHMLA_SPARSE=1.25, FLASH_ATTN_MLA_SPARSE=1.2),
                   static_choice="FLASHMLA_SPARSE")
    assert not with_anomalies([close])[0].anomalies       # 4% is not worth an operator's attention


DENSE = DecisionKey(sku="NVIDIA H100 80GB HBM3 | 9.0 | 80GiB | 0x2330", compute_capability="9.0",
                    query_dtype="bf16", kv_cache_dtype="bf16", num_heads=16)
SHAPES = ((1, 1024), (16, 8192), (128, 32768))


def _dense(backend: str, ms: float, *, engine_ms: float | None = None, shapes=SHAPES) -> list[Measurement]:
    """`backend` at every shape (`ms` x batch); a refined one with `engine_ms` x batch as the vLLM launch's time."""
    params = None
    out = []
    for b, kv_len in shapes:
        if engine_ms is not None:
            params = {"tile": {"block_h": 16}, "label": "t", "default_label": "t", "default_median_ms": ms * b,
                      "candidates": 2, "rejected": {}, "engine_median_ms": engine_ms * b,
                      "engine_max_seq_len": 32768, "engine_reason": ""}
        out.append(Measurement(key=DENSE, backend=backend, batch_size=b, kv_len=kv_len, status="ok",
                               median_ms=ms * b, ci_low_ms=ms * b * 0.995, ci_high_ms=ms * b * 1.005, samples=20,
                               params=params))
    return out


def test_the_vllm_launch_is_scored_against_the_same_per_shape_best():
    d = decide(DENSE, _dense("MLA_TUNE_TRITON", 1.0, engine_ms=1.12) + _dense("FLASHMLA", 1.05)
               + _dense("TRITON_MLA", 2.0), static_choice="FLASHMLA")
    assert d.winner == "MLA_TUNE_TRITON" and d.scores["MLA_TUNE_TRITON"] == pytest.approx(1.0)
    assert d.plugin_scores == {"MLA_TUNE_TRITON": pytest.approx(1.12)}
    # weighted: the vLLM launch loses most where the weight is
    mixed = _dense("MLA_TUNE_TRITON", 1.0)
    mixed = [replace(m, params={**_dense("MLA_TUNE_TRITON", 1.0, engine_ms=e)[0].params,
                                "engine_median_ms": e * m.batch_size})
             for m, e in zip(mixed, (1.0, 1.0, 1.3))]
    weighted = decide(DENSE, mixed + _dense("FLASHMLA", 1.05),
                      weights={(1, 1024): 1.0, (16, 8192): 1.0, (128, 32768): 2.0})
    assert weighted.plugin_scores["MLA_TUNE_TRITON"] == pytest.approx(1.3 ** 0.5)


def test_ours_fastest_as_tuned_but_slower_as_vllm_launches_it_hands_vllm_flashmla():
    from mla_tune.engines import decision_for_engine

    d = decide(DENSE, _dense("MLA_TUNE_TRITON", 1.0, engine_ms=1.12) + _dense("FLASHMLA", 1.05),
               static_choice="FLASHMLA")
    assert d.winner == "MLA_TUNE_TRITON"
    got = decision_for_engine(d, "vllm", plugin_missing=None)
    assert (got.engine_backend, got.basis, got.score) == ("FLASHMLA", "engine_best", pytest.approx(1.05))
    assert "MLA_TUNE_TRITON as vLLM launches it takes 1.12x the time of the fastest kernel; FLASHMLA 1.05x" \
        in got.reason


def test_ours_still_fastest_as_vllm_launches_it_goes_to_vllm_with_that_score():
    from mla_tune.engines import decision_for_engine

    d = decide(DENSE, _dense("MLA_TUNE_TRITON", 1.0, engine_ms=1.03) + _dense("FLASHMLA", 1.05),
               static_choice="FLASHMLA")
    got = decision_for_engine(d, "vllm", plugin_missing=None)
    assert (got.engine_backend, got.basis, got.score) == ("MLA_TUNE_TRITON", "winner", pytest.approx(1.03))
    assert "as vLLM launches it takes 1.03x the time of the fastest kernel; vLLM's fastest own backend FLASHMLA " \
           "1.05x" in got.reason


def test_a_vllm_launch_missing_at_one_shape_is_not_scored_and_not_handed_to_vllm():
    from mla_tune.engines import decision_for_engine

    ours = _dense("MLA_TUNE_TRITON", 1.0, engine_ms=1.0)
    ours[1] = replace(ours[1], params={**ours[1].params, "engine_median_ms": None,
                                       "engine_reason": "relative error 0.3 against the reference exceeds 0.01"})
    d = decide(DENSE, ours + _dense("FLASHMLA", 1.05))
    assert d.plugin_scores == {}
    got = decision_for_engine(d, "vllm", plugin_missing=None)
    assert got.engine_backend == "FLASHMLA" and "not timed as vLLM launches it at every shape" in got.reason
