"""The op's first call in a fresh process with empty Triton caches: what a user's first
training step pays for the op's kernels (their compiles, their launchers' builds), with the
fused forward compiling them ahead on threads (Policy.compile_ahead) and without.

    PYTHONPATH=$PWD python benchmarks/first_call.py --shapes llama3-8b,qwen2.5-0.5b --rounds 2 \\
        --out benchmarks/results/first-call-h200.json

Each (round, shape, setting) runs in its own process: LM-like bf16 inputs, one cuBLAS GEMM
before the timing (cuBLAS's own setup is not the op's), then linear_cross_entropy forward +
backward three times; the first call's seconds and the third's (a warm call) are printed per
run and their medians per (shape, setting). `--profile FILE` writes a cProfile of one first
call with the kernels compiled ahead (the first shape): where the rest of the time goes.
Without CUDA it runs a small shape on CPU (a smoke run of this script, no kernels).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import pstats
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cce_compile.bench.fresh_process import alternating, run_fresh  # noqa: E402
from cce_compile.bench.shapes import parse_shape  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="llama3-8b,qwen2.5-0.5b", help="comma-separated names or NxDxV")
    parser.add_argument("--rounds", type=int, default=2, help="runs per (shape, setting), alternating")
    parser.add_argument("--out", type=Path, help="JSON results")
    parser.add_argument("--profile", type=Path, help="a cProfile of one first call, as text")
    parser.add_argument("--child", nargs=3, metavar=("SHAPE", "AHEAD", "PROFILE"), help=argparse.SUPPRESS)
    return parser.parse_args()


def run_child(spec: str, ahead: bool, profile: str) -> dict:
    """Three calls in this process; the first one profiled into `profile` where given."""
    import torch

    import cce_compile
    from cce_compile.bench.inputs import lm_like_inputs
    from cce_compile.plan.policy import active_policy, override_policy

    shape = parse_shape(spec)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n, d, v = (shape.n, shape.d, shape.v) if device == "cuda" else (256, 64, 4096)
    e, c, targets = lm_like_inputs(n, d, v, torch.bfloat16, device, seed=0)
    e.requires_grad_()
    c.requires_grad_()
    torch.mm(e[:256].detach(), c[:256].detach().T)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds, profiler = [], cProfile.Profile()
    with override_policy(replace(active_policy(), compile_ahead=ahead)):
        for call in range(3):
            start = time.perf_counter()
            with profiler if profile and call == 0 else contextlib.nullcontext():
                cce_compile.linear_cross_entropy(e, c, targets).backward()
                if device == "cuda":
                    torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
            e.grad = c.grad = None
    if profile:
        with open(profile, "w") as out:
            stats = pstats.Stats(profiler, stream=out)
            stats.sort_stats("cumulative").print_stats(50)
            stats.sort_stats("tottime").print_stats(30)
    return {"shape": shape.name, "ahead": ahead, "first_s": seconds[0], "warm_s": seconds[2], "device": device}


def spawn(spec: str, ahead: bool, profile: Path | None) -> dict:
    """One run in a fresh process with empty Triton and Inductor caches; a failure is recorded."""
    result = run_fresh(__file__, ["--child", spec, str(int(ahead)), str(profile or "")])
    return {"shape": spec, "ahead": ahead, **result} if "error" in result else result


def main() -> None:
    args = parse_args()
    if args.child:
        spec, ahead, profile = args.child
        print(json.dumps(run_child(spec, ahead == "1", profile)))
        return
    specs = [spec.strip() for spec in args.shapes.split(",") if spec.strip()]
    runs = []
    for spec, ahead in alternating([(spec, ahead) for spec in specs for ahead in (False, True)], args.rounds):
        runs.append(spawn(spec, ahead, None))
        print(json.dumps(runs[-1]), flush=True)
    if args.profile:
        runs.append({**spawn(specs[0], True, args.profile), "profiled": True})
    print("shape | compiled one after another: first call s | ahead: first call s | warm call s")
    for spec in specs:
        name = parse_shape(spec).name
        firsts = {ahead: [run["first_s"] for run in runs if run.get("shape") == name and run["ahead"] is ahead
                          and "first_s" in run and not run.get("profiled")] for ahead in (False, True)}
        warm = [run["warm_s"] for run in runs if run.get("shape") == name and "warm_s" in run]
        if all(firsts.values()):
            print(f"{name} | {statistics.median(firsts[False]):.2f} | {statistics.median(firsts[True]):.2f} | "
                  f"{statistics.median(warm):.3f}")
    if args.out:
        args.out.write_text(json.dumps({"rounds": args.rounds, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
