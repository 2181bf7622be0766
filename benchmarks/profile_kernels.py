"""Where one forward+backward of the op spends its GPU time, kernel by kernel.

    PYTHONPATH=$PWD python benchmarks/profile_kernels.py --shape 8192x2304x256000 --modes exact,filtered
    PYTHONPATH=$PWD python benchmarks/profile_kernels.py --modes filtered --compile reduce-overhead

The benchmark gives one number per mode; when a mode misses its prediction (filtered mode's
v5 and v6 did, by 3-6 x), this says which kernel to blame before any more code is written.
For each mode it runs `--iters` forward+backward passes on LM-like bf16 inputs under
torch.profiler and prints, per kernel name, the launches and the GPU milliseconds per pass,
with their share of the pass and the ratio to one cuBLAS `e @ c.T` of the same shape timed
in the same run. `--out` writes the same as JSON. Without CUDA it is a dry run on CPU under
TRITON_INTERPRET=1 (a small shape; CPU times, no ratios).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

if not torch.cuda.is_available():  # before cce_compile's kernels are decorated
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cce_compile  # noqa: E402
from cce_compile.bench.harness import _peak_fwd_bwd_bytes, parse_shape  # noqa: E402
from cce_compile.bench.inputs import FILTER_EPS, lm_like_inputs  # noqa: E402
from cce_compile.bench.peers import materialized_loss  # noqa: E402
from cce_compile.ops.problem import config_for  # noqa: E402
from cce_compile.plan.backward import BackwardPlan  # noqa: E402
from cce_compile.plan.policy import Policy, active_policy, override_policy  # noqa: E402


def idle_gaps(prof, iters: int, top: int = 8) -> dict:
    """Where the GPU sat idle between two of the pass's kernels (CUDA only): the total per
    pass, the longest gaps with the kernels on either side, and the idle time per pass
    summed by the kernel that ended it (many short gaps before small torch operations show
    there, where no single gap is long). Idle time is wall clock that no kernel
    optimization recovers (host launch time, host syncs, allocations)."""
    kernels = sorted(
        (event.time_range.start, event.time_range.end, event.name)
        for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA
    )
    gaps = [(start - prev_end, prev_name, name)
            for (_, prev_end, prev_name), (start, _, name) in zip(kernels, kernels[1:]) if start > prev_end]
    # The gaps between passes (the host resetting grads, the profiler's own step) are no one's.
    gaps = sorted(gaps, reverse=True)[iters - 1:] if iters > 1 else gaps
    by_next: dict[str, list[float]] = {}
    for gap, _, name in gaps:
        total = by_next.setdefault(name[:80], [0.0, 0])
        total[0] += gap / 1000 / iters
        total[1] += 1 / iters
    ranked = sorted(by_next.items(), key=lambda item: -item[1][0])[:top]
    return {"idle_ms": sum(gap for gap, _, _ in gaps) / 1000 / iters,
            "longest": [{"us": gap, "after": before[:80], "before": after[:80]} for gap, before, after in gaps[:top]],
            "by_next_kernel": [{"ms": ms, "gaps": count, "before": name} for name, (ms, count) in ranked]}


def kernel_times(step, iters: int, cuda: bool) -> tuple[dict[str, dict[str, float]], dict | None]:
    """Per kernel (or, on CPU, per op) name: launches and milliseconds per call of `step`;
    and on CUDA, the GPU's idle gaps (idle_gaps)."""
    step()  # compile and warm up outside the profile
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        for _ in range(iters):
            step()
            if cuda:
                torch.cuda.synchronize()
    totals: dict[str, dict[str, float]] = defaultdict(lambda: {"launches": 0.0, "ms": 0.0})
    for event in prof.key_averages():
        us = event.device_time_total if cuda else event.self_cpu_time_total
        if us <= 0:
            continue
        totals[event.key]["launches"] += event.count / iters
        totals[event.key]["ms"] += us / 1000 / iters
    return dict(sorted(totals.items(), key=lambda item: -item[1]["ms"])), idle_gaps(prof, iters) if cuda else None


