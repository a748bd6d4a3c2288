"""`import mla_tune` and a lookup load no torch, triton, flashinfer (nor SQLAlchemy), checked in a clean interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "triton", "flashinfer", "sqlalchemy", "alembic")


def run_python(code: str, **env) -> dict:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**__import__("os").environ, **env})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_import_mla_tune_loads_no_heavy_module():
    loaded = run_python(
        "import sys, json, mla_tune; mla_tune.__version__; "
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    assert loaded == []


def test_lookup_on_a_real_sqlite_store_loads_no_heavy_module(tmp_path):
    from mla_tune.store.repository import Store

    url = f"sqlite:///{tmp_path / 'd.db'}"
    Store.open(url).close()
    code = (
        "import sys, json, mla_tune\n"
        f"c = mla_tune.lookup(64, 'fp8', device={{'name': 'NVIDIA H100 80GB HBM3', 'compute_capability': (9, 0)}},"
        f" db={url!r})\n"
        "mla_tune.static_priority(compute_capability=(10, 0), kv_cache_dtype='fp8', num_heads=64)\n"
        f"print(json.dumps({{'backend': c.backend, 'loaded': [m for m in {HEAVY!r} if m in sys.modules]}}))")
    out = run_python(code)
    assert out["loaded"] == []
    assert out["backend"]


def test_importing_the_cli_loads_no_gpu_library():
    loaded = run_python(
        "import sys, json, mla_tune.cli.main; "
        "print(json.dumps([m for m in ('torch', 'triton', 'flashinfer') if m in sys.modules]))")
    assert loaded == []


def test_installed_names_live_under_mla_tune():
    out = run_python(
        "import json, importlib.util as u; "
        "print(json.dumps({n: u.find_spec(n) is not None for n in "
        "('mla_tune.store', 'mla_tune.backends', 'mla_tune.tuner', 'mla_tune.cli')}))")
    assert all(out.values())


def test_the_public_api_imports_no_tuner_code_even_when_it_probes_the_gpu(tmp_path):
    from pathlib import Path

    shim = str(Path(__file__).parent / "nvml_absent")   # NVML without a driver: the probe runs and fails
    url = f"sqlite:///{tmp_path / 'none.db'}"
    code = (
        "import sys, json, mla_tune\n"
        "try:\n"
        f"    mla_tune.lookup(64, 'fp8', db={url!r})\n"
        "except mla_tune.runtime.NoDeviceError as exc:\n"
        "    probed = 'no NVIDIA GPU found' in str(exc)\n"
        "print(json.dumps({'probed': probed, 'tuner': sorted(m for m in sys.modules if m.startswith('mla_tune.tuner'))}))")
    out = run_python(code, PYTHONPATH=shim)
    assert out == {"probed": True, "tuner": []}
