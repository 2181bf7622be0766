"""Where tuning results go: the tuning service (POST /v1/measurements over httpx), the
tuning database directly (tuning_db.store), and the bundled configs shipped with the
package. Only the database path loads SQLAlchemy, so a GPU node without it can tune and
publish over HTTP (pydantic, which records.py's shared header name comes with, is a core
dependency).

Each run yields kernel-level measurements (kernel "cce.<kernel>": one per timed config,
the default's included, with that kernel's stage time) and one whole-op measurement
(kernel "cce", the key the op's config resolution looks up: the best config's
forward+backward time against the default's).
"""

from __future__ import annotations

import getpass
import json
import os
import re
import socket
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from cce_compile.config.keys import KERNEL_NAME
from cce_compile.redact import hide_secrets_in_http_client_logs, redact_urls
from cce_compile.resolve import sources
from cce_compile.resolve.platform import kernel_version, local_platform, triton_version
from cce_compile.config.kernel_config import KernelConfig
from tuning_db.records import IDEMPOTENCY_KEY_HEADER, MAX_MILLISECONDS, MIN_MILLISECONDS

from .tuner import Timing, TuneResult

if TYPE_CHECKING:  # SQLAlchemy only where a database is written
    from sqlalchemy import Engine

HTTP_TIMEOUT_S = 30.0
BUSY_RETRIES = 3
"""How often a measurement is sent again after a 503 with Retry-After (the database was busy:
a lock past its timeout, a deadlock; or a gateway lost the service's answer, which its
Idempotency-Key makes harmless)."""
MAX_RETRY_AFTER_S = 5
"""The longest Retry-After waited out. A longer one (a schema that waits for an operator's
`cce db upgrade`: 30 s) will not have passed after any wait a run can afford: that measurement
is refused at once with the service's reason, and the rest are not sent."""
LOST_CONNECTION_WAIT_S = 1.0
"""The wait before a measurement whose send lost its connection (refused, reset, timed out) is
sent once more, under the same idempotency key: the service may have stored it already."""
NOT_SENT = "not sent: the {store} failed on an earlier measurement"
"""The refusal of a measurement not sent because the one before met a failure it would meet
too ({store}: database or service)."""


@dataclass(frozen=True)
class Identity:
    """What a measurement is valid for besides the problem: the GPU and the code versions.

    The GPU name is torch's, unnormalized: the service and the bundled-config reader
    normalize it as the op's resolution does (config.keys.normalize_gpu_name). Off the
    GPU the name is the op's device ("interpreter"), as resolve.platform.local_platform
    names it."""

    gpu: dict[str, Any]
    kernel_version: str
    triton_version: str
    torch_version: str


def local_identity(device: str) -> Identity:
    if device == "cuda":
        index = torch.cuda.current_device()
        platform = local_platform("cuda")  # the same device, cached
        gpu = {
            "name": torch.cuda.get_device_name(index),
            "compute_capability": platform.compute_capability,
            "sm_count": platform.sm_count,
            "memory_bytes": torch.cuda.get_device_properties(index).total_memory,
        }
    else:
        gpu = {"name": device, "compute_capability": "0.0", "sm_count": 1, "memory_bytes": 0}
    return Identity(gpu, kernel_version(), triton_version(), torch.__version__)


def _name(text: str) -> str:
    """`text` in the database's name alphabet ([A-Za-z0-9_.+-], at most 128 characters)."""
    return re.sub(r"[^A-Za-z0-9_.+\-]", "-", text)[:128] or "unknown"


def default_submitter() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no login name in some containers
        user = "unknown"
    return _name(f"cce-tune-{user}")


def in_range(milliseconds: float) -> bool:
    """Whether the database takes this as a kernel time (records.Milliseconds: 1 us to 1000 s)."""
    return MIN_MILLISECONDS <= milliseconds <= MAX_MILLISECONDS


def is_publishable(timing: Timing) -> bool:
    """Whether the database takes these times (each in range, ordered); a backward time (a
    difference of two timings) can fail this on a noisy machine."""
    values = (timing.p20_ms, timing.median_ms, timing.p80_ms)
    return all(map(in_range, values)) and timing.p20_ms <= timing.median_ms <= timing.p80_ms


