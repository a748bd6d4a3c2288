"""bench/vllm_adapters.py's plan and bench/vllm_site.py's metadata shim, on the CPU."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

from bench_scripts import BENCH, load


def test_the_plan_covers_the_grid_with_our_kernel_beside_vllms():
    out = subprocess.run([sys.executable, str(BENCH / "vllm_adapters.py"), "--dry-run"], capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert len(out) == 2 * 3 * 3 * 2      # kv dtypes x heads x batches x (dense, sparse)
    assert "bf16 h16 b1 kv4096: FLASHMLA, FLASH_ATTN_MLA, TRITON_MLA, MLA_TUNE_TRITON" in out
    assert ("fp8_e4m3 h128 b128 kv32768 topk2048: FLASHMLA_SPARSE, FLASH_ATTN_MLA_SPARSE, "
            "FLASHINFER_MLA_SPARSE_SM90, MLA_TUNE_TRITON_SPARSE") in out


def test_the_shim_gives_vllm_a_version_and_an_unspecified_platform_plugin(tmp_path):
    site = load("vllm_site")
    info = site.write_shim(tmp_path, "0.33.0")
    dist = next(importlib.metadata.distributions(path=[str(tmp_path)]))
    assert dist.metadata["Name"] == "vllm" and dist.version == "0.33.0" and info.name == "vllm-0.33.0.dist-info"
    (plugin,) = [ep for ep in dist.entry_points if ep.group == "vllm.platform_plugins"]
    sys.path.insert(0, str(tmp_path))
    try:
        assert plugin.load()() == "vllm.platforms.interface.UnspecifiedPlatform"
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(site.PLUGIN_MODULE, None)
    assert Path(tmp_path / f"{site.PLUGIN_MODULE}.py").exists()
