"""A/B of launch policies in one process: the benchmark's timing of the op under each Policy in
turn, alternating, so machine drift and clocks fall on all of them alike.

    PYTHONPATH=$PWD python benchmarks/ab_switch.py --policy recompute_gluon_max_k_steps=0,64 \\
        --shapes qwen2.5-0.5b,gemma2-2b --rounds 2 --impls cce_exact_low

    PYTHONPATH=$PWD python benchmarks/ab_switch.py --plans 2x4096,4x4096 --shapes gemma2-2b

    PYTHONPATH=$PWD python benchmarks/ab_switch.py --policy workspace_fraction=0.5,0.75 --compile eager,default

`--policy FIELD=value,...` runs under the default Policy with that field at each value (numbers,
true/false or words, e.g. gemm_backend=cublas,triton); `--plans CHUNKSxSLAB_V,...` forces
the backward's plan (Policy.backward_plan). Prints one line per (round, value, shape, impl) as
the benchmark logs it (ms and x that run's GEMM, memory x the gradients), then the medians per
value. CUDA only; writes nothing to the results CSV.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import fields, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cce_compile.bench import harness, peers  # noqa: E402
from cce_compile.plan.backward import BackwardPlan  # noqa: E402
from cce_compile.plan.policy import Policy, active_policy, override_policy  # noqa: E402


def _value(text: str) -> object:
    if text in ("true", "false"):
        return text == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def policies_of(args: argparse.Namespace) -> tuple[str, dict[str, Policy]]:
    """(what varies, {value label: policy}) from --policy or --plans."""
    base = active_policy()
    if args.plans:
        plans = {}
        for label in args.plans.split(","):
            n_chunks, slab_v = (int(part) for part in label.split("x"))
            plans[label] = replace(base, backward_plan=BackwardPlan(n_chunks, slab_v, fp32_accumulator=True))
        return "backward_plan", plans
    name, _, values = args.policy.partition("=")
    if name not in {field.name for field in fields(Policy)} or not values:
        raise SystemExit(f"--policy: {args.policy!r} is not FIELD=value,... with FIELD a Policy field")
    return name, {value: replace(base, **{name: _value(value)}) for value in values.split(",")}


COLUMNS = ("fwd_bwd_ms", "fwd_bwd_x_gemm", "fwd_ms", "fwd_x_gemm", "memory_x_grads", "rel_err_de")
"""The harness result's fields each line shows, in describe()'s order."""


def describe(row: tuple[float, ...]) -> str:
    fwd_bwd, fwd_bwd_ratio, fwd, fwd_ratio, memory, de = row
    return (f"fwd+bwd {fwd_bwd:.2f} ms ({fwd_bwd_ratio:.3f} x GEMM), fwd {fwd:.2f} ms ({fwd_ratio:.3f} x GEMM), "
            f"memory {memory:.3f} x grads, err dE {de:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    choice = parser.add_mutually_exclusive_group(required=True)
    choice.add_argument("--policy", help="FIELD=value,value,... a field of cce_compile.plan.policy.Policy")
    choice.add_argument("--plans", help="CHUNKSxSLAB_V,... forced backward plans")
    parser.add_argument("--shapes", default="qwen2.5-0.5b")
    parser.add_argument("--impls", default="cce_exact")
    parser.add_argument("--compile", default="eager", help="eager, default, reduce-overhead (comma-separated)")
    parser.add_argument("--kinds", default="lm_like", help="input kinds (harness.INPUT_KINDS)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rep-ms", type=float, default=300.0)
    args = parser.parse_args()
    name, policies = policies_of(args)
    shapes = [harness.parse_shape(spec) for spec in args.shapes.split(",")]
    impls = peers.with_compile_modes(peers.resolve_impls(args.impls.split(",")),
                                     peers.resolve_compile_modes(args.compile.split(",")))
    kinds = harness.resolve_kinds(args.kinds.split(","))
    settings = harness.Settings(warmup_ms=25.0, rep_ms=args.rep_ms, input_sets=2)
    timed: dict[tuple[str, str, str], list[tuple[float, ...]]] = {}
    for round_index in range(1, args.rounds + 1):
        for value, policy in policies.items():
            with override_policy(policy):
                runs = harness.run_benchmark(shapes, kinds, impls, settings)
            for run in runs:
                for result in run.impls:
                    where = f"{name}={value} round {round_index}: {run.shape.label} {run.kind} {result.label}"
                    if result.status != "ok":
                        print(f"{where}: {result.status}: {result.reason}")
                        continue
                    row = tuple(getattr(result, column) for column in COLUMNS)
                    timed.setdefault((value, f"{run.shape.label} {run.kind}", result.label), []).append(row)
                    print(f"{where}: {describe(row)}", flush=True)
    print("medians:")
    for (value, shape, label), rows in timed.items():
        print(f"  {name}={value}: {shape} {label}: {describe(tuple(statistics.median(col) for col in zip(*rows)))}")

if __name__ == "__main__":
    main()
