"""The fault-injection suite: a store attacked as a hostile operator and a busy cluster would.

Every test is bounded in time (SIGALRM, `LIMIT_S` unless marked `time_limit(n)`), and every command run
in a subprocess has its own timeout, so a hang fails the test instead of stalling CI.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "store"))

LIMIT_S = 60
CLI = [sys.executable, "-c", "from mla_tune.cli.main import main; main()"]


def pytest_configure(config):
    config.addinivalue_line("markers", "time_limit(seconds): the fault suite's bound for one test")


@pytest.fixture(autouse=True)
def time_bound(request):
    """Fail a test that runs longer than its bound (it would otherwise hang CI)."""
    marker = request.node.get_closest_marker("time_limit")
    limit = int(marker.args[0]) if marker else LIMIT_S

    def expired(_signum, _frame):
        raise TimeoutError(f"the test ran longer than its {limit} s bound")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(limit)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(autouse=True)
def private_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg-data"))
    monkeypatch.delenv("MLA_TUNE_DB", raising=False)
    from mla_tune.runtime import clear_cache

    clear_cache()
    yield
    clear_cache()


def run_cli(*args, timeout_s: float = 30, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    """`mla-tune ARGS` in a fresh process, bounded by `timeout_s` (TimeoutExpired fails the test)."""
    full_env = {k: v for k, v in os.environ.items() if k != "MLA_TUNE_DB"}
    full_env.update(env or {})
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=timeout_s,
                          env=full_env, **kwargs)


def one_error_line(result, exit_code: int) -> str:
    """The single `mla-tune: error:` line of a failed command (asserting there is exactly one, and no traceback)."""
    assert result.returncode == exit_code, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mla-tune: error: "), result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def filled_store(url: str, *, heads=(16, 64), measurements_per_key: int = 4, node: str = "node-a") -> str:
    """A store with decisions, a run and measurements; returns the URL."""
    from store_samples import FP, H100, decision, key, measurement

    from mla_tune.store.repository import Store

    with Store.open(url) as store, store.batch():
        run_id = store.start_run(device=H100, fingerprint=FP, preset="quick", node=node)
        for h in heads:
            store.save_decision(decision(key(num_heads=h)), node=node)
            for i in range(measurements_per_key):
                store.add_measurement(run_id, measurement(key(num_heads=h), kv_len=1024 + 16 * i))
        store.finish_run(run_id)
    return url


def export_file(url: str, path) -> Path:
    from mla_tune.store.exchange import write_export
    from mla_tune.store.repository import Store

    with Store.open(url, create=False) as store:
        write_export(store, path, node="exporter")
    return Path(path)
