"""Prometheus metrics of one app: request counts and latency per route, lookups per match level.

With several uvicorn workers, `cce serve` sets PROMETHEUS_MULTIPROC_DIR so that every
worker writes its numbers to files there and /metrics adds up all workers.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tuning_db.records import MATCH_LEVELS, MatchLevel

try:  # FastAPI 0.16x keeps an included router as one route, which names no template of its own
    from fastapi.routing import iter_route_contexts as _each_route
except ImportError:  # older FastAPI copies the included routes into the app's list

    def _each_route(routes: Sequence[BaseRoute]) -> Sequence[BaseRoute]:
        return routes


HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
"""The methods counted under their own name; every other is counted as 'other'."""
CLIENT_CLOSED_REQUEST = 499
"""The status counted for a request whose client left before its answer began (nginx's
convention): no answer reached anyone, and it is no server error."""


class ServiceMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        multiprocess = "PROMETHEUS_MULTIPROC_DIR" in os.environ
        # In multiprocess mode the values live in files, read back by the collector below.
        register_to = None if multiprocess else self.registry
        if multiprocess:
            MultiProcessCollector(self.registry)
        self.requests = Counter(
            "cce_http_requests", "HTTP requests", ["method", "route", "status"], registry=register_to
        )
        self.latency = Histogram(
            "cce_http_request_duration_seconds",
            "HTTP request latency",
            ["method", "route"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
            registry=register_to,
        )
        self.lookups = Counter("cce_lookups", "config lookups by match level", ["match_level"], registry=register_to)
        for level in MATCH_LEVELS:
            self.lookups.labels(level)

    def count_lookup(self, level: MatchLevel) -> None:
        self.lookups.labels(level).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestMetricsMiddleware:
    """Counts and times every HTTP request under its method, route template and status,
    each from a bounded set (the route is a template or 'unmatched', never the raw path; the
    status 499 where the client left first)."""

    def __init__(self, app: ASGIApp, metrics: ServiceMetrics, routes: Sequence[BaseRoute]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status_code: int | None = None
        # Routing rewrites the scope (a Mount moves the path into root_path), so the route of a
        # request that names none is found from the scope as it came in.
        request_scope = dict(scope)

        async def receive_noting_departure() -> Message:
            nonlocal status_code
            message = await receive()
            if message["type"] == "http.disconnect" and status_code is None:
                status_code = CLIENT_CLOSED_REQUEST
            return message

        async def send_with_status(message: Message) -> None:
            nonlocal status_code
            if message["type"] == "http.response.start" and status_code is None:
                status_code = message["status"]
            await send(message)

        try:
            await self.app(scope, receive_noting_departure, send_with_status)
        finally:
            status_code = status_code or 500  # no answer, and the client still there: the app failed
            route_path = getattr(scope.get("route"), "path", None) or matched_template(request_scope, self.routes)
            # The method comes from the client: any token is a valid HTTP method, so an
            # unknown one must not become a new label value (a series per invented method).
            method = scope["method"] if scope["method"] in HTTP_METHODS else "other"
            self.metrics.requests.labels(method, route_path, str(status_code)).inc()
            self.metrics.latency.labels(method, route_path).observe(time.perf_counter() - started)


def matched_template(scope: Scope, routes: Sequence[BaseRoute]) -> str:
    """The template of the route that takes this request, as Starlette's router picks it (the
    first full match, else the first partial one), or 'unmatched'. FastAPI names its own routes
    in scope["route"]; Starlette's Route and Mount (/openapi.json, /docs/assets) may not."""
    partial = "unmatched"
    for route in _each_route(routes):
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return getattr(route, "path", "unmatched")
        if match is Match.PARTIAL and partial == "unmatched":
            partial = getattr(route, "path", "unmatched")
    return partial
