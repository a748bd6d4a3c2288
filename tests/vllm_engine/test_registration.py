"""The plugin registers MLA_TUNE_TRITON and MLA_TUNE_TRITON_SPARSE in a real vLLM, only when enabled."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import vllm_host  # noqa: E402

vllm_host.require_vllm()
pytestmark = pytest.mark.vllm

PROBE = """
import json
from vllm.plugins import load_general_plugins
from vllm.v1.attention.backends.registry import AttentionBackendEnum
load_general_plugins()
load_general_plugins()
from mla_tune.vllm_plugin import register
register()                         # a second registration in one process changes nothing
found = {}
for name in ("MLA_TUNE_TRITON", "MLA_TUNE_TRITON_SPARSE"):
    if name in AttentionBackendEnum.__members__:
        member = AttentionBackendEnum[name]
        found[name] = [member.get_path(), member.get_class().get_name(), member.get_class().is_sparse()]
print(json.dumps(found))
"""


def _probe(env: dict) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MLA_TUNE", "VLLM_"))}
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                            env={**clean, **env}, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_enabled_plugin_registers_both_backends_in_vllm():
    found = _probe({"MLA_TUNE_VLLM_PLUGIN": "1"})
    assert found == {
        "MLA_TUNE_TRITON": ["mla_tune.vllm_backends.dense.MlaTuneTritonBackend", "MLA_TUNE_TRITON", False],
        "MLA_TUNE_TRITON_SPARSE": ["mla_tune.vllm_backends.sparse.MlaTuneTritonSparseBackend",
                                   "MLA_TUNE_TRITON_SPARSE", True],
    }


def test_plugin_registers_nothing_unless_enabled():
    assert _probe({}) == {}


def test_plugin_status_in_vllms_environment(monkeypatch):
    from mla_tune.vllm_plugin import plugin_status

    monkeypatch.setenv("MLA_TUNE_VLLM_PLUGIN", "1")
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    status = plugin_status()
    assert status.can_serve and status.installed and status.enabled and status.reasons == ()
    assert status.vllm_version.startswith("0.33")
    monkeypatch.setenv("VLLM_PLUGINS", "someone_else")
    status = plugin_status()
    assert not status.can_serve and not status.enabled
    assert status.reasons == ("VLLM_PLUGINS='someone_else' does not list mla_tune, so vLLM does not load it",)
    monkeypatch.delenv("MLA_TUNE_VLLM_PLUGIN")
    status = plugin_status(check_opt_in=False)   # as lookup --format vllm asks from an operator's shell
    assert status.can_serve and not status.enabled and status.reasons == ()
