"""Whether two persistent programs per SM beat one in exact mode's logits kernels.

With D = 896 (Qwen2.5) a tile's dot runs only 14 K steps, and the one program per SM runs
its softmax epilogue with the tensor cores idle (the forward costs ~1.24 x GEMM there). Two
programs per SM on tiles small enough that both fit (registers and shared memory) could run
one's epilogue under the other's MMAs. For each variant (forward and recompute tile, programs
per SM) this times exact mode's forward alone and forward+backward with `do_bench`, against
the cuBLAS GEMM, and checks the loss and dC against the bundled config's.

    PYTHONPATH=$PWD python benchmarks/probe_programs_per_sm.py --shape 16384x896x151936 --out probe.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch
import triton.testing

import cce_compile
from cce_compile.bench.harness import parse_shape
from cce_compile.bench.inputs import lm_like_inputs
from cce_compile.bench.metrics import relative_error
from cce_compile.config.kernel_config import TileConfig
from cce_compile.ops import backward as op_backward
from cce_compile.ops import dispatch
from cce_compile.ops import forward as op_forward

VARIANTS = {  # name: (forward and recompute tile, or None for the bundled ones; programs per SM)
    "bundled": (None, 1),
    "128x128 w8 s3": (TileConfig(128, 128, 64, 8, 8, 3), 1),
    "128x128 w8 s3, 2 per SM": (TileConfig(128, 128, 64, 8, 8, 3), 2),
    "128x128 w4 s3, 2 per SM": (TileConfig(128, 128, 64, 8, 4, 3), 2),
    "64x256 w4 s3, 2 per SM": (TileConfig(64, 256, 64, 8, 4, 3), 2),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", action="append", required=True, help="NxDxV (repeatable)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    sms, shared_memory = dispatch.device_limits(torch.device("cuda"))
    report = []
    for text in args.shape:
        shape = parse_shape(text)
        e, c, targets = lm_like_inputs(shape.n, shape.d, shape.v, torch.bfloat16, "cuda", seed=0)
        gemm_ms = triton.testing.do_bench(lambda: e @ c.T, return_mode="median")
        bundled = dispatch.config_for(e, c, 0.0)
        reference = None
        for name, (tile, per_sm) in VARIANTS.items():
            config = bundled if tile is None else dataclasses.replace(bundled, forward=tile, grad_logits=tile)
            limits = lambda device, k=per_sm: (sms * k, shared_memory // k)  # noqa: E731
            op_forward.device_limits = op_backward.device_limits = limits
            leaf = c.detach().clone().requires_grad_()

            def forward():
                return cce_compile.linear_cross_entropy(e, leaf, targets)

            def forward_backward():
                leaf.grad = None
                forward().backward()

            row = {"shape": text, "variant": name, "programs_per_sm": per_sm, "tile": dataclasses.asdict(config.forward)}
            try:
                with cce_compile.override_config(config):
                    forward_backward()
                    loss, grad_c = forward().detach(), leaf.grad.clone()
                    if reference is None:
                        reference = (loss, grad_c)
                    row["loss_error"] = relative_error(loss, reference[0])
                    row["dc_error"] = relative_error(grad_c, reference[1])
                    with torch.no_grad():
                        row["forward_x_gemm"] = triton.testing.do_bench(forward, return_mode="median") / gemm_ms
                    row["fwd_bwd_x_gemm"] = triton.testing.do_bench(forward_backward, return_mode="median") / gemm_ms
            except Exception as error:  # noqa: BLE001 - a variant that does not fit is a result too
                row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
            report.append(row)
            print(json.dumps(row), flush=True)
            if args.out is not None:
                args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        op_forward.device_limits = op_backward.device_limits = dispatch.device_limits


if __name__ == "__main__":
    main()
