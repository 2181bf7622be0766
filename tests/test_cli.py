"""The `cce` command as a user meets it, in real processes: every failure one line on stderr
with a non-zero exit (no traceback), `cce token`, `cce --version`, what `cce serve` says at
start, and the README's service example working as written."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import re
import socket
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cce_compile import __version__
from service.auth import parse_token_spec
from service.process import REPO_ROOT, free_port, serving
from tests.db_fixtures import bearer, measurement_data
from tests.http_servers import loopback_server

README = REPO_ROOT / "README.md"


def cce(*args: str, env: dict[str, str] | None = None, prelude: str = "", stdout_closed: bool = False,
        timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`cce ARGS` in a child process (after `prelude`, Python run first), in a scratch cache; with
    `stdout_closed`, started without a stdout, as by the shell's `>&-`. Past `timeout` seconds it
    is killed and subprocess.TimeoutExpired raised."""
    environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})}
    code = f"{prelude}\nimport sys\nfrom cce_compile.cli.main import app\nsys.argv = ['cce', *{list(args)!r}]\napp()"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment,
                          cwd=REPO_ROOT, timeout=timeout, preexec_fn=(lambda: os.close(1)) if stdout_closed else None)


def assert_one_line_failure(done: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert done.returncode != 0, done.stdout
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cce: error: "), done.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_version() -> None:
    done = cce("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"cce-compile {__version__}"


def test_token_prints_fresh_tokens_the_service_accepts() -> None:
    first, second = cce("token").stdout.strip(), cce("token").stdout.strip()
    assert first != second and len(first) >= 8
    entry = cce("token", "--scopes", "read,write").stdout.strip()
    assert parse_token_spec(f"{first}:read;{entry}")[first] == frozenset({"read"})
    misused = cce("token", "--scopes", "reed")
    assert_one_line_failure(misused, "--scopes", "unknown scope 'reed'")
    assert misused.returncode == 2  # a misused option, as docs/service.md says


def test_a_misused_option_is_one_line_with_status_2() -> None:
    for args in (["serve", "--port", "0"], ["token", "--bogus"], ["lookup", "--vocab", "1", "--hidden", "1",
                                                                  "--tokens", "1", "--dtype", "fp64"]):
        done = cce(*args)
        assert_one_line_failure(done, "(see --help)")
        assert done.returncode == 2


def test_an_unforeseen_failure_is_one_line_and_its_traceback_on_request() -> None:
    """A bug (here: the token source broken by the prelude) is one line naming the exception;
    CCE_TRACEBACK=1 shows the traceback for a report."""
    broken = "import secrets\nsecrets.token_urlsafe = None"
    assert_one_line_failure(cce("token", prelude=broken), "TypeError")
    shown = cce("token", prelude=broken, env={"CCE_TRACEBACK": "1"})
    assert shown.returncode != 0 and "Traceback" in shown.stderr


def test_db_upgrade_names_the_database_it_cannot_open_or_upgrade(tmp_path: Path) -> None:
    """A missing folder, a file that is not SQLite, tables made by something else, a newer
    release's schema: one line naming --db-url, and for the last no advice to upgrade it."""
    not_sqlite = tmp_path / "random.db"
    not_sqlite.write_bytes(bytes(range(256)) * 16)
    for path in (tmp_path / "no" / "such" / "dir" / "tuning.db", not_sqlite):
        assert_one_line_failure(cce("db", "upgrade", "--db-url", f"sqlite:///{path}"),
                                f"--db-url sqlite:///{path}: cannot open the database")
    foreign = tmp_path / "foreign.db"
    with sqlite3.connect(foreign) as connection:
        connection.execute("CREATE TABLE gpus (id INTEGER PRIMARY KEY)")
    assert_one_line_failure(cce("db", "upgrade", "--db-url", f"sqlite:///{foreign}"),
                            f"--db-url sqlite:///{foreign}: cannot upgrade the schema", "already exists")
    newer = tmp_path / "newer.db"
    assert cce("db", "upgrade", "--db-url", f"sqlite:///{newer}").returncode == 0
    with sqlite3.connect(newer) as connection:
        connection.execute("UPDATE alembic_version SET version_num = 'ffff9999'")
    for args in (["db", "upgrade"], ["export"], ["serve", "--port", str(free_port())]):
        done = cce(*args, "--db-url", f"sqlite:///{newer}")
        assert_one_line_failure(done, "schema ffff9999", "newer release", "upgrade cce_compile")
        assert "cce db upgrade" not in done.stderr


def test_a_database_whose_alembic_version_is_another_programs_is_named_without_sql(tmp_path: Path) -> None:
    """Another program's alembic_version table (other columns, several heads) failed upgrade,
    export and serve with the driver's text, the whole SELECT and Alembic's advice to call
    get_current_heads(), none naming --db-url; a database stamped at this code's revision but
    without its tables failed export with the whole SELECT."""
    other_columns, two_heads, stamped = tmp_path / "other.db", tmp_path / "heads.db", tmp_path / "stamped.db"
    with sqlite3.connect(other_columns) as connection:
        connection.execute("CREATE TABLE alembic_version (revision TEXT)")
    with sqlite3.connect(two_heads) as connection:
        connection.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)")
        connection.execute("INSERT INTO alembic_version VALUES ('a1'), ('b2')")
    for database in (other_columns, two_heads):
        for args in (["db", "upgrade"], ["export"], ["serve", "--port", str(free_port())]):
            done = cce(*args, "--db-url", f"sqlite:///{database}")
            assert_one_line_failure(done, f"--db-url sqlite:///{database}: cannot read its schema revision")
            assert "SELECT" not in done.stderr and "get_current_heads" not in done.stderr
    from tuning_db.migrate import head_revision

    with sqlite3.connect(stamped) as connection:
        connection.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)")
        connection.execute("INSERT INTO alembic_version VALUES (?)", (head_revision(),))
    done = cce("export", "--db-url", f"sqlite:///{stamped}")
    assert_one_line_failure(done, f"--db-url sqlite:///{stamped}", "has no table")
    assert "SELECT" not in done.stderr
    # another program's table of one row, at a revision this code has none of: the advice was
    # only to upgrade cce_compile
    foreign = tmp_path / "foreign.db"
    with sqlite3.connect(foreign) as connection:
        connection.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)")
        connection.execute("INSERT INTO alembic_version VALUES ('3f2a9c1b7d4e')")
    done = cce("db", "upgrade", "--db-url", f"sqlite:///{foreign}")
    assert_one_line_failure(done, "schema 3f2a9c1b7d4e", "upgrade cce_compile", "another program's")


