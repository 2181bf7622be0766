"""`cce token`: a fresh random token for CCE_SERVICE_TOKENS."""

from __future__ import annotations

import secrets
from typing import Annotated, Optional

import typer

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
    from service.auth import parse_scopes

    try:  # the scope list alone: in a whole entry ';' and '#' would split it ('read;admin')
        parse_scopes(scopes)
    except ValueError as error:  # a misused option: status 2, as typer gives other bad values
        raise typer.BadParameter(str(error), param_hint="--scopes") from None
    typer.echo(f"{fresh}:{','.join(name.strip() for name in scopes.split(','))}")


def register(app: typer.Typer) -> None:
    app.command()(token)
