"""The FastAPI app: `create_app(settings)` for tests and embedding; with no settings it reads
the environment, which is how uvicorn's factory calls it (each worker builds its own app)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request, status
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from starlette.requests import ClientDisconnect

from service.log_secrets import hide_secrets_in_uvicorn_logs
from service.body_limit import BodySizeLimitMiddleware
from service.database_errors import LOCK_RETRY_AFTER_S, connections_held, database_error, lasting
from service.deps import single_valued_headers, single_valued_query
from service.metrics import CLIENT_CLOSED_REQUEST, RequestMetricsMiddleware, ServiceMetrics
from service.parent_watch import exit_with_parent
from service.routes import configs, gpus, health, measurements, transfer
from service.schemas import EVERY_ROUTE
from service.settings import ServiceSettings
from tuning_db import store
from tuning_db.engine import make_engine, resolve_db_url
from tuning_db.migrate import upgrade
from tuning_db.records import MAX_REPORTED_ERRORS, clip

_STORE_ERROR_STATUS = {
    store.NotFoundError: status.HTTP_404_NOT_FOUND,
    store.ConflictError: status.HTTP_409_CONFLICT,
    store.ImportFormatError: status.HTTP_422_UNPROCESSABLE_CONTENT,
    store.ImportInterrupted: status.HTTP_503_SERVICE_UNAVAILABLE,
}


MAX_DETAIL_CHARS = 1000
"""An error's text in an answer is cut here (it may quote megabytes of input)."""


def create_app(settings: ServiceSettings | None = None) -> FastAPI:
    settings = settings or ServiceSettings()
    db_url = resolve_db_url(settings.db_url)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        exit_with_parent()
        # A single machine's SQLite file is upgraded in place; a shared PostgreSQL is
        # upgraded once, by `cce db upgrade`, not by every replica that starts.
        if app.state.engine.dialect.name == "sqlite":
            await run_in_threadpool(upgrade, db_url)
        yield
        app.state.engine.dispose()

    app = FastAPI(
        title="cce_compile tuning service",
        version="1",
        summary="Best kernel launch configs per GPU and problem shape, shared by a cluster.",
        lifespan=lifespan,
        dependencies=[Depends(single_valued_query), Depends(single_valued_headers)],
        responses=EVERY_ROUTE,
        docs_url=None,  # served by _serve_docs_locally
        redoc_url=None,
    )
    _serve_docs_locally(app)
    hide_secrets_in_uvicorn_logs()
    app.state.settings = settings
    app.state.token_scopes = settings.token_scopes()
    app.state.engine = make_engine(db_url)
    app.state.metrics = ServiceMetrics()

    for module in (configs, measurements, gpus, transfer, health):
        app.include_router(module.router)

    async def store_error(_request: Request, error: Exception) -> JSONResponse:
        body = {"detail": clip(str(error), limit=MAX_DETAIL_CHARS)}
        if isinstance(error, store.ImportFormatError):
            body["line"] = error.line_number
        if isinstance(error, (store.ImportFormatError, store.ImportInterrupted)):
            body["lines_imported"] = error.lines_imported
        # an interrupted import that met a lock can be sent again soon; one that met a full or
        # read-only database cannot
        retry = isinstance(error, store.ImportInterrupted) and not lasting(error.error)
        headers = {"Retry-After": str(LOCK_RETRY_AFTER_S)} if retry else None
        return JSONResponse(body, status_code=_STORE_ERROR_STATUS[type(error)], headers=headers)

    for error_type in _STORE_ERROR_STATUS:
        app.add_exception_handler(error_type, store_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(DBAPIError, database_error)
    app.add_exception_handler(PoolTimeoutError, connections_held)
    app.add_exception_handler(ClientDisconnect, _client_left)

    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=settings.max_body_bytes,
                       path_limits={"/v1/measurements": measurements.MAX_BODY_BYTES})
    app.add_middleware(RequestMetricsMiddleware, metrics=app.state.metrics, routes=app.routes)
    return app


DOCS_ASSETS = "/docs/assets"


def _serve_docs_locally(app: FastAPI) -> None:
    """/docs with Swagger UI's files from the swagger-ui-bundle package, not FastAPI's CDN
    default: a cluster without internet access would see a blank page."""
    import swagger_ui_bundle

    app.mount(DOCS_ASSETS, StaticFiles(directory=swagger_ui_bundle.swagger_ui_path), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json", title=f"{app.title} - API",
            swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js", swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{DOCS_ASSETS}/favicon-32x32.png",
        )


async def _client_left(_request: Request, _error: Exception) -> Response:
    """A client gone mid-body is no server error: an answer nobody reads, not a 500 and its
    traceback in the log."""
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def _validation_error(_request: Request, error: Exception) -> JSONResponse:
    """A 422 naming the bad fields, without echoing the input back (it may be huge, or NaN,
    which JSON cannot carry): names and messages are clipped, as they may quote it."""
    assert isinstance(error, RequestValidationError)
    details = [
        {
            "loc": [clip(part) if isinstance(part, str) else part for part in item["loc"]],
            "msg": clip(_message(item)),
            "type": item["type"],
        }
        for item in error.errors()[:MAX_REPORTED_ERRORS]
    ]
    return JSONResponse({"detail": details}, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)


def _message(item: dict[str, Any]) -> str:
    """An error's message; for a body that is not JSON with the parser's reason, which
    FastAPI keeps apart ("JSON decode error" alone says neither where nor what)."""
    reason = item.get("ctx", {}).get("error") if item["type"] == "json_invalid" else None
    return f"{item['msg']}: {reason}" if reason else item["msg"]