def _another_alembic_projects_database(url: str, own_columns: bool) -> None:
    """Another Alembic project's database at its own first revision, whose id is this code's
    (0001): its own tables, or (`own_columns`) tables named as this store's with other columns."""
    from sqlalchemy import text

    from tuning_db.engine import make_engine

    engine = make_engine(url)
    with engine.begin() as connection:
        connection.execute(text("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)"))
        connection.execute(text("INSERT INTO alembic_version VALUES ('0001')"))
        for table in ("gpus", "measurements", "best_configs") if own_columns else ("users",):
            connection.execute(text(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, name VARCHAR(64))"))
    engine.dispose()


def test_another_alembic_projects_database_at_revision_0001_is_not_taken_as_ours(tmp_path: Path) -> None:
    """Its revision id is this code's first: `cce db upgrade` said 'at revision 0001' and created
    nothing, and export, import and serve then failed on tables it lacks. Each now names --db-url
    and what is missing, and leaves the database as it was."""
    from tests.db_fixtures import POSTGRES_URL, _require_postgres
    from tuning_db.scratch import scratch_schema

    export_file = tmp_path / "export.jsonl"
    export_file.write_text('{"format": "cce-tuning-db", "schema_version": 1, "entries": 0, "measurements": 0}\n')
    for own_columns, missing in ((False, "has no table gpus"), (True, "table gpus has no column compute_capability")):
        path = tmp_path / f"other-{own_columns}.db"
        _another_alembic_projects_database(f"sqlite:///{path}", own_columns)
        for args in (["db", "upgrade"], ["export"], ["import", str(export_file)], ["serve", "--port", str(free_port())]):
            done = cce(*args, "--db-url", f"sqlite:///{path}")
            assert_one_line_failure(done, f"--db-url sqlite:///{path}: its alembic_version says schema 0001", missing,
                                    "another program's database")
        with sqlite3.connect(path) as connection:
            tables = {row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert tables == ({"alembic_version", "gpus", "measurements", "best_configs"} if own_columns
                          else {"alembic_version", "users"})
    _require_postgres()
    with scratch_schema(POSTGRES_URL, prefix="cce_test_foreign") as url:
        _another_alembic_projects_database(url, own_columns=False)
        done = cce("db", "upgrade", "--db-url", url)
        assert_one_line_failure(done, "--db-url postgresql", "its alembic_version says schema 0001", "has no table gpus")


def test_a_bad_token_spec_stops_serve_in_one_line(tmp_path: Path) -> None:
    done = cce("serve", "--port", str(free_port()), env={"CCE_SERVICE_TOKENS": "short:read"})
    assert_one_line_failure(done, "CCE_SERVICE_TOKENS", "8+", "cce token")
    for tokens_file in (tmp_path, tmp_path / "missing"):
        done = cce("serve", "--port", str(free_port()), env={"CCE_SERVICE_TOKENS_FILE": str(tokens_file)})
        assert_one_line_failure(done, f"CCE_SERVICE_TOKENS_FILE: cannot read {tokens_file}")


def test_a_tokens_file_that_is_not_utf8_stops_serve_naming_the_file_variable(tmp_path: Path) -> None:
    """It was reported as a malformed entry of CCE_SERVICE_TOKENS/CCE_SERVICE_TOKENS_FILE, with
    `cce token`'s advice, though the file's entries were never read."""
    tokens_file = tmp_path / "tokens"
    tokens_file.write_bytes("admin-token-0001:admin # r\u00e9seau\n".encode("latin-1"))
    done = cce("serve", "--port", str(free_port()), env={"CCE_SERVICE_TOKENS_FILE": str(tokens_file)})
    assert_one_line_failure(done, f"CCE_SERVICE_TOKENS_FILE: {tokens_file} is not UTF-8 text", "offset 26")
    assert "CCE_SERVICE_TOKENS/" not in done.stderr and "cce token" not in done.stderr
    tokens_file.write_bytes(b"\xef\xbb\xbf" + tokens_file.read_bytes())  # after a byte order mark, counted in
    done = cce("serve", "--port", str(free_port()), env={"CCE_SERVICE_TOKENS_FILE": str(tokens_file)})
    assert_one_line_failure(done, f"CCE_SERVICE_TOKENS_FILE: {tokens_file} is not UTF-8 text", "byte 0xe9 at offset 29")


def test_a_token_listed_twice_stops_serve_in_one_line(tmp_path: Path) -> None:
    """A read token in CCE_SERVICE_TOKENS listed again as admin in the tokens file was one admin
    token ('1 token(s)'), the later entry silently winning: the line names it, not its secret."""
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text("node-token-0001:admin\n")
    for env in ({"CCE_SERVICE_TOKENS": "node-token-0001:read", "CCE_SERVICE_TOKENS_FILE": str(tokens_file)},
                {"CCE_SERVICE_TOKENS": "node-token-0001:read;node-token-0001:read"}):
        done = cce("serve", "--port", str(free_port()), "--db-url", f"sqlite:///{tmp_path / 'tuning.db'}", env=env)
        assert_one_line_failure(done, "token node... is listed more than once")
        assert "node-token-0001" not in done.stderr


def test_tokens_and_scopes_are_checked_where_they_are_given() -> None:
    """`--scopes 'read;admin'` once failed on the token's length; `--token` with a non-ASCII
    character raised UnicodeEncodeError from the HTTP client."""
    for scopes in ("read;admin", "read#x"):
        assert_one_line_failure(cce("token", "--scopes", scopes), "--scopes", "unknown scope")
    done = cce("export", "--url", f"http://127.0.0.1:{free_port()}", "--token", "t\u00f6k\u00e9n-token")
    assert_one_line_failure(done, "--token", "ASCII")
    assert done.returncode == 2  # a misused option, as `cce tune`'s non-ASCII token


def test_a_bad_setting_stops_serve_in_one_line() -> None:
    """Named by its variable; an empty tokens file name once read '.' ('cannot read .: Is a directory')."""
    done = cce("serve", "--port", str(free_port()), env={"CCE_SERVICE_TOKENS_FILE": ""})
    assert_one_line_failure(done, "CCE_SERVICE_TOKENS_FILE: is empty")
    done = cce("serve", "--port", str(free_port()), env={"CCE_SERVICE_MAX_BODY_BYTES": "lots"})
    assert_one_line_failure(done, "CCE_SERVICE_MAX_BODY_BYTES", "valid integer")


def test_serve_stops_in_one_line_on_a_port_in_use(tmp_path: Path) -> None:
    """Not uvicorn's error among its start-up lines and exit status 3."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = cce("serve", "--port", str(port), "--db-url", f"sqlite:///{tmp_path / 'tuning.db'}")
    assert_one_line_failure(done, f"cannot listen on 127.0.0.1:{port}")
    assert done.returncode == 1


def test_serve_stops_in_one_line_on_a_database_it_cannot_open(tmp_path: Path) -> None:
    """Not ~145 lines of uvicorn's and SQLAlchemy's traceback from the app's start-up upgrade."""
    not_sqlite = tmp_path / "random.db"
    not_sqlite.write_bytes(bytes(range(256)) * 16)
    for path in (tmp_path / "no" / "such" / "dir" / "tuning.db", Path("/proc/tuning.db"), not_sqlite):
        done = cce("serve", "--port", str(free_port()), "--db-url", f"sqlite:///{path}")
        assert_one_line_failure(done, f"--db-url sqlite:///{path}: cannot open the database")
        assert done.returncode == 1


def test_serve_refuses_an_in_memory_database(tmp_path: Path) -> None:
    """Each connection would get its own empty database: the service started, answered 503
    forever, and advised `cce db upgrade`, which could not help."""
    for url in ("sqlite://", "sqlite:///:memory:", "sqlite:///file::memory:?uri=true",
                "sqlite:///file:shared?mode=memory&cache=shared&uri=true"):
        done = cce("serve", "--port", str(free_port()), "--db-url", url)
        assert_one_line_failure(done, "Invalid value for --db-url", "in-memory")
        assert done.returncode == 2


def test_db_commands_refuse_an_in_memory_database(tmp_path: Path) -> None:
    """`cce db upgrade --db-url sqlite://` said 'tuning database at revision 0001' and kept
    nothing; export and import then said 'no schema; run `cce db upgrade --db-url sqlite://`',
    which sent the user round the same loop."""
    export_file = tmp_path / "export.jsonl"
    export_file.write_text('{"format": "cce-tuning-db", "schema_version": 1, "entries": 0, "measurements": 0}\n')
    for url in ("sqlite://", "sqlite:///:memory:", "sqlite:///file:shared?mode=memory&cache=shared&uri=true"):
        for args in (["db", "upgrade"], ["export"], ["import", str(export_file)]):
            done = cce(*args, "--db-url", url)
            assert_one_line_failure(done, "Invalid value for --db-url", "in-memory")
            assert done.returncode == 2
            assert "revision" not in done.stdout + done.stderr


def test_in_memory_reads_sqlite_urls_as_the_driver_does() -> None:
    """A URI with an empty path is a temporary database that keeps nothing; ':memory:' inside a
    file's name, or mode=memory where uri is false (the query then goes unread), is a file."""
    from tuning_db.engine import in_memory

    keeps_nothing = ("sqlite://", "sqlite:///:memory:", "sqlite:///file::memory:?uri=true", "sqlite:///file:?uri=true",
                     "sqlite:///file:x.db?mode=memory&uri=1", "sqlite:///?uri=true")
    files = ("sqlite:///x.db", "sqlite:///file:a:memory:b.db?uri=true", "sqlite:///x.db?uri=false&mode=memory",
             "sqlite:///file:x.db?mode=ro&uri=true", "sqlite:////tmp/x.db", "sqlite:///file:///tmp/x.db?uri=true",
             "postgresql://u@h/db")
    assert [url for url in keeps_nothing if not in_memory(url)] == []
    assert [url for url in files if in_memory(url)] == []


def test_export_and_import_name_a_database_without_schema_and_create_none(tmp_path: Path) -> None:
    """A mistyped SQLite path is not created, and neither it nor a database never upgraded
    fails with the driver's text and the SQL statement: the line says to run `cce db upgrade`."""
    typo = tmp_path / "typo.db"
    assert_one_line_failure(cce("export", "--db-url", f"sqlite:///{typo}"), f"cce db upgrade --db-url sqlite:///{typo}")
    assert not typo.exists()
    empty = tmp_path / "empty.db"
    empty.touch()
    export_file = tmp_path / "export.jsonl"
    export_file.write_text('{"format": "cce-tuning-db", "schema_version": 1, "entries": 0, "measurements": 0}\n')
    for args in (["export"], ["import", str(export_file)]):
        done = cce(*args, "--db-url", f"sqlite:///{empty}")
        assert_one_line_failure(done, "has no schema", f"run `cce db upgrade --db-url sqlite:///{empty}`")
        assert "SELECT" not in done.stderr and "INSERT" not in done.stderr


def test_export_and_import_create_no_database_named_as_a_uri(tmp_path: Path) -> None:
    """A mistyped path in a `file:` URI was created, empty, and then said to have no schema (the
    missing-file check skipped every URI); mode=rwc is the driver's default, no request to create."""
    typo = tmp_path / "typo.db"
    export_file = tmp_path / "export.jsonl"
    export_file.write_text('{"format": "cce-tuning-db", "schema_version": 1, "entries": 0, "measurements": 0}\n')
    for url in (f"sqlite:///file:{typo}?uri=true", f"sqlite:///file://localhost{typo}?mode=rwc&uri=true",
                f"sqlite:///file:{typo}?mode=ro&uri=true"):
        for args in (["export"], ["import", str(export_file)]):
            assert_one_line_failure(cce(*args, "--db-url", url), "no such SQLite database", "cce db upgrade --db-url")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["export.jsonl"]


def test_sqlite_file_reads_uris_as_the_driver_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The file each URL names is the one connecting creates: a `file:` URI's path after an empty
    or localhost authority, without its query or fragment, percent-decoded; a URI without `file:`
    is a plain name, the query SQLAlchemy passes on included."""
    from tuning_db.engine import make_engine, sqlite_file

    monkeypatch.chdir(tmp_path)
    names = {f"sqlite:///file:{tmp_path}/typo.db?uri=true": "typo.db",
             f"sqlite:///file://localhost{tmp_path}/a%2520b.db?uri=true": "a b.db",
             f"sqlite:///file://{tmp_path}/f.db%23x?cache=shared&uri=true": "f.db",
             "sqlite:///file:relative.db?mode=rwc&uri=1": "relative.db",
             "sqlite:///plain.db?mode=rwc&uri=true": "plain.db?mode=rwc",
             "sqlite:///file:no.db?uri=false": "file:no.db"}
    for url, name in names.items():
        path = sqlite_file(url)
        assert path is not None and path.absolute() == tmp_path / name and not path.exists(), url
        engine = make_engine(url)
        engine.connect().close()
        engine.dispose()
        assert path.is_file(), url
    assert sqlite_file(f"sqlite:///file://elsewhere{tmp_path}/x.db?uri=true") is None  # SQLite refuses it
    assert sqlite_file("sqlite:///file::memory:?uri=true") is None


def test_an_empty_db_url_is_refused_not_the_default_database(tmp_path: Path) -> None:
    done = cce("export", "--db-url", "", env={"XDG_CACHE_HOME": str(tmp_path)})
    assert_one_line_failure(done, "--db-url", "empty")
    assert done.returncode == 2


def test_a_default_database_folder_that_cannot_be_made_says_how_to_name_another(tmp_path: Path) -> None:
    """XDG_CACHE_HOME naming a file: the default SQLite file's folder cannot be made, and the
    commands failed with a bare 'FileExistsError: [Errno 17] File exists' that named no way out."""
    (tmp_path / "file").touch()
    environment = {"XDG_CACHE_HOME": str(tmp_path / "file"), "CCE_TUNING_DB_URL": ""}
    for args in (["export"], ["db", "upgrade"], ["serve", "--port", "18777"]):
        done = cce(*args, env=environment)
        assert_one_line_failure(done, "the default database's folder cannot be made", str(tmp_path / "file"),
                                "--db-url or CCE_TUNING_DB_URL")


def test_a_db_url_whose_driver_is_missing_names_the_option(tmp_path: Path) -> None:
    """A dialect SQLAlchemy knows whose driver is not installed: one line naming --db-url and the
    module, before serve, db or export touches anything; a scheme with no dialect is a bad option."""
    for args in (["export"], ["db", "upgrade"], ["serve"]):
        done = cce(*args, "--db-url", "mysql://someone@127.0.0.1/tuning")
        assert_one_line_failure(done, "--db-url mysql://someone@127.0.0.1/tuning", "driver is not installed", "MySQLdb")
        assert done.returncode == 1
        done = cce(*args, "--db-url", "nosuchdb://127.0.0.1/tuning")
        assert_one_line_failure(done, "Invalid value for --db-url", "nosuchdb")
        assert done.returncode == 2


def test_empty_service_url_and_host_are_refused_not_a_fallback(tmp_path: Path) -> None:
    """An unset shell variable must not import into the local database instead of the service,
    look up the op's ladder instead of the service, nor make the service listen on every interface."""
    local = tmp_path / "local.db"
    assert cce("db", "upgrade", "--db-url", f"sqlite:///{local}").returncode == 0
    export_file = tmp_path / "export.jsonl"
    export_file.write_text(cce("export", "--db-url", f"sqlite:///{local}").stdout)
    for args in (["import", str(export_file), "--url", ""], ["export", "--url", " "],
                 ["lookup", "--vocab", "64", "--hidden", "16", "--tokens", "16", "--url", ""],
                 ["serve", "--host", "", "--db-url", f"sqlite:///{local}"]):
        done = cce(*args, env={"CCE_TUNING_DB_URL": f"sqlite:///{local}"})
        assert_one_line_failure(done, "--url" if "--url" in args else "--host", "empty")
        assert done.returncode == 2


def test_a_bad_log_level_names_the_option_and_the_levels() -> None:
    done = cce("serve", "--port", str(free_port()), "--log-level", "bogus")
    assert_one_line_failure(done, "--log-level", "'warning'")
    assert done.returncode == 2


def test_a_bad_import_file_is_one_clipped_line_naming_the_file(tmp_path: Path) -> None:
    """Not UTF-8, or a line of 3,000 unknown keys (50,000 once made a 2 MB line of stderr; a line
    that long is now refused by its length)."""
    database = f"sqlite:///{tmp_path / 'tuning.db'}"
    assert cce("db", "upgrade", "--db-url", database).returncode == 0
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b'{"format": "cce-tuning-db"}\n\xff\xfe\x00garbage\n')
    assert_one_line_failure(cce("import", str(binary), "--db-url", database), str(binary), "not UTF-8",
                            "nothing was imported")
    header = '{"format": "cce-tuning-db", "schema_version": 1, "entries": 1, "measurements": 1}'
    many_keys = tmp_path / "many.jsonl"
    many_keys.write_text(header + "\n" + json.dumps({f"key{i}": i for i in range(3_000)}) + "\n")
    done = cce("import", str(many_keys), "--db-url", database)
    assert_one_line_failure(done, str(many_keys), "line 2", "more", "nothing was imported")
    assert len(done.stderr) < 5000


def test_a_byte_that_is_not_utf8_far_into_an_import_file_names_its_line_and_offset(tmp_path: Path) -> None:
    """The byte was named by its offset in the text decoder's chunk (byte 1924 for 100228), and
    no line."""
    database = f"sqlite:///{tmp_path / 'tuning.db'}"
    assert cce("db", "upgrade", "--db-url", database).returncode == 0
    header = {"format": "cce-tuning-db", "schema_version": 1, "entries": 300, "measurements": 300}
    lines = [json.dumps(header)] + [
        json.dumps(measurement_data(V=v, measurement_uid=f"{v:032x}", created_at="2026-01-01T00:00:00Z"))
        for v in range(1, 301)
    ]
    data = "".join(line + "\n" for line in lines).encode()
    offset = len("".join(line + "\n" for line in lines[:249])) + 10  # inside line 250
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(data[:offset] + b"\xff" + data[offset + 1 :])
    assert_one_line_failure(cce("import", str(bad), "--db-url", database), str(bad), "line 250",
                            f"byte {offset} of the file", "not UTF-8", "nothing was imported")


ADMIN_TOKEN = "admin-token-0003"

MEMORY_CAP = "import resource\nresource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, 2 * 2**30))"
"""A prelude for a child that might read without end: a MemoryError at 2 GiB, not the machine's
memory taken."""


def _export_text(entries: int, line_break: str = "\n") -> str:
    """An export file of `entries` lines (about 700 bytes each), each ended by `line_break`."""
    from tuning_db.records import ExportHeader

    lines = [json.dumps(measurement_data(V=v, measurement_uid=f"{v:032x}", created_at="2026-01-01T00:00:00Z"))
             for v in range(1, entries + 1)]
    header = ExportHeader(entries=entries, measurements=entries).model_dump_json()
    return "".join(line + line_break for line in [header, *lines])


def _exported_entries(database: str) -> int:
    done = cce("export", "--db-url", database)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[0])["entries"]


