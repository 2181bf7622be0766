"""The OpenAPI schema declares every answer the routes give: for odd requests on each route
(no token, a weak or unknown one, a query parameter or header given twice, bad input, a body
over the limit or of another type, a conflict, a database that fails) the status is one that
/openapi.json declares for that operation, in a declared media type, and a JSON body validates
against the schema declared for it. A client generated from the schema (or schemathesis'
conformance checks) met 401s, 404s and 409s it had never heard of, and an import's 422 whose
body was not the HTTPValidationError the schema promised."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from jsonschema import Draft202012Validator
from sqlalchemy.exc import DBAPIError, OperationalError

from service.app import create_app
from service.settings import ServiceSettings
from tests.db_fixtures import GPU_H100, bearer, lookup_params, measurement_data
from tests.test_service_api import ADMIN_TOKEN, MAX_BODY_BYTES, READ_TOKEN, TOKENS, WRITE_TOKEN
from tuning_db import store

IDEMPOTENCY_KEY = "6f1c2b0e-8a4d-4f3e-9b7a-2d5c8e1f0a93"
OVER_THE_LIMIT = b"x" * (MAX_BODY_BYTES + 1)


def _measurement(**overrides: Any) -> dict[str, Any]:
    return {"json": measurement_data(**overrides)}


# Each route (method, template, path, its scope's token) with its odd requests, as keyword
# arguments of TestClient.request (a `token` of None sends none, a missing one the route's).
ROUTES: list[tuple[str, str, str, str | None, list[dict[str, Any]]]] = [
    ("GET", "/v1/configs/best", "/v1/configs/best", READ_TOKEN, [
        {"params": lookup_params()},
        {"params": {}},
        {"params": lookup_params(V="many")},
        {"params": lookup_params(extra="1")},
    ]),
    ("GET", "/v1/configs", "/v1/configs", READ_TOKEN, [{}, {"params": {"limit": 0}}, {"params": {"offset": -1}}]),
    ("POST", "/v1/configs/{entry_id}/retire", "/v1/configs/1/retire", ADMIN_TOKEN, [
        {},
        {"path": "/v1/configs/99/retire"},
        {"path": "/v1/configs/01/retire"},
        {"path": "/v1/configs/0/retire"},
        {"token": READ_TOKEN},
        {"token": WRITE_TOKEN},
    ]),
    ("POST", "/v1/measurements", "/v1/measurements", WRITE_TOKEN, [
        _measurement(),
        _measurement(median_ms=-1.0),
        _measurement(gpu={**GPU_H100, "sm_count": 1}),  # the GPU registered with other properties
        {**_measurement(), "headers": {"Idempotency-Key": IDEMPOTENCY_KEY}},
        {**_measurement(median_ms=12.0), "headers": {"Idempotency-Key": IDEMPOTENCY_KEY}},  # the key, another body
        {**_measurement(), "headers": {"Idempotency-Key": "not-a-uuid"}},
        {"content": b'{"kernel": "a", "kernel": "b"}', "headers": {"Content-Type": "application/json"}},
        {"content": b"{not json", "headers": {"Content-Type": "application/json"}},
        {"content": b"kernel=cce", "headers": {"Content-Type": "application/x-www-form-urlencoded"}},
        {"content": b'{"a": 1}'},
        {"token": READ_TOKEN, **_measurement()},
    ]),
    ("GET", "/v1/gpus", "/v1/gpus", READ_TOKEN, [{}, {"params": {"name": "x"}}]),
    ("GET", "/v1/export", "/v1/export", READ_TOKEN, [{}, {"params": {"since": "0"}}]),
    ("POST", "/v1/import", "/v1/import", ADMIN_TOKEN, [
        {"content": b"not json\n"},
        {"content": b""},
        {"content": b'{"schema_version": 1}\n\xff\n'},
        {"content": b"{}", "params": {"mode": "merge"}},
        {"content": b"{}", "params": {"dry_run": "perhaps"}},
        {"content": iter([OVER_THE_LIMIT])},  # chunked: refused as it arrives
        {"token": WRITE_TOKEN, "content": b"{}"},
    ]),
    ("GET", "/healthz", "/healthz", None, [{}]),
    ("GET", "/readyz", "/readyz", None, [{}]),
    ("GET", "/metrics", "/metrics", None, [{}]),
]

# What every route is sent: no token, an unknown one, a query parameter or Authorization given
# twice, a body over the limit by its Content-Length.
EVERY_ROUTE: list[dict[str, Any]] = [
    {"token": None},
    {"token": "unknown-token-0001"},
    {"headers": {"Authorization": "Basic dXNlcjpwYXNz"}},
    {"params": [("x", "1"), ("x", "2")]},
    {"auth_twice": True},
    {"content": OVER_THE_LIMIT},
]

# The store call behind each route, for the database failures.
STORE_CALLS = {
    "/v1/configs/best": "lookup",
    "/v1/configs": "list_configs",
    "/v1/configs/{entry_id}/retire": "retire",
    "/v1/measurements": "record_measurement",
    "/v1/gpus": "list_gpus",
    "/v1/export": "export_jsonl",
    "/v1/import": "import_jsonl",
}


def _locked() -> OperationalError:
    return OperationalError("UPDATE best_configs", {}, Exception("database is locked"))


DATABASE_FAILURES: dict[str, Callable[[], Exception]] = {
    "locked": _locked,
    "read-only": lambda: OperationalError("INSERT", {}, Exception("attempt to write a readonly database")),
    "other": lambda: DBAPIError("SELECT", {}, Exception("disk I/O error")),
    "import-interrupted": lambda: store.ImportInterrupted(100, 300, _locked()),
}


@pytest.fixture(scope="module")
def openapi() -> dict[str, Any]:
    """The schema as a real service serves it (it depends on no database)."""
    with TestClient(create_app(ServiceSettings(db_url="sqlite://", tokens=TOKENS))) as client:
        return client.get("/openapi.json").json()


@pytest.fixture
def client(sqlite_url: str) -> Iterator[TestClient]:
    settings = ServiceSettings(db_url=sqlite_url, tokens=TOKENS, max_body_bytes=MAX_BODY_BYTES)
    with TestClient(create_app(settings), raise_server_exceptions=False) as test_client:
        yield test_client


def send(client: TestClient, method: str, path: str, route_token: str | None, request: dict[str, Any]) -> httpx.Response:
    request = dict(request)
    token = request.pop("token", route_token)
    path = request.pop("path", path)
    headers = {**(bearer(token) if token else {}), **request.pop("headers", {})}
    if request.pop("auth_twice", False):
        headers = [*headers.items(), ("Authorization", f"Bearer {token or READ_TOKEN}")]
    return client.request(method, path, headers=headers, **request)


def assert_declared(openapi: dict[str, Any], method: str, template: str, response: httpx.Response) -> None:
    """The answer's status is declared for the operation, its media type too, and a JSON body
    validates against the declared schema."""
    answers = openapi["paths"][template][method.lower()]["responses"]
    status = str(response.status_code)
    what = f"{method} {template} answered {status} {response.text[:300]!r}"
    assert status in answers, f"{what}: undeclared (declared: {sorted(answers)})"
    media_type = response.headers.get("content-type", "").split(";")[0].strip()
    content = answers[status].get("content", {})
    assert media_type in content, f"{what}: {media_type!r} undeclared (declared: {sorted(content)})"
    if media_type == "application/json":
        schema = {**content[media_type]["schema"], "components": openapi["components"]}
        errors = [error.message for error in Draft202012Validator(schema).iter_errors(response.json())]
        assert not errors, f"{what}: body does not match its declared schema: {errors}"


def test_every_documented_route_is_exercised(openapi: dict[str, Any]) -> None:
    documented = {(method.upper(), path) for path, operations in openapi["paths"].items() for method in operations}
    assert documented == {(method, template) for method, template, *_ in ROUTES}


@pytest.mark.parametrize(("method", "template", "path", "token", "requests"), ROUTES, ids=[r[1] for r in ROUTES])
def test_every_answer_to_odd_requests_is_declared(
    client: TestClient, openapi: dict[str, Any], method: str, template: str, path: str, token: str | None,
    requests: list[dict[str, Any]],
) -> None:
    client.post("/v1/measurements", json=measurement_data(), headers=bearer(WRITE_TOKEN))  # entry 1, an H100
    statuses = set()
    for request in [*requests, *EVERY_ROUTE]:
        response = send(client, method, path, token, request)
        statuses.add(response.status_code)
        assert_declared(openapi, method, template, response)
    if template == "/v1/import":  # an export file, imported; one with a GPU of other properties
        export = client.get("/v1/export", headers=bearer(READ_TOKEN)).text
        for content in (export, export.replace('"sm_count":132', '"sm_count":1')):
            response = send(client, method, path, token, {"content": content.encode()})
            statuses.add(response.status_code)
            assert_declared(openapi, method, template, response)
    assert statuses - {413, 422}, f"{method} {template}: every request was refused before the route"


@pytest.mark.parametrize(
    ("template", "failure"),
    [*((template, failure) for template in STORE_CALLS for failure in ("locked", "read-only", "other")),
     ("/v1/import", "import-interrupted")],
)
def test_database_failures_are_declared(
    client: TestClient, openapi: dict[str, Any], monkeypatch: pytest.MonkeyPatch, template: str, failure: str
) -> None:
    method, _, path, token, requests = next(route for route in ROUTES if route[1] == template)

    def fail(*_args: Any, **_kwargs: Any) -> Any:
        raise DATABASE_FAILURES[failure]()

    monkeypatch.setattr(store, STORE_CALLS[template], fail)
    response = send(client, method, path, token, requests[0])
    assert response.status_code in (500, 503), response.text
    assert_declared(openapi, method, template, response)


def test_readyz_not_ready_is_declared(client: TestClient, openapi: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from service.routes import health

    monkeypatch.setattr(health, "current_revision", lambda _engine: "a-revision-of-old")
    response = client.get("/readyz")
    assert response.status_code == 503
    assert_declared(openapi, "GET", "/readyz", response)


def test_the_import_422_documents_both_bodies(openapi: dict[str, Any]) -> None:
    """A bad query is a list of bad fields; a bad file names its line: both are declared."""
    schema = openapi["paths"]["/v1/import"]["post"]["responses"]["422"]["content"]["application/json"]["schema"]
    validator = Draft202012Validator({**schema, "components": openapi["components"]})
    assert validator.is_valid({"detail": "line 2: bad", "line": 2, "lines_imported": 0})
    assert validator.is_valid({"detail": [{"loc": ["query", "mode"], "msg": "bad", "type": "enum"}]})
    assert not validator.is_valid({"detail": "line 2: bad"})
    assert json.dumps(openapi).count("HTTPValidationError") == 0  # the service never sends FastAPI's own 422
