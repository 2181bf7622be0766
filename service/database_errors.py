"""Database failures as HTTP answers: what a client can wait out (a lock, a database that
is down or not yet upgraded) is 503 with Retry-After, a read-only or full database 503
without it, never a bare 500."""

from __future__ import annotations

from fastapi import Request, status
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError, OperationalError

from tuning_db.engine import missing_schema

LOCK_RETRY_AFTER_S = 1
"""A lock is held for one transaction (an import on SQLite commits in batches): retry soon."""
SCHEMA_RETRY_AFTER_S = 30
"""A schema waits for an operator to run `cce db upgrade`: longer than a client waits (the
publisher's MAX_RETRY_AFTER_S), so it gives up at once instead of retrying."""


READ_ONLY_SQLSTATE = "25006"
DISK_FULL_SQLSTATE = "53100"


def read_only(error: DBAPIError) -> bool:
    """SQLite's 'attempt to write a readonly database', PostgreSQL's read_only_sql_transaction
    (a hot standby, or default_transaction_read_only): no retry mends either."""
    return getattr(error.orig, "sqlstate", None) == READ_ONLY_SQLSTATE or "readonly database" in str(error.orig)


def disk_full(error: DBAPIError) -> bool:
    """SQLite's 'database or disk is full' (SQLITE_FULL: the disk, or max_page_count),
    PostgreSQL's disk_full: writes fail until an operator frees space."""
    return getattr(error.orig, "sqlstate", None) == DISK_FULL_SQLSTATE or "database or disk is full" in str(error.orig)


def lasting(error: BaseException | None) -> bool:
    """A database failure that no retry mends (read-only, or out of space): no Retry-After."""
    return isinstance(error, DBAPIError) and (read_only(error) or disk_full(error))


async def database_error(_request: Request, error: Exception) -> JSONResponse:
    """503 for a missing schema, a read-only or full database (without Retry-After: neither
    passes by itself), or an unavailable or locked database; 500 without the driver's text (it
    may quote the statement) for anything else."""
    assert isinstance(error, DBAPIError)
    if lasting(error):
        detail = ("the database is read-only: writes fail until an operator makes it writable" if read_only(error)
                  else "the database's disk is full: writes fail until an operator frees space")
        return JSONResponse({"detail": detail}, status_code=status.HTTP_503_SERVICE_UNAVAILABLE)
    if missing_schema(error):
        detail = "the database lacks this service's schema (none, or an older revision): run `cce db upgrade`"
        retry_after = SCHEMA_RETRY_AFTER_S
    elif isinstance(error, OperationalError):
        # SQLite's "database is locked" after the busy timeout, PostgreSQL's lock and
        # statement time-outs, serialization failures and lost connections.
        detail = f"the database is busy or unavailable ({type(error.orig).__name__}): retry later"
        retry_after = LOCK_RETRY_AFTER_S
    else:
        return JSONResponse({"detail": "database error"}, status_code=status.HTTP_500_INTERNAL_SERVER_ERROR)
    return JSONResponse(
        {"detail": detail},
        status_code=status.HTTP_503_SERVICE_UNAVAILABLE,
        headers={"Retry-After": str(retry_after)},
    )


async def connections_held(_request: Request, _error: Exception) -> JSONResponse:
    """SQLAlchemy's pool timeout: every connection of this process is held by requests waiting
    on the database (behind a lock), so this one waited 30 s for a connection and got none. No
    database error, but the database busy all the same: 503 with Retry-After, not a bare 500."""
    return JSONResponse(
        {"detail": "the database is busy: all of this service's connections to it are in use; retry later"},
        status_code=status.HTTP_503_SERVICE_UNAVAILABLE,
        headers={"Retry-After": str(LOCK_RETRY_AFTER_S)},
    )
