"""HTTP request and response shapes beyond the store's own records (tuning_db.records,
whose MeasurementIn is the POST body as it is). Unknown fields are rejected.

The error bodies too, and which statuses each route answers with them (`errors`, given as
`responses=` to the app, the routers and routes), so that /openapi.json names every answer."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tuning_db.records import MAX_ROW_ID, BestEntry, ConfigFilters, ImportMode, MatchLevel


class Forbidding(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NoQuery(Forbidding):
    """The query of a route that takes none: any parameter is refused (422), as on the routes
    that take some, so a misspelt or unsupported one is never silently ignored."""


class BestConfigResponse(Forbidding):
    """What a launching node needs: the config, how well it matches, and where it came from.
    With match_level 'none' the node uses its own defaults."""

    match_level: MatchLevel
    config: dict[str, Any] | None
    speedup: float | None = Field(description="default_ms / median_ms of the source measurement")
    entry_id: int | None
    n_bucket: int = Field(description="the bucket of the requested token count")
    source: BestEntry | None


class ConfigListQuery(ConfigFilters):
    limit: int = Field(100, ge=1, le=1000)
    offset: int = Field(0, ge=0, le=MAX_ROW_ID)


class ConfigPage(Forbidding):
    items: list[BestEntry]
    total: int
    limit: int
    offset: int


class ImportQuery(Forbidding):
    mode: ImportMode = "keep_better"
    dry_run: bool = False


class Health(Forbidding):
    status: str
    detail: str | None = None


class ErrorBody(Forbidding):
    """A refused or failed request (401, 403, 404, 409, 413, 415, 500, 503): why, in words."""

    detail: str


class ValidationIssue(Forbidding):
    loc: list[str | int] = Field(description="where: 'query', 'header', 'path' or 'body', then the name")
    msg: str
    type: str


class ValidationErrorBody(Forbidding):
    """A 422 naming each bad part of the request (at most MAX_REPORTED_ERRORS), without its input."""

    detail: list[ValidationIssue]


class ImportLineError(Forbidding):
    """An import file refused (422) at a line; on SQLite the batches before it may be imported."""

    detail: str
    line: int
    lines_imported: int


class ImportInterruptedBody(Forbidding):
    """An SQLite import whose later batch the database failed (503, Retry-After): send it again."""

    detail: str
    lines_imported: int


_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before sending it again (none: waiting will not "
                                "mend it)", "schema": {"type": "string"}}}
_ERRORS: dict[int, dict[str, Any]] = {
    401: {"description": "no bearer token, or an unknown one",
          "headers": {"WWW-Authenticate": {"schema": {"type": "string"}}}},
    403: {"description": "the token lacks the route's scope"},
    404: {"description": "no such entry"},
    409: {"description": "a GPU registered with other properties, or an Idempotency-Key stored with another body"},
    413: {"description": "the request body is over the size limit"},
    415: {"description": "the body's Content-Type is not JSON"},
    422: {"model": ValidationErrorBody, "description": "a bad query, header, path or body"},
    500: {"description": "a database error that no retry mends"},
    503: {"description": "the database is busy, unreachable, read-only or not upgraded", "headers": _RETRY_AFTER},
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The `responses=` of a route that may answer these statuses, each with the body it sends
    (ErrorBody unless _ERRORS names another)."""
    return {status: {"model": ErrorBody, **_ERRORS[status]} for status in statuses}


EVERY_ROUTE = errors(413, 422)
"""What any route may answer: a body over the limit (the middleware's), a query parameter or
header given twice (the app's dependencies)."""
AUTH = (401, 403)
"""A route that needs a token: none or an unknown one, or one without the route's scope."""
DATABASE = (500, 503)
"""A route that reaches the database (service.database_errors)."""
IMPORT_ERRORS: dict[int | str, dict[str, Any]] = {  # beside its router's AUTH and DATABASE
    422: {"model": ValidationErrorBody | ImportLineError, "description": "a bad query, or a file refused at a line"},
    503: {**_ERRORS[503], "model": ErrorBody | ImportInterruptedBody},
}
