"""Apply validated export files to a store: all or nothing, idempotent, decisions merged across nodes.

`import_files` validates every file first (nothing is written when any file
is rejected), then plans against a snapshot of what the store holds, without
holding the write lock (planning reads every stored measurement and can take
seconds), and writes the plan in one short transaction. That transaction first
takes the import lock (PostgreSQL: an advisory lock; SQLite: `BEGIN IMMEDIATE`)
and, when anything was written since the snapshot (another import, a tune),
plans again under the lock: two imports of one file at once store it once.
With `check=True` it only plans, in a read-only snapshot, and reports.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from sqlalchemy import func, insert, select, text

from mla_tune.store import codec, provenance
from mla_tune.store.exchange import MAX_IMPORT_BYTES, Incoming, decode, read_export
from mla_tune.store.models import DecisionRow, DeviceRow, FingerprintRow, MeasurementRow, RunRow
from mla_tune.store.records import Decision, DecisionKey, Measurement

DISAGREEMENT_FLOOR = 0.02   # never report node differences below 2% (clock and thermal drift)
IMPORT_LOCK_ID = 0x6D6C7469  # "mlti": the PostgreSQL advisory lock every mla-tune import takes


@dataclass
class ImportReport:
    """What an import did (or, with `check`, would do)."""

    files: list[str]
    producers: list[str]
    check: bool = False
    devices: int = 0
    fingerprints: int = 0
    runs_added: int = 0
    measurements_added: int = 0
    measurements_present: int = 0
    decisions_saved: int = 0
    decisions_unchanged: int = 0
    rebuilt: list[str] = field(default_factory=list)
    disagreements: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        verb = "would add" if self.check else "added"
        out = [f"{'checked' if self.check else 'imported'} {len(self.files)} file(s) from "
               f"{'; '.join(self.producers) or 'unknown producers'}",
               f"{verb} {self.runs_added} run(s), {self.measurements_added} measurement(s) "
               f"({self.measurements_present} already stored), "
               f"{'would save' if self.check else 'saved'} {self.decisions_saved} decision(s) "
               f"({self.decisions_unchanged} unchanged)"]
        out += [f"rebuilt from several nodes: {line}" for line in self.rebuilt]
        out += [f"disagreement: {line}" for line in self.disagreements]
        out += [f"note: {line}" for line in self.notes]
        return out


def _identity(m: Measurement, digest: str) -> str:
    return _values_identity(codec.measurement_values(m), digest)


def _values_identity(values: dict, digest: str) -> str:
    return json.dumps([values, digest], sort_keys=True, default=str)


def _decision_identity(d: Decision, node: str) -> str:
    return json.dumps([codec.decision_values(d), node], sort_keys=True, default=str)


MERGED_PREFIX = "merged from "


def _disagreements(key: DecisionKey, evidence: list[tuple[Measurement, str]], decision: Decision,
                   node_winners: dict[str, str]) -> list[str]:
    """One line when the nodes' times depart from each other beyond the noise margin, and one per
    node whose own decision named another winner than the merged evidence."""
    tolerance = max(decision.noise_margin, DISAGREEMENT_FLOOR)
    times: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for m, node in evidence:
        if m.status == "ok" and m.median_ms:
            times[(m.backend, m.batch_size, m.kv_len)][node].append(m.median_ms)
    logs: dict[str, list[float]] = defaultdict(list)
    for per_node in times.values():
        if len(per_node) < 2:
            continue
        node_median = {n: statistics.median(v) for n, v in per_node.items()}
        center = statistics.median(node_median.values())
        for n, t in node_median.items():
            logs[n].append(math.log(t / center))
    lines = []
    if len(logs) >= 2:
        ratio = {n: math.exp(sum(v) / len(v)) for n, v in logs.items()}
        spread = max(ratio.values()) / min(ratio.values()) - 1.0
        if spread > tolerance:
            each = ", ".join(f"{n or 'unknown'} {r:.3f}x" for n, r in sorted(ratio.items(), key=lambda x: -x[1]))
            lines.append(f"{key.sku}, {key.label}: node times differ by {spread:.1%}, beyond the noise margin "
                         f"{tolerance:.1%} (each node against the median of the nodes: {each}; "
                         f"{max(len(v) for v in logs.values())} backend-shape points)")
    for n, winner in sorted(node_winners.items()):
        if winner != decision.winner:
            lines.append(f"{key.sku}, {key.label}: node {n or 'unknown'} chose {winner}; "
                         f"the merged evidence chooses {decision.winner}")
    return lines


def plan(store, incoming: Incoming, report: ImportReport, *, decide: Callable | None) -> dict:
    """Work out what to write: new runs and measurements, and the decision of every touched key."""
    present = {_identity(ev.measurement, ev.fingerprint_digest) for ev in provenance.evidence(store)}
    stored_runs = {provenance.run_key(node=r["node"], gpu_uuid=r["gpu_uuid"], fingerprint_digest=r["fingerprint"],
                                      sku=r["sku"], started_at=r["started_at"]) for r in provenance.runs(store)}
    new_runs = [k for k in incoming.runs if k not in stored_runs]
    new_measurements, new_values, seen = [], [], set()
    for m, run, digest, node in incoming.measurements:
        values = codec.measurement_values(m)
        ident = _values_identity(values, digest)
        if ident in present or ident in seen:
            report.measurements_present += ident in present
            continue
        seen.add(ident)
        new_measurements.append((m, run, digest, node))
        new_values.append(values)
    report.runs_added, report.measurements_added = len(new_runs), len(new_measurements)

    # Every (key, fingerprint) the import touches, with all its evidence and decisions.
    groups: set[tuple[DecisionKey, str]] = {(d.key, d.fingerprint.digest) for d, _ in incoming.decisions}
    groups |= {(m.key, digest) for m, _, digest, _ in new_measurements if digest}
    evidence: dict[tuple, list[tuple[Measurement, str]]] = defaultdict(list)
    for ev in provenance.evidence(store):
        if (ev.measurement.key, ev.fingerprint_digest) in groups:
            evidence[(ev.measurement.key, ev.fingerprint_digest)].append((ev.measurement, ev.node))
    for m, _, digest, node in new_measurements:
        evidence[(m.key, digest)].append((m, node))
    stored_nodes = provenance.decision_nodes(store)
    candidates: dict[tuple, list[tuple[Decision, str]]] = defaultdict(list)
    already: dict[tuple, tuple[Decision, str]] = {}
    for group in groups:
        stored = store.decision(group[0], fingerprint=group[1])
        if stored is not None:
            already[group] = (stored, stored_nodes.get(group, ""))
            candidates[group].append(already[group])
    for d, node in incoming.decisions:
        candidates[(d.key, d.fingerprint.digest)].append((d, node))

    to_save: list[tuple[Decision, str]] = []
    for group in sorted(groups, key=lambda g: (json.dumps(g[0].to_dict(), sort_keys=True), g[1])):
        key, digest = group
        decisions = candidates.get(group, [])
        plain = [(d, n) for d, n in decisions if not n.startswith(MERGED_PREFIX)]
        nodes = {n for _, n in evidence.get(group, [])} or {n for _, n in plain}
        if not decisions:
            continue  # measurements without any decision: stored as evidence only
        newest = max(decisions, key=lambda dn: (dn[0].decided_at, dn[1]))
        chosen = newest
        if len(nodes) >= 2 and evidence.get(group):
            node_winners = {n: d.winner for d, n in plain if n}
            if decide is None:
                report.notes.append(f"{key.sku}, {key.label}: measured on {len(nodes)} nodes but no decision "
                                    f"rule was given; kept the newest decision ({newest[1] or 'unknown node'})")
            else:
                try:
                    merged = decide(key, [m for m, _ in evidence[group]], static_choice=newest[0].static_choice,
                                    fingerprint=newest[0].fingerprint, decided_at=newest[0].decided_at,
                                    extra_failures=None)
                except ValueError as exc:
                    report.notes.append(f"{key.sku}, {key.label}: not rebuilt ({exc}); kept the newest decision")
                else:
                    anomalies = tuple(sorted({a for d, _ in decisions for a in d.anomalies}))
                    merged = replace(merged, anomalies=anomalies)
                    label = f"{MERGED_PREFIX}{len(nodes)} nodes: " + ", ".join(sorted(n or "?" for n in nodes))
                    chosen = (merged, label[:255])
                    report.rebuilt.append(f"{key.sku}, {key.label}: {merged.winner} "
                                          f"({len(nodes)} nodes, {len(merged.gpu_uuids)} GPUs)")
                    report.disagreements += _disagreements(key, evidence[group], merged, node_winners)
        if group in already and _decision_identity(*already[group]) == _decision_identity(*chosen):
            report.decisions_unchanged += 1
        else:
            to_save.append(chosen)
    report.decisions_saved = len(to_save)
    report.devices, report.fingerprints = len(incoming.devices), len(incoming.fingerprints)
    # the new measurements' column values and identities, worked out here so that the write lock is not held for them
    return {"runs": [(k, incoming.runs[k]) for k in new_runs], "measurements": new_measurements,
            "values": new_values, "identities": seen, "decisions": to_save, "groups": groups}


def apply(store, incoming: Incoming, todo: dict) -> None:
    """Write a plan inside the caller's transaction (`store.batch()`)."""
    for info in sorted(incoming.devices.values(), key=lambda d: d.uuid):
        store.record_device(info)
    for fp in incoming.fingerprints.values():
        store.record_fingerprint(fp)
    with store._write() as session:
        fp_ids = dict(session.execute(select(FingerprintRow.digest, FingerprintRow.id)).all())
        device_ids = dict(session.execute(select(DeviceRow.uuid, DeviceRow.id)).all())
        for key, run in todo["runs"]:
            session.add(RunRow(device_id=device_ids.get(run["gpu_uuid"]), fingerprint_id=fp_ids[run["fingerprint"]],
                               sku=run["sku"], preset=run["preset"], node=run["node"], status=run["status"],
                               started_at=run["started_at"], finished_at=run["finished_at"]))
        session.flush()
        run_ids = {}
        stmt = (select(RunRow.id, RunRow.node, DeviceRow.uuid, FingerprintRow.digest, RunRow.sku, RunRow.started_at)
                .outerjoin(DeviceRow, DeviceRow.id == RunRow.device_id)
                .join(FingerprintRow, FingerprintRow.id == RunRow.fingerprint_id))
        for run_id, node, uuid, digest, sku, started in session.execute(stmt):
            run_ids[provenance.run_key(node=node, gpu_uuid=uuid or "", fingerprint_digest=digest,
                                       sku=sku, started_at=started)] = run_id
        rows = [{"run_id": run_ids.get(run) if run else None,
                 "fingerprint_id": fp_ids.get(digest) if digest else None, **values}
                for (_, run, digest, _), values in zip(todo["measurements"], todo["values"])]
        if rows:  # one Core executemany (the ORM's bulk insert took 1.6x as long): 16,000 rows in about 0.5 s
            session.connection().execute(insert(MeasurementRow.__table__), rows)
    for decision, node in todo["decisions"]:
        store.save_decision(decision, node=node)


