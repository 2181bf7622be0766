"""`cce tune` on CPU: the search with its correctness gate, run on a tiny problem through the
Triton interpreter with the wall-clock timer; publishing into a real `cce serve` process
and into a database; the CLI, and its refusals before any GPU time is spent (in real
processes, one line each); the candidate pruning."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch
from pydantic import ValidationError
from typer.testing import CliRunner

from cce_compile import linear_cross_entropy
from cce_compile.cli.main import app as cce
from cce_compile.config.kernel_config import KernelConfig, TileConfig
from cce_compile.config.keys import KERNEL_NAME
from cce_compile.ops.problem import config_for
from cce_compile.plan.policy import Policy, active_policy, override_policy
from cce_compile.resolve import sources
from cce_compile.resolve.platform import local_platform
from cce_compile.resolve.heuristic import heuristic_config
from cce_compile.tuning.candidates import KernelSpace, Limits, Problem, device_limits, kernel_spaces
from cce_compile.tuning.publish import (
    DatabasePublisher,
    PublishError,
    bundled_entries,
    is_publishable,
    ServicePublisher,
    local_identity,
    measurements,
    write_bundled,
)
from cce_compile.tuning.tuner import Timing, Tuner, TuneResult, WallClockTimer
from service.process import REPO_ROOT, free_port, serving
from tests.db_fixtures import measurement_count, measurement_data
from tests.http_servers import loopback_server
from tuning_db.records import MeasurementIn
from tests.test_cli import assert_one_line_failure, cce as cce_process
from tests.test_service_process import READ_TOKEN, TOKENS_ENV, WRITE_TOKEN

TINY = Problem(n=64, v=257, d=32, dtype="bfloat16", mode="exact")
WRONG_BLOCK_M = 16
"""The test op corrupts its results under any config whose grad_logits rows are this tall."""


def _corrupting_op(e: Any, c: Any, targets: Any) -> Any:
    """The op, except that a config with WRONG_BLOCK_M grad_logits rows computes 1.5x the
    loss and gradients: a candidate that computes something else."""
    loss = linear_cross_entropy(e, c, targets)
    wrong = config_for(e, c, False, active_policy()).grad_logits.block_m == WRONG_BLOCK_M
    return loss * 1.5 if wrong else loss


@pytest.fixture(scope="module")
def tuned() -> TuneResult:
    """One search on TINY: a forward candidate (narrower tiles; TINY's forward is persistent,
    so vocab splits would not change it), a grad_logits candidate (narrower tiles) and a
    wrong one (shorter tiles)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 set before import (CPU-only machines)")
    limits = device_limits(TINY)
    spaces = [
        KernelSpace("forward", {"block_n": (16,)}, TINY, limits),
        KernelSpace("grad_logits", {"block_n": (16,), "block_m": (WRONG_BLOCK_M,)}, TINY, limits),
    ]
    timer = WallClockTimer(warmup=0, runs=2)
    with override_policy(Policy(triton_on_cpu=True)):
        tuner = Tuner(TINY, "interpreter", spaces, timer, budget_s=600, input_sets=2, loss_fn=_corrupting_op)
        return tuner.run()


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A real service on its SQLite file: (its URL, the file)."""
    database = tmp_path_factory.mktemp("service") / "tuning.db"
    with serving(database.parent / "serve.log", "--db-url", f"sqlite:///{database}", env=TOKENS_ENV) as url:
        yield url, database


@pytest.fixture(scope="module")
def service_url(service: tuple[str, Path]) -> str:
    return service[0]


def _best(url: str, problem: Problem, kernel: str = KERNEL_NAME) -> dict[str, Any]:
    """GET /v1/configs/best for `problem` on the interpreter, asked as the op asks."""
    platform = local_platform("interpreter")
    params = {
        "gpu": platform.gpu, "kernel": kernel, "kernel_version": platform.kernel_version,
        "triton_version": platform.triton_version, "V": problem.v, "D": problem.d, "dtype": problem.dtype,
        "tokens": problem.n, "mode": problem.mode,
    }
    response = httpx.get(f"{url}/v1/configs/best", params=params, headers={"Authorization": f"Bearer {READ_TOKEN}"})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.interpreter
def test_the_search_times_checked_candidates_and_drops_a_wrong_one(tuned: TuneResult) -> None:
    by_status = {trial.status: trial for trial in tuned.trials}
    assert sorted(trial.status for trial in tuned.trials) == ["dropped", "timed", "timed"]
    dropped = by_status["dropped"]
    assert dropped.config.grad_logits.block_m == WRONG_BLOCK_M and dropped.time is None
    assert "loss relative error 5.00e-01 > 0.01" in dropped.detail and "dE" in dropped.detail
    assert tuned.best_config.grad_logits.block_m != WRONG_BLOCK_M
    assert {trial.kernel for trial in tuned.trials if trial.status == "timed"} == {"forward", "grad_logits"}
    assert tuned.best_config in {tuned.default_config, *(t.config for t in tuned.trials if t.status == "timed")}
    for kernel in tuned.kernels.values():
        assert 0 < kernel.best.median_ms <= kernel.default.median_ms
    assert tuned.best_whole.median_ms <= tuned.default_whole.median_ms
    assert tuned.method == "wall_clock"
    assert json.loads(json.dumps(tuned.to_json()))["trials"][0]["kernel"] == "forward"


@pytest.mark.parametrize("timing", [
    Timing(0.5, 0.4, 0.6), Timing(1e-3, 1e-3, 1e-3), Timing(5e-4, 4e-4, 6e-4), Timing(2e6, 2e6, 2e6),
    Timing(0.5, 0.6, 0.4), Timing(float("nan"), 0.4, 0.6), Timing(0.5, 0.4, float("inf")),
])
def test_a_time_is_published_exactly_when_the_database_takes_it(timing: Timing) -> None:
    """is_publishable took any positive time, the database only 1 us to 1000 s: a sub-microsecond
    time was sent, refused with a 422, and `cce tune --publish` exited 1."""
    data = measurement_data(median_ms=timing.median_ms, p20_ms=timing.p20_ms, p80_ms=timing.p80_ms)
    try:
        MeasurementIn.model_validate(data)
        taken = True
    except ValidationError:
        taken = False
    assert is_publishable(timing) == taken


@pytest.mark.interpreter
def test_published_measurements_make_the_best_config_what_the_service_answers(
    tuned: TuneResult, service_url: str
) -> None:
    bodies = measurements(tuned, local_identity("interpreter"), "tester")
    assert [body["kernel"] for body in bodies].count("cce") == 1
    publisher = ServicePublisher(service_url, WRITE_TOKEN)
    publisher.check()
    outcomes = publisher.publish(bodies)
    assert all(outcome.accepted for outcome in outcomes), [o.detail for o in outcomes if not o.accepted]
    assert outcomes[0].kernel == "cce" and outcomes[0].is_best

    best = _best(service_url, TINY)
    assert best["match_level"] == "exact"
    assert KernelConfig.from_dict(best["config"]) == tuned.best_config
    assert best["source"]["median_ms"] == pytest.approx(tuned.best_whole.median_ms)
    assert best["source"]["default_ms"] == pytest.approx(tuned.default_whole.median_ms)
    forward = _best(service_url, TINY, kernel="cce.forward")
    assert forward["source"]["median_ms"] == pytest.approx(tuned.kernels["forward"].best.median_ms)
    refused = ServicePublisher(service_url, READ_TOKEN).publish(bodies[:1])
    assert not refused[0].accepted and refused[0].detail.startswith("403")


def test_publishing_sends_again_a_measurement_the_service_answered_503(tmp_path: Path, postgres_url: str) -> None:
    """A 503 with Retry-After (a busy database: here a best entry locked past the service's
    lock_timeout; a deadlock answered alike) stores nothing: the publisher refused the
    measurement at once, which the tuning run then lost. It waits Retry-After and sends it again."""
    from sqlalchemy import text
    from sqlalchemy.engine import make_url

    from tuning_db.engine import make_engine

    scoped = make_url(postgres_url)
    impatient = scoped.update_query_dict({"options": f"{scoped.query['options']} -clock_timeout=300"})
    db_url = impatient.render_as_string(hide_password=False)
    body = measurement_data()
    holder = make_engine(postgres_url)
    with serving(tmp_path / "serve.log", "--db-url", db_url, env=TOKENS_ENV) as url:
        publisher = ServicePublisher(url, WRITE_TOKEN)
        assert publisher.publish([body])[0].accepted
        with holder.connect() as connection:
            connection.execute(text("SELECT id FROM best_configs FOR UPDATE"))
            releasing = threading.Timer(0.8, connection.rollback)
            releasing.start()
            outcomes = publisher.publish([{**body, "median_ms": 1.0, "p20_ms": 1.0, "p80_ms": 1.0}])
            releasing.join()
    holder.dispose()
    assert [(outcome.accepted, outcome.is_best) for outcome in outcomes] == [(True, True)], outcomes


@contextlib.contextmanager
def _gateway_losing_the_first_answer(
    upstream: str, lost_as: str = "503"
) -> Iterator[tuple[str, list[dict[str, str]]]]:
    """A real HTTP gateway on a loopback port in front of `upstream`: it forwards every POST,
    and loses the first answer after the service has committed: `lost_as` "503" answers 503 with
    Retry-After whatever the service said, as a proxy does whose upstream connection dropped;
    "dropped" closes the client's connection unanswered. Yields its URL, then the headers of
    each POST it forwarded."""
    forwarded: list[dict[str, str]] = []

    class Gateway(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            headers = {name.lower(): value for name, value in self.headers.items()}
            headers = {name: value for name, value in headers.items() if name not in ("host", "content-length")}
            answer = httpx.post(upstream + self.path, content=body, headers=headers, timeout=30)
            forwarded.append(headers)
            status, content, extra = answer.status_code, answer.content, {}
            if len(forwarded) == 1 and lost_as == "dropped":
                self.close_connection = True
                return
            if len(forwarded) == 1:
                status, content, extra = 503, b'{"detail": "upstream connection lost"}', {"Retry-After": "1"}
            self.send_response(status)
            for name, value in {"Content-Type": "application/json", "Content-Length": str(len(content)), **extra}.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(content)

        def log_message(self, *args: object) -> None:
            pass

    with loopback_server(Gateway) as url:
        yield url, forwarded


@pytest.mark.parametrize("lost_as", ["503", "dropped"])
def test_a_measurement_stored_before_its_answer_was_lost_is_stored_once(tmp_path: Path, lost_as: str) -> None:
    """The service stored the measurement, and the gateway in front of it answered 503 with
    Retry-After: the publisher sent it again, and the database held the one timed run twice.
    Each measurement now travels under an Idempotency-Key of its own, the same on every send,
    which the service stores as its uid: the retry finds the first send's row. A connection
    dropped unanswered refused the measurement though the service had stored it; it is now
    sent once more too."""
    database = tmp_path / "tuning.db"
    with serving(tmp_path / "serve.log", "--db-url", f"sqlite:///{database}", env=TOKENS_ENV) as url:
        with _gateway_losing_the_first_answer(url, lost_as) as (gateway, forwarded):
            outcomes = ServicePublisher(gateway, WRITE_TOKEN).publish([measurement_data(), measurement_data(V=5)])
    assert _stored(database) == 2  # one row per measurement, none for the retry
    assert [(outcome.accepted, outcome.is_best) for outcome in outcomes] == [(True, True)] * 2, outcomes
    keys = [headers.get("idempotency-key") for headers in forwarded]
    assert len(forwarded) == 3 and keys[0] == keys[1] != keys[2] and None not in keys, forwarded


@pytest.mark.postgres
def test_publishing_to_a_database_without_schema_fails_at_once_naming_the_fix(
    tmp_path: Path, postgres_schema_url: str
) -> None:
    """A service on a PostgreSQL schema never upgraded answers 503 with Retry-After: 30 (it
    waits for an operator's `cce db upgrade`): the publisher waited 5 s three times for each
    measurement, then refused it in the service's JSON, 15 s a measurement for what no wait
    mends. It now refuses the first at once with the service's reason, and sends no more."""
    from tests.db_fixtures import POSTGRES_URL
    from tuning_db.scratch import scratch_schema

    with (scratch_schema(POSTGRES_URL, prefix="cce_test") as empty_url,
          serving(tmp_path / "serve.log", "--db-url", empty_url, env=TOKENS_ENV, ready_path="/healthz") as url):
        publisher = ServicePublisher(url, WRITE_TOKEN)
        start = time.monotonic()
        outcomes = publisher.publish([measurement_data(), measurement_data(V=5), measurement_data(V=6)])
        elapsed = time.monotonic() - start
        assert elapsed < 3, (elapsed, outcomes)
        with pytest.raises(PublishError, match=r"not ready: 503: schema at None, .*: run `cce db upgrade`$"):
            publisher.check()  # what `cce tune --publish` meets first, in one line
    assert [outcome.accepted for outcome in outcomes] == [False] * 3
    assert outcomes[0].detail == ("503: the database lacks this service's schema (none, or an older revision): "
                                  "run `cce db upgrade`")
    assert all(outcome.detail.startswith("not sent: ") for outcome in outcomes[1:]), outcomes


def test_db_url_publishing_to_a_database_without_schema_names_the_fix(tmp_path: Path) -> None:
    """The driver's 'no such table: gpus' was all it said (`cce tune --db-url` checks the schema
    first; a library caller, or a schema dropped during the run, met this)."""
    from tuning_db.engine import make_engine

    empty = tmp_path / "empty.db"
    sqlite3.connect(empty).close()
    engine = make_engine(f"sqlite:///{empty}")
    outcomes = DatabasePublisher(engine).publish([measurement_data(), measurement_data(V=5)])
    assert [outcome.accepted for outcome in outcomes] == [False, False]
    assert outcomes[0].detail == (f"the database has no schema (no such table: gpus): run "
                                  f"`cce db upgrade --db-url sqlite:///{empty}`")
    assert outcomes[1].detail.startswith("not sent: ")


@pytest.mark.interpreter
def test_db_url_publishing_writes_through_the_store(tuned: TuneResult, sqlite_url: str) -> None:
    from tuning_db.engine import make_engine
    from tuning_db.records import LookupQuery
    from tuning_db.store import lookup

    publisher = DatabasePublisher(make_engine(sqlite_url))
    bodies = measurements(tuned, local_identity("interpreter"), "tester")
    assert all(outcome.accepted for outcome in publisher.publish(bodies))
    platform = local_platform("interpreter")
    query = LookupQuery(
        gpu=platform.gpu, kernel="cce", kernel_version=platform.kernel_version,
        triton_version=platform.triton_version, V=TINY.v, D=TINY.d, dtype=TINY.dtype, tokens=TINY.n, mode=TINY.mode,
    )
    answer = lookup(publisher.engine, query)
    assert answer.match_level == "exact" and KernelConfig.from_dict(answer.entry.config) == tuned.best_config
    publisher.engine.dispose()


def test_db_url_publishing_that_the_database_fails_says_what_was_stored(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A database error (here SQLite's lock held past the busy timeout, from the first
    measurement's commit on) once escaped the publisher: `cce tune --db-url` stopped with a
    traceback, saying nothing of what it had stored. The rest are not tried: each would wait out
    the same lock."""
    from sqlalchemy import event

    from tuning_db import engine as engine_module
    from tuning_db.engine import make_engine

    monkeypatch.setattr(engine_module, "SQLITE_BUSY_TIMEOUT_MS", 200)
    engine = make_engine(sqlite_url)
    holder = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"), isolation_level=None, check_same_thread=False)

    @event.listens_for(engine.pool, "checkin", once=True)
    def _lock_once_the_first_is_stored(*_args: Any) -> None:
        holder.execute("BEGIN IMMEDIATE")

    try:
        outcomes = DatabasePublisher(engine).publish([measurement_data(V=vocab) for vocab in (1, 2, 3)])
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert [outcome.accepted for outcome in outcomes] == [True, False, False]
    assert "database is locked" in outcomes[1].detail and "\n" not in outcomes[1].detail
    assert outcomes[2].detail.startswith("not sent: the database failed on an earlier measurement")
    assert measurement_count(engine) == 1
    engine.dispose()


@pytest.mark.interpreter
def test_bundled_entries_replace_the_same_key_and_the_op_reads_them(
    tuned: TuneResult, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bundle = tmp_path / "interpreter.json"
    other = {"gpu": "interpreter", "V": 1000, "D": 64, "dtype": "float32", "tokens": 8, "mode": "exact", "config": {},
             "kernel_version": "older"}
    stale = {**other, "V": TINY.v, "D": TINY.d, "dtype": TINY.dtype, "tokens": 40, "config": {"slab_v": 128}}
    bundle.write_text(json.dumps({"entries": [stale, other]}))
    write_bundled(bundle, tuned, local_identity("interpreter"))
    entries = json.loads(bundle.read_text())["entries"]
    assert len(entries) == 2 and other in entries
    mine = next(entry for entry in entries if entry["V"] == TINY.v)
    assert mine["tokens"] == TINY.n and KernelConfig.from_dict(mine["config"]) == tuned.best_config
    monkeypatch.setattr(sources, "BUNDLED_DIR", tmp_path)
    found = sources.bundled_config(local_platform("interpreter"), TINY.key("interpreter"))
    assert found is not None and KernelConfig.from_dict(found.config) == tuned.best_config


@pytest.mark.interpreter
def test_cli_tunes_writes_json_and_publishes(service_url: str, tmp_path: Path) -> None:
    """With no budget the CLI checks and times the default config only, and publishes it."""
    out = tmp_path / "results.json"
    args = ["tune", "--vocab", "200", "--hidden", "16", "--tokens", "40", "--mode", "filtered", "--budget-s", "0",
            "--input-sets", "1", "--out", str(out), "--publish", service_url]
    result = CliRunner().invoke(cce, args, env={sources.TOKEN_ENV: WRITE_TOKEN})
    assert result.exit_code == 0, result.output
    assert "forward+backward" in result.output and "1.000x" in result.output
    report = json.loads(out.read_text())
    assert report["best_config"] == report["default_config"]
    assert {body["kernel"] for body in report["measurements"]} >= {"cce", "cce.forward", "cce.grad_logits"}
    best = _best(service_url, Problem(40, 200, 16, "bfloat16", "filtered"))
    assert best["match_level"] == "exact" and best["config"] == report["best_config"]


@pytest.mark.interpreter
def test_cli_checks_where_results_go_before_tuning(tmp_path: Path) -> None:
    runner = CliRunner()
    base = ["tune", "--vocab", "200", "--hidden", "16", "--tokens", "40"]
    no_token = runner.invoke(cce, [*base, "--publish", "http://127.0.0.1:9"], env={sources.TOKEN_ENV: ""})
    assert no_token.exit_code == 2 and "CCE_TUNING_TOKEN" in no_token.output
    dead = runner.invoke(cce, [*base, "--publish", "http://127.0.0.1:9"], env={sources.TOKEN_ENV: "x"})
    assert dead.exit_code == 1 and "unreachable" in dead.output  # as `cce export --url` from a dead service
    both = runner.invoke(cce, [*base, "--publish", "http://x", "--db-url", "sqlite://"])
    assert both.exit_code == 2 and "not both" in both.output


TINY_CLI = ("tune", "--vocab", "200", "--hidden", "16", "--tokens", "40", "--budget-s", "0", "--input-sets", "1")


def _stored(database: Path) -> int:
    """How many measurements the service's database holds, the slower ones behind no entry too."""
    from tuning_db.engine import make_engine

    engine = make_engine(f"sqlite:///{database}")
    try:
        return measurement_count(engine)
    finally:
        engine.dispose()


def test_publish_checks_the_token_can_write_before_tuning(service: tuple[str, Path]) -> None:
    """A read token or an unknown one once tuned the whole problem, then had every measurement
    refused; the check sends an empty measurement, which stores nothing, even with a write token."""
    service_url, database = service
    before = _stored(database)
    for token, status in ((READ_TOKEN, "403"), ("unknown-token-0002", "401")):
        done = cce_process(*TINY_CLI, "--publish", service_url, env={sources.TOKEN_ENV: token})
        assert_one_line_failure(done, f"--publish {service_url}", "CCE_TUNING_TOKEN cannot write", status)
        assert done.returncode == 1
    ServicePublisher(service_url, WRITE_TOKEN).check()
    assert _stored(database) == before


def test_an_empty_destination_is_refused() -> None:
    """An unset shell variable (`--db-url "$URL"`) once tuned the whole problem and stored nothing."""
    for option in ("--db-url", "--publish"):
        done = cce_process(*TINY_CLI, option, "")
        assert_one_line_failure(done, f"Invalid value for '{option}'", "empty")
        assert done.returncode == 2


def test_a_destination_that_cannot_work_stops_tune_in_one_line(tmp_path: Path) -> None:
    """Each once came after the plan, without `cce: error:` or the option's name, some on
    several lines: a value that cannot be right exits 2, a refusal from where it points 1."""
    dead = f"127.0.0.1:{free_port()}"
    missing = f"sqlite:///{tmp_path / 'no' / 'such' / 'dir' / 'tuning.db'}"
    token = {sources.TOKEN_ENV: WRITE_TOKEN}
    cases = (
        (["--db-url", missing], {}, 1, [f"--db-url {missing}: no such SQLite database"]),
        (["--db-url", f"postgresql+psycopg://postgres@{dead}/test"], {}, 1, ["--db-url", "cannot open the database"]),
        (["--db-url", "nonsense://"], {}, 2, ["Invalid value for --db-url", "nonsense"]),
        (["--db-url", "garbage"], {}, 2, ["Invalid value for --db-url", "Could not parse"]),
        (["--publish", f"http://{dead}"], token, 1, [f"--publish http://{dead}: tuning service unreachable"]),
        (["--publish", "garbage"], token, 2, ["--publish garbage: not an http:// or https:// URL"]),
        (["--publish", "http://127.0.0.1:99999"], token, 2,
         ["--publish http://127.0.0.1:99999: its port '99999' is not a number from 1 to 65535"]),
        (["--publish", f"http://{dead}"], {sources.TOKEN_ENV: ""}, 2, ["--publish", "needs a write token"]),
        (["--publish", f"http://tuner:pw-s3cret@{dead}/?token=tok-s3cret"], token, 1,
         [f"--publish http://tuner:***@{dead}/?token=***: tuning service unreachable"]),
        (["--db-url", f"postgresql+psycopg://postgres:pw-s3cret@{dead}/test"], {}, 1,
         [f"--db-url postgresql+psycopg://postgres:***@{dead}/test: cannot open the database"]),
    )
    with ThreadPoolExecutor(len(cases)) as pool:  # each process spends seconds importing torch
        runs = list(pool.map(lambda case: cce_process(*TINY_CLI, *case[0], env=case[1]), cases))
    for (args, _, status, fragments), done in zip(cases, runs):
        assert_one_line_failure(done, *fragments)
        assert done.returncode == status, (args, done.stderr)
        assert "s3cret" not in done.stderr, done.stderr  # a password or token in a URL is shown as ***


def test_db_url_is_a_database_cce_db_upgrade_made(tmp_path: Path) -> None:
    """A missing SQLite file was created empty, and then `cce db upgrade` was advised without
    --db-url, which upgrades another database."""
    missing = tmp_path / "missing.db"
    assert_one_line_failure(cce_process(*TINY_CLI, "--db-url", f"sqlite:///{missing}"), "no such SQLite database")
    assert not missing.exists()
    empty = tmp_path / "empty.db"
    sqlite3.connect(empty).close()
    done = cce_process(*TINY_CLI, "--db-url", f"sqlite:///{empty}")
    assert_one_line_failure(done, "has no schema", f"run `cce db upgrade --db-url sqlite:///{empty}`")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_without_a_gpu_tune_stops_before_the_plan() -> None:
    """The plan, a screenful, once came before the refusal (a dry run's plan still comes)."""
    done = cce_process(*TINY_CLI, env={"TRITON_INTERPRET": ""})
    assert_one_line_failure(done, "needs a CUDA GPU")
    assert done.returncode == 2


def _entry_text(**fields: Any) -> str:
    """A bundled-configs file of one entry, its fields as given (a V in quotes, the dtype's short name)."""
    entry = {"gpu": "NVIDIA H200", "V": 128256, "D": 4096, "dtype": "bfloat16", "tokens": 8192, "mode": "exact",
             "kernel_version": "0123456789ab", "config": {}}
    return json.dumps({"entries": [{**entry, **fields}]})


def test_a_bundle_file_that_is_not_one_is_refused_before_tuning(tmp_path: Path) -> None:
    """It once failed after the whole run, in the JSON reader's words, and before publishing;
    an entry keyed by a V in quotes failed there too (sorting the file's keys raised TypeError),
    and one the reader matches to no key ("bf16") was kept, unwarned."""
    bundle = tmp_path / "bundle.json"
    for text, fragment in (("not json", "not a bundled-configs file"), ("[]", "not a bundled-configs file"),
                           ('{"entries": [{"gpu": "x"}]}', "entry 0 lacks one of"),
                           (_entry_text(V="128256"), "entry 0 has V '128256'"),
                           (_entry_text(dtype="bf16"), "entry 0 has dtype 'bf16'")):
        bundle.write_text(text)
        done = cce_process(*TINY_CLI, "--bundle", str(bundle))
        assert_one_line_failure(done, "Invalid value for --bundle", str(bundle), fragment)
        assert done.returncode == 2 and bundle.read_text() == text


@pytest.mark.interpreter
def _tune_until_planned(problem: Problem, *options: str) -> subprocess.Popen:
    """`cce tune` on `problem` in a process of its own, returned once it has printed its plan:
    its checks are done and its run (a few seconds under the interpreter) starts."""
    args = ["tune", "--vocab", str(problem.v), "--hidden", str(problem.d), "--tokens", str(problem.n),
            "--budget-s", "0", "--input-sets", "1", *options]
    environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT), sources.TOKEN_ENV: WRITE_TOKEN}
    child = subprocess.Popen([sys.executable, "-m", "cce_compile.cli.main", *args], env=environment, cwd=REPO_ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stderr is not None
    while "cce tune plan" not in child.stderr.readline():
        assert child.poll() is None, child.stderr.read()
    return child


def test_ctrl_c_ends_the_search_and_keeps_what_it_measured(tmp_path: Path) -> None:
    """A Ctrl-C during `cce tune` exited 130 with nothing written or published, however long it
    had run; the first now ends the search as the budget does, and the run finishes."""
    out = tmp_path / "report.json"
    with _tune_until_planned(TINY, "--budget-s", "600", "--out", str(out)) as child:
        time.sleep(3)
        child.send_signal(signal.SIGINT)
        _, stderr = child.communicate(timeout=300)
    assert child.returncode == 0, stderr
    report = json.loads(out.read_text())
    assert report["stopped"] and report["elapsed_s"] < 300, report["elapsed_s"]
    assert report["measurements"][0]["kernel"] == KERNEL_NAME


@pytest.mark.interpreter
def test_a_failed_candidates_error_text_is_printed_as_it_is(tmp_path: Path) -> None:
    """A candidate's error quoting kernel source (`desc.store([pid_m * BLOCK_M, ...])`) was read
    as rich markup: the brackets vanished, and a closing tag (`[/path]`) raised MarkupError after
    the whole run, before --out was written or anything published."""
    out = tmp_path / "report.json"
    detail = "at 3:4: desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N]) in [/tmp/kernel.py]"
    failing = (f"import cce_compile.tuning.tuner as tuner\noutputs = tuner.Tuner._outputs\n"
               f"def failing(self, config):\n    if config != self.default_config:\n"
               f"        raise RuntimeError({detail!r})\n    return outputs(self, config)\n"
               f"tuner.Tuner._outputs = failing")
    done = cce_process("tune", "--vocab", str(TINY.v), "--hidden", str(TINY.d), "--tokens", str(TINY.n),
                       "--budget-s", "600", "--input-sets", "1", "--out", str(out), prelude=failing,
                       env={"COLUMNS": "300"})
    assert done.returncode == 0, done.stderr
    assert f"RuntimeError: {detail}" in done.stdout
    assert json.loads(out.read_text())["trials"]


class _SignalledTuner:
    """A stand-in for Tuner in _run_with_progress: its run() calls `during` (which signals the
    process) and returns the stand-in result."""

    spaces: list = []
    default_config = None
    on_trial = None

    def __init__(self, during) -> None:
        self.during, self.stopped = during, False

    def stop(self) -> None:
        self.stopped = True

    def run(self):
        self.during(self)
        return SimpleNamespace(stopped=self.stopped, elapsed_s=0.0)


class _Aborted(Exception):
    pass


@contextlib.contextmanager
def _own_signal_handlers(sigint: Any = None, sigterm: Any = None) -> Iterator[list[int]]:
    """SIGINT and SIGTERM handled by this test (a handler that records and raises _Aborted,
    unless given), put back afterwards."""
    seen: list[int] = []

    def aborting(number: int, _frame: object) -> None:
        seen.append(number)
        raise _Aborted

    installed = {signal.SIGINT: sigint or aborting, signal.SIGTERM: sigterm or aborting}
    old = {number: signal.signal(number, handler) for number, handler in installed.items()}
    try:
        yield seen
    finally:
        for number, handler in old.items():
            signal.signal(number, handler)


def _signal(number: int) -> None:
    os.kill(os.getpid(), number)
    time.sleep(0.01)  # the Python handler runs here at the latest


def test_a_second_signal_of_the_other_kind_aborts() -> None:
    """Ctrl-C, then SIGTERM (a scheduler, or `kill`): the first handler put back only its own
    signal's previous handler, so the SIGTERM stopped the stopped run again instead of aborting."""
    from cce_compile.cli.tune import _run_with_progress

    def during(tuner: _SignalledTuner) -> None:
        _signal(signal.SIGINT)
        assert tuner.stopped
        _signal(signal.SIGTERM)

    with _own_signal_handlers() as seen:
        with pytest.raises(_Aborted):
            _run_with_progress(_SignalledTuner(during))
        assert seen == [signal.SIGTERM]


def test_an_ignored_signal_stays_ignored() -> None:
    """A shell runs a script's background job with SIGINT ignored (so that a Ctrl-C meant for the
    script leaves it running): cce tune's handler replaced that, and such a Ctrl-C ended its search."""
    from cce_compile.cli.tune import _run_with_progress

    def during(tuner: _SignalledTuner) -> None:
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        _signal(signal.SIGINT)

    with _own_signal_handlers(sigint=signal.SIG_IGN):
        assert not _run_with_progress(_SignalledTuner(during)).stopped
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_a_signal_while_the_handlers_are_being_installed_stops_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C between installing the SIGINT handler and the dict of previous handlers being bound
    raised NameError ('previous') out of cce tune, and left its handler installed."""
    from cce_compile.cli.tune import _run_with_progress

    real = signal.signal

    def signalling(number: int, handler: Any) -> Any:
        old = real(number, handler)
        if number == signal.SIGINT and getattr(handler, "__name__", "") == "stop":
            _signal(signal.SIGINT)
        return old

    with _own_signal_handlers() as seen:
        monkeypatch.setattr(signal, "signal", signalling)
        assert _run_with_progress(_SignalledTuner(lambda tuner: None)).stopped
        monkeypatch.undo()
        assert seen == [] and getattr(signal.getsignal(signal.SIGINT), "__name__", "") == "aborting"


def test_a_bundle_broken_during_the_run_loses_no_published_measurement(service_url: str, tmp_path: Path) -> None:
    """The bundle is written after publishing: its failure is the command's, not the results'."""
    bundle = tmp_path / "bundle.json"
    problem = Problem(24, 300, 16, "bfloat16", "exact")
    with _tune_until_planned(problem, "--publish", service_url, "--bundle", str(bundle)) as child:
        bundle.write_text("not json")
        _, stderr = child.communicate(timeout=300)
    assert child.returncode == 1
    assert re.search(r"published (\d+) of \1 measurements", stderr), stderr
    assert stderr.strip().splitlines()[-1].startswith(f"cce: error: --bundle {bundle}: not a bundled-configs file")
    assert _best(service_url, problem)["match_level"] == "exact"


def test_a_dead_service_refuses_the_first_measurement_after_one_more_try_and_is_sent_no_more() -> None:
    """Each measurement was sent to a service that had gone, one connection error each; the
    first is now tried twice and the rest are not sent."""
    dead = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    outcomes = ServicePublisher(dead, WRITE_TOKEN).publish([measurement_data(V=v) for v in (4, 5, 6)])
    assert time.monotonic() - start < 10
    assert [outcome.accepted for outcome in outcomes] == [False] * 3
    assert outcomes[0].detail.startswith("ConnectError"), outcomes
    assert all(outcome.detail.startswith("not sent: ") for outcome in outcomes[1:]), outcomes


def test_a_service_lost_during_the_run_loses_neither_file(tmp_path: Path) -> None:
    """A service that passed the checks and is gone when the run ends: every measurement is
    refused with the connection's error, and the report and the bundle are still written (the
    lost connection once raised out of the command before either)."""
    out, bundle = tmp_path / "report.json", tmp_path / "bundle.json"
    problem = Problem(24, 300, 16, "bfloat16", "exact")
    with serving(tmp_path / "serve.log", "--db-url", f"sqlite:///{tmp_path / 'tuning.db'}", env=TOKENS_ENV) as url:
        child = _tune_until_planned(problem, "--publish", url, "--out", str(out), "--bundle", str(bundle))
    with child:  # the service has stopped
        _, stderr = child.communicate(timeout=300)
    assert child.returncode == 1, stderr
    assert re.search(r"published 0 of \d+ measurements", stderr) and "ConnectError" in stderr, stderr
    assert json.loads(out.read_text())["measurements"]
    assert [entry["V"] for entry in bundled_entries(bundle)] == [problem.v]


def test_a_schema_lost_during_the_run_is_one_refusal_naming_the_fix(tmp_path: Path) -> None:
    """The service's database lost its tables while `cce tune` ran (the check before it had
    passed): every measurement waited 15 s and was refused on a line of the service's JSON. Now
    the first is refused at once with the service's reason and the rest share a line."""
    out = tmp_path / "report.json"
    database = tmp_path / "tuning.db"
    problem = Problem(24, 300, 16, "bfloat16", "exact")
    with serving(tmp_path / "serve.log", "--db-url", f"sqlite:///{database}", env=TOKENS_ENV) as url:
        with _tune_until_planned(problem, "--publish", url, "--out", str(out)) as child:
            with sqlite3.connect(database) as connection:
                for table in ("best_configs", "measurements", "gpus", "alembic_version"):
                    connection.execute(f"DROP TABLE {table}")
            _, stderr = child.communicate(timeout=300)
    assert child.returncode == 1, stderr
    sent = len(json.loads(out.read_text())["measurements"])
    lines = stderr[stderr.index("published 0 of"):].strip().splitlines()
    assert len(lines) == 3 and lines[0] == f"published 0 of {sent} measurements", stderr
    assert re.fullmatch(r"  refused cce \([0-9.]+ ms\): 503: the database lacks this service's schema "
                        r"\(none, or an older revision\): run `cce db upgrade`", lines[1]), stderr
    assert lines[2] == f"  not sent: {sent - 1} more measurements (the service failed on an earlier measurement)"