def _import_targets(base_url: str, database: str) -> dict[str, list[str]]:
    return {"--db-url": ["--db-url", database], "--url": ["--url", base_url, "--token", ADMIN_TOKEN]}


def test_an_import_of_a_file_without_line_breaks_stops_at_a_line_s_bound(tmp_path: Path) -> None:
    """`cce import /dev/zero` read the whole file before checking a byte, without end (and a
    multi-GB file into memory), directly and through --url alike. A line is now refused once
    it has gone four times MAX_RECORD_CHARS bytes without a line break."""
    from tuning_db.records import MAX_RECORD_CHARS

    database = f"sqlite:///{tmp_path / 'tuning.db'}"
    assert cce("db", "upgrade", "--db-url", database).returncode == 0
    with serving(tmp_path / "serve.log", "--db-url", database, env={"CCE_SERVICE_TOKENS": f"{ADMIN_TOKEN}:admin"}) \
            as base_url:
        for target, args in _import_targets(base_url, database).items():
            done = cce("import", "/dev/zero", *args, prelude=MEMORY_CAP, timeout=60)
            assert_one_line_failure(done, "/dev/zero: line 1: no line break in its first",
                                    f"at most {MAX_RECORD_CHARS} characters", "nothing was imported")
            assert done.stdout == "", target
    assert _exported_entries(database) == 0


