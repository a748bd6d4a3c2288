"""bench/vllm_site.py's metadata shim, on the CPU."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

from bench_scripts import load


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
