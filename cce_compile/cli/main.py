"""The `cce` command: a thin list of registrations. Command modules import their heavy
dependencies (web stack, database) inside the commands, so `cce --help` stays fast."""

from typing import Annotated

import typer

from cce_compile import __version__
from cce_compile.cli import bench, db, lookup, serve, token, tune
from cce_compile.cli.errors import Cli

app = Cli(help="cce_compile: Cut Cross-Entropy kernels and their tuning database.", no_args_is_help=True)


def _print_version(asked: bool) -> None:
    if asked:
        typer.echo(f"cce-compile {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="print the version and exit")
    ] = False,
) -> None:
    """cce_compile: Cut Cross-Entropy kernels and their tuning database."""


serve.register(app)
token.register(app)
db.register(app)
bench.register(app)
lookup.register(app)
tune.register(app)

if __name__ == "__main__":
    app()
