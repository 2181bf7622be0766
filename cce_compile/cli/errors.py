"""How the `cce` command fails: one line on stderr and a non-zero exit, never a traceback.

Commands call `fail` for the failures they foresee; anything else that escapes a command is
still reported in one line (CCE_TRACEBACK=1 shows the traceback, for a bug report). Every
such line has the passwords and tokens of the URLs it quotes hidden (cce_compile.redact):
the commands name the URL they failed on, as the user gave it, credentials included."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import typer

from cce_compile.redact import redact_urls

TRACEBACK_ENV = "CCE_TRACEBACK"
POSTGRES_DRIVER_HINT = "PostgreSQL URLs need psycopg: pip install 'cce-compile[postgres]'"


def fail(message: str, status: int = 1) -> NoReturn:
    """Stop the command with `message` (one line) and exit `status`: 1, or 2 where the command
    cannot run here at all (a GPU command without a GPU, nothing to render)."""
    typer.echo(_line(message), err=True)
    raise typer.Exit(status)


def require_stdout() -> None:
    """Stop a command whose result is what it writes to stdout when stdout is closed (`cce export
    >&-`): Python then has no sys.stdout, where click's echo drops the result without a word and
    a write fails as an AttributeError. Called first, before a database is opened or a service
    asked."""
    if sys.stdout is None or sys.stdout.closed:
        fail("stdout is closed, and this command writes its result there; redirect it (> FILE) instead")


def _line(message: str) -> str:
    """`message` as the command's one error line, the credentials of its URLs hidden."""
    return f"cce: error: {redact_urls(' '.join(message.split()))}"


def finite(value: float | None) -> float | None:
    """An option callback refusing inf, which a range with a minimum alone lets through: a budget
    or a timing of inf never ends, and reached the tune report's JSON as Infinity (nan too,
    where an option's range does not refuse it)."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def refuse_empty(message: str) -> Callable[[str | None], str | None]:
    """An option callback refusing an empty value with `message`: an empty value is an unset
    shell variable, never a request for the option's default or fallback."""

    def check(value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise typer.BadParameter(message)
        return value

    return check


def service_url(empty_message: str) -> Callable[[str | None], str | None]:
    """An option callback for a tuning service's URL (--url): refuses an empty value with
    `empty_message`, and a value that cannot be one (another scheme, no host, a port out of
    range) saying why, before the command connects anywhere."""
    from cce_compile.resolve.sources import service_url_problem

    not_empty = refuse_empty(empty_message)

    def check(value: str | None) -> str | None:
        value = not_empty(value)
        problem = None if value is None else service_url_problem(value)
        if problem is not None:
            raise typer.BadParameter(f"{value}: {problem}")
        return value

    return check


def one_line(error: BaseException) -> str:
    """`error` as one line of text, naming the fix where one is known."""
    if isinstance(error, ModuleNotFoundError) and (error.name or "").split(".")[0] in ("psycopg", "psycopg2"):
        return POSTGRES_DRIVER_HINT
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


class Cli(typer.Typer):
    """A Typer app whose failures are one line and exit status 1."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            status = super().__call__(*args, standalone_mode=False, **kwargs)
        except typer.Abort:
            raise SystemExit(130) from None
        except typer.TyperException as error:  # a misused option or argument (click's errors)
            if type(error).__name__ == "NoArgsIsHelpError":  # `cce` alone: the help is already printed
                raise SystemExit(getattr(error, "exit_code", 2)) from None
            message = error.format_message() if hasattr(error, "format_message") else str(error)
            print(f"{_line(message)} (see --help)", file=sys.stderr)
            raise SystemExit(getattr(error, "exit_code", 2)) from None
        except Exception as error:  # the last line of defence: no command prints a traceback
            if os.environ.get(TRACEBACK_ENV, "").strip() in ("1", "true", "yes"):
                raise
            print(_line(one_line(error)), file=sys.stderr)
            raise SystemExit(1) from None
        raise SystemExit(status if isinstance(status, int) else 0)


def run_alone(command: Callable[..., Any]) -> NoReturn:
    """Run one command as its own program (`python -m cce_compile.cli.bench`, `...cli.tune`, what
    GPU machines run without the service's stack) with the `cce` command's failure handling:
    `typer.run` would print a misused option in a box and a failure as a traceback."""
    app = Cli(add_completion=False)
    app.command()(command)
    app()
    raise SystemExit(0)  # Cli.__call__ always exits; this line states it for the type checker
