"""`cce tune`: search the op's launch parameters for one problem on this GPU, then print
best vs default per kernel and for the whole op, and write the results (JSON, bundled
configs, the tuning service or database).

Runs as `python -m cce_compile.cli.tune` too, which loads no database code: a GPU node
without SQLAlchemy can tune and publish over HTTP.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from cce_compile.cli.errors import fail, finite, refuse_empty, run_alone
from cce_compile.cli.lookup import check_as_the_service_does, checked_problem_options

if TYPE_CHECKING:  # the package imports torch: only inside the command
    from cce_compile.config.kernel_config import KernelConfig
    from cce_compile.tuning.candidates import Limits
    from cce_compile.tuning.publish import Publisher
    from cce_compile.tuning.tuner import Timing, Trial, Tuner, TuneResult


def tune(
    vocab: Annotated[int, typer.Option("--vocab", min=1, help="V, the vocabulary size")],
    hidden: Annotated[int, typer.Option("--hidden", min=1, help="D, the hidden size")],
    tokens: Annotated[int, typer.Option("--tokens", min=1, help="N, the token count to time")],
    dtype: Annotated[str, typer.Option(help="bf16, fp16, fp32 (or the torch names)")] = "bf16",
    mode: Annotated[str, typer.Option(help="exact, or filtered (filter_eps='auto')")] = "exact",
    publish: Annotated[
        Optional[str],
        typer.Option(
            "--publish", metavar="URL",
            callback=refuse_empty("the URL is empty; leave --publish out to publish nothing"),
            help="POST the measurements to this tuning service ($CCE_TUNING_TOKEN: a write token)",
        ),
    ] = None,
    db_url: Annotated[
        Optional[str],
        typer.Option("--db-url", callback=refuse_empty("the URL is empty; leave --db-url out to write no database"),
                     help="write the measurements into this tuning database instead (one `cce db upgrade` made)"),
    ] = None,
    out: Annotated[Optional[Path], typer.Option("--out", help="write the results as JSON here")] = None,
    bundle: Annotated[
        Optional[Path],
        typer.Option("--bundle", help="add the best config to this bundled-configs file (cce_compile/config/bundled/*.json)"),
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print the plan and run nothing")] = False,
    budget_s: Annotated[
        float, typer.Option("--budget-s", min=0.0, callback=finite, help="start no candidate after this many seconds")
    ] = 60.0,
    input_sets: Annotated[int, typer.Option(min=1, help="input copies the timings rotate over")] = 3,
    seed: Annotated[int, typer.Option(min=-(2**63), max=2**63 - 1, help="seed of the LM-like inputs")] = 0,
    submitter: Annotated[Optional[str], typer.Option(help="the measurements' submitter; default: cce-tune-$USER")] = None,
) -> None:
    """Tune the kernel config for one problem: coordinate descent from the heuristic, one
    kernel at a time, every candidate checked against the default config's results."""
    from cce_compile.bench.inputs import LM_LIKE_MIN_HIDDEN
    from cce_compile.plan.policy import active_policy
    from cce_compile.tuning import candidates, publish as results
    from cce_compile.tuning.tuner import Tuner, default_timer

    dtype_name = checked_problem_options(dtype, mode)
    # A problem the tuning database refuses would have every measurement refused after the run.
    check_as_the_service_does(vocab=vocab, hidden=hidden, tokens=tokens)
    if hidden < LM_LIKE_MIN_HIDDEN:
        raise typer.BadParameter(f"{hidden}: the tuner's LM-like inputs need a hidden size of "
                                 f"{LM_LIKE_MIN_HIDDEN} at least", param_hint="--hidden")
    if publish and db_url:
        raise typer.BadParameter("give --publish or --db-url, not both", param_hint="--publish")
    _check_writable(out, "--out")
    _check_writable(bundle, "--bundle")
    _check_bundle(bundle)
    _check_publish_url(publish)
    _check_db_url(db_url)
    import torch

    device = "cuda" if torch.cuda.is_available() or not active_policy().triton_on_cpu else "interpreter"
    publisher: Publisher | None = None
    if not dry_run:  # a dry run plans for a GPU it may not have, and publishes nothing
        if device == "cuda" and not torch.cuda.is_available():
            fail("cce tune times Triton kernels: it needs a CUDA GPU (or TRITON_INTERPRET=1, for tests)", status=2)
        publisher = _publisher(publish, db_url)
    problem = candidates.Problem(tokens, vocab, hidden, dtype_name, mode)
    limits = candidates.device_limits(problem)
    untuned = candidates.untuned_kernels(problem, device)
    spaces = candidates.kernel_spaces(problem, device, limits)
    tuner = Tuner(problem, device, spaces, default_timer(device), budget_s, input_sets=input_sets, seed=seed)
    _print_plan(tuner, limits, untuned)
    if dry_run:
        return
    result = _run_with_progress(tuner)
    _print_result(result, untuned)
    identity = results.local_identity(device)
    bodies = results.measurements(result, identity, submitter or results.default_submitter())
    # The report first (its folder was checked), then the store, then the bundle: a bundle file
    # changed during the run must lose neither the report nor the published measurements.
    if out is not None:
        report = {**result.to_json(), "identity": asdict(identity), "measurements": bodies}
        out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    all_published = publisher is None or _publish(publisher, bodies)
    if bundle is not None:
        try:
            results.write_bundled(bundle, result, identity)
        except (OSError, ValueError) as error:
            fail(f"--bundle {bundle}: {error}; the results are in the tables above")
        typer.echo(f"bundled config for V={vocab} D={hidden} tokens={tokens} written to {bundle}", err=True)
    if not all_published:
        raise typer.Exit(1)


