"""Where the backward's host time goes, per kind of call: a probe for docs/performance.md's
"Next" item on host time (Qwen2.5's exact backward is host-bound: 304 slab steps).

    PYTHONPATH=$PWD python benchmarks/probe_host.py --shape 16384x896x151936 --out probe.json

Runs the backward op on LM-like bf16 inputs while timing, on the host, every Triton launch
(by kernel, through ops/launch.KernelLauncher) and every cuBLAS call the op makes, then
reports microseconds per call and what is left (Python between the calls); each with the
launcher's reuse of compiled kernels on and off. The GPU is ahead of the host on host-bound
shapes, so the host times are enqueue times, not waits. Beside them, a one-argument kernel's
launch: the floor of a Triton launch on this machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_kernels import host_and_wall_ms  # noqa: E402

from cce_compile.bench.harness import parse_shape  # noqa: E402
from cce_compile.bench.inputs import FILTER_EPS, lm_like_inputs  # noqa: E402
from cce_compile.ops import backward as op_backward  # noqa: E402
from cce_compile.ops.forward import linear_cross_entropy_forward  # noqa: E402
from cce_compile.ops.launch import KernelLauncher  # noqa: E402

SPENT: dict[str, list[float]] = defaultdict(list)


def timed(name: str, call):
    def run(*args, **kwargs):
        start = time.perf_counter()
        result = call(*args, **kwargs)
        SPENT[name].append(time.perf_counter() - start)
        return result
    return run


LAUNCH = KernelLauncher.__call__
LAUNCHER_INIT = KernelLauncher.__init__


def timed_launch(self, grid, *args, **kwargs):
    start = time.perf_counter()
    LAUNCH(self, grid, *args, **kwargs)
    SPENT[f"triton {self.kernel.fn.__name__}"].append(time.perf_counter() - start)


@triton.jit
def empty_kernel(x_ptr):
    tl.store(x_ptr + tl.program_id(0), 1.0)


def probe(shape: str, mode: str, reuse: bool, iters: int) -> dict:
    s = parse_shape(shape)
    e, c, targets = lm_like_inputs(s.n, s.d, s.v, torch.bfloat16, "cuda", seed=0)
    filter_eps = FILTER_EPS if mode == "filtered" else 0.0
    _, lse, kept_tiles, tile_lse, order = linear_cross_entropy_forward(
        e, c, targets, None, None, -100, 0.0, 0.0, filter_eps)
    grad_loss = torch.full_like(lse, 1.0 / s.n)

    def backward():
        return op_backward.linear_cross_entropy_backward(
            grad_loss, torch.zeros_like(lse), e, c, targets, None, None, lse, kept_tiles, tile_lse, order,
            -100, 0.0, 0.0, filter_eps)

    KernelLauncher.__init__ = lambda self, kernel, on: LAUNCHER_INIT(self, kernel, on and reuse)
    backward()
    torch.cuda.synchronize()
    SPENT.clear()
    host_ms, wall_ms = host_and_wall_ms(backward, iters)
    KernelLauncher.__init__ = LAUNCHER_INIT
    calls = {name: {"calls": len(t) / iters, "us_per_call": statistics.median(t) * 1e6,
                    "ms_per_pass": sum(t) / iters * 1e3} for name, t in SPENT.items()}
    timed_ms = sum(entry["ms_per_pass"] for entry in calls.values())
    return {"shape": shape, "mode": mode, "reuse": reuse, "host_ms": host_ms, "wall_ms": wall_ms,
            "untimed_python_ms": host_ms - timed_ms, "calls": calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", action="append", default=None)
    parser.add_argument("--modes", default="exact,filtered")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.mm = timed("cublas mm", torch.mm)
    torch.addmm = timed("cublas addmm", torch.addmm)
    torch.Tensor.addmm_ = timed("cublas addmm_", torch.Tensor.addmm_)
    KernelLauncher.__call__ = timed_launch

    x = torch.zeros(1, device="cuda")
    empty_kernel[(1,)](x)
    torch.cuda.synchronize()
    floor = []
    for _ in range(2000):
        start = time.perf_counter()
        empty_kernel[(1,)](x)
        floor.append(time.perf_counter() - start)
    report = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__,
              "one_arg_launch_us": statistics.median(floor) * 1e6, "runs": []}
    print(f"one-argument Triton launch: {report['one_arg_launch_us']:.1f} us")
    for shape in args.shape or ["16384x896x151936"]:
        for mode in args.modes.split(","):
            for reuse in (True, False):
                run = probe(shape, mode, reuse, args.iters)
                report["runs"].append(run)
                print(f"\n{shape} {mode} (reuse {reuse}): host {run['host_ms']:.2f} ms, "
                      f"wall {run['wall_ms']:.2f} ms, untimed Python {run['untimed_python_ms']:.2f} ms")
                for name, entry in sorted(run["calls"].items(), key=lambda item: -item[1]["ms_per_pass"]):
                    print(f"  {name:40s} {entry['calls']:6.0f} calls {entry['us_per_call']:7.1f} us "
                          f"{entry['ms_per_pass']:7.2f} ms/pass")
    args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
