"""`cce bench`: this project against its peers on one GPU, eager and under torch.compile, or a
re-render of saved results.

Runnable alone as `python -m cce_compile.cli.bench`, so a GPU machine needs neither the
service's dependencies nor an installed package.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Optional

import typer

from cce_compile.bench.shapes import QUICK_SHAPES, SHAPES, parse_shape
from cce_compile.cli.errors import fail, finite, run_alone


def _split(values: list[str] | None, option: str) -> list[str]:
    """List options take repeats and comma-separated values alike. One given must name
    something: an empty value is an unset shell variable, not a request for the default."""
    parts = [part.strip() for value in values or [] for part in value.split(",") if part.strip()]
    if values is not None and not parts:
        raise typer.BadParameter("names nothing; leave the option out for its default", param_hint=option)
    return parts


@contextmanager
def _option(option: str) -> Iterator[None]:
    """A ValueError while resolving `option`'s values is that option's misuse, named."""
    try:
        yield
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint=option) from None


def _render(out: Path, sync: list[Path]) -> None:
    from cce_compile.bench import results

    csv_path = out / results.CSV_NAME
    if not csv_path.exists():
        fail(f"--render: no results at {csv_path}", status=2)
    try:
        written = results.render(csv_path, sync)
    except results.SyncError as error:
        fail(f"--sync {error}")
    except ValueError as error:  # the CSV's problem, naming it and the line
        fail(f"--render: {error}")
    except OSError as error:  # a rendered file that cannot be written
        fail(f"--render: cannot write {error.filename or out}: {error.strerror or error}")
    for path in written:
        typer.echo(f"wrote {path}")


def _check_out(out: Path) -> None:
    """Refuses an --out the results could not be appended to, before any GPU time is spent: the
    first rows are written only after the first shape's whole run."""
    from cce_compile.bench import results

    if out.exists() and not out.is_dir():
        raise typer.BadParameter(f"{out} is not a folder", param_hint="--out")
    # The folder is made when the first rows are written: the nearest part of it that exists
    # must be a folder this process can write in (a path below a file once failed only then).
    existing = next(path for path in (out, *out.absolute().parents) if path.exists())
    if not existing.is_dir():
        raise typer.BadParameter(f"{existing} is not a folder", param_hint="--out")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise typer.BadParameter(f"cannot write in {existing}: {error.strerror}", param_hint="--out") from None
    csv_path = out / results.CSV_NAME
    if csv_path.exists():
        try:
            results.read_rows(csv_path)
            csv_path.open("a").close()  # appended to after the first shape's run
        except (OSError, ValueError) as err:
            raise typer.BadParameter(str(err), param_hint="--out") from err


def bench(
    shapes: Annotated[Optional[list[str]], typer.Option(
        help=f"shape names ({', '.join([*SHAPES, *QUICK_SHAPES])}) or NxDxV; repeat or comma-separate; "
             f"default: {', '.join(SHAPES)}, or with --quick {', '.join(QUICK_SHAPES)}")] = None,
    kinds: Annotated[Optional[list[str]], typer.Option(help="input kinds: lm_like, heavy_tail, uniform; default: lm_like, uniform")] = None,
    impls: Annotated[Optional[list[str]], typer.Option(
        help="cce_exact, cce_exact_low, cce_filtered, torch, apple_cce, apple_cce_exact, liger; the log-probs rows "
             "cce_log_probs, cce_log_probs_filtered, torch_compile_log_probs, verl_log_probs, trl_log_probs; "
             "default: all")] = None,
    compile_modes: Annotated[Optional[list[str]], typer.Option(
        "--compile", help="eager, default, reduce-overhead: how each impl is called; the compiled modes apply to "
                          "cce_* and torch; default: all three")] = None,
    quick: Annotated[bool, typer.Option(help="the small smoke-test shapes instead of the model shapes")] = False,
    out: Annotated[Path, typer.Option(help="results folder (bench.csv, latest.md, latest.png)")] = Path("benchmarks/results"),
    warmup_ms: Annotated[float, typer.Option(min=1, callback=finite)] = 25.0,
    rep_ms: Annotated[float, typer.Option(min=1, callback=finite)] = 100.0,
    input_sets: Annotated[int, typer.Option(min=1, help="input draws cycled through while timing")] = 2,
    budget_s: Annotated[Optional[float], typer.Option(
        min=0, callback=finite, help="start nothing new after this many seconds")] = None,
    uniform_all: Annotated[bool, typer.Option(
        help="time every impl on uniform inputs, not only the filtering ones and cce_exact")] = False,
    frozen_head: Annotated[bool, typer.Option(
        help="c frozen, as in a LoRA run: the backward asks for dE alone")] = False,
    render: Annotated[bool, typer.Option(
        help="only re-render latest.md and latest.png from <out>/bench.csv (needs no GPU)")] = False,
    sync: Annotated[Optional[list[str]], typer.Option(
        help="with --render: markdown files whose <!-- cce-bench-table --> blocks are rewritten from the CSV")] = None,
) -> None:
    """Time, size and check the fused linear cross-entropy implementations on one GPU.

    Appends a row per (shape, inputs, impl, compiled) to <out>/bench.csv and re-renders
    <out>/latest.md and, where matplotlib is installed, <out>/latest.png after every
    (shape, inputs) run.
    """
    if render:
        _render(out, [Path(path) for path in _split(sync, "--sync")])
        return
    if sync is not None:
        raise typer.BadParameter("rewrites tables from saved results: use it with --render", param_hint="--sync")
    # The arguments first, each naming its option: a mistake is reported as one, on a machine
    # without a GPU too, and those checked without torch before it is imported.
    with _option("--shapes"):
        shape_list = [parse_shape(spec) for spec in _split(shapes, "--shapes")] or list(
            (QUICK_SHAPES if quick else SHAPES).values())
    _check_out(out)
    from cce_compile.bench import harness, peers, report

    with _option("--impls"):
        impl_list = peers.resolve_impls(_split(impls, "--impls"))
    with _option("--compile"):
        modes = peers.resolve_compile_modes(_split(compile_modes, "--compile"))
    with _option("--kinds"):
        kind_list = harness.resolve_kinds(_split(kinds, "--kinds"))
    impl_list = peers.with_compile_modes(impl_list, modes)
    try:
        harness.require_cuda()
    except harness.BenchmarkUnavailable as err:
        fail(str(err), status=2)
    settings = harness.Settings(warmup_ms=warmup_ms, rep_ms=rep_ms, input_sets=input_sets, budget_s=budget_s,
                                uniform_all=uniform_all, frozen_head=frozen_head)
    env = report.environment()
    written: list[Path] = []

    def save_after(run: harness.RunResult) -> None:
        written[:] = report.save(run, env, out, frozen_head)

    harness.run_benchmark(shape_list, kind_list, impl_list, settings, on_run=save_after)
    for path in written:
        typer.echo(f"wrote {path}")


def register(app: typer.Typer) -> None:
    app.command()(bench)


if __name__ == "__main__":
    run_alone(bench)
