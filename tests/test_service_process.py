"""A real `cce serve` process on a free loopback port, and the `cce` database commands:
data survives a restart, and export/import move it between databases."""

from __future__ import annotations

import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from typer.testing import CliRunner

from cce_compile.cli import db as cli_db
from cce_compile.cli.main import app as cce
from service.process import REPO_ROOT, serving, serving_process
from tests.db_fixtures import bearer, lookup_params, measurement_data
from tests.test_service_schema import assert_declared
from tuning_db.engine import make_engine
from tuning_db.migrate import head_revision

READ_TOKEN, WRITE_TOKEN, ADMIN_TOKEN = "read-token-0002", "write-token-0002", "admin-token-0002"
TOKENS_ENV = {"CCE_SERVICE_TOKENS": f"{READ_TOKEN}:read;{WRITE_TOKEN}:write;{ADMIN_TOKEN}:admin"}


def _lookup(base_url: str) -> dict[str, Any]:
    response = httpx.get(f"{base_url}/v1/configs/best", params=lookup_params(), headers=bearer(READ_TOKEN))
    assert response.status_code == 200, response.text
    return response.json()


def test_data_survives_a_restart_of_the_service(tmp_path: Path) -> None:
    """The first start takes no --db-url: the per-user SQLite file, created and upgraded."""
    log = tmp_path / "serve.log"
    cache_home = tmp_path / "cache"
    with serving(log, env={**TOKENS_ENV, "XDG_CACHE_HOME": str(cache_home)}) as base_url:
        response = httpx.post(f"{base_url}/v1/measurements", json=measurement_data(), headers=bearer(WRITE_TOKEN))
        assert response.status_code == 201, response.text
        first = _lookup(base_url)
        assert first["match_level"] == "exact"
        assert 'cce_lookups_total{match_level="exact"} 1.0' in httpx.get(f"{base_url}/metrics").text
    database = cache_home / "cce_compile" / "tuning.db"
    assert database.exists()

    with serving(log, "--db-url", f"sqlite:///{database}", env=TOKENS_ENV) as base_url:
        assert _lookup(base_url) == first


def test_a_database_file_removed_under_the_running_service_takes_no_more_writes(tmp_path: Path) -> None:
    """Its pooled connections still had the removed file open: writes were acknowledged (201)
    into a file no one could open again, lost for good at the next start, and /readyz said
    ready. The service opens what the path names now (here nothing, so a database without
    schema: 503 naming `cce db upgrade`)."""
    database = tmp_path / "tuning.db"
    with serving(tmp_path / "serve.log", "--db-url", f"sqlite:///{database}", env=TOKENS_ENV) as base_url:
        post = {"url": f"{base_url}/v1/measurements", "json": measurement_data(), "headers": bearer(WRITE_TOKEN)}
        assert httpx.post(**post).status_code == 201
        for suffix in ("", "-wal", "-shm"):
            Path(f"{database}{suffix}").unlink(missing_ok=True)
        refused = httpx.post(**post)
        assert refused.status_code == 503 and "cce db upgrade" in refused.json()["detail"], refused.text
        assert httpx.get(f"{base_url}/readyz").status_code == 503


@pytest.mark.parametrize(("stop", "workers"), [(signal.SIGTERM, 1), (signal.SIGINT, 1), (signal.SIGTERM, 2)])
def test_a_stopped_server_leaves_no_metrics_directory(tmp_path: Path, stop: signal.Signals, workers: int) -> None:
    scratch = tmp_path / "tmp"  # where the server makes its temporary directories
    scratch.mkdir()
    args = ("--db-url", f"sqlite:///{tmp_path / 'tuning.db'}", "--workers", str(workers))
    with serving_process(tmp_path / "serve.log", *args, env={**TOKENS_ENV, "TMPDIR": str(scratch)}) as served:
        assert httpx.get(f"{served.base_url}/healthz").status_code == 200
        [metrics_dir] = scratch.iterdir()
        assert metrics_dir.name.startswith("cce-metrics-")
        served.process.send_signal(stop)
        returncode = served.process.wait(timeout=20)
    # One worker dies of the signal that uvicorn raises again after its graceful shutdown; a
    # master of several returns. Either is a clean stop, and neither leaves its directory.
    assert returncode in (0, -stop), (tmp_path / "serve.log").read_text()[-2000:]
    assert list(scratch.iterdir()) == []


