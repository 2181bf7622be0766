"""`cce token`: a fresh random token for CCE_SERVICE_TOKENS."""

from __future__ import annotations

import secrets
from typing import Annotated, Optional

import typer

from cce_compile.cli.errors import fail

TOKEN_BYTES = 24
"""32 URL-safe characters: far past the service's 8-character minimum, and unguessable."""


def token(
    scopes: Annotated[
        Optional[str],
        typer.Option("--scopes", help="print a CCE_SERVICE_TOKENS entry 'TOKEN:SCOPES' (e.g. read,write) instead"),
    ] = None,
) -> None:
    """Print a fresh random token (32 URL-safe characters)."""
    fresh = secrets.token_urlsafe(TOKEN_BYTES)
    if scopes is None:
        typer.echo(fresh)
        return
    from typing import get_args

    from service.auth import Scope

    names = [name.strip() for name in scopes.split(",")]
    unknown = [name for name in names if name not in get_args(Scope)]
    if unknown:
        fail(f"--scopes: unknown scope {unknown[0]!r}; give a comma-separated list of {', '.join(get_args(Scope))}")
    typer.echo(f"{fresh}:{','.join(names)}")


def register(app: typer.Typer) -> None:
    app.command()(token)
