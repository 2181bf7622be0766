"""Route dependencies: the app's engine and metrics, and the auth checks by scope.

They are `async def` because they only read app state: FastAPI would run a plain `def`
dependency in its thread pool, a thread hop per dependency per request."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from sqlalchemy import Engine

from service.auth import require
from service.metrics import ServiceMetrics
from tuning_db.records import IDEMPOTENCY_KEY_HEADER


async def _engine(request: Request) -> Engine:
    return request.app.state.engine


async def _metrics(request: Request) -> ServiceMetrics:
    return request.app.state.metrics


async def single_valued_query(request: Request) -> None:
    """Every query parameter is a single value: given twice, one of them was silently dropped
    (?V=5&V=128256 looked up V=128256, ?mode=overwrite&mode=skip imported as skip)."""
    seen: set[str] = set()
    for name, _value in request.query_params.multi_items():
        if name in seen:
            raise RequestValidationError([{"loc": ("query", name), "msg": "given more than once; give it once",
                                           "type": "value_error"}])
        seen.add(name)


SINGLE_VALUED_HEADERS = ("Authorization", IDEMPOTENCY_KEY_HEADER)
"""Headers whose one value decides what a request may do or which measurement it is."""


async def single_valued_headers(request: Request) -> None:
    """Each of SINGLE_VALUED_HEADERS is given at most once: two Authorization headers were
    authorized by the first alone (a proxy adding its own, a client merging two configs), two
    Idempotency-Keys stored the measurement under the first; a 422 naming the header, as a
    repeated query parameter gets."""
    for name in SINGLE_VALUED_HEADERS:
        if len(request.headers.getlist(name)) > 1:
            raise RequestValidationError([{"loc": ("header", name), "msg": "given more than once; give it once",
                                           "type": "value_error"}])


EngineDep = Annotated[Engine, Depends(_engine)]
MetricsDep = Annotated[ServiceMetrics, Depends(_metrics)]
READ = [Depends(require("read"))]
WRITE = [Depends(require("write"))]
ADMIN = [Depends(require("admin"))]
