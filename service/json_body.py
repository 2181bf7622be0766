"""JSON request bodies that give a key twice are refused (422, naming the key), as import
files are: FastAPI's parser would keep the last value silently."""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
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
    """A route whose JSON body refuses a repeated key."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def unique_keys_handler(request: Request) -> Response:
            return await handler(_UniqueKeysRequest(request.scope, request.receive))

        return unique_keys_handler
