"""Schema versions through Alembic, configured from Python so an installed package works
from any working directory (no alembic.ini)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import Connection, Engine, func, inspect, select

from tuning_db.engine import WRITE_OPTION, make_engine

MIGRATIONS_DIR = Path(__file__).with_name("migrations")
UPGRADE_LOCK_KEY = int.from_bytes(b"cce_migr", "big")
"""The PostgreSQL advisory lock (one per database) that upgrades of the schema queue on."""


def alembic_config(connection: Connection | None = None) -> Config:
    """Alembic's config; migrations/env.py runs on the `connection` passed here."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["connection"] = connection
    return config


@cache
def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "tuning_db/migrations has no revision"
    return head


def known_revision(revision: str) -> bool:
    """Whether `revision` is one of this code's migrations (a newer release's is not)."""
    return revision in {script.revision for script in ScriptDirectory.from_config(alembic_config()).walk_revisions()}


class UnreadableRevision(Exception):
    """An alembic_version table of several rows: no revision of this store's (another program's?)."""


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as connection:
        try:
            return MigrationContext.configure(connection).get_current_revision()
        except CommandError:  # Alembic's for several rows, which it calls heads
            raise UnreadableRevision("it holds several revisions") from None


FIRST_TABLES = ("gpus", "measurements", "best_configs")
"""The tables revision 0001 made, which every revision has: what a database at an older revision
is checked for before an upgrade. foreign_tables reads their columns from today's models, so a
migration that adds a column to one of them must leave it out of that check."""


def foreign_tables(engine: Engine, tables: tuple[str, ...] | None = None) -> str | None:
    """Why the database's tables are not this code's schema (a table missing, or lacking a
    column), or None; `tables` names those to check, by default all of the head's. A database
    whose alembic_version names one of this code's revisions may still be another Alembic
    project's: `0001` is many a project's first migration id, and Alembic then takes it as up
    to date (or upgrades it on top of that project's tables)."""
    from tuning_db.models import Base

    with engine.connect() as connection:
        inspector = inspect(connection)
        present = set(inspector.get_table_names())
        for table in Base.metadata.sorted_tables:
            if tables is not None and table.name not in tables:
                continue
            if table.name not in present:
                return f"it has no table {table.name}"
            columns = {column["name"] for column in inspector.get_columns(table.name)}
            missing = [column.name for column in table.columns if column.name not in columns]
            if missing:
                return f"its table {table.name} has no column {', '.join(missing)}"
    return None


def upgrade(url: str | None = None) -> str | None:
    """Bring the database at `url` to the head revision; safe to run from several processes at
    once: SQLite serializes them on its write lock, PostgreSQL on an advisory lock (its DDL
    alone does not: two upgrades of an empty schema both create alembic_version, and one
    fails on a duplicate key)."""
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            connection.execution_options(**{WRITE_OPTION: True})
            with connection.begin():
                if connection.dialect.name == "postgresql":  # held until this transaction ends
                    connection.execute(select(func.pg_advisory_xact_lock(UPGRADE_LOCK_KEY)))
                command.upgrade(alembic_config(connection), "head")
        return current_revision(engine)
    finally:
        engine.dispose()
