"""`cce db upgrade`, `cce export`, `cce import`: the tuning database, directly or through a
running service (--url)."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, BinaryIO, Optional

import typer

from cce_compile.cli.errors import fail, one_line, refuse_empty, require_stdout, service_url
from cce_compile.redact import hide_secrets_in_http_client_logs
from cce_compile.resolve.sources import TOKEN_ENV, bearer_token, token_problem
from tuning_db.records import ImportMode

if TYPE_CHECKING:
    from sqlalchemy import Engine


DbUrlOption = Annotated[
    Optional[str],
    typer.Option(
        "--db-url", envvar="CCE_TUNING_DB_URL",
        callback=refuse_empty("the URL is empty; leave the option out for the per-user SQLite file"),
        help="SQLAlchemy URL; default: the per-user SQLite file",
    ),
]
ServiceUrlOption = Annotated[
    Optional[str],
    typer.Option("--url", callback=service_url("the URL is empty; leave --url out to use --db-url"),
                 help="a running service's base URL, instead of --db-url"),
]
TokenOption = Annotated[
    Optional[str],
    typer.Option("--token", envvar=TOKEN_ENV, help="bearer token for --url: read scope for export, admin for import"),
]
HTTP_TIMEOUT_S = 60.0
ERROR_DETAIL_CHARS = 500

db_app = typer.Typer(help="Tuning database maintenance.", no_args_is_help=True)


@db_app.command("upgrade")
def upgrade_command(db_url: DbUrlOption = None) -> None:
    """Create or migrate the schema to the latest revision."""
    typer.echo(f"tuning database at revision {upgraded(db_url)}", err=True)


def upgraded(db_url: str | None) -> str | None:
    """Bring the database to the code's schema revision; a database that cannot be opened or
    upgraded (a newer release's revision, tables made by something else) stops with one line
    naming --db-url."""
    from alembic.util import CommandError
    from sqlalchemy.exc import DBAPIError

    from tuning_db.engine import resolve_db_url, shown_url
    from tuning_db.migrate import UnreadableRevision, upgrade

    url = resolve_db_url(db_url)
    engine = opened_engine(url)
    try:
        _refuse_foreign_schema(engine, url, _read_revision(engine, url))
    finally:
        engine.dispose()
    try:
        revision = upgrade(url)
    except (CommandError, DBAPIError, UnreadableRevision) as error:
        fail(f"--db-url {shown_url(url)}: cannot upgrade the schema: {getattr(error, 'orig', None) or error}")
    engine = new_engine(url)
    try:
        _refuse_foreign_tables(engine, url, revision)
    finally:
        engine.dispose()
    return revision


def _refuse_foreign_schema(engine: Engine, url: str, revision: str | None) -> None:
    """A revision a newer release wrote, or one of this code's revisions on tables that are not
    this store's (another Alembic project's at its own `0001`): upgrading or using it would fail
    half-way or build on that project's tables. Checked before an upgrade, so only the tables
    every revision has."""
    from tuning_db.migrate import FIRST_TABLES

    _refuse_unknown_revision(revision, url)
    if revision is not None:
        _refuse_foreign_tables(engine, url, revision, FIRST_TABLES)


def _refuse_foreign_tables(engine: Engine, url: str, revision: str | None,
                           tables: tuple[str, ...] | None = None) -> None:
    """A database at one of this code's revisions whose `tables` (by default the head's) are not
    this store's: another Alembic project's, whose own first revision has this code's first id
    (0001). The store's queries, or an upgrade, would fail on tables it lacks."""
    from tuning_db.engine import shown_url
    from tuning_db.migrate import foreign_tables

    reason = foreign_tables(engine, tables)
    if reason is not None:
        engine.dispose()
        fail(f"--db-url {shown_url(url)}: its alembic_version says schema {revision}, this store's, but {reason}: "
             "another program's database (another Alembic project's revision id)? name the tuning database")


