"""Probe: the Gluon recompute (kernels/warp_specialized.grad_logits_ws_kernel) in its variants,
one token chunk's sweep over the vocabulary in slabs as the backward launches it.

    PYTHONPATH=$PWD python benchmarks/probe_recompute_ws.py --out probe-recompute-ws.json

On LM-like bf16 inputs and in one process: per slab width, one cuBLAS `e[chunk] @ c[slab].T`
per slab (the yardstick: the same MMAs, back to back) against the Gluon recompute of every
slab, for each (group_m, programs per SM) variant. Prints ms and x the GEMMs. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cce_compile.bench.harness import parse_shape  # noqa: E402
from cce_compile.bench.inputs import lm_like_inputs  # noqa: E402
from cce_compile.kernels.warp_specialized import grad_logits_ws_kernel  # noqa: E402
from cce_compile.ops.backward import recompute_descriptors, recompute_warp_specialized  # noqa: E402
from cce_compile.ops.forward import linear_cross_entropy_forward  # noqa: E402
from cce_compile.ops.launch import KernelLauncher  # noqa: E402
from cce_compile.ops.warp_specialized import WARP_SPECIALIZED_TILE  # noqa: E402

# (group_m, programs per SM); the op's first
VARIANTS = [(16, 2), (8, 2), (32, 2), (4, 2), (16, 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="16384x896x151936")
    parser.add_argument("--chunk-rows", type=int, default=2048)
    parser.add_argument("--slabs", default="4096,8192")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    shape = parse_shape(args.shape)
    n, d, v = shape.n, shape.d, shape.v
    e, c, targets = lm_like_inputs(n, d, v, torch.bfloat16, "cuda", seed=0)
    with torch.no_grad():
        _, lse, *_ = linear_cross_entropy_forward(e, c, targets, None, None, -100, 0.0, 0.0, 0.0)
    coef = torch.full((n,), 1.0 / n, device="cuda")
    rows = args.chunk_rows
    bench = lambda fn: triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")  # noqa: E731
    results = []
    for slab in (int(width) for width in args.slabs.split(",")):
        out = torch.empty((rows, slab), dtype=torch.bfloat16, device="cuda")
        starts = range(0, v, slab)
        views = [(c[start:start + slab], out[:, :min(slab, v - start)]) for start in starts]

        def gemms() -> None:
            for c_slab, out_slab in views:
                torch.mm(e[:rows], c_slab.T, out=out_slab)

        descriptors = recompute_descriptors(e, c, out)
        row = {"slab": slab, "chunk_rows": rows, "gemms_ms": bench(gemms), "variants": []}
        for group_m, per_sm in VARIANTS:
            launch = KernelLauncher(grad_logits_ws_kernel, True)
            variant = replace(WARP_SPECIALIZED_TILE, group_m=group_m)

            def recompute() -> None:
                for start in starts:
                    recompute_warp_specialized(launch, descriptors, targets, lse, coef, coef, lse, False,
                                               0, rows, start, min(slab, v - start), variant, per_sm)

            ms = bench(recompute)
            row["variants"].append({"group_m": group_m, "per_sm": per_sm, "ms": ms})
            print(f"slab {slab}: group_m {group_m}, {per_sm} per SM: {ms:.3f} ms = {ms / row['gemms_ms']:.3f} x "
                  f"the slabs' GEMMs ({row['gemms_ms']:.3f} ms)", flush=True)
        results.append(row)
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "shape": args.shape,
                                        "results": results}, indent=1))


if __name__ == "__main__":
    main()
