"""Tuners submit measurements; the store keeps the fastest per key."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, status

from service.deps import WRITE, EngineDep
from service.json_body import UniqueKeysRoute
from service.schemas import NoQuery
from tuning_db import store
from tuning_db.records import MAX_RECORD_CHARS, MeasurementIn, RecordResult

router = APIRouter(prefix="/v1", tags=["measurements"], route_class=UniqueKeysRoute)

MAX_BODY_BYTES = MAX_RECORD_CHARS
"""FastAPI parses and validates a body on the event loop, before auth: 8 MB of 700,000 unknown
keys held it, and every other request, for 8 s."""


@router.post("/measurements", dependencies=WRITE, status_code=status.HTTP_201_CREATED, response_model=RecordResult)
def record_measurement(
    measurement: MeasurementIn, _query: Annotated[NoQuery, Query()], engine: EngineDep
) -> RecordResult:
    return store.record_measurement(engine, measurement)
