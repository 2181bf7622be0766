"""A real `cce serve --workers 2` that crashes: a kill -9 of its master ends its workers,
and a kill -9 of the whole server in the middle of a burst of racing writes loses no write
it acknowledged (SQLite and PostgreSQL; SQLite's file passes its integrity check)."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import threading
import time
from pathlib import Path

import httpx
import pytest

from sqlalchemy import text

from service.process import serving, serving_process
from tests.db_fixtures import bearer, lookup_params, measurement_data
from tests.test_service_process import ADMIN_TOKEN, READ_TOKEN, TOKENS_ENV, WRITE_TOKEN
from tuning_db.engine import make_engine
from tuning_db.records import ExportHeader
from tuning_db.store import IMPORT_BATCH_LINES

WRITERS = 4
WRITES_PER_WRITER = 60
KILL_AFTER_ACKNOWLEDGED = 60
WORKER_EXIT_TIMEOUT_S = 15
IMPORT_BATCHES = 5


def _children(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(child) for child in children]


def _running(pid: int) -> bool:
    """Alive and not a zombie (a dead worker may wait a moment to be reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads the process tree from /proc (Linux)")
def test_workers_exit_when_the_master_is_killed(tmp_path: Path) -> None:
    db_url = f"sqlite:///{tmp_path / 'tuning.db'}"
    with serving_process(tmp_path / "serve.log", "--db-url", db_url, "--workers", "2", env=TOKENS_ENV) as served:
        workers = _children(served.process.pid)
        assert len(workers) >= 2
        served.process.send_signal(signal.SIGKILL)
        served.process.wait()
        deadline = time.monotonic() + WORKER_EXIT_TIMEOUT_S
        while any(map(_running, workers)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(map(_running, workers)), (tmp_path / "serve.log").read_text()[-2000:]
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{served.base_url}/healthz", timeout=2)


def _write_burst(base_url: str, writer: int, acknowledged: list[str], lock: threading.Lock) -> None:
    """Post measurements of distinct keys (V) until the server dies; record every uid it
    acknowledged with a 201."""
    with httpx.Client(base_url=base_url, headers=bearer(WRITE_TOKEN), timeout=10) as client:
        for index in range(WRITES_PER_WRITER):
            body = measurement_data(V=1000 + writer * WRITES_PER_WRITER + index, host=f"writer{writer}-{index}")
            try:
                response = client.post("/v1/measurements", json=body)
            except httpx.TransportError:
                return
            assert response.status_code in (201, 503), response.text
            if response.status_code == 201:
                with lock:
                    acknowledged.append(response.json()["measurement_uid"])


def test_a_server_killed_mid_burst_keeps_every_acknowledged_write(tmp_path: Path, db_url: str) -> None:
    log = tmp_path / "serve.log"
    acknowledged: list[str] = []
    lock = threading.Lock()
    # its metrics directory in tmp_path: a killed server has no chance to remove it
    crash_env = {**TOKENS_ENV, "TMPDIR": str(tmp_path)}
    with serving_process(log, "--db-url", db_url, "--workers", "2", "--log-level", "warning", env=crash_env) as served:
        writers = [
            threading.Thread(target=_write_burst, args=(served.base_url, writer, acknowledged, lock))
            for writer in range(WRITERS)
        ]
        for thread in writers:
            thread.start()
        while len(acknowledged) < KILL_AFTER_ACKNOWLEDGED and any(thread.is_alive() for thread in writers):
            time.sleep(0.01)
        os.killpg(served.process.pid, signal.SIGKILL)  # master and workers at once: a crash
        for thread in writers:
            thread.join(timeout=60)
    assert KILL_AFTER_ACKNOWLEDGED <= len(acknowledged) < WRITERS * WRITES_PER_WRITER

    if db_url.startswith("sqlite"):
        with sqlite3.connect(db_url.removeprefix("sqlite:///")) as connection:
            assert connection.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    with serving(log, "--db-url", db_url, "--log-level", "warning", env=TOKENS_ENV) as base_url:
        export = httpx.get(f"{base_url}/v1/export", headers=bearer(READ_TOKEN), timeout=30)
    assert export.status_code == 200
    stored = {line.split('"measurement_uid":"')[1][:32] for line in export.text.splitlines()[1:]}
    assert set(acknowledged) <= stored


def test_writers_are_not_locked_out_for_a_whole_import(tmp_path: Path) -> None:
    """The import commits in batches, so a racing writer waits a batch, not the whole file
    (which once held SQLite's lock past other writers' busy timeout: 500 'database is
    locked'). Measured as the longest wait between the writer's acknowledgements."""
    lines = [
        json.dumps(measurement_data(V=vocab, measurement_uid=f"{vocab:032x}", created_at="2026-01-01T00:00:00Z"))
        for vocab in range(1, IMPORT_BATCHES * IMPORT_BATCH_LINES + 1)
    ]
    header = ExportHeader(entries=len(lines), measurements=len(lines)).model_dump_json()
    db_url = f"sqlite:///{tmp_path / 'tuning.db'}"
    args = ("--db-url", db_url, "--workers", "2", "--log-level", "warning")
    with serving(tmp_path / "serve.log", *args, env=TOKENS_ENV) as base_url:
        importing = threading.Event()
        acknowledged_at: list[float] = []
        statuses: list[int] = []

        def write_while_importing() -> None:
            with httpx.Client(base_url=base_url, headers=bearer(WRITE_TOKEN), timeout=60) as client:
                while importing.is_set():
                    body = measurement_data(V=10**6 + len(statuses), host=f"racer-{len(statuses)}")
                    statuses.append(client.post("/v1/measurements", json=body).status_code)
                    acknowledged_at.append(time.monotonic())

        importing.set()
        racer = threading.Thread(target=write_while_importing)
        racer.start()
        started = time.monotonic()
        imported = httpx.post(
            f"{base_url}/v1/import", content="\n".join([header, *lines]), headers=bearer(ADMIN_TOKEN), timeout=300
        )
        duration = time.monotonic() - started
        importing.clear()
        racer.join(timeout=120)
    assert imported.status_code == 200 and imported.json()["measurements_added"] == len(lines), imported.text
    assert set(statuses) == {201}
    waits = [later - earlier for earlier, later in zip([started, *acknowledged_at], acknowledged_at)]
    assert max(waits) < duration / 2, (max(waits), duration)


POOL_CONNECTIONS = 15
"""SQLAlchemy's QueuePool: 5 connections kept, 10 more on demand, then a 30 s wait for one."""


def test_a_request_finding_every_database_connection_held_is_503_not_500(tmp_path: Path, postgres_url: str) -> None:
    """Lookups queued behind a table lock hold every connection of the worker's pool; the next
    request waited 30 s for one and got a bare 500 (SQLAlchemy's pool TimeoutError, no database
    error), its traceback in the log. It is the database being busy: 503 with Retry-After."""
    locker = make_engine(postgres_url)
    answers: list[httpx.Response] = []

    def look_up(base_url: str) -> None:
        answers.append(httpx.get(f"{base_url}/v1/configs/best", params=lookup_params(), headers=bearer(READ_TOKEN),
                                 timeout=120))

    try:
        with serving(tmp_path / "serve.log", "--db-url", postgres_url, "--log-level", "warning",
                     env=TOKENS_ENV) as base_url, locker.connect() as connection:
            connection.execute(text("LOCK TABLE best_configs IN ACCESS EXCLUSIVE MODE"))
            lookups = [threading.Thread(target=look_up, args=(base_url,)) for _ in range(POOL_CONNECTIONS + 1)]
            for thread in lookups:
                thread.start()
            deadline = time.monotonic() + 90
            while not answers and time.monotonic() < deadline:  # the one left without a connection
                time.sleep(0.2)
            connection.rollback()  # the lock goes: the queued lookups answer
            for thread in lookups:
                thread.join(timeout=60)
    finally:
        locker.dispose()
    statuses = sorted(answer.status_code for answer in answers)
    assert statuses == [200] * POOL_CONNECTIONS + [503], [answer.text for answer in answers]
    refused = next(answer for answer in answers if answer.status_code == 503)
    assert refused.headers["Retry-After"] == "1" and "connections" in refused.json()["detail"]
    assert "Traceback" not in (tmp_path / "serve.log").read_text()
