"""The tables of the tuning database.

Measurements are append-only facts; `best_configs` holds one row per problem key and is
changed only by the atomic upsert in `store`, so concurrent writers can never lose the
faster time. The schema itself is created by the Alembic migrations, not by create_all:
`tests/test_store.py` checks that the two agree.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    MetaData,
    String,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAME_LENGTH = 128

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

BEST_KEY_COLUMNS = (
    "gpu_id",
    "kernel",
    "kernel_version",
    "triton_version",
    "v",
    "d",
    "dtype",
    "n_bucket",
    "mode",
)
"""One best config per value of these columns (the unique key the upsert conflicts on)."""


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class ProblemKey:
    """The columns that name a problem (measurements and best entries share them)."""

    gpu_id: Mapped[int] = mapped_column(ForeignKey("gpus.id"))
    kernel: Mapped[str] = mapped_column(String(NAME_LENGTH))
    kernel_version: Mapped[str] = mapped_column(String(NAME_LENGTH))
    triton_version: Mapped[str] = mapped_column(String(NAME_LENGTH))
    v: Mapped[int]
    d: Mapped[int]
    dtype: Mapped[str] = mapped_column(String(16))
    n_bucket: Mapped[int] = mapped_column(BigInteger)
    mode: Mapped[str] = mapped_column(String(16))


class Gpu(Base):
    """A GPU model, keyed by its normalized name; configs are tuned per model."""

    __tablename__ = "gpus"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(NAME_LENGTH), unique=True)
    compute_capability: Mapped[str] = mapped_column(String(8))
    sm_count: Mapped[int]
    memory_bytes: Mapped[int] = mapped_column(BigInteger)


class Measurement(ProblemKey, Base):
    """One timed run of one config on one problem: never updated or deleted."""

    __tablename__ = "measurements"
    __table_args__ = (
        Index("ix_measurements_problem", "gpu_id", "kernel", "kernel_version", "v", "d", "dtype", "mode"),
        CheckConstraint("median_ms > 0", name="median_positive"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    uid: Mapped[str] = mapped_column(String(32), unique=True)
    torch_version: Mapped[str] = mapped_column(String(NAME_LENGTH))
    tokens: Mapped[int] = mapped_column(BigInteger)
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    median_ms: Mapped[float] = mapped_column(Float)
    p20_ms: Mapped[float] = mapped_column(Float)
    p80_ms: Mapped[float] = mapped_column(Float)
    default_ms: Mapped[float] = mapped_column(Float)
    method: Mapped[str] = mapped_column(String(NAME_LENGTH))
    submitter: Mapped[str] = mapped_column(String(NAME_LENGTH))
    host: Mapped[str] = mapped_column(String(NAME_LENGTH))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class BestConfig(ProblemKey, Base):
    """The fastest live config known for one problem key.

    It holds only what the upsert compares (`median_ms`) and the measurement it came from;
    the config and the other times are read from that measurement, so they cannot drift
    apart from the time they were measured with.
    """

    __tablename__ = "best_configs"
    __table_args__ = (
        UniqueConstraint(*BEST_KEY_COLUMNS, name="uq_best_configs_key"),
        Index("ix_best_configs_problem", "kernel", "kernel_version", "v", "d", "dtype", "mode"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    median_ms: Mapped[float] = mapped_column(Float)
    measurement_id: Mapped[int] = mapped_column(ForeignKey("measurements.id"))
    retired: Mapped[bool] = mapped_column(default=False)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class RetiredMeasurement(Base):
    """A measurement whose entry an admin retired: never a key's best again, so an older export
    that still carries it cannot bring it back once a newer measurement has replaced it.
    Append-only, as measurements are; a best entry is `retired` exactly while it points at one."""

    __tablename__ = "retired_measurements"

    measurement_id: Mapped[int] = mapped_column(ForeignKey("measurements.id"), primary_key=True)
    retired_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
