"""Bearer tokens with scopes. A token holding a scope also holds the ones below it
(admin > write > read). Reads may be opened to everyone by setting; writes never are."""

from __future__ import annotations

import hmac
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Annotated, Literal, get_args

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

Scope = Literal["read", "write", "admin"]
TokenScopes = Mapping[str, frozenset[Scope]]

IMPLIED_SCOPES: dict[Scope, frozenset[Scope]] = {
    "read": frozenset({"read"}),
    "write": frozenset({"read", "write"}),
    "admin": frozenset({"read", "write", "admin"}),
}
_TOKEN_PATTERN = re.compile(r"^[A-Za-z0-9._~+/=-]{8,}$")

bearer = HTTPBearer(auto_error=False, description="a token from CCE_SERVICE_TOKENS")


def parse_token_spec(spec: str) -> dict[str, frozenset[Scope]]:
    """Parse 'token:scope,scope;token2:scope' (';' or newlines between entries, '#' comments);
    a token given twice is refused, whatever its scopes."""
    tokens: dict[str, frozenset[Scope]] = {}
    for raw_entry in re.split(r"[;\n]", spec):
        entry = raw_entry.split("#", 1)[0].strip()
        if not entry:
            continue
        token, separator, scope_list = entry.partition(":")
        token = token.strip()
        if not separator or not _TOKEN_PATTERN.match(token):
            raise ValueError("a token entry must be 'token:scopes' with a token of 8+ URL-safe characters")
        if token in tokens:  # the later entry's scopes would silently replace the earlier's
            raise ValueError(f"token {shown_token(token)} is listed more than once; list it once, with all its scopes")
        tokens[token] = parse_scopes(scope_list)
    return tokens


def shown_token(token: str) -> str:
    """A token as an error names it: its first characters only, as it is a secret."""
    return f"{token[:4]}..."


def parse_scopes(scope_list: str) -> frozenset[Scope]:
    """'scope,scope' as the scopes it grants (with those each implies)."""
    scopes: set[Scope] = set()
    for name in (part.strip() for part in scope_list.split(",")):
        if name not in get_args(Scope):
            raise ValueError(f"unknown scope {name!r}; scopes are {get_args(Scope)}")
        scopes |= IMPLIED_SCOPES[name]  # type: ignore[index]
    return frozenset(scopes)


def scopes_of(presented: str, tokens: TokenScopes) -> frozenset[Scope] | None:
    """The scopes of a presented token, compared in constant time against every known one."""
    granted: frozenset[Scope] | None = None
    for token, scopes in tokens.items():
        if hmac.compare_digest(token.encode(), presented.encode()):
            granted = scopes
    return granted


def require(scope: Scope) -> Callable[..., Awaitable[None]]:
    """A route dependency that lets the request through only with `scope`."""

    async def check(  # async: it never blocks, so it runs on the event loop, not in a thread
        request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
    ) -> None:
        if scope == "read" and request.app.state.settings.open_reads:
            return
        if credentials is None:
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED, "missing bearer token", headers={"WWW-Authenticate": "Bearer"}
            )
        granted = scopes_of(credentials.credentials, request.app.state.token_scopes)
        if granted is None:
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED, "unknown token", headers={"WWW-Authenticate": "Bearer"}
            )
        if scope not in granted:
            raise HTTPException(status.HTTP_403_FORBIDDEN, f"this token lacks the {scope!r} scope")

    return check