def test_health_checks_answer_head_without_a_body(tmp_path: Path) -> None:
    """Load balancers often check health with HEAD: same status as GET, headers only."""
    with serving(tmp_path / "serve.log", "--db-url", f"sqlite:///{tmp_path / 'tuning.db'}") as base_url:
        port = int(base_url.rsplit(":", 1)[1])
        for path in ("/healthz", "/readyz"):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
                connection.sendall(f"HEAD {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
                answer = connection.makefile("rb").read()  # all of it: the server closes after
            assert answer.startswith(b"HTTP/1.1 200 "), answer
            assert answer.endswith(b"\r\n\r\n"), answer


def test_the_access_log_shows_no_token_a_client_put_in_a_query_string(tmp_path: Path) -> None:
    """uvicorn logs each request line with its query string, a refused one too: a token sent as
    ?token= (a client's URL given as http://host/?token=...) reached the log as it was sent."""
    log = tmp_path / "serve.log"
    with serving(log, "--db-url", f"sqlite:///{tmp_path / 'tuning.db'}", "--workers", "2", env=TOKENS_ENV) as base_url:
        for name in ("token", "access_token", "api_key"):
            params = {**lookup_params(), name: "tok-s3cret"}
            assert httpx.get(f"{base_url}/v1/configs/best", params=params, headers=bearer(READ_TOKEN)).status_code == 422
    logged = [line for line in log.read_text().splitlines() if "/v1/configs/best" in line]
    assert len(logged) == 3 and "s3cret" not in log.read_text(), logged
    for line, name in zip(logged, ("token", "access_token", "api_key")):
        assert f"&{name}=*** HTTP/1.1\" 422" in line and f"&tokens={lookup_params()['tokens']}&" in line, line


def test_the_error_log_shows_no_token_in_a_websocket_handshake_line(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Where websockets or wsproto is installed (not here), uvicorn logs each WebSocket
    handshake to its error log, path and query string included, as '%s - "WebSocket %s" 403'
    (this app has no WebSocket route): a record of that shape through the app's filter."""
    from service.app import create_app
    from service.settings import ServiceSettings

    create_app(ServiceSettings(db_url=f"sqlite:///{tmp_path / 'tuning.db'}"))
    with caplog.at_level(logging.INFO, logger="uvicorn.error"):
        logging.getLogger("uvicorn.error").info('%s - "WebSocket %s" 403', "127.0.0.1:5000",
                                                "/v1/configs/best?tokens=8192&api_key=tok-s3cret")
    assert caplog.messages == ['127.0.0.1:5000 - "WebSocket /v1/configs/best?tokens=8192&api_key=***" 403']


def _metric_lines(base_url: str, fragment: str) -> list[str]:
    return [line for line in httpx.get(f"{base_url}/metrics").text.splitlines()
            if line.startswith("cce_http_requests_total") and fragment in line]


def test_metrics_name_a_body_refused_before_routing_and_count_a_client_that_left_as_499(tmp_path: Path) -> None:
    """A body refused by its Content-Length (413, before routing) was counted under 'unmatched':
    FastAPI's included routers match no bare scope. A client gone mid-body was a 500 (and a
    traceback in the log) on /v1/import, a 400 on /v1/measurements."""
    log = tmp_path / "serve.log"
    env = {**TOKENS_ENV, "CCE_SERVICE_MAX_BODY_BYTES": "16384"}
    with serving(log, "--db-url", f"sqlite:///{tmp_path / 'tuning.db'}", "--log-level", "warning", env=env) as base_url:
        refused = httpx.post(f"{base_url}/v1/import", content=b"x" * 32768, headers=bearer(ADMIN_TOKEN))
        assert refused.status_code == 413
        port = int(base_url.rsplit(":", 1)[1])
        for path in ("/v1/import", "/v1/measurements"):
            with socket.create_connection(("127.0.0.1", port)) as client:
                client.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ADMIN_TOKEN}\r\n"
                               "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"gpu".encode())
        deadline = time.monotonic() + 10
        while len(_metric_lines(base_url, 'status="499"')) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _metric_lines(base_url, "/v1/import") == [
            'cce_http_requests_total{method="POST",route="/v1/import",status="413"} 1.0',
            'cce_http_requests_total{method="POST",route="/v1/import",status="499"} 1.0',
        ]
        assert _metric_lines(base_url, "/v1/measurements") == [
            'cce_http_requests_total{method="POST",route="/v1/measurements",status="499"} 1.0']
        assert not _metric_lines(base_url, "unmatched")
    assert "Traceback" not in log.read_text()


@pytest.mark.parametrize("route", ["measurements", "import"])
def test_a_huge_record_holds_up_no_other_request(route: str, tmp_path: Path) -> None:
    """8 MB of 700,000 unknown keys (under the 8 MiB body limit) as a measurement, or as an
    import's line, kept the service parsing and listing errors for 4-25 s: /healthz and every
    lookup waited as long. A measurement's body is refused past 64 KiB (413), sent whole or in
    chunks, and so is an import's line (422), before either is parsed."""
    keys = ("{" + ",".join(f'"k{i}":1' for i in range(700_000)) + "}").encode()
    if route == "import":
        keys = b'{"format": "cce-tuning-db", "schema_version": 1, "entries": 1, "measurements": 1}\n' + keys
    token, expected = (WRITE_TOKEN, 413) if route == "measurements" else (ADMIN_TOKEN, 422)
    headers = {**bearer(token), "Content-Type": "application/json"}
    with serving(tmp_path / "serve.log", "--db-url", f"sqlite:///{tmp_path / 'tuning.db'}", "--log-level", "warning",
                 env=TOKENS_ENV) as base_url:
        for body in (keys, iter([keys[i:i + 65536] for i in range(0, len(keys), 65536)])):
            statuses: list[int] = []
            heavy = threading.Thread(target=lambda: statuses.append(
                httpx.post(f"{base_url}/v1/{route}", content=body, headers=headers, timeout=60).status_code))
            heavy.start()
            slowest = 0.0
            while True:
                asked = time.monotonic()
                assert httpx.get(f"{base_url}/healthz", timeout=60).status_code == 200
                slowest = max(slowest, time.monotonic() - asked)
                if not heavy.is_alive():
                    break
            heavy.join()
            assert slowest < 1.0
            assert statuses == [expected]


def test_cli_exports_from_the_service_and_imports_into_another_database(tmp_path: Path) -> None:
    runner = CliRunner()
    copy_url = f"sqlite:///{tmp_path / 'copy.db'}"
    upgraded = runner.invoke(cce, ["db", "upgrade", "--db-url", copy_url])
    assert upgraded.exit_code == 0 and f"revision {head_revision()}" in upgraded.output

    with serving(tmp_path / "serve.log", "--db-url", f"sqlite:///{tmp_path / 'origin.db'}", env=TOKENS_ENV) as base_url:
        for tokens in (1024, 8192):
            httpx.post(f"{base_url}/v1/measurements", json=measurement_data(tokens=tokens), headers=bearer(WRITE_TOKEN))
        exported = runner.invoke(cce, ["export", "--url", base_url, "--token", READ_TOKEN])
        assert exported.exit_code == 0, exported.output
        export_file = tmp_path / "export.jsonl"
        export_file.write_text(exported.stdout)
        dry_run = runner.invoke(
            cce, ["import", str(export_file), "--url", base_url, "--token", ADMIN_TOKEN, "--dry-run"]
        )
        assert json.loads(dry_run.stdout)["entries_kept"] == 2
        refused = runner.invoke(cce, ["import", str(export_file), "--url", base_url, "--token", WRITE_TOKEN])
        assert refused.exit_code == 1 and "403" in refused.output

    imported = runner.invoke(cce, ["import", str(export_file), "--db-url", copy_url, "--mode", "skip"])
    assert imported.exit_code == 0, imported.output
    assert json.loads(imported.stdout)["entries_added"] == 2
    copied = runner.invoke(cce, ["export", "--db-url", copy_url])
    assert copied.stdout == exported.stdout

    broken = tmp_path / "broken.jsonl"
    broken.write_text(exported.stdout.replace('"slab_v":8192', '"slab_v":8191'))
    failed = runner.invoke(cce, ["import", str(broken), "--db-url", copy_url])
    assert failed.exit_code == 1 and "line 2" in failed.output and "nothing was imported" in failed.output


def test_the_cli_and_the_package_load_no_web_stack() -> None:
    check = (
        "import sys, cce_compile; before = set(sys.modules); import cce_compile.cli.main; "
        "web = ('fastapi', 'uvicorn', 'starlette', 'sqlalchemy', 'alembic', 'httpx', 'psycopg'); "
        "print([m for m in web if m in before], [m for m in web if m in sys.modules])"
    )
    result = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, cwd=REPO_ROOT, check=True, timeout=120
    )
    assert result.stdout.strip() == "[] []"


