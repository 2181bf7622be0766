"""Requests that once broke an endpoint or slipped past validation (issue 32), through the
HTTP API on SQLite and PostgreSQL: each must get a clear 4xx (or 503 when the database
cannot serve) and leave every endpoint working."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, event, text
from sqlalchemy.engine import make_url

from tests.db_fixtures import GPU_H100, POSTGRES_URL, bearer, lookup_params, measurement_data
from service.app import create_app
from service.settings import ServiceSettings
from tests.test_service_api import (
    ADMIN_TOKEN,
    READ_TOKEN,
    TOKENS,
    WRITE_TOKEN,
    best,
    exported,
    make_client,
    post_measurement,
)
from tuning_db import engine as engine_module
from tuning_db import store
from tuning_db.engine import make_engine
from tuning_db.records import ExportHeader, ExportLine
from tuning_db.scratch import scratch_schema

MAX_ECHO_CHARS = 1000
"""No 422 answer may carry more than about this much of a string it was sent."""


@pytest.fixture
def client(db_url: str) -> Iterator[TestClient]:
    with make_client(db_url) as test_client:
        yield test_client


def _post(client: TestClient, body: dict[str, Any]) -> Any:
    return client.post("/v1/measurements", json=body, headers=bearer(WRITE_TOKEN))


@pytest.mark.parametrize("name", ["___", "   ", "_ _", "...", "-", "(-)", "._.", ". . ."])
def test_a_gpu_name_without_a_letter_or_digit_is_422(client: TestClient, name: str) -> None:
    response = _post(client, measurement_data(gpu={**GPU_H100, "name": name}))
    assert response.status_code == 422, response.text
    assert "gpu" in json.dumps(response.json()["detail"][0]["loc"])
    assert client.get("/v1/configs/best", params=lookup_params(gpu=name), headers=bearer(READ_TOKEN)).status_code == 422
    assert exported(client).count("\n") == 1


def test_a_stored_row_that_fails_validation_breaks_no_endpoint(client: TestClient, db_url: str) -> None:
    """Rows written before a rule existed (or by hand) are served as they are, never a 500."""
    entry_id = post_measurement(client)["entry_id"]
    engine = make_engine(db_url)
    with engine.begin() as connection:
        connection.execute(text("UPDATE gpus SET name = ''"))
        connection.execute(text("UPDATE measurements SET host = ''"))
    engine.dispose()
    headers = bearer(READ_TOKEN)
    assert client.get("/v1/export", headers=headers).status_code == 200
    page = client.get("/v1/configs", headers=headers)
    assert page.status_code == 200 and page.json()["items"][0]["gpu"]["name"] == ""
    assert client.get("/v1/gpus", headers=headers).status_code == 200
    assert client.post(f"/v1/configs/{entry_id}/retire", headers=bearer(ADMIN_TOKEN)).status_code == 200


@pytest.mark.parametrize("value", [4.0, 4.5, True, "4"])
def test_num_warps_must_be_an_integer(client: TestClient, value: Any) -> None:
    response = _post(client, measurement_data(config={"forward": {"num_warps": value}}))
    assert response.status_code == 422, response.text
    assert "num_warps" in response.text


def test_import_refuses_a_float_num_warps(client: TestClient) -> None:
    post_measurement(client)
    export = exported(client)
    header, line = export.splitlines()
    edited = json.loads(line)
    edited["config"]["forward"]["num_warps"] = 4.0
    edited["measurement_uid"] = "b" * 32
    body = f"{header}\n{json.dumps(edited)}\n"
    response = client.post("/v1/import", content=body, headers=bearer(ADMIN_TOKEN))
    assert response.status_code == 422 and response.json()["line"] == 2
    assert "num_warps" in response.text
    assert exported(client) == export


def test_metrics_labels_stay_bounded_whatever_the_method(client: TestClient) -> None:
    for number in range(50):
        client.request(f"INVENTED{number}", "/v1/gpus")
    metrics = client.get("/metrics").text
    assert "INVENTED" not in metrics
    assert 'method="other"' in metrics


@pytest.mark.parametrize(
    ("path", "params"),
    [
        ("/v1/configs", {"offset": 2**63}),
        ("/v1/configs", {"offset": 2**31}),
        ("/v1/configs", {"limit": 2**63}),
        ("/v1/configs", {"V": 2**63}),
        ("/v1/configs/best", lookup_params(tokens=2**63)),
        ("/v1/configs/best", lookup_params(V=2**64, sm_count=2**63, compute_capability="9.0")),
    ],
)
def test_huge_integers_in_queries_are_422(client: TestClient, path: str, params: dict[str, Any]) -> None:
    response = client.get(path, params=params, headers=bearer(READ_TOKEN))
    assert response.status_code == 422, response.text


@pytest.mark.parametrize("entry_id", [2**31, 2**63, 2**64, -1, 0, "1.0", "+1", "01", " 1", "1e0"])
def test_huge_negative_or_oddly_written_entry_ids_are_422(client: TestClient, entry_id: int | str) -> None:
    """'1.0', '+1' and '01' once retired entry 1."""
    post_measurement(client)
    response = client.post(f"/v1/configs/{entry_id}/retire", headers=bearer(ADMIN_TOKEN))
    assert response.status_code == 422, response.text
    assert best(client)["entry_id"] == 1, "the entry is still served"


def test_a_query_parameter_given_twice_is_422_not_the_last_one_silently(client: TestClient) -> None:
    """?V=5&V=128256 once looked up V=128256; ?mode=overwrite&mode=skip imported as skip."""
    post_measurement(client)
    params = lookup_params()
    query = "&".join(f"{name}={value}" for name, value in params.items()) + f"&V={params['V']}"
    response = client.get(f"/v1/configs/best?{query}", headers=bearer(READ_TOKEN))
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["query", "V"], response.text
    imported = client.post("/v1/import?mode=overwrite&mode=skip", content=exported(client), headers=bearer(ADMIN_TOKEN))
    assert imported.status_code == 422, imported.text
    assert best(client)["entry_id"] == 1


def test_an_authorization_or_idempotency_key_header_given_twice_is_422_not_the_first_silently(
    client: TestClient,
) -> None:
    """Two Authorization headers were authorized by the first alone (a read token then an admin
    one read; an admin token then an unknown one retired), two Idempotency-Keys stored the
    measurement under the first; each is refused as a repeated query parameter is, naming the
    header, whatever the order, and nothing changes."""
    post_measurement(client)
    before = exported(client)
    for tokens in ((ADMIN_TOKEN, "unknown-token-1"), ("unknown-token-1", ADMIN_TOKEN), (ADMIN_TOKEN, ADMIN_TOKEN)):
        headers = [("Authorization", f"Bearer {token}") for token in tokens]
        for method, path in (("POST", "/v1/configs/1/retire"), ("GET", "/v1/export")):
            response = client.request(method, path, headers=headers)
            assert response.status_code == 422, response.text
            assert response.json()["detail"] == [
                {"loc": ["header", "Authorization"], "msg": "given more than once; give it once", "type": "value_error"}]
    keys = [("Idempotency-Key", "a" * 32), ("Idempotency-Key", "b" * 32)]
    response = client.post("/v1/measurements", json=measurement_data(V=5),
                           headers=[*bearer(WRITE_TOKEN).items(), *keys])
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["header", "Idempotency-Key"]
    assert exported(client) == before
    assert best(client)["entry_id"] == 1


def _uid_line(client: TestClient) -> tuple[str, dict[str, Any]]:
    header, line = exported(client).splitlines()
    return header, json.loads(line)


@pytest.mark.parametrize("mode", ["keep_better", "overwrite", "skip"])
def test_an_edited_line_with_a_known_uid_is_refused(client: TestClient, mode: str) -> None:
    """A uid names one measurement: the same uid with other content is a conflict, reported."""
    post_measurement(client, median_ms=8.0, p20_ms=7.0, p80_ms=9.0)
    before = exported(client)
    header, line = _uid_line(client)
    edited = line | {"median_ms": 3.0, "p20_ms": 3.0}
    response = client.post(
        "/v1/import", params={"mode": mode}, content=f"{header}\n{json.dumps(edited)}\n", headers=bearer(ADMIN_TOKEN)
    )
    assert response.status_code == 422, response.text
    assert response.json()["line"] == 2 and "uid" in response.json()["detail"]
    assert exported(client) == before


def test_a_line_carrying_another_keys_uid_cannot_revert_that_key(client: TestClient) -> None:
    post_measurement(client, median_ms=9.0, p20_ms=9.0, p80_ms=9.0)
    post_measurement(client, tokens=1024, median_ms=3.0, p20_ms=3.0, p80_ms=3.0)
    before = exported(client)
    header, *lines = before.splitlines()
    key_a, key_b = (json.loads(line) for line in lines)
    assert (key_a["tokens"], key_b["tokens"]) == (1024, 8192)
    borrowed = key_b | {"measurement_uid": key_a["measurement_uid"]}
    body = header.replace('"entries":2', '"entries":1') + "\n" + json.dumps(borrowed) + "\n"
    response = client.post("/v1/import", params={"mode": "overwrite"}, content=body, headers=bearer(ADMIN_TOKEN))
    assert response.status_code == 422, response.text
    assert exported(client) == before
    assert best(client, tokens=1024)["source"]["median_ms"] == 3.0


def test_a_file_repeating_a_uid_with_other_content_is_refused(client: TestClient) -> None:
    post_measurement(client)
    before = exported(client)
    header, line = _uid_line(client)
    fresh = line | {"measurement_uid": "c" * 32}
    other = fresh | {"host": "node-2"}
    body = "\n".join([header.replace('"entries":1', '"entries":2'), json.dumps(fresh), json.dumps(other)]) + "\n"
    response = client.post("/v1/import", content=body, headers=bearer(ADMIN_TOKEN))
    assert response.status_code == 422 and response.json()["line"] == 3, response.text
    assert exported(client) == before


def test_reimporting_an_export_changes_nothing_and_reports_no_replacement(client: TestClient) -> None:
    post_measurement(client)
    before = exported(client)
    response = client.post("/v1/import", params={"mode": "overwrite"}, content=before, headers=bearer(ADMIN_TOKEN))
    assert response.status_code == 200, response.text
    assert (response.json()["measurements_added"], response.json()["entries_replaced"]) == (0, 0)
    assert exported(client) == before


HUGE = "x" * 50_000
"""Far past what an answer may quote, within a measurement body's 64 KiB."""