def loss_of(mode: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss `mode` times: the benchmark's torch impl (materialized), or the op (filtered
    mode's at the benchmark's filter_eps)."""
    if mode == "materialized":
        return materialized_loss
    filter_eps = FILTER_EPS if mode == "filtered" else None
    return lambda e, c, targets: cce_compile.linear_cross_entropy(e, c, targets, filter_eps=filter_eps)


def pass_step(mode: str, e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor, compile_mode: str = "eager"):
    """One pass of `mode` as the benchmark times it: forward+backward from cleared gradients
    (exact, filtered, triton-gemms: exact mode's path, the backend is set by the caller;
    materialized: the benchmark's torch impl), or
    with "forward" the forward alone, without autograd. `compile_mode` other than "eager":
    the loss inside torch.compile(fullgraph=True) in that mode, each pass a new CUDA-graph
    step under "reduce-overhead", as the benchmark's compiled rows run it."""
    loss = loss_of(mode)
    if compile_mode != "eager":
        loss = torch.compile(loss, fullgraph=True, dynamic=False,
                             mode=None if compile_mode == "default" else compile_mode)

    def step() -> None:
        if compile_mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        if mode == "forward":
            with torch.no_grad():
                loss(e.detach(), c.detach(), targets)
            return
        e.grad = c.grad = None
        loss(e, c, targets).backward()

    return step


def print_host_profile(step, top: int) -> None:
    """Where one pass spends host time, by Python function (own time): when the host is the
    bottleneck, this names what to cut."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    step()
    profiler.disable()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def write_trace(step, path: Path) -> None:
    """One pass, synced before and after, as a Chrome trace of host calls and GPU kernels."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))


def host_and_wall_ms(step, iters: int) -> tuple[float, float]:
    """(host ms to enqueue one pass, wall ms of one pass), medians: where the host takes
    as long as the wall clock, the pass is launch-bound, whatever its GPU time."""
    import statistics
    import time

    host, wall = [], []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        host.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        wall.append(time.perf_counter() - start)
    return statistics.median(host) * 1e3, statistics.median(wall) * 1e3


def policy_of(args: argparse.Namespace) -> Policy:
    """The active policy with the command line's overrides."""
    changes: dict = {}
    if args.plan is not None:
        n_chunks, slab_v, slots = (int(part) for part in args.plan.split(","))
        changes["backward_plan"] = BackwardPlan(n_chunks, slab_v, fp32_accumulator=True, slots=slots)
    if args.persistent_min_k_steps is not None:
        changes["recompute_tma_min_k_steps"] = args.persistent_min_k_steps
    if args.scratch_fraction is not None:
        changes["scratch_fraction"] = changes["filtered_scratch_fraction"] = args.scratch_fraction
    return dataclasses.replace(active_policy(), **changes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default=None, help="NxDxV [default: 8192x2304x256000 on CUDA, 256x64x1031 on CPU]")
    parser.add_argument("--modes", default="exact,filtered",
                        help="comma-separated: exact, filtered, triton-gemms (exact mode with the Triton gradient "
                             "GEMMs that torch.compile runs instead of cuBLAS), forward (exact mode's forward without "
                             "autograd, as the benchmark times it), materialized (the benchmark's torch impl; with "
                             "--compile default, the torch.compile rows exact mode is set against)")
    parser.add_argument("--slab-v", type=int, default=None, help="override the resolved config's widest slab")
    parser.add_argument("--workspace-rows", type=int, default=None,
                        help="override the fused forward's token chunk (KernelConfig.workspace_rows): fewer, "
                             "larger chunks against the workspace's memory")
    parser.add_argument("--scratch-fraction", type=float, default=None,
                        help="override the backward's scratch budget, either mode's (Policy.scratch_fraction, "
                             "filtered_scratch_fraction), to see what fewer, larger steps would gain")
    parser.add_argument("--plan", default=None, metavar="CHUNKS,SLAB_V,SLOTS",
                        help="override the backward's plan (Policy.backward_plan; slots: filtered mode's "
                             "scratch tiles, 0 for the slab's)")
    parser.add_argument("--persistent-min-k-steps", type=int, default=None,
                        help="override Policy.recompute_tma_min_k_steps: from how many K steps exact mode's "
                             "recompute runs persistent")
    parser.add_argument("--compile", default="eager", choices=["eager", "default", "reduce-overhead"],
                        help="the loss eager or inside torch.compile in this mode (the kernels of a replayed "
                             "CUDA graph are profiled as launched ones are)")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--host-profile", type=int, default=0, metavar="N",
                        help="also print the N Python functions with the most host time in one pass (cProfile)")
    parser.add_argument("--trace", type=Path, default=None, metavar="DIR",
                        help="also write one pass per mode as a Chrome trace (host and GPU, with each launch's "
                             "correlation to its kernel) to DIR/trace-<mode>.json, for chrome://tracing or Perfetto: "
                             "where the GPU idles, it shows what the host was doing")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    policy = policy_of(args)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    shape = parse_shape(args.shape or ("8192x2304x256000" if cuda else "256x64x1031"))
    n, d, v = shape.n, shape.d, shape.v
    e, c, targets = lm_like_inputs(n, d, v, torch.bfloat16, device, seed=0)
    e.requires_grad_()
    c.requires_grad_()

    gemm_ms = None
    if cuda:
        import triton.testing

        gemm_ms = triton.testing.do_bench(lambda: e.detach() @ c.detach().T)
    report: dict = {"shape": {"n": n, "d": d, "v": v}, "device": torch.cuda.get_device_name() if cuda else "cpu",
                    "gemm_ms": gemm_ms, "slab_v": args.slab_v, "workspace_rows": args.workspace_rows, "scratch_fraction": args.scratch_fraction,
                    "plan": args.plan, "persistent_min_k_steps": args.persistent_min_k_steps, "compile": args.compile,
                    "modes": {}}
    print(f"N={n} D={d} V={v} bf16 on {report['device']}, {args.compile}" + (f"; one cuBLAS e @ c.T: {gemm_ms:.3f} ms" if cuda else ""))
    for mode in args.modes.split(","):
        torch._dynamo.reset()  # a compiled call keeps the config and Policy it was traced with
        filter_eps = FILTER_EPS if mode == "filtered" else None
        mode_policy = dataclasses.replace(policy, gemm_backend="triton" if mode == "triton-gemms" else "cublas")
        config = config_for(e, c, filter_eps is not None, mode_policy)
        if args.slab_v is not None:
            config = dataclasses.replace(config, slab_v=args.slab_v)
        if args.workspace_rows is not None:
            config = dataclasses.replace(config, workspace_rows=args.workspace_rows)
        step = pass_step(mode, e, c, targets, args.compile)
        with cce_compile.override_config(config), override_policy(mode_policy):
            times, idle = kernel_times(step, args.iters, cuda)
            host_ms, wall_ms = host_and_wall_ms(step, max(args.iters, 5)) if cuda else (None, None)
            # as the benchmark measures it (gradients cleared first, counted in the peak); the forward has none
            peak = _peak_fwd_bwd_bytes(loss_of(mode), e, c, targets) / 2**20 if cuda and mode != "forward" else None
            if args.host_profile:
                print_host_profile(step, args.host_profile)
            if args.trace is not None and cuda:
                write_trace(step, args.trace / f"trace-{mode}.json")
        total = sum(entry["ms"] for entry in times.values())
        report["modes"][mode] = {"total_ms": total, "host_ms": host_ms, "wall_ms": wall_ms, "peak_mib": peak,
                                 "idle": idle,
                                 "kernels": times}
        print(f"\n{mode}: {total:.3f} ms of {'GPU' if cuda else 'CPU'} time per forward+backward"
              + (f" = {total / gemm_ms:.2f} x GEMM; wall {wall_ms:.3f} ms = {wall_ms / gemm_ms:.2f} x, "
                 f"host enqueue {host_ms:.3f} ms" + (f", peak {peak:.0f} MiB" if peak is not None else "")
                 if gemm_ms else ""))
        print(f"  {'kernel':60s} {'launches':>9s} {'ms':>9s} {'share':>6s}" + ("  x GEMM" if gemm_ms else ""))
        for name, entry in list(times.items())[:15]:
            ratio = f"  {entry['ms'] / gemm_ms:6.2f}" if gemm_ms else ""
            print(f"  {name[:60]:60s} {entry['launches']:9.0f} {entry['ms']:9.3f} {entry['ms'] / total:6.1%}{ratio}")
        if idle is not None:
            print(f"  GPU idle between kernels: {idle['idle_ms']:.3f} ms per pass; longest gaps:")
            for gap in idle["longest"]:
                print(f"    {gap['us']:8.1f} us  after {gap['after'][:50]}  before {gap['before'][:50]}")
            print("  GPU idle per pass by the kernel that ended it:")
            for entry in idle["by_next_kernel"]:
                print(f"    {entry['ms']:8.3f} ms in {entry['gaps']:5.1f} gaps  before {entry['before'][:60]}")
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
