"""The software fingerprint: versions from package metadata, CUDA runtime read as text, kernel-source hash."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata

from mla_tune.backends import software
from mla_tune.backends.software import current_fingerprint, kernel_hash, torch_cuda_runtime


def test_fingerprint_reports_installed_versions():
    fp = current_fingerprint(driver_version="580.65.06")
    assert fp.driver == "580.65.06"
    assert fp.torch == metadata.version("torch")
    assert fp.triton == metadata.version("triton")
    assert fp.mla_tune == __import__("mla_tune").__version__
    assert len(fp.kernel_hash) == 16 and fp.kernel_hash == kernel_hash()
    assert current_fingerprint(driver_version="580.65.06") is fp  # cached


def test_a_missing_package_is_an_empty_version():
    assert software.package_version("mla-tune-no-such-distribution") == ""


def test_fingerprint_does_not_import_gpu_libraries():
    code = ("import sys, json; from mla_tune.backends.software import current_fingerprint; "
            "fp = current_fingerprint(); "
            "print(json.dumps({'torch': fp.torch, 'loaded': [m for m in ('torch', 'triton', 'flashinfer') "
            "if m in sys.modules]}))")
    out = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                    check=True).stdout)
    assert out["loaded"] == [] and out["torch"]


def test_kernel_hash_changes_when_a_kernel_source_changes(tmp_path):
    (tmp_path / "kernel.py").write_text("BLOCK = 64\n")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "kernel.py").write_text("ignored")
    first = kernel_hash(tmp_path)
    (tmp_path / "__pycache__" / "kernel.py").write_text("still ignored")
    assert kernel_hash(tmp_path) == first
    (tmp_path / "kernel.py").write_text("BLOCK = 128\n")
    assert kernel_hash(tmp_path) != first
    (tmp_path / "kernel.py").write_text("BLOCK = 64\n")
    assert kernel_hash(tmp_path) == first


def test_cuda_runtime_of_torch(monkeypatch, tmp_path):
    import importlib.util

    import torch  # noqa: F401 - only to compare with what we read without importing it

    assert torch_cuda_runtime() == (torch.version.cuda or "")
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "version.py").write_text("__version__ = '2.11.0+cu130'\ncuda: Optional[str] = '13.0'\n")
    spec = importlib.util.spec_from_file_location("torch", fake / "__init__.py",
                                                  submodule_search_locations=[str(fake)])
    monkeypatch.setattr(software.importlib.util, "find_spec", lambda name: spec)
    assert torch_cuda_runtime() == "13.0"
    (fake / "version.py").write_text("cuda: Optional[str] = None\n")
    assert torch_cuda_runtime() == ""
    monkeypatch.setattr(software.importlib.util, "find_spec", lambda name: None)
    assert torch_cuda_runtime("2.11.0+cu128") == "12.8"
    assert torch_cuda_runtime("2.13.0+cpu") == ""
