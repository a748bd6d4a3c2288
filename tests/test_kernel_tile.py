"""`mla_tune.kernel_tile`: the tuned launch tile of our Triton kernel, read back from a real store."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest

from mla_tune import kernel_tile
from mla_tune.runtime import clear_cache
from mla_tune.backends.device import DeviceInfo
from mla_tune.backends.problem import Problem
from mla_tune.backends.software import current_fingerprint
from mla_tune.store.records import DecisionKey, Measurement
from mla_tune.store.repository import Store

H100 = DeviceInfo(name="NVIDIA H100 80GB HBM3", compute_capability=(9, 0), memory_total_mib=81559,
                  pci_device_id="0x233010DE", driver_version="580.65.06", uuid="GPU-1")
H100_ARG = {"name": "NVIDIA H100 80GB HBM3", "compute_capability": (9, 0)}
NARROW = {"block_h": 16, "block_n": 64, "num_warps": 4, "num_stages": 2, "split_d": False, "per_sm": 1,
          "reload_v": False, "min_split_tokens": 128, "hoist_pages": 0, "fp16_math": False, "max_regs": 0,
          "split_scores": False, "opaque_v_cast": False, "warp_specialized": True}
TL = {**NARROW, "block_n": 32, "split_d": True, "per_sm": 2, "reload_v": True, "min_split_tokens": 64,
      "hoist_pages": 64, "fp16_math": True, "warp_specialized": False}


@pytest.fixture(autouse=True)
def _fresh_memo():
    clear_cache()
    yield
    clear_cache()


def test_answers_are_memoised_per_process(tmp_path):
    url = f"sqlite:///{tmp_path / 'memo.db'}"
    _tuned(url)
    first = kernel_tile(16, "fp8", batch_size=96, kv_len=8192, device=H100_ARG, db=url)
    (tmp_path / "memo.db").unlink()
    assert kernel_tile(16, "fp8", batch_size=96, kv_len=8192, device=H100_ARG, db=url) is first


def _tuned(url: str, *, fingerprint=None, shapes=((1, 4096, TL), (128, 16384, NARROW)), backend="MLA_TUNE_TRITON",
           heads=16) -> None:
    fingerprint = fingerprint or current_fingerprint(driver_version=H100.driver_version)
    key = DecisionKey.of(H100.sku, H100.compute_capability, Problem(num_heads=heads, kv_cache_dtype="fp8"))
    with Store.open(url) as store:
        run = store.start_run(device=H100, fingerprint=fingerprint, preset="test", node="n1")
        for batch, kv_len, tile in shapes:
            store.add_measurement(run, Measurement(
                key=key, backend=backend, batch_size=batch, kv_len=kv_len, status="ok", median_ms=0.4,
                ci_low_ms=0.39, ci_high_ms=0.41, samples=20, rel_error=2e-3, gpu_uuid=H100.uuid,
                measured_at="2026-11-25T05:00:00Z",
                params=None if tile is None else {"tile": tile, "label": "x", "default_label": "d",
                                                  "default_median_ms": 0.5, "candidates": 4, "rejected": {}}))
        store.finish_run(run)


def test_the_tile_of_the_nearest_measured_shape_is_returned(store_url):
    _tuned(store_url)
    big = kernel_tile(16, "fp8", batch_size=96, kv_len=8192, device=H100_ARG, db=store_url)
    assert (big.source, dict(big.tile), big.measured_shape) == ("tuned", NARROW, (128, 16384))
    assert "batch 128, kv_len 16384" in big.why and "0.5 ms with the default d" in big.why
    small = kernel_tile(16, "fp8", batch_size=2, kv_len=3000, device=H100_ARG, db=store_url)
    assert (dict(small.tile), small.measured_shape) == (TL, (1, 4096))


def test_other_keys_devices_and_sparse_get_the_default(store_url):
    _tuned(store_url)
    for why, kwargs in (("heads", dict(num_heads=32)), ("dtype", dict(kv_cache_dtype="bf16")),
                        ("sparse", dict(sparse=True)),
                        ("device", dict(device={"name": "NVIDIA H200", "compute_capability": (9, 0)}))):
        args = {"num_heads": 16, "kv_cache_dtype": "fp8", "device": H100_ARG, **kwargs}
        got = kernel_tile(args.pop("num_heads"), args.pop("kv_cache_dtype"), batch_size=4, kv_len=4096,
                          db=store_url, **args)
        assert (got.source, got.tile) == ("default", None), why
        assert "no tuned" in got.why


def test_a_tile_measured_with_other_kernel_sources_is_not_used(tmp_path):
    url = f"sqlite:///{tmp_path / 'stale.db'}"
    stale = replace(current_fingerprint(driver_version=H100.driver_version), kernel_hash="0" * 16)
    _tuned(url, fingerprint=stale)
    got = kernel_tile(16, "fp8", batch_size=4, kv_len=4096, device=H100_ARG, db=url)
    assert (got.source, got.tile) == ("default", None) and "other software" in got.why


def test_store_problems_fall_back_and_bad_arguments_raise(tmp_path):
    missing = kernel_tile(16, "fp8", batch_size=4, kv_len=4096, device=H100_ARG,
                          db=f"sqlite:///{tmp_path / 'nope.db'}")
    assert (missing.source, missing.tile) == ("default", None) and "could not be read" in missing.why
    corrupt = tmp_path / "corrupt.db"
    corrupt.write_bytes(b"not a database" * 100)
    got = kernel_tile(16, "fp8", batch_size=4, kv_len=4096, device=H100_ARG, db=f"sqlite:///{corrupt}")
    assert got.source == "default" and "could not be read" in got.why
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="batch_size must be a positive int"):
            kernel_tile(16, "fp8", batch_size=bad, kv_len=4096, device=H100_ARG, db=f"sqlite:///{corrupt}")


def test_an_old_schema_store_says_to_upgrade(tmp_path):
    url = f"sqlite:///{tmp_path / 'old.db'}"
    _tuned(url)
    with Store.open(url) as store:
        store.downgrade("0001")
    got = kernel_tile(16, "fp8", batch_size=4, kv_len=4096, device=H100_ARG, db=url)
    assert got.source == "default" and "run `mla-tune db upgrade`" in got.why


def test_kernel_tile_imports_no_torch(tmp_path):
    import subprocess

    code = ("import sys, mla_tune; "
            "t = mla_tune.kernel_tile(16, 'fp8', batch_size=4, kv_len=4096, "
            "device={'name': 'NVIDIA H100 80GB HBM3', 'compute_capability': (9, 0)}, "
            f"db='sqlite:///{tmp_path / 'none.db'}'); "
            "print(t.source, 'torch' in sys.modules, 'triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["default", "False", "False"]


def test_a_stored_launch_without_a_tile_is_ignored_not_fatal(tmp_path):
    url = f"sqlite:///{tmp_path / 'odd.db'}"
    _tuned(url, shapes=((4, 4096, None),))
    with Store.open(url) as store:  # a row written by hand: params without a tile
        run = store.start_run(device=H100, fingerprint=current_fingerprint(driver_version=H100.driver_version),
                              preset="test", node="n1")
        key = DecisionKey.of(H100.sku, H100.compute_capability, Problem(num_heads=16, kv_cache_dtype="fp8"))
        store.add_measurement(run, Measurement(key=key, backend="MLA_TUNE_TRITON", batch_size=8, kv_len=4096,
                                               status="ok", median_ms=0.4, params={"label": "x"}))
    got = kernel_tile(16, "fp8", batch_size=4, kv_len=4096, device=H100_ARG, db=url)
    assert (got.source, got.tile) == ("default", None) and "no tuned" in got.why
