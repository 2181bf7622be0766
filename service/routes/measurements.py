"""Tuners submit measurements; the store keeps the fastest per key."""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Header, Query, status

from service.deps import WRITE, EngineDep
from service.json_body import UniqueKeysRoute
from service.schemas import AUTH, DATABASE, NoQuery, errors
from tuning_db import store
from tuning_db.records import IDEMPOTENCY_KEY_HEADER, MAX_RECORD_CHARS, MeasurementIn, RecordResult

router = APIRouter(prefix="/v1", tags=["measurements"], route_class=UniqueKeysRoute,
                   responses=errors(*AUTH, *DATABASE, 409, 415))

MAX_BODY_BYTES = MAX_RECORD_CHARS
"""FastAPI parses and validates a body on the event loop, before auth: 8 MB of 700,000 unknown
keys held it, and every other request, for 8 s."""

@router.post("/measurements", dependencies=WRITE, status_code=status.HTTP_201_CREATED, response_model=RecordResult)
def record_measurement(
    measurement: MeasurementIn,
    _query: Annotated[NoQuery, Query()],
    engine: EngineDep,
    idempotency_key: Annotated[
        uuid.UUID | None,
        Header(
            alias=IDEMPOTENCY_KEY_HEADER,
            description="a UUID the client draws for this measurement and sends with every retry of it: a retry "
            "whose first send was stored adds nothing (already_stored) and gets the stored one's answer; it becomes "
            "the measurement's uid",
        ),
    ] = None,
) -> RecordResult:
    """Append a measurement; sent again under its Idempotency-Key (its answer was lost: a
    gateway's 503, a timeout) it is stored once."""
    return store.record_measurement(engine, measurement, uid=None if idempotency_key is None else idempotency_key.hex)
