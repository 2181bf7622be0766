"""Fuzzing a real `cce serve` (SQLite and PostgreSQL) through every route: generated
requests, mostly valid ones with one part broken, must never get a 5xx, and a refused one
must leave the export as it was. Bounded (FUZZ_EXAMPLES per database) so CI stays fast."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text

from service.process import serving
from tests.db_fixtures import GPU_H100, bearer, lookup_params, measurement_data
from tests.test_service_process import ADMIN_TOKEN, READ_TOKEN, TOKENS_ENV, WRITE_TOKEN
from tuning_db.engine import make_engine

FUZZ_EXAMPLES = 150

BOUNDARY_INTS = [0, 1, -1, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30]
BOUNDARY_FLOATS = [0.0, -0.0, 5e-324, 1e-9, 1e-3, 1e6, 1e7, 1e308, float("inf"), float("nan"), 4.0]
texts = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=40)
names = st.sampled_from(["", " ", "___", "_ _", "-", "a" * 129, "x'; DROP TABLE gpus; --", "NVIDIA H100"]) | texts
scalars = (
    st.none()
    | st.booleans()
    | st.sampled_from(BOUNDARY_INTS)
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from(BOUNDARY_FLOATS)
    | st.floats()
    | names
)
query_values = names | st.sampled_from(BOUNDARY_INTS).map(str)
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3), max_leaves=6
)
TILE_PATHS = [("config", "forward", key) for key in ("block_m", "num_warps", "num_stages", "group_m", "pre_hook")]
BODY_PATHS = [
    *[(key,) for key in measurement_data()],
    *[("gpu", key) for key in GPU_H100],
    *TILE_PATHS,
    ("config", "slab_v"),
    ("config", "workspace_rows"),
    ("extra",),
]


@dataclass
class Call:
    method: str
    path: str
    token: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    content: str | None = None


def _set(data: dict[str, Any], path: tuple[str, ...], value: Any, delete: bool) -> dict[str, Any]:
    """A copy of `data` with the value at `path` replaced (or removed), creating objects on the way."""
    data = json.loads(json.dumps(data))
    node = data
    for key in path[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    if delete:
        node.pop(path[-1], None)
    else:
        node[path[-1]] = value
    return data


@st.composite
def broken_measurements(draw: st.DrawFn) -> dict[str, Any]:
    body = measurement_data(V=draw(st.sampled_from([1000, 2000])), tokens=draw(st.sampled_from([1024, 8192])))
    for _ in range(draw(st.integers(1, 2))):
        path = draw(st.sampled_from(BODY_PATHS))
        body = _set(body, path, draw(json_values), delete=draw(st.booleans()) and draw(st.booleans()))
    return body


@st.composite
def calls(draw: st.DrawFn, export_line: str) -> Call:
    kind = draw(st.sampled_from(["measurement", "lookup", "list", "retire", "import", "other"]))
    if kind == "measurement":
        body = draw(broken_measurements())
        return Call("POST", "/v1/measurements", WRITE_TOKEN, content=json.dumps(body))
    if kind == "lookup":
        params = lookup_params()
        key = draw(st.sampled_from([*params, "compute_capability", "sm_count", "extra"]))
        params[key] = draw(query_values)
        return Call("GET", "/v1/configs/best", READ_TOKEN, params=params)
    if kind == "list":
        keys = st.sampled_from(["limit", "offset", "gpu", "V", "include_retired"])
        params = draw(st.dictionaries(keys, query_values, max_size=3))
        return Call("GET", "/v1/configs", READ_TOKEN, params=params)
    if kind == "retire":
        entry = draw(st.sampled_from(BOUNDARY_INTS).map(str) | st.integers(-(2**70), 2**70).map(str) | names)
        return Call("POST", f"/v1/configs/{quote(entry, safe='')}/retire", ADMIN_TOKEN)
    if kind == "import":
        path = draw(st.sampled_from([*BODY_PATHS, ("measurement_uid",), ("created_at",)]))
        line = _set(json.loads(export_line), path, draw(json_values), delete=False)
        header = {"format": "cce-tuning-db", "schema_version": 1, "entries": 1, "measurements": 1}
        body = f"{json.dumps(header)}\n{json.dumps(line)}\n"
        mode = draw(st.sampled_from(["keep_better", "skip", "overwrite"]) | names)
        return Call("POST", "/v1/import", ADMIN_TOKEN, params={"mode": mode}, content=body)
    method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "BREW"]))
    path = draw(st.sampled_from(["/v1/gpus", "/v1/export", "/v1/configs/best", "/metrics", "/readyz", "/v1/nothing"]))
    return Call(method, path, draw(st.sampled_from([None, READ_TOKEN, ADMIN_TOKEN, "not-a-token-at-all"])))


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """One real server per database for the whole fuzz run, seeded with two entries."""
    directory = tmp_path_factory.mktemp(f"fuzz-{request.param}")
    if request.param == "sqlite":
        db_url = f"sqlite:///{directory / 'tuning.db'}"
    else:
        db_url = request.getfixturevalue("postgres_schema_url")
        engine = make_engine(db_url)
        with engine.begin() as connection:
            connection.execute(text("TRUNCATE retired_measurements, best_configs, measurements, gpus RESTART IDENTITY CASCADE"))
        engine.dispose()
    log = directory / "serve.log"
    with serving(log, "--db-url", db_url, "--log-level", "warning", env=TOKENS_ENV) as base_url:
        with httpx.Client(base_url=base_url, timeout=30) as client:
            for V in (1000, 2000):
                seeded = client.post("/v1/measurements", json=measurement_data(V=V), headers=bearer(WRITE_TOKEN))
                assert seeded.status_code == 201, seeded.text
            yield client
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


def _export(client: httpx.Client) -> str:
    response = client.get("/v1/export", headers=bearer(READ_TOKEN))
    assert response.status_code == 200, response.text
    return response.text


def test_no_request_gets_a_5xx_or_changes_data_when_refused(server: httpx.Client) -> None:
    export_line = _export(server).splitlines()[1]

    @settings(
        max_examples=FUZZ_EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(call=calls(export_line))
    def check(call: Call) -> None:
        before = _export(server)
        headers = bearer(call.token) if call.token else {}
        response = server.request(call.method, call.path, params=call.params, content=call.content, headers=headers)
        assert response.status_code < 500, (call, response.status_code, response.text[:500])
        if response.status_code >= 400:
            assert _export(server) == before, call

    check()
