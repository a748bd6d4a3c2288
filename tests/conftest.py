"""Shared test set-up: the `gpu` marker is skipped centrally when no CUDA GPU is usable; `no_gpu` makes NVML
report no driver (tests/nvml_fake.py), so the no-GPU paths run on every machine."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest


@functools.cache
def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def no_gpu(monkeypatch):
    """NVML without a driver in this process and in the subprocesses it starts, whatever GPUs the machine has."""
    import nvml_fake

    from mla_tune.runtime import clear_cache

    monkeypatch.setitem(sys.modules, "pynvml", nvml_fake.FakeNVML(init_error="NVML Shared Library Not Found"))
    shim = str(Path(__file__).parent / "nvml_absent")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [shim, os.environ.get("PYTHONPATH")])))
    clear_cache()
    yield
    clear_cache()


# --- PostgreSQL and the store URL fixtures (store engineer) ------------------------------------------

PG_URL_ENV = "MLA_TUNE_TEST_PG_URL"


@pytest.fixture(scope="session")
def pg_admin_url():
    """URL of a PostgreSQL server for this session: `$MLA_TUNE_TEST_PG_URL`, else a throwaway local cluster.

    Without PostgreSQL binaries the postgres tests fail when `$CI` is set (CI
    must really run them) and are skipped otherwise.
    """
    import os

    if os.environ.get(PG_URL_ENV):
        yield os.environ[PG_URL_ENV]
        return
    from pg_server import find_pg_bin, start_server

    if find_pg_bin() is None:
        message = ("PostgreSQL binaries (initdb, pg_ctl) not found; install them with "
                   f"`apt-get install -y postgresql` or set {PG_URL_ENV}")
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    server = start_server()
    try:
        yield server.url()
    finally:
        server.stop()


@pytest.fixture
def pg_url(pg_admin_url):
    """A fresh, empty database on the session's PostgreSQL server, dropped after the test."""
    import uuid

    from pg_server import create_database, drop_database
    from sqlalchemy.engine import make_url

    name = f"mla_test_{uuid.uuid4().hex[:12]}"
    create_database(pg_admin_url, name)
    try:
        yield make_url(pg_admin_url).set(database=name).render_as_string(hide_password=False)
    finally:
        drop_database(pg_admin_url, name)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def store_url(request, tmp_path):
    """A URL for a fresh store: a new SQLite file, and (marked `postgres`) a new PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    return request.getfixturevalue("pg_url")
