"""Fuzzing the importer with hypothesis: every input is either accepted and imported, or one ExchangeError."""

from __future__ import annotations

import functools
import json
import sys
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
import fleet_data  # noqa: E402

from mla_tune.store.exchange import ExchangeError, checksum, dumps, export_document, parse_document  # noqa: E402
from mla_tune.store.importer import import_documents  # noqa: E402
from mla_tune.store.repository import Store  # noqa: E402
from mla_tune.tuner.decide import decide  # noqa: E402

FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=150)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12)


@functools.cache
def base_document() -> dict:
    with tempfile.TemporaryDirectory() as tmp, Store.open(f"sqlite:///{tmp}/base.db") as store:
        fleet_data.populate(store, node="fuzz", heads=(16,))
        return export_document(store, node="fuzz")


def _copy(document: dict) -> dict:
    return json.loads(json.dumps(document))


def _paths(value, prefix=()):
    """Every (path) into a JSON value, containers included."""
    yield prefix
    if isinstance(value, dict):
        for name, inner in value.items():
            yield from _paths(inner, prefix + (name,))
    elif isinstance(value, list):
        for i, inner in enumerate(value[:3]):   # the first few records of each list are enough
            yield from _paths(inner, prefix + (i,))


@functools.cache
def all_paths() -> tuple:
    return tuple(p for p in _paths(base_document()) if p and p != ("checksum",))


def _replace(document: dict, path: tuple, value) -> dict:
    target = document
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    return document


def _parse(data: bytes):
    """parse_document, asserting that nothing but ExchangeError ever escapes."""
    try:
        return parse_document(data, source="fuzz.json")
    except ExchangeError as exc:
        message = str(exc)
        assert message.startswith("fuzz.json: ") and "\n" not in message
        return None


@FUZZ
@given(st.binary(max_size=4096))
def test_random_bytes_are_rejected_cleanly(data):
    assert _parse(data) is None


@FUZZ
@given(st.data())
def test_truncations_and_byte_flips_of_a_good_file_are_rejected(data):
    raw = dumps(base_document())
    cut = data.draw(st.integers(min_value=0, max_value=len(raw) - 2))
    assert _parse(raw[:cut]) is None
    position = data.draw(st.integers(min_value=0, max_value=len(raw) - 1))
    flipped = bytearray(raw)
    flipped[position] ^= data.draw(st.integers(min_value=1, max_value=255))
    # Whitespace-only changes keep the content (and its checksum) intact.
    parsed = _parse(bytes(flipped))
    if parsed is not None:
        assert parsed == base_document()


@FUZZ
@given(path=st.integers(min_value=0, max_value=10**6),
       value=json_values)
def test_unsigned_edits_fail_the_checksum(path, value):
    paths = all_paths()
    document = _replace(_copy(base_document()), paths[path % len(paths)], value)
    parsed = _parse(dumps(document))
    if parsed is not None:
        assert checksum(document) == base_document()["checksum"]  # the edit changed nothing


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=60)
@given(path=st.integers(min_value=0, max_value=10**6), value=json_values)
def test_resigned_edits_are_rejected_or_import_cleanly(path, value):
    paths = all_paths()
    document = _replace(_copy(base_document()), paths[path % len(paths)], value)
    document["checksum"] = checksum(document)
    parsed = _parse(dumps(document))
    if parsed is None:
        return
    # Whatever passes validation must import without any error, twice (idempotent).
    with tempfile.TemporaryDirectory() as tmp, Store.open(f"sqlite:///{tmp}/t.db") as store:
        first = import_documents(store, [parsed], files=["fuzz.json"], decide=decide)
        again = import_documents(store, [parsed], files=["fuzz.json"], decide=decide)
        assert again.measurements_added == 0 and again.decisions_saved == 0, (first, again)


_VALID_EDITS = {
    "median_ms": st.floats(min_value=1e-6, max_value=1e6),
    "batch_size": st.integers(min_value=1, max_value=1 << 20),
    "kv_len": st.integers(min_value=1, max_value=1 << 26),
    "backend": st.sampled_from(sorted(__import__("mla_tune.backends.registry", fromlist=["BACKENDS"]).BACKENDS)),
    "status": st.sampled_from(["ok", "failed", "incorrect", "timeout", "skipped", "ineligible"]),
    "reason": st.text(max_size=200),
    "gpu_uuid": st.text(max_size=96),
}
_VALID_KEY_EDITS = {
    "num_heads": st.integers(min_value=1, max_value=1024),
    "sku": st.text(min_size=1, max_size=255),
    "page_size": st.integers(min_value=1, max_value=4096),
    "kv_cache_dtype": st.sampled_from(["bf16", "fp16", "fp8_e4m3", "fp8_ds_mla"]),
}


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=25)
@given(data=st.data())
def test_valid_edits_import_and_reimport_cleanly(data):
    document = _copy(base_document())
    measurements = document["content"]["measurements"]
    for _ in range(data.draw(st.integers(min_value=1, max_value=4))):
        record = measurements[data.draw(st.integers(min_value=0, max_value=len(measurements) - 1))]
        if data.draw(st.booleans()):
            name = data.draw(st.sampled_from(sorted(_VALID_EDITS)))
            record[name] = data.draw(_VALID_EDITS[name])
        else:
            name = data.draw(st.sampled_from(sorted(_VALID_KEY_EDITS)))
            record["key"][name] = data.draw(_VALID_KEY_EDITS[name])
    node = data.draw(st.text(max_size=40))
    document["content"]["decisions"][0]["node"] = node
    document["checksum"] = checksum(document)
    parsed = _parse(dumps(document))
    if parsed is None:      # e.g. status "ok" drawn without a time
        return
    with tempfile.TemporaryDirectory() as tmp, Store.open(f"sqlite:///{tmp}/t.db") as store:
        import_documents(store, [parsed], files=["fuzz.json"], decide=decide)
        again = import_documents(store, [parsed], files=["fuzz.json"], decide=decide)
        assert again.measurements_added == 0 and again.decisions_saved == 0
        assert len(store.measurements()) == len({json.dumps(m, sort_keys=True) for m in measurements})
