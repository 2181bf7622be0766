"""Throwaway PostgreSQL schemas, so tests and benchmarks that run at the same time on one
server never see each other's tables."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import text
from sqlalchemy.engine import make_url

from tuning_db.engine import make_engine


@contextmanager
def scratch_schema(postgres_url: str, prefix: str = "cce_scratch") -> Iterator[str]:
    """Create a uniquely named schema, yield a URL whose connections use it, drop it after.

    Raises sqlalchemy.exc.OperationalError when the server cannot be reached."""
    schema = f"{prefix}_{uuid.uuid4().hex[:12]}"
    engine = make_engine(postgres_url)
    admin = engine.execution_options(isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            connection.execute(text(f'CREATE SCHEMA "{schema}"'))
        try:
            scoped = make_url(postgres_url).update_query_dict({"options": f"-csearch_path={schema}"})
            yield scoped.render_as_string(hide_password=False)
        finally:
            with admin.connect() as connection:
                connection.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    finally:
        engine.dispose()
