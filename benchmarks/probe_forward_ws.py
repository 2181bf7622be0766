"""Probe: the warp-specialized Gluon forward (kernels/warp_specialized.py) against lse_forward_tma_kernel.

    PYTHONPATH=$PWD python benchmarks/probe_forward_ws.py --out probe-forward-ws.json

Per shape, on LM-like bf16 inputs and in one process: one cuBLAS `e @ c.T` (the yardstick),
the op's forward on lse_forward_tma_kernel (`linear_cross_entropy_forward`, exact, no grad,
the Gluon path switched off) and lse_forward_ws_kernel in several tile / ring / programs-per-SM
variants, each followed by the same merge of per-tile log-sum-exps and per-token loss. Prints each as ms and x GEMM, and each variant's largest difference in
lse and loss from the op's. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cce_compile.bench.harness import parse_shape  # noqa: E402
from cce_compile.bench.inputs import lm_like_inputs  # noqa: E402
from cce_compile.config.kernel_config import TileConfig  # noqa: E402
from cce_compile.ops import forward  # noqa: E402

SHAPES = ["16384x896x151936", "8192x2304x256000", "8192x4096x128256", "4096x8192x128256", "1000x1000x50001"]
# (BLOCK_M, BLOCK_N, STAGES, GROUP_M, programs per SM); the op's is the first
VARIANTS = [(128, 128, 3, 16, 2), (128, 128, 3, 32, 2), (128, 128, 3, 8, 2), (128, 128, 4, 16, 1)]


def ws_forward(e, c, targets, variant):
    block_m, block_n, stages, group_m, per_sm = variant
    tile = TileConfig(block_m=block_m, block_n=block_n, block_k=64, group_m=group_m, num_warps=4, num_stages=stages)
    tile_lse, target_logit = forward.forward_warp_specialized(e, c, targets, tile, per_sm)
    lse = torch.logsumexp(tile_lse, dim=0)
    return lse - target_logit, lse


def op_forward(e, c, targets):
    loss, lse, *_ = forward.linear_cross_entropy_forward(e, c, targets, None, None, -100, 0.0, 0.0, 0.0)
    return loss, lse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append")
    parser.add_argument("--rep-ms", type=int, default=400)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    forward.WARP_SPECIALIZED_MAX_K_STEPS = 0  # the op's forward: lse_forward_tma_kernel everywhere
    results = []
    for label in args.shape or SHAPES:
        shape = parse_shape(label)
        n, d, v = shape.n, shape.d, shape.v
        e, c, targets = lm_like_inputs(n, d, v, torch.bfloat16, "cuda", seed=0)
        logits = torch.empty((n, v), dtype=torch.bfloat16, device="cuda")
        bench = lambda fn: triton.testing.do_bench(fn, warmup=50, rep=args.rep_ms, return_mode="median")  # noqa: E731
        with torch.no_grad():
            ref_loss, ref_lse = op_forward(e, c, targets)
            gemm_ms = bench(lambda: torch.mm(e, c.T, out=logits))
            row = {"shape": label, "gemm_ms": gemm_ms, "op_ms": bench(lambda: op_forward(e, c, targets)), "variants": []}
            for variant in VARIANTS:
                entry = {"variant": variant}
                try:
                    loss, lse = ws_forward(e, c, targets, variant)
                    torch.cuda.synchronize()
                    entry["lse_diff"] = (lse - ref_lse).abs().max().item()
                    entry["loss_diff"] = (loss - ref_loss).abs().max().item()
                    entry["ms"] = bench(lambda: ws_forward(e, c, targets, variant))
                except Exception as err:  # noqa: BLE001 - a variant that fails is a result
                    entry["error"] = f"{type(err).__name__}: {err}"[:400]
                print(f"  {variant}: {entry}", flush=True)
                row["variants"].append(entry)
                if "error" in entry:  # a CUDA error leaves the context unusable
                    raise SystemExit(1)
            row["gemm_ms_after"] = bench(lambda: torch.mm(e, c.T, out=logits))
        logits = None  # frees the GEMM output before the next shape
        torch.cuda.empty_cache()
        results.append(row)
        print(f"{label}: GEMM {gemm_ms:.3f} ms (after: {row['gemm_ms_after']:.3f}); op {row['op_ms'] / gemm_ms:.3f} x",
              flush=True)
        for entry in row["variants"]:
            if "error" in entry:
                print(f"  {entry['variant']}: {entry['error']}", flush=True)
            else:
                print(f"  {entry['variant']}: {entry['ms'] / gemm_ms:.3f} x; lse diff {entry['lse_diff']:.2e}, "
                      f"loss diff {entry['loss_diff']:.2e}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