def test_dry_run_prints_the_plan_and_runs_nothing() -> None:
    """Off the GPU the plan is for a GPU with an H100/H200's shared memory."""
    runner = CliRunner(env={"COLUMNS": "200"})  # rich wraps table cells at 80
    bf16 = runner.invoke(cce, ["tune", "--vocab", "128256", "--hidden", "4096", "--tokens", "8192", "--dry-run"])
    assert bf16.exit_code == 0, bf16.output
    shared_memory = str(device_limits(TINY).shared_memory_bytes)  # 232448 off the GPU
    for text in ("cuda", shared_memory, "no-grad forward", "fwd+bwd minus fwd", "first sweep", "cuBLAS", "slab_v"):
        assert text in bf16.output
    fp16 = runner.invoke(cce, ["tune", "--vocab", "1000", "--hidden", "64", "--tokens", "100", "--dtype", "fp16",
                               "--dry-run"])
    assert fp16.exit_code == 0 and "cuBLAS" not in fp16.output and "grad_hidden" in fp16.output


def test_candidates_fit_the_gpu_and_launch_differently() -> None:
    bf16 = Limits(shared_memory_bytes=232_448, element_bytes=2)
    assert bf16.fits(TileConfig(128, 256, 64, 8, 8, 4))
    assert not bf16.fits(TileConfig(256, 256, 64, 8, 8, 4))  # 262144 bytes of stages
    assert not bf16.fits(TileConfig(256, 256, 32, 8, 4, 2))  # 512 accumulator registers a thread
    llama = Problem(n=8192, v=128_256, d=4096, dtype="bfloat16", mode="filtered")
    space = KernelSpace("grad_logits", {"slab_v": (2048, 4096, 8192, 16384)}, llama, bf16)
    start = KernelConfig(slab_v=4096)
    # slab_v 16384 plans the same slabs as 8192 within the scratch budget: not tried again.
    assert [config.slab_v for config in space.along(start, "slab_v")] == [2048, 8192]
    # Exact mode's calls take the fused forward, which no slab shapes; its token chunk is searched,
    # within the memory plan's budget (2816 rows here: 0.75 of the gradients' bytes over a row's).
    fused = KernelSpace("grad_logits", {"slab_v": (2048, 8192), "workspace_rows": (1024, 2048, 16384)},
                        replace(llama, mode="exact"), bf16)
    assert fused.workspace_budget == 2816
    assert list(fused.along(start, "slab_v")) == []
    assert [config.workspace_rows for config in fused.along(start, "workspace_rows")] == [1024, 2048]
    tiny = KernelSpace("forward", {"block_k": (32, 64, 128)}, TINY, bf16)
    assert [config.forward.block_k for config in tiny.along(KernelConfig(), "block_k")] == []  # D = 32


