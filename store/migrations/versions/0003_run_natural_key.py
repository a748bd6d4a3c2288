"""A run is unique by its natural key (node, SKU, start time, fingerprint, device): imports cannot duplicate it.

Stores written while two imports of one file could interleave may hold such duplicates: they are merged
first (measurements move to the oldest copy of their run, and measurements that are then identical are
kept once).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-27
"""

from __future__ import annotations

from collections import defaultdict

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

INDEX = "uq_runs_natural_key"
# COALESCE: a run imported without a known device (device_id NULL) is still one run per natural key.
NATURAL_KEY = ("node", "sku", "started_at", "fingerprint_id", sa.text("coalesce(device_id, 0)"))


def _merge_duplicate_runs(connection) -> None:
    runs = sa.table("runs", *(sa.column(c) for c in ("id", "node", "sku", "started_at", "fingerprint_id",
                                                       "device_id")))
    groups = defaultdict(list)
    for row in connection.execute(sa.select(runs).order_by(runs.c.id)):
        groups[(row.node, row.sku, row.started_at, row.fingerprint_id, row.device_id or 0)].append(row.id)
    duplicates = {ids[0]: ids[1:] for ids in groups.values() if len(ids) > 1}
    if not duplicates:
        return
    inspector = sa.inspect(connection)
    columns = [c["name"] for c in inspector.get_columns("measurements") if c["name"] != "id"]
    measurements = sa.table("measurements", sa.column("id"), *(sa.column(c) for c in columns))
    for keep, extra in duplicates.items():
        connection.execute(measurements.update().where(measurements.c.run_id.in_(extra)).values(run_id=keep))
        connection.execute(runs.delete().where(runs.c.id.in_(extra)))
        seen, drop = set(), []
        for row in connection.execute(sa.select(measurements).where(measurements.c.run_id == keep)
                                      .order_by(measurements.c.id)):
            content = tuple(str(getattr(row, c)) for c in columns)
            (drop if content in seen else []).append(row.id)
            seen.add(content)
        if drop:
            connection.execute(measurements.delete().where(measurements.c.id.in_(drop)))


def upgrade() -> None:
    _merge_duplicate_runs(op.get_bind())
    op.create_index(INDEX, "runs", list(NATURAL_KEY), unique=True)


def downgrade() -> None:
    op.drop_index(INDEX, table_name="runs")
