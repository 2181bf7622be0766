"""The HTTP API through FastAPI's TestClient, on SQLite and PostgreSQL: routes, auth,
metrics, and bad input that must get a 4xx and leave the database as it was."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text

from tests.db_fixtures import (
    GPU_H100,
    H100_KEY,
    POSTGRES_URL,
    bearer,
    lookup_params,
    measurement_count,
    measurement_data,
)
from service.app import create_app
from service.settings import ServiceSettings
from tuning_db.engine import make_engine
from tuning_db.migrate import head_revision
from tuning_db.scratch import scratch_schema

READ_TOKEN, WRITE_TOKEN, ADMIN_TOKEN = "read-token-0001", "write-token-0001", "admin-token-0001"
TOKENS = f"{READ_TOKEN}:read;{WRITE_TOKEN}:write;{ADMIN_TOKEN}:admin"
MAX_BODY_BYTES = 16 * 1024


def make_client(db_url: str, **settings: Any) -> TestClient:
    return TestClient(create_app(ServiceSettings(db_url=db_url, tokens=TOKENS, max_body_bytes=MAX_BODY_BYTES, **settings)))


@pytest.fixture
def client(db_url: str) -> Iterator[TestClient]:
    with make_client(db_url) as test_client:
        yield test_client


def post_measurement(client: TestClient, **overrides: Any) -> dict[str, Any]:
    response = client.post("/v1/measurements", json=measurement_data(**overrides), headers=bearer(WRITE_TOKEN))
    assert response.status_code == 201, response.text
    return response.json()


def best(client: TestClient, **overrides: Any) -> dict[str, Any]:
    response = client.get("/v1/configs/best", params=lookup_params(**overrides), headers=bearer(READ_TOKEN))
    assert response.status_code == 200, response.text
    return response.json()


def exported(client: TestClient) -> str:
    response = client.get("/v1/export", headers=bearer(READ_TOKEN))
    assert response.status_code == 200
    return response.text


def test_health_readiness_and_docs(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok", "detail": None}
    assert client.get("/readyz").status_code == 200
    assert client.get("/docs").status_code == 200
    paths = set(client.get("/openapi.json").json()["paths"])
    assert {"/v1/configs/best", "/v1/configs", "/v1/measurements", "/v1/gpus", "/v1/export", "/v1/import"} <= paths
    assert "/v1/configs/{entry_id}/retire" in paths


def test_readyz_is_503_when_the_database_is_unreachable() -> None:
    with make_client("postgresql+psycopg://postgres@127.0.0.1:1/test") as unreachable:
        response = unreachable.get("/readyz")
        head = unreachable.head("/readyz")
    assert response.status_code == 503
    assert "unreachable" in response.json()["detail"]
    assert head.status_code == 503 and head.content == b""


def _readyz_of_a_database_made_by(*statements: str) -> Any:
    """/readyz of a service on a fresh PostgreSQL schema holding an alembic_version table and
    what `statements` make (another program's database)."""
    with scratch_schema(POSTGRES_URL, prefix="cce_test") as url:
        engine = make_engine(url)
        with engine.begin() as connection:
            connection.execute(text("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)"))
            for statement in statements:
                connection.execute(text(statement))
        engine.dispose()
        with make_client(url) as foreign:
            return foreign.get("/readyz")


@pytest.mark.postgres
def test_readyz_names_an_alembic_version_of_several_rows() -> None:
    """Another program's alembic_version of several rows, in the PostgreSQL schema a replica
    serves (it never migrates one), was 'database unreachable: CommandError'."""
    response = _readyz_of_a_database_made_by("INSERT INTO alembic_version VALUES ('a1'), ('b2')")
    assert response.status_code == 503
    assert "several revisions" in response.json()["detail"]


def test_health_checks_answer_head(client: TestClient) -> None:
    for path in ("/healthz", "/readyz"):
        response = client.head(path)
        assert response.status_code == 200 and response.content == b"", path
    assert "head" not in client.get("/openapi.json").json()["paths"]["/healthz"]


def test_metrics_name_every_matched_route_by_its_template(client: TestClient) -> None:
    """Starlette's own routes too (the OpenAPI schema, the docs' files); only a path that no
    route takes is 'unmatched', so the labels stay a bounded set."""
    for path in ("/openapi.json", "/docs/assets/swagger-ui.css", "/docs/assets/missing.js", "/no/such/path"):
        client.get(path)
    metrics = client.get("/metrics").text
    assert 'cce_http_requests_total{method="GET",route="/openapi.json",status="200"} 1.0' in metrics
    assert 'cce_http_requests_total{method="GET",route="/docs/assets",status="200"} 1.0' in metrics
    assert 'cce_http_requests_total{method="GET",route="/docs/assets",status="404"} 1.0' in metrics
    assert 'cce_http_requests_total{method="GET",route="unmatched",status="404"} 1.0' in metrics
    assert 'route="unmatched",status="200"' not in metrics


@pytest.mark.postgres
def test_readyz_is_503_until_a_postgres_schema_is_upgraded(postgres_schema_url: str) -> None:
    """Replicas never migrate a shared PostgreSQL: they wait for `cce db upgrade`."""
    with scratch_schema(POSTGRES_URL, prefix="cce_test") as empty_url, make_client(empty_url) as not_upgraded:
        response = not_upgraded.get("/readyz")
    assert response.status_code == 503
    assert "cce db upgrade" in response.json()["detail"]


@pytest.mark.postgres
def test_readyz_is_503_on_another_projects_database_at_this_revision(postgres_schema_url: str) -> None:
    """Another Alembic project's database whose revision id is this code's head: /readyz said
    ready (it compared only the revision) while every lookup answered 503."""
    response = _readyz_of_a_database_made_by(f"INSERT INTO alembic_version VALUES ('{head_revision()}')",
                                             "CREATE TABLE users (id INTEGER PRIMARY KEY)")
    assert response.status_code == 503
    assert "has no table gpus" in response.json()["detail"]


def test_measurement_then_lookup_with_metrics(client: TestClient) -> None:
    recorded = post_measurement(client, median_ms=8.0, p20_ms=7.0, p80_ms=9.0, default_ms=12.0)
    assert recorded["is_best"]
    answer = best(client)
    assert answer["match_level"] == "exact"
    assert answer["entry_id"] == recorded["entry_id"]
    assert answer["speedup"] == pytest.approx(1.5)
    assert answer["config"]["slab_v"] == 8192
    assert answer["source"]["host"] == "node-1" and answer["source"]["gpu"]["name"] == H100_KEY
    assert best(client, tokens=20000)["match_level"] == "nearest_bucket"
    assert best(client, tokens=10**6) == {
        "match_level": "none", "config": None, "speedup": None, "entry_id": None, "n_bucket": 2**20, "source": None
    }
    metrics = client.get("/metrics").text
    assert 'cce_lookups_total{match_level="exact"} 1.0' in metrics
    assert 'cce_lookups_total{match_level="none"} 1.0' in metrics
    assert 'cce_http_requests_total{method="POST",route="/v1/measurements",status="201"} 1.0' in metrics


def test_slower_measurement_does_not_replace_the_best(client: TestClient) -> None:
    post_measurement(client, median_ms=8.0, p20_ms=7.0, p80_ms=9.0)
    slower = post_measurement(client, median_ms=9.0, p20_ms=8.0, p80_ms=10.0)
    assert (slower["is_best"], slower["best_median_ms"]) == (False, 8.0)
    assert best(client)["source"]["median_ms"] == 8.0


def test_a_measurement_sent_again_with_its_idempotency_key_is_stored_once(client: TestClient, db_url: str) -> None:
    """A client that lost the answer to a stored measurement (a gateway's 503, a timeout) and
    sends it again under the same Idempotency-Key gets the first one's answer, not a second
    row; the key in another form (hyphens, capitals) is the same key. Without a key every
    POST is a new measurement, as before keys existed."""
    key = uuid.uuid4()
    headers = bearer(WRITE_TOKEN)
    body = measurement_data()
    first = client.post("/v1/measurements", json=body, headers={**headers, "Idempotency-Key": key.hex})
    again = client.post("/v1/measurements", json=body, headers={**headers, "Idempotency-Key": str(key).upper()})
    assert (first.status_code, again.status_code) == (201, 201), again.text
    assert first.json()["measurement_uid"] == again.json()["measurement_uid"] == key.hex
    assert (first.json()["already_stored"], again.json()["already_stored"]) == (False, True)
    before = exported(client)
    other = client.post("/v1/measurements", json=measurement_data(V=5), headers={**headers, "Idempotency-Key": key.hex})
    assert other.status_code == 409 and "new Idempotency-Key" in other.json()["detail"], other.text
    bad = client.post("/v1/measurements", json=body, headers={**headers, "Idempotency-Key": "retry-1"})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["header", "Idempotency-Key"], bad.text
    assert exported(client) == before
    post_measurement(client)
    post_measurement(client)
    engine = make_engine(db_url)
    assert measurement_count(engine) == 3
    engine.dispose()


def test_list_configs_and_gpus(client: TestClient) -> None:
    for tokens in (1024, 2048, 4096):
        post_measurement(client, tokens=tokens)
    headers = bearer(READ_TOKEN)
    page = client.get("/v1/configs", params={"limit": 2, "offset": 1, "dtype": "bfloat16"}, headers=headers).json()
    assert (page["total"], [item["n_bucket"] for item in page["items"]]) == (3, [2048, 4096])
    assert client.get("/v1/configs", params={"gpu": "NVIDIA H100 80GB HBM3"}, headers=headers).json()["total"] == 3
    assert client.get("/v1/configs", params={"colour": "red"}, headers=headers).status_code == 422
    assert client.get("/v1/configs", params={"limit": 0}, headers=headers).status_code == 422
    gpus = client.get("/v1/gpus", headers=headers).json()
    assert gpus == [{**GPU_H100, "name": H100_KEY, "entries": 3}]


@pytest.mark.parametrize(
    ("method", "path", "token"),
    [
        ("GET", "/v1/gpus", READ_TOKEN),
        ("GET", "/v1/export", READ_TOKEN),
        ("POST", "/v1/measurements", WRITE_TOKEN),
        ("POST", "/v1/configs/1/retire", ADMIN_TOKEN),
    ],
)
def test_unknown_query_parameters_are_422_on_routes_that_take_none(
    client: TestClient, method: str, path: str, token: str
) -> None:
    """As on /v1/configs: a parameter a route does not take (here one another route does) is
    refused, never silently ignored, and changes nothing."""
    post_measurement(client)
    before = exported(client)
    body = {"json": measurement_data(median_ms=1.0, p20_ms=1.0, p80_ms=1.0)} if path == "/v1/measurements" else {}
    response = client.request(method, path, params={"include_retired": "true"}, headers=bearer(token), **body)
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"] == ["query", "include_retired"]
    assert exported(client) == before


def test_retire_is_admin_only_and_hides_the_entry(client: TestClient) -> None:
    entry_id = post_measurement(client)["entry_id"]
    assert client.post(f"/v1/configs/{entry_id}/retire", headers=bearer(WRITE_TOKEN)).status_code == 403
    response = client.post(f"/v1/configs/{entry_id}/retire", headers=bearer(ADMIN_TOKEN))
    assert response.status_code == 200 and response.json()["retired"]
    assert best(client)["match_level"] == "none"
    assert client.post("/v1/configs/999/retire", headers=bearer(ADMIN_TOKEN)).status_code == 404


def test_import_over_http(client: TestClient) -> None:
    post_measurement(client, median_ms=8.0, p20_ms=7.0, p80_ms=9.0)
    export = exported(client)
    header = json.loads(export.splitlines()[0])
    assert (header["schema_version"], header["entries"], header["measurements"]) == (1, 1, 1)
    faster = json.loads(export.splitlines()[1]) | {"median_ms": 4.0, "p20_ms": 4.0, "measurement_uid": "a" * 32}
    body = export.splitlines()[0] + "\n" + json.dumps(faster) + "\n"

    dry = client.post("/v1/import", params={"dry_run": "true"}, content=body, headers=bearer(ADMIN_TOKEN))
    assert dry.status_code == 200 and dry.json()["entries_replaced"] == 1
    assert exported(client) == export
    assert client.post("/v1/import", content=body, headers=bearer(WRITE_TOKEN)).status_code == 403
    done = client.post("/v1/import", params={"mode": "keep_better"}, content=body, headers=bearer(ADMIN_TOKEN))
    assert done.json() == {
        "lines": 1, "measurements_added": 1, "entries_added": 0, "entries_replaced": 1, "entries_kept": 0, "dry_run": False
    }
    assert best(client)["source"]["median_ms"] == 4.0


@pytest.mark.parametrize(
    ("method", "path", "token", "status"),
    [
        ("GET", "/v1/configs/best", None, 401),
        ("GET", "/v1/configs/best", "not-a-known-token", 401),
        ("GET", "/v1/configs/best", READ_TOKEN, 200),
        ("GET", "/v1/configs/best", ADMIN_TOKEN, 200),
        ("GET", "/v1/export", None, 401),
        ("GET", "/v1/gpus", None, 401),
        ("POST", "/v1/measurements", None, 401),
        ("POST", "/v1/measurements", READ_TOKEN, 403),
        ("POST", "/v1/measurements", WRITE_TOKEN, 201),
        ("POST", "/v1/import", WRITE_TOKEN, 403),
        ("POST", "/v1/configs/1/retire", READ_TOKEN, 403),
    ],
)
def test_tokens_and_scopes(client: TestClient, method: str, path: str, token: str | None, status: int) -> None:
    headers = bearer(token) if token else {}
    kwargs: dict[str, Any] = {"params": lookup_params()} if path == "/v1/configs/best" else {}
    if path == "/v1/measurements":
        kwargs = {"json": measurement_data()}
    assert client.request(method, path, headers=headers, **kwargs).status_code == status


def test_a_non_bearer_authorization_is_refused(client: TestClient) -> None:
    response = client.get("/v1/gpus", headers={"Authorization": f"Basic {READ_TOKEN}"})
    assert response.status_code == 401


def test_open_reads_never_open_writes(db_url: str) -> None:
    with make_client(db_url, open_reads=True) as open_client:
        assert open_client.get("/v1/configs/best", params=lookup_params()).status_code == 200
        assert open_client.get("/v1/export").status_code == 200
        assert open_client.post("/v1/measurements", json=measurement_data()).status_code == 401
        assert open_client.post("/v1/import", content="").status_code == 401


def test_token_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="unknown scope"):
        ServiceSettings(tokens="some-long-token:superuser").token_scopes()
    with pytest.raises(ValueError, match="token"):
        ServiceSettings(tokens="short:read").token_scopes()
    with pytest.raises(ValueError, match="listed more than once"):
        ServiceSettings(tokens="some-long-token:read;some-long-token:admin").token_scopes()


