"""`cce lookup`: the config the op would launch with for a GPU and problem, and where it
comes from (the same ladder as the op, minus the in-process memo). A lookup writes nothing:
the disk cache it reads is the op's, and what the op launches must not depend on what was
looked up. `--url` asks that service alone: neither the disk cache (filled from whichever
service CCE_TUNING_URL named) nor CCE_TUNING_OFFLINE stands in for its answer, and one that
cannot be asked (unreachable, a refused token) is an error, not the heuristic's config."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from cce_compile.cli.errors import fail, require_stdout, service_url
from cce_compile.config.keys import KEY_MODES

if TYPE_CHECKING:
    from cce_compile.config.keys import ProblemKey
    from cce_compile.resolve.ladder import Resolution
    from cce_compile.resolve.platform import Platform

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def checked_problem_options(dtype: str, mode: str) -> str:
    """`--dtype` as a torch dtype name, after checking it and `--mode`."""
    dtype_name = DTYPES.get(dtype, dtype)
    if dtype_name not in DTYPES.values():
        raise typer.BadParameter(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}", param_hint="--dtype")
    if mode not in KEY_MODES:
        raise typer.BadParameter(f"unknown mode {mode!r}; use exact or filtered", param_hint="--mode")
    return dtype_name


def lookup(
    vocab: Annotated[int, typer.Option("--vocab", min=1, help="V, the vocabulary size")],
    hidden: Annotated[int, typer.Option("--hidden", min=1, help="D, the hidden size")],
    tokens: Annotated[int, typer.Option("--tokens", min=1, help="N, the token count (looked up by its bucket)")],
    gpu: Annotated[
        Optional[str], typer.Option("--gpu", help="GPU name as torch reports it; default: this machine's")
    ] = None,
    dtype: Annotated[str, typer.Option(help="bf16, fp16, fp32 (or the torch names)")] = "bf16",
    mode: Annotated[str, typer.Option(help="exact, or filtered (filter_eps set)")] = "exact",
    url: Annotated[Optional[str], typer.Option(
        "--url", callback=service_url("the URL is empty; leave --url out to use $CCE_TUNING_URL and the disk cache"),
        help="ask this tuning service alone, not the disk cache, under CCE_TUNING_OFFLINE too (an error if "
             "it cannot be asked); default: the op's ladder, with $CCE_TUNING_URL")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON instead of a table")] = False,
) -> None:
    """Print the resolved config, its source and match level."""
    from cce_compile.config.keys import ProblemKey, n_bucket
    from cce_compile.resolve import client, sources
    from cce_compile.resolve.ladder import look_up

    dtype_name = checked_problem_options(dtype, mode)
    check_as_the_service_does(gpu=gpu, vocab=vocab, hidden=hidden, tokens=tokens)
    require_stdout()
    platform = _platform(gpu)
    device = platform.gpu if platform.gpu in ("cpu", "interpreter") else "cuda"
    key = ProblemKey(device, vocab, hidden, dtype_name, n_bucket(tokens), mode)
    try:
        resolution = look_up(key, platform, sources.Settings.from_env().with_url(url),
                             skip=frozenset({"disk"}) if url is not None else frozenset(), write_cache=False,
                             service_required=url is not None)
    except client.UnreadableAnswer as error:
        fail(f"--url {url}: the service {error}")
    except client.ServiceUnusable as error:
        fail(f"--url {url}: cannot ask the service: {error}")
    if as_json:
        typer.echo(json.dumps({
            "gpu": platform.gpu,
            "key": {"V": vocab, "D": hidden, "dtype": dtype_name, "n_bucket": key.n_bucket, "mode": mode},
            "source": resolution.source,
            "match_level": resolution.match_level,
            "config": resolution.config.to_dict(),
        }))
        return
    _print_table(platform.gpu, key, resolution)


def check_as_the_service_does(**options: str | int | None) -> None:
    """The options by the service's own rules (tuning_db.records), so that a problem it refuses
    with 422 is refused here too, not answered with the heuristic's config (by `cce lookup`) or
    tuned only to have every measurement refused (by `cce tune`). Imported here:
    `python -m cce_compile.cli.tune` imports this module without pydantic."""
    from pydantic import TypeAdapter, ValidationError

    from tuning_db.records import GpuName, HiddenSize, Tokens, VocabSize, clip

    rules = {"gpu": GpuName, "vocab": VocabSize, "hidden": HiddenSize, "tokens": Tokens}
    for name, value in options.items():
        if value is None:
            continue
        try:
            TypeAdapter(rules[name]).validate_python(value)
        except ValidationError as error:
            message = f"{clip(repr(value))}: {error.errors()[0]['msg']}"
            raise typer.BadParameter(message, param_hint=f"--{name}") from None


def _platform(gpu: str | None) -> Platform:
    """This machine's platform, or a named GPU's (its shared memory is then unknown)."""
    from cce_compile.config.keys import normalize_gpu_name
    from cce_compile.resolve.platform import Platform, kernel_version, local_platform, triton_version

    if gpu is None:  # the device the op's key names here (TRITON_INTERPRET=1: the interpreter, as the op and cce tune)
        import torch

        from cce_compile.plan.policy import active_policy

        return local_platform("cuda" if torch.cuda.is_available()
                              else "interpreter" if active_policy().triton_on_cpu else "cpu")
    name = gpu if gpu in ("cpu", "interpreter") else normalize_gpu_name(gpu)
    return Platform(name, None, None, None, kernel_version(), triton_version())


def _print_table(gpu: str, key: ProblemKey, resolution: Resolution) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{gpu}: V={key.v} D={key.d} {key.dtype} tokens<={key.n_bucket} {key.mode}")
    table.add_column("setting")
    table.add_column("value")
    table.add_row("source", resolution.source)
    table.add_row("match level", resolution.match_level)
    for name, value in resolution.config.to_dict().items():
        table.add_row(name, ", ".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict) else str(value))
    Console().print(table)


def register(app: typer.Typer) -> None:
    app.command()(lookup)
