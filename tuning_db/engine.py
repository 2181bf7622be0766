"""One engine per database URL, for SQLite (one machine) and PostgreSQL (a cluster).

The URL comes from the caller, else `CCE_TUNING_DB_URL`, else an SQLite file in the
user's cache dir. SQLite gets WAL (readers never block the writer), a busy timeout, and
write transactions that take the write lock at BEGIN (BEGIN IMMEDIATE): a deferred
transaction that reads before it writes can fail at once with "database is locked" when
another writer commits in between, whatever the busy timeout.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import platformdirs
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, Connection, make_url
from sqlalchemy.exc import DBAPIError, InvalidatePoolError
from sqlalchemy.util import asbool
from sqlalchemy.orm import Session

from cce_compile.redact import redact_urls

DB_URL_ENV = "CCE_TUNING_DB_URL"
SQLITE_BUSY_TIMEOUT_MS = 30_000
CONNECT_TIMEOUT_S = 5
"""A cluster node must fall back to its defaults quickly when the database is down."""
WRITE_OPTION = "cce_write"
"""Execution option that marks a connection's transactions as writes (BEGIN IMMEDIATE)."""


class DefaultDatabaseUnavailable(RuntimeError):
    """No database was named and the default SQLite file's folder cannot be made."""


def default_db_url() -> str:
    """The per-user SQLite file, so a single machine works with no setup. Its path is escaped
    in the URL: pasted as it is, a '?' in it began the URL's query (a cache dir `/home/a?b`
    gave the database file `/home/a`) and a '%41' was read as 'A'. A cache folder that cannot
    be made (XDG_CACHE_HOME naming a file, a read-only home) raises saying how to name another."""
    try:
        cache_dir = Path(platformdirs.user_cache_dir("cce_compile", ensure_exists=True))
    except OSError as error:
        raise DefaultDatabaseUnavailable(
            f"the default database's folder cannot be made ({error.strerror}: {error.filename}); give a "
            f"database URL with --db-url or {DB_URL_ENV}") from None
    return URL.create("sqlite", database=str(cache_dir / "tuning.db")).render_as_string(hide_password=False)


def resolve_db_url(url: str | None = None) -> str:
    return url or os.environ.get(DB_URL_ENV) or default_db_url()


UNDEFINED_TABLE_SQLSTATE = "42P01"


def missing_schema(error: DBAPIError) -> bool:
    """Whether `error` is a query on a database without the schema (PostgreSQL's
    undefined_table, SQLite's 'no such table'): no retry mends it, `cce db upgrade` does."""
    return getattr(error.orig, "sqlstate", None) == UNDEFINED_TABLE_SQLSTATE or "no such table" in str(error.orig)


def shown_url(url: str | URL) -> str:
    """`url` fit to print: its password hidden, in the userinfo and in a query parameter
    (libpq takes ?password=, which SQLAlchemy's hide_password leaves)."""
    return redact_urls(make_url(url).render_as_string(hide_password=True))


def sqlite_file(url: str) -> Path | None:
    """The file an SQLite URL names, so a caller can tell a missing database from an empty one
    (connecting creates the file); None for another database or an in-memory one.

    Read as a URI (uri=true), the name the driver is given is read as SQLite reads it
    (_uri_path; an authority SQLite refuses: None, and connecting says why); a name without
    `file:` is a plain file name, the query SQLAlchemy appends to it included. The URI's mode
    does not change the file: ro and rw open only an existing one, and rwc is the driver's own
    default (it opens read-write and create, and SQLite takes no mode less restrictive than the
    open flags), so a URI saying rwc asks for nothing a plain path does not: a caller refusing a
    missing file refuses it whatever the mode."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or in_memory(url):
        return None
    if not asbool(parsed.query.get("uri", False)):
        return Path(parsed.database or "")
    (name,), _ = parsed.get_dialect()().create_connect_args(parsed)  # the name the driver opens
    path = _uri_path(name)
    return None if path is None else Path(path)


def _uri_path(name: str) -> str | None:
    """The file SQLite opens for `name` read as a URI: a `file:` URI's path, after an authority
    that is empty or `localhost` (None for any other, which SQLite refuses), up to its query or
    fragment, percent-decoded; a name without `file:` as it is."""
    if not name.startswith("file:"):
        return name
    path = name.removeprefix("file:")
    if path.startswith("//"):  # file://authority/path
        authority, slash, path = path[2:].partition("/")
        if authority not in ("", "localhost"):
            return None
        path = slash + path
    return unquote(re.split("[?#]", path, maxsplit=1)[0])


def in_memory(url: str) -> bool:
    """Whether an SQLite URL names a database that keeps nothing past its connection: in memory
    (sqlite://, :memory:) or, read as a URI (uri=true, SQLAlchemy's truth words), the path
    :memory:, mode=memory or an empty path (a temporary file)."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return False
    database = parsed.database or ""
    if not asbool(parsed.query.get("uri", False)):
        return database in ("", ":memory:")
    return _uri_path(database) in ("", ":memory:") or parsed.query.get("mode") == "memory"


def make_engine(url: str | None = None) -> Engine:
    url = resolve_db_url(url)
    if url.startswith("sqlite"):
        engine = create_engine(url)
        _configure_sqlite(engine)
        return engine
    return create_engine(url, pool_pre_ping=True, connect_args={"connect_timeout": CONNECT_TIMEOUT_S})


def _file_identity(path: str) -> tuple[int, int] | None:
    """The device and inode of the file at `path` now (None: no file there)."""
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_dev, status.st_ino


def _configure_sqlite(engine: Engine) -> None:
    """Each checkout checks that the file a pooled connection opened (its absolute path, as
    SQLite reports it) is still the file at that path: a connection keeps a removed or replaced
    file open, and writes went on into it (acknowledged, and lost with the process) while the
    path named another file or none. Such connections are dropped, and the next opens what the
    path names now (a removed database is then a new file without schema: the service says to
    upgrade it). A database in memory has no file and is not checked."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, record: Any) -> None:
        # Let SQLAlchemy emit BEGIN itself (the sqlite3 module would skip it for reads).
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA journal_mode = WAL")
        cursor.execute("PRAGMA synchronous = NORMAL")
        cursor.execute("PRAGMA foreign_keys = ON")
        _, _, file = cursor.execute("PRAGMA database_list").fetchone()  # main: '' in memory
        cursor.close()
        if file:
            record.info["file"] = file, _file_identity(file)

    @event.listens_for(engine, "checkout")
    def _on_checkout(_dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        opened = record.info.get("file")
        if opened is not None and _file_identity(opened[0]) != opened[1]:
            raise InvalidatePoolError(f"the database file {opened[0]} was removed or replaced")

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        is_write = connection.get_execution_options().get(WRITE_OPTION, False)
        connection.exec_driver_sql("BEGIN IMMEDIATE" if is_write else "BEGIN")


@contextmanager
def write_session(engine: Engine) -> Iterator[Session]:
    """A transaction that commits on success and rolls back on any error."""
    with Session(engine, execution_options={WRITE_OPTION: True}) as session, session.begin():
        yield session


@contextmanager
def read_session(engine: Engine, snapshot: bool = False) -> Iterator[Session]:
    """A read transaction; `snapshot` makes several queries see one state (PostgreSQL)."""
    options = {"isolation_level": "REPEATABLE READ"} if snapshot and engine.dialect.name == "postgresql" else {}
    with Session(engine, execution_options=options) as session, session.begin():
        yield session
