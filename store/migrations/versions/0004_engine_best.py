"""Our Triton kernels get names of their own, and decisions record each engine's best backend.

`TRITON_MLA` and `TRITON_MLA_SPARSE` used to name mla-tune's Triton kernels; `TRITON_MLA` now means
vLLM's own Triton kernel, timed through vLLM's code. Stored measurements and decisions of our kernels are
renamed to `MLA_TUNE_TRITON` and `MLA_TUNE_TRITON_SPARSE`. A vLLM static choice keeps its name (it is
vLLM's), but its score is dropped where it was our kernel's. `decisions.engine_best` (JSON, nullable)
holds {engine: backend} for decisions that timed the engines' own kernels; it stays NULL for the
decisions migrated here, which never did, so no engine is handed their answer.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-27
"""

from __future__ import annotations

import json

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

RENAMES = {"TRITON_MLA": "MLA_TUNE_TRITON", "TRITON_MLA_SPARSE": "MLA_TUNE_TRITON_SPARSE"}


def _load(value):
    if isinstance(value, (str, bytes)):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _renamed(value, names: dict[str, str]):
    """`value` (a name, a {name: ...} map or a list of {"backend": name} rows) with `names` applied."""
    value = _load(value)
    if isinstance(value, str):
        return names.get(value, value)
    if isinstance(value, dict):
        return {names.get(k, k): v for k, v in value.items()}
    if isinstance(value, list):
        return [dict(row, backend=names.get(row.get("backend"), row.get("backend")))
                if isinstance(row, dict) else row for row in value]
    return value


def _rename_decisions(names: dict[str, str], *, drop_static_score: bool) -> None:
    bind = op.get_bind()
    decisions = sa.table("decisions", sa.column("id", sa.Integer), sa.column("winner", sa.String),
                         sa.column("runner_up", sa.String), sa.column("static_choice", sa.String),
                         sa.column("static_score", sa.Double), sa.column("scores", sa.JSON),
                         sa.column("per_shape", sa.JSON), sa.column("failures", sa.JSON))
    for row in bind.execute(sa.select(decisions)).mappings().all():
        values = {"winner": _renamed(row["winner"], names), "runner_up": _renamed(row["runner_up"], names),
                  "scores": _renamed(row["scores"], names), "per_shape": _renamed(row["per_shape"], names),
                  "failures": _renamed(row["failures"], names)}
        if drop_static_score and row["static_choice"] in names:
            values["static_score"] = None   # it was our kernel's score, not that of vLLM's kernel of this name
        bind.execute(decisions.update().where(decisions.c.id == row["id"]).values(**values))


def upgrade() -> None:
    measurements = sa.table("measurements", sa.column("backend", sa.String))
    for old, new in RENAMES.items():
        op.execute(measurements.update().where(measurements.c.backend == old).values(backend=new))
    _rename_decisions(RENAMES, drop_static_score=True)
    op.add_column("decisions", sa.Column("engine_best", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("decisions") as batch:
        batch.drop_column("engine_best")
    back = {new: old for old, new in RENAMES.items()}
    measurements = sa.table("measurements", sa.column("backend", sa.String))
    for new, old in back.items():
        op.execute(measurements.update().where(measurements.c.backend == new).values(backend=old))
    _rename_decisions(back, drop_static_score=False)
