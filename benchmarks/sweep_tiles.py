"""Time the kernels' tile shapes the tuner's coordinate descent cannot reach.

    PYTHONPATH=$PWD python benchmarks/sweep_tiles.py --shape 8192x2304x256000 --out sweep.json
    ... --filtered --kernels grad_hidden,grad_classifier   (filtered mode's sparse GEMMs)

The tuner changes one launch parameter at a time from the current best, so a tile that only
pays with a different shape, warp count and pipeline depth at once (say two programs per SM,
whose epilogues then overlap each other's main loops) is never tried. This times a fixed list
of whole tiles for the forward (forward alone) and for grad_logits (forward+backward, exact
mode), each as a ratio to one cuBLAS `e @ c.T` GEMM of the same shape timed in the same run.
With --filtered, everything runs in filtered mode, and the gradient GEMMs' kernels
(grad_hidden: dE, grad_classifier: dC; block-sparse there, so block_m is the logits tile's)
take GEMM_TILES, timed forward+backward.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cce_compile  # noqa: E402
from cce_compile.bench.harness import parse_shape  # noqa: E402
from cce_compile.bench.inputs import FILTER_EPS, lm_like_inputs  # noqa: E402
from cce_compile.config.kernel_config import TileConfig  # noqa: E402
from cce_compile.ops.dispatch import config_for  # noqa: E402

TILES = [  # block_m, block_n, block_k, group_m, num_warps, num_stages
    (128, 256, 64, 8, 8, 4),
    (128, 256, 64, 8, 8, 3),
    (128, 128, 64, 8, 8, 3),  # 96 KB of buffers: two programs per SM
    (128, 128, 64, 8, 4, 3),
    (128, 128, 64, 8, 8, 4),
    (64, 256, 64, 8, 4, 2),  # 80 KB: two per SM
    (64, 256, 64, 8, 4, 3),
    (256, 128, 64, 8, 8, 3),
    (128, 256, 32, 8, 8, 6),
    (128, 128, 128, 8, 8, 2),
]
GEMM_TILES = [  # the bundled 128 x 128 tiles, then wider N (one A tile read per 256 columns of dE)
    (128, 128, 64, 8, 8, 3),
    (128, 256, 64, 8, 8, 3),
    (128, 256, 64, 8, 8, 4),
    (128, 128, 64, 8, 8, 4),
    (128, 64, 64, 8, 4, 4),
    (128, 128, 64, 8, 4, 4),  # small D (Qwen2.5's 896 = 7 x 128): narrower N, fewer warps
    (128, 64, 64, 8, 4, 3),
    (128, 64, 64, 8, 8, 4),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="8192x2304x256000")
    parser.add_argument("--kernels", default="forward,grad_logits")
    parser.add_argument("--filtered", action="store_true", help="filtered mode (filter_eps = FILTER_EPS)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    filter_eps = FILTER_EPS if args.filtered else None
    shape = parse_shape(args.shape)
    e, c, targets = lm_like_inputs(shape.n, shape.d, shape.v, torch.bfloat16, "cuda", seed=0)
    e.requires_grad_()
    c.requires_grad_()
    gemm_ms = triton.testing.do_bench(lambda: e.detach() @ c.detach().T)
    base = config_for(e, c, filter_eps or 0.0)
    report = {"shape": dataclasses.asdict(shape), "filter_eps": filter_eps, "gemm_ms": gemm_ms,
              "base": dataclasses.asdict(base), "runs": []}
    print(f"{args.shape}: GEMM {gemm_ms:.3f} ms")

    def forward() -> None:
        with torch.no_grad():
            cce_compile.linear_cross_entropy(e, c, targets, filter_eps=filter_eps)

    def forward_backward() -> None:
        e.grad = c.grad = None
        cce_compile.linear_cross_entropy(e, c, targets, filter_eps=filter_eps).backward()

    for kernel in args.kernels.split(","):
        for values in GEMM_TILES if kernel in ("grad_hidden", "grad_classifier") else TILES:
            config = dataclasses.replace(base, **{kernel: TileConfig(*values)})
            with cce_compile.override_config(config):
                try:
                    ms = triton.testing.do_bench(forward if kernel == "forward" else forward_backward)
                except Exception as error:  # a tile that does not compile or launch (shared memory)
                    print(f"{kernel} {values}: {type(error).__name__}: {str(error)[:120]}")
                    continue
            report["runs"].append({"kernel": kernel, "tile": values, "ms": ms, "x_gemm": ms / gemm_ms})
            print(f"{kernel} {values}: {ms:.3f} ms = {ms / gemm_ms:.3f} x GEMM")
            if args.out is not None:
                args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
