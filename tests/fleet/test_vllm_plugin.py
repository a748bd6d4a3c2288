"""The vLLM general plugin against a minimal fake host that follows vLLM's plugin contract.

Each case runs in a fresh interpreter with `tests/fleet/fake_vllm` on the path:
the host discovers our entry point through `importlib.metadata` exactly as
vLLM does, calls it with no arguments, then builds an engine config.
This is not a real vLLM: the plugin has not run inside one here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import fleet_data  # noqa: E402

from mla_tune.store.repository import Store  # noqa: E402

FAKE_HOST = Path(__file__).parent / "fake_vllm"

HOST_SCRIPT = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from vllm.plugins import load_general_plugins
from vllm.engine.arg_utils import EngineArgs
load_general_plugins()
load_general_plugins()            # vLLM guards this; calling again must change nothing
if "mla_tune.vllm_plugin" in sys.modules:    # loaded by the host: a second register must not wrap twice
    sys.modules["mla_tune.vllm_plugin"].register()
args = EngineArgs(**json.loads(sys.argv[1]))
config = args.create_engine_config()
backend = config["attention_backend"]
print(json.dumps({"backend": getattr(backend, "name", backend),
                  "is_enum": type(backend).__name__ == "AttentionBackendEnum"}))
"""


@pytest.fixture(scope="module")
def tuned_db(tmp_path_factory) -> str:
    """A real SQLite store tuned for DeepSeek-V3 at TP 8 (16 heads) and TP 2 (64 heads), fp8 KV."""
    from mla_tune.backends.software import current_fingerprint

    path = tmp_path_factory.mktemp("plugin") / "decisions.db"
    with Store.open(f"sqlite:///{path}") as store:
        fleet_data.populate(store, heads=(16, 64), fingerprint=current_fingerprint())
    return f"sqlite:///{path}"


