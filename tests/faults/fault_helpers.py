"""Helpers of the fault-injection suite: run the CLI in a bounded subprocess, build stores and exports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "store"))

CLI = [sys.executable, "-c", "from mla_tune.cli.main import main; main()"]


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