def test_an_over_long_line_is_refused_as_it_is_read_not_once_the_file_ends(tmp_path: Path) -> None:
    """A line over MAX_RECORD_CHARS characters was refused only after the whole file was read:
    from a pipe whose writer is still open, never. It is refused once read, naming the file, its
    line and the bound, directly and through --url."""
    import fcntl

    from tuning_db.records import MAX_RECORD_CHARS

    database = f"sqlite:///{tmp_path / 'tuning.db'}"
    assert cce("db", "upgrade", "--db-url", database).returncode == 0
    data = (_export_text(1).splitlines()[0] + "\n" + "x" * 100_000 + "\n").encode()
    regular = tmp_path / "long.jsonl"
    regular.write_bytes(data)
    with serving(tmp_path / "serve.log", "--db-url", database, env={"CCE_SERVICE_TOKENS": f"{ADMIN_TOKEN}:admin"}) \
            as base_url:
        for target, args in _import_targets(base_url, database).items():
            done = cce("import", str(regular), *args, timeout=60)
            assert_one_line_failure(done, f"{regular}: line 2: line of 100000 characters",
                                    f"at most {MAX_RECORD_CHARS}", "nothing was imported")
            fifo = tmp_path / f"{target.strip('-')}.fifo"
            os.mkfifo(fifo)
            # Read and write: opening never waits for the child, and the pipe stays open after
            # the data, as a writer that has more to come keeps it.
            writer = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
            try:
                fcntl.fcntl(writer, fcntl.F_SETPIPE_SZ, 2**18)
                assert os.write(writer, data) == len(data)
                done = cce("import", str(fifo), *args, prelude=MEMORY_CAP, timeout=60)
            finally:
                os.close(writer)
            assert_one_line_failure(done, f"{fifo}: line 2: line of 100000 characters", "nothing was imported")
    assert _exported_entries(database) == 0


def test_an_import_read_and_sent_in_pieces_stores_every_line(tmp_path: Path) -> None:
    """A file of 300 lines (160 KB: several pieces read, several sent) ended by CR LF is imported
    whole directly and through --url; a service refuses a body over its
    CCE_SERVICE_MAX_BODY_BYTES in one line (413), importing nothing."""
    export_file = tmp_path / "export.jsonl"
    export_file.write_bytes(_export_text(300, "\r\n").encode())
    assert export_file.stat().st_size > 2 * 2**16
    local, served = (f"sqlite:///{tmp_path / name}" for name in ("local.db", "served.db"))
    for database in (local, served):
        assert cce("db", "upgrade", "--db-url", database).returncode == 0
    tokens = {"CCE_SERVICE_TOKENS": f"{ADMIN_TOKEN}:admin"}
    with serving(tmp_path / "serve.log", "--db-url", served, env=tokens) as base_url:
        for database, args in ((local, ["--db-url", local]), (served, ["--url", base_url, "--token", ADMIN_TOKEN])):
            done = cce("import", str(export_file), *args)
            assert done.returncode == 0, done.stderr
            assert json.loads(done.stdout)["entries_added"] == 300
            assert _exported_entries(database) == 300
    small = tmp_path / "small.db"
    with serving(tmp_path / "small.log", "--db-url", f"sqlite:///{small}",
                 env={**tokens, "CCE_SERVICE_MAX_BODY_BYTES": "16384"}) as base_url:
        done = cce("import", str(export_file), "--url", base_url, "--token", ADMIN_TOKEN)
        assert_one_line_failure(done, "413", "request body is larger than 16384 bytes")
    assert _exported_entries(f"sqlite:///{small}") == 0


def test_lookup_refuses_what_the_service_refuses() -> None:
    """The service's bounds and GPU name rules (tuning_db.records), not a heuristic config."""
    problem = {"--gpu": "NVIDIA H100 80GB HBM3", "--vocab": "128256", "--hidden": "4096", "--tokens": "8192"}
    for option, value in (("--gpu", ""), ("--gpu", "\u2603"), ("--gpu", "___"), ("--vocab", "99999999999"),
                          ("--hidden", str(2**20 + 1)), ("--tokens", str(2**40 + 1))):
        done = cce("lookup", *(part for item in {**problem, option: value}.items() for part in item))
        assert_one_line_failure(done, f"Invalid value for {option}")
        assert done.returncode == 2


@contextlib.contextmanager
def _answering(body: bytes = b"<html><body>Sign in</body></html>", content_type: str = "text/html") -> Iterator[str]:
    """A real HTTP server on a loopback port that answers every GET with 200 and `body` (by
    default a login page's HTML)."""

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:  # a login page answers a form's POST with itself
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.do_GET()

        def log_message(self, *args: object) -> None:
            pass

    with loopback_server(Page) as url:
        yield url


def test_lookup_of_a_named_service_it_cannot_ask_is_one_line_not_the_heuristic(tmp_path: Path) -> None:
    """`--url` once printed the heuristic's config with exit 0 when the service refused the token,
    was not there or was not HTTP, a log line the only hint; without --url the op's ladder still
    passes such a service by."""
    problem = ["lookup", "--gpu", "NVIDIA H100 80GB HBM3", "--vocab", "128256", "--hidden", "4096", "--tokens", "8192",
               "--json"]
    dead = f"http://127.0.0.1:{free_port()}"
    scratch = {"CCE_CONFIG_CACHE_DIR": str(tmp_path / "configs"), "CCE_TUNING_URL": "", "CCE_TUNING_TOKEN": ""}
    with serving(tmp_path / "serve.log", "--db-url", f"sqlite:///{tmp_path / 'tuning.db'}",
                 env={"CCE_SERVICE_TOKENS": "read-token-0001:read"}) as base_url:
        answered = cce(*problem, "--url", base_url, env={**scratch, "CCE_TUNING_TOKEN": "read-token-0001"})
        assert answered.returncode == 0 and json.loads(answered.stdout)["match_level"] == "none", answered.stderr
        with _answering() as other_server:  # a login page, another app behind the URL
            for url, token, reason in ((base_url, "", "HTTP 401"), (base_url, "wrong-token-123", "unknown token"),
                                       (dead, "", "ConnectError"),
                                       (other_server, "", "answered no JSON object")):
                done = cce(*problem, "--url", url, env={**scratch, "CCE_TUNING_TOKEN": token})
                said = "the service" if reason.startswith("answered") else "cannot ask the service"
                assert_one_line_failure(done, f"--url {url}: {said}", reason)
                assert done.stdout == ""
    ladder = cce(*problem, env={**scratch, "CCE_TUNING_URL": dead})
    assert ladder.returncode == 0 and json.loads(ladder.stdout)["source"] == "heuristic", ladder.stderr


