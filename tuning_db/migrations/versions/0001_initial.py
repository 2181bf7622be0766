"""Initial schema: GPUs, append-only measurements, one best config per problem key.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

PROBLEM_COLUMNS = ["kernel", "kernel_version", "v", "d", "dtype", "mode"]


def _name_column() -> sa.String:
    return sa.String(length=128)


def _problem_key_columns() -> list[sa.Column]:
    """The columns that name a problem, shared by measurements and best_configs."""
    return [
        sa.Column("gpu_id", sa.Integer(), nullable=False),
        sa.Column("kernel", _name_column(), nullable=False),
        sa.Column("kernel_version", _name_column(), nullable=False),
        sa.Column("triton_version", _name_column(), nullable=False),
        sa.Column("v", sa.Integer(), nullable=False),
        sa.Column("d", sa.Integer(), nullable=False),
        sa.Column("dtype", sa.String(length=16), nullable=False),
        sa.Column("n_bucket", sa.BigInteger(), nullable=False),
        sa.Column("mode", sa.String(length=16), nullable=False),
    ]


def upgrade() -> None:
    op.create_table(
        "gpus",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", _name_column(), nullable=False),
        sa.Column("compute_capability", sa.String(length=8), nullable=False),
        sa.Column("sm_count", sa.Integer(), nullable=False),
        sa.Column("memory_bytes", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_gpus")),
        sa.UniqueConstraint("name", name=op.f("uq_gpus_name")),
    )
    op.create_table(
        "measurements",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("uid", sa.String(length=32), nullable=False),
        *_problem_key_columns(),
        sa.Column("torch_version", _name_column(), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("median_ms", sa.Float(), nullable=False),
        sa.Column("p20_ms", sa.Float(), nullable=False),
        sa.Column("p80_ms", sa.Float(), nullable=False),
        sa.Column("default_ms", sa.Float(), nullable=False),
        sa.Column("method", _name_column(), nullable=False),
        sa.Column("submitter", _name_column(), nullable=False),
        sa.Column("host", _name_column(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("median_ms > 0", name=op.f("ck_measurements_median_positive")),
        sa.ForeignKeyConstraint(["gpu_id"], ["gpus.id"], name=op.f("fk_measurements_gpu_id_gpus")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_measurements")),
        sa.UniqueConstraint("uid", name=op.f("uq_measurements_uid")),
    )
    op.create_index("ix_measurements_problem", "measurements", ["gpu_id", *PROBLEM_COLUMNS])
    op.create_table(
        "best_configs",
        sa.Column("id", sa.Integer(), nullable=False),
        *_problem_key_columns(),
        sa.Column("median_ms", sa.Float(), nullable=False),
        sa.Column("measurement_id", sa.Integer(), nullable=False),
        sa.Column("retired", sa.Boolean(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["gpu_id"], ["gpus.id"], name=op.f("fk_best_configs_gpu_id_gpus")),
        sa.ForeignKeyConstraint(
            ["measurement_id"],
            ["measurements.id"],
            name=op.f("fk_best_configs_measurement_id_measurements"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_best_configs")),
        sa.UniqueConstraint(
            "gpu_id", "kernel", "kernel_version", "triton_version", "v", "d", "dtype", "n_bucket", "mode",
            name="uq_best_configs_key",
        ),
    )
    op.create_index("ix_best_configs_problem", "best_configs", PROBLEM_COLUMNS)


def downgrade() -> None:
    op.drop_index("ix_best_configs_problem", table_name="best_configs")
    op.drop_table("best_configs")
    op.drop_index("ix_measurements_problem", table_name="measurements")
    op.drop_table("measurements")
    op.drop_table("gpus")
