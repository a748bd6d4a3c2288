"""Decisions record how the launch our vLLM plugin makes of our kernel scores (`decisions.plugin_scores`).

`decisions.plugin_scores` (JSON, nullable) holds {backend: score} of our kernel as our vLLM backend launches it
(vLLM's max_seq_len, no host lengths), timed beside the tuned launch. It stays NULL for the decisions upgraded
here, which never timed that launch, so our kernel is not handed to vLLM on their strength.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("decisions", sa.Column("plugin_scores", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("decisions") as batch:
        batch.drop_column("plugin_scores")