def test_tokens_file(tmp_path: Any, sqlite_url: str) -> None:
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text("# cluster tokens\nfile-token-0001:write\n")
    with make_client(sqlite_url, tokens_file=tokens_file) as file_client:
        response = file_client.post("/v1/measurements", json=measurement_data(), headers=bearer("file-token-0001"))
    assert response.status_code == 201


def test_a_tokens_file_may_start_with_a_byte_order_mark(tmp_path: Any, sqlite_url: str) -> None:
    """As an import file may: Notepad writes one, and the first token was refused as malformed."""
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text("file-token-0001:write\n", encoding="utf-8-sig")
    with make_client(sqlite_url, tokens_file=tokens_file) as file_client:
        response = file_client.post("/v1/measurements", json=measurement_data(), headers=bearer("file-token-0001"))
    assert response.status_code == 201


def _tile(**changes: Any) -> dict[str, Any]:
    return {"config": {"forward": {"block_m": 64, **changes}}}


SQL = "x'; DROP TABLE best_configs; --"
BAD_MEASUREMENTS: dict[str, tuple[Any, int]] = {
    "malformed json": ('{"gpu": {', 422),
    "not an object": ("[1, 2, 3]", 422),
    "empty body": ("", 422),
    "V as a string": ({"V": "128256"}, 422),
    "V as a bool": ({"V": True}, 422),
    "time as a string": ({"median_ms": "fast"}, 422),
    "sm_count as a float": ({"gpu": {**GPU_H100, "sm_count": 1.5}}, 422),
    "config as a list": ({"config": [1, 2]}, 422),
    "unknown top-level key": ({"priority": 1}, 422),
    "unknown config key": ({"config": {"hook": "os.system"}}, 422),
    "unknown tile key": (_tile(pre_hook="x"), 422),
    "tile value as a string": (_tile(block_m="64"), 422),
    "block not a power of two": (_tile(block_m=48), 422),
    "block out of range": (_tile(block_m=512), 422),
    "num_warps not allowed": (_tile(num_warps=3), 422),
    "num_stages out of range": (_tile(num_stages=9), 422),
    "slab_v out of range": ({"config": {"slab_v": 64}}, 422),
    "negative time": ({"median_ms": -1.0}, 422),
    "not a number": ({"median_ms": float("nan")}, 422),
    "quantiles out of order": ({"p20_ms": 11.0}, 422),
    "unknown dtype": ({"dtype": "int8"}, 422),
    "unknown mode": ({"mode": "fast"}, 422),
    "zero tokens": ({"tokens": 0}, 422),
    "SQL in kernel_version": ({"kernel_version": SQL}, 422),
    "SQL in gpu name": ({"gpu": {**GPU_H100, "name": SQL}}, 422),
    "SQL in submitter": ({"submitter": SQL}, 422),
    "too large": ({"host": "h" * (MAX_BODY_BYTES + 1)}, 413),
    "gpu with other properties": ({"gpu": {**GPU_H100, "sm_count": 7}}, 409),
}


