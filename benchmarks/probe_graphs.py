"""What replaying exact mode's backward slab loop as a CUDA graph (cce_compile/ops/graphs.py)
costs and saves, call by call: peak memory above the inputs and what stays allocated after
each call (the capture stream's cuBLAS workspace appears once), host time to enqueue a
forward+backward, and its wall time, with graphs on and off.

    PYTHONPATH=$PWD python benchmarks/probe_graphs.py --shape 16384x896x151936 --out probe-graphs.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cce_compile  # noqa: E402
from cce_compile.bench.harness import parse_shape  # noqa: E402
from cce_compile.bench.inputs import lm_like_inputs  # noqa: E402
from cce_compile.ops import graphs  # noqa: E402

MIB = 2**20


def probe(shape: str, calls: int) -> dict:
    spec = parse_shape(shape)
    e, c, targets = lm_like_inputs(spec.n, spec.d, spec.v, torch.bfloat16, "cuda", seed=0)
    e.requires_grad_()
    c.requires_grad_()
    grad_mib = (e.numel() + c.numel()) * 2 / MIB
    rows = []
    for enabled in (False, True, False, True):
        graphs.ENABLED = enabled
        for call in range(calls):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            started = time.perf_counter()
            cce_compile.linear_cross_entropy(e, c, targets).backward()
            enqueued = time.perf_counter()
            torch.cuda.synchronize()
            finished = time.perf_counter()
            row = {
                "graphs": enabled, "call": call, "host_ms": (enqueued - started) * 1e3,
                "wall_ms": (finished - started) * 1e3,
                "peak_x_grads": (torch.cuda.max_memory_allocated() - before) / MIB / grad_mib,
                "kept_mib": (torch.cuda.memory_allocated() - before) / MIB,
                "captures": graphs.SLAB_LOOPS.captures, "replays": graphs.SLAB_LOOPS.replays,
            }
            e.grad = c.grad = None
            rows.append(row)
            print(json.dumps(row), flush=True)
    return {"shape": shape, "grad_mib": grad_mib, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", default=None)
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    results = [probe(shape, args.calls) for shape in args.shape or ["16384x896x151936"]]
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "results": results}, indent=1))


if __name__ == "__main__":
    main()