def import_files(store, paths: Iterable, *, check: bool = False, decide: Callable | None = None,
                 max_bytes: int = MAX_IMPORT_BYTES) -> ImportReport:
    """Validate every file, then apply them all in one transaction (or, with `check`, only report).

    Args:
        store: an open `Store`.
        paths: export files.
        check: validate and report what would change; write nothing.
        decide: the decision rule (`mla_tune.tuner.decide.decide`) used to rebuild
            decisions measured on several nodes; None keeps the newest decision.
        max_bytes: size limit per file.

    Raises:
        ExchangeError: a file was rejected (nothing was written).
        StoreError: the store failed (the transaction was rolled back).
    """
    paths = [str(p) for p in paths]
    documents = [read_export(p, max_bytes=max_bytes) for p in paths]
    return import_documents(store, documents, files=paths, check=check, decide=decide)


def import_documents(store, documents: list[dict], *, files: list[str], check: bool = False,
                     decide: Callable | None = None) -> ImportReport:
    """`import_files` for documents already read and validated by `read_export`."""
    incoming = decode(documents)
    report = ImportReport(files=files, producers=incoming.producers, check=check)
    with store.snapshot():
        state = None if check else _state(store)
        todo = plan(store, incoming, report, decide=decide)
    if check:
        return report
    with store.batch():
        _lock_imports(store)
        if not _plan_holds(store, state, todo):  # written meanwhile where it matters: plan again, locked
            report = ImportReport(files=files, producers=incoming.producers)
            todo = plan(store, incoming, report, decide=decide)
        apply(store, incoming, todo)
    return report


