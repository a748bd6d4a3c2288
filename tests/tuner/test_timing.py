"""The timing harness: order-statistic CIs, L2 rotation sizing, interleaved timing on CPU."""

from __future__ import annotations

import time

import pytest

from mla_tune.tuner.timing import (Timing, fake_bench, l2_rotation_copies, median_ci,
                                   time_interleaved)

MiB = 1024 * 1024


def test_median_ci_uses_the_binomial_order_statistics():
    xs = list(range(1, 101))                  # x_(i) = i
    med, low, high = median_ci(xs)
    assert med == 50.5 and (low, high) == (40, 61)   # the textbook 95 % ranks for n = 100
    _, low50, high50 = median_ci(xs, confidence=0.5)
    assert low < low50 <= high50 < high
    assert median_ci([5, 1, 9, 3, 7, 2, 8, 4, 6]) == (5, 2, 8)   # n = 9: ranks 2 and 8
    assert median_ci([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)   # too few: the full range


def test_median_ci_rejects_bad_arguments():
    with pytest.raises(ValueError, match="at least one"):
        median_ci([])
    with pytest.raises(ValueError, match="confidence"):
        median_ci([1.0], confidence=1.0)


def test_l2_rotation_covers_three_times_l2_within_memory():
    assert l2_rotation_copies(10 * MiB, l2_bytes=50 * MiB) == 15
    assert l2_rotation_copies(400 * MiB, l2_bytes=50 * MiB) == 1
    assert l2_rotation_copies(10 * MiB, l2_bytes=50 * MiB, free_bytes=35 * MiB) == 4
    assert l2_rotation_copies(10 * MiB, l2_bytes=50 * MiB, free_bytes=0) == 1
    assert l2_rotation_copies(1024, l2_bytes=50 * MiB) == 512
    # a sparse set reads 10 MiB of its 200 MiB: 15 copies wanted, memory for 1 + 1000 // 200
    assert l2_rotation_copies(10 * MiB, l2_bytes=50 * MiB, free_bytes=1000 * MiB, bytes_per_copy=200 * MiB) == 6
    assert l2_rotation_copies(10 * MiB, l2_bytes=50 * MiB, free_bytes=4000 * MiB, bytes_per_copy=200 * MiB) == 15
    with pytest.raises(ValueError):
        l2_rotation_copies(0, l2_bytes=50 * MiB)


def sleeper(seconds: float, calls: list, name: str):
    def step():
        calls.append(name)
        time.sleep(seconds)
    return step


def test_interleaved_timing_ranks_candidates_and_rotates_the_order():
    calls: list[str] = []
    steps = {"slow": sleeper(0.004, calls, "slow"), "fast": sleeper(0.001, calls, "fast")}
    result = time_interleaved(steps, rel_ci_target=0.5, max_seconds=1.0, min_samples=6,
                              max_samples=6, warmup=1)
    assert set(result) == {"slow", "fast"}
    assert result["fast"].median_ms < result["slow"].median_ms
    assert 3.5 < result["slow"].median_ms < 30
    assert result["slow"].samples == 6 and len(result["slow"].all_ms) == 6
    timed = calls[2:]                         # after one warm-up call each
    firsts = {timed[i] for i in range(0, len(timed), 2)}
    assert firsts == {"slow", "fast"}, "the same candidate always went first"


def test_time_cap_and_iterations_per_sample():
    class Step:
        iterations_per_replay = 4

        def __call__(self):
            time.sleep(0.004)

    t0 = time.perf_counter()
    result = time_interleaved({"x": Step()}, rel_ci_target=0.0, max_seconds=0.1,
                              min_samples=5, max_samples=1000, warmup=0)
    assert time.perf_counter() - t0 < 1.0
    timing = result["x"]
    assert timing.iterations_per_sample == 4 and 0.9 < timing.median_ms < 5
    assert timing.samples < 1000
    assert timing.ci_low_ms <= timing.median_ms <= timing.ci_high_ms


def test_converged_candidate_stops_early():
    result = time_interleaved({"steady": lambda: time.sleep(0.002)}, rel_ci_target=0.5,
                              max_seconds=5.0, min_samples=9, max_samples=500, warmup=0)
    assert result["steady"].samples < 50


def test_every_round_times_every_candidate_until_all_converge():
    # "noisy" alternates 1 and 6 ms, so its median's CI never reaches 5 %; "steady" would alone after 9 samples
    calls: list[str] = []
    noisy_sleeps = iter([0.001, 0.006] * 100)

    def noisy():
        calls.append("noisy")
        time.sleep(next(noisy_sleeps))

    steps = {"steady": sleeper(0.002, calls, "steady"), "noisy": noisy}
    result = time_interleaved(steps, rel_ci_target=0.05, max_seconds=5.0, min_samples=9, max_samples=30,
                              warmup=0)
    assert result["steady"].samples == result["noisy"].samples == 30
    rounds = [set(calls[i:i + 2]) for i in range(0, len(calls), 2)]
    assert rounds == [{"steady", "noisy"}] * 30, "a round left a candidate out"


def test_fake_bench_has_the_same_signature_and_calls_steps():
    called = []
    bench = fake_bench({"A": 1.0, "B": 2.0}, rel_spread=0.01)
    out = bench({"A": lambda: called.append("A"), "B": lambda: called.append("B")},
                rel_ci_target=0.01, max_seconds=1.0)
    assert called == ["A", "B"]
    assert isinstance(out["B"], Timing) and out["B"].median_ms == 2.0
    assert out["A"].rel_ci_half_width == pytest.approx(0.01)
    with pytest.raises(ZeroDivisionError):
        fake_bench(lambda name: 1.0)({"A": lambda: 1 / 0})
