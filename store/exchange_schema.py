"""The export file format (schema version 3; versions 1 and 2 are read too) as data, and its strict validator.

docs/export-schema.md describes the format for people; this module is what
enforces it. Every field has one checker; a checker returns None or a
sentence naming the observed value. Unknown fields, missing fields, wrong
types, values out of range and unknown backend names are all errors: an
import file is untrusted input, and nothing from it is ever executed or
unpickled (it is parsed as JSON and checked field by field).
"""

from __future__ import annotations

import math
import re
from datetime import datetime

from mla_tune.backends.problem import KV_CACHE_DTYPES, QUERY_DTYPES
from mla_tune.backends.registry import BACKENDS
from mla_tune.store.records import RUN_STATUSES, STATUSES

FORMAT = "mla-tune-export"
# 2: measurements carry `params` (version 1 files have none; read as null). 3: our Triton kernels are
# MLA_TUNE_TRITON(_SPARSE) and decisions carry `engine_best` (older files are renamed on reading). 4: decisions
# carry `plugin_scores` and refined measurements' params the vLLM launch's time (older files read it as null).
SCHEMA_VERSION = 4
MAX_LIST = 2_000_000            # records per list; the byte limit bites first in practice


class SchemaError(ValueError):
    """The file does not follow the schema; the message names the field and the value."""


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# Names, versions and other one-line values hold no control character (an ANSI sequence or a newline in a
# node name would reach terminals); free text (a failure's reason) may hold tabs and newlines; nothing holds
# NUL, which PostgreSQL text cannot store.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_TEXT_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _control_problem(v: str, pattern: re.Pattern) -> str | None:
    found = pattern.search(v)
    if found is None:
        return None
    return f"holds the control character U+{ord(found.group()):04X} at position {found.start()}"


def string(max_len: int = 255, *, empty: bool = True, pattern: str | None = None, free_text: bool = False):
    regex = re.compile(pattern) if pattern else None
    controls = _TEXT_CONTROL if free_text else _CONTROL

    def check(v):
        if not isinstance(v, str):
            return f"{_show(v)} is not a string"
        if len(v) > max_len:
            return f"a string of {len(v)} characters is longer than {max_len}"
        problem = _control_problem(v, controls)
        if problem:
            return problem
        if not v and not empty:
            return "is empty"
        if regex and v and not regex.fullmatch(v):
            return f"{_show(v)} does not match {pattern}"
        return None
    return check


def integer(lo: int, hi: int):
    def check(v):
        if isinstance(v, bool) or not isinstance(v, int):
            return f"{_show(v)} is not an integer"
        if not lo <= v <= hi:
            return f"{v} is not in [{lo}, {hi}]"
        return None
    return check


def number(lo: float, hi: float, *, lo_open: bool = False):
    def check(v):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return f"{_show(v)} is not a number"
        if not math.isfinite(v):
            return f"{v} is not finite"
        if v > hi or v < lo or (lo_open and v == lo):
            return f"{v} is not in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
        return None
    return check


def boolean(v):
    return None if isinstance(v, bool) else f"{_show(v)} is not true or false"


def one_of(values):
    allowed = tuple(values)

    def check(v):
        if v not in allowed:
            shown = ", ".join(map(str, allowed[:8])) + (", ..." if len(allowed) > 8 else "")
            return f"{_show(v)} is not one of {shown}"
        return None
    return check


def backend_name(v):
    if not isinstance(v, str) or v not in BACKENDS:
        return f"unknown backend {_show(v)} (known: the names of `mla-tune backends`)"
    return None


def timestamp(*, empty: bool = True):
    def check(v):
        if not isinstance(v, str) or len(v) > 40:
            return f"{_show(v)} is not an ISO 8601 timestamp"
        if not v:
            return None if empty else "is empty"
        try:
            datetime.fromisoformat(v.replace("Z", "+00:00"))
        except ValueError:
            return f"{_show(v)} is not an ISO 8601 timestamp"
        return None
    return check