@pytest.mark.parametrize(("v", "d", "n", "dtype"), [(50_000, 8, 8192, "float32"), (2, 4096, 8192, "bfloat16")])
def test_the_plan_counts_every_candidate_its_first_sweep_tries(v: int, d: int, n: int, dtype: str) -> None:
    """The space's size counted only tiles no wider than the problem, but a sweep of vocab_splits,
    slab_v or workspace_rows tries them with the start's tile, as wide as it is: cce tune --dry-run
    planned 'candidates 0, first sweep 6' for D = 8 in fp32 (the heuristic's block_k is 32)."""
    problem = Problem(n=n, v=v, d=d, dtype=dtype, mode="exact")
    limits = Limits(shared_memory_bytes=232_448, element_bytes=problem.element_bytes)
    start = heuristic_config(problem.key("cuda"))
    for space in kernel_spaces(problem, "cuda", limits):
        assert space.first_pass(start) <= space.size(start), space.kernel


@pytest.mark.parametrize(("v", "d", "n", "dtype"), [
    (16, 64, 64, "bfloat16"), (4096, 16, 8, "bfloat16"), (1, 1, 1, "float32"), (16, 16, 16, "float16"),
])
def test_a_problem_smaller_than_the_tiles_gets_tiles_clipped_to_it(v: int, d: int, n: int, dtype: str) -> None:
    """Every candidate tile was 32 to 256 wide and none wider than the problem was admitted, so a
    dimension below 32 (64 for the rows and columns) left the search nothing: `cce tune --vocab 16`
    planned 'first sweep 0' for every kernel. Wider tiles are now clipped to the padded dimension
    (16 at least: Triton's smallest dot), so every kernel has candidates, all within the problem."""
    problem = Problem(n=n, v=v, d=d, dtype=dtype, mode="exact")
    limits = Limits(shared_memory_bytes=232_448, element_bytes=problem.element_bytes)
    start = heuristic_config(problem.key("cuda"))
    for space in kernel_spaces(problem, "cuda", limits):
        tried = [candidate for axis in space.axes for candidate in space.along(start, axis)]
        assert 0 < space.first_pass(start) <= space.size(start), space.kernel
        assert all(space.admits(getattr(candidate, space.kernel)) for candidate in tried
                   if getattr(candidate, space.kernel) != getattr(start, space.kernel)), space.kernel