def measurements(result: TuneResult, identity: Identity, submitter: str) -> list[dict[str, Any]]:
    """POST /v1/measurements bodies for `result`: the whole-op measurement first, then the
    kernel-level ones; times the database would refuse are left out."""
    problem = result.problem
    common = {
        "gpu": identity.gpu,
        "kernel_version": identity.kernel_version,
        "triton_version": identity.triton_version,
        "torch_version": _name(identity.torch_version),
        "V": problem.v,
        "D": problem.d,
        "dtype": problem.dtype,
        "tokens": problem.n,
        "mode": problem.mode,
        "method": _name(result.method),
        "submitter": _name(submitter),
        "host": _name(socket.gethostname()),
    }

    # (kernel, config, its time, the default config's time), the whole op first
    rows: list[tuple[str, KernelConfig, Timing, Timing]] = [
        (KERNEL_NAME, result.best_config, result.best_whole, result.default_whole)
    ]
    for kernel, outcome in result.kernels.items():
        name = f"{KERNEL_NAME}.{kernel}"
        rows.append((name, result.default_config, outcome.default, outcome.default))
        rows += [
            (name, trial.config, trial.time, outcome.default)
            for trial in result.trials
            if trial.kernel == kernel and trial.time is not None
        ]
    return [
        {**common, "kernel": kernel, "config": config.to_dict(), **asdict(timing), "default_ms": default.median_ms}
        for kernel, config, timing, default in rows
        if is_publishable(timing) and in_range(default.median_ms)
    ]


@dataclass(frozen=True)
class Outcome:
    """What the store said about one measurement."""

    kernel: str
    median_ms: float
    accepted: bool
    is_best: bool
    detail: str


class Publisher(Protocol):
    def publish(self, bodies: list[dict[str, Any]]) -> list[Outcome]: ...


class PublishError(RuntimeError):
    pass


class ServicePublisher:
    """POST /v1/measurements to a tuning service with a write token."""

    def __init__(self, url: str, token: str | None) -> None:
        """PublishError where the URL or the token cannot be right, whatever the service says."""
        token = sources.bearer_token(token)
        if not token:
            raise PublishError(f"publishing needs a write token in ${sources.TOKEN_ENV}")
        problem = sources.token_problem(token)
        if problem is not None:  # never quoted: the HTTP client's error quotes the header whole
            raise PublishError(f"${sources.TOKEN_ENV} {problem}")
        problem = sources.service_url_problem(url)
        if problem is not None:
            raise PublishError(problem)
        self.url = url.rstrip("/")
        self.token = token

    def _client(self) -> Any:
        import httpx

        hide_secrets_in_http_client_logs()
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {self.token}"}, timeout=HTTP_TIMEOUT_S
        )

    def check(self) -> None:
        """PublishError unless the service is ready and takes writes with this token: found out
        after the run, either would throw its measurements away. The token is tried on an empty
        measurement, which the service authorizes before it validates the body: 422 means
        authorized, and nothing is stored."""
        import httpx

        try:
            with self._client() as client:
                ready = client.get("/readyz")
                write = client.post("/v1/measurements", json={})
        except httpx.HTTPError as error:
            raise PublishError(f"tuning service unreachable: {type(error).__name__}: {error}") from None
        if ready.status_code != 200:
            raise PublishError(f"tuning service not ready: {_answer(ready)}")
        if write.status_code in (401, 403):
            raise PublishError(f"${sources.TOKEN_ENV} cannot write: {_answer(write)}")
        if write.status_code != 422:
            raise PublishError(f"POST /v1/measurements answered {write.status_code}, not 422, to an empty "
                               f"measurement: {write.text[:200]}")

    def publish(self, bodies: list[dict[str, Any]]) -> list[Outcome]:
        """One outcome a measurement, so that what the run found still reaches its files
        (cli/tune.py). A send that loses its connection is made once more (the key makes that
        safe); a connection lost again, or a 503 still there once waited out (a database without
        schema, read-only, or busy past the retries), refuses that measurement with the error
        or the service's reason and leaves the rest unsent: each would meet it."""
        import httpx

        outcomes = []
        failed = False
        with self._client() as client:
            for item in bodies:
                if failed:
                    detail = NOT_SENT.format(store="service")
                    outcomes.append(Outcome(item["kernel"], item["median_ms"], False, False, detail))
                    continue
                try:
                    response = _post_waiting_out_busy(client, item, uuid.uuid4().hex)
                except httpx.HTTPError as error:  # its text may quote the URL: credentials hidden
                    outcomes.append(Outcome(item["kernel"], item["median_ms"], False, False,
                                            redact_urls(f"{type(error).__name__}: {error}")[:300]))
                    failed = True
                    continue
                if response.status_code == 201:
                    answer = response.json()
                    outcomes.append(Outcome(item["kernel"], item["median_ms"], True, answer["is_best"], ""))
                else:
                    failed = response.status_code == 503
                    outcomes.append(Outcome(item["kernel"], item["median_ms"], False, False, _answer(response)))
        return outcomes