def _large_body_client(db_url: str) -> TestClient:
    return TestClient(create_app(ServiceSettings(db_url=db_url, tokens=TOKENS, max_body_bytes=1 << 20)))


@pytest.mark.parametrize(
    "body",
    [
        measurement_data(config={"forward": {"num_warps": HUGE}}),
        measurement_data(config={HUGE: 1}),
        measurement_data(**{HUGE: 1}),
        measurement_data(kernel=HUGE),
    ],
)
def test_422_answers_do_not_echo_large_input(db_url: str, body: dict[str, Any]) -> None:
    with _large_body_client(db_url) as large_client:
        response = _post(large_client, body)
    assert response.status_code == 422
    assert len(response.content) < MAX_ECHO_CHARS + 1000, response.content[:300]


def test_an_import_error_does_not_echo_large_input(db_url: str) -> None:
    header = '{"format":"cce-tuning-db","schema_version":1,"entries":1,"measurements":1}'
    body = f"{header}\n{json.dumps(measurement_data(config={HUGE: 1}))}\n"
    with _large_body_client(db_url) as large_client:
        response = large_client.post("/v1/import", content=body, headers=bearer(ADMIN_TOKEN))
    assert response.status_code == 422
    assert len(response.content) < MAX_ECHO_CHARS + 1000


