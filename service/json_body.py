"""JSON request bodies that give a key twice are refused (422, naming the key), as import
files are: FastAPI's parser would keep the last value silently. A body sent as another media
type (curl -d sends a form) is refused with 415 naming the Content-Type it needs; one with no
Content-Type is read as JSON."""

from __future__ import annotations

import email.message
import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import HTTPException, Request, Response, status
from fastapi.routing import APIRoute

from tuning_db.records import RepeatedKeyError, unique_keys


class _UniqueKeysRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = json.loads(body, object_pairs_hook=unique_keys)
            except RepeatedKeyError as error:  # FastAPI answers it as a body that is not JSON
                raise json.JSONDecodeError(str(error), body.decode(errors="replace"), 0) from None
            except json.JSONDecodeError:
                raise
            except RecursionError:  # and so these, which FastAPI answered 400 'There was an error parsing the body'
                raise json.JSONDecodeError("nested too deep", "", 0) from None
            except ValueError as error:  # an integer past Python's digits limit, a byte that is not UTF-8
                raise json.JSONDecodeError(str(error), "", 0) from None
        return self._json


class UniqueKeysRoute(APIRoute):
    """A route whose JSON body refuses a repeated key, and a body of another media type."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def unique_keys_handler(request: Request) -> Response:
            content_type = request.headers.get("content-type")
            if content_type and not _is_json(content_type):  # FastAPI validated the raw bytes as the model:
                # 'Input should be a valid dictionary', as if the JSON were wrong
                raise HTTPException(status.HTTP_415_UNSUPPORTED_MEDIA_TYPE,
                                    f"the body's Content-Type must be application/json, not {content_type[:100]!r}")
            scope = request.scope
            if not content_type:  # read as JSON, as documented: FastAPI's strict_content_type (default
                # True in recent releases, 0.165 here) would validate the raw bytes, 422 'a valid dictionary'
                # an empty Content-Type header is replaced, not joined: FastAPI reads the first one
                headers = [(name, value) for name, value in scope["headers"] if name.lower() != b"content-type"]
                scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
            return await handler(_UniqueKeysRequest(scope, request.receive))

        return unique_keys_handler


def _is_json(content_type: str) -> bool:
    """Whether FastAPI reads a body of `content_type` as JSON (application/json, or a +json type)."""
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))