def _post_waiting_out_busy(client: Any, item: dict[str, Any], key: str) -> Any:
    """POST one measurement under its idempotency `key`; a 503 with a Retry-After of at most
    MAX_RETRY_AFTER_S is waited out and sent again, BUSY_RETRIES times at most. A 503 without
    it (a read-only database) or with a longer one (a database without schema) is returned at
    once: neither passes within a wait worth making. Every send carries the same key: a 503 may
    come from a gateway after the service stored the measurement, and the retry then stores
    nothing twice."""
    for _ in range(BUSY_RETRIES):
        response = _post_twice_if_lost(client, item, key)
        retry_after = response.headers.get("Retry-After", "")
        if response.status_code != 503 or not retry_after.isdigit() or int(retry_after) > MAX_RETRY_AFTER_S:
            return response
        time.sleep(int(retry_after))
    return _post_twice_if_lost(client, item, key)


def _post_twice_if_lost(client: Any, item: dict[str, Any], key: str) -> Any:
    """POST one measurement under `key`; where the connection is lost (the transport's error:
    refused, reset, no answer in time), once more after LOST_CONNECTION_WAIT_S. A second loss
    raises it."""
    import httpx

    headers = {IDEMPOTENCY_KEY_HEADER: key}
    try:
        return client.post("/v1/measurements", json=item, headers=headers)
    except httpx.TransportError:
        time.sleep(LOST_CONNECTION_WAIT_S)
    return client.post("/v1/measurements", json=item, headers=headers)


def _answer(response: Any) -> str:
    """A refusal in one line: its status and the service's `detail` where that is text (its
    reason, such as 'run `cce db upgrade`'), else the start of the body."""
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):  # not JSON, or JSON but not an object
        detail = None
    text = detail if isinstance(detail, str) else response.text
    return f"{response.status_code}: {' '.join(text.split())[:300]}"


