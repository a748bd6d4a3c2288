"""Measurements with where they came from: node, run and software fingerprint.

`Store.measurements()` returns plain `Measurement` records; export, import and
the fleet view also need to know which node and which software produced each
one. These reads join the run and fingerprint rows and still return plain
values (ORM rows stay in `store`).
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select

from mla_tune.store import codec
from mla_tune.store.models import DeviceRow, FingerprintRow, MeasurementRow, RunRow


@dataclass(frozen=True)
class Evidence:
    """One stored measurement and its provenance."""

    measurement: object          # Measurement
    node: str                    # the run's node ("" when it came without a run)
    fingerprint_digest: str      # "" when unknown
    run: tuple | None            # the run's natural key (see `run_key`), None without a run


def run_key(*, node: str, gpu_uuid: str, fingerprint_digest: str, sku: str, started_at: str) -> tuple:
    """What identifies a run across databases (row ids do not)."""
    return (node, gpu_uuid, fingerprint_digest, sku, started_at)


def runs(store) -> list[dict]:
    """Every stored run as plain values: sku, gpu_uuid, fingerprint, preset, node, status, times."""
    stmt = (select(RunRow, DeviceRow.uuid, FingerprintRow.digest)
            .outerjoin(DeviceRow, DeviceRow.id == RunRow.device_id)
            .join(FingerprintRow, FingerprintRow.id == RunRow.fingerprint_id))
    with store._reading() as session:
        return [{"sku": r.sku, "gpu_uuid": uuid or "", "fingerprint": digest, "preset": r.preset,
                 "node": r.node, "status": r.status, "started_at": r.started_at,
                 "finished_at": r.finished_at}
                for r, uuid, digest in session.execute(stmt)]


def evidence(store, *, sku: str | None = None) -> list[Evidence]:
    """Every stored measurement (optionally of one SKU) with its node, run and fingerprint."""
    stmt = (select(MeasurementRow, RunRow, DeviceRow.uuid, FingerprintRow.digest)
            .outerjoin(RunRow, RunRow.id == MeasurementRow.run_id)
            .outerjoin(DeviceRow, DeviceRow.id == RunRow.device_id)
            .outerjoin(FingerprintRow, FingerprintRow.id == MeasurementRow.fingerprint_id))
    if sku is not None:
        stmt = stmt.where(MeasurementRow.sku == sku)
    out = []
    with store._reading() as session:
        for row, run, run_uuid, digest in session.execute(stmt.order_by(MeasurementRow.id)):
            m = codec.measurement_from({c.key: getattr(row, c.key) for c in row.__table__.columns})
            key = None
            if run is not None:
                key = run_key(node=run.node, gpu_uuid=run_uuid or "", fingerprint_digest=digest or "",
                              sku=run.sku, started_at=run.started_at)
            out.append(Evidence(m, run.node if run is not None else "", digest or "", key))
    return out


def decision_nodes(store) -> dict[tuple, str]:
    """(DecisionKey, fingerprint digest) -> the node that saved the decision."""
    from mla_tune.store.models import DecisionRow

    with store._reading() as session:
        rows = session.scalars(select(DecisionRow)).all()
        return {(codec.key_from({c: getattr(r, c) for c in codec.KEY_FIELDS}), r.fingerprint_digest): r.node
                for r in rows}