@pytest.mark.parametrize(
    "times",
    [
        {"median_ms": 5e-324, "p20_ms": 5e-324, "p80_ms": 5e-324},
        {"median_ms": 1e-9, "p20_ms": 1e-9, "p80_ms": 1e-9},
        {"default_ms": 5e-324},
        {"median_ms": 9e6, "p20_ms": 9e6, "p80_ms": 9e6, "default_ms": 9e6},
    ],
)
def test_implausible_timings_are_422(client: TestClient, times: dict[str, float]) -> None:
    post_measurement(client)
    before = exported(client)
    response = _post(client, measurement_data(**times))
    assert response.status_code == 422, response.text
    assert exported(client) == before
    assert best(client)["speedup"] == pytest.approx(1.5)


@pytest.mark.postgres
@pytest.mark.parametrize("path", ["/v1/gpus", "/v1/configs", "/v1/export"])
def test_v1_is_503_with_a_hint_before_the_schema_is_upgraded(postgres_schema_url: str, path: str) -> None:
    """PostgreSQL's replicas never migrate a shared schema: until `cce db upgrade` every call
    says so, as /readyz does."""
    with scratch_schema(POSTGRES_URL, prefix="cce_test") as empty_url, make_client(empty_url) as not_upgraded:
        response = not_upgraded.get(path, headers=bearer(READ_TOKEN))
        assert response.status_code == 503, response.text
        assert "cce db upgrade" in response.json()["detail"]
        assert response.headers.get("Retry-After")
        posted = not_upgraded.post("/v1/measurements", json=measurement_data(), headers=bearer(WRITE_TOKEN))
        assert posted.status_code == 503