def test_lookup_of_a_named_service_answering_a_config_it_refuses_is_one_line_not_the_heuristic(
    tmp_path: Path,
) -> None:
    """A stored config today's rules refuse (num_warps 3, stored before a rule existed): `--url`
    printed the heuristic's config with exit 0, `"source": "heuristic"`, as if the service held
    nothing; a log line the only hint. Without --url the op's ladder still passes it by."""
    from cce_compile.resolve.platform import kernel_version, triton_version

    database = tmp_path / "tuning.db"
    problem = ["lookup", "--gpu", "NVIDIA H100 80GB HBM3", "--vocab", "128256", "--hidden", "4096", "--tokens", "8192",
               "--json"]
    scratch = {"CCE_CONFIG_CACHE_DIR": str(tmp_path / "configs"), "CCE_TUNING_TOKEN": "write-token-001"}
    with serving(tmp_path / "serve.log", "--db-url", f"sqlite:///{database}",
                 env={"CCE_SERVICE_TOKENS": "write-token-001:read,write"}) as base_url:
        body = measurement_data(kernel_version=kernel_version(), triton_version=triton_version())
        assert httpx.post(f"{base_url}/v1/measurements", json=body, headers=bearer("write-token-001")).status_code == 201
        answered = cce(*problem, "--url", base_url, env=scratch)
        assert answered.returncode == 0 and json.loads(answered.stdout)["source"] == "service", answered.stderr
        with sqlite3.connect(database) as connection:
            config = json.loads(connection.execute("SELECT config FROM measurements").fetchone()[0])
            config["forward"]["num_warps"] = 3
            connection.execute("UPDATE measurements SET config = ?", (json.dumps(config),))
        done = cce(*problem, "--url", base_url, env=scratch)
        assert_one_line_failure(done, f"--url {base_url}: the service answered a config (exact match) this client refuses",
                                "forward.num_warps")
        assert done.returncode == 1 and done.stdout == ""
        ladder = cce(*problem, env={**scratch, "CCE_TUNING_URL": base_url})
        assert ladder.returncode == 0 and json.loads(ladder.stdout)["source"] == "heuristic", ladder.stderr


PASSWORD, TOKEN = "pw-s3cret-1", "tok-s3cret-2"


def test_a_url_in_an_error_or_a_log_line_shows_no_password_or_token(tmp_path: Path) -> None:
    """A URL given with a password (http://user:password@host, postgresql://user:password@host,
    ?password=, ?token=) was printed as given in one-line errors and the op's log line: into
    terminals, CI logs and bug reports. Each shows *** instead, and the rest of the URL, which
    says which one failed."""
    from cce_compile.cli.serve import startup_report
    from service.settings import ServiceSettings

    port = free_port()
    http_url, http_shown = f"http://tuner:{PASSWORD}@127.0.0.1:{port}", f"http://tuner:***@127.0.0.1:{port}"
    problem = ["lookup", "--gpu", "NVIDIA H100 80GB HBM3", "--vocab", "128256", "--hidden", "4096", "--tokens", "8192",
               "--json"]
    scratch = {"CCE_CONFIG_CACHE_DIR": str(tmp_path / "configs"), "CCE_TUNING_TOKEN": "", "CCE_TUNING_URL": ""}
    postgres = f"postgresql+psycopg://postgres:{PASSWORD}@127.0.0.1:{port}/test"
    postgres_query = f"postgresql+psycopg://postgres@127.0.0.1:{port}/test?sslmode=disable&password={PASSWORD}"
    export_file = tmp_path / "export.jsonl"
    export_file.write_text('{"format": "cce-tuning-db", "schema_version": 1, "entries": 0, "measurements": 0}\n')
    failures = (
        ([*problem, "--url", f"{http_url}/?token={TOKEN}"],
         f"--url {http_shown}/?token=***: cannot ask the service"),
        (["export", "--url", http_url], f"GET {http_shown}/v1/export: ConnectError"),
        (["import", str(export_file), "--url", f"{http_url}/?access_token={TOKEN}"],
         f"POST {http_shown}/?access_token=***: ConnectError"),  # the value hides the path appended after it
        (["export", "--db-url", postgres], f"--db-url postgresql+psycopg://postgres:***@127.0.0.1:{port}/test: "
                                           "cannot open the database"),
        (["db", "upgrade", "--db-url", postgres_query],
         f"--db-url postgresql+psycopg://postgres@127.0.0.1:{port}/test?password=***&sslmode=disable: cannot open"),
    )
    for args, fragment in failures:
        done = cce(*args, env=scratch)
        assert_one_line_failure(done, fragment)
        assert PASSWORD not in done.stderr + done.stdout and TOKEN not in done.stderr + done.stdout, done.stderr
    logged = cce(*problem, env={**scratch, "CCE_TUNING_URL": f"{http_url}/?token={TOKEN}"})  # the op's ladder
    assert logged.returncode == 0 and json.loads(logged.stdout)["source"] == "heuristic", logged.stderr
    assert f"tuning service {http_shown}/?token=*** unusable" in logged.stderr, logged.stderr
    assert PASSWORD not in logged.stderr and TOKEN not in logged.stderr, logged.stderr
    report = startup_report(ServiceSettings(db_url=postgres_query), postgres_query)
    assert report[0] == f"database postgresql+psycopg://postgres@127.0.0.1:{port}/test?password=***&sslmode=disable"


def test_tune_checks_where_it_writes_before_tuning(tmp_path: Path) -> None:
    """The files are written after the whole run: a bad path must stop it first (a dry run too)."""
    problem = ["tune", "--vocab", "64", "--hidden", "16", "--tokens", "16", "--dry-run"]
    for option in ("--out", "--bundle"):
        done = cce(*problem, option, str(tmp_path / "no" / "such" / "dir" / "x.json"))
        assert_one_line_failure(done, f"Invalid value for {option}", str(tmp_path / "no" / "such" / "dir"))
        assert done.returncode == 2
    assert_one_line_failure(cce(*problem, "--out", str(tmp_path)), "--out", "is a directory")


def test_tune_refuses_a_problem_it_cannot_tune_or_publish_before_the_plan() -> None:
    """A problem outside the tuning database's bounds (those `cce lookup` refuses) was tuned, on
    the GPU's time, and then every measurement refused; D = 1 was tuned on NaN inputs (the LM-like
    inputs need a second direction), every candidate dropped, and the run exited 0; a seed torch
    cannot take failed after the plan as 'ValueError: Overflow when unpacking long long'."""
    problem = {"--vocab": "64", "--hidden": "16", "--tokens": "16"}
    for option, value, says in (
        ("--vocab", str(2**31), "less than or equal to 2147483647"),
        ("--hidden", str(2**20 + 1), "less than or equal to 1048576"),
        ("--tokens", str(2**40 + 1), "less than or equal to 1099511627776"),
        ("--hidden", "1", "the tuner's LM-like inputs need a hidden size of 2 at least"),
        ("--seed", str(2**64), "less than or equal to 9223372036854775807"),
        ("--budget-s", "inf", "inf is not a finite number"),  # never ended, and wrote Infinity into --out
    ):
        args = (part for item in {**problem, option: value}.items() for part in item)
        done = cce("tune", *args, "--dry-run")
        assert_one_line_failure(done, "Invalid value for", option, says)
        assert done.returncode == 2 and "cce tune plan" not in done.stdout
    negative_seed = cce("tune", *(part for item in problem.items() for part in item), "--seed", "-1", "--dry-run")
    assert negative_seed.returncode == 0 and "cce tune plan" in negative_seed.stderr, negative_seed.stderr


