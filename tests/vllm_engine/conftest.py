"""Tests against the real vLLM 0.33 (marker `vllm`): run `pytest -m vllm tests/vllm_engine` in vLLM's environment.

The folder is not called `vllm`: on sys.path (pytest puts `tests/` there) it would import as a namespace
package `vllm` and pass for vLLM in every test that asks whether vLLM is installed.

Without vLLM installed every module here is skipped at collection (`importorskip`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import vllm_host as host  # noqa: E402


def _no_cuda() -> bool:
    import torch

    return not torch.cuda.is_available()


# Without a GPU our kernels (and vLLM's) run in Triton's interpreter, which must be chosen before anything
# imports Triton (importing vLLM at collection does); only in vLLM's environment, where these tests run.
# vLLM disables Triton when it sees no active GPU driver, except with an empty CUDA_VISIBLE_DEVICES (its
# rule for workers whose devices are not visible yet): that keeps its Triton kernels real here.
if host.real_vllm_installed() and _no_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture(scope="session")
def vllm_host():
    """vLLM's CUDA platform made current in this process (see `vllm_host.py`), and the plugin registered."""
    os.environ["MLA_TUNE_VLLM_PLUGIN"] = "1"

    host.start_cuda_platform()
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    return host


@pytest.fixture
def capability(vllm_host):
    """Set the reported compute capability for one test; restores 9.0 after it."""
    def set_to(major: int, minor: int) -> None:
        vllm_host.set_capability(major, minor)
    yield set_to
    vllm_host.set_capability(9, 0)


@pytest.fixture(scope="session")
def models(tmp_path_factory, vllm_host) -> dict[str, Path]:
    """Config folders: DeepSeek-V3 and V3.2 as published (128 heads), and small ones for kernel runs."""
    root = tmp_path_factory.mktemp("models")
    return {
        "DeepSeek-V3": vllm_host.deepseek_config(root / "v3"),
        "DeepSeek-V3.2": vllm_host.deepseek_config(root / "v32", topk=2048),
        "small-dense": vllm_host.deepseek_config(root / "small", heads=5, layers=1),
        "small-sparse": vllm_host.deepseek_config(root / "small-sparse", heads=3, layers=1, topk=128),
    }