def _read_revision(engine: Engine, url: str) -> str | None:
    """The database's schema revision; an alembic_version table this code cannot read (another
    program's: other columns, several heads) stops the command with one line naming --db-url,
    not the driver's text with the whole SELECT."""
    from sqlalchemy.exc import DBAPIError

    from tuning_db.engine import shown_url
    from tuning_db.migrate import UnreadableRevision, current_revision

    try:
        return current_revision(engine)
    except UnreadableRevision as error:
        reason = str(error)
    except DBAPIError as error:
        reason = str(error.orig)
    engine.dispose()
    fail(f"--db-url {shown_url(url)}: cannot read its schema revision from its alembic_version table "
         f"(another program's?): {reason}")


def _refuse_unknown_revision(revision: str | None, url: str) -> None:
    """A revision this code has no migration for was written by a newer release: neither
    upgrading nor using the database can work."""
    from tuning_db.engine import shown_url
    from tuning_db.migrate import known_revision

    if revision is not None and not known_revision(revision):
        fail(f"--db-url {shown_url(url)}: the database has schema {revision}, which this cce_compile does not "
             "know: a newer release wrote it (upgrade cce_compile), or its alembic_version table is another "
             "program's (name the tuning database)")


def opened_engine(db_url: str | None, existing: bool = False) -> Engine:
    """An engine that has connected once, so a database that cannot be opened (a missing folder,
    a file that is not SQLite) stops the command with one line naming --db-url, not mid-way;
    with `existing`, a missing SQLite file is refused instead of created."""
    from sqlalchemy.exc import DBAPIError

    from tuning_db.engine import resolve_db_url, shown_url, sqlite_file

    url = resolve_db_url(db_url)
    engine = new_engine(url)
    path = sqlite_file(url)
    if existing and path is not None and not path.exists():
        engine.dispose()
        shown = shown_url(url)
        fail(f"--db-url {shown}: no such SQLite database; create it with `cce db upgrade --db-url {shown}`")
    try:
        with engine.connect():
            pass
    except DBAPIError as error:
        engine.dispose()
        fail(f"--db-url {shown_url(url)}: cannot open the database: {error.orig}")
    return engine


def new_engine(url: str) -> Engine:
    """make_engine, failing in one line naming --db-url: a URL SQLAlchemy cannot parse or has no
    dialect for, or an in-memory SQLite database (exit 2, a bad option), or a dialect whose
    driver is not installed."""
    from sqlalchemy.exc import ArgumentError

    from tuning_db.engine import in_memory, make_engine, shown_url

    try:
        engine = make_engine(url)
    except ArgumentError as error:
        raise typer.BadParameter(str(error), param_hint="--db-url") from None
    except ImportError as error:
        fail(f"--db-url {shown_url(url)}: its database driver is not installed ({one_line(error)})")
    if in_memory(url):  # `cce db upgrade` "succeeded" on it, and export/import then sent the user back to it
        engine.dispose()
        raise typer.BadParameter(
            "an in-memory SQLite database is a new, empty one for each connection: nothing written to it "
            "outlives the connection; name a file (sqlite:///path/tuning.db)", param_hint="--db-url")
    return engine


def store_engine(db_url: str | None) -> Engine:
    """An existing database whose schema is at the code's revision: the store's queries would
    otherwise fail with the driver's text and the whole SQL statement."""
    from tuning_db.engine import resolve_db_url, shown_url
    from tuning_db.migrate import head_revision

    url = resolve_db_url(db_url)
    engine = opened_engine(url, existing=True)
    revision = _read_revision(engine, url)
    if revision != head_revision():
        _refuse_foreign_schema(engine, url, revision)
        engine.dispose()
        shown = shown_url(url)
        state = "has no schema" if revision is None else f"has schema {revision}, not {head_revision()}"
        fail(f"--db-url {shown}: the database {state}; run `cce db upgrade --db-url {shown}`")
    _refuse_foreign_tables(engine, url, revision)
    return engine


