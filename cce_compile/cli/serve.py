"""`cce serve`: the tuning service under uvicorn."""

from __future__ import annotations

import os
import tempfile
from typing import Annotated

import typer

from cce_compile.cli.db import DbUrlOption


def serve(
    host: Annotated[str, typer.Option(help="address to listen on (keep loopback unless behind a proxy)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8000,
    db_url: DbUrlOption = None,
    workers: Annotated[int, typer.Option(min=1, help="uvicorn worker processes")] = 1,
    log_level: Annotated[str, typer.Option(help="uvicorn log level; 'warning' drops the access log")] = "info",
) -> None:
    """Serve the tuning database over HTTP (an SQLite database is upgraded on start).

    Tokens and other settings come from the environment: CCE_SERVICE_TOKENS,
    CCE_SERVICE_TOKENS_FILE, CCE_SERVICE_OPEN_READS, CCE_SERVICE_MAX_BODY_BYTES.
    """
    import uvicorn

    from tuning_db.engine import DB_URL_ENV, resolve_db_url

    # Every worker builds its app from the environment, so the URL travels there.
    os.environ[DB_URL_ENV] = resolve_db_url(db_url)
    with tempfile.TemporaryDirectory(prefix="cce-metrics-") as metrics_dir:
        if workers > 1:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        uvicorn.run(
            "service.app:create_app",
            factory=True,
            host=host,
            port=port,
            workers=workers,
            log_level=log_level,
        )


def register(app: typer.Typer) -> None:
    app.command()(serve)