def run_host(engine_args: dict, *, env: dict, with_host: bool = True) -> tuple[dict | None, str]:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("MLA_TUNE", "VLLM_")) and k != "PYTHONPATH"}
    clean.update(env)
    if with_host:
        clean["PYTHONPATH"] = str(FAKE_HOST)
    result = subprocess.run([sys.executable, "-c", HOST_SCRIPT, json.dumps(engine_args)],
                            capture_output=True, text=True, env=clean, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


def _enabled(db: str, **extra) -> dict:
    return {"MLA_TUNE_VLLM_PLUGIN": "1", "MLA_TUNE_DB": db, "MLA_TUNE_VLLM_DEVICE": "NVIDIA H200;9.0", **extra}


DEEPSEEK_TP8_FP8 = {"model": "deepseek-ai/DeepSeek-V3", "tensor_parallel_size": 8, "kv_cache_dtype": "fp8"}


def test_tuned_winner_vllm_lacks_becomes_the_best_backend_vllm_has(tuned_db):
    # The tuned winner (FLASHINFER_FA2_MLA) has no vLLM name; the decision's engine_best says vLLM's
    # fastest own backend is FLASHMLA, so that is what the engine gets, as vLLM's enum.
    out, log = run_host(DEEPSEEK_TP8_FP8, env=_enabled(tuned_db))
    assert out == {"backend": "FLASHMLA", "is_enum": True}
    assert "vLLM's fastest own backend is FLASHMLA" in log and "the fastest kernel FLASHINFER_FA2_MLA" in log


def test_a_decision_made_before_vllms_kernels_were_timed_is_not_acted_on(tmp_path):
    # A stale decision (engine_best None) may name a kernel vLLM does not run under that name: vLLM chooses.
    from dataclasses import replace

    from mla_tune.backends.software import current_fingerprint

    path = tmp_path / "stale.db"
    with Store.open(f"sqlite:///{path}") as store:
        k = fleet_data.key(16)
        ms = fleet_data.measurements(k)
        store.save_decision(replace(fleet_data.decision(k, ms, fingerprint=current_fingerprint()),
                                    engine_best=None), node="node-a")
    out, log = run_host(DEEPSEEK_TP8_FP8, env=_enabled(f"sqlite:///{path}"))
    assert out["backend"] is None
    assert "made before mla-tune timed vLLM's own kernels" in log


@pytest.mark.parametrize("user", [{"attention_backend": "FLASHMLA"},
                                  {"attention_config": {"backend": "FLASH_ATTN_MLA"}}])
def test_the_users_choice_is_never_overridden(tuned_db, user):
    out, log = run_host({**DEEPSEEK_TP8_FP8, **user}, env=_enabled(tuned_db))
    assert out["backend"] == user.get("attention_backend")   # unchanged: the flag, or None with a config
    assert "the user chose attention backend" in log


def test_the_environment_choice_is_never_overridden(tuned_db):
    out, log = run_host(DEEPSEEK_TP8_FP8, env=_enabled(tuned_db, VLLM_ATTENTION_BACKEND="FLASHMLA"))
    assert out["backend"] is None and "the user chose attention backend FLASHMLA" in log


@pytest.mark.parametrize("env", [{}, {"MLA_TUNE_VLLM_PLUGIN": "0"}], ids=["unset", "zero"])
def test_inert_unless_enabled(tuned_db, env):
    out, _ = run_host(DEEPSEEK_TP8_FP8, env={"MLA_TUNE_DB": tuned_db, "MLA_TUNE_VLLM_DEVICE": "NVIDIA H200;9.0",
                                              **env})
    assert out["backend"] is None


def test_not_loaded_when_vllm_plugins_excludes_it(tuned_db):
    out, _ = run_host(DEEPSEEK_TP8_FP8, env=_enabled(tuned_db, VLLM_PLUGINS="some_other_plugin"))
    assert out["backend"] is None


def test_untuned_key_and_non_mla_model_leave_vllm_to_choose(tuned_db):
    untuned, log = run_host({**DEEPSEEK_TP8_FP8, "tensor_parallel_size": 4}, env=_enabled(tuned_db))  # 32 heads
    assert untuned["backend"] is None and "nothing tuned for 32 heads" in log
    llama, _ = run_host({"model": "meta-llama/Llama-3.1-8B"}, env=_enabled(tuned_db))
    assert llama["backend"] is None


@pytest.mark.parametrize("problem", ["garbage store", "bad device override"])
def test_problems_never_stop_the_engine(tmp_path, tuned_db, problem):
    if problem == "garbage store":  # lookup falls back and warns; nothing is set
        (tmp_path / "bad.db").write_bytes(b"this is not a database" * 100)
        out, _ = run_host(DEEPSEEK_TP8_FP8, env=_enabled(f"sqlite:///{tmp_path / 'bad.db'}"))
        assert out["backend"] is None
    else:
        # A malformed device override makes the plugin's own lookup fail; the engine still starts.
        out, log = run_host(DEEPSEEK_TP8_FP8, env=_enabled(tuned_db, MLA_TUNE_VLLM_DEVICE="garbage-without-cc"))
        assert out["backend"] is None and "could not choose the MLA backend" in log


def test_register_is_inert_without_vllm():
    code = ("import sys, mla_tune.vllm_plugin as p; p.register(); "
            "assert 'vllm' not in sys.modules; assert 'torch' not in sys.modules; print('ok')")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["MLA_TUNE_VLLM_PLUGIN"] = "1"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_the_entry_point_is_declared_for_vllm():
    from importlib.metadata import entry_points

    found = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert found.get("mla_tune") == "mla_tune.vllm_plugin:register"


@pytest.mark.parametrize("chosen, model, kept", [
    ("MLA_TUNE_TRITON", "deepseek-ai/DeepSeek-V3", True),
    ("MLA_TUNE_TRITON_SPARSE", "deepseek-ai/DeepSeek-V3.2", True),
    ("MLA_TUNE_TRITON_SPARSE", "deepseek-ai/DeepSeek-V3", False),
    ("MLA_TUNE_TRITON", "deepseek-ai/DeepSeek-V3.2", False),
])
def test_our_backend_is_kept_only_where_it_can_run(tuned_db, chosen, model, kept):
    out, log = run_host({"model": model, "attention_backend": chosen}, env=_enabled(tuned_db))
    if kept:
        assert out["backend"] == chosen and "cannot run this model" not in log
    else:
        assert out["backend"] is None   # vLLM's normal selection
        assert log.count("cannot run this model") == 1 and "vLLM chooses the attention backend" in log


def test_fp8_on_an_ampere_gpu_is_handed_back_with_the_reason(tuned_db):
    env = _enabled(tuned_db, MLA_TUNE_VLLM_DEVICE="NVIDIA A100-SXM4-80GB;8.0")
    out, log = run_host({**DEEPSEEK_TP8_FP8, "attention_backend": "MLA_TUNE_TRITON"}, env=env)
    assert out["backend"] is None
    assert "reads an FP8 cache from compute capability 8.9 (native e4m3); this GPU has 8.0" in log


def test_plugin_status_without_vllm_says_why(monkeypatch):
    from mla_tune.vllm_plugin import plugin_status

    monkeypatch.setenv("MLA_TUNE_VLLM_PLUGIN", "1")
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    status = plugin_status()
    assert not status.can_serve and not status.installed and status.vllm_version is None
    assert status.reasons[0] == "vLLM is not installed in this environment (no 'vllm' distribution)"


def test_plugin_status_names_the_missing_opt_in(monkeypatch):
    from mla_tune.vllm_plugin import plugin_status

    monkeypatch.delenv("MLA_TUNE_VLLM_PLUGIN", raising=False)
    status = plugin_status()
    assert not status.enabled and not status.can_serve
    assert "MLA_TUNE_VLLM_PLUGIN is None, not 1: the plugin is inert" in status.reasons
    # A shell that is not the engine's (lookup --format vllm): the opt-in is reported, not held against it.
    status = plugin_status(check_opt_in=False)
    assert not status.enabled and not any("MLA_TUNE_VLLM_PLUGIN" in r for r in status.reasons)


def test_plugin_status_imports_neither_torch_nor_vllm():
    code = ("import sys, mla_tune.vllm_plugin as p; p.plugin_status(); "
            "assert 'torch' not in sys.modules and 'vllm' not in sys.modules; print('ok')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
