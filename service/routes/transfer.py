"""Moving the store's contents between databases as JSON lines."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from service.deps import ADMIN, READ, EngineDep
from service.schemas import AUTH, DATABASE, IMPORT_ERRORS, ImportQuery, NoQuery, errors
from tuning_db import store
from tuning_db.records import ImportReport

JSONL_MEDIA_TYPE = "application/x-ndjson"

router = APIRouter(prefix="/v1", tags=["transfer"], responses=errors(*AUTH, *DATABASE))


@router.get("/export", dependencies=READ, response_class=Response,
            responses={200: {"content": {JSONL_MEDIA_TYPE: {"schema": {"type": "string"}}}}})
def export(_query: Annotated[NoQuery, Query()], engine: EngineDep) -> Response:
    """A header line with the schema version, then one line per live best entry."""
    return Response("".join(line + "\n" for line in store.export_jsonl(engine)), media_type=JSONL_MEDIA_TYPE)


@router.post(
    "/import",
    dependencies=ADMIN,
    response_model=ImportReport,
    responses=IMPORT_ERRORS,
    openapi_extra={"requestBody": {"content": {JSONL_MEDIA_TYPE: {"schema": {"type": "string"}}}, "required": True}},
)
async def import_entries(request: Request, query: Annotated[ImportQuery, Query()], engine: EngineDep) -> ImportReport:
    """Import an export file (the body), checked whole first: on PostgreSQL all lines or none, on
    SQLite in batches of lines; `dry_run` only reports."""
    lines = store.decoded_lines(await request.body())
    return await run_in_threadpool(store.import_jsonl, engine, lines, query.mode, query.dry_run)
