"""Liveness, readiness and metrics, for the load balancer and Prometheus (no auth)."""

from __future__ import annotations

from fastapi import APIRouter, status
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from service.deps import EngineDep, MetricsDep
from service.schemas import Health
from tuning_db.migrate import UnreadableRevision, current_revision, foreign_tables, head_revision

router = APIRouter(tags=["health"])


# HEAD too, as load balancers often check with it; out of the schema, where it would repeat
# GET's operation id.
@router.head("/healthz", response_model=Health, include_in_schema=False)
@router.get("/healthz", response_model=Health)
def healthz() -> Health:
    return Health(status="ok")


@router.head("/readyz", response_model=Health, include_in_schema=False)
@router.get("/readyz", response_model=Health, responses={503: {"model": Health}})
def readyz(engine: EngineDep) -> Health | JSONResponse:
    """Ready when the database answers, its schema is at the code's revision, and its tables are
    this store's (another Alembic project's database may carry the same revision id)."""
    try:
        revision = current_revision(engine)
        foreign = foreign_tables(engine) if revision == head_revision() else None
    except UnreadableRevision as error:
        return _not_ready(f"alembic_version: {error} (another program's?)")
    except Exception as error:  # any failure to reach the database means not ready
        return _not_ready(f"database unreachable: {type(error).__name__}")
    if revision != head_revision():
        return _not_ready(f"schema at {revision}, expected {head_revision()}: run `cce db upgrade`")
    if foreign is not None:
        return _not_ready(f"schema at {revision}, but {foreign}: another program's database?")
    return Health(status="ready")


def _not_ready(detail: str) -> JSONResponse:
    return JSONResponse(Health(status="unavailable", detail=detail).model_dump(), status.HTTP_503_SERVICE_UNAVAILABLE)


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
def metrics(service_metrics: MetricsDep) -> Response:
    return Response(service_metrics.render(), media_type=CONTENT_TYPE_LATEST)
