"""`cce bench`: this project against its peers on one GPU, or a re-render of saved results.

Runnable alone as `python -m cce_compile.cli.bench`, so a GPU machine needs neither the
service's dependencies nor an installed package.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Annotated, Optional

import typer


def _split(values: list[str] | None) -> list[str]:
    """List options take repeats and comma-separated values alike."""
    return [part.strip() for value in values or [] for part in value.split(",") if part.strip()]


def bench(
    shapes: Annotated[Optional[list[str]], typer.Option(
        help="shape names (gemma2-2b, llama3-8b, qwen2.5-0.5b, large-d, quick-aligned, quick-odd) or NxDxV; "
             "repeat or comma-separate [default: the four model shapes]")] = None,
    kinds: Annotated[Optional[list[str]], typer.Option(help="input kinds: lm_like, heavy_tail, uniform [default: lm_like, uniform]")] = None,
    impls: Annotated[Optional[list[str]], typer.Option(
        help="cce_exact, cce_filtered, torch_compile, apple_cce, apple_cce_exact, liger, torch_eager [default: all]")] = None,
    quick: Annotated[bool, typer.Option(help="the small smoke-test shapes instead of the model shapes")] = False,
    out: Annotated[Path, typer.Option(help="results folder")] = Path("benchmarks/results"),
    name: Annotated[Optional[str], typer.Option(help="results file stem [default: bench-<UTC time>]")] = None,
    warmup_ms: Annotated[float, typer.Option(min=1)] = 25.0,
    rep_ms: Annotated[float, typer.Option(min=1)] = 100.0,
    input_sets: Annotated[int, typer.Option(min=1, help="input draws cycled through while timing")] = 2,
    budget_s: Annotated[Optional[float], typer.Option(help="start nothing new after this many seconds")] = None,
    uniform_all: Annotated[bool, typer.Option(
        help="time every impl on uniform inputs, not only the filtering ones and cce_exact")] = False,
    frozen_head: Annotated[bool, typer.Option(
        help="c frozen, as in a LoRA run: the backward asks for dE alone")] = False,
    render: Annotated[Optional[Path], typer.Option(
        help="only re-render the markdown and PNG of this saved JSON (needs no GPU)", exists=True, dir_okay=False)] = None,
) -> None:
    """Time, size and check the fused linear cross-entropy implementations on one GPU.

    Writes <out>/<name>.json (all numbers and the environment), .md and, where matplotlib is
    installed, .png; the files are rewritten after every (shape, inputs) run.
    """
    from cce_compile.bench import harness, peers, report

    if render is not None:
        for path in report.render(render):
            typer.echo(f"wrote {path}")
        return
    try:
        harness.require_cuda()
        shape_list = [harness.parse_shape(spec) for spec in _split(shapes)] or list(
            (harness.QUICK_SHAPES if quick else harness.SHAPES).values())
        impl_list = peers.resolve_impls(_split(impls))
        kind_list = harness.resolve_kinds(_split(kinds))
    except harness.BenchmarkUnavailable as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(2) from err
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    settings = harness.Settings(warmup_ms=warmup_ms, rep_ms=rep_ms, input_sets=input_sets, budget_s=budget_s,
                                uniform_all=uniform_all, frozen_head=frozen_head)
    name = name or datetime.datetime.now(datetime.timezone.utc).strftime("bench-%Y%m%d-%H%M")
    plan = {"shapes": [shape.label for shape in shape_list], "kinds": kind_list, "impls": [i.key for i in impl_list]}
    runs: list[harness.RunResult] = []

    def save_after(run: harness.RunResult) -> None:
        runs.append(run)
        report.save(report.build_document(name, settings, plan, runs), out)

    harness.run_benchmark(shape_list, kind_list, impl_list, settings, on_run=save_after)
    for path in report.save(report.build_document(name, settings, plan, runs), out):
        typer.echo(f"wrote {path}")


def register(app: typer.Typer) -> None:
    app.command()(bench)


if __name__ == "__main__":
    typer.run(bench)
