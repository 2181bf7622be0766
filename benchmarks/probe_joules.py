"""Where exact mode's joules go: each part of a forward+backward pass, run back to back on its own.

    PYTHONPATH=$PWD python benchmarks/probe_joules.py --shape 16384x896x151936 --out probe-joules.json

At the H200's 700 W limit a pass's wall clock is its energy (docs/performance.md, v15, v20, v27),
so a part that costs more joules than its share of GPU time is where the wall clock goes. For one
shape, on LM-like bf16 inputs, in one process, each phase runs back to back for --seconds (at the
power limit, as the benchmark's passes do) and the board's energy counter (NVML, mJ) is read
before and after:
- `gemm`: one cuBLAS e @ c.T into a preallocated output (the yardstick);
- `forward`: the op's forward alone, no autograd;
- `recompute`, `dE`, `dC`: the backward's three kernels over a whole pass, each alone: every
  slab step of the op's plan (the Gluon recompute into the d-logits buffer; the fp32 dE
  accumulator's cuBLAS addmm; dC's in-place cuBLAS addmm), each replayed as one CUDA graph;
- `slab loop`: the three interleaved step by step, as the op's backward runs them (its cost over
  the three alone is what they do to each other);
- `pass`: forward+backward as the benchmark times it.
Prints and writes ms, watts, joules per pass and both as multiples of the GEMM's. CUDA with a
Hopper GPU (the Gluon recompute: D <= 4096) and nvidia-ml-py only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cce_compile.bench.harness import parse_shape  # noqa: E402
from cce_compile.bench.inputs import lm_like_inputs  # noqa: E402
from cce_compile.config.plan import n_bucket, plan_backward  # noqa: E402
from cce_compile.kernels.warp_specialized import grad_logits_ws_kernel  # noqa: E402
from cce_compile.ops.backward import recompute_descriptors, recompute_warp_specialized  # noqa: E402
from cce_compile.ops.dispatch import config_for  # noqa: E402
from cce_compile.ops.forward import linear_cross_entropy_forward  # noqa: E402
from cce_compile.ops.launch import KernelLauncher  # noqa: E402
from cce_compile.ops.warp_specialized import WARP_SPECIALIZED_TILE  # noqa: E402
from profile_kernels import pass_step  # noqa: E402


def energy_counter() -> Callable[[], int] | None:
    """The board's energy counter in mJ (NVML), or None where there is none (no GPU, no NVML)."""
    if not torch.cuda.is_available():
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        board = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        return lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(board)
    except Exception:  # noqa: BLE001 - NVML's errors vary by driver; the caller decides
        return None


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def back_to_back(call: Callable[[], object], seconds: float, energy_mj: Callable[[], int] | None) -> dict[str, float]:
    """ms and (with a counter) joules per call over `seconds` of calls back to back, after a
    second of warm-up (clocks and power settle at the limit); at least one call each."""
    for budget in (1.0, seconds):
        synchronize()
        calls, started, joules_before = 0, time.perf_counter(), energy_mj() if energy_mj else 0
        while calls == 0 or time.perf_counter() - started < budget:
            call()
            calls += 1
            if calls % 4 == 0:
                synchronize()
        synchronize()
        elapsed = time.perf_counter() - started
    result = {"ms": elapsed / calls * 1000, "calls": calls}
    if energy_mj:
        joules = (energy_mj() - joules_before) / 1000
        result |= {"joules": joules / calls, "watts": joules / elapsed}
    return result


