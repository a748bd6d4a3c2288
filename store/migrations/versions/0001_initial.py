"""Initial schema: devices, fingerprints, runs, measurements, decisions.

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _key_columns() -> list[sa.Column]:
    return [
        sa.Column("sku", sa.String(255), nullable=False),
        sa.Column("compute_capability", sa.String(8), nullable=False),
        sa.Column("query_dtype", sa.String(32), nullable=False),
        sa.Column("kv_cache_dtype", sa.String(32), nullable=False),
        sa.Column("num_heads", sa.Integer(), nullable=False),
        sa.Column("geometry", sa.String(32), nullable=False),
        sa.Column("page_size", sa.Integer(), nullable=False),
        sa.Column("topk", sa.Integer(), nullable=False),
        sa.Column("q_len", sa.Integer(), nullable=False),
    ]


def upgrade() -> None:
    op.create_table(
        "devices",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("uuid", sa.String(96), nullable=False),
        sa.Column("sku", sa.String(255), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("compute_capability", sa.String(8), nullable=False),
        sa.Column("gpu_index", sa.Integer(), nullable=False),
        sa.Column("memory_total_mib", sa.Integer(), nullable=False),
        sa.Column("driver_version", sa.String(32), nullable=False),
        sa.Column("cuda_driver_version", sa.String(32), nullable=False),
        sa.Column("max_sm_clock_mhz", sa.Integer(), nullable=False),
        sa.Column("power_limit_w", sa.Double(), nullable=False),
        sa.Column("mig_mode", sa.Boolean(), nullable=False),
        sa.Column("mig_profile", sa.String(32), nullable=True),
        sa.Column("pci_device_id", sa.String(32), nullable=False),
        sa.Column("first_seen", sa.String(40), nullable=False),
        sa.Column("last_seen", sa.String(40), nullable=False),
        sa.UniqueConstraint("uuid", name=op.f("uq_devices_uuid")),
    )
    op.create_index(op.f("ix_devices_sku"), "devices", ["sku"])
    op.create_table(
        "fingerprints",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("digest", sa.String(32), nullable=False),
        sa.Column("torch", sa.String(64), nullable=False),
        sa.Column("triton", sa.String(64), nullable=False),
        sa.Column("flashinfer", sa.String(64), nullable=False),
        sa.Column("cuda_runtime", sa.String(64), nullable=False),
        sa.Column("driver", sa.String(64), nullable=False),
        sa.Column("mla_tune", sa.String(64), nullable=False),
        sa.Column("kernel_hash", sa.String(128), nullable=False),
        sa.UniqueConstraint("digest", name=op.f("uq_fingerprints_digest")),
    )
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("device_id", sa.Integer(), sa.ForeignKey("devices.id", name="fk_runs_device_id_devices"),
                  nullable=True),
        sa.Column("fingerprint_id", sa.Integer(),
                  sa.ForeignKey("fingerprints.id", name="fk_runs_fingerprint_id_fingerprints"),
                  nullable=False),
        sa.Column("sku", sa.String(255), nullable=False),
        sa.Column("preset", sa.String(64), nullable=False),
        sa.Column("node", sa.String(255), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("started_at", sa.String(40), nullable=False),
        sa.Column("finished_at", sa.String(40), nullable=True),
    )
    op.create_index(op.f("ix_runs_device_id"), "runs", ["device_id"])
    op.create_table(
        "measurements",
        *_key_columns(),
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("run_id", sa.Integer(),
                  sa.ForeignKey("runs.id", ondelete="CASCADE", name="fk_measurements_run_id_runs"),
                  nullable=True),
        sa.Column("fingerprint_id", sa.Integer(),
                  sa.ForeignKey("fingerprints.id", name="fk_measurements_fingerprint_id_fingerprints"),
                  nullable=True),
        sa.Column("backend", sa.String(64), nullable=False),
        sa.Column("batch_size", sa.Integer(), nullable=False),
        sa.Column("kv_len", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("median_ms", sa.Double(), nullable=True),
        sa.Column("ci_low_ms", sa.Double(), nullable=True),
        sa.Column("ci_high_ms", sa.Double(), nullable=True),
        sa.Column("samples", sa.Integer(), nullable=False),
        sa.Column("rel_error", sa.Double(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("gpu_uuid", sa.String(96), nullable=False),
        sa.Column("sm_clock_mhz_before", sa.Integer(), nullable=True),
        sa.Column("sm_clock_mhz_after", sa.Integer(), nullable=True),
        sa.Column("temperature_c_before", sa.Integer(), nullable=True),
        sa.Column("temperature_c_after", sa.Integer(), nullable=True),
        sa.Column("measured_at", sa.String(40), nullable=False),
    )
    op.create_index(op.f("ix_measurements_run_id"), "measurements", ["run_id"])
    op.create_index("ix_measurements_key", "measurements",
                    ["sku", "kv_cache_dtype", "num_heads", "query_dtype"])
    op.create_table(
        "decisions",
        *_key_columns(),
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("fingerprint_digest", sa.String(32),
                  sa.ForeignKey("fingerprints.digest", name="fk_decisions_fingerprint_digest_fingerprints"),
                  nullable=False),
        sa.Column("winner", sa.String(64), nullable=False),
        sa.Column("runner_up", sa.String(64), nullable=True),
        sa.Column("margin", sa.Double(), nullable=True),
        sa.Column("static_choice", sa.String(64), nullable=True),
        sa.Column("static_score", sa.Double(), nullable=True),
        sa.Column("noise_margin", sa.Double(), nullable=False),
        sa.Column("kept_static", sa.Boolean(), nullable=False),
        sa.Column("scores", sa.JSON(), nullable=False),
        sa.Column("per_shape", sa.JSON(), nullable=False),
        sa.Column("anomalies", sa.JSON(), nullable=False),
        sa.Column("failures", sa.JSON(), nullable=False),
        sa.Column("gpu_uuids", sa.JSON(), nullable=False),
        sa.Column("decided_at", sa.String(40), nullable=False),
        sa.Column("node", sa.String(255), nullable=False),
        sa.Column("updated_at", sa.String(40), nullable=False),
        sa.UniqueConstraint("sku", "kv_cache_dtype", "num_heads", "query_dtype",
                            "compute_capability", "geometry", "page_size", "topk", "q_len",
                            "fingerprint_digest", name="uq_decisions_key_fingerprint"),
    )
    op.create_index("ix_decisions_lookup", "decisions", ["num_heads", "kv_cache_dtype", "query_dtype"])


def downgrade() -> None:
    op.drop_index("ix_decisions_lookup", table_name="decisions")
    op.drop_table("decisions")
    op.drop_index("ix_measurements_key", table_name="measurements")
    op.drop_index(op.f("ix_measurements_run_id"), table_name="measurements")
    op.drop_table("measurements")
    op.drop_index(op.f("ix_runs_device_id"), table_name="runs")
    op.drop_table("runs")
    op.drop_table("fingerprints")
    op.drop_index(op.f("ix_devices_sku"), table_name="devices")
    op.drop_table("devices")