def _publish(publisher: Publisher, bodies: list[dict[str, Any]]) -> bool:
    """Publish and report what the store said; whether it took every measurement. Those not
    sent after a failure share one line: the failure's own line says what to do."""
    outcomes = publisher.publish(bodies)
    refused = [outcome for outcome in outcomes if not outcome.accepted]
    whole = outcomes[0]  # measurements() puts the whole-op measurement first
    typer.echo(
        f"published {len(outcomes) - len(refused)} of {len(outcomes)} measurements"
        + (f"; the whole-op config is the key's best: {whole.is_best}" if whole.accepted else ""),
        err=True,
    )
    unsent = [outcome.detail for outcome in refused if outcome.detail.startswith("not sent: ")]
    for outcome in refused:
        if not outcome.detail.startswith("not sent: "):
            typer.echo(f"  refused {outcome.kernel} ({outcome.median_ms:.3f} ms): {outcome.detail}", err=True)
    if unsent:
        typer.echo(f"  not sent: {len(unsent)} more measurements ({unsent[0].removeprefix('not sent: ')})", err=True)
    return not refused


def _check_writable(path: Path | None, option: str) -> None:
    """Files are written after the whole run: a path that cannot take one must stop the
    command before any GPU time is spent, so a file is made there and removed."""
    if path is None:
        return
    if path.is_dir():
        raise typer.BadParameter(f"{path} is a directory", param_hint=option)
    try:
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as error:
        raise typer.BadParameter(f"cannot write in {path.parent}: {error.strerror}", param_hint=option) from None


def _check_publish_url(url: str | None) -> None:
    """A --publish URL that cannot be a service's (another scheme, no host, a port out of range) is
    a misused option on a dry run and on a machine without a GPU too: it was checked only once a
    real run began, so a dry run passed it and a CPU machine said only that it has no GPU."""
    from cce_compile.resolve.sources import service_url_problem

    problem = None if url is None else service_url_problem(url)
    if problem is not None:
        fail(f"--publish {url}: {problem}", status=2)


def _check_db_url(db_url: str | None) -> None:
    """A --db-url that cannot name a tuning database (no dialect, a missing driver, in memory)
    is refused as `cce export` refuses it, on a dry run and on a machine without a GPU too: only
    the database itself waits for a real run (_publisher)."""
    if db_url is None:
        return
    from cce_compile.cli.db import new_engine  # loads the database stack, which --db-url needs anyway
    from tuning_db.engine import resolve_db_url

    new_engine(resolve_db_url(db_url)).dispose()


def _check_bundle(path: Path | None) -> None:
    """An existing --bundle file gets the best config added after the whole run: one that is
    not a bundled-configs file must stop the command first."""
    from cce_compile.tuning.publish import bundled_entries

    if path is None:
        return
    try:
        bundled_entries(path)
    except (OSError, ValueError) as error:
        raise typer.BadParameter(f"{path}: {error}", param_hint="--bundle") from None


def _publisher(url: str | None, db_url: str | None) -> Publisher | None:
    """The configured publisher, checked before any GPU time is spent: a URL or token that
    cannot be right exits 2, a service or database that refuses exits 1 (as `cce export` does)."""
    from cce_compile.resolve import sources
    from cce_compile.tuning import publish as results

    if db_url:
        from cce_compile.cli.db import store_engine  # loads the database stack
        from tuning_db.engine import resolve_db_url, shown_url

        database = results.DatabasePublisher(store_engine(db_url))
        try:
            database.check()
        except results.PublishError as error:
            database.engine.dispose()
            fail(f"--db-url {shown_url(resolve_db_url(db_url))}: {error}")
        return database
    if not url:
        return None
    try:
        publisher = results.ServicePublisher(url, os.environ.get(sources.TOKEN_ENV))
    except results.PublishError as error:
        fail(f"--publish {url}: {error}", status=2)
    try:
        publisher.check()
    except results.PublishError as error:
        fail(f"--publish {url}: {error}")
    return publisher