def test_bench_checks_its_shapes_and_out_before_importing_torch(tmp_path: Path) -> None:
    """A shape or an --out that cannot be used is refused without torch (seconds to import, and
    what a broken install fails on); the error names the option (it said `Invalid value: shape`)."""
    no_torch = "import sys\nsys.modules['torch'] = None"
    done = cce("bench", "--shapes", "0x1x1", prelude=no_torch)
    assert_one_line_failure(done, "Invalid value for --shapes: shape '0x1x1': N, D and V must each be at least 1")
    assert done.returncode == 2
    (tmp_path / "file").touch()
    done = cce("bench", "--out", str(tmp_path / "file"), prelude=no_torch)
    assert_one_line_failure(done, "Invalid value for --out", "is not a folder")
    assert done.returncode == 2
    for option, value in (("--rep-ms", "inf"), ("--warmup-ms", "inf"), ("--budget-s", "inf")):
        done = cce("bench", option, value, prelude=no_torch)  # a timing or budget that never ends
        assert_one_line_failure(done, f"Invalid value for '{option}'", f"{value} is not a finite number")
        assert done.returncode == 2


def test_the_gpu_commands_run_alone_fail_as_cce_does(tmp_path: Path) -> None:
    """`python -m cce_compile.cli.bench` and `...cli.tune` (what GPU machines run, docs/performance.md)
    fail in one line too: a misused option with status 2, an unforeseen error with status 1."""
    environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}

    def alone(module: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", f"cce_compile.cli.{module}", *args], capture_output=True,
                              text=True, env=environment, cwd=tmp_path, timeout=120)

    done = alone("tune", "--vocab", "64", "--hidden", "16", "--tokens", "16", "--dry-run",
                 "--out", str(tmp_path / "no" / "such" / "x.json"))
    assert_one_line_failure(done, "Invalid value for --out", "(see --help)")
    assert done.returncode == 2
    (tmp_path / "bench.csv").write_text("a,b\n1,2\n")
    done = alone("bench", "--render", "--out", str(tmp_path))
    assert_one_line_failure(done, f"--render: {tmp_path / 'bench.csv'} does not have the results columns")
    assert done.returncode == 1 and "ValueError" not in done.stderr


def test_export_and_lookup_with_stdout_closed_say_so_in_one_line(tmp_path: Path) -> None:
    """`cce export >&-` failed as `AttributeError: 'NoneType' object has no attribute 'write'`, and
    `cce lookup >&-` exited 0 having printed its answer nowhere; each now stops before it opens
    a database or asks a service."""
    database = tmp_path / "tuning.db"
    assert cce("db", "upgrade", "--db-url", f"sqlite:///{database}").returncode == 0
    for args in (["export", "--db-url", f"sqlite:///{database}"], ["export", "--url", f"http://127.0.0.1:{free_port()}"],
                 ["lookup", "--vocab", "1000", "--hidden", "64", "--tokens", "100", "--gpu", "NVIDIA H100"],
                 ["lookup", "--vocab", "1000", "--hidden", "64", "--tokens", "100", "--gpu", "NVIDIA H100", "--json"]):
        done = cce(*args, stdout_closed=True)
        assert_one_line_failure(done, "stdout is closed")
        assert done.returncode == 1
    assert cce("export", "--db-url", f"sqlite:///{database}").stdout.startswith('{"format":"cce-tuning-db"')


def test_an_export_whose_reader_leaves_does_not_exit_0(tmp_path: Path) -> None:
    """`cce export | head -1`, or a consumer that died: the export was one write, which returned
    after the part the pipe took when its reader left, and the command exited 0 as if it had
    written the whole export (a backup cut short looked whole). Its status is now 1."""
    from tests.db_fixtures import measurement
    from tuning_db.engine import make_engine
    from tuning_db.store import record_measurement

    url = f"sqlite:///{tmp_path / 'tuning.db'}"
    assert cce("db", "upgrade", "--db-url", url).returncode == 0
    engine = make_engine(url)
    for vocab in range(1000, 1300):  # ~280 KB of export: more than a pipe holds
        record_measurement(engine, measurement(V=vocab))
    engine.dispose()
    code = f"import sys\nfrom cce_compile.cli.main import app\nsys.argv = ['cce', 'export', '--db-url', {url!r}]\napp()"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, cwd=REPO_ROOT)
    assert child.stdout is not None and child.stdout.readline().startswith(b'{"format":"cce-tuning-db"')
    child.stdout.close()  # as `head -1` exits
    assert child.wait(timeout=120) != 0
    assert child.stderr is not None and b"Traceback" not in child.stderr.read()
    child.stderr.close()


def test_ctrl_c_during_an_sqlite_import_says_what_it_imported(tmp_path: Path) -> None:
    """SQLite takes a file in batches, each committed: a Ctrl-C after the first ones exited 130
    without a word, so the batches it kept (entries overwritten with --mode overwrite, say) were
    unknown to the user, who took the import for cancelled. It now names how many lines stay."""
    import signal
    import time

    from tuning_db.records import ExportHeader
    from tuning_db.store import IMPORT_BATCH_LINES

    database = tmp_path / "tuning.db"
    assert cce("db", "upgrade", "--db-url", f"sqlite:///{database}").returncode == 0
    lines = [json.dumps(measurement_data(V=vocab, measurement_uid=f"{vocab:032x}", created_at="2026-01-01T00:00:00Z"))
             for vocab in range(1, 30 * IMPORT_BATCH_LINES + 1)]
    export_file = tmp_path / "export.jsonl"
    header = ExportHeader(entries=len(lines), measurements=len(lines)).model_dump_json()
    export_file.write_text("\n".join([header, *lines]) + "\n")

    def stored() -> int:
        with contextlib.closing(sqlite3.connect(database)) as connection:
            return connection.execute("SELECT count(*) FROM measurements").fetchone()[0]

    code = ("import sys\nfrom cce_compile.cli.main import app\n"
            f"sys.argv = ['cce', 'import', {str(export_file)!r}, '--db-url', 'sqlite:///{database}']\napp()")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, cwd=REPO_ROOT)
    deadline = time.monotonic() + 120
    while stored() == 0:
        assert child.poll() is None and time.monotonic() < deadline, child.communicate()
        time.sleep(0.05)
    child.send_signal(signal.SIGINT)
    _, stderr = child.communicate(timeout=120)
    kept = stored()
    assert 0 < kept < len(lines)
    assert child.returncode == 130
    assert_one_line_failure(subprocess.CompletedProcess([], 130, "", stderr), "import the file again")
    said = re.search(rf"interrupted after (\d+) of {len(lines)} lines were imported", stderr)
    # A Ctrl-C between a batch's commit and its count leaves that batch out of the message.
    assert said and int(said[1]) in (kept, kept - IMPORT_BATCH_LINES), stderr


def test_an_import_on_a_terminal_shows_its_progress_and_leaves_no_trace_in_a_pipe(tmp_path: Path) -> None:
    """A PostgreSQL import of thousands of lines took a minute without a word: on a terminal a
    progress bar follows the rows (and is gone at the end); piped, stderr stays empty."""
    import pty

    from tuning_db.records import ExportHeader

    database = f"sqlite:///{tmp_path / 'tuning.db'}"
    assert cce("db", "upgrade", "--db-url", database).returncode == 0
    lines = [json.dumps(measurement_data(V=vocab, measurement_uid=f"{vocab:032x}", created_at="2026-01-01T00:00:00Z"))
             for vocab in range(1, 401)]
    export_file = tmp_path / "export.jsonl"
    header = ExportHeader(entries=len(lines), measurements=len(lines)).model_dump_json()
    export_file.write_text("\n".join([header, *lines]) + "\n")
    piped = cce("import", str(export_file), "--db-url", database, "--mode", "overwrite")
    assert piped.returncode == 0 and piped.stderr == "" and json.loads(piped.stdout)["lines"] == 400
    controller, terminal = pty.openpty()
    child = subprocess.Popen(
        [sys.executable, "-m", "cce_compile.cli.main", "import", str(export_file), "--db-url", database,
         "--mode", "overwrite"], stdin=terminal, stdout=subprocess.PIPE, stderr=terminal,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "TERM": "xterm", "COLUMNS": "120"}, cwd=REPO_ROOT)
    os.close(terminal)
    shown = b""
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    stdout, _ = child.communicate(timeout=120)
    os.close(controller)
    assert child.returncode == 0 and json.loads(stdout)["lines"] == 400
    assert b"importing rows" in shown and b"/800" in shown, shown[-500:]


