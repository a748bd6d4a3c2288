"""Records <-> column values, shared by the repository and the read-only lookup.

Plain dicts in and out, no SQLAlchemy: the lookup path builds `Decision`s
from `sqlite3` rows with the same code the repository uses.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any, Mapping

from mla_tune.backends.device import DeviceInfo, SoftwareFingerprint
from mla_tune.store.records import Decision, DecisionKey, Measurement, ShapeWinner

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


def _json(value: Any) -> Any:
    """JSON columns come back parsed (SQLAlchemy, psycopg) or as text (raw sqlite3)."""
    return json.loads(value) if isinstance(value, (str, bytes)) else value


def key_values(key: DecisionKey) -> dict[str, Any]:
    return {name: getattr(key, name) for name in KEY_FIELDS}


def key_from(row: Mapping[str, Any]) -> DecisionKey:
    return DecisionKey(**{name: row[name] for name in KEY_FIELDS})


def fingerprint_values(fp: SoftwareFingerprint) -> dict[str, Any]:
    return {"digest": fp.digest, **asdict(fp)}


def fingerprint_from(row: Mapping[str, Any]) -> SoftwareFingerprint:
    return SoftwareFingerprint(**{name: row[name] or "" for name in FINGERPRINT_FIELDS})


def device_values(info: DeviceInfo) -> dict[str, Any]:
    return {"uuid": info.uuid, "sku": info.sku, "name": info.name,
            "compute_capability": f"{info.compute_capability[0]}.{info.compute_capability[1]}",
            "gpu_index": info.index, "memory_total_mib": info.memory_total_mib,
            "driver_version": info.driver_version, "cuda_driver_version": info.cuda_driver_version,
            "max_sm_clock_mhz": info.max_sm_clock_mhz, "power_limit_w": info.power_limit_w,
            "mig_mode": bool(info.mig_mode), "mig_profile": info.mig_profile,
            "pci_device_id": info.pci_device_id}


def device_from(row: Mapping[str, Any]) -> DeviceInfo:
    major, minor = (int(x) for x in row["compute_capability"].split("."))
    return DeviceInfo(name=row["name"], compute_capability=(major, minor), uuid=row["uuid"],
                      index=row["gpu_index"], memory_total_mib=row["memory_total_mib"],
                      driver_version=row["driver_version"],
                      cuda_driver_version=row["cuda_driver_version"],
                      max_sm_clock_mhz=row["max_sm_clock_mhz"], power_limit_w=row["power_limit_w"],
                      mig_mode=bool(row["mig_mode"]), mig_profile=row["mig_profile"],
                      pci_device_id=row["pci_device_id"])


_MEASUREMENT_FLOATS = ("median_ms", "ci_low_ms", "ci_high_ms", "rel_error")


def _float(value: Any) -> float | None:
    """Floats as the database returns them (an int 1 comes back as 1.0), so identities compare equal."""
    return None if value is None else float(value)


def measurement_values(m: Measurement) -> dict[str, Any]:
    values = {**key_values(m.key), **{name: getattr(m, name) for name in MEASUREMENT_FIELDS}}
    values.update({name: _float(values[name]) for name in _MEASUREMENT_FLOATS})
    return clean_text(values)


def measurement_from(row: Mapping[str, Any]) -> Measurement:
    values = {name: row[name] for name in MEASUREMENT_FIELDS}
    values["params"] = _json(values["params"])
    return Measurement(key=key_from(row), **values)


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
            "decided_at": d.decided_at})


def decision_from(row: Mapping[str, Any], fingerprint: SoftwareFingerprint) -> Decision:
    return Decision(key=key_from(row), winner=row["winner"], static_choice=row["static_choice"],
                    scores={k: float(v) for k, v in _json(row["scores"]).items()},
                    runner_up=row["runner_up"], margin=row["margin"],
                    static_score=row["static_score"], noise_margin=row["noise_margin"],
                    kept_static=bool(row["kept_static"]),
                    per_shape=tuple(ShapeWinner(**s) for s in _json(row["per_shape"])),
                    anomalies=tuple(_json(row["anomalies"])),
                    failures=dict(_json(row["failures"])), fingerprint=fingerprint,
                    gpu_uuids=tuple(_json(row["gpu_uuids"])), decided_at=row["decided_at"],
                    engine_best=_engine_best(row["engine_best"] if "engine_best" in row.keys() else None))


def _engine_best(value: Any) -> dict[str, str] | None:
    """{engine: backend} from the `engine_best` column; None when absent (a decision from before it)."""
    value = _json(value)
    if not isinstance(value, dict):
        return None
    return {str(k): str(v) for k, v in value.items() if isinstance(v, str)}
