"""The measurements of retired entries, kept so that an older export cannot bring one back.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    retired_measurements = op.create_table(
        "retired_measurements",
        sa.Column("measurement_id", sa.Integer(), nullable=False),
        sa.Column("retired_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["measurement_id"],
            ["measurements.id"],
            name=op.f("fk_retired_measurements_measurement_id_measurements"),
        ),
        sa.PrimaryKeyConstraint("measurement_id", name=op.f("pk_retired_measurements")),
    )
    # The entries retired now are the retirements this store still knows of.
    best_configs = sa.table(
        "best_configs", sa.column("measurement_id"), sa.column("retired"), sa.column("updated_at")
    )
    op.execute(
        retired_measurements.insert().from_select(
            ["measurement_id", "retired_at"],
            sa.select(best_configs.c.measurement_id, best_configs.c.updated_at).where(
                best_configs.c.retired.is_(True)
            ),
        )
    )


def downgrade() -> None:
    op.drop_table("retired_measurements")
