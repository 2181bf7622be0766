"""Fixtures and builders shared by the tuning database and service tests.

`db_url` runs a test on SQLite (a file in tmp_path) and on PostgreSQL (a schema made for
this test session, dropped at its end, so parallel runs do not collide). Without a
reachable PostgreSQL the postgres cases skip, or fail when CI is set.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, func, select, text
from sqlalchemy.exc import OperationalError

from tuning_db.engine import make_engine
from tuning_db.migrate import upgrade
from tuning_db.models import Measurement
from tuning_db.records import MeasurementIn
from tuning_db.scratch import scratch_schema

POSTGRES_URL = os.environ.get("CCE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")

GPU_H100 = {"name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0", "sm_count": 132, "memory_bytes": 85_899_345_920}
H100_KEY = "nvidia-h100-80gb-hbm3"


def measurement_data(**overrides: Any) -> dict[str, Any]:
    """A valid POST /v1/measurements body (JSON-ready), with `overrides` applied."""
    data: dict[str, Any] = {
        "gpu": dict(GPU_H100),
        "kernel": "cce",
        "kernel_version": "k1a2b3",
        "triton_version": "3.5.0",
        "torch_version": "2.9.0+cu128",
        "V": 128_256,
        "D": 4096,
        "dtype": "bfloat16",
        "tokens": 8192,
        "mode": "exact",
        "config": {"slab_v": 8192},
        "median_ms": 10.0,
        "p20_ms": 9.5,
        "p80_ms": 10.5,
        "default_ms": 15.0,
        "method": "triton.do_bench",
        "submitter": "tester",
        "host": "node-1",
    }
    data.update(overrides)
    return data


def measurement(median_ms: float = 10.0, **overrides: Any) -> MeasurementIn:
    """A validated measurement with quantiles around `median_ms`."""
    return MeasurementIn.model_validate(
        measurement_data(median_ms=median_ms, p20_ms=median_ms * 0.95, p80_ms=median_ms * 1.05, **overrides)
    )


_LOOKUP_FIELDS = ("kernel", "kernel_version", "triton_version", "V", "D", "dtype", "tokens", "mode")


def lookup_params(**overrides: Any) -> dict[str, Any]:
    """The query of GET /v1/configs/best for measurement_data()'s problem."""
    data = measurement_data()
    params: dict[str, Any] = {"gpu": data["gpu"]["name"], **{name: data[name] for name in _LOOKUP_FIELDS}}
    params.update(overrides)
    return params


def measurement_count(engine: Engine) -> int:
    with engine.connect() as connection:
        return connection.scalar(select(func.count()).select_from(Measurement)) or 0


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _require_postgres() -> None:
    """Skip without a reachable server, or fail when CI is set (CI must test PostgreSQL)."""
    engine = make_engine(POSTGRES_URL)
    try:
        with engine.connect():
            pass
    except OperationalError as error:
        message = f"PostgreSQL at {POSTGRES_URL} (CCE_TEST_POSTGRES_URL) is unreachable: {error}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    finally:
        engine.dispose()


@pytest.fixture(scope="session")
def postgres_schema_url() -> Iterator[str]:
    """A migrated schema of its own on the PostgreSQL server, for this test session."""
    _require_postgres()
    with scratch_schema(POSTGRES_URL, prefix="cce_test") as url:
        upgrade(url)
        yield url


@pytest.fixture
def postgres_url(postgres_schema_url: str) -> str:
    """The session's schema, emptied for this test."""
    engine = make_engine(postgres_schema_url)
    with engine.begin() as connection:
        connection.execute(text("TRUNCATE retired_measurements, best_configs, measurements, gpus RESTART IDENTITY CASCADE"))
    engine.dispose()
    return postgres_schema_url


@pytest.fixture
def sqlite_url(tmp_path: Any) -> str:
    url = f"sqlite:///{tmp_path / 'tuning.db'}"
    upgrade(url)
    return url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest) -> str:
    """A migrated, empty database: once on SQLite, once on PostgreSQL."""
    return request.getfixturevalue(f"{request.param}_url")


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    engine = make_engine(db_url)
    yield engine
    engine.dispose()