def graphed(call: Callable[[], None]) -> Callable[[], None]:
    """`call` captured once as a CUDA graph, so its hundreds of launches do not wait on the host
    (as in the op, whose slab loop replays as a graph): the replay."""
    call()  # compiles and initializes outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph.replay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", help="NxDxV (repeatable) [Qwen2.5's and Gemma-2's]")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    energy_mj = energy_counter()
    if energy_mj is None:
        raise SystemExit("probe_joules.py needs a CUDA GPU with NVML's energy counter (nvidia-ml-py)")
    report: dict = {"device": torch.cuda.get_device_name(), "shapes": {}}
    for spec in args.shape or ["16384x896x151936", "8192x2304x256000"]:
        shape = parse_shape(spec)
        n, d, v = shape.n, shape.d, shape.v
        e, c, targets = lm_like_inputs(n, d, v, torch.bfloat16, "cuda", seed=0)
        plan = plan_backward(n_bucket(n), v, d, 2, config_for(e, c, 0.0))
        rows = plan.chunk_rows(n, WARP_SPECIALIZED_TILE.block_m)
        with torch.no_grad():
            _, lse, *_ = linear_cross_entropy_forward(e, c, targets, None, None, -100, 0.0, 0.0, 0.0)
        coef = torch.full((n,), 1.0 / n, device="cuda")
        d_logits = torch.empty((rows, plan.slab_v), dtype=torch.bfloat16, device="cuda")
        accumulator = torch.zeros((rows, d), dtype=torch.float32, device="cuda")
        grad_c = torch.zeros_like(c)
        descriptors = recompute_descriptors(e, c, d_logits)
        launch = KernelLauncher(grad_logits_ws_kernel, True)
        steps = [(start, min(start + rows, n), col, min(col + plan.slab_v, v))
                 for start in range(0, n, rows) for col in range(0, v, plan.slab_v)]
        views = [(e[r0:r1], c[c0:c1], grad_c[c0:c1], d_logits[:r1 - r0, :c1 - c0], accumulator[:r1 - r0])
                 for r0, r1, c0, c1 in steps]
        logits = torch.empty((n, v), dtype=torch.bfloat16, device="cuda")

        def recompute_step(r0: int, r1: int, c0: int, c1: int) -> None:
            recompute_warp_specialized(launch, descriptors, targets, lse, coef, coef, lse, False,
                                       r0, r1 - r0, c0, c1 - c0)

        def recompute() -> None:
            for step in steps:
                recompute_step(*step)

        def grad_e_gemms() -> None:
            for _, c_slab, _, dl, acc in views:
                torch.addmm(acc, dl, c_slab, out_dtype=torch.float32, out=acc)

        def grad_c_gemms() -> None:
            for e_chunk, _, grad_c_slab, dl, _ in views:
                grad_c_slab.addmm_(dl.T, e_chunk)

        def slab_loop() -> None:
            for step, (e_chunk, c_slab, grad_c_slab, dl, acc) in zip(steps, views):
                recompute_step(*step)
                grad_c_slab.addmm_(dl.T, e_chunk)
                torch.addmm(acc, dl, c_slab, out_dtype=torch.float32, out=acc)

        e_leaf, c_leaf = e.clone().requires_grad_(), c.clone().requires_grad_()
        # Each phase's call made just before it runs; the recompute before the GEMMs, so they
        # read realistic d logits (the last slab's).
        phases = {
            "gemm": lambda: lambda: torch.mm(e, c.T, out=logits),
            "forward": lambda: pass_step("forward", e_leaf, c_leaf, targets),
            "recompute": lambda: graphed(recompute), "dE": lambda: graphed(grad_e_gemms),
            "dC": lambda: graphed(grad_c_gemms), "slab loop": lambda: graphed(slab_loop),
            "pass": lambda: pass_step("exact", e_leaf, c_leaf, targets),
        }
        results = {}
        print(f"{spec}: plan {plan.n_chunks} x {plan.slab_v}, {len(steps)} steps", flush=True)
        for name, make_call in phases.items():
            results[name] = measured = back_to_back(make_call(), args.seconds, energy_mj)
            gemm = results["gemm"]
            print(f"  {name:24s} {measured['ms']:8.3f} ms ({measured['ms'] / gemm['ms']:.3f} x GEMM)  "
                  f"{measured['watts']:5.0f} W  {measured['joules']:7.3f} J ({measured['joules'] / gemm['joules']:.3f} "
                  f"x GEMM)", flush=True)
        parts = sum(results[name]["joules"] for name in ("forward", "recompute", "dE", "dC"))
        backward = sum(results[name]["joules"] for name in ("recompute", "dE", "dC"))
        print(f"  parts sum {parts / results['gemm']['joules']:.3f} x a GEMM's joules; the pass "
              f"{results['pass']['joules'] / results['gemm']['joules']:.3f}; the backward's three parts "
              f"{backward / results['gemm']['joules']:.3f}, interleaved step by step "
              f"{results['slab loop']['joules'] / results['gemm']['joules']:.3f}", flush=True)
        report["shapes"][spec] = {"plan": [plan.n_chunks, plan.slab_v], "steps": len(steps), "phases": results}
        del phases
        torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