def _service_request(
    method: str, url: str, path: str, token: str | None, wait_for_answer: bool = False, **kwargs: object
) -> str:
    """One call to the service; exits with its error detail on a failure status. With
    `wait_for_answer` there is no read timeout: an import answers once the service has
    written every line, which a large file on a busy database takes minutes to."""
    import httpx

    hide_secrets_in_http_client_logs()
    token = bearer_token(token)
    problem = token_problem(token) if token else None
    if problem is not None:  # never quoted: the HTTP client's error quotes the header whole
        fail(f"--token {problem}", status=2)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    timeout = httpx.Timeout(HTTP_TIMEOUT_S, read=None if wait_for_answer else HTTP_TIMEOUT_S)
    try:
        response = httpx.request(method, url.rstrip("/") + path, headers=headers, timeout=timeout, **kwargs)
    except (httpx.HTTPError, httpx.InvalidURL) as error:
        fail(f"{method} {url.rstrip('/')}{path}: {type(error).__name__}: {error}")
    if response.is_error:
        fail(f"{response.status_code}: {response.text[:ERROR_DETAIL_CHARS]}")
    return response.text


def _checked_export(url: str, answer: str) -> str:
    """A service's export as it came, once its first line names the export format and its line
    count matches: a 200 from something else at the URL (a login page, another app) is no
    backup. Only the format is checked, so a newer service's export (another schema version,
    more header fields) is still written out whole."""
    import json

    from tuning_db.records import ExportHeader, clip
    from tuning_db.store import BYTE_ORDER_MARK

    lines = [line for line in answer.split("\n") if line.strip()]  # as the service writes them
    try:
        header = json.loads(lines[0].removeprefix(BYTE_ORDER_MARK)) if lines else None
    except ValueError:
        header = None
    if not (isinstance(header, dict) and header.get("format") == ExportHeader.model_fields["format"].default):
        fail(f"--url {url}: the service answered no export file (its first line is no export header): "
             f"{clip(answer[:ERROR_DETAIL_CHARS])!r}")
    if header.get("entries") != len(lines) - 1:
        fail(f"--url {url}: the service's export announces {header.get('entries')!r} entries but holds {len(lines) - 1}")
    return answer


def _checked_import_report(url: str, answer: str) -> str:
    """A service's import answer, once it reads as the counts an import reports."""
    from pydantic import ValidationError

    from tuning_db.records import ImportReport, clip

    try:
        ImportReport.model_validate_json(answer)
    except ValidationError:
        fail(f"--url {url}: the service answered no import report: {clip(answer[:ERROR_DETAIL_CHARS])!r}")
    return answer


def _refuse_two_targets(ctx: typer.Context, url: str | None) -> None:
    """--url and a --db-url given on the command line name two stores; the command would use one
    and silently ignore the other. CCE_TUNING_DB_URL in the environment is a default, which an
    explicit --url outranks."""
    source = ctx.get_parameter_source("db_url")  # typer's own copy of click's ParameterSource
    if url and source is not None and source.name == "COMMANDLINE":
        raise typer.BadParameter("give --url or --db-url, not both", param_hint="--url")


def export_command(
    ctx: typer.Context, db_url: DbUrlOption = None, url: ServiceUrlOption = None, token: TokenOption = None
) -> None:
    """Write the live best entries as JSON lines to stdout (first line: schema header)."""
    _refuse_two_targets(ctx, url)
    require_stdout()
    if url:
        _write_out(_checked_export(url, _service_request("GET", url, "/v1/export", token)).splitlines(keepends=True))
        return
    from sqlalchemy.exc import DBAPIError

    from tuning_db.engine import resolve_db_url, shown_url
    from tuning_db.store import export_jsonl

    engine = store_engine(db_url)
    try:
        _write_out(line + "\n" for line in export_jsonl(engine))
    except DBAPIError as error:  # the driver's text only, as import says it: the exception's own quotes the statement
        fail(f"--db-url {shown_url(resolve_db_url(db_url))}: {error.orig}")
    finally:
        engine.dispose()


def _write_out(lines: Iterable[str]) -> None:
    """`lines` to stdout, a write each, then flushed. One write of a whole export lost its tail
    without an error when the reader left during it (`cce export | head -1`, a consumer that
    died): CPython's write returned after the part the pipe took and the command exited 0, as
    if the export were whole. A write after that one fails (EPIPE), which exits 1. A disk that
    fills under a redirect (`> export.jsonl`) fails naming stdout."""
    try:
        for line in lines:
            sys.stdout.write(line)
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as error:
        fail(f"writing to stdout: {error.strerror or error}; the output there is cut short")


