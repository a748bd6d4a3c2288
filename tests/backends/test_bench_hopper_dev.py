"""bench/hopper_dev.py's candidate names: which tile and which measurement switches a name stands for."""

from __future__ import annotations

from bench_scripts import load


def test_a_candidate_takes_a_measurement_mode_after_an_at_sign():
    dev = load("hopper_dev")
    kind, tile_for, switches = dev.candidate("fp8:dflt@decoupled")
    assert kind == "fp8" and tile_for(32) == dev.DISPATCHED
    assert switches == {"DEBUG_MODE": dev.DEBUG_MODES["decoupled"]}
    # the mode joins the candidate's own switches, and the named form keeps its tiles
    kind, tile_for, switches = dev.candidate("fp8:kspf1@mma_only")
    assert tile_for(128) == dev.HOPPER_KSPLIT_TILE and tile_for(32) is None
    assert switches == {"L2_PREFETCH": True, "DEBUG_MODE": dev.DEBUG_MODES["mma_only"]}
    assert dev.candidate("16bit:narrow@loader_only")[1](16) == dev.HOPPER_TILES[16]


def test_a_dm_candidate_is_the_dispatched_tile_with_another_minimum_split():
    dev = load("hopper_dev")
    kind, tile_for, switches = dev.candidate("16bit:dm256")
    assert kind == "16bit" and tile_for(16) == tile_for(128) == f"{dev.DISPATCHED}:256" and switches == {}


def test_an_x_suffix_gives_the_dispatched_tile_the_splits_for_n_programs_an_sm():
    dev = load("hopper_dev")
    kind, tile_for, switches = dev.candidate("16bit:qr128x2")
    assert kind == "16bit" and tile_for(64) == f"{dev.DISPATCHED}::2" and switches == {"QUERY_REG_COLS": 128}
    assert dev.candidate("fp8:dfltx3")[1](16) == f"{dev.DISPATCHED}::3"


def test_the_dev_tools_time_a_shapes_kernels_together_round_robin():
    # `triton_dev.time_steps` (what hopper_dev times a shape's captured graphs with) goes through
    # `tuner.timing.time_interleaved`: every kernel gets the same number of replays, and they alternate in a rotating
    # order instead of one kernel's replays after another's. Without CUDA the steps are plain calls, timed by the clock.
    dev = load("triton_dev")
    calls = []
    steps = {name: (lambda name=name: calls.append(name)) for name in ("tl", "ks", "fa3")}
    times = dev.time_steps(steps, replays=6)
    assert set(times) == {"tl", "ks", "fa3"}
    assert all(low <= median <= high for median, low, high in times.values()), times
    timed = calls[2 * 3:]  # after two warm-up calls each
    assert [timed.count(name) for name in ("tl", "ks", "fa3")] == [6, 6, 6]
    rounds = [timed[i:i + 3] for i in range(0, len(timed), 3)]
    assert all(sorted(r) == ["fa3", "ks", "tl"] for r in rounds)  # each round runs every kernel once
    assert len({r[0] for r in rounds}) == 3  # and the kernel that goes first rotates