class DatabasePublisher:
    """tuning_db.store.record_measurement on a database (no service in between): an engine
    the caller has checked (`cce tune` opens it as `cce import` does: cli.db.store_engine)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def check(self) -> None:
        """PublishError unless the database takes writes: a read-only one (an SQLite file opened
        mode=ro, a PostgreSQL standby or read-only session, a role without INSERT) refused every
        measurement only after the whole run, as a read token did with --publish. The check
        registers a GPU under a name no tuner sends and rolls it back: nothing is stored."""
        from sqlalchemy import insert
        from sqlalchemy.exc import DBAPIError

        from tuning_db.engine import write_session
        from tuning_db.models import Gpu

        probe = {"name": f"cce-tune-write-check-{uuid.uuid4().hex}", "compute_capability": "0.0", "sm_count": 1,
                 "memory_bytes": 0}
        try:
            with write_session(self.engine) as session:
                session.execute(insert(Gpu).values(**probe))
                session.rollback()
        except DBAPIError as error:  # the driver's text only: the exception's own quotes the statement
            # the driver's reason says which: read-only, or locked past the busy timeout
            raise PublishError(f"the database refused a test write: {' '.join(str(error.orig).split())[:300]}") from None

    def publish(self, bodies: list[dict[str, Any]]) -> list[Outcome]:
        """One outcome a measurement. A database error (a lock held past its timeout, a lost
        connection) refuses that measurement with the error and the rest unsent, as each would
        wait out the same failure; what was stored before it stays, and the outcomes say which."""
        from pydantic import ValidationError
        from sqlalchemy.exc import DBAPIError

        from tuning_db.engine import missing_schema, shown_url
        from tuning_db.records import MeasurementIn
        from tuning_db.store import StoreError, record_measurement

        outcomes = []
        failed = False
        for item in bodies:
            if failed:
                detail = NOT_SENT.format(store="database")
                outcomes.append(Outcome(item["kernel"], item["median_ms"], False, False, detail))
                continue
            try:
                recorded = record_measurement(self.engine, MeasurementIn.model_validate(item))
            except (ValidationError, StoreError) as error:
                outcomes.append(Outcome(item["kernel"], item["median_ms"], False, False, str(error)[:300]))
            except DBAPIError as error:  # the driver's text only: the exception's own quotes the statement
                failed = True
                reason = " ".join(str(error.orig).split())
                if missing_schema(error):
                    detail = (f"the database has no schema ({reason[:200]}): run "
                              f"`cce db upgrade --db-url {shown_url(self.engine.url)}`")
                else:
                    detail = f"database error: {reason}"[:300]
                outcomes.append(Outcome(item["kernel"], item["median_ms"], False, False, detail))
            else:
                outcomes.append(Outcome(item["kernel"], item["median_ms"], True, recorded.is_best, ""))
        self.engine.dispose()
        return outcomes


def write_bundled(path: Path, result: TuneResult, identity: Identity) -> None:
    """Put `result`'s best config into a bundled-configs file (config/bundled/README.md),
    replacing an entry for the same GPU and key (as the reader keys them); written atomically."""
    problem = result.problem
    entry = {
        "gpu": identity.gpu["name"],
        "V": problem.v,
        "D": problem.d,
        "dtype": problem.dtype,
        "tokens": problem.n,
        "mode": problem.mode,
        "config": result.best_config.to_dict(),
        "kernel_version": identity.kernel_version,
        "triton_version": identity.triton_version,
        "median_ms": result.best_whole.median_ms,
        "default_ms": result.default_whole.median_ms,
    }

    replaced = sources.bundled_key(entry)
    entries = bundled_entries(path)
    _write_entries(path, [item for item in entries if sources.bundled_key(item) != replaced] + [entry])


def bundled_entries(path: Path) -> list[dict[str, Any]]:
    """The entries of a bundled-configs file (none where there is no file); ValueError saying
    why where the file is not one, or holds an entry the reader would skip."""
    if not path.exists():
        return []
    document = sources.parse_json(path.read_bytes())
    entries = document.get("entries") if isinstance(document, dict) else None
    if not isinstance(entries, list):
        raise ValueError('not a bundled-configs file: JSON {"entries": [...]} (config/bundled/README.md)')
    for number, entry in enumerate(entries):
        fault = sources.bundled_entry_fault(entry)
        if fault is not None:
            raise ValueError(f"entry {number} {fault}")
    return entries


def restamp_bundled(path: Path) -> None:
    """Mark every entry of a bundled-configs file as tuned for the kernels of this checkout.
    Only for a change of the launched code that leaves the tuned tiles' ranking alone, once
    the benchmark on the GPU has confirmed them (config/bundled/README.md); otherwise re-tune."""
    _write_entries(path, [{**entry, "kernel_version": kernel_version()} for entry in bundled_entries(path)])


def _write_entries(path: Path, entries: list[dict[str, Any]]) -> None:
    """Sorted as the reader keys them, a line per entry; written atomically."""
    entries = sorted(entries, key=sources.bundled_key)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}", suffix=".tmp")
    with os.fdopen(descriptor, "w", encoding="utf-8") as file:
        file.write('{"entries": [\n' + ",\n".join(json.dumps(item) for item in entries) + "\n]}\n")
    os.replace(temporary, path)
