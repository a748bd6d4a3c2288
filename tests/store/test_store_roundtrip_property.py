"""Any measurement or decision the tuner can build comes back from the store equal (hypothesis)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from store_samples import FP, H100, key

from mla_tune.store.records import STATUSES, Decision, Measurement, ShapeWinner
from mla_tune.store.repository import Store

text = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=200)


def text_of(max_size: int):
    """Text that fits a column of `max_size` characters (PostgreSQL refuses longer; SQLite would keep it)."""
    return st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
                   max_size=max_size)


floats = st.floats(min_value=1e-9, max_value=1e6, allow_nan=False, allow_infinity=False)
maybe_float = st.none() | floats
small_int = st.integers(min_value=0, max_value=2**31 - 1)
keys = st.builds(lambda heads, kv, page, topk, q_len: key(num_heads=heads, kv_cache_dtype=kv, page_size=page,
                                                           topk=topk, q_len=q_len),
                 st.integers(1, 256), st.sampled_from(["bf16", "fp16", "fp8_e4m3"]),
                 st.sampled_from([1, 16, 32, 64]), st.sampled_from([0, 512, 2048]), st.integers(1, 4))
measurements = st.builds(Measurement, key=keys, backend=st.sampled_from(["TRITON_MLA", "FLASHMLA"]),
                         batch_size=st.integers(1, 1024), kv_len=st.integers(1, 1 << 20),
                         status=st.sampled_from(STATUSES), median_ms=maybe_float, ci_low_ms=maybe_float,
                         ci_high_ms=maybe_float, samples=small_int, rel_error=maybe_float, reason=text,
                         gpu_uuid=text_of(96), sm_clock_mhz_before=st.none() | small_int,
                         temperature_c_after=st.none() | st.integers(-50, 150), measured_at=text_of(40),
                         params=st.none() | st.fixed_dictionaries({
                             "tile": st.dictionaries(st.sampled_from(["block_h", "num_warps", "split_d"]),
                                                     st.integers(0, 1024) | st.booleans()),
                             "label": text, "default_median_ms": maybe_float,
                             "rejected": st.dictionaries(text, text, max_size=2)}))
decisions = st.builds(Decision, key=keys, winner=st.sampled_from(["TRITON_MLA", "FLASHINFER_FA3_MLA"]),
                      static_choice=st.none() | st.just("FLASHMLA"),
                      scores=st.dictionaries(st.sampled_from(["TRITON_MLA", "FLASHMLA", "CUTLASS_MLA"]), floats),
                      runner_up=st.none() | text_of(64), margin=maybe_float, static_score=maybe_float,
                      noise_margin=floats, kept_static=st.booleans(),
                      per_shape=st.lists(st.builds(ShapeWinner, st.integers(1, 1024), st.integers(1, 1 << 20),
                                                   st.just("TRITON_MLA"), floats), max_size=5).map(tuple),
                      anomalies=st.lists(text, max_size=3).map(tuple),
                      failures=st.dictionaries(text, text, max_size=3), fingerprint=st.just(FP),
                      gpu_uuids=st.lists(text, max_size=3).map(tuple), decided_at=text_of(40))


@pytest.fixture(scope="module")
def shared_store(request, tmp_path_factory):
    """One store per backend for all examples (a fresh database per example would be slow)."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('prop') / 'store.db'}"
    else:
        url = request.getfixturevalue("pg_module_url")
    with Store.open(url) as store:
        yield store


@pytest.fixture(scope="module")
def pg_module_url(pg_admin_url):
    import uuid

    from pg_server import create_database, drop_database
    from sqlalchemy.engine import make_url

    name = f"mla_prop_{uuid.uuid4().hex[:12]}"
    create_database(pg_admin_url, name)
    yield make_url(pg_admin_url).set(database=name).render_as_string(hide_password=False)
    drop_database(pg_admin_url, name)


BACKENDS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("shared_store", BACKENDS, indirect=True)
@SETTINGS
@given(m=measurements)
def test_measurement_round_trip(shared_store, m):
    run_id = shared_store.start_run(device=H100, fingerprint=FP, preset="prop", node="n")
    shared_store.add_measurement(run_id, m)
    assert shared_store.measurements(run_id=run_id) == [m]


@pytest.mark.parametrize("shared_store", BACKENDS, indirect=True)
@SETTINGS
@given(d=decisions)
def test_decision_round_trip(shared_store, d):
    shared_store.save_decision(d)
    assert shared_store.decision(d.key, fingerprint=FP) == d


@pytest.mark.parametrize("shared_store", BACKENDS, indirect=True)
def test_nul_characters_are_replaced_not_fatal(shared_store):
    """A crashed backend's output may hold NUL, which PostgreSQL text cannot store."""
    m = Measurement(key=key(), backend="FLASHMLA", batch_size=1, kv_len=1, status="failed",
                    reason="worker died: b'\x00\x01'")
    run_id = shared_store.start_run(device=H100, fingerprint=FP, preset="nul", node="n")
    shared_store.add_measurement(run_id, m)
    assert shared_store.measurements(run_id=run_id) == [dataclasses.replace(m, reason="worker died: b'\ufffd\x01'")]
