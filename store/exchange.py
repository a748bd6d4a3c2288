"""Export the decision table and its evidence to a versioned JSON file, and import such files.

An export is deterministic: records are sorted, keys are sorted, and
`producer.exported_at` is the time of the newest exported record (or
`$SOURCE_DATE_EPOCH`), so two exports of the same data are byte-identical and
can be reviewed with `diff`. The sha256 checksum covers everything but itself
in canonical form (sorted keys, no whitespace, UTF-8).

Import reads every file completely and validates it strictly
(`exchange_schema`) before touching the store; then it applies all files in
one transaction (all or nothing). It is idempotent: runs, measurements and
decisions already stored are recognised by their content and skipped. When
measurements of one key and software fingerprint come from several nodes,
the decision is rebuilt from all of them with the decision rule passed in as
`decide` (the tuner's; the store does not import the tuner), and nodes whose
times disagree beyond the noise margin are reported.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from mla_tune import __version__
from mla_tune.backends.device import DeviceInfo, SoftwareFingerprint
from mla_tune.store import codec, provenance
from mla_tune.store.exchange_schema import DOCUMENT, FORMAT, SCHEMA_VERSION, SchemaError, check
from mla_tune.store.records import Decision, DecisionKey, Measurement, ShapeWinner
from mla_tune.store.safe_write import write_file

MAX_IMPORT_BYTES = 256 * 1024 * 1024
MAX_DEPTH_ERROR = "nests too deeply to be an mla-tune export"


class ExchangeError(ValueError):
    """An export file was rejected; the message is one line naming the file and the problem."""


def canonical(value) -> bytes:
    """The bytes the checksum is computed over: sorted keys, no whitespace, UTF-8, no NaN."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def checksum(document: dict) -> str:
    import hashlib

    body = {name: value for name, value in document.items() if name != "checksum"}
    return "sha256:" + hashlib.sha256(canonical(body)).hexdigest()


def dumps(document: dict) -> bytes:
    """The file bytes of a document: indented for review, deterministic."""
    return (json.dumps(document, sort_keys=True, indent=1, ensure_ascii=False, allow_nan=False)
            + "\n").encode("utf-8")


# -- export -----------------------------------------------------------------------------------

def _device_dict(info: DeviceInfo) -> dict:
    values = asdict(info)
    values["compute_capability"] = f"{info.compute_capability[0]}.{info.compute_capability[1]}"
    return values


def _measurement_dict(m: Measurement) -> dict:
    values = {name: getattr(m, name) for name in codec.MEASUREMENT_FIELDS}
    return {"key": m.key.to_dict(), **values}


def _decision_dict(d: Decision, node: str) -> dict:
    values = codec.decision_values(d)
    for name in codec.KEY_FIELDS:
        values.pop(name)
    values["fingerprint"] = values.pop("fingerprint_digest")
    return {"key": d.key.to_dict(), "node": node, **values}


def _newest_timestamp(content: dict) -> str:
    stamps = [r.get(name) or "" for kind in ("runs", "measurements", "decisions") for r in content[kind]
              for name in ("started_at", "finished_at", "measured_at", "decided_at")]
    return max(stamps, default="")


def export_document(store, *, node: str | None = None) -> dict:
    """Everything in `store` as an export document (schema version 1), checksum included."""
    runs = sorted(provenance.runs(store), key=canonical)
    run_index = {provenance.run_key(node=r["node"], gpu_uuid=r["gpu_uuid"], fingerprint_digest=r["fingerprint"],
                                    sku=r["sku"], started_at=r["started_at"]): i for i, r in enumerate(runs)}
    measurements = []
    for ev in provenance.evidence(store):
        record = _measurement_dict(ev.measurement)
        record["run"] = run_index.get(ev.run) if ev.run is not None else None
        record["fingerprint"] = ev.fingerprint_digest or None
        measurements.append(record)
    nodes = provenance.decision_nodes(store)
    decisions = [_decision_dict(d, nodes.get((d.key, d.fingerprint.digest), "")) for d in store.decisions()]
    content = {
        "devices": sorted((_device_dict(d) for d in store.devices()), key=canonical),
        "fingerprints": sorted(({"digest": fp.digest, **asdict(fp)} for fp in store.fingerprints()),
                               key=canonical),
        "runs": runs,
        "measurements": sorted(measurements, key=canonical),
        "decisions": sorted(decisions, key=canonical),
    }
    epoch = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    exported_at = (datetime.fromtimestamp(int(epoch), UTC).isoformat() if epoch.isdigit()
                   else _newest_timestamp(content))
    document = {"format": FORMAT, "schema_version": SCHEMA_VERSION,
                "producer": {"node": node if node is not None else socket.gethostname(),
                             "mla_tune": __version__, "exported_at": exported_at},
                "content": content}
    document["checksum"] = checksum(document)
    return document