@pytest.mark.interpreter
def test_a_clipped_candidate_is_checked_and_timed() -> None:
    """On V = D = N = 16 the interpreter's 32-wide tiles are clipped to 16: the candidate runs,
    computes the default config's results and is timed."""
    problem = Problem(n=16, v=16, d=16, dtype="float32", mode="exact")
    space = KernelSpace("forward", {"block_n": (64,)}, problem, device_limits(problem))
    tuner = Tuner(problem, "interpreter", [space], WallClockTimer(warmup=0, runs=1), budget_s=600, input_sets=1)
    [trial] = tuner.run().trials
    assert trial.status == "timed", trial.detail
    assert (trial.config.forward.block_m, trial.config.forward.block_n, trial.config.forward.block_k) == (16, 16, 16)


def test_persistent_kernels_drop_the_axes_they_ignore() -> None:
    """The 16-bit forward runs persistent in both modes (no vocab splits), and exact mode's
    fused forward (on tensor descriptors off a Hopper) clamps its stages to what fits beside
    its staged output tile: candidates that differ only there launch the same kernel and are
    not timed twice. An fp32 forward still splits the vocabulary, and filtered mode's
    recompute (the pointer kernel) keeps its stages."""
    bf16 = Limits(shared_memory_bytes=232_448, element_bytes=2)
    start = KernelConfig(forward=TileConfig(128, 256, 64, 8, 8, 4), grad_logits=TileConfig(128, 256, 64, 8, 8, 4),
                         vocab_splits=16)
    exact = Problem(n=8192, v=128_256, d=4096, dtype="bfloat16", mode="exact")
    filtered = Problem(n=8192, v=128_256, d=4096, dtype="bfloat16", mode="filtered")
    splits = {"vocab_splits": (1, 4, 16)}
    fp32 = Problem(n=8192, v=128_256, d=4096, dtype="float32", mode="filtered")
    assert list(KernelSpace("forward", splits, exact, bf16).along(start, "vocab_splits")) == []
    assert list(KernelSpace("forward", splits, filtered, bf16).along(start, "vocab_splits")) == []
    fp32_limits = Limits(shared_memory_bytes=232_448, element_bytes=4)
    assert [c.vocab_splits for c in KernelSpace("forward", splits, fp32, fp32_limits).along(start, "vocab_splits")] == [1, 4]
    stages = {"num_stages": (2, 3, 4, 5)}
    tried = KernelSpace("grad_logits", stages, exact, bf16).along(start, "num_stages")
    assert [config.grad_logits.num_stages for config in tried] == [2]  # 3, 4 and 5 all launch 3
    tried = KernelSpace("grad_logits", stages, filtered, bf16).along(start, "num_stages")
    assert [config.grad_logits.num_stages for config in tried] == [2, 3]  # 5 stages do not fit
    short_k = Problem(n=16384, v=151_936, d=896, dtype="bfloat16", mode="exact")  # the fused kernel too
    tried = KernelSpace("grad_logits", stages, short_k, bf16).along(start, "num_stages")
    assert [config.grad_logits.num_stages for config in tried] == [2]


