"""The NVML probe against a fake NVML module (no driver can exist here), and without NVML at all."""

from __future__ import annotations

import pytest

from mla_tune.tuner.probe import ProbeError, device_busy_reasons, local_device, probe_devices
from nvml_fake import FakeNVML, gpu


def test_probe_reads_every_gpu_and_forms_the_sku():
    nvml = FakeNVML([gpu(), gpu(name="NVIDIA H200", memory_mib=143771, uuid="GPU-h200", pci_id=0x233510DE)])
    devices = probe_devices(nvml=nvml)
    assert [d.name for d in devices] == ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]
    h100 = devices[0]
    assert h100.compute_capability == (9, 0)
    assert h100.memory_class_gib == 80
    assert h100.driver_version == "580.65.06"
    assert h100.cuda_driver_version == "13.0"
    assert h100.max_sm_clock_mhz == 1980
    assert h100.power_limit_w == 700.0
    assert h100.pci_device_id == "0x233010DE"
    assert h100.sku == "NVIDIA H100 80GB HBM3 | 9.0 | 80GiB | 0x233010DE"
    assert devices[1].sku == "NVIDIA H200 | 9.0 | 140GiB | 0x233510DE"
    assert nvml.initialized == nvml.shutdowns == 1


def test_mig_instances_are_listed_with_their_profile_in_the_sku():
    nvml = FakeNVML([gpu(migs=[("3g.40gb", 40192, "MIG-a"), ("3g.40gb", 40192, "MIG-b")]), gpu(uuid="GPU-2")])
    devices = probe_devices(nvml=nvml)
    assert len(devices) == 3
    mig = devices[0]
    assert mig.name == "NVIDIA H100 80GB HBM3" and mig.compute_capability == (9, 0)
    assert mig.mig_mode and mig.mig_profile == "3g.40gb" and mig.uuid == "MIG-a"
    assert mig.memory_class_gib == 39
    assert mig.sku.endswith("| MIG 3g.40gb")
    assert devices[2].mig_profile is None and not devices[2].mig_mode and devices[2].index == 1


def test_unsupported_optional_queries_do_not_fail_the_probe():
    (device,) = probe_devices(nvml=FakeNVML([gpu(power_mw=None)]))
    assert device.power_limit_w == 0.0


def test_no_driver_is_one_clear_line():
    with pytest.raises(ProbeError) as info:
        probe_devices(nvml=FakeNVML(init_error="Driver Not Loaded"))
    message = str(info.value)
    assert message == "no NVIDIA GPU found: NVML could not start (Driver Not Loaded)"
    assert "\n" not in message


def test_zero_gpus_is_an_error():
    with pytest.raises(ProbeError, match="reports 0 devices"):
        probe_devices(nvml=FakeNVML([]))


def test_real_nvml_without_a_driver_fails_cleanly():
    try:
        devices = probe_devices()
    except ProbeError as exc:
        assert str(exc).startswith("no NVIDIA GPU found") and "\n" not in str(exc)
    else:
        assert devices  # a GPU machine: the real probe worked


def test_busy_reasons_name_other_processes_and_utilisation():
    nvml = FakeNVML([gpu(pids=[4242, 99], utilization=87), gpu()])
    reasons = device_busy_reasons(0, nvml=nvml, own_pid=99)
    assert reasons == ["1 other process(es) use GPU 0 (pid 4242)", "GPU 0 utilisation is 87% (above 5%)"]
    assert device_busy_reasons(1, nvml=nvml) == []
    with pytest.raises(ProbeError, match="GPU index 2 does not exist"):
        device_busy_reasons(2, nvml=nvml)


def test_local_device_follows_cuda_visible_devices(monkeypatch):
    nvml = FakeNVML([gpu(uuid="GPU-aaaa"), gpu(name="NVIDIA H200", uuid="GPU-bbbb", memory_mib=143771)])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert local_device(nvml=nvml).uuid == "GPU-aaaa"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert local_device(nvml=nvml).name == "NVIDIA H200"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bb")
    assert local_device(nvml=nvml).uuid == "GPU-bbbb"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    with pytest.raises(ProbeError, match="names no GPU"):
        local_device(nvml=nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ProbeError, match="sees no GPU"):
        local_device(nvml=nvml)
