"""The repository the tuner, CLI and importer write and read through.

Records in, records out (`store/records.py`, `backends/device.py`); ORM rows
stay here. Every write is one transaction (`with session.begin():`), committed
before the method returns, so a killed tune loses at most the measurement in
flight. `Store.batch()` groups several writes into one all-or-nothing
transaction (the importer uses it).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from datetime import UTC, datetime
from typing import Iterator

from sqlalchemy import Engine, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from mla_tune.backends.device import DeviceInfo, SoftwareFingerprint
from mla_tune.store import codec
from mla_tune.store.engine import (DEFAULT_BUSY_TIMEOUT_S, StoreError, check_sqlite_file, default_sqlite_path,
                                   make_engine, mask_url, resolve_url, sqlite_path, translate_error)
from mla_tune.store.migrate import check_known, current_revision, migrate
from mla_tune.store.schema import HEAD_REVISION
from mla_tune.store.sqlite_file import CorruptValueError, check_parent
from mla_tune.store.models import KEY_COLUMNS, DecisionRow, DeviceRow, FingerprintRow, MeasurementRow, RunRow
from mla_tune.store.records import RUN_STATUSES, Decision, DecisionKey, Measurement, Run


def utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def _insert(session: Session):
    """The dialect's INSERT, which has `on_conflict_do_update`/`_do_nothing`."""
    if session.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    return insert