def _print_plan(tuner: Tuner, limits: Limits, untuned: dict[str, str]) -> None:
    from rich.console import Console
    from rich.table import Table

    problem = tuner.problem
    start = tuner.default_config
    table = Table(
        title=f"cce tune plan: N={problem.n} V={problem.v} D={problem.d} {problem.dtype} {problem.mode} on "
        f"{tuner.device} (shared memory {limits.shared_memory_bytes} B); budget {tuner.budget_s:g} s, "
        f"{tuner.input_sets} input sets, {tuner.timer.method}"
    )
    for column in ("kernel", "timed as", "default", "candidates", "first sweep"):
        table.add_column(column)
    for space in tuner.spaces:
        timed_as = "no-grad forward" if space.kernel == "forward" else "fwd+bwd minus fwd"
        table.add_row(space.kernel, timed_as, _describe(start, space.kernel), str(space.size(start)),
                      str(space.first_pass(start)))
    for kernel, why in untuned.items():
        table.add_row(kernel, why, _describe(start, kernel), "0", "0")
    Console(stderr=True).print(table)
    axes = {name: values for space in tuner.spaces for name, values in space.axes.items()}
    Console(stderr=True).print(
        "Axes, in search order: " + "; ".join(f"{name} {','.join(map(str, values))}" for name, values in axes.items())
        + ".\nEach candidate is checked against the default config's loss, dE and dC before it is timed; "
        "the default is timed in the same run, and the best config's whole forward+backward against it."
    )


def _describe(config: KernelConfig, kernel: str) -> str:
    """A kernel's tile (and its config-wide value) in one short string."""
    tile = getattr(config, kernel)
    text = f"{tile.block_m}x{tile.block_n}x{tile.block_k} g{tile.group_m} w{tile.num_warps} s{tile.num_stages}"
    extra = {"forward": f" splits {config.vocab_splits}", "grad_logits": f" slab {config.slab_v}"}
    return text + extra.get(kernel, "")


def _run_with_progress(tuner: Tuner) -> TuneResult:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    planned = sum(space.first_pass(tuner.default_config) for space in tuner.spaces)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True)) as progress:
        task = progress.add_task("default config: check and time", total=planned)

        def on_trial(trial: Trial) -> None:
            done = progress.tasks[0].completed + 1
            progress.update(
                task, advance=1, total=max(planned, done),
                description=f"{trial.kernel} {_describe(trial.config, trial.kernel)}: {trial.status}",
            )

        def stop(signal_number: int, _frame: object) -> None:
            """The first Ctrl-C (or SIGTERM) ends the search and keeps its results; the next, of
            either kind, is the previous handler's."""
            for number, handler in previous.items():
                signal.signal(number, handler)
            tuner.stop()
            progress.update(task, description="stopping after this candidate (again to abort)")

        tuner.on_trial = on_trial
        # Bound before any handler is installed; an ignored signal stays ignored (a script's
        # background job), and one whose handler Python cannot put back (None) is left alone.
        previous = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
        previous = {number: handler for number, handler in previous.items() if handler not in (signal.SIG_IGN, None)}
        try:
            for number in previous:
                signal.signal(number, stop)
            result = tuner.run()
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)
        progress.update(task, description=f"{'stopped' if result.stopped else 'done'} in {result.elapsed_s:.0f} s")
    return result


def _print_result(result: TuneResult, untuned: dict[str, str]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"cce tune: best vs default ({result.method}, median ms; p20-p80)")
    for column in ("kernel", "default ms", "best ms", "speedup", "tried", "dropped", "best config"):
        table.add_column(column)

    def span(timing: Timing) -> str:
        return f"{timing.median_ms:.3f} ({timing.p20_ms:.3f}-{timing.p80_ms:.3f})"

    for kernel, outcome in result.kernels.items():
        trials = [trial for trial in result.trials if trial.kernel == kernel]
        dropped = sum(trial.status != "timed" for trial in trials)
        table.add_row(
            kernel, span(outcome.default), span(outcome.best), f"{outcome.speedup:.3f}x",
            str(len(trials)), str(dropped), _describe(outcome.best_config, kernel),
        )
    for kernel, why in untuned.items():
        table.add_row(kernel, "-", "-", "-", "0", "0", why)
    table.add_row(
        "forward+backward", span(result.default_whole), span(result.best_whole), f"{result.speedup:.3f}x",
        str(len(result.trials)), str(sum(t.status != "timed" for t in result.trials)),
        "default" if result.best_config == result.default_config else "tuned",
    )
    console = Console()
    console.print(table)
    for trial in result.trials:  # a detail is an error's text, which may hold brackets: no markup
        if trial.status != "timed":
            console.print(f"{trial.status}: {trial.kernel} {_describe(trial.config, trial.kernel)}: {trial.detail}",
                          markup=False)


def register(app: typer.Typer) -> None:
    app.command()(tune)


if __name__ == "__main__":
    run_alone(tune)