@pytest.mark.parametrize("case", list(BAD_MEASUREMENTS))
def test_bad_measurements_are_refused_and_change_nothing(client: TestClient, case: str) -> None:
    post_measurement(client)
    before = exported(client)
    body, status = BAD_MEASUREMENTS[case]
    if isinstance(body, dict):
        body = json.dumps(measurement_data(**body))  # NaN stays NaN: Python writes it
    response = client.post(
        "/v1/measurements", content=body, headers={**bearer(WRITE_TOKEN), "Content-Type": "application/json"}
    )
    assert response.status_code == status, response.text
    assert exported(client) == before


def test_a_chunked_body_over_the_limit_is_refused(client: TestClient) -> None:
    before = exported(client)

    def chunks() -> Iterator[bytes]:
        for _ in range(MAX_BODY_BYTES // 1024 + 2):
            yield b" " * 1024

    response = client.post(
        "/v1/import", content=chunks(), headers=bearer(ADMIN_TOKEN)
    )
    assert response.status_code == 413
    assert exported(client) == before


def test_a_measurement_giving_a_key_twice_is_refused_naming_it(client: TestClient) -> None:
    """FastAPI's JSON parser keeps the last of a repeated key: a body with "tokens" twice was
    stored with the later value."""
    post_measurement(client)
    before = exported(client)
    body = json.dumps(measurement_data())[:-1] + ', "tokens": 1}'
    response = client.post(
        "/v1/measurements", content=body, headers={**bearer(WRITE_TOKEN), "Content-Type": "application/json"}
    )
    assert response.status_code == 422
    assert "the key 'tokens' is given twice" in response.json()["detail"][0]["msg"]
    assert exported(client) == before


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "text/json"])
def test_a_measurement_sent_as_another_media_type_is_415_naming_json(client: TestClient, content_type: str) -> None:
    """A JSON body sent as text/plain (or as a form, curl -d's default) was validated as the raw
    bytes: 422 'Input should be a valid dictionary', as if the JSON were wrong."""
    body = json.dumps(measurement_data())
    response = client.post("/v1/measurements", content=body,
                           headers={**bearer(WRITE_TOKEN), "Content-Type": content_type})
    assert response.status_code == 415, response.text
    assert response.json() == {"detail": f"the body's Content-Type must be application/json, not {content_type!r}"}
    assert exported(client).count("\n") == 1
    for json_type in ("application/json; charset=utf-8", "Application/JSON", "application/vnd.cce+json"):
        response = client.post("/v1/measurements", content=body,
                               headers={**bearer(WRITE_TOKEN), "Content-Type": json_type})
        assert response.status_code == 201, response.text