def test_a_write_that_times_out_on_the_lock_is_503_with_retry_after(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process holding SQLite's write lock longer than the busy timeout: 503, not 500."""
    monkeypatch.setattr(engine_module, "SQLITE_BUSY_TIMEOUT_MS", 200)
    holder = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"), isolation_level=None)
    with make_client(sqlite_url) as locked_client:
        holder.execute("BEGIN IMMEDIATE")
        try:
            response = _post(locked_client, measurement_data())
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        assert response.status_code == 503, response.text
        assert int(response.headers["Retry-After"]) >= 1
        assert _post(locked_client, measurement_data()).status_code == 201


def test_a_read_only_database_is_503_without_retry_after(db_url: str) -> None:
    """SQLite opened read-only, PostgreSQL in read-only transactions (a hot standby): no retry
    mends it, so no Retry-After (it once said 'busy, retry later', forever); reads still work."""
    with make_client(db_url) as writable:
        post_measurement(writable)
    if db_url.startswith("sqlite"):
        read_only_url = f"sqlite:///file:{db_url.removeprefix('sqlite:///')}?mode=ro&uri=true"
    else:
        options = make_url(db_url).query["options"]
        read_only_url = make_url(db_url).update_query_dict(
            {"options": f"{options} -cdefault_transaction_read_only=on"}).render_as_string(hide_password=False)
    with make_client(read_only_url) as read_only:
        response = _post(read_only, measurement_data(V=4096))
        assert response.status_code == 503, response.text
        assert "read-only" in response.json()["detail"] and "Retry-After" not in response.headers
        assert read_only.get("/v1/configs/best", params=lookup_params(), headers=bearer(READ_TOKEN)).status_code == 200
        assert exported(read_only).count("\n") == 2


def _page_cap(extra_pages: int):
    """A connect hook capping each new SQLite connection's database at its file's pages plus
    `extra_pages`: past them SQLite answers SQLITE_FULL, as on a full disk."""
    def cap(dbapi_connection: Any, _record: Any) -> None:
        (pages,) = dbapi_connection.execute("PRAGMA page_count").fetchone()
        dbapi_connection.execute(f"PRAGMA max_page_count = {pages + extra_pages}")
    return cap


def test_a_full_database_is_503_naming_it_without_retry_after(sqlite_url: str) -> None:
    """SQLite out of space: no retry mends it, so 503 without Retry-After, naming the full disk
    (it said 'busy or unavailable, retry later', and `cce tune --publish` retried to no purpose);
    what was stored stays, reads work, and writes go on once there is room."""
    with make_client(sqlite_url) as writable:
        post_measurement(writable)
        before = exported(writable)
    cap = _page_cap(0)
    event.listen(Engine, "connect", cap)
    try:
        with make_client(sqlite_url) as full:
            answers = [_post(full, measurement_data(V=4096 + i, host=f"node-{i}-" + "x" * 100)) for i in range(40)]
            refused = [answer for answer in answers if answer.status_code != 201]
            assert refused and {answer.status_code for answer in refused} == {503}, [a.text for a in refused]
            assert "disk is full" in refused[0].json()["detail"] and "Retry-After" not in refused[0].headers
            assert full.get("/v1/configs/best", params=lookup_params(), headers=bearer(READ_TOKEN)).status_code == 200
    finally:
        event.remove(Engine, "connect", cap)
    with make_client(sqlite_url) as freed:
        assert set(before.splitlines()[1:]) <= set(exported(freed).splitlines())
        assert _post(freed, measurement_data(V=999)).status_code == 201


def test_an_import_stopped_by_a_full_database_asks_no_retry(sqlite_url: str, tmp_path: Any,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """An SQLite import whose later batch found the database full keeps the batches before it
    and says so, without Retry-After (that is for a lock, which passes)."""
    source_url = f"sqlite:///{tmp_path / 'source.db'}"
    with make_client(source_url) as source:
        for i in range(40):
            post_measurement(source, V=4096 + i, host=f"node-{i}-" + "x" * 100)
        body = exported(source)
    monkeypatch.setattr(store, "IMPORT_BATCH_LINES", 1)
    monkeypatch.setattr(store, "SQLITE_BATCH_PAUSE_S", 0)
    cap = _page_cap(3)
    event.listen(Engine, "connect", cap)
    try:
        with _large_body_client(sqlite_url) as target:
            response = target.post("/v1/import", content=body, headers=bearer(ADMIN_TOKEN))
    finally:
        event.remove(Engine, "connect", cap)
    assert response.status_code == 503, response.text
    assert response.json()["lines_imported"] > 0 and "full" in response.json()["detail"]
    assert "Retry-After" not in response.headers


def test_a_large_import_commits_in_bounded_transactions_on_sqlite_and_once_on_postgres(engine: Engine) -> None:
    """On SQLite other writers get its one lock between batches: no import holds it for the
    whole file. PostgreSQL locks rows, so there the import is one transaction (all or none)."""
    lines = [
        ExportLine.model_validate_json(
            json.dumps(measurement_data(V=vocab, measurement_uid=f"{vocab:032x}", created_at="2026-01-01T00:00:00Z"))
        ).model_dump_json()
        for vocab in range(1, 2 * store.IMPORT_BATCH_LINES + 2)
    ]
    header = ExportHeader(entries=len(lines), measurements=len(lines)).model_dump_json()
    commits: list[int] = []
    event.listen(engine, "commit", lambda _connection: commits.append(1))
    report = store.import_jsonl(engine, [header, *lines])
    assert report.measurements_added == len(lines)
    batches = 3 if engine.dialect.name == "sqlite" else 1
    assert len(commits) == 1 + batches  # the read-only check against the store, then the writes