def test_an_export_to_a_full_disk_names_stdout(tmp_path: Path) -> None:
    """`cce export > FILE` on a full disk said 'OSError: [Errno 28] No space left on device',
    naming neither what was written nor that the file is cut short."""
    database = f"sqlite:///{tmp_path / 'tuning.db'}"
    assert cce("db", "upgrade", "--db-url", database).returncode == 0
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "cce_compile.cli.main", "export", "--db-url", database],
                              stdout=full, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                              env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, timeout=120)
    assert_one_line_failure(done, "writing to stdout", "No space left on device", "cut short")


def test_export_from_a_dead_service_is_one_line() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert_one_line_failure(cce("export", "--url", url), f"GET {url}/v1/export", "ConnectError")


def test_a_service_url_that_cannot_be_one_is_refused_up_front_naming_url(tmp_path: Path) -> None:
    """A port out of range, another scheme, no scheme or no host: export and import said httpx's
    text once they tried to connect ('ConnectError', 'UnsupportedProtocol'), lookup the same
    after 'cannot ask the service'; each names --url and what is wrong, as a misused option."""
    export_file = tmp_path / "export.jsonl"
    export_file.write_text('{"format": "cce-tuning-db", "schema_version": 1, "entries": 0, "measurements": 0}\n')
    commands = (["export"], ["import", str(export_file)],
                ["lookup", "--gpu", "NVIDIA H100 80GB HBM3", "--vocab", "64", "--hidden", "16", "--tokens", "16"])
    bad = (("http://127.0.0.1:99999", "its port '99999' is not a number from 1 to 65535"),
           ("http://127.0.0.1:0", "its port '0' is not a number from 1 to 65535"),
           ("http://127.0.0.1:8o00", "its port '8o00' is not a number from 1 to 65535"),
           ("ftp://127.0.0.1", "not an http:// or https:// URL"),
           ("127.0.0.1:8000", "not an http:// or https:// URL"),
           ("http://:8000", "it names no host"),
           ("http://[::1:8000", "not a URL"))
    for args in commands:
        for url, reason in bad:
            done = cce(*args, "--url", url, env={"CCE_CONFIG_CACHE_DIR": str(tmp_path / "configs")})
            assert_one_line_failure(done, f"Invalid value for '--url': {url}: {reason}")
            assert done.returncode == 2 and done.stdout == ""
            assert "Error" not in done.stderr  # no exception's name: neither httpx's nor a bug's


def test_export_and_import_through_a_url_answering_no_export_fail_in_one_line(tmp_path: Path) -> None:
    """A login page or another app behind --url answers 200: `cce export --url` wrote its HTML
    as the backup and `cce import --url` printed it as the counts, both with exit 0."""
    export = tmp_path / "export.jsonl"
    export.write_text('{"format": "cce-tuning-db", "schema_version": 1, "entries": 0, "measurements": 0}\n')
    with _answering() as other_server:
        exported = cce("export", "--url", other_server)
        assert_one_line_failure(exported, f"--url {other_server}: the service answered no export file", "Sign in")
        assert exported.stdout == ""
        imported = cce("import", str(export), "--url", other_server)
        assert_one_line_failure(imported, f"--url {other_server}: the service answered no import report", "Sign in")
        assert imported.stdout == ""


def test_export_through_a_url_writes_a_newer_services_export_whole() -> None:
    """The answer is checked for the export format only: a newer service's export (another
    schema version, another header field, a byte order mark) was refused as 'no export file',
    so no backup could be taken from it."""
    header = '\ufeff{"format": "cce-tuning-db", "schema_version": 2, "entries": 1, "measurements": 1, "new": 0}'
    body = f"{header}\n{{\"any\": \"entry\"}}\n"
    with _answering(body.encode(), "application/x-ndjson") as newer_service:
        exported = cce("export", "--url", newer_service)
    assert exported.returncode == 0, exported.stderr
    assert exported.stdout == body
    short = body.replace('"entries": 1', '"entries": 2')
    with _answering(short.encode(), "application/x-ndjson") as newer_service:
        assert_one_line_failure(cce("export", "--url", newer_service), "announces 2 entries but holds 1")


def test_export_and_import_refuse_a_service_and_a_database_named_together(tmp_path: Path) -> None:
    """Each used --url and silently ignored --db-url; the environment's CCE_TUNING_DB_URL is a
    default that --url outranks."""
    url, database = f"http://127.0.0.1:{free_port()}", f"sqlite:///{tmp_path / 'tuning.db'}"
    export = tmp_path / "export.jsonl"
    export.write_text('{"schema": 1}\n')
    for args in (["export"], ["import", str(export)]):
        both = cce(*args, "--url", url, "--db-url", database)
        assert_one_line_failure(both, "--url", "not both")
        assert both.returncode == 2
        from_env = cce(*args, "--url", url, env={"CCE_TUNING_DB_URL": database})
        assert_one_line_failure(from_env, "ConnectError")
    assert not (tmp_path / "tuning.db").exists()


def test_a_postgresql_url_without_psycopg_names_the_extra() -> None:
    """psycopg is installed here, so the child hides it as an uninstalled package would be."""
    url = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
    for args in (["db", "upgrade", "--db-url", url], ["serve", "--port", str(free_port()), "--db-url", url]):
        done = cce(*args, prelude="import sys; sys.modules['psycopg'] = None")
        assert_one_line_failure(done, "pip install 'cce-compile[postgres]'")


