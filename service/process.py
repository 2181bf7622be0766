"""`cce serve` as a child process, ready when this returns: for the tests and the load
benchmark, which must drive the real server (uvicorn, workers, signals) and not an
in-process app."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tuning_db.engine import DB_URL_ENV

REPO_ROOT = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 90


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass(frozen=True)
class Served:
    """A running `cce serve`: its master process (the leader of its own process group,
    so that a test can kill it with its workers) and its base URL."""

    process: subprocess.Popen[bytes]
    base_url: str


@contextmanager
def serving(
    log: Path, *serve_args: str, env: Mapping[str, str] | None = None, ready_path: str = "/readyz"
) -> Iterator[str]:
    """Run `python -m cce_compile.cli.main serve --port <free> *serve_args` on loopback
    until the block ends (SIGINT, as Ctrl-C would); yields the base URL once `ready_path`
    answers 200 (/healthz for a service on a database that is not ready by design).

    The child's environment is this one plus `env`, less CCE_TUNING_DB_URL unless `env`
    sets it, so the database is the one the arguments name. Its output goes to `log`."""
    with serving_process(log, *serve_args, env=env, ready_path=ready_path) as served:
        yield served.base_url


@contextmanager
def serving_process(
    log: Path, *serve_args: str, env: Mapping[str, str] | None = None, ready_path: str = "/readyz"
) -> Iterator[Served]:
    """`serving`, yielding the process too (for tests that signal or kill it). When the block
    ends, a master still running gets SIGINT; its process group is killed if it lingers."""
    port = free_port()
    environment = {key: value for key, value in os.environ.items() if key != DB_URL_ENV}
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    environment.update(env or {})
    command = [sys.executable, "-m", "cce_compile.cli.main", "serve", "--port", str(port), *serve_args]
    with log.open("ab") as output:
        process = subprocess.Popen(
            command, env=environment, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not _ready(base_url + ready_path):
            if process.poll() is not None:
                raise RuntimeError(f"cce serve exited with {process.returncode}:\n{log.read_text()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"cce serve not ready after {STARTUP_TIMEOUT_S}s:\n{log.read_text()}")
            time.sleep(0.2)
        yield Served(process, base_url)
    finally:
        _stop(process)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
    try:  # whatever is left of its group: workers of a master that was killed
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.TransportError:
        return False
