"""SQLAlchemy 2.0 models of the decision store.

Rows never leave `store`: `repository.py` converts them to and from the
records of `store/records.py` and `backends/device.py`. A change here needs a
migration in `store/migrations/versions/` (and `schema.HEAD_REVISION`).

Timestamps are ISO 8601 UTC strings, as in the records: they round-trip
exactly on every dialect and sort chronologically.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (JSON, Boolean, Double, ForeignKey, Index, Integer, MetaData, String, Text,
                        UniqueConstraint, text)
from sqlalchemy.orm import DeclarativeBase, Mapped, declared_attr, mapped_column
from sqlalchemy.types import TypeDecorator

from mla_tune.store.sqlite_file import Unparsed


class StoredJSON(TypeDecorator):
    """JSON whose stored text may have been damaged: text that does not parse comes back as `Unparsed`,
    so that `codec` names the column in its error instead of the driver raising mid-query."""

    impl = JSON
    cache_ok = True

    def result_processor(self, dialect, coltype):
        parse = self.impl_instance.result_processor(dialect, coltype)
        if parse is None:
            return None

        def process(value):
            try:
                return parse(value)
            except (ValueError, TypeError, RecursionError):
                return Unparsed(value)
        return process

# Columns of `DecisionKey`, in order; measurements and decisions both carry them.
KEY_COLUMNS = ("sku", "compute_capability", "query_dtype", "kv_cache_dtype", "num_heads",
               "geometry", "page_size", "topk", "q_len")


# Named constraints, so that later migrations (batch mode on SQLite) can address them.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {dict[str, Any]: StoredJSON, list[Any]: StoredJSON}


class DeviceRow(Base):
    """One GPU (or MIG instance), by UUID, with its NVML facts."""

    __tablename__ = "devices"

    id: Mapped[int] = mapped_column(primary_key=True)
    uuid: Mapped[str] = mapped_column(String(96), unique=True)
    sku: Mapped[str] = mapped_column(String(255), index=True)
    name: Mapped[str] = mapped_column(String(128))
    compute_capability: Mapped[str] = mapped_column(String(8))    # "9.0"
    gpu_index: Mapped[int] = mapped_column(Integer, default=0)
    memory_total_mib: Mapped[int] = mapped_column(Integer, default=0)
    driver_version: Mapped[str] = mapped_column(String(32), default="")
    cuda_driver_version: Mapped[str] = mapped_column(String(32), default="")
    max_sm_clock_mhz: Mapped[int] = mapped_column(Integer, default=0)
    power_limit_w: Mapped[float] = mapped_column(Double, default=0.0)
    mig_mode: Mapped[bool] = mapped_column(Boolean, default=False)
    mig_profile: Mapped[str | None] = mapped_column(String(32))
    pci_device_id: Mapped[str] = mapped_column(String(32), default="")
    first_seen: Mapped[str] = mapped_column(String(40))
    last_seen: Mapped[str] = mapped_column(String(40))


class FingerprintRow(Base):
    """A software fingerprint (versions + kernel hash), unique by digest."""

    __tablename__ = "fingerprints"

    id: Mapped[int] = mapped_column(primary_key=True)
    digest: Mapped[str] = mapped_column(String(32), unique=True)
    torch: Mapped[str] = mapped_column(String(64), default="")
    triton: Mapped[str] = mapped_column(String(64), default="")
    flashinfer: Mapped[str] = mapped_column(String(64), default="")
    cuda_runtime: Mapped[str] = mapped_column(String(64), default="")
    driver: Mapped[str] = mapped_column(String(64), default="")
    mla_tune: Mapped[str] = mapped_column(String(64), default="")
    kernel_hash: Mapped[str] = mapped_column(String(128), default="")


class RunRow(Base):
    """One tuning run on one GPU of one node."""

    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(primary_key=True)
    device_id: Mapped[int | None] = mapped_column(ForeignKey("devices.id"), index=True)
    fingerprint_id: Mapped[int] = mapped_column(ForeignKey("fingerprints.id"))
    sku: Mapped[str] = mapped_column(String(255))
    preset: Mapped[str] = mapped_column(String(64), default="")
    node: Mapped[str] = mapped_column(String(255), default="")
    status: Mapped[str] = mapped_column(String(16), default="running")
    started_at: Mapped[str] = mapped_column(String(40))
    finished_at: Mapped[str | None] = mapped_column(String(40))

    @declared_attr.directive
    def __table_args__(cls):
        # A run's natural key (what `provenance.run_key` compares across stores) is unique (0003).
        return (Index("uq_runs_natural_key", "node", "sku", "started_at", "fingerprint_id",
                      text("coalesce(device_id, 0)"), unique=True),)


class KeyColumns:
    """The columns of a `DecisionKey`."""

    sku: Mapped[str] = mapped_column(String(255))
    compute_capability: Mapped[str] = mapped_column(String(8))
    query_dtype: Mapped[str] = mapped_column(String(32))
    kv_cache_dtype: Mapped[str] = mapped_column(String(32))
    num_heads: Mapped[int] = mapped_column(Integer)
    geometry: Mapped[str] = mapped_column(String(32))
    page_size: Mapped[int] = mapped_column(Integer)
    topk: Mapped[int] = mapped_column(Integer, default=0)
    q_len: Mapped[int] = mapped_column(Integer, default=1)


class MeasurementRow(KeyColumns, Base):
    """One backend at one shape of one key on one GPU: a time, or why there is none."""

    __tablename__ = "measurements"

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    fingerprint_id: Mapped[int | None] = mapped_column(ForeignKey("fingerprints.id"))
    backend: Mapped[str] = mapped_column(String(64))
    batch_size: Mapped[int] = mapped_column(Integer)
    kv_len: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))
    median_ms: Mapped[float | None] = mapped_column(Double)
    ci_low_ms: Mapped[float | None] = mapped_column(Double)
    ci_high_ms: Mapped[float | None] = mapped_column(Double)
    samples: Mapped[int] = mapped_column(Integer, default=0)
    rel_error: Mapped[float | None] = mapped_column(Double)
    reason: Mapped[str] = mapped_column(Text, default="")
    gpu_uuid: Mapped[str] = mapped_column(String(96), default="")
    sm_clock_mhz_before: Mapped[int | None] = mapped_column(Integer)
    sm_clock_mhz_after: Mapped[int | None] = mapped_column(Integer)
    temperature_c_before: Mapped[int | None] = mapped_column(Integer)
    temperature_c_after: Mapped[int | None] = mapped_column(Integer)
    measured_at: Mapped[str] = mapped_column(String(40), default="")
    params: Mapped[dict[str, Any] | None] = mapped_column(StoredJSON)   # records.Measurement.params (0002)

    @declared_attr.directive
    def __table_args__(cls):
        return (Index("ix_measurements_key", "sku", "kv_cache_dtype", "num_heads", "query_dtype"),)


class DecisionRow(KeyColumns, Base):
    """The answer for one key under one software fingerprint, and why."""

    __tablename__ = "decisions"

    id: Mapped[int] = mapped_column(primary_key=True)
    fingerprint_digest: Mapped[str] = mapped_column(ForeignKey("fingerprints.digest"))
    winner: Mapped[str] = mapped_column(String(64))
    runner_up: Mapped[str | None] = mapped_column(String(64))
    margin: Mapped[float | None] = mapped_column(Double)
    static_choice: Mapped[str | None] = mapped_column(String(64))
    static_score: Mapped[float | None] = mapped_column(Double)
    noise_margin: Mapped[float] = mapped_column(Double, default=0.0)
    kept_static: Mapped[bool] = mapped_column(Boolean, default=False)
    scores: Mapped[dict[str, Any]] = mapped_column(StoredJSON)
    per_shape: Mapped[list[Any]] = mapped_column(StoredJSON)
    anomalies: Mapped[list[Any]] = mapped_column(StoredJSON)
    failures: Mapped[dict[str, Any]] = mapped_column(StoredJSON)
    gpu_uuids: Mapped[list[Any]] = mapped_column(StoredJSON)
    engine_best: Mapped[dict[str, Any] | None] = mapped_column(StoredJSON, nullable=True)
    plugin_scores: Mapped[dict[str, Any] | None] = mapped_column(StoredJSON, nullable=True)
    decided_at: Mapped[str] = mapped_column(String(40), default="")
    node: Mapped[str] = mapped_column(String(255), default="")
    updated_at: Mapped[str] = mapped_column(String(40))

    @declared_attr.directive
    def __table_args__(cls):
        # The unique constraint leads with sku + kv dtype + heads: the index for lookups by SKU.
        # The runtime lookup often knows only the GPU name (a prefix of the SKU): it uses the second.
        return (Index("ix_decisions_lookup", "num_heads", "kv_cache_dtype", "query_dtype"),
                UniqueConstraint("sku", "kv_cache_dtype", "num_heads", "query_dtype",
                                 "compute_capability", "geometry", "page_size", "topk", "q_len",
                                 "fingerprint_digest", name="uq_decisions_key_fingerprint"),)
