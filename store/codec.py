"""Records <-> column values, shared by the repository and the read-only lookup.

Plain dicts in and out, no SQLAlchemy: the lookup path builds `Decision`s
from `sqlite3` rows with the same code the repository uses.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from typing import Any, Mapping

from mla_tune.backends.device import DeviceInfo, SoftwareFingerprint
from mla_tune.store.records import Decision, DecisionKey, Measurement, ShapeWinner
from mla_tune.store.sqlite_file import CorruptValueError, Unparsed

KEY_FIELDS = ("sku", "compute_capability", "query_dtype", "kv_cache_dtype", "num_heads",
              "geometry", "page_size", "topk", "q_len")
FINGERPRINT_FIELDS = ("torch", "triton", "flashinfer", "cuda_runtime", "driver", "mla_tune",
                      "kernel_hash")
MEASUREMENT_FIELDS = ("backend", "batch_size", "kv_len", "status", "median_ms", "ci_low_ms",
                      "ci_high_ms", "samples", "rel_error", "reason", "gpu_uuid",
                      "sm_clock_mhz_before", "sm_clock_mhz_after", "temperature_c_before",
                      "temperature_c_after", "measured_at", "params")


def clean_text(value: Any) -> Any:
    """Strings with NUL characters replaced by U+FFFD (PostgreSQL text cannot hold NUL; a
    crashed backend's error output can contain one); containers cleaned recursively."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, dict):
        return {clean_text(k): clean_text(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean_text(v) for v in value]
    return value


def _json(value: Any, column: str = "a JSON column") -> Any:
    """JSON columns come back parsed (SQLAlchemy, psycopg) or as text (raw sqlite3)."""
    if isinstance(value, Unparsed):
        raise CorruptValueError(f"{column} holds {_shown(str(value))}, which is not JSON")
    if not isinstance(value, (str, bytes)):
        return value
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        raise CorruptValueError(f"{column} holds {_shown(value)}, which is not JSON") from None


# -- reading rows: every value is checked for its kind, so that a row changed behind mla-tune's back is a
# one-line CorruptValueError naming the column, never a TypeError far away.

def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _bad(column: str, value: Any, kind: str) -> CorruptValueError:
    return CorruptValueError(f"column {column} holds {_shown(value)}, not {kind}")


def _text(row: Mapping[str, Any], column: str, *, null: bool = False) -> str | None:
    value = row[column]
    if value is None and null:
        return None
    if not isinstance(value, str):
        raise _bad(column, value, "text")
    return value


def _int(row: Mapping[str, Any], column: str, *, null: bool = False) -> int | None:
    value = row[column]
    if value is None and null:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(column, value, "an integer")
    return value


def _number(value: Any, column: str, *, null: bool = False) -> float | None:
    if value is None and null:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(column, value, "a finite number")
    return float(value)


def _list_of(value: Any, column: str, kind: type) -> list:
    if not isinstance(value, list) or not all(isinstance(v, kind) for v in value):
        raise _bad(column, value, f"a list of {kind.__name__}")
    return value


def _map(value: Any, column: str) -> dict:
    if not isinstance(value, dict):
        raise _bad(column, value, "a JSON object")
    return value


def key_values(key: DecisionKey) -> dict[str, Any]:
    return {name: getattr(key, name) for name in KEY_FIELDS}


_KEY_INTS = ("num_heads", "page_size", "topk", "q_len")


def key_from(row: Mapping[str, Any]) -> DecisionKey:
    return DecisionKey(**{name: _int(row, name) if name in _KEY_INTS else _text(row, name)
                          for name in KEY_FIELDS})


def fingerprint_values(fp: SoftwareFingerprint) -> dict[str, Any]:
    return {"digest": fp.digest, **asdict(fp)}


def fingerprint_from(row: Mapping[str, Any]) -> SoftwareFingerprint:
    return SoftwareFingerprint(**{name: _text(row, name, null=True) or "" for name in FINGERPRINT_FIELDS})


def device_values(info: DeviceInfo) -> dict[str, Any]:
    return {"uuid": info.uuid, "sku": info.sku, "name": info.name,
            "compute_capability": f"{info.compute_capability[0]}.{info.compute_capability[1]}",
            "gpu_index": info.index, "memory_total_mib": info.memory_total_mib,
            "driver_version": info.driver_version, "cuda_driver_version": info.cuda_driver_version,
            "max_sm_clock_mhz": info.max_sm_clock_mhz, "power_limit_w": info.power_limit_w,
            "mig_mode": bool(info.mig_mode), "mig_profile": info.mig_profile,
            "pci_device_id": info.pci_device_id}


def device_from(row: Mapping[str, Any]) -> DeviceInfo:
    cc = _text(row, "compute_capability")
    major, dot, minor = cc.partition(".")
    if not (dot and major.isdigit() and minor.isdigit()):
        raise _bad("compute_capability", cc, "a compute capability such as '9.0'")
    return DeviceInfo(name=_text(row, "name"), compute_capability=(int(major), int(minor)), uuid=_text(row, "uuid"),
                      index=_int(row, "gpu_index"), memory_total_mib=_int(row, "memory_total_mib"),
                      driver_version=_text(row, "driver_version"),
                      cuda_driver_version=_text(row, "cuda_driver_version"),
                      max_sm_clock_mhz=_int(row, "max_sm_clock_mhz"),
                      power_limit_w=_number(row["power_limit_w"], "power_limit_w"),
                      mig_mode=bool(row["mig_mode"]), mig_profile=_text(row, "mig_profile", null=True),
                      pci_device_id=_text(row, "pci_device_id"))


_MEASUREMENT_FLOATS = ("median_ms", "ci_low_ms", "ci_high_ms", "rel_error")


def _float(value: Any) -> float | None:
    """Floats as the database returns them (an int 1 comes back as 1.0), so identities compare equal."""
    return None if value is None else float(value)


def measurement_values(m: Measurement) -> dict[str, Any]:
    values = {**key_values(m.key), **{name: getattr(m, name) for name in MEASUREMENT_FIELDS}}
    values.update({name: _float(values[name]) for name in _MEASUREMENT_FLOATS})
    return clean_text(values)


_MEASUREMENT_TEXTS = ("backend", "status", "reason", "gpu_uuid", "measured_at")
_MEASUREMENT_INTS = ("batch_size", "kv_len", "samples")


def measurement_from(row: Mapping[str, Any]) -> Measurement:
    values: dict[str, Any] = {name: _text(row, name) for name in _MEASUREMENT_TEXTS}
    values.update({name: _int(row, name) for name in _MEASUREMENT_INTS})
    values.update({name: _number(row[name], name, null=True) for name in _MEASUREMENT_FLOATS})
    values.update({name: _int(row, name, null=True) for name in MEASUREMENT_FIELDS
                   if name.startswith(("sm_clock", "temperature"))})
    params = _json(row["params"], "params")
    if params is not None:
        _map(params, "params")
    values["params"] = params
    try:
        return Measurement(key=key_from(row), **values)
    except ValueError as exc:  # an unknown status
        raise CorruptValueError(f"column status: {exc}") from None


def decision_values(d: Decision) -> dict[str, Any]:
    """Column values of a decision (without node/updated_at, which the writer adds)."""
    return clean_text({**key_values(d.key), "fingerprint_digest": d.fingerprint.digest, "winner": d.winner,
            "runner_up": d.runner_up, "margin": _float(d.margin), "static_choice": d.static_choice,
            "static_score": _float(d.static_score), "noise_margin": _float(d.noise_margin),
            "kept_static": bool(d.kept_static), "scores": {k: float(v) for k, v in d.scores.items()},
            "per_shape": [{**asdict(s), "median_ms": float(s.median_ms)} for s in d.per_shape],
            "anomalies": list(d.anomalies),
            "failures": dict(d.failures), "gpu_uuids": list(d.gpu_uuids),
            "engine_best": None if d.engine_best is None else dict(d.engine_best),
            "plugin_scores": None if d.plugin_scores is None
            else {k: float(v) for k, v in d.plugin_scores.items()},
            "decided_at": d.decided_at})


def _shape_winner(value: Any) -> ShapeWinner:
    entry = _map(value, "per_shape")
    if set(entry) != {"batch_size", "kv_len", "backend", "median_ms"}:
        raise _bad("per_shape", value, "an object of batch_size, kv_len, backend, median_ms")
    return ShapeWinner(batch_size=_int(entry, "batch_size"), kv_len=_int(entry, "kv_len"),
                       backend=_text(entry, "backend"), median_ms=_number(entry["median_ms"], "per_shape median_ms"))


def decision_from(row: Mapping[str, Any], fingerprint: SoftwareFingerprint) -> Decision:
    scores = _map(_json(row["scores"], "scores"), "scores")
    failures = _map(_json(row["failures"], "failures"), "failures")
    if not all(isinstance(v, str) for v in failures.values()):
        raise _bad("failures", failures, "an object of texts")
    kept = row["kept_static"]
    if kept not in (0, 1, True, False):
        raise _bad("kept_static", kept, "true or false")
    return Decision(key=key_from(row), winner=_text(row, "winner"),
                    static_choice=_text(row, "static_choice", null=True),
                    scores={str(k): _number(v, "scores") for k, v in scores.items()},
                    runner_up=_text(row, "runner_up", null=True), margin=_number(row["margin"], "margin", null=True),
                    static_score=_number(row["static_score"], "static_score", null=True),
                    noise_margin=_number(row["noise_margin"], "noise_margin"),
                    kept_static=bool(kept),
                    per_shape=tuple(_shape_winner(s) for s in _list_of(_json(row["per_shape"], "per_shape"),
                                                                      "per_shape", dict)),
                    anomalies=tuple(_list_of(_json(row["anomalies"], "anomalies"), "anomalies", str)),
                    failures=dict(failures), fingerprint=fingerprint,
                    gpu_uuids=tuple(_list_of(_json(row["gpu_uuids"], "gpu_uuids"), "gpu_uuids", str)),
                    decided_at=_text(row, "decided_at"),
                    engine_best=_engine_best(row["engine_best"] if "engine_best" in row.keys() else None),
                    plugin_scores=_plugin_scores(row["plugin_scores"] if "plugin_scores" in row.keys() else None))


def _engine_best(value: Any) -> dict[str, str] | None:
    """{engine: backend} from the `engine_best` column; None for a decision that never timed the engines'
    own kernels (stored before the column, or migrated)."""
    value = _json(value, "engine_best")
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise _bad("engine_best", value, "an object of backend names")
    return dict(value)


def _plugin_scores(value: Any) -> dict[str, float] | None:
    """{backend: score} from the `plugin_scores` column; None for a decision that never timed the launch our
    vLLM plugin makes (stored before the column, or upgraded)."""
    value = _json(value, "plugin_scores")
    if value is None:
        return None
    scores = _map(value, "plugin_scores")
    return {str(k): _number(v, "plugin_scores") for k, v in scores.items()}