class Store:
    """An open decision store. Use `Store.open(url)`; close it (or use `with`)."""

    def __init__(self, engine: Engine, url: str, *, busy_timeout_s: float):
        self._engine = engine
        self._url = url
        self.busy_timeout_s = busy_timeout_s
        self._read = sessionmaker(engine, expire_on_commit=False)
        self._write_sessions = sessionmaker(engine.execution_options(sqlite_begin="IMMEDIATE"),
                                            expire_on_commit=False)
        self._local = threading.local()

    # -- opening -------------------------------------------------------------------------------

    @classmethod
    def open(cls, url: str | None = None, *, create: bool = True,
             busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S) -> Store:
        """Open the store at `url` (default: `$MLA_TUNE_DB` or the user's SQLite file).

        Args:
            url: any supported SQLAlchemy URL; None for the default.
            create: create a missing SQLite file and migrate the store to head. With
                False the store is opened read-only: nothing is created, migrated or
                written (SQLite `mode=ro`, no journal-mode switch; a read-only
                PostgreSQL session), and a store not at head is a StoreError.
            busy_timeout_s: how long a write waits for another writer's lock.

        Only the default SQLite file gets its missing directory created; for any
        other path the directory must exist, and a dangling symbolic link is
        refused (`StorePathError`).

        Raises:
            ValueError: a malformed URL or unknown dialect/driver (nothing created).
            StoreError: the store cannot be used (one line; a bad file is left untouched).
        """
        resolved = resolve_url(url)
        path = sqlite_path(resolved)
        made: list[str] = []  # files this call created, removed again if opening fails
        if path is not None:
            exists = check_sqlite_file(path, must_exist=not create)
            if create and not exists:
                if path == default_sqlite_path() and not os.path.lexists(path):
                    _make_data_directory(os.path.dirname(path))
                check_parent(path)
                parent = os.path.dirname(path)
                if not os.access(parent, os.W_OK | os.X_OK):
                    raise StoreError(f"cannot create {path}: directory {parent} is not writable")
            if create:
                made = [path + suffix for suffix in ("", "-wal", "-shm", "-journal")
                        if not os.path.lexists(path + suffix)]
        store = cls(make_engine(resolved, busy_timeout_s=busy_timeout_s, read_only=not create), resolved,
                    busy_timeout_s=busy_timeout_s)
        try:
            if create:
                store.upgrade()
            else:
                store._check_head()
        except BaseException:
            store.close()
            for name in made:  # do not leave a half-made file behind; never remove what was there
                with contextlib.suppress(OSError):
                    if os.path.isfile(name) and not os.path.islink(name):
                        os.remove(name)
            raise
        return store

    def _check_head(self) -> None:
        """StoreError unless the store is at the schema this mla-tune writes (read-only opens do not migrate)."""
        revision = self.schema_revision()
        if revision is None:
            raise StoreError(f"{self.where} has no mla-tune tables (a database of something else, or never "
                             f"migrated); run `mla-tune db upgrade`")
        check_known(revision, self.where)
        if revision != HEAD_REVISION:
            raise StoreError(f"{self.where} has schema revision {revision}, older than this mla-tune's "
                             f"{HEAD_REVISION}; run `mla-tune db upgrade`")

    @property
    def where(self) -> str:
        """The file path (SQLite) or the URL with its password masked: safe to print."""
        return sqlite_path(self._url) or mask_url(self._url)

    @property
    def dialect(self) -> str:
        return self._engine.dialect.name

    def close(self) -> None:
        self._engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except SQLAlchemyError as exc:
            raise translate_error(exc, self._url, busy_timeout_s=self.busy_timeout_s) from None
        except (CorruptValueError, json.JSONDecodeError) as exc:  # a row changed behind our back
            raise StoreError(f"{self.where} holds a corrupt row ({' '.join(str(exc).split())}); fix or delete "
                             f"it, or re-run `mla-tune` to tune again") from None

    # -- schema ----------------------------------------------------------------------------------

    def upgrade(self, target: str = "head") -> None:
        """Migrate to `target` (what `mla-tune db upgrade` runs); StoreError for a newer schema."""
        with self._errors():
            migrate(self._engine, self.where, target=target)

    def downgrade(self, target: str = "base") -> None:
        with self._errors():
            migrate(self._engine, self.where, target=target, downgrade=True)

    def schema_revision(self) -> str | None:
        with self._errors(), self._engine.connect() as connection:
            return current_revision(connection)

    # -- transactions ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def batch(self) -> Iterator[Store]:
        """Make every write inside the block one transaction: all of them or none."""
        if getattr(self._local, "session", None) is not None:
            yield self
            return
        with self._errors(), self._write_sessions.begin() as session:
            self._local.session = session
            try:
                yield self
            finally:
                self._local.session = None

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[Store]:
        """Make every read inside the block see one consistent state: one read transaction
        (REPEATABLE READ, read-only on PostgreSQL; SQLite's WAL snapshot), so that a writer
        committing meanwhile is seen entirely or not at all."""
        if getattr(self._local, "session", None) is not None:
            yield self
            return
        engine = self._engine
        if engine.dialect.name == "postgresql":
            engine = engine.execution_options(isolation_level="REPEATABLE READ", postgresql_readonly=True)
        with self._errors(), Session(engine, expire_on_commit=False) as session, session.begin():
            self._local.session = session
            try:
                yield self
            finally:
                self._local.session = None

    @contextlib.contextmanager
    def _write(self) -> Iterator[Session]:
        session = getattr(self._local, "session", None)
        if session is not None:
            with self._errors():
                yield session
            return
        with self._errors(), self._write_sessions.begin() as session:
            yield session

    @contextlib.contextmanager
    def _reading(self) -> Iterator[Session]:
        session = getattr(self._local, "session", None)
        if session is not None:
            with self._errors():
                yield session
            return
        with self._errors(), self._read() as session, session.begin():
            yield session

    # -- writes ----------------------------------------------------------------------------------

    def record_device(self, info: DeviceInfo) -> int:
        """Insert or refresh one GPU's NVML facts (by UUID); returns its row id."""
        with self._write() as session:
            return self._device_id(session, info)

    def record_fingerprint(self, fp: SoftwareFingerprint) -> int:
        """Insert a software fingerprint unless its digest is stored; returns its row id."""
        with self._write() as session:
            return self._fingerprint_id(session, fp)

    def start_run(self, *, device: DeviceInfo, fingerprint: SoftwareFingerprint, preset: str,
                  node: str) -> int:
        """Record the device and fingerprint and open a run; returns the run id."""
        with self._write() as session:
            row = RunRow(device_id=self._device_id(session, device),
                         fingerprint_id=self._fingerprint_id(session, fingerprint),
                         sku=device.sku, preset=preset, node=node, status="running",
                         started_at=utc_now())
            session.add(row)
            session.flush()
            return row.id

    def add_measurement(self, run_id: int | None, m: Measurement) -> int:
        """Store one measurement (a failure is a row too), committed at once; returns its id."""
        with self._write() as session:
            fingerprint_id = None
            if run_id is not None:
                fingerprint_id = session.scalar(select(RunRow.fingerprint_id).where(RunRow.id == run_id))
                if fingerprint_id is None:
                    raise ValueError(f"no run with id {run_id} in {self.where}")
            row = MeasurementRow(run_id=run_id, fingerprint_id=fingerprint_id,
                                 **codec.measurement_values(m))
            session.add(row)
            session.flush()
            return row.id

    def finish_run(self, run_id: int, status: str = "done") -> None:
        if status not in RUN_STATUSES:
            raise ValueError(f"run status {status!r} not in {RUN_STATUSES}")
        with self._write() as session:
            row = session.get(RunRow, run_id)
            if row is None:
                raise ValueError(f"no run with id {run_id} in {self.where}")
            row.status = status
            row.finished_at = utc_now()

    def save_decision(self, d: Decision, *, node: str = "") -> None:
        """Insert or replace the decision for (key, fingerprint digest)."""
        with self._write() as session:
            self._fingerprint_id(session, d.fingerprint)
            values = {**codec.decision_values(d), "node": node, "updated_at": utc_now()}
            conflict = [*KEY_COLUMNS, "fingerprint_digest"]
            stmt = _insert(session)(DecisionRow).values(**values)
            stmt = stmt.on_conflict_do_update(
                index_elements=conflict,
                set_={name: stmt.excluded[name] for name in values if name not in conflict})
            session.execute(stmt)

    def _device_id(self, session: Session, info: DeviceInfo) -> int:
        now = utc_now()
        values = {**codec.device_values(info), "first_seen": now, "last_seen": now}
        stmt = _insert(session)(DeviceRow).values(**values)
        stmt = stmt.on_conflict_do_update(
            index_elements=["uuid"],
            set_={name: stmt.excluded[name] for name in values if name not in ("uuid", "first_seen")})
        session.execute(stmt)
        return session.scalar(select(DeviceRow.id).where(DeviceRow.uuid == info.uuid))

    def _fingerprint_id(self, session: Session, fp: SoftwareFingerprint) -> int:
        stmt = _insert(session)(FingerprintRow).values(**codec.fingerprint_values(fp))
        session.execute(stmt.on_conflict_do_nothing(index_elements=["digest"]))
        return session.scalar(select(FingerprintRow.id).where(FingerprintRow.digest == fp.digest))

    # -- reads -----------------------------------------------------------------------------------

    def _decisions(self, session: Session, stmt) -> list[Decision]:
        stmt = stmt.join(FingerprintRow, FingerprintRow.digest == DecisionRow.fingerprint_digest)
        out = []
        for row, fp in session.execute(stmt.add_columns(FingerprintRow)):
            out.append(codec.decision_from(_columns(row), codec.fingerprint_from(_columns(fp))))
        return out

    def decision(self, key: DecisionKey, *,
                 fingerprint: SoftwareFingerprint | str | None = None) -> Decision | None:
        """The decision for `key` under `fingerprint` (an object or digest); without one, the newest."""
        stmt = select(DecisionRow).where(*_key_filter(DecisionRow, key))
        if fingerprint is not None:
            digest = fingerprint if isinstance(fingerprint, str) else fingerprint.digest
            stmt = stmt.where(DecisionRow.fingerprint_digest == digest)
        stmt = stmt.order_by(DecisionRow.decided_at.desc(), DecisionRow.updated_at.desc(),
                             DecisionRow.id.desc()).limit(1)
        with self._reading() as session:
            found = self._decisions(session, stmt)
        return found[0] if found else None

    def decisions(self, *, sku: str | None = None) -> list[Decision]:
        """Every stored decision (optionally of one SKU), in key order."""
        stmt = select(DecisionRow)
        if sku is not None:
            stmt = stmt.where(DecisionRow.sku == sku)
        stmt = stmt.order_by(*[getattr(DecisionRow, c) for c in KEY_COLUMNS],
                             DecisionRow.fingerprint_digest)
        with self._reading() as session:
            return self._decisions(session, stmt)

    def measurements(self, *, key: DecisionKey | None = None, run_id: int | None = None,
                     sku: str | None = None) -> list[Measurement]:
        """Stored measurements, oldest first, filtered by key, run and/or SKU."""
        stmt = select(MeasurementRow)
        if key is not None:
            stmt = stmt.where(*_key_filter(MeasurementRow, key))
        if run_id is not None:
            stmt = stmt.where(MeasurementRow.run_id == run_id)
        if sku is not None:
            stmt = stmt.where(MeasurementRow.sku == sku)
        with self._reading() as session:
            rows = session.scalars(stmt.order_by(MeasurementRow.id)).all()
            return [codec.measurement_from(_columns(row)) for row in rows]

    def tuned_keys(self, sku: str, fingerprint_digest: str) -> set[DecisionKey]:
        """Keys of `sku` that have a decision under this fingerprint (what `--resume` skips)."""
        stmt = select(*[getattr(DecisionRow, c) for c in KEY_COLUMNS]).where(
            DecisionRow.sku == sku, DecisionRow.fingerprint_digest == fingerprint_digest)
        with self._reading() as session:
            return {codec.key_from(row._mapping) for row in session.execute(stmt)}

    def runs(self, *, sku: str | None = None, status: str | None = None) -> list[Run]:
        """Stored runs, oldest first."""
        stmt = (select(RunRow, DeviceRow.uuid, FingerprintRow.digest)
                .outerjoin(DeviceRow, DeviceRow.id == RunRow.device_id)
                .join(FingerprintRow, FingerprintRow.id == RunRow.fingerprint_id))
        if sku is not None:
            stmt = stmt.where(RunRow.sku == sku)
        if status is not None:
            stmt = stmt.where(RunRow.status == status)
        with self._reading() as session:
            return [Run(id=r.id, sku=r.sku, gpu_uuid=uuid or "", fingerprint_digest=digest,
                        preset=r.preset, node=r.node, status=r.status, started_at=r.started_at,
                        finished_at=r.finished_at)
                    for r, uuid, digest in session.execute(stmt.order_by(RunRow.id))]

    def devices(self) -> list[DeviceInfo]:
        with self._reading() as session:
            rows = session.scalars(select(DeviceRow).order_by(DeviceRow.uuid)).all()
            return [codec.device_from(_columns(row)) for row in rows]

    def fingerprints(self) -> list[SoftwareFingerprint]:
        with self._reading() as session:
            rows = session.scalars(select(FingerprintRow).order_by(FingerprintRow.digest)).all()
            return [codec.fingerprint_from(_columns(row)) for row in rows]


def _make_data_directory(parent: str) -> None:
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as exc:
        raise StoreError(f"cannot create the data directory {parent}: {exc.strerror or exc}") from None


def _columns(row) -> dict:
    return {c.key: getattr(row, c.key) for c in row.__table__.columns}


def _key_filter(model, key: DecisionKey) -> list:
    return [getattr(model, name) == value for name, value in codec.key_values(key).items()]
