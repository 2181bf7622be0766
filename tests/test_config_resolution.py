"""The op's config ladder (override, memo, disk cache, service, bundled, heuristic) against a
real `cce serve` process, dead and lying services, bad local files, `cce lookup`, and two
gloo ranks that must launch the same config."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import timedelta
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources, PTXASError
from typer.testing import CliRunner

from cce_compile import linear_cross_entropy, linear_log_probs, override_config
from cce_compile.cli.main import app as cce
from cce_compile.config.kernel_config import KernelConfig
from cce_compile.config.keys import ProblemKey
from cce_compile.ops import library
from cce_compile.ops import log_probs as log_probs_ops
from cce_compile.ops.problem import (
    _settings_for_key, config_for, decode_settings, encode_settings, launch_backward_with_config, launch_with_config,
    problem_key,
)
from cce_compile.plan.policy import Policy, override_policy
from cce_compile.resolve import client, platform, sources
from cce_compile.resolve import ladder as resolve
from cce_compile.resolve.heuristic import heuristic_config
from cce_compile.resolve.ladder import Resolution, resolution_for, resolve_config, resolved
from service.process import REPO_ROOT, serving
from tests.db_fixtures import GPU_H100, H100_KEY, measurement_data
from tests.http_servers import loopback_server

READ_TOKEN, WRITE_TOKEN = "read-token-0003", "write-token-0003"
TOKENS_ENV = {"CCE_SERVICE_TOKENS": f"{READ_TOKEN}:read;{WRITE_TOKEN}:write"}

H100 = platform.Platform(
    gpu=H100_KEY,
    compute_capability=GPU_H100["compute_capability"],
    sm_count=GPU_H100["sm_count"],
    shared_memory_bytes=232_448,
    kernel_version=platform.kernel_version(),
    triton_version=platform.triton_version(),
)
"""The platform every test resolves for (patched in), so CPU machines and GPUs agree."""
A100 = replace(H100, gpu="nvidia-a100-sxm4-80gb", compute_capability="8.0", sm_count=108,
               shared_memory_bytes=166_912)
"""A second GPU model, for a host (or a job) that mixes models."""

KEY = ProblemKey("cuda", 128_256, 4096, "bfloat16", 8192, "exact")
TUNED = {"slab_v": 8192, "vocab_splits": 8, "forward": {"block_m": 64, "block_n": 256, "num_stages": 3}}
SMALL = dict(v=512, d=64, n=100)
"""The op's problem in the end-to-end tests: its key is SMALL_KEY (CPU tensors)."""
SMALL_KEY = ProblemKey("cpu", 512, 64, "float32", 128, "exact")
SMALL_TUNED = {"slab_v": 256, "vocab_splits": 2}
SHIPPED_BUNDLED_DIR = sources.BUNDLED_DIR
"""The package's own bundle, kept before `isolated` points BUNDLED_DIR at each test's empty one."""


def _problem(key: ProblemKey, tokens: int) -> dict[str, Any]:
    return {"V": key.v, "D": key.d, "dtype": key.dtype, "tokens": tokens, "mode": key.mode}


def _post(base_url: str, key: ProblemKey, tokens: int, config: dict[str, Any]) -> None:
    """A real measurement of `config` on the H100, by this checkout's kernels."""
    body = measurement_data(
        kernel_version=H100.kernel_version, triton_version=H100.triton_version, config=config, **_problem(key, tokens)
    )
    response = httpx.post(f"{base_url}/v1/measurements", json=body, headers={"Authorization": f"Bearer {WRITE_TOKEN}"})
    assert response.status_code == 201, response.text


def _settings() -> sources.Settings:
    return sources.Settings.from_env()


def _memoized(key: ProblemKey) -> Resolution:
    """The memo's resolution of `key` for the GPU model it resolves for here (`isolated`)."""
    return resolved()[resolve.gpu_model(key.device), key]


def _heuristic(key: ProblemKey) -> Resolution:
    return Resolution(heuristic_config(key), "heuristic", "none")


def _bundle(directory: Path, key: ProblemKey, config: dict[str, Any], kernel_version: str | None = None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    entry = {"gpu": GPU_H100["name"], **_problem(key, key.n_bucket), "config": config,
             "kernel_version": kernel_version or platform.kernel_version()}
    (directory / "h100.json").write_text(json.dumps({"entries": [entry]}))


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No service, an empty disk cache and bundle of this test's own, the H100 platform (and
    its name for the memo's GPU model), and fresh module state (memo, breaker) before and after."""
    for name in (sources.URL_ENV, sources.TOKEN_ENV, sources.OFFLINE_ENV, sources.CACHE_TTL_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(sources.CACHE_DIR_ENV, str(tmp_path / "configs"))
    monkeypatch.setattr(sources, "BUNDLED_DIR", tmp_path / "bundled")
    monkeypatch.setattr(resolve, "local_platform", lambda device, gpu=None: H100)
    monkeypatch.setattr(resolve, "gpu_model", lambda device, gpu=None: H100.gpu if device == "cuda" else device)
    resolve.reset()
    yield
    resolve.reset()


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real `cce serve` on SQLite, holding measurements for KEY and SMALL_KEY."""
    root = tmp_path_factory.mktemp("service")
    db_url = f"sqlite:///{root / 'tuning.db'}"
    with serving(root / "serve.log", "--db-url", db_url, "--log-level", "warning", env=TOKENS_ENV) as base_url:
        _post(base_url, KEY, 8000, TUNED)
        _post(base_url, SMALL_KEY, SMALL["n"], SMALL_TUNED)
        yield base_url


@dataclass
class FakeService:
    """A tiny HTTP server standing in for the service: it answers every GET with `status`
    and `body` (or never, with body None) and records each request's Authorization."""

    status: int
    body: bytes | None
    requests: list[str | None] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)
    headers: dict[str, str] = field(default_factory=dict)


@contextmanager
def fake_service(status: int, body: bytes | None, headers: dict[str, str] | None = None
                 ) -> Iterator[tuple[str, FakeService]]:
    fake = FakeService(status, body, headers=headers or {})

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            fake.requests.append(self.headers.get("Authorization"))
            if fake.body is None:
                fake.release.wait(30)
                return
            self.send_response(fake.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(fake.body)))
            for name, value in fake.headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(fake.body)

        def log_message(self, *args: Any) -> None:
            pass

    with loopback_server(Handler) as url:
        try:
            yield url, fake
        finally:
            fake.release.set()


def _small_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    e = torch.randn(SMALL["n"], SMALL["d"], generator=generator)
    c = torch.randn(SMALL["v"], SMALL["d"], generator=generator)
    return e, c, torch.randint(0, SMALL["v"], (SMALL["n"],), generator=generator)


# (1) the service ----------------------------------------------------------------------