def optional(inner):
    return lambda v: None if v is None else inner(v)


DIGEST = string(32, empty=False, pattern=r"[0-9a-f]{16}")
CC = string(8, empty=False, pattern=r"\d{1,2}\.\d{1,2}")
MS = number(0.0, 1e6, lo_open=True)     # a decode step of more than 1000 s is not a measurement
SCORE = number(0.999, 1e6)              # time / per-shape best, so >= 1 up to float rounding

KEY = {
    "sku": string(255, empty=False),
    "compute_capability": CC,
    "query_dtype": one_of(QUERY_DTYPES),
    "kv_cache_dtype": one_of(KV_CACHE_DTYPES),
    "num_heads": integer(1, 1024),
    "geometry": string(32, empty=False, pattern=r"[1-9]\d{0,4}/[1-9]\d{0,4}/[1-9]\d{0,4}/[1-9]\d{0,4}"),
    "page_size": integer(1, 4096),
    "topk": integer(0, 1 << 20),
    "q_len": integer(1, 16),
}
DEVICE = {
    "uuid": string(96, empty=False), "name": string(128, empty=False), "compute_capability": CC,
    "index": integer(0, 1024), "memory_total_mib": integer(0, 1 << 24),
    "driver_version": string(32), "cuda_driver_version": string(32),
    "max_sm_clock_mhz": integer(0, 100_000), "power_limit_w": number(0.0, 100_000.0),
    "mig_mode": boolean, "mig_profile": optional(string(32)), "pci_device_id": string(32),
}
FINGERPRINT = {"digest": DIGEST, **{name: string(64) for name in (
    "torch", "triton", "flashinfer", "cuda_runtime", "driver", "mla_tune")}, "kernel_hash": string(128)}
RUN = {
    "sku": string(255, empty=False), "gpu_uuid": string(96), "fingerprint": DIGEST,
    "preset": string(64), "node": string(255), "status": one_of(RUN_STATUSES),
    "started_at": timestamp(empty=False), "finished_at": optional(timestamp()),
}
def _tile_value(v) -> str | None:
    return None if isinstance(v, int) and 0 <= v < 1 << 20 else f"{_show(v)} is not a tile value"


# records.Measurement.params: the launch a refined backend was timed with. The tile's fields are checked by
# name and kind here (the kernel's `tile_from_dict` checks them against its own fields before any use).
PARAMS = {
    "tile": ("map", string(32, empty=False, pattern=r"[a-z][a-z0-9_]*"), _tile_value),
    "label": string(64, empty=False), "default_label": string(64), "default_median_ms": optional(MS),
    "candidates": integer(1, 64), "rejected": ("map", string(64, empty=False), string(4096, free_text=True)),
}
# The launch our vLLM backend makes of the kernel, timed beside the candidates; absent in params written without it.
ENGINE_PARAMS = {"engine_median_ms": optional(MS), "engine_max_seq_len": optional(integer(1, 1 << 26)),
                 "engine_reason": string(4096, free_text=True)}
MEASUREMENT = {
    "key": KEY, "run": optional(integer(0, MAX_LIST)), "fingerprint": optional(DIGEST),
    "backend": backend_name, "batch_size": integer(1, 1 << 20), "kv_len": integer(1, 1 << 26),
    "status": one_of(STATUSES), "median_ms": optional(MS), "ci_low_ms": optional(MS),
    "ci_high_ms": optional(MS), "samples": integer(0, 1 << 30),
    "rel_error": optional(number(0.0, 1e6)), "reason": string(4096, free_text=True), "gpu_uuid": string(96),
    "sm_clock_mhz_before": optional(integer(0, 100_000)), "sm_clock_mhz_after": optional(integer(0, 100_000)),
    "temperature_c_before": optional(integer(-50, 200)), "temperature_c_after": optional(integer(-50, 200)),
    "measured_at": timestamp(), "params": ("optional", ("with_optional", PARAMS, ENGINE_PARAMS)),
}
SHAPE_WINNER = {"batch_size": integer(1, 1 << 20), "kv_len": integer(1, 1 << 26),
                "backend": backend_name, "median_ms": MS}