def import_command(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="a file written by `cce export`")],
    mode: Annotated[ImportMode, typer.Option(help="what to do when a key already has an entry")] = "keep_better",
    dry_run: Annotated[bool, typer.Option(help="report what would change, change nothing")] = False,
    db_url: DbUrlOption = None,
    url: ServiceUrlOption = None,
    token: TokenOption = None,
) -> None:
    """Import an export file (checked whole first; on PostgreSQL one transaction, on SQLite in
    batches of lines) and print the counts. The file is read a line at a time, each line's
    length bounded (tuning_db.store.read_lines); through --url it is sent as it is read, and
    the service refuses a body over its own limit (413) before importing anything."""
    _refuse_two_targets(ctx, url)
    from tuning_db.store import ImportFormatError

    try:
        stream = file.open("rb")
    except OSError as error:
        fail(f"{file}: {error.strerror or error}")
    with stream:
        try:
            if url:
                answer = _import_through_service(url, token, stream, mode, dry_run)
            else:
                answer = _import_into_database(db_url, stream, mode, dry_run)
        except ImportFormatError as error:
            fail(f"{file}: {error}" + ("" if error.lines_imported else "; nothing was imported"))
    typer.echo(answer)


def _import_through_service(url: str, token: str | None, stream: BinaryIO, mode: ImportMode, dry_run: bool) -> str:
    """The service's counts for the file, its lines POSTed as they are read (a chunked body). A
    line the reader refuses stops the upload mid-body: the service, which reads a body whole
    before importing, then imports nothing."""
    from tuning_db.store import read_lines

    params = {"mode": mode, "dry_run": str(dry_run).lower()}
    answer = _service_request("POST", url, "/v1/import", token, wait_for_answer=True, params=params,
                              content=_body_chunks(read_lines(stream)))
    return _checked_import_report(url, answer)


UPLOAD_CHUNK_BYTES = 2**16
"""How much of an import file is sent at once through --url."""


def _body_chunks(lines: Iterable[str]) -> Iterator[bytes]:
    """`lines` joined by \n, as UTF-8 in pieces of about UPLOAD_CHUNK_BYTES."""
    pieces: list[bytes] = []
    size = 0
    for index, line in enumerate(lines):
        piece = (line if index == 0 else "\n" + line).encode()
        pieces.append(piece)
        size += len(piece)
        if size >= UPLOAD_CHUNK_BYTES:
            yield b"".join(pieces)
            pieces, size = [], 0
    if pieces:
        yield b"".join(pieces)


def _import_into_database(db_url: str | None, stream: BinaryIO, mode: ImportMode, dry_run: bool) -> str:
    """The counts of an import into the database, as JSON."""
    from sqlalchemy.exc import DBAPIError

    from tuning_db.engine import resolve_db_url, shown_url
    from tuning_db.store import ImportInterrupted, ImportStopped, import_jsonl, read_lines

    engine = store_engine(db_url)
    try:
        with _progress_on_terminal("importing rows") as progress:
            report = import_jsonl(engine, read_lines(stream), mode=mode, dry_run=dry_run, progress=progress)
    except ImportInterrupted as error:
        fail(f"--db-url {shown_url(resolve_db_url(db_url))}: {error}")
    except ImportStopped as error:  # Ctrl-C's status, saying which lines stay
        fail(f"--db-url {shown_url(resolve_db_url(db_url))}: {error}", status=130)
    except DBAPIError as error:  # the driver's text only: the exception's own quotes the statement
        fail(f"--db-url {shown_url(resolve_db_url(db_url))}: {error.orig}")
    finally:
        engine.dispose()
    return json.dumps(report.model_dump())


@contextlib.contextmanager
def _progress_on_terminal(description: str) -> Iterator[Callable[[int, int], None] | None]:
    """A progress bar on stderr where it is a terminal (a PostgreSQL import of thousands of
    lines takes a minute), gone when the work ends; nothing in a log or a pipe."""
    from rich.console import Console

    console = Console(stderr=True)
    if not console.is_terminal:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn(description), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(description, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def register(app: typer.Typer) -> None:
    app.add_typer(db_app, name="db")
    app.command("export")(export_command)
    app.command("import")(import_command)