def test_the_op_launches_the_service_config_and_caches_it(service: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(sources.URL_ENV, service)
    monkeypatch.setenv(sources.TOKEN_ENV, READ_TOKEN)
    e, c, targets = _small_inputs()
    torch.testing.assert_close(linear_cross_entropy(e, c, targets), F.cross_entropy(e @ c.T, targets))
    expected = Resolution(KernelConfig.from_dict(SMALL_TUNED), "service", "exact")
    assert resolved() == {("cpu", SMALL_KEY): expected}
    assert resolution_for(KEY) == Resolution(KernelConfig.from_dict(TUNED), "service", "exact")

    # A new process without the service: the disk cache answers, with the service's match level.
    resolve.reset()
    monkeypatch.delenv(sources.URL_ENV)
    assert resolution_for(SMALL_KEY) == Resolution(expected.config, "disk", "exact")


def test_a_missing_entry_is_not_cached(service: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(sources.URL_ENV, service)
    monkeypatch.setenv(sources.TOKEN_ENV, READ_TOKEN)
    other = ProblemKey("cuda", 32_000, 4096, "bfloat16", 8192, "exact")
    assert resolution_for(other) == _heuristic(other)
    assert not (tmp_path / "configs").exists()


def test_a_key_the_service_refuses_is_a_miss_for_that_key_alone(service: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """mark_dynamic(e, 0, min=2, max=sys.maxsize) keys its config on the 2^63 token bucket,
    past the service's Tokens: its 422 tripped the breaker, and no later key asked the service."""
    monkeypatch.setenv(sources.URL_ENV, service)
    monkeypatch.setenv(sources.TOKEN_ENV, READ_TOKEN)
    unbounded = replace(KEY, n_bucket=2**63)
    assert resolution_for(unbounded) == _heuristic(unbounded)
    assert client._service_down is None
    assert resolution_for(KEY) == Resolution(KernelConfig.from_dict(TUNED), "service", "exact")


def test_a_422_naming_the_platform_trips_the_breaker(service: str) -> None:
    """Only a 422 naming the key's own values is a miss for that key alone; one naming the
    platform (a GPU name the service's rule refuses) holds for every key, so the breaker trips
    rather than each key asking again."""
    settings = sources.Settings(service, READ_TOKEN, False, Path("unused"), 0.0)
    refused_gpu = replace(H100, gpu="NVIDIA H100 [MIG 1g.10gb]")
    assert client.fetch_from_service(settings, refused_gpu, KEY) is None
    assert client._service_down is not None and "HTTP 422" in client._service_down


# (2) a dead service -------------------------------------------------------------------


def test_a_killed_service_falls_back_fast_and_is_asked_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    bundled_key = ProblemKey("cuda", 32_000, 4096, "bfloat16", 8192, "exact")
    _bundle(tmp_path / "bundled", bundled_key, {"slab_v": 2048})
    db_url = f"sqlite:///{tmp_path / 'tuning.db'}"
    with serving(tmp_path / "serve.log", "--db-url", db_url, "--log-level", "warning", env=TOKENS_ENV) as base_url:
        monkeypatch.setenv(sources.URL_ENV, base_url)
        monkeypatch.setenv(sources.TOKEN_ENV, READ_TOKEN)
        _post(base_url, KEY, 8192, TUNED)
        assert resolution_for(KEY).source == "service"

    start = time.monotonic()
    assert resolution_for(bundled_key) == Resolution(KernelConfig(slab_v=2048), "bundled", "exact")
    assert resolution_for(SMALL_KEY) == _heuristic(SMALL_KEY)
    assert time.monotonic() - start < 3.0
    assert len([r for r in caplog.records if "not asking it again" in r.getMessage()]) == 1


def test_a_hanging_service_costs_one_timeout_per_process() -> None:
    with fake_service(200, None) as (url, fake):
        settings = sources.Settings(url, None, False, Path("unused"), 0.0)
        start = time.monotonic()
        assert client.fetch_from_service(settings, H100, KEY) is None
        first = time.monotonic() - start
        start = time.monotonic()
        assert client.fetch_from_service(settings, H100, SMALL_KEY) is None
        second = time.monotonic() - start
    assert 0.9 * client.SERVICE_TIMEOUT_S <= first < 3.0
    assert second < 0.5
    assert len(fake.requests) == 1, "a timeout is not retried, and the breaker stops the second lookup"


@contextmanager
def dribbling_service(answer_bytes: int, header_lines: int) -> Iterator[tuple[str, list[float]]]:
    """A raw socket server that sends a status line, then `header_lines` header lines one
    per 0.3 s, then an `answer_bytes` JSON-ish body; records when each request arrived."""
    listener = socket.create_server(("127.0.0.1", 0))
    arrivals: list[float] = []
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except OSError:
                continue
            arrivals.append(time.monotonic())
            with connection, contextlib.suppress(OSError):
                connection.recv(65536)
                connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n")
                for number in range(header_lines):
                    if stop.wait(0.3):
                        return
                    connection.sendall(f"X-Slow-{number}: 1\r\n".encode())
                connection.sendall(f"Content-Length: {answer_bytes}\r\n\r\n".encode())
                chunk = b" " * 65536
                for _ in range(answer_bytes // len(chunk)):
                    connection.sendall(chunk)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", arrivals
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def test_a_dribbling_service_costs_one_deadline_not_one_timeout_per_read() -> None:
    """Each header line comes well within the per-read timeout; 30 of them would take 9 s."""
    with dribbling_service(answer_bytes=0, header_lines=30) as (url, arrivals):
        settings = sources.Settings(url, None, False, Path("unused"), 0.0)
        start = time.monotonic()
        assert client.fetch_from_service(settings, H100, KEY) is None
        elapsed = time.monotonic() - start
    assert 0.9 * client.SERVICE_TIMEOUT_S <= elapsed < client.SERVICE_TIMEOUT_S + 1.0
    assert len(arrivals) == 1


def test_a_lookup_from_inside_a_running_event_loop_is_served() -> None:
    """A notebook runs the op inside its event loop: the lookup's own loop must not collide."""
    import asyncio

    with fake_service(200, _answer({"slab_v": 8192})) as (url, _fake):
        settings = sources.Settings(url, None, False, Path("unused"), 0.0)

        async def op_call() -> sources.Found | None:
            return client.fetch_from_service(settings, H100, KEY)

        assert asyncio.run(op_call()) == sources.Found({"slab_v": 8192}, "exact")


def test_why_a_service_is_unusable_names_the_cause_not_its_exception_group() -> None:
    """A port out of range failed inside anyio's task group: the reason (the op's log line, `cce
    lookup --url`'s error) read 'ExceptionGroup: unhandled errors in a TaskGroup (1 sub-exception)'."""
    settings = sources.Settings("http://127.0.0.1:99999", None, False, Path("unused"), 0.0)
    with pytest.raises(client.ServiceUnusable) as refused:
        client.ask_service(settings, H100, KEY)
    assert "ExceptionGroup" not in str(refused.value) and "port must be 0-65535" in str(refused.value)


def test_a_process_forked_while_a_thread_resolves_resolves_in_the_child(monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread holds the ladder's lock for a whole lookup (up to the service's deadline, or a
    rank's wait for rank 0): a process forked meanwhile (a DataLoader worker, multiprocessing's
    fork) inherited the lock held by a thread it does not have, and its first resolution hung
    forever."""
    with fake_service(200, None) as (url, _fake):
        monkeypatch.setenv(sources.URL_ENV, url)
        resolving = threading.Thread(target=resolution_for, args=(KEY,))
        resolving.start()
        deadline = time.monotonic() + 5
        while not resolve._memo_lock.locked() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert resolve._memo_lock.locked()
        child = os.fork()
        if child == 0:  # pragma: no cover - the child's outcome is its exit status
            os.environ[sources.OFFLINE_ENV] = "1"
            os._exit(0 if resolution_for(SMALL_KEY) == _heuristic(SMALL_KEY) else 1)
        resolving.join()
        deadline = time.monotonic() + 20
        while (ended := os.waitpid(child, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if ended[0] == 0:
            os.kill(child, 9)
            os.waitpid(child, 0)
        assert ended[0] == child, "the forked child hung on the ladder's lock"
        assert os.waitstatus_to_exitcode(ended[1]) == 0


def test_an_oversized_answer_is_not_read_whole() -> None:
    with dribbling_service(answer_bytes=64 << 20, header_lines=0) as (url, _arrivals):
        settings = sources.Settings(url, None, False, Path("unused"), 0.0)
        assert client.fetch_from_service(settings, H100, KEY) is None
    assert client._service_down is not None and str(client.MAX_ANSWER_BYTES) in client._service_down


# (3) a lying service ------------------------------------------------------------------


def _answer(config: Any, match_level: Any = "exact") -> bytes:
    return json.dumps({"match_level": match_level, "config": config, "entry_id": 1}).encode()


@pytest.mark.parametrize(
    ("status", "body", "requests"),
    [
        pytest.param(200, _answer({"forward": {"block_m": 48}}), 2, id="block_m-not-a-power-of-two"),
        pytest.param(200, _answer({"slab_v": 1 << 20}), 2, id="slab_v-out-of-range"),
        pytest.param(
            200, _answer({"forward": {"block_m": 256, "block_n": 256, "block_k": 128, "num_stages": 4}}), 2,
            id="exceeds-shared-memory",
        ),
        pytest.param(200, _answer({"forward": {"pre_hook": "os.system('x')"}}), 2, id="unknown-key"),
        pytest.param(200, _answer([64, 64]), 2, id="config-not-an-object"),
        pytest.param(200, _answer({"slab_v": 8192}, "perfect"), 2, id="unknown-match-level"),
        pytest.param(200, b"<html>not json", 2, id="not-json"),
        pytest.param(200, b"[1, 2]", 2, id="not-an-object"),
        pytest.param(200, b"[" * 200_000, 2, id="nested-past-the-parser-depth"),
        pytest.param(200, _answer({"forward": {"num_warps": 4.0}}), 2, id="num_warps-a-float"),
        pytest.param(200, _answer({"slab_v": 8192.0}), 2, id="slab_v-a-float"),
        pytest.param(500, b"{}", 2, id="server-error-retried-once-then-given-up"),
        pytest.param(401, b'{"detail": "no"}', 1, id="unauthorized-given-up"),
    ],
)
def test_bad_answers_are_rejected_and_the_ladder_goes_on(
    status: int, body: bytes, requests: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _bundle(tmp_path / "bundled", KEY, {"slab_v": 2048})
    with fake_service(status, body) as (url, fake):
        monkeypatch.setenv(sources.URL_ENV, url)
        monkeypatch.setenv(sources.TOKEN_ENV, "secret-token")
        assert resolution_for(KEY) == Resolution(KernelConfig(slab_v=2048), "bundled", "exact")
        assert resolution_for(SMALL_KEY) == _heuristic(SMALL_KEY)
    assert fake.requests == ["Bearer secret-token"] * requests, "garbage is per key; failures trip the breaker"
    assert not (tmp_path / "configs").exists(), "only accepted service answers reach the disk cache"


def test_whatever_breaks_in_the_lookup_is_a_miss_not_the_callers_exception(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A body that is not the gzip its header says (httpx.DecodingError), a port out of range
    (an ExceptionGroup from anyio), a non-ASCII token (UnicodeEncodeError): each once escaped
    from the op's call into the training step."""
    _bundle(tmp_path / "bundled", KEY, {"slab_v": 2048})
    with fake_service(200, b"not gzip at all", {"Content-Encoding": "gzip"}) as (url, fake):
        for service_url, token in ((url, "secret-token"), ("http://127.0.0.1:99999", "secret-token"),
                                   (url, "t\u00f6ken-token")):
            resolve.reset()
            monkeypatch.setenv(sources.URL_ENV, service_url)
            monkeypatch.setenv(sources.TOKEN_ENV, token)
            assert resolution_for(KEY) == Resolution(KernelConfig(slab_v=2048), "bundled", "exact")
            assert client._service_down is not None
    assert fake.requests == ["Bearer secret-token"], "the non-ASCII token is refused before a request"
    assert "CCE_TUNING_TOKEN is not ASCII" in client._service_down


def test_a_token_that_cannot_be_a_header_is_refused_unquoted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A line break in CCE_TUNING_TOKEN made the HTTP client refuse the header, and its error,
    which the op logged (and `cce lookup --url` printed), quoted 'Bearer <token>' whole. A
    secret file's trailing newline is stripped, as the service strips its own tokens."""
    _bundle(tmp_path / "bundled", KEY, {"slab_v": 2048})
    with fake_service(200, _answer({"slab_v": 8192})) as (url, fake):
        monkeypatch.setenv(sources.URL_ENV, url)
        monkeypatch.setenv(sources.TOKEN_ENV, "secret-token\r\nX-Injected: 1")
        assert resolution_for(KEY) == Resolution(KernelConfig(slab_v=2048), "bundled", "exact")
        assert fake.requests == [], "refused before a request"
        assert "secret-token" not in caplog.text and "secret-token" not in client._service_down
        assert "CCE_TUNING_TOKEN holds a space or a control character" in client._service_down

        resolve.reset()
        monkeypatch.setenv(sources.TOKEN_ENV, "secret-token\n")
        assert resolution_for(KEY) == Resolution(KernelConfig(slab_v=8192), "service", "exact")
        assert fake.requests == ["Bearer secret-token"]


def test_the_http_clients_request_log_hides_the_password_in_the_service_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """httpx logs every request's URL at INFO ('HTTP Request: GET http://user:password@...'): a
    training script that logs at INFO (logging.basicConfig(level=logging.INFO)) wrote the
    password of CCE_TUNING_URL (a gateway's basic auth) to its log on the op's first call."""
    caplog.set_level(logging.INFO)
    with fake_service(200, _answer({"slab_v": 8192})) as (url, fake):
        monkeypatch.setenv(sources.URL_ENV, url.replace("http://", "http://node:gateway-password@"))
        assert resolution_for(KEY) == Resolution(KernelConfig(slab_v=8192), "service", "exact")
    assert len(fake.requests) == 1
    assert "HTTP Request: GET http://node:***@127.0.0.1" in caplog.text, "the request is still logged"
    assert "gateway-password" not in caplog.text


def test_the_cache_dir_expands_the_home_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CCE_CONFIG_CACHE_DIR written as the README writes its default (~/.cache/...) made a
    directory named '~' under the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv(sources.CACHE_DIR_ENV, "~/configs")
    assert sources.Settings.from_env().cache_dir == tmp_path / "configs"


@contextmanager
def closing_after_500_service() -> Iterator[tuple[str, list[float]]]:
    """An HTTP/1.1 server that answers 500 as uvicorn does for an unhandled exception: a
    complete answer that keeps the connection open (no Connection: close), closed a moment
    later (once the traceback is logged); records each request it reads."""
    requests: list[float] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            requests.append(time.monotonic())
            body = b"Internal Server Error"
            self.send_response(500)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()
            time.sleep(0.3)
            self.close_connection = True

        def log_message(self, *args: Any) -> None:
            pass

    with loopback_server(Handler) as url:
        yield url, requests


def test_a_500_is_retried_on_a_new_connection_and_named() -> None:
    """The retry after a 500 went out on the connection the server was closing: it failed at
    once (ReadError), never reached the service, and the breaker's reason (the op's warning,
    `cce lookup --url`'s error) read 'ReadError: ' instead of the 500."""
    with closing_after_500_service() as (url, requests):
        settings = sources.Settings(url, None, False, Path("unused"), 0.0)
        with pytest.raises(client.ServiceUnusable) as refused:
            client.ask_service(settings, H100, KEY)
    assert len(requests) == 2
    assert str(refused.value) == "HTTP 500: Internal Server Error"


def test_a_hung_name_lookup_keeps_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """asyncio.run waits for the resolver's thread after the deadline cancels the request: a
    host whose DNS lookup hangs (an unreachable resolver) once held the op 8 s, not 1.5."""
    resolving = socket.getaddrinfo

    def hanging(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host in ("tuning.invalid", b"tuning.invalid"):
            time.sleep(6)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return resolving(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", hanging)
    settings = sources.Settings("http://tuning.invalid:8000", None, False, Path("unused"), 0.0)
    start = time.monotonic()
    assert client.fetch_from_service(settings, H100, KEY) is None
    assert time.monotonic() - start < client.SERVICE_TIMEOUT_S + 1.0
    assert "within" in client._service_down


def test_an_invalid_bundled_entry_is_skipped(tmp_path: Path) -> None:
    _bundle(tmp_path / "bundled", KEY, {"grad_hidden": {"num_warps": 3}})
    assert resolution_for(KEY) == _heuristic(KEY)


def test_a_bundled_entry_for_other_kernels_is_skipped(tmp_path: Path) -> None:
    _bundle(tmp_path / "bundled", KEY, TUNED, kernel_version="0123456789ab")
    assert resolution_for(KEY) == _heuristic(KEY)


def test_the_shipped_bundled_configs_are_valid_and_tuned_for_these_kernels() -> None:
    """Editing a kernel (or a Policy threshold) orphans the bundled configs until they are
    re-tuned, or re-stamped after the benchmark confirms them (config/bundled/README.md)."""
    paths = sorted(SHIPPED_BUNDLED_DIR.glob("*.json"))
    assert paths, f"no bundled configs in {SHIPPED_BUNDLED_DIR}"
    for path in paths:
        for entry in json.loads(path.read_text())["entries"]:
            KernelConfig.from_dict(entry["config"])
            assert entry["kernel_version"] == platform.kernel_version(), f"{path.name}: stale entry {entry}"


def _refusal() -> OutOfResources:
    """What Triton raises for a config whose pipeline stages overflow the GPU's shared memory."""
    return OutOfResources(264_192, 232_448, "shared memory")


def _refusing_launch(refused: set[str], launched: list[KernelConfig]) -> Any:
    """A launch that Triton refuses for the configs whose slab_v is in `refused`, and records
    every config it is given."""

    def launch(config: KernelConfig, policy: Policy) -> str:
        launched.append(config)
        if str(config.slab_v) in refused:
            raise _refusal()
        return f"ran with slab_v={config.slab_v}"

    return launch


def _failing_cache_above_a_bundle(tmp_path: Path) -> tuple[torch.Tensor, torch.Tensor, Policy, ProblemKey]:
    """Small inputs whose key has a cached config (slab_v 256, which _refusing_launch({"256"})
    fails) above a bundled one (512)."""
    e, c, _targets = _small_inputs()
    policy = Policy()
    key = problem_key(e, c, False, policy)
    sources.write_cache(_settings(), H100, key, sources.Found({"slab_v": 256}, "exact"))
    _bundle(tmp_path / "bundled", key, {"slab_v": 512})
    return e, c, policy, key


def test_a_config_that_fails_to_launch_falls_back_to_the_next_source(tmp_path: Path) -> None:
    e, c, policy, key = _failing_cache_above_a_bundle(tmp_path)
    launched: list[KernelConfig] = []
    launch = _refusing_launch({"256"}, launched)

    with override_policy(policy):
        assert launch_with_config(e, c, False, "", launch) == "ran with slab_v=512"
        assert _memoized(key).source == "bundled"
        assert not sources.cache_path(_settings(), H100, key).exists(), "the failing cached config is forgotten"
        assert launch_with_config(e, c, False, "", launch) == "ran with slab_v=512"
    assert [config.slab_v for config in launched] == [256, 512, 512], "one failed launch per process, not per call"


@pytest.mark.parametrize("refusal", [
    CompilationError("", None, "arange's range must be a power of 2"),
    PTXASError("Entry function uses too much shared data"),
    RuntimeError("Triton Error [CUDA]: too many resources requested for launch"),
    RuntimeError("PassManager::run failed"),  # an MLIR pass refusing the config's layout
], ids=["compilation", "ptxas", "launch-resources", "mlir-pass"])
def test_each_way_triton_refuses_a_config_falls_back(tmp_path: Path, refusal: Exception) -> None:
    e, c, policy, key = _failing_cache_above_a_bundle(tmp_path)
    launched: list[int] = []

    def launch(config: KernelConfig, policy: Policy) -> str:
        launched.append(config.slab_v)
        if config.slab_v == 256:
            raise refusal
        return "ran"

    with override_policy(policy):
        assert launch_with_config(e, c, False, "", launch) == "ran"
    assert launched == [256, 512]
    assert _memoized(key).source == "bundled"


def test_running_out_of_memory_is_raised_and_the_config_kept(tmp_path: Path) -> None:
    """Running out of memory says nothing about the config: it is raised, the tuned config
    (and its cache file) kept."""
    e, c, policy, key = _failing_cache_above_a_bundle(tmp_path)
    launched: list[int] = []
    error = torch.OutOfMemoryError("CUDA out of memory")

    def launch(config: KernelConfig, policy: Policy) -> str:
        launched.append(config.slab_v)
        raise error

    with override_policy(policy), pytest.raises(torch.OutOfMemoryError) as raised:
        launch_with_config(e, c, False, "", launch)
    assert raised.value is error
    assert launched == [256]
    assert _memoized(key).source == "disk"
    assert sources.cache_path(_settings(), H100, key).exists()


def test_linear_log_probs_falls_back_from_a_config_that_fails_to_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """linear_log_probs' forward launches through launch_with_config as the loss's does: a
    cached config that fails to launch is dropped for the bundled one, not raised."""
    e, c, policy, key = _failing_cache_above_a_bundle(tmp_path)
    tokens = _small_inputs()[2]
    real = log_probs_ops.row_and_filter_stats
    launched: list[int] = []

    def refusing(plan, config, *args):
        launched.append(config.slab_v)
        if config.slab_v == 256:
            raise _refusal()
        return real(plan, config, *args)

    monkeypatch.setattr(log_probs_ops, "row_and_filter_stats", refusing)
    with override_policy(policy):
        log_probs = linear_log_probs(e, c, tokens)
    assert launched == [256, 512]
    assert _memoized(key).source == "bundled"
    torch.testing.assert_close(log_probs, torch.log_softmax(e @ c.T, dim=-1).gather(1, tokens[:, None])[:, 0])


def test_a_served_config_that_fails_to_launch_is_not_launched_again_from_its_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """look_up writes a served config to the disk cache; when it failed, the next resolution
    once launched that copy (and failed again) before reaching the bundle."""
    e, c, _targets = _small_inputs()
    policy = Policy()
    key = problem_key(e, c, False, policy)
    _bundle(tmp_path / "bundled", key, {"slab_v": 512})
    launched: list[KernelConfig] = []
    with fake_service(200, _answer({"slab_v": 256})) as (url, _fake), override_policy(policy):
        monkeypatch.setenv(sources.URL_ENV, url)
        assert launch_with_config(e, c, False, "", _refusing_launch({"256"}, launched)) == "ran with slab_v=512"
    assert [config.slab_v for config in launched] == [256, 512]
    assert not sources.cache_path(_settings(), H100, key).exists()


def test_a_cached_config_that_fails_to_launch_is_not_launched_again_as_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk cache holds the service's answer: once the cached config failed, the ladder
    asked the service, which answered the same config, and it failed a second time (a traced
    call raised twice, each wanting a torch._dynamo.reset())."""
    e, c, policy, key = _failing_cache_above_a_bundle(tmp_path)
    launched: list[KernelConfig] = []
    with fake_service(200, _answer({"slab_v": 256})) as (url, fake), override_policy(policy):
        monkeypatch.setenv(sources.URL_ENV, url)
        assert launch_with_config(e, c, False, "", _refusing_launch({"256"}, launched)) == "ran with slab_v=512"
    assert [config.slab_v for config in launched] == [256, 512]
    assert _memoized(key).source == "bundled"
    assert not sources.cache_path(_settings(), H100, key).exists()


def test_a_config_two_threads_failed_drops_its_own_source_only(tmp_path: Path) -> None:
    """Two threads launch the cached config, and both fail. The first drops the cache and
    launches the bundled config; the second's failure once dropped whatever the memo held by
    then (the bundled config, which never failed: the key fell to the heuristic), or, with the
    memo empty between the first's drop and its new resolution, was raised into its call."""
    e, c, policy, key = _failing_cache_above_a_bundle(tmp_path)
    launched: list[KernelConfig] = []
    refusing = _refusing_launch({"256"}, launched)
    both_failed, first_done = threading.Barrier(2, timeout=10), threading.Event()
    results: dict[str, Any] = {}

    def call(name: str) -> None:
        def launch(config: KernelConfig, policy: Policy) -> str:
            if config.slab_v == 256:
                both_failed.wait()
                if name == "second":
                    first_done.wait(10)
            return refusing(config, policy)

        try:
            with override_policy(policy):
                results[name] = launch_with_config(e, c, False, "", launch)
        except Exception as error:
            results[name] = repr(error)
        finally:
            if name == "first":
                first_done.set()

    threads = [threading.Thread(target=call, args=(name,)) for name in ("first", "second")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert results == {"first": "ran with slab_v=512", "second": "ran with slab_v=512"}
    assert _memoized(key).source == "bundled"
    assert sorted(config.slab_v for config in launched) == [256, 256, 512, 512]


def test_when_every_rung_fails_to_launch_the_error_is_raised(tmp_path: Path) -> None:
    e, c, _targets = _small_inputs()
    policy = Policy()
    key = problem_key(e, c, False, policy)
    _bundle(tmp_path / "bundled", key, {"slab_v": 512})
    launched: list[KernelConfig] = []
    everything = {"512", str(heuristic_config(key).slab_v)}
    with override_policy(policy), pytest.raises(OutOfResources, match="shared memory"):
        launch_with_config(e, c, False, "", _refusing_launch(everything, launched))
    assert [config.slab_v for config in launched] == [512, heuristic_config(key).slab_v]


def test_an_override_that_fails_to_launch_is_raised_at_once() -> None:
    e, c, _targets = _small_inputs()
    launched: list[KernelConfig] = []
    with override_config(KernelConfig(slab_v=2048)), override_policy(Policy()), pytest.raises(OutOfResources):
        launch_with_config(e, c, False, "", _refusing_launch({"2048"}, launched))
    assert len(launched) == 1


def test_a_traced_config_that_fails_to_launch_is_raised_and_only_its_own_source_dropped(tmp_path: Path) -> None:
    """A call traced by torch.compile launches with the config it was traced for (its graph's
    sizes and backward were made for it): a failure is raised, naming the way out, and its
    source dropped for the next trace. The graph runs it again at its next call, when the
    ladder has moved on: raised again, and the next source (the one that works) is kept."""
    e, c, policy, key = _failing_cache_above_a_bundle(tmp_path)
    launched: list[KernelConfig] = []
    with override_policy(policy):
        traced = encode_settings(resolve_config(key), policy)
        for _ in range(2):
            with pytest.raises(RuntimeError, match=r"traced with failed to launch.*torch._dynamo.reset\(\)"):
                launch_with_config(e, c, False, traced, _refusing_launch({"256"}, launched))
            assert resolve_config(key).slab_v == 512
    assert [config.slab_v for config in launched] == [256, 256]


def _refusing_backward(monkeypatch: pytest.MonkeyPatch, refused: int) -> list[int]:
    """The loss's backward refused by Triton for the configs of slab_v `refused`; returns the
    slab_v of every config it is given."""
    real = library.run_backward
    launched: list[int] = []

    def refusing(plan, config, *args):
        launched.append(config.slab_v)
        if config.slab_v == refused:
            raise _refusal()
        return real(plan, config, *args)

    monkeypatch.setattr(library, "run_backward", refusing)
    return launched


def test_a_config_the_backward_alone_fails_to_launch_falls_back_in_exact_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """memory="low"'s backward launches with the forward's config. Where its kernels are
    refused after the forward's launched, the backward raised: the recompute reads only the
    forward's lse, so it takes the next rung's config as the forward would."""
    e, c, policy, key = _failing_cache_above_a_bundle(tmp_path)
    targets = _small_inputs()[2]
    launched = _refusing_backward(monkeypatch, 256)
    e.requires_grad_(True)
    with override_policy(policy):
        linear_cross_entropy(e, c, targets, memory="low").backward()
    assert launched == [256, 512]
    assert _memoized(key).source == "bundled"
    assert not sources.cache_path(_settings(), H100, key).exists()
    expected = e.detach().clone().requires_grad_(True)
    F.cross_entropy(expected @ c.T, targets).backward()
    torch.testing.assert_close(e.grad, expected.grad)


def test_a_config_the_filtered_backward_fails_to_launch_is_raised_and_dropped_for_the_next_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Filtered mode's backward reads the kept tiles the forward laid out by its config: it
    cannot take another. It raises, naming why, and the next call runs with the next rung."""
    e, c, targets = _small_inputs()
    policy = Policy()
    key = problem_key(e, c, True, policy)
    sources.write_cache(_settings(), H100, key, sources.Found({"slab_v": 256}, "exact"))
    _bundle(tmp_path / "bundled", key, {"slab_v": 512})
    launched = _refusing_backward(monkeypatch, 256)
    e.requires_grad_(True)
    with override_policy(policy):
        with pytest.raises(RuntimeError, match="filtered mode's backward reads the forward's tiles") as raised:
            linear_cross_entropy(e, c, targets, filter_eps=1e-30, memory="low").backward()
        assert isinstance(raised.value.__cause__, OutOfResources)
        assert not sources.cache_path(_settings(), H100, key).exists()
        linear_cross_entropy(e, c, targets, filter_eps=1e-30, memory="low").backward()
    assert launched == [256, 512]


def test_a_traced_config_the_backward_fails_to_launch_is_raised_as_the_forwards_is(tmp_path: Path) -> None:
    e, c, policy, key = _failing_cache_above_a_bundle(tmp_path)
    launched: list[KernelConfig] = []
    with override_policy(policy):
        traced = platform.package_source_version() + "." + encode_settings(resolve_config(key), policy)
        with pytest.raises(RuntimeError, match=r"traced with failed to launch.*torch._dynamo.reset\(\)"):
            launch_backward_with_config(e, c, False, traced, _refusing_launch({"256"}, launched))
        assert resolve_config(key).slab_v == 512
    assert [config.slab_v for config in launched] == [256]


def test_an_override_the_backward_fails_to_launch_off_its_thread_is_raised(tmp_path: Path) -> None:
    """Autograd runs a CUDA backward on a device thread, where the forward's override is not
    active: its failure there once counted as the memoized config's (another thread's drop),
    and the backward launched the ladder's config instead of raising."""
    e, c, policy, key = _failing_cache_above_a_bundle(tmp_path)
    launched: list[KernelConfig] = []
    with override_policy(policy):
        assert resolve_config(key).slab_v == 256
        overridden = encode_settings(KernelConfig(slab_v=2048), policy)
        with pytest.raises(OutOfResources):
            launch_backward_with_config(e, c, False, overridden, _refusing_launch({"2048"}, launched))
    assert [config.slab_v for config in launched] == [2048]
    assert _memoized(key).source == "disk"


def test_a_call_resolves_for_its_operands_gpu_not_the_current_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a host of several GPUs the config was looked up (tuned configs, shared memory, the
    cache file a refused one is removed from) for the current GPU's platform, not for the
    operands': torch.compile traces a call outside the op's device guard. Fake tensors on
    cuda:1 stand in for the operands, as they do where a call is traced."""
    asked: list[tuple[str, int | None]] = []
    monkeypatch.setattr(resolve, "local_platform", lambda device, gpu=None: asked.append((device, gpu)) or H100)
    policy = Policy()
    with FakeTensorMode():
        e = torch.empty(SMALL["n"], SMALL["d"], device="cuda:1")
        c = torch.empty(SMALL["v"], SMALL["d"], device="cuda:1")
        key = problem_key(e, c, False, policy)
        sources.write_cache(_settings(), H100, key, sources.Found({"slab_v": 256}, "exact"))
        _bundle(tmp_path / "bundled", key, {"slab_v": 512})
        with override_policy(policy):
            assert launch_with_config(e, c, False, "", _refusing_launch({"256"}, [])) == "ran with slab_v=512"
    assert asked == [("cuda", 1)] * 3, "resolved, the refused config's cache removed, resolved again"


def _two_gpu_models(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any, ProblemKey]:
    """A host whose cuda:0 is an H100 and cuda:1 an A100, each with its own cached config for
    the key of the (fake) operands both calls take, placed on either GPU."""
    platforms = {0: H100, 1: A100}
    monkeypatch.setattr(resolve, "local_platform", lambda device, gpu=None: platforms[gpu])
    monkeypatch.setattr(resolve, "gpu_model", lambda device, gpu=None: platforms[gpu].gpu)
    with FakeTensorMode():
        operands = [(torch.empty(SMALL["n"], SMALL["d"], device=f"cuda:{gpu}"),
                     torch.empty(SMALL["v"], SMALL["d"], device=f"cuda:{gpu}")) for gpu in platforms]
    key = problem_key(*operands[0], False, Policy())
    assert problem_key(*operands[1], False, Policy()) == key
    for gpu, slab_v in ((0, 2048), (1, 512)):
        sources.write_cache(_settings(), platforms[gpu], key, sources.Found({"slab_v": slab_v}, "exact"))
    return operands[0], operands[1], key


def test_each_gpu_model_resolves_a_key_for_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """The memo was keyed by the problem alone: on a host of two GPU models the first to
    resolve a key fixed its config for calls on the other too (an H100's config on the A100,
    past its shared memory, or tuned for another chip), though each resolution is made for the
    operands' GPU. Eager calls (config_for) and traced ones (_settings_for_key) alike."""
    on_h100, on_a100, key = _two_gpu_models(monkeypatch)
    policy = Policy()
    with override_policy(policy):
        assert config_for(*on_h100, False, policy).slab_v == 2048
        assert config_for(*on_a100, False, policy).slab_v == 512, "the A100 took the H100's config"
        assert config_for(*on_h100, False, policy).slab_v == 2048
        traced = _settings_for_key(True, key.v, key.d, key.dtype, key.n_bucket, False, 1)
        assert decode_settings(traced)[0].slab_v == 512
    assert resolved() == {(H100.gpu, key): Resolution(KernelConfig(slab_v=2048), "disk", "exact"),
                          (A100.gpu, key): Resolution(KernelConfig(slab_v=512), "disk", "exact")}


def test_a_config_that_fails_on_one_gpu_model_stays_on_the_other(monkeypatch: pytest.MonkeyPatch) -> None:
    """A config that fails to launch on the A100 (its shared memory is smaller) says nothing
    of the H100: only the A100 drops its source, and its cache file."""
    _on_h100, _on_a100, key = _two_gpu_models(monkeypatch)
    a100_config = resolve_config(key, 1)
    assert resolve_config(key, 0).slab_v == 2048
    assert resolve.launch_failed(key, OutOfResources(1, 0, "shared memory"), a100_config, 1)
    assert resolution_for(key, 1) == _heuristic(key)
    assert resolution_for(key, 0) == Resolution(KernelConfig(slab_v=2048), "disk", "exact")
    assert sources.cache_path(_settings(), H100, key).exists()
    assert not sources.cache_path(_settings(), A100, key).exists()


# (4) the disk cache -------------------------------------------------------------------


def _cache(config: Any, match_level: str = "nearest_bucket") -> Path:
    sources.write_cache(_settings(), H100, KEY, sources.Found(config, match_level))
    return sources.cache_path(_settings(), H100, KEY)


def test_a_fresh_cache_file_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(sources.OFFLINE_ENV, "1")
    _cache(TUNED)
    assert resolution_for(KEY) == Resolution(KernelConfig.from_dict(TUNED), "disk", "nearest_bucket")


@pytest.mark.parametrize(
    "content",
    [
        pytest.param('{"stored_at": ', id="truncated"),
        pytest.param("\x00\xff garbage", id="binary"),
        pytest.param("[]", id="not-an-object"),
        pytest.param('{"match_level": "exact", "config": {}}', id="no-timestamp"),
        pytest.param('{"stored_at": "now", "match_level": "exact", "config": {}}', id="timestamp-not-a-number"),
        pytest.param('{"stored_at": 1' + "0" * 400 + ', "match_level": "exact", "config": {}}',
                     id="timestamp-past-any-float"),
        pytest.param('{"stored_at": NOW, "match_level": "none", "config": {}}', id="no-match"),
        pytest.param(
            '{"stored_at": NOW, "match_level": "exact", "config": {"forward": {"block_m": 48}}}', id="bad-config"
        ),
        pytest.param('{"stored_at": NOW, "match_level": "exact", "config": "slab_v=8192"}', id="config-not-an-object"),
        pytest.param("[" * 200_000, id="nested-past-the-parser-depth"),
        pytest.param(
            '{"stored_at": NOW, "match_level": "exact", "config": {"grad_logits": {"num_warps": 4.0}}}',
            id="num_warps-a-float",
        ),
        pytest.param('{"stored_at": NOW, "match_level": "exact", "config": {}, "pad": "' + "x" * (2 << 20) + '"}',
                     id="larger-than-any-config"),
    ],
)
def test_a_corrupt_cache_file_is_a_miss(content: str) -> None:
    path = _cache(TUNED)
    path.write_text(content.replace("NOW", str(time.time())))
    assert resolution_for(KEY) == _heuristic(KEY)


def test_an_expired_cache_file_is_a_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    path = _cache(TUNED)
    record = json.loads(path.read_text())
    record["stored_at"] -= 120
    path.write_text(json.dumps(record))
    monkeypatch.setenv(sources.CACHE_TTL_ENV, "60")
    assert resolution_for(KEY) == _heuristic(KEY)
    resolve.reset()
    monkeypatch.setenv(sources.CACHE_TTL_ENV, "600")
    assert resolution_for(KEY).source == "disk"


@pytest.mark.parametrize("value", ["abc", "nan", "inf", "-60"])
def test_a_bad_cache_ttl_is_warned_about_and_the_default_used(
    value: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """'abc' was; nan and -60 silently made the TTL 0 (the cache off), inf kept files forever."""
    _cache(TUNED)
    monkeypatch.setenv(sources.CACHE_TTL_ENV, value)
    assert resolution_for(KEY).source == "disk"
    assert _settings().ttl_s == sources.DEFAULT_TTL_S
    assert f"ignoring {sources.CACHE_TTL_ENV}={value!r}" in caplog.text


@pytest.mark.parametrize("value", ["inf", "1e300", "nan"])
def test_a_rank_waits_for_rank_0_whatever_the_wait_setting(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """inf and 1e300 overflowed the store wait's timedelta, taken for rank 0's timeout: the
    rank resolved its own config at once; nan waited 0 s."""
    monkeypatch.setenv(resolve.WAIT_ENV, value)
    wait_s = resolve._wait_s()
    assert 1.0 <= wait_s < math.inf
    assert timedelta(seconds=wait_s).total_seconds() == wait_s


def test_the_cache_is_written_atomically_and_survives_an_unwritable_directory(tmp_path: Path) -> None:
    path = _cache(TUNED)
    assert [p.name for p in path.parent.iterdir()] == [path.name], "no temporary file is left behind"
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache directory should be")
    settings = sources.Settings(None, None, False, blocked, 60.0)
    sources.write_cache(settings, H100, KEY, sources.Found(TUNED, "exact"))  # logged, not raised
    assert sources.read_cache(settings, H100, KEY) is None


def test_a_cache_path_that_is_no_regular_file_is_a_miss_at_once(tmp_path: Path) -> None:
    """A FIFO at the cache file's path held the op's first call for the key forever."""
    path = sources.cache_path(_settings(), H100, KEY)
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    answers: list[Resolution] = []
    looking = threading.Thread(target=lambda: answers.append(resolution_for(KEY)), daemon=True)
    looking.start()
    looking.join(10)
    if looking.is_alive():  # let the thread go: a writer that opens the FIFO unblocks its read
        with open(path, "wb"):
            pass
        pytest.fail("reading a FIFO at the cache path blocked")
    assert answers == [_heuristic(KEY)]


# (5) offline --------------------------------------------------------------------------


def test_offline_makes_no_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with fake_service(200, _answer(TUNED)) as (url, fake):
        monkeypatch.setenv(sources.URL_ENV, url)
        monkeypatch.setenv(sources.OFFLINE_ENV, "1")
        assert resolution_for(KEY) == _heuristic(KEY)
        monkeypatch.delenv(sources.OFFLINE_ENV)
        resolve.reset()
        assert resolution_for(KEY).source == "service"
    assert len(fake.requests) == 1


def test_the_op_loads_no_web_stack_without_a_reachable_service(tmp_path: Path) -> None:
    """Offline with a URL set, the op resolves and runs without importing httpx."""
    check = (
        "import sys, torch, cce_compile\n"
        "cce_compile.linear_cross_entropy(torch.randn(8, 16), torch.randn(64, 16), torch.zeros(8, dtype=torch.long))\n"
        "from cce_compile.resolve.ladder import resolved\n"
        "print([r.source for r in resolved().values()], "
        "[m for m in ('httpx', 'fastapi', 'sqlalchemy', 'pydantic') if m in sys.modules])\n"
    )
    env = {
        **os.environ,
        sources.URL_ENV: "http://127.0.0.1:9",
        sources.OFFLINE_ENV: "1",
        sources.CACHE_DIR_ENV: str(tmp_path),
        "TRITON_INTERPRET": "0",
    }
    result = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, cwd=REPO_ROOT, env=env, check=True, timeout=120
    )
    assert result.stdout.strip() == "['heuristic'] []", result.stderr


# (6) cce lookup -----------------------------------------------------------------------


def test_cce_lookup_prints_the_service_config(service: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(sources.TOKEN_ENV, READ_TOKEN)
    args = ["lookup", "--gpu", GPU_H100["name"], "--vocab", "128256", "--hidden", "4096", "--dtype", "bf16"]
    args += ["--tokens", "8000", "--url", service]
    result = CliRunner().invoke(cce, [*args, "--json"])
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)
    assert (answer["gpu"], answer["source"], answer["match_level"]) == (H100_KEY, "service", "exact")
    assert answer["config"] == KernelConfig.from_dict(TUNED).to_dict()

    table = CliRunner().invoke(cce, args)  # the service again: a lookup caches nothing
    assert table.exit_code == 0 and "service" in table.stdout and "exact" in table.stdout
    refused = CliRunner().invoke(cce, [*args, "--dtype", "int8"])
    assert refused.exit_code == 2 and "unknown dtype" in refused.output


def _lookup_source(*options: str) -> str:
    """The source `cce lookup` names for KEY on the H100."""
    args = ["lookup", "--gpu", GPU_H100["name"], "--vocab", str(KEY.v), "--hidden", str(KEY.d), "--dtype", "bf16",
            "--tokens", str(KEY.n_bucket), "--json", *options]
    result = CliRunner().invoke(cce, args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["source"]


def test_cce_lookup_of_a_named_service_changes_nothing_the_op_launches(
    service: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`--url` once wrote that service's answer into the op's disk cache: the op, set up with
    no service at all, then launched it, and the next lookup said `disk`. Nor may the op's
    cache, filled from whatever CCE_TUNING_URL named, answer for the service --url names."""
    monkeypatch.setenv(sources.TOKEN_ENV, READ_TOKEN)
    assert _lookup_source("--url", service) == "service"
    assert not (tmp_path / "configs").exists()
    assert resolution_for(KEY) == _heuristic(KEY)
    _cache({"slab_v": 256})
    assert _lookup_source("--url", service) == "service"
    assert _lookup_source() == "disk"  # without --url: the op's ladder, cache first


def test_cce_lookup_asks_a_named_service_under_offline(service: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """CCE_TUNING_OFFLINE=1 once dropped --url without a word: the heuristic's config was
    printed as the answer. The variable still keeps the op's ladder (no --url) off the service."""
    monkeypatch.setenv(sources.TOKEN_ENV, READ_TOKEN)
    monkeypatch.setenv(sources.URL_ENV, service)
    monkeypatch.setenv(sources.OFFLINE_ENV, "1")
    assert _lookup_source() == "heuristic"
    assert _lookup_source("--url", service) == "service"


def test_cce_lookup_names_the_key_the_op_uses_on_this_machine() -> None:
    """Under the interpreter the op keys its configs 'interpreter' (as cce tune does); cce
    lookup without --gpu once looked up 'cpu' and reported the heuristic instead."""
    e, c, _targets = _small_inputs()
    args = ["lookup", "--vocab", str(SMALL["v"]), "--hidden", str(SMALL["d"]), "--tokens", str(SMALL["n"]),
            "--dtype", "fp32", "--json"]
    for kernels in (True, False):
        with override_policy(Policy(triton_on_cpu=kernels)):
            result = CliRunner().invoke(cce, args)
            assert result.exit_code == 0, result.output
            assert json.loads(result.stdout)["gpu"] == problem_key(e, c, False, Policy(triton_on_cpu=kernels)).device


# (7) torch.distributed ----------------------------------------------------------------


def _rank_config(rank: int, use: int) -> dict[str, Any]:
    """A config that differs per rank and per use."""
    return {"slab_v": 256 << rank, "vocab_splits": 1 << (2 * use + rank)}


def _rank_main(rank: int, root: str) -> None:
    with override_policy(Policy(triton_on_cpu=False)):
        _rank_main_body(rank, root)


def _rank_main_body(rank: int, root: str) -> None:
    """One gloo rank with its own disk cache and override: eager calls, then a compiled one
    that resolves a new key at trace time (where Dynamo traces the call: ops/problem.traced_settings)."""
    os.environ.update({sources.CACHE_DIR_ENV: f"{root}/rank{rank}", sources.OFFLINE_ENV: "1"})
    resolve.local_platform = lambda device, gpu=None: H100
    for use, key in enumerate((SMALL_KEY, replace(SMALL_KEY, n_bucket=512))):
        sources.write_cache(_settings(), H100, key, sources.Found(_rank_config(rank, use), "exact"))
    launched: list[KernelConfig] = []
    run_forward = library.run_forward
    library.run_forward = lambda plan, config, *args: launched.append(config) or run_forward(plan, config, *args)
    dist.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=2)
    try:
        if rank == 1:  # rank 0 meets every key first, so it resolves them all
            dist.barrier()
        e, c, targets = _small_inputs()
        linear_cross_entropy(e, c, targets)
        with override_config(KernelConfig.from_dict(_rank_config(rank, 2))):
            linear_cross_entropy(e, c, targets)
        linear_cross_entropy(e, c, targets)  # memoized: no collective, the same config
        compiled = torch.compile(linear_cross_entropy, backend="aot_eager", fullgraph=True)
        compiled(e.repeat(3, 1), c, targets.repeat(3))
        report = {"launched": [config.to_dict() for config in launched], "source": resolution_for(SMALL_KEY).source}
        if rank == 0:
            dist.barrier()
            # a new key on one rank only, with the exchange switched off
            os.environ[resolve.BROADCAST_ENV] = "0"
            linear_cross_entropy(e.repeat(7, 1), c, targets.repeat(7))
            report["alone"] = resolution_for(replace(SMALL_KEY, n_bucket=1024)).source
        Path(root, f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


def _failing_rank_main(rank: int, root: str) -> None:
    with override_policy(Policy(triton_on_cpu=False)):
        _failing_rank_main_body(rank, root)


def _failing_rank_main_body(rank: int, root: str) -> None:
    """Rank 0, elected for the key (rank 1 waits until it is), cannot resolve (its platform
    lookup fails): every rank must raise, none wait."""
    os.environ.update({sources.CACHE_DIR_ENV: f"{root}/rank{rank}", sources.OFFLINE_ENV: "1"})
    dist.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=2)
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        def broken(device: str, gpu: int | None = None):
            store.set("test/rank 0 resolves", "")
            raise RuntimeError("no GPU identity")

        resolve.local_platform = broken
    else:
        store.wait(["test/rank 0 resolves"])
    try:
        linear_cross_entropy(*_small_inputs())
    except RuntimeError as exc:
        Path(root, f"rank{rank}.txt").write_text(str(exc))
    finally:
        dist.destroy_process_group()


def _unordered_rank_main(rank: int, root: str) -> None:
    with override_policy(Policy(triton_on_cpu=False)):
        _unordered_rank_main_body(rank, root)


def _unordered_rank_main_body(rank: int, root: str) -> None:
    """The ranks meet the keys in opposite orders, and rank 1 also meets a bucket rank 0
    never runs: nobody hangs, the ranks agree on the shared keys (each the config of whichever
    rank met it first), and the lone key is rank 1's own at no wait (it once cost rank 1 the
    whole CCE_CONFIG_WAIT_S, waiting for rank 0)."""
    os.environ.update({sources.CACHE_DIR_ENV: f"{root}/rank{rank}", sources.OFFLINE_ENV: "1",
                       resolve.WAIT_ENV: "8"})
    resolve.local_platform = lambda device, gpu=None: H100
    keys = [SMALL_KEY, replace(SMALL_KEY, n_bucket=512)]
    for use, key in enumerate(keys):
        sources.write_cache(_settings(), H100, key, sources.Found(_rank_config(rank, use), "exact"))
    dist.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=2)
    try:
        order = keys if rank == 0 else keys[::-1] + [replace(SMALL_KEY, n_bucket=4096)]
        report = {str(key.n_bucket): resolve_config(key).to_dict() for key in order[:2]}
        started = time.monotonic()
        for key in order[2:]:
            report[str(key.n_bucket)] = resolve_config(key).to_dict()
            report["lone key s"] = time.monotonic() - started
        Path(root, f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_ranks_may_meet_keys_in_any_order(tmp_path: Path) -> None:
    mp.spawn(_unordered_rank_main, args=(str(tmp_path),), nprocs=2, join=True)
    rank0, rank1 = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2))
    assert rank1.pop("4096") == heuristic_config(replace(SMALL_KEY, n_bucket=4096)).to_dict()
    assert rank1.pop("lone key s") < 4
    assert rank0 == rank1
    for use, key in enumerate((SMALL_KEY, replace(SMALL_KEY, n_bucket=512))):
        assert rank0[str(key.n_bucket)] in [KernelConfig.from_dict(_rank_config(rank, use)).to_dict() for rank in range(2)]


def _mixed_models_rank_main(rank: int, root: str) -> None:
    """Rank 0 on an H100 resolves KEY first, then rank 1 on an A100, each with its own cached
    config; rank 1 then resolves KEY for an H100 it also drives (its cuda:1)."""
    os.environ.update({sources.CACHE_DIR_ENV: f"{root}/rank{rank}", sources.OFFLINE_ENV: "1"})
    platforms = {0: H100, 1: A100} if rank == 0 else {0: A100, 1: H100}
    resolve.local_platform = lambda device, gpu=None: platforms[gpu or 0]
    resolve.gpu_model = lambda device, gpu=None: platforms[gpu or 0].gpu
    sources.write_cache(_settings(), platforms[0], KEY, sources.Found(_rank_config(rank, 0), "exact"))
    dist.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=2)
    try:
        if rank == 1:
            dist.barrier()
        report = {platforms[0].gpu: resolve_config(KEY, 0).to_dict()}
        if rank == 1:
            report[platforms[1].gpu] = resolve_config(KEY, 1).to_dict()
        else:
            dist.barrier()
        Path(root, f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_ranks_on_another_gpu_model_resolve_a_key_for_theirs(tmp_path: Path) -> None:
    """Every rank took the config of the first rank to meet a key, whatever GPU that rank was
    resolving for: an A100 rank launched the H100 rank's config. Ranks of one model still agree."""
    mp.spawn(_mixed_models_rank_main, args=(str(tmp_path),), nprocs=2, join=True)
    rank0, rank1 = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2))
    h100_config, a100_config = (KernelConfig.from_dict(_rank_config(rank, 0)).to_dict() for rank in range(2))
    assert rank0 == {H100.gpu: h100_config}
    assert rank1 == {A100.gpu: a100_config, H100.gpu: h100_config}


def _slow_rank_main(rank: int, root: str, wait: str) -> None:
    """Rank 0, elected for a key, takes 5 s to resolve it; rank 1 asks for it meanwhile under
    CCE_CONFIG_WAIT_S=`wait`."""
    os.environ.update({sources.CACHE_DIR_ENV: f"{root}/rank{rank}", sources.OFFLINE_ENV: "1", resolve.WAIT_ENV: wait})
    dist.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=2)
    store = dist.distributed_c10d._get_default_store()
    try:
        if rank == 0:
            def slow(device: str, gpu: int | None = None) -> platform.Platform:
                store.set("test/rank 0 resolves", "")
                time.sleep(5)
                return H100

            resolve.local_platform = slow
            resolution_for(SMALL_KEY)
        else:
            resolve.local_platform = lambda device, gpu=None: H100
            store.wait(["test/rank 0 resolves"])
            started = time.monotonic()
            source = resolution_for(SMALL_KEY).source
            Path(root, "rank1.json").write_text(json.dumps({"source": source, "s": time.monotonic() - started}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("wait", ["0", "-5", "0.0001"])
def test_a_rank_that_waits_no_time_resolves_on_its_own(wait: str, tmp_path: Path) -> None:
    """A wait under a millisecond (0, a negative one) reached the store as 0 ms, which c10d
    takes for no timeout: under a file:// rendezvous (a FileStore) the rank waited forever
    for a key another rank was resolving."""
    mp.spawn(_slow_rank_main, args=(str(tmp_path), wait), nprocs=2, join=True)
    report = json.loads((tmp_path / "rank1.json").read_text())
    assert report["source"] == "heuristic" and report["s"] < 4


@pytest.mark.parametrize("rank", [0, 1])
def test_a_fake_process_group_resolves_alone(rank: int) -> None:
    """torch's fake process group (one process standing in for one rank of many: a dry run of a
    sharded model, a test of its sharding) communicates nothing, and its FakeStore implements
    nothing: every resolution raised ("Store::add" a pure virtual function; rank 0's publication
    raised alike before the election), where there is no other rank to agree with."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
    try:
        with override_policy(Policy()):
            assert resolution_for(SMALL_KEY).source == "heuristic"
            with override_config(KernelConfig(slab_v=2048)):
                assert resolve_config(SMALL_KEY).slab_v == 2048
            e, c, targets = _small_inputs()
            assert torch.isfinite(linear_cross_entropy(e, c, targets))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_failure_on_rank_0_reaches_every_rank(tmp_path: Path) -> None:
    mp.spawn(_failing_rank_main, args=(str(tmp_path),), nprocs=2, join=True)
    assert (tmp_path / "rank0.txt").read_text() == "no GPU identity"
    assert "rank 0 failed to resolve" in (tmp_path / "rank1.txt").read_text()


@pytest.mark.timeout(180)
def test_every_rank_launches_the_config_of_the_first_rank_to_meet_a_key(tmp_path: Path) -> None:
    mp.spawn(_rank_main, args=(str(tmp_path),), nprocs=2, join=True)
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert reports[0].pop("alone") == "heuristic"
    assert reports[0] == reports[1]
    rank0 = [KernelConfig.from_dict(_rank_config(0, use)).to_dict() for use in (0, 2, 0, 1)]
    assert reports[0]["launched"][:3] == rank0[:3] and reports[0]["source"] == "disk"
    traced = reports[0]["launched"][3:]
    assert traced and all(config == rank0[3] for config in traced), "resolved from rank 0"
