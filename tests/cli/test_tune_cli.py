"""`mla-tune tune`: bad input is one line and exit 2 with nothing stored; no GPU is exit 1."""

from __future__ import annotations

import pytest

from mla_tune.backends.device import DeviceInfo
from mla_tune.tuner import probe

GPUS = [DeviceInfo("NVIDIA H100 80GB HBM3", (9, 0), uuid=f"GPU-{i}", index=i, memory_total_mib=81559)
        for i in range(2)]


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(probe, "probe_devices", lambda **_: list(GPUS))
    monkeypatch.setattr(probe, "device_busy_reasons", lambda index, **_: ["3 other process(es) use GPU 1 (pid 7)"]
                        if index == 1 else [])


@pytest.mark.parametrize("args, message", [
    (["--model", "llama-3"], "unknown model preset 'llama-3'"),
    (["--tp", "3"], "no TP in [3] divides deepseek-v3's 128 heads"),
    (["--tp", "two"], "expected a comma-separated list of integers"),
    (["--heads", "0"], "expected positive integers"),
    (["--kv-cache-dtype", "int3"], "unknown kv_cache_dtype 'int3'"),
    (["--budget-s", "0.5"], "--budget-s 0.5 cannot fit a single measurement"),
    (["--quick", "--thorough"], "mutually exclusive"),
    (["--workload", "{missing}"], "cannot read workload file"),
    (["--workload", "{bad}"], "does not parse"),
    (["--gpus", "0,7"], "GPU index 7 does not exist (this node has GPU(s) 0, 1)"),
    (["--gpus", "some"], "expected 'all' or GPU indices"),
    (["--skip-backends", "MLA_TUNE_TRITON_FP8Q,NOPE"], "unknown backend 'NOPE'"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_stored(cli, tmp_path, two_gpus, args, message):
    bad = tmp_path / "bad.json"
    bad.write_text("{oops")
    args = [a.replace("{missing}", str(tmp_path / "nope.json")).replace("{bad}", str(bad)) for a in args]
    db = tmp_path / "t.db"
    result = cli("--db", f"sqlite:///{db}", "tune", *args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert not db.exists()


def test_no_gpu_is_one_line_exit_1(cli, tmp_path, monkeypatch):
    def no_nvml(**_):
        raise probe.ProbeError("NVML could not start (NVML Shared Library Not Found)")

    monkeypatch.setattr(probe, "probe_devices", no_nvml)
    db = tmp_path / "t.db"
    result = cli("--db", f"sqlite:///{db}", "tune", "--quick")
    assert result.exit_code == 1
    assert result.stderr.strip() == ("mla-tune: error: cannot tune: NVML could not start "
                                     "(NVML Shared Library Not Found)")
    assert not db.exists()


def test_a_busy_gpu_is_reported_and_not_timed(cli, tmp_path, two_gpus):
    db = tmp_path / "t.db"
    result = cli("--db", f"sqlite:///{db}", "tune", "--gpus", "1")
    assert result.exit_code == 1
    assert "GPU 1 (NVIDIA H100 80GB HBM3) is busy and will not be timed" in result.stderr
    assert "no idle GPU to time" in result.stderr
    assert not db.exists()


@pytest.mark.slow
def test_main_job_tunes_and_prints_the_decision_table(cli, tmp_path, monkeypatch):
    """`mla-tune` with no command, end to end on CPU: real workers and store, fake backends and timing."""
    import dataclasses
    import json
    from pathlib import Path

    from mla_tune.tuner import presets, run

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "tuner"))
    from fake_mla_backends import ADAPTERS

    monkeypatch.setattr(probe, "probe_devices", lambda **_: [GPUS[0]])
    monkeypatch.setattr(probe, "device_busy_reasons", lambda index, **_: [])
    monkeypatch.setenv("MLA_TUNE_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.setenv("MLA_TUNE_FAKE_MS", json.dumps({"FAKE_GOOD": 1.0, "FAKE_OTHER": 1.5}))
    real = run.TuneOptions

    def fake_options(**kw):
        return dataclasses.replace(real(**kw), worker_device="cpu", progress=False, max_seconds=0.05,
                                   adapters={n: ADAPTERS[n] for n in ("FAKE_GOOD", "FAKE_OTHER", "FAKE_LIAR")},
                                   bench="fake_mla_backends:fake_bench", static_choice="FAKE_OTHER")

    monkeypatch.setattr(run, "TuneOptions", fake_options)
    # The default preset, on a two-shape grid so that the CPU run stays short.
    monkeypatch.setitem(presets.GRIDS, "default", ((1, 2), (64,), ()))
    db = tmp_path / "t.db"
    # 16 keys: DeepSeek-V3 (dense) and V3.2 (sparse) x bf16/fp8 KV x 16/32/64/128 heads, 2 shapes each.
    # The table is as wide as $COLUMNS (160 when piped): pin it, so that the developer's terminal does not matter.
    monkeypatch.setenv("COLUMNS", "160")
    result = cli("--db", f"sqlite:///{db}", "tune", "--heads", "16,32,64,128")
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    assert ("Decisions (key, winner, margin over the runner-up, vLLM's static choice, anomalies) on "
            f"{GPUS[0].sku}") in out
    # at 160 columns a row of one SKU keeps every cell on one line: names and margins are whole
    assert out.count("FAKE_GOOD") == 16 and out.count("50.0% over FAKE_OTHER") == 16
    assert max(len(line) for line in out.splitlines() if line.startswith("│")) <= 160
    assert "FAKE_LIAR cannot win: incorrect at batch" in out
    assert "Measured 32 of 32 shape(s)" in out and "Time went to: worker start" in out
    monkeypatch.setenv("COLUMNS", "80")                    # too narrow for the table: one block per decision
    again = cli("--db", f"sqlite:///{db}")                 # the main job: everything is tuned already
    assert again.exit_code == 0, again.stderr
    assert "16 key(s) already tuned with this software were skipped" in again.stdout
    assert "Measured 0 of 0 shape(s)" in again.stdout
    assert "Decisions (key, winner" in again.stdout and again.stdout.count("margin: 50.0% over FAKE_OTHER") == 16
    table_text, _, _ = again.stdout.partition("Measured ")
    assert max(len(line) for line in table_text.splitlines()) <= 80


def test_default_gpu_is_the_first_idle_one(monkeypatch):
    from mla_tune.cli.tune import select_devices

    monkeypatch.setattr(probe, "device_busy_reasons", lambda index, **_: ["GPU 0 utilisation is 97%"]
                        if index == 0 else [])
    assert [d.index for d in select_devices(GPUS, None, force=False)] == [1]       # GPU 0 serves traffic
    assert [d.index for d in select_devices(GPUS, None, force=True)] == [0]
    assert [d.index for d in select_devices(GPUS, "all", force=False)] == [1]