def test_a_measurement_sent_without_a_content_type_is_read_as_json(client: TestClient) -> None:
    """docs/service.md: a body with no Content-Type is read as JSON. Recent FastAPI (0.165 here) made its
    default strict_content_type=True: such a body was validated as raw bytes, 422 'Input should
    be a valid dictionary', as if the JSON were wrong."""
    body = json.dumps(measurement_data()).encode()
    request = client.build_request("POST", "/v1/measurements", content=body, headers=bearer(WRITE_TOKEN))
    assert "content-type" not in request.headers
    response = client.send(request)
    assert response.status_code == 201, response.text
    assert exported(client).count("\n") == 2
    duplicate = json.dumps(measurement_data())[:-1] + ', "tokens": 1}'
    request = client.build_request("POST", "/v1/measurements", content=duplicate, headers=bearer(WRITE_TOKEN))
    response = client.send(request)
    assert response.status_code == 422 and "given twice" in response.json()["detail"][0]["msg"], response.text


def test_a_measurement_sent_with_an_empty_content_type_is_read_as_json(client: TestClient) -> None:
    """An empty Content-Type header is none: the JSON one added beside it came second, and
    FastAPI, reading the first, validated the raw bytes (422 'a valid dictionary')."""
    headers = {**bearer(WRITE_TOKEN), "Content-Type": ""}
    response = client.post("/v1/measurements", content=json.dumps(measurement_data()).encode(), headers=headers)
    assert response.status_code == 201, response.text


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (json.dumps(measurement_data()).replace('"tokens": 8192', '"tokens": ' + "9" * 5000).encode(), "digits"),
        (b"[" * 5000 + b"]" * 5000, "nested too deep"),
        (json.dumps(measurement_data()).replace("node-1", "node-\udcff").encode(errors="surrogateescape"), "utf-8"),
    ],
    ids=["digits", "nesting", "utf-8"],
)
def test_a_measurement_body_json_cannot_read_is_422_saying_why(client: TestClient, body: bytes, reason: str) -> None:
    """An integer past Python's 4300 digits, nesting past the parser's depth, a byte that is not
    UTF-8: the repeated-key check's parser raised other than JSONDecodeError, which FastAPI
    answers 400 'There was an error parsing the body', naming neither what nor where."""
    response = client.post(
        "/v1/measurements", content=body, headers={**bearer(WRITE_TOKEN), "Content-Type": "application/json"}
    )
    assert response.status_code == 422, response.text
    detail = response.json()["detail"][0]
    assert detail["type"] == "json_invalid" and reason in detail["msg"].lower(), detail
    post_measurement(client)


