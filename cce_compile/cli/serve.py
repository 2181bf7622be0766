"""`cce serve`: the tuning service under uvicorn."""

from __future__ import annotations

import os
import signal
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING, Annotated, Literal

import typer

from cce_compile.cli.db import DbUrlOption, new_engine, upgraded
from cce_compile.cli.errors import fail, refuse_empty

if TYPE_CHECKING:
    from service.settings import ServiceSettings

LogLevel = Literal["critical", "error", "warning", "info", "debug", "trace"]
"""uvicorn's log levels."""



def serve(
    host: Annotated[str, typer.Option(
        callback=refuse_empty("the address is empty; leave --host out for loopback (127.0.0.1)"), help="address to listen on (keep loopback unless behind a proxy)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8000,
    db_url: DbUrlOption = None,
    workers: Annotated[int, typer.Option(min=1, help="uvicorn worker processes")] = 1,
    log_level: Annotated[LogLevel, typer.Option(help="uvicorn log level; 'warning' drops the access log")] = "info",
) -> None:
    """Serve the tuning database over HTTP (an SQLite database is upgraded on start).

    Tokens and other settings come from the environment: CCE_SERVICE_TOKENS,
    CCE_SERVICE_TOKENS_FILE, CCE_SERVICE_OPEN_READS, CCE_SERVICE_MAX_BODY_BYTES.
    `cce token` makes a token.
    """
    import uvicorn

    from tuning_db.engine import DB_URL_ENV, resolve_db_url

    # Every worker builds its app from the environment, so the URL travels there.
    os.environ[DB_URL_ENV] = resolve_db_url(db_url)
    settings = _checked_settings()
    _check_free(host, port)
    for line in startup_report(settings, os.environ[DB_URL_ENV]):
        typer.echo(f"cce serve: {line}", err=True)
    with _cleanups_run_on_sigterm(), tempfile.TemporaryDirectory(prefix="cce-metrics-") as metrics_dir:
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


def _check_free(host: str, port: int) -> None:
    """A one-line error where the address cannot be listened on (a port in use): uvicorn
    would log it among its start-up lines and exit 3."""
    try:
        with socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET):
            pass
    except OSError as error:
        fail(f"cannot listen on {host}:{port}: {error.strerror or error}")


class _Terminated(BaseException):
    """SIGTERM, as an exception, so that it unwinds through the `with` blocks' cleanups."""


def _raise_terminated(_signum: int, _frame: FrameType | None) -> None:
    raise _Terminated


@contextmanager
def _cleanups_run_on_sigterm() -> Iterator[None]:
    """After its graceful shutdown on SIGTERM, uvicorn raises the signal again so that the
    process dies of it, as supervisors expect (systemd counts that a clean stop, not exit 143);
    the default action would kill it there, skipping every cleanup of the block (the metrics
    directory). Here the signal unwinds the block first, then kills the process all the same."""
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _checked_settings() -> ServiceSettings:
    """The environment's settings, checked here so that a bad one stops `cce serve` with one
    line before uvicorn starts workers that would each fail with a traceback.

    An SQLite database is upgraded here (each worker does it again at start, a no-op then),
    so that one it cannot be (a newer release's schema) stops here too; a PostgreSQL server is
    not opened: while it is down the service answers 503 (/readyz too) and waits."""
    from pydantic import ValidationError

    from service.settings import ServiceSettings
    from tuning_db.engine import resolve_db_url

    try:
        settings = ServiceSettings()
        settings.token_scopes()
    except ValidationError as error:
        first = error.errors()[0]
        fail(f"{ServiceSettings.model_config['env_prefix']}{str(first['loc'][0]).upper()}: {first['msg']}")
    except OSError as error:
        fail(f"CCE_SERVICE_TOKENS_FILE: cannot read {settings.tokens_file}: {error.strerror or error}")
    except UnicodeDecodeError as error:  # a ValueError, but no malformed entry: `cce token` would not mend it
        # the decoder's offset counts from after a byte order mark it took off
        offset = error.start + len(settings.tokens_file.read_bytes()) - len(error.object)
        fail(f"CCE_SERVICE_TOKENS_FILE: {settings.tokens_file} is not UTF-8 text "
             f"(byte 0x{error.object[error.start]:02x} at offset {offset})")
    except ValueError as error:
        source = "CCE_SERVICE_TOKENS" + ("/CCE_SERVICE_TOKENS_FILE" if settings.tokens_file else "")
        fail(f"{source}: {error} (`cce token` makes one)")
    db_url = resolve_db_url(settings.db_url)
    new_engine(db_url).dispose()  # loads the database driver (a missing one fails here), refuses an in-memory one
    if db_url.startswith("sqlite"):
        upgraded(db_url)
    return settings


def startup_report(settings: ServiceSettings, db_url: str) -> list[str]:
    """What a new user needs to reach the service: where its data is, and who may read."""
    from tuning_db.engine import shown_url

    tokens = settings.token_scopes()
    lines = [f"database {shown_url(db_url)}"]
    reads = "reads open to everyone (CCE_SERVICE_OPEN_READS=1)" if settings.open_reads else "reads need a read token"
    lines.append(f"auth: {len(tokens)} token(s) configured; {reads}; writes need a write token")
    if not tokens:
        lines.append(
            "no tokens: every /v1 call but open reads answers 401. Make one with `cce token --scopes read,write` "
            "and start with CCE_SERVICE_TOKENS=<that entry>; clients send it from CCE_TUNING_TOKEN"
        )
    return lines


def register(app: typer.Typer) -> None:
    app.command()(serve)