@pytest.mark.parametrize("args", [["serve", "--help"], ["db", "upgrade", "--help"], ["import", "--help"]])
def test_commands_are_registered(args: list[str]) -> None:
    assert CliRunner().invoke(cce, args).exit_code == 0


def test_cli_import_through_the_service_waits_for_a_long_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An import the service takes longer to write than the CLI's HTTP timeout (here cut to
    0.1 s; 60 s against a 7.8 MB file): the CLI once reported a ReadTimeout for an import that
    went on to succeed. Three SQLite batches take 0.3 s in pauses alone."""
    monkeypatch.setattr(cli_db, "HTTP_TIMEOUT_S", 0.1)
    count = 450
    header = {"format": "cce-tuning-db", "schema_version": 1, "entries": count, "measurements": count}
    lines = [
        json.dumps(measurement_data(V=v, measurement_uid=f"{v:032x}", created_at="2026-01-01T00:00:00Z"))
        for v in range(1, count + 1)
    ]
    export_file = tmp_path / "export.jsonl"
    export_file.write_text("\n".join([json.dumps(header), *lines]) + "\n")
    with serving(tmp_path / "serve.log", "--db-url", f"sqlite:///{tmp_path / 'served.db'}", env=TOKENS_ENV) as base_url:
        imported = CliRunner().invoke(cce, ["import", str(export_file), "--url", base_url, "--token", ADMIN_TOKEN])
    assert imported.exit_code == 0, imported.output
    assert json.loads(imported.stdout)["entries_added"] == count


def test_an_import_does_not_revive_a_retired_entry_through_another_line_of_its_key(tmp_path: Path, db_url: str) -> None:
    """A file with two lines for one key (a merge of two exports): the slower line replaced the
    retired entry (a retired entry takes the key's next measurement), then the retired line,
    faster, replaced that one, so re-importing the file served the retired config again. An
    entry that holds a line's measurement stays retired; it must not come back by another line."""
    with serving(tmp_path / "serve.log", "--db-url", db_url, "--log-level", "warning", env=TOKENS_ENV) as base_url:

        def post(median_ms: float) -> dict[str, Any]:
            body = measurement_data(median_ms=median_ms, p20_ms=median_ms, p80_ms=median_ms)
            response = httpx.post(f"{base_url}/v1/measurements", json=body, headers=bearer(WRITE_TOKEN))
            assert response.status_code == 201, response.text
            return response.json()

        def exported_line() -> str:
            response = httpx.get(f"{base_url}/v1/export", headers=bearer(READ_TOKEN))
            [line] = response.text.splitlines()[1:]
            return line

        post(10.0)
        slower = exported_line()
        bogus = post(8.0)
        header = {"format": "cce-tuning-db", "schema_version": 1, "entries": 2, "measurements": 2}
        export_file = "\n".join([json.dumps(header), slower, exported_line()]) + "\n"
        retired = httpx.post(f"{base_url}/v1/configs/{bogus['entry_id']}/retire", headers=bearer(ADMIN_TOKEN))
        assert retired.status_code == 200 and retired.json()["retired"], retired.text

        imported = httpx.post(f"{base_url}/v1/import", content=export_file, headers=bearer(ADMIN_TOKEN))
        assert imported.status_code == 200, imported.text
        source = _lookup(base_url)["source"]
        assert source is not None and source["measurement_uid"] != bogus["measurement_uid"], source
        assert source["median_ms"] == 10.0


def test_a_retried_measurement_does_not_revive_its_retired_entry(tmp_path: Path, db_url: str) -> None:
    """A tuner's send whose answer was lost, retried under its Idempotency-Key after an admin had
    retired its entry and another measurement had taken the key: the retry ran the upsert again
    and, faster, made the retired config the key's best once more, while answering that it added
    nothing (already_stored)."""
    with serving(tmp_path / "serve.log", "--db-url", db_url, "--log-level", "warning", env=TOKENS_ENV) as base_url:

        def post(median_ms: float, headers: dict[str, str]) -> dict[str, Any]:
            body = measurement_data(median_ms=median_ms, p20_ms=median_ms, p80_ms=median_ms)
            response = httpx.post(f"{base_url}/v1/measurements", json=body, headers={**bearer(WRITE_TOKEN), **headers})
            assert response.status_code == 201, response.text
            return response.json()

        key = {"Idempotency-Key": "3b9f4c2e-6a1d-4e8b-9c7f-0d2a5e6b1c4f"}
        bogus = post(8.0, key)
        retired = httpx.post(f"{base_url}/v1/configs/{bogus['entry_id']}/retire", headers=bearer(ADMIN_TOKEN))
        assert retired.status_code == 200 and retired.json()["retired"], retired.text
        post(10.0, {})
        again = post(8.0, key)
        assert again["already_stored"] and not again["is_best"], again
        source = _lookup(base_url)["source"]
        assert source is not None and source["measurement_uid"] != bogus["measurement_uid"], source


def test_an_entry_stored_with_a_time_the_first_release_took_is_answered_as_the_schema_declares(
    tmp_path: Path, db_url: str
) -> None:
    """The first release took any positive time (median_ms 5e-324), and such a row is served as
    stored: its speedup, default_ms / median_ms, overflowed to infinity, which JSON cannot carry,
    so lookups, listings and the retire answered `"speedup": null` where /openapi.json declared
    a number (a generated client refused the answer)."""
    engine = make_engine(db_url)
    with serving(tmp_path / "serve.log", "--db-url", db_url, "--log-level", "warning", env=TOKENS_ENV) as base_url:
        openapi = httpx.get(f"{base_url}/openapi.json").json()
        stored = httpx.post(f"{base_url}/v1/measurements", json=measurement_data(), headers=bearer(WRITE_TOKEN))
        assert stored.status_code == 201, stored.text
        with engine.begin() as connection:
            connection.execute(text("UPDATE measurements SET median_ms = :tiny, p20_ms = :tiny"), {"tiny": 5e-324})
            connection.execute(text("UPDATE best_configs SET median_ms = :tiny"), {"tiny": 5e-324})
        engine.dispose()
        entry_id = stored.json()["entry_id"]
        answers = [
            ("GET", "/v1/configs/best", httpx.get(f"{base_url}/v1/configs/best", params=lookup_params(),
                                                   headers=bearer(READ_TOKEN))),
            ("GET", "/v1/configs", httpx.get(f"{base_url}/v1/configs", headers=bearer(READ_TOKEN))),
            ("POST", "/v1/configs/{entry_id}/retire", httpx.post(f"{base_url}/v1/configs/{entry_id}/retire",
                                                                 headers=bearer(ADMIN_TOKEN))),
        ]
    for method, template, response in answers:
        assert response.status_code == 200, response.text
        assert_declared(openapi, method, template, response)
    assert answers[0][2].json()["source"]["median_ms"] == 5e-324