def test_tiles_the_gluon_kernels_ignore_are_not_searched_on_hopper() -> None:
    """On a Hopper GPU exact mode's plain forward and fused forward run the Gluon kernels, whose
    tile is their own, where K is short (Qwen2.5's D = 896; the plain forward's up to D =
    1024, the fused forward's too): the config's logits tiles launch nothing different there,
    so the search tries none of them, but still the fused forward's token chunk; at Gemma-2's
    D = 2304 and Llama-3's D = 4096 (the fused forward's TMA kernel), at D = 8192, on another
    GPU, or in filtered mode the tiles are searched."""
    hopper = Limits(shared_memory_bytes=232_448, element_bytes=2, hopper=True)
    other = Limits(shared_memory_bytes=232_448, element_bytes=2)
    start = KernelConfig(forward=TileConfig(128, 256, 64, 8, 8, 4), grad_logits=TileConfig(128, 256, 64, 8, 8, 4))
    qwen = Problem(n=16384, v=151_936, d=896, dtype="bfloat16", mode="exact")
    gemma = Problem(n=8192, v=256_000, d=2304, dtype="bfloat16", mode="exact")
    llama = Problem(n=8192, v=128_256, d=4096, dtype="bfloat16", mode="exact")
    wide = Problem(n=4096, v=128_256, d=8192, dtype="bfloat16", mode="exact")
    qwen_filtered = replace(qwen, mode="filtered")
    axes = {"group_m": (4, 8, 16, 32), "block_n": (64, 128, 256), "workspace_rows": (256, 512)}

    def tried(kernel: str, problem: Problem, limits: Limits, axis: str) -> int:
        return len(list(KernelSpace(kernel, axes, problem, limits).along(start, axis)))

    for kernel in ("forward", "grad_logits"):
        for axis in ("group_m", "block_n"):
            assert tried(kernel, qwen, hopper, axis) == 0
            assert tried(kernel, qwen, other, axis) > 0
            assert tried(kernel, wide, hopper, axis) > 0
            assert tried(kernel, qwen_filtered, hopper, axis) > 0
    for axis in ("group_m", "block_n"):
        assert tried("forward", gemma, hopper, axis) > 0
        assert tried("grad_logits", gemma, hopper, axis) > 0
        assert tried("grad_logits", llama, hopper, axis) > 0
    assert tried("grad_logits", qwen, hopper, "workspace_rows") > 0


def test_filtered_mode_tunes_its_sparse_gemm_tiles_in_eager_cuda() -> None:
    """Exact mode's eager bf16 gradient GEMMs are cuBLAS (their tiles untuned); filtered
    mode's block-sparse GEMMs are Triton kernels, so the tuner searches their tiles too."""
    from cce_compile.tuning.candidates import kernel_spaces, untuned_kernels

    problem = Problem(n=8192, v=128256, d=4096, dtype="bfloat16", mode="filtered")
    assert set(untuned_kernels(replace(problem, mode="exact"), "cuda")) == {"grad_classifier", "grad_hidden"}
    assert untuned_kernels(problem, "cuda") == {}
    spaces = kernel_spaces(problem, "cuda", Limits(232448, 2))
    assert {space.kernel for space in spaces} == {"forward", "grad_logits", "grad_classifier", "grad_hidden"}