def test_serve_says_where_its_data_is_and_how_to_get_a_token(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    with serving(log, "--db-url", f"sqlite:///{tmp_path / 'tuning.db'}", env={"CCE_SERVICE_TOKENS": ""}) as base_url:
        assert httpx.get(f"{base_url}/v1/gpus").status_code == 401
    said = log.read_text()
    assert f"cce serve: database sqlite:///{tmp_path / 'tuning.db'}" in said
    assert "0 token(s) configured; reads need a read token" in said
    assert "cce token --scopes read,write" in said and "CCE_TUNING_TOKEN" in said


def test_the_readme_token_example_works_as_written(tmp_path: Path) -> None:
    spec = re.search(r'^CCE_SERVICE_TOKENS="([^"$]+)" cce serve$', README.read_text(), re.MULTILINE).group(1)
    tokens = parse_token_spec(spec)
    reader = next(token for token, scopes in tokens.items() if scopes == frozenset({"read", "write"}))
    with serving(tmp_path / "serve.log", "--db-url", f"sqlite:///{tmp_path / 'tuning.db'}",
                 env={"CCE_SERVICE_TOKENS": spec}) as base_url:
        assert httpx.get(f"{base_url}/v1/gpus", headers=bearer(reader)).status_code == 200


def test_docs_load_every_asset_from_the_service_itself(tmp_path: Path) -> None:
    """An offline cluster's browser can fetch nothing from a CDN: every script, style sheet and
    icon /docs names must come from the service."""
    with serving(tmp_path / "serve.log", "--db-url", f"sqlite:///{tmp_path / 'tuning.db'}") as base_url:
        page = httpx.get(f"{base_url}/docs")
        assert page.status_code == 200
        assets = re.findall(r"""(?:src|href)=["']([^"']+)["']|url: ?["']([^"']+)["']""", page.text)
        urls = [next(filter(None, found)) for found in assets]
        assert len(urls) >= 4, page.text  # the script, its style sheet, the icon, the schema
        for url in urls:
            assert url.startswith("/"), f"/docs loads {url} from elsewhere"
            assert httpx.get(base_url + url).status_code == 200, url
        assert "SwaggerUIBundle" in httpx.get(base_url + "/docs/assets/swagger-ui-bundle.js").text


def test_redaction_hides_passwords_and_keeps_the_host() -> None:
    """The authority ends at '/', '?' or '#': an '@' in a query once made the host vanish
    (`http://user:***@b`) or a port look like a password."""
    from cce_compile.redact import redact_urls

    assert redact_urls("http://user:pw@host?next=a@b") == "http://user:***@host?next=a@b"
    assert redact_urls("http://host:8080?a=b@c") == "http://host:8080?a=b@c"
    assert redact_urls("GET http://u:p@w@h:1/x#y@z failed; also postgresql://a:b@db/t") == (
        "GET http://u:***@h:1/x#y@z failed; also postgresql://a:***@db/t")
    assert redact_urls("http://h/v1?token=abc&gpu=x") == "http://h/v1?token=***&gpu=x"


def test_redaction_hides_parameters_named_as_secrets_not_those_that_merely_contain_one() -> None:
    """A name is a secret's when one of its words (split at '_', '-', '.' or camelCase) is one:
    a substring once hid monkey=, author=, design= and the service's own tokens= (a problem size)."""
    from cce_compile.redact import redact_urls

    secrets = ("token", "access_token", "id_token", "sessionToken", "authtoken", "api_key", "apikey", "apiKey",
               "x-api-key", "key", "private_key", "AWSAccessKeyId", "sort_key", "password", "passwd", "pwd",
               "user.password", "secret", "client_secret", "clientSecret", "signature", "X-Amz-Signature",
               "X-Amz-Credential", "X-Amz-Security-Token", "sig", "auth", "authorization", "credential",
               "credentials")
    for name in secrets:
        assert redact_urls(f"http://h/v1?gpu=x&{name}=abc&V=8") == f"http://h/v1?gpu=x&{name}=***&V=8", name
    for name in ("tokens", "monkey", "turkey", "keyword", "keys", "author", "authority", "design", "signal",
                 "assignee", "passage"):
        assert redact_urls(f"http://h/v1?{name}=abc") == f"http://h/v1?{name}=abc", name


def test_redaction_takes_linear_time_on_long_parameter_names() -> None:
    """The service's access log redacts every request line a client sends (h11 takes 16 KiB of
    it, httptools more): a name was tried for a secret word from every camelCase or '_'
    boundary, each try scanning the rest of the name, so 16 KiB of 'aA' took ~4 s of the worker's
    event loop (quadratic: 64 KiB over a minute); so did a URL's scheme, tried from every letter
    of a long word."""
    import time

    from cce_compile.redact import redact_urls

    for query in ("aA" * 32768, "aToken" * 10923, "token_" * 10923, "a?" * 32768, "a" * 65536,
                  ("aA" * 64 + "=x&") * 500, "token=a(?" * 7282 + "x" * 512):
        text = f"http://h/v1?{query}"
        started = time.perf_counter()
        redacted = redact_urls(text)
        assert time.perf_counter() - started < 2.0, query[:12]
        assert redacted == (text.replace("=a(", "=***(") if "token=a(" in query else text)
    for text in ("http://h/v1?next=/x?token=abc", "http://h/v1?x?token=abc", "http://h/v1?a_token-b?=abc",
                 "GET http://h/v1?token=abc: refused", "http://h/v1?token=***(?key=abc"):
        assert "abc" not in redact_urls(text), text  # a '?' starts a name anywhere, as before
    long_name = "x" * 4096
    assert redact_urls(f"http://h/v1?{long_name}=abc&V=8") == f"http://h/v1?{long_name}=***&V=8"  # over the cap: hidden



def test_redaction_hides_compound_key_names() -> None:
    """'key' ends harmless words (monkey=, turkey=), so only a secret's own word ends one:
    secretkey=, privatekey=, accesskey= were hidden before names were split into words, and then shown."""
    from cce_compile.redact import redact_urls

    for name in ("secretkey", "privatekey", "accesskey", "masterkey", "signingkey", "sessionkey", "accountkey",
                 "clientkey", "encryptionkey", "authkey", "sharedkey", "x-secretkey"):
        assert redact_urls(f"http://h/v1?gpu=x&{name}=abc&V=8") == f"http://h/v1?gpu=x&{name}=***&V=8", name
    for name in ("monkey", "turkey", "hockey", "keys"):
        assert redact_urls(f"http://h/v1?{name}=abc") == f"http://h/v1?{name}=abc", name


def test_redaction_reads_percent_encoded_names_as_the_server_does() -> None:
    """A server decodes ?%74oken= to token=, so its value is a secret; it was shown as sent."""
    from cce_compile.redact import redact_urls

    for name in ("%74oken", "api%5Fkey", "%70assword", "access%2Dtoken"):
        assert redact_urls(f"http://h/v1?gpu=x&{name}=abc&V=8") == f"http://h/v1?gpu=x&{name}=***&V=8", name
    assert redact_urls("http://h/v1?%74okens=8") == "http://h/v1?%74okens=8"  # tokens: a problem size


def test_redaction_splits_names_at_brackets_as_web_frameworks_nest_them() -> None:
    """token[]= and user[password]= (array and nested parameters) were shown as sent."""
    from cce_compile.redact import redact_urls

    for name in ("token[]", "user[password]", "auth[api_key]", "token%5B%5D", "a[token][0]"):
        assert redact_urls(f"http://h/v1?gpu=x&{name}=abc&V=8") == f"http://h/v1?gpu=x&{name}=***&V=8", name
    for name in ("tokens[]", "user[name]", "monkey[0]"):
        assert redact_urls(f"http://h/v1?{name}=abc") == f"http://h/v1?{name}=abc", name


def test_tune_refuses_a_publish_or_db_url_that_cannot_be_one_on_a_dry_run_and_without_a_gpu() -> None:
    """`--publish ftp://...` passed a dry run, and on a machine without a GPU the GPU's absence was
    all it said (the URL was checked only once a real run began); a --db-url SQLAlchemy cannot
    use passed a dry run too. Each is a misused option, refused as `cce export` refuses it."""
    problem = ["tune", "--vocab", "64", "--hidden", "16", "--tokens", "16"]
    bad = (("--publish", "ftp://127.0.0.1", "--publish ftp://127.0.0.1: not an http:// or https:// URL"),
           ("--publish", "http://127.0.0.1:99999", "--publish http://127.0.0.1:99999: its port '99999' is not a number"),
           ("--db-url", "sqlte:///tuning.db", "Invalid value for --db-url: Can't load plugin"),
           ("--db-url", "sqlite://", "Invalid value for --db-url: an in-memory SQLite database"))
    for run in ([], ["--dry-run"]):
        for option, value, fragment in bad:
            done = cce(*problem, *run, option, value, env={"TRITON_INTERPRET": "0"})  # as without a GPU
            assert_one_line_failure(done, fragment)
            assert done.returncode == 2 and "GPU" not in done.stderr and done.stdout == ""


def _read_only(url: str) -> str:
    """`url`'s database opened read-only: an SQLite file with mode=ro, a PostgreSQL session whose
    transactions are read-only (as on a standby)."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        return f"sqlite:///file:{parsed.database}?mode=ro&uri=true"
    options = f"{parsed.query.get('options', '')} -cdefault_transaction_read_only=on".strip()
    return parsed.update_query_dict({"options": options}).render_as_string(hide_password=False)


def test_tune_db_url_checks_the_database_takes_writes_before_tuning(db_url: str) -> None:
    """A read-only database (an SQLite file opened mode=ro, a PostgreSQL standby or read-only
    session) refused every measurement only after the whole run, as a read token once did with
    --publish; the check stores nothing in a database that takes writes."""
    from sqlalchemy import func, select

    from cce_compile.tuning.publish import DatabasePublisher
    from tuning_db.engine import make_engine
    from tuning_db.models import Gpu

    done = cce("tune", "--vocab", "64", "--hidden", "16", "--tokens", "16", "--budget-s", "0", "--input-sets", "1",
               "--db-url", _read_only(db_url), env={"TRITON_INTERPRET": "1"})
    assert_one_line_failure(done, "--db-url", "the database refused a test write")
    assert done.returncode == 1 and done.stdout == ""
    engine = make_engine(db_url)
    try:
        DatabasePublisher(engine).check()
        with engine.connect() as connection:
            assert connection.scalar(select(func.count()).select_from(Gpu)) == 0
    finally:
        engine.dispose()
