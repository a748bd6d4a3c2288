"""The fault-injection suite: a store attacked as a hostile operator and a busy cluster would.

Every test is bounded in time (SIGALRM, `LIMIT_S` unless marked `time_limit(n)`), and every command run
in a subprocess has its own timeout, so a hang fails the test instead of stalling CI.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "store"))

LIMIT_S = 60


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