DECISION = {
    "key": KEY, "fingerprint": DIGEST, "node": string(255), "winner": backend_name,
    "runner_up": optional(backend_name), "margin": optional(number(0.0, 1e6)),
    "static_choice": optional(backend_name), "static_score": optional(SCORE),
    "noise_margin": number(0.0, 1.0), "kept_static": boolean,
    "scores": ("map", backend_name, SCORE), "per_shape": ("list", SHAPE_WINNER),
    "anomalies": ("list", string(4096, free_text=True)),
    "failures": ("map", backend_name, string(4096, free_text=True)),
    "gpu_uuids": ("list", string(96)), "decided_at": timestamp(),
    "engine_best": ("optional", ("map", string(32, empty=False, pattern=r"[a-z][a-z0-9_]*"), backend_name)),
    # Below 0.999 is possible: the vLLM launch is scored against the per-shape best of the tuned launches.
    "plugin_scores": ("optional", ("map", backend_name, number(0.0, 1e6, lo_open=True))),
}
PRODUCER = {"node": string(255), "mla_tune": string(64), "exported_at": timestamp()}
CONTENT = {"devices": ("list", DEVICE), "fingerprints": ("list", FINGERPRINT), "runs": ("list", RUN),
           "measurements": ("list", MEASUREMENT), "decisions": ("list", DECISION)}
DOCUMENT = {"format": one_of((FORMAT,)), "schema_version": integer(1, SCHEMA_VERSION),
            "producer": PRODUCER, "checksum": string(71, empty=False, pattern=r"sha256:[0-9a-f]{64}"),
            "content": CONTENT}


def check(value, spec, path: str) -> None:
    """Raise SchemaError naming the first field of `value` that does not follow `spec`."""
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            raise SchemaError(f"{path}: {_show(value)} is not an object")
        unknown = sorted(set(value) - set(spec))
        if unknown:
            raise SchemaError(f"{path}: unknown field {unknown[0]!r}")
        missing = [name for name in spec if name not in value]
        if missing:
            raise SchemaError(f"{path}: missing field {missing[0]!r}")
        for name, inner in spec.items():
            check(value[name], inner, f"{path}.{name}")
    elif isinstance(spec, tuple) and spec[0] == "with_optional":
        required, extra = spec[1], spec[2]
        if not isinstance(value, dict):
            raise SchemaError(f"{path}: {_show(value)} is not an object")
        check({k: v for k, v in value.items() if k not in extra}, required, path)
        for name in extra.keys() & value.keys():
            check(value[name], extra[name], f"{path}.{name}")
    elif isinstance(spec, tuple) and spec[0] == "list":
        if not isinstance(value, list):
            raise SchemaError(f"{path}: {_show(value)} is not a list")
        if len(value) > MAX_LIST:
            raise SchemaError(f"{path}: {len(value)} entries is more than {MAX_LIST}")
        for i, item in enumerate(value):
            check(item, spec[1], f"{path}[{i}]")
    elif isinstance(spec, tuple) and spec[0] == "optional":
        if value is not None:
            check(value, spec[1], path)
    elif isinstance(spec, tuple) and spec[0] == "map":
        if not isinstance(value, dict):
            raise SchemaError(f"{path}: {_show(value)} is not an object")
        for name, item in value.items():
            problem = spec[1](name)
            if problem:
                raise SchemaError(f"{path}: {problem}")
            check(item, spec[2], f"{path}[{name!r}]")
    else:
        problem = spec(value)
        if problem:
            raise SchemaError(f"{path}: {problem}")
