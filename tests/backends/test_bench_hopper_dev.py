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