@pytest.mark.parametrize(
    ("body", "line"),
    [
        ("", 1),
        ('{"format": "cce-tuning-db", "schema_version": 9, "entries": 0, "measurements": 0}\n', 1),
        ('{"format": "cce-tuning-db", "schema_version": 1, "entries": 1, "measurements": 1}\n{"V": 1}\n', 2),
        (b"\xff\xfe not utf-8", 1),
        (b'{"format": "cce-tuning-db"}\n\n{"V": 1, "gpu": "\xff"}\n', 3),
        ('{"format": "cce-tuning-db", "schema_version": 1, "entries": 0, "entries": 0, "measurements": 0}\n', 1),
    ],
)
def test_bad_imports_are_refused_with_the_line_and_change_nothing(
    client: TestClient, body: str | bytes, line: int
) -> None:
    post_measurement(client)
    before = exported(client)
    response = client.post("/v1/import", content=body, headers=bearer(ADMIN_TOKEN))
    assert response.status_code == 422
    assert response.json()["line"] == line
    assert exported(client) == before


@pytest.mark.parametrize("dry_run", ["false", "true"])
def test_an_import_with_a_created_at_no_database_stores_is_422_and_changes_nothing(db_url: str, dry_run: str) -> None:
    """It once passed validation and failed on PostgreSQL: 500, with earlier batches kept."""
    lines = [
        json.dumps(measurement_data(V=vocab, measurement_uid=f"{vocab:032x}", created_at="2026-01-01T00:00:00Z"))
        for vocab in range(1, 251)
    ]
    lines[239] = lines[239].replace("2026-01-01T00:00:00Z", "9999-12-31T23:59:59-01:00")
    header = json.dumps({"format": "cce-tuning-db", "schema_version": 1, "entries": 250, "measurements": 250})
    body = "\n".join([header, *lines])
    with TestClient(create_app(ServiceSettings(db_url=db_url, tokens=TOKENS))) as client:  # body > MAX_BODY_BYTES
        post_measurement(client)
        before = exported(client)
        response = client.post("/v1/import", params={"dry_run": dry_run}, content=body, headers=bearer(ADMIN_TOKEN))
        assert response.status_code == 422, response.text
        assert response.json()["line"] == 241
        assert "created_at" in response.json()["detail"]
        assert exported(client) == before


@pytest.mark.parametrize(
    "overrides",
    [
        {"gpu": SQL},
        {"kernel": "cce' OR '1'='1"},
        {"tokens": 0},
        {"V": "many"},
        {"dtype": "int8"},
        {"compute_capability": "9.0"},
        {"extra": "1"},
    ],
)
def test_bad_lookups_are_422(client: TestClient, overrides: dict[str, Any]) -> None:
    post_measurement(client)
    response = client.get("/v1/configs/best", params=lookup_params(**overrides), headers=bearer(READ_TOKEN))
    assert response.status_code == 422
    assert best(client)["match_level"] == "exact"
