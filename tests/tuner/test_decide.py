"""The decision rule on hand-computed examples (no GPU, no store)."""

from __future__ import annotations

import math

import pytest

from mla_tune.store.records import DecisionKey, Measurement
from mla_tune.tuner.decide import NOISE_CAP, NoDecision, decide, find_anomalies, with_anomalies
from mla_tune.tuner.gate import check_output

KEY = DecisionKey(sku="NVIDIA H100 80GB HBM3 | 9.0 | 80GiB | -", compute_capability="9.0",
                  query_dtype="bf16", kv_cache_dtype="bf16", num_heads=64)


def ok(backend, batch, kv_len, ms, *, key=KEY, rel_ci=0.002, gpu="GPU-0"):
    return Measurement(key=key, backend=backend, batch_size=batch, kv_len=kv_len, status="ok", median_ms=ms,
                       ci_low_ms=ms * (1 - rel_ci), ci_high_ms=ms * (1 + rel_ci), samples=30, gpu_uuid=gpu)


def bad(backend, batch, kv_len, status, reason, *, key=KEY):
    return Measurement(key=key, backend=backend, batch_size=batch, kv_len=kv_len, status=status, reason=reason)


def test_score_is_the_weighted_geometric_mean_of_time_over_the_per_shape_best():
    # Shape 1: A 1.0, B 2.0 -> A best.  Shape 2: A 3.0, B 1.5 -> B best.
    rows = [ok("A", 1, 1024, 1.0), ok("B", 1, 1024, 2.0), ok("A", 64, 4096, 3.0), ok("B", 64, 4096, 1.5)]
    uniform = decide(KEY, rows)
    assert uniform.scores["A"] == pytest.approx(math.sqrt(1.0 * 2.0))   # 1x and 2x the best
    assert uniform.scores["B"] == pytest.approx(math.sqrt(2.0 * 1.0))
    # Weight shape 2 three times as much: A = 2^(3/4), B = 2^(1/4): B wins by 2^(1/2) - 1.
    weighted = decide(KEY, rows, weights={(1, 1024): 1.0, (64, 4096): 3.0})
    assert weighted.scores["A"] == pytest.approx(2 ** 0.75)
    assert weighted.scores["B"] == pytest.approx(2 ** 0.25)
    assert weighted.winner == "B" and weighted.runner_up == "A"
    assert weighted.margin == pytest.approx(math.sqrt(2) - 1)
    assert {(w.batch_size, w.kv_len): w.backend for w in weighted.per_shape} == {(1, 1024): "A", (64, 4096): "B"}


def test_static_choice_is_kept_within_the_noise_margin_and_not_beyond():
    rows = [ok("FAST", 1, 1024, 1.000), ok("STATIC", 1, 1024, 1.004)]   # 0.4% slower, CIs +-0.2% each
    kept = decide(KEY, rows, static_choice="STATIC")
    assert kept.winner == "STATIC" and kept.kept_static
    assert kept.runner_up == "FAST"
    assert kept.noise_margin == pytest.approx(0.005)                    # floor: 0.2% + 0.2% < 0.5%
    rows = [ok("FAST", 1, 1024, 1.00), ok("STATIC", 1, 1024, 1.05)]
    flipped = decide(KEY, rows, static_choice="STATIC")
    assert flipped.winner == "FAST" and not flipped.kept_static
    assert flipped.static_score == pytest.approx(1.05)
    assert flipped.margin == pytest.approx(0.05)


def test_noisy_measurements_widen_the_margin_but_never_past_the_cap():
    rows = [ok("FAST", 1, 1024, 1.0, rel_ci=0.05), ok("STATIC", 1, 1024, 1.03, rel_ci=0.05)]
    d = decide(KEY, rows, static_choice="STATIC")
    assert d.noise_margin == NOISE_CAP                                  # 10% measured, capped at 2%
    assert d.winner == "FAST"                                           # 3% slower is beyond 2%


def test_a_backend_that_failed_or_lied_anywhere_never_wins_even_when_fastest():
    rows = [ok("GOOD", 1, 1024, 2.0), ok("GOOD", 8, 1024, 2.0),
            ok("LIAR", 1, 1024, 0.5), bad("LIAR", 8, 1024, "incorrect", "relative error 0.1 exceeds 0.01"),
            ok("CRASHY", 1, 1024, 0.4), bad("CRASHY", 8, 1024, "failed", "the worker died of SIGSEGV"),
            bad("HANGS", 1, 1024, "timeout", "no progress for 60 s")]
    d = decide(KEY, rows, static_choice="LIAR")
    assert d.winner == "GOOD" and d.runner_up is None
    assert set(d.scores) == {"GOOD"}
    assert "incorrect at batch 8 x kv_len 1024: relative error 0.1" in d.failures["LIAR"]
    assert "SIGSEGV" in d.failures["CRASHY"] and "timeout" in d.failures["HANGS"]
    assert all(w.backend == "GOOD" for w in d.per_shape)


