"""A/B of a module-level switch in one process: the benchmark's timing of exact mode, with
the switch at each value in turn, alternating, so machine drift and clocks fall on both.

    PYTHONPATH=$PWD python benchmarks/ab_switch.py \\
        --switch cce_compile.ops.backward.WARP_SPECIALIZED_MAX_K_STEPS=0,16 \\
        --shapes qwen2.5-0.5b,gemma2-2b --rounds 2 --impls cce_exact

    PYTHONPATH=$PWD python benchmarks/ab_switch.py --plans 2x4096,4x4096 --shapes gemma2-2b

    PYTHONPATH=$PWD python benchmarks/ab_switch.py --config forward.group_m=16,32 --shapes gemma2-2b

A switch may be a config constant (`cce_compile.config.resolve.HEURISTIC_*`, for shapes with no
tuned config): resolutions are forgotten at each switch. It may name a field of a frozen
dataclass constant (`cce_compile.ops.backward.WARP_SPECIALIZED_TILE.group_m=16,32`). `--plans`
forces the backward's plan (token chunks x slab columns; exact mode) instead of a switch;
`--config` changes one field of every resolved config, tuned ones included. Prints one line per
(round, value, shape, impl) as the benchmark logs it (ms and x that run's GEMM, memory x the
gradients), then the medians per value. CUDA only.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cce_compile.bench import harness, peers  # noqa: E402
from cce_compile.config import resolve  # noqa: E402
from cce_compile.config.plan import BackwardPlan  # noqa: E402
from cce_compile.ops import backward as op_backward  # noqa: E402
from cce_compile.ops import dispatch  # noqa: E402


def parse_switch(spec: str) -> tuple[object, str, dict[str, object]]:
    """'package.module.NAME=0,16' -> (module, NAME, {"0": 0, "16": 16}); a field of a frozen
    dataclass constant, 'package.module.TILE.group_m=16,32', gives copies of the constant."""
    target, values = spec.split("=")
    path, attribute = target.rsplit(".", 1)
    try:
        module, field = importlib.import_module(path), None
    except ModuleNotFoundError:
        field = attribute
        path, attribute = path.rsplit(".", 1)
        module = importlib.import_module(path)
    if not hasattr(module, attribute):
        raise SystemExit(f"--switch: {path} has no {attribute}")
    if field is None:
        return module, attribute, {value: _number(value) for value in values.split(",")}
    constant = getattr(module, attribute)
    return module, attribute, {value: replace(constant, **{field: _number(value)}) for value in values.split(",")}


def _number(text: str) -> int | float:
    return int(text) if text.lstrip("-").isdigit() else float(text)


def parse_config(spec: str) -> tuple[object, str, dict[str, object]]:
    """'forward.group_m=16,32' -> the op's config resolution, replaced by one that changes
    that field of whatever config the ladder resolves (a tuned shape's bundled config too)."""
    target, values = spec.split("=")
    kernel, field = target.split(".")
    resolved = dispatch.resolve_config

    def with_field(value: int):
        def resolve_with_field(key):
            config = resolved(key)
            return replace(config, **{kernel: replace(getattr(config, kernel), **{field: value})})
        return resolve_with_field

    return dispatch, "resolve_config", {value: with_field(int(value)) for value in values.split(",")}


def parse_plans(spec: str) -> tuple[object, str, dict[str, object]]:
    """'2x4096,4x4096' -> the backward's plan_backward, replaced by one returning each plan."""
    plans = {}
    for label in spec.split(","):
        n_chunks, slab_v = (int(part) for part in label.split("x"))
        plans[label] = lambda *_, forced=BackwardPlan(n_chunks, slab_v, fp32_accumulator=True): forced
    return op_backward, "plan_backward", plans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    choice = parser.add_mutually_exclusive_group(required=True)
    choice.add_argument("--switch", help="module.ATTRIBUTE=value,value,... (numbers)")
    choice.add_argument("--plans", help="CHUNKSxSLAB_V,... forced backward plans (16-bit inputs)")
    choice.add_argument("--config", help="KERNEL.FIELD=value,... a field of the resolved config (e.g. forward.group_m)")
    parser.add_argument("--shapes", default="qwen2.5-0.5b")
    parser.add_argument("--impls", default="cce_exact")
    parser.add_argument("--kinds", default="lm_like", help="input kinds (harness.INPUT_KINDS)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rep-ms", type=float, default=300.0)
    args = parser.parse_args()
    spec_parsers = {"switch": parse_switch, "config": parse_config, "plans": parse_plans}
    option = next(name for name in spec_parsers if getattr(args, name))
    module, attribute, values = spec_parsers[option](getattr(args, option))
    shapes = [harness.parse_shape(spec) for spec in args.shapes.split(",")]
    impls = peers.resolve_impls(args.impls.split(","))
    settings = harness.Settings(warmup_ms=25.0, rep_ms=args.rep_ms, input_sets=2, budget_s=None, uniform_all=False)
    timed: dict[tuple[str, str, str], list[tuple[float, float, float, float, float]]] = {}
    for round_index in range(1, args.rounds + 1):
        for value, setting in values.items():
            setattr(module, attribute, setting)
            resolve.reset()  # configs are resolved once per process: a switched heuristic takes effect
            for run in harness.run_benchmark(shapes, harness.resolve_kinds(args.kinds.split(",")), impls, settings):
                for result in run.impls:
                    if result.status != "ok":
                        print(f"{attribute}={value} round {round_index}: {run.shape.label} {result.label}: {result.reason}")
                        continue
                    timed.setdefault((value, f"{run.shape.label} {run.kind}", result.label), []).append(
                        (result.fwd_bwd_x_gemm, result.fwd_bwd_ms, result.fwd_ms, result.memory_x_grads, result.rel_err_de))
                    print(f"{attribute}={value} round {round_index}: {run.shape.label} {run.kind} {result.label}: "
                          f"fwd+bwd {result.fwd_bwd_ms:.2f} ms ({result.fwd_bwd_x_gemm:.3f} x GEMM), "
                          f"fwd {result.fwd_ms:.2f} ms, memory {result.memory_x_grads:.3f} x grads, "
                          f"err dE {result.rel_err_de:.1e} dC {result.rel_err_dc:.1e}", flush=True)
    print("medians:")
    for (value, shape, label), rows in timed.items():
        ratio, fwd_bwd, fwd, memory, de = (statistics.median(column) for column in zip(*rows))
        print(f"  {attribute}={value}: {shape} {label}: fwd+bwd {fwd_bwd:.2f} ms ({ratio:.3f} x GEMM), "
              f"fwd {fwd:.2f} ms, memory {memory:.3f} x grads, err dE {de:.1e}")


if __name__ == "__main__":
    main()