def write_export(store, path: str | os.PathLike, *, node: str | None = None) -> dict:
    """Write the export of `store` to `path`; return counts and the checksum.

    The document is read in one snapshot (`Store.snapshot`) and checked against
    the schema the importer enforces, so a store holding a value no import would
    accept is a StoreError before anything is written. The file is written as
    `write_file` does: atomically, through symbolic links, never replacing a device.
    """
    from mla_tune.store.sqlite_file import StoreError

    with store.snapshot():
        document = export_document(store, node=node)
    try:
        check(document, DOCUMENT, "export")
        _check_references(document["content"])
    except SchemaError as exc:
        raise StoreError(f"{store.where} holds a value an export cannot carry ({exc}); fix or delete the row") from None
    data = dumps(document)
    written = write_file(path, data)
    return {"path": written, "bytes": len(data), "checksum": document["checksum"],
            **{kind: len(records) for kind, records in document["content"].items()}}


# -- reading and validating -------------------------------------------------------------------

def _no_duplicates(pairs):
    result = {}
    for name, value in pairs:
        if name in result:
            raise ValueError(f"duplicate field {name!r}")
        result[name] = value
    return result


def _no_constant(name):
    raise ValueError(f"{name} is not a JSON number")


def parse_document(data: bytes, *, source: str = "<bytes>") -> dict:
    """Parse and validate export bytes; raise ExchangeError with one line on any problem."""
    def fail(problem: str) -> ExchangeError:
        return ExchangeError(f"{source}: {problem}")

    problem = structure_problem(data)
    if problem:
        raise fail(problem)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise fail(f"is not UTF-8 text (byte {exc.start})") from None
    if not text.strip():
        raise fail("is empty")
    try:
        document = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except MemoryError:
        raise fail(f"could not be parsed in the memory available ({len(data)} bytes); split the export, "
                   f"or import on a machine with more memory") from None
    except json.JSONDecodeError as exc:
        truncated = exc.pos >= len(text.rstrip()) - 1 or exc.msg.startswith("Unterminated")
        hint = " (truncated?)" if truncated else ""
        raise fail(f"is not valid JSON{hint}: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise fail(MAX_DEPTH_ERROR) from None
    except ValueError as exc:
        raise fail(f"is not valid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise fail(f"is not an mla-tune export (the top level is a JSON {type(document).__name__})")
    if document.get("format") != FORMAT:
        raise fail(f"is not an mla-tune export (format {document.get('format')!r}, expected {FORMAT!r})")
    version = document.get("schema_version")
    if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
        raise fail(f"uses export schema {version}, newer than this mla-tune {__version__} reads "
                   f"(up to {SCHEMA_VERSION}); upgrade mla-tune to import it")
    if isinstance(version, bool) or version not in range(1, SCHEMA_VERSION + 1):
        raise fail(f"has unknown export schema version {version!r} (this mla-tune reads 1 to {SCHEMA_VERSION})")
    stated = document.get("checksum")
    try:
        computed = checksum(document)
    except (ValueError, TypeError, RecursionError) as exc:
        raise fail(f"cannot be checksummed: {exc}") from None
    if stated != computed:
        raise fail(f"checksum mismatch: the file says {str(stated)[:80]!r}, its content hashes to "
                   f"{computed}; it was changed or damaged after export")
    if version == 1:  # before measurements had `params`: checksummed as written, then read as null
        for m in _records(document, "measurements"):
            m.setdefault("params", None)
    if version < 3:
        rename_legacy_backends(document)
    if version < 4:  # before decisions scored the launch our vLLM plugin makes: read as never timed
        for d in _records(document, "decisions"):
            d.setdefault("plugin_scores", None)
    try:
        check(document, DOCUMENT, "export")
        _check_references(document["content"])
    except SchemaError as exc:
        raise fail(str(exc)) from None
    except RecursionError:
        raise fail(MAX_DEPTH_ERROR) from None
    return document


# Before schema 3, our Triton kernels were stored under vLLM's Triton backend name.
LEGACY_NAMES = {"TRITON_MLA": "MLA_TUNE_TRITON", "TRITON_MLA_SPARSE": "MLA_TUNE_TRITON_SPARSE"}


def rename_legacy_backends(document: dict) -> None:
    """Give a schema 1-2 file's measurements and decisions of our kernels their own names, in place.

    A decision's static choice stays vLLM's name, but a score it had was our kernel's and is dropped;
    `engine_best` is null: those decisions never timed the engines' own kernels.
    """
    def renamed(name):
        return LEGACY_NAMES.get(name, name) if isinstance(name, str) else name

    for m in _records(document, "measurements"):
        m["backend"] = renamed(m.get("backend"))
    for d in _records(document, "decisions"):
        for field in ("winner", "runner_up"):
            d[field] = renamed(d.get(field))
        for field in ("scores", "failures"):
            if isinstance(d.get(field), dict):
                d[field] = {renamed(k): v for k, v in d[field].items()}
        if isinstance(d.get("per_shape"), list):
            for row in d["per_shape"]:
                if isinstance(row, dict):
                    row["backend"] = renamed(row.get("backend"))
        if d.get("static_choice") in LEGACY_NAMES:
            d["static_score"] = None
        d.setdefault("engine_best", None)


# An export spends at least ~10 bytes per JSON value (`"topk": 0,` is the shortest field); parsed, a value
# costs up to ~100 bytes of Python objects. Refusing files denser than one value per 8 bytes, before
# parsing, bounds the memory a file can make the parser use to about 13x its size (tests/faults measure it).
BYTES_PER_VALUE_MIN = 8
DENSITY_CHECK_BYTES = 1 << 20


def structure_problem(data: bytes) -> str | None:
    """Why `data` cannot be an export, judged from byte counts alone (no parsing), or None.

    A file of tiny values (`[[],[],...]`, `[0,0,...]`) would cost many times its size
    in memory once parsed; such a file is refused before any parsing.
    """
    if len(data) <= DENSITY_CHECK_BYTES:  # a small file cannot cost much memory, whatever it holds
        return None
    values = data.count(b",") + data.count(b"[") + data.count(b"{")
    if values > len(data) // BYTES_PER_VALUE_MIN:
        return (f"holds about {values} JSON values in {len(data)} bytes, more than an export holds (at most one "
                f"per {BYTES_PER_VALUE_MIN} bytes); refused before parsing")
    return None


def _records(document: dict, name: str) -> list[dict]:
    """The `content.<name>` records that are objects (the schema check names whatever else is there)."""
    content = document.get("content")
    records = content.get(name) if isinstance(content, dict) else None
    return [r for r in records if isinstance(r, dict)] if isinstance(records, list) else []


def _check_references(content: dict) -> None:
    digests = set()
    for i, fp in enumerate(content["fingerprints"]):
        values = {name: fp[name] for name in codec.FINGERPRINT_FIELDS}
        if SoftwareFingerprint(**values).digest != fp["digest"]:
            raise SchemaError(f"export.content.fingerprints[{i}].digest: {fp['digest']!r} is not the digest "
                              f"of its fields")
        digests.add(fp["digest"])
    for i, run in enumerate(content["runs"]):
        if run["fingerprint"] not in digests:
            raise SchemaError(f"export.content.runs[{i}].fingerprint: {run['fingerprint']!r} is not listed")
    for i, m in enumerate(content["measurements"]):
        if m["run"] is not None and m["run"] >= len(content["runs"]):
            raise SchemaError(f"export.content.measurements[{i}].run: {m['run']} is not a run index "
                              f"(there are {len(content['runs'])} runs)")
        if m["fingerprint"] is not None and m["fingerprint"] not in digests:
            raise SchemaError(f"export.content.measurements[{i}].fingerprint: {m['fingerprint']!r} is not listed")
        if m["status"] == "ok" and m["median_ms"] is None:
            raise SchemaError(f"export.content.measurements[{i}].median_ms: status ok without a time")
    seen = set()
    for i, d in enumerate(content["decisions"]):
        if d["fingerprint"] not in digests:
            raise SchemaError(f"export.content.decisions[{i}].fingerprint: {d['fingerprint']!r} is not listed")
        ident = (canonical(d["key"]), d["fingerprint"])
        if ident in seen:
            raise SchemaError(f"export.content.decisions[{i}]: a second decision for the same key and fingerprint")
        seen.add(ident)


def read_export(path: str | os.PathLike, *, max_bytes: int = MAX_IMPORT_BYTES) -> dict:
    """Read and validate one export file; ExchangeError (one line) when it is not acceptable.

    The file is read in 1 MiB chunks and refused as soon as it passes `max_bytes` (a pipe's size is not
    known beforehand); memory is the file's bytes, then what parsing costs (see `structure_problem`).
    """
    source = str(path)
    try:
        size = os.stat(path).st_size
        if size > max_bytes:
            raise ExchangeError(f"{source}: is {size} bytes, more than the import limit of {max_bytes} bytes")
        chunks, total = [], 0
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 20):
                total += len(chunk)
                if total > max_bytes:
                    raise ExchangeError(f"{source}: is more than the import limit of {max_bytes} bytes")
                chunks.append(chunk)
        data = b"".join(chunks)
        del chunks
        return parse_document(data, source=source)
    except OSError as exc:
        raise ExchangeError(f"{source}: cannot be read: {exc.strerror or exc}") from None
    except MemoryError:
        raise ExchangeError(f"{source}: could not be read and checked in the memory available; split the "
                            f"export, or import it on a machine with more memory") from None


# -- decoding into records --------------------------------------------------------------------

@dataclass
class Incoming:
    """The records of one or more validated documents."""

    devices: dict[str, DeviceInfo] = field(default_factory=dict)
    fingerprints: dict[str, SoftwareFingerprint] = field(default_factory=dict)
    runs: dict[tuple, dict] = field(default_factory=dict)                 # run_key -> run values
    measurements: list[tuple[Measurement, tuple | None, str, str]] = field(default_factory=list)
    decisions: list[tuple[Decision, str]] = field(default_factory=list)   # (decision, node)
    producers: list[str] = field(default_factory=list)


def decode(documents: list[dict]) -> Incoming:
    incoming = Incoming()
    for document in documents:
        content = document["content"]
        producer = document["producer"]
        incoming.producers.append(f"{producer['node'] or 'unknown node'} (exported {producer['exported_at'] or '-'})")
        for d in content["devices"]:
            major, minor = (int(x) for x in d["compute_capability"].split("."))
            incoming.devices[d["uuid"]] = DeviceInfo(**{**d, "compute_capability": (major, minor)})
        for fp in content["fingerprints"]:
            incoming.fingerprints[fp["digest"]] = SoftwareFingerprint(
                **{name: fp[name] for name in codec.FINGERPRINT_FIELDS})
        run_keys = []
        for run in content["runs"]:
            key = provenance.run_key(node=run["node"], gpu_uuid=run["gpu_uuid"],
                                     fingerprint_digest=run["fingerprint"], sku=run["sku"],
                                     started_at=run["started_at"])
            incoming.runs.setdefault(key, run)
            run_keys.append(key)
        for m in content["measurements"]:
            record = Measurement(key=DecisionKey(**m["key"]),
                                 **{name: m[name] for name in codec.MEASUREMENT_FIELDS})
            run = run_keys[m["run"]] if m["run"] is not None else None
            digest = m["fingerprint"] or (run[2] if run else "")
            incoming.measurements.append((record, run, digest, run[0] if run else ""))
        for d in content["decisions"]:
            decision = Decision(
                key=DecisionKey(**d["key"]), winner=d["winner"], static_choice=d["static_choice"],
                scores=dict(d["scores"]), runner_up=d["runner_up"], margin=d["margin"],
                static_score=d["static_score"], noise_margin=d["noise_margin"], kept_static=d["kept_static"],
                per_shape=tuple(ShapeWinner(**s) for s in d["per_shape"]), anomalies=tuple(d["anomalies"]),
                failures=dict(d["failures"]), fingerprint=incoming.fingerprints[d["fingerprint"]],
                gpu_uuids=tuple(d["gpu_uuids"]), decided_at=d["decided_at"],
                engine_best=None if d.get("engine_best") is None else dict(d["engine_best"]),
                plugin_scores=None if d.get("plugin_scores") is None else dict(d["plugin_scores"]))
            incoming.decisions.append((decision, d["node"]))
    return incoming
