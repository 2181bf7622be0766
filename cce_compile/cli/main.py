"""The `cce` command: a thin list of registrations. Command modules import their heavy
dependencies (web stack, database) inside the commands, so `cce --help` stays fast."""

import typer

from cce_compile.cli import bench, db, lookup, serve, tune

app = typer.Typer(help="cce_compile: Cut Cross-Entropy kernels and their tuning database.", no_args_is_help=True)

serve.register(app)
db.register(app)
bench.register(app)
lookup.register(app)
tune.register(app)

if __name__ == "__main__":
    app()