def test_a_backend_missing_a_shape_cannot_win_and_a_skipped_shape_is_dropped():
    rows = [ok("A", 1, 1024, 1.0), ok("B", 1, 1024, 0.5), ok("A", 8, 1024, 1.0),
            bad("A", 128, 32768, "skipped", "needs 90 GiB"), bad("B", 128, 32768, "skipped", "needs 90 GiB")]
    d = decide(KEY, rows)
    assert d.winner == "A"
    assert d.failures["B"] == "not measured at batch 8 x kv_len 1024"
    assert [(w.batch_size, w.kv_len) for w in d.per_shape] == [(1, 1024), (8, 1024)]


def test_identical_gpus_are_combined_by_median():
    rows = [ok("A", 1, 1024, 1.0, gpu="g0"), ok("A", 1, 1024, 1.2, gpu="g1"), ok("A", 1, 1024, 5.0, gpu="g2"),
            ok("B", 1, 1024, 1.1, gpu="g0")]
    d = decide(KEY, rows)
    assert d.winner == "B" and d.scores["A"] == pytest.approx(1.2 / 1.1)
    assert d.gpu_uuids == ("g0", "g1", "g2")


def test_nothing_correct_is_no_decision_with_the_reasons():
    with pytest.raises(NoDecision, match="LIAR: incorrect"):
        decide(KEY, [bad("LIAR", 1, 1024, "incorrect", "relative error 0.5")])


def _decision_at(heads, scores_by_backend):
    key = DecisionKey(**{**KEY.__dict__, "num_heads": heads})
    rows = [ok(b, 1, 1024, ms, key=key) for b, ms in scores_by_backend.items()]
    return decide(key, rows)


def test_anomaly_at_64_heads_is_detected_against_its_neighbours():
    # SPARSE is 1.10x the best at 32 and 128 heads but 1.60x at 64 heads (the TP=2 pattern).
    decisions = [_decision_at(h, {"BEST": 1.0, "SPARSE": s, "STEADY": 1.3})
                 for h, s in ((16, 1.1), (32, 1.1), (64, 1.6), (128, 1.1))]
    found = find_anomalies(decisions)
    assert list(found) == [decisions[2].key]
    (sentence,) = found[decisions[2].key]
    assert sentence.startswith("SPARSE at 64 heads scores 1.60x the per-shape best, 45% above its trend")
    marked = with_anomalies(decisions)
    assert marked[2].anomalies == (sentence,) and all(not d.anomalies for i, d in enumerate(marked) if i != 2)


def test_a_smooth_trend_is_not_an_anomaly():
    decisions = [_decision_at(h, {"BEST": 1.0, "SLOWER": s}) for h, s in ((16, 1.0), (32, 1.15), (64, 1.3),
                                                                           (128, 1.5))]
    assert find_anomalies(decisions) == {}


def test_gate_thresholds_depend_on_the_kv_dtype():
    import torch

    ref = torch.randn(2, 1, 4, 512)
    lse = torch.randn(2, 1, 4)
    off = ref * 1.015                                                   # 1.5% relative error
    assert not check_output(off, lse, ref, lse, kv_cache_dtype="bf16").ok
    assert check_output(off, lse, ref, lse, kv_cache_dtype="fp8_e4m3").ok
    nan = ref.clone()
    nan[0, 0, 0, 0] = float("nan")
    assert "non-finite" in check_output(nan, lse, ref, lse, kv_cache_dtype="bf16").reason
    assert "lse differs" in check_output(ref, lse + 0.5, ref, lse, kv_cache_dtype="bf16").reason


def test_without_a_static_choice_a_fixed_preference_breaks_ties_within_noise():
    # ZED is 0.3% faster than ALPHA, inside the 0.5% noise floor: the fixed preference (registry
    # order, then name) picks ALPHA on every run; 3% apart, the faster one wins.
    tie = decide(KEY, [ok("ZED", 1, 1024, 1.000), ok("ALPHA", 1, 1024, 1.003)], static_choice="OTHER")
    assert tie.winner == "ALPHA" and tie.runner_up == "ZED" and tie.margin == pytest.approx(1 / 1.003 - 1)
    assert not tie.kept_static
    clear = decide(KEY, [ok("ZED", 1, 1024, 1.00), ok("ALPHA", 1, 1024, 1.03)])
    assert clear.winner == "ZED" and clear.margin == pytest.approx(0.03)
    # Registry order outranks names: FLASHINFER_FA2_MLA comes before TRITON_MLA.
    known = decide(KEY, [ok("TRITON_MLA", 1, 1024, 1.000), ok("FLASHINFER_FA2_MLA", 1, 1024, 1.002)])
    assert known.winner == "FLASHINFER_FA2_MLA"
