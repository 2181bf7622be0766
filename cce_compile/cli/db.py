"""`cce db upgrade`, `cce export`, `cce import`: the tuning database, directly or through a
running service (--url)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from cce_compile.cli.errors import fail
from cce_compile.resolve.sources import TOKEN_ENV
from tuning_db.records import ImportMode

DbUrlOption = Annotated[
    Optional[str],
    typer.Option("--db-url", envvar="CCE_TUNING_DB_URL", help="SQLAlchemy URL; default: the per-user SQLite file"),
]
ServiceUrlOption = Annotated[
    Optional[str], typer.Option("--url", help="a running service's base URL, instead of --db-url")
]
TokenOption = Annotated[
    Optional[str],
    typer.Option("--token", envvar=TOKEN_ENV, help="bearer token for --url (the one the op reads with)"),
]
HTTP_TIMEOUT_S = 60.0
ERROR_DETAIL_CHARS = 500

db_app = typer.Typer(help="Tuning database maintenance.", no_args_is_help=True)


@db_app.command("upgrade")
def upgrade_command(db_url: DbUrlOption = None) -> None:
    """Create or migrate the schema to the latest revision."""
    from tuning_db.engine import resolve_db_url
    from tuning_db.migrate import upgrade

    url = resolve_db_url(db_url)
    revision = upgrade(url)
    typer.echo(f"tuning database at revision {revision}", err=True)


def _service_request(method: str, url: str, path: str, token: str | None, **kwargs: object) -> str:
    """One call to the service; exits with its error detail on a failure status."""
    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        response = httpx.request(method, url.rstrip("/") + path, headers=headers, timeout=HTTP_TIMEOUT_S, **kwargs)
    except (httpx.HTTPError, httpx.InvalidURL) as error:
        fail(f"{method} {url.rstrip('/')}{path}: {type(error).__name__}: {error}")
    if response.is_error:
        fail(f"{response.status_code}: {response.text[:ERROR_DETAIL_CHARS]}")
    return response.text


def export_command(db_url: DbUrlOption = None, url: ServiceUrlOption = None, token: TokenOption = None) -> None:
    """Write the live best entries as JSON lines to stdout (first line: schema header)."""
    if url:
        sys.stdout.write(_service_request("GET", url, "/v1/export", token))
        return
    from tuning_db.engine import make_engine
    from tuning_db.store import export_jsonl

    engine = make_engine(db_url)
    try:
        sys.stdout.write("".join(line + "\n" for line in export_jsonl(engine)))
    finally:
        engine.dispose()


def import_command(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="a file written by `cce export`")],
    mode: Annotated[ImportMode, typer.Option(help="what to do when a key already has an entry")] = "keep_better",
    dry_run: Annotated[bool, typer.Option(help="report what would change, change nothing")] = False,
    db_url: DbUrlOption = None,
    url: ServiceUrlOption = None,
    token: TokenOption = None,
) -> None:
    """Import an export file in one transaction (all lines or none) and print the counts."""
    if url:
        params = {"mode": mode, "dry_run": str(dry_run).lower()}
        typer.echo(_service_request("POST", url, "/v1/import", token, params=params, content=file.read_bytes()))
        return
    from tuning_db.engine import make_engine
    from tuning_db.store import ImportFormatError, import_jsonl

    engine = make_engine(db_url)
    try:
        with file.open(encoding="utf-8") as lines:
            report = import_jsonl(engine, lines, mode=mode, dry_run=dry_run)
    except ImportFormatError as error:
        fail(f"{file}: {error}; nothing was imported")
    finally:
        engine.dispose()
    typer.echo(json.dumps(report.model_dump()))


def register(app: typer.Typer) -> None:
    app.add_typer(db_app, name="db")
    app.command("export")(export_command)
    app.command("import")(import_command)