def _lock_imports(store) -> None:
    """Serialise imports until the caller's transaction ends (SQLite's BEGIN IMMEDIATE already does)."""
    with store._write() as session:
        if session.get_bind().dialect.name == "postgresql":
            session.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": IMPORT_LOCK_ID})


_TRACKED = (RunRow, MeasurementRow, DecisionRow)


def _state(store) -> dict:
    """Row count and largest id of the tables a plan depends on, and the newest decision update."""
    with store._reading() as session:
        state = {model: tuple(session.execute(select(func.count(), func.max(model.id))).one()) for model in _TRACKED}
        state["updated_at"] = session.scalar(select(func.max(DecisionRow.updated_at))) or ""
    return state


def _plan_holds(store, state: dict, todo: dict) -> bool:
    """Whether what was written since `state` (read under the import lock) leaves the plan as it is:
    nothing deleted, no new run or measurement the plan would add, nothing new for a key it decides.
    A tune writing other keys meanwhile keeps the plan, so the lock is held only for the writes."""
    planned_runs = {k for k, _ in todo["runs"]}
    planned = todo["identities"]
    groups = todo["groups"]
    with store._reading() as session:
        for model in _TRACKED:
            count, max_id = state[model]
            now_count, added = session.execute(select(func.count(), func.count().filter(model.id > (max_id or 0)))
                                               .select_from(model)).one()
            if now_count != count + added:
                return False                      # rows were deleted
        runs = (select(RunRow.node, DeviceRow.uuid, FingerprintRow.digest, RunRow.sku, RunRow.started_at)
                .outerjoin(DeviceRow, DeviceRow.id == RunRow.device_id)
                .join(FingerprintRow, FingerprintRow.id == RunRow.fingerprint_id)
                .where(RunRow.id > (state[RunRow][1] or 0)))
        for node, uuid, digest, sku, started in session.execute(runs):
            if provenance.run_key(node=node, gpu_uuid=uuid or "", fingerprint_digest=digest, sku=sku,
                                  started_at=started) in planned_runs:
                return False
        measurements = (select(MeasurementRow, FingerprintRow.digest)
                        .outerjoin(FingerprintRow, FingerprintRow.id == MeasurementRow.fingerprint_id)
                        .where(MeasurementRow.id > (state[MeasurementRow][1] or 0)))
        for row, digest in session.execute(measurements):
            m = codec.measurement_from({c.key: getattr(row, c.key) for c in row.__table__.columns})
            if (m.key, digest or "") in groups or _identity(m, digest or "") in planned:
                return False
        decisions = select(*[getattr(DecisionRow, c) for c in codec.KEY_FIELDS], DecisionRow.fingerprint_digest).where(
            (DecisionRow.id > (state[DecisionRow][1] or 0)) | (DecisionRow.updated_at >= state["updated_at"]))
        for row in session.execute(decisions):
            if (codec.key_from(row._mapping), row.fingerprint_digest) in groups:
                return False
    return True
