"""Rejects request bodies over the configured size with 413 before they are read whole."""

from __future__ import annotations

from collections.abc import Mapping

from fastapi import HTTPException, status
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodySizeLimitMiddleware:
    """`max_body_bytes` for every request; `path_limits` lowers it for the paths named there."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, path_limits: Mapping[str, int] | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.path_limits = path_limits or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = min(self.max_body_bytes, self.path_limits.get(scope["path"], self.max_body_bytes))
        too_large = HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, f"request body is larger than {limit} bytes")
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await JSONResponse({"detail": too_large.detail}, status_code=too_large.status_code)(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            # A body without Content-Length (chunked) is counted as it arrives; the route's
            # body parsing lets the HTTPException through to the 413 handler.
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise too_large
            return message

        await self.app(scope, limited_receive, send)
