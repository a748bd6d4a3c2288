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
