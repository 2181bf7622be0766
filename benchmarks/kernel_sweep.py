"""Time the op's kernels under candidate tile configs on one GPU (coordinate descent, one
kernel at a time), next to a cuBLAS GEMM of the same shape. A development tool: the
tuner (`cce tune`) is the user-facing form of this."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cce_compile  # noqa: E402
from cce_compile.config.kernel_config import KernelConfig, TileConfig  # noqa: E402
from cce_compile.config.resolve import heuristic_config  # noqa: E402
from cce_compile.ops.dispatch import problem_key  # noqa: E402
from tests.op_cases import make_inputs  # noqa: E402

CANDIDATES = [
    TileConfig(128, 256, 64, 8, 8, 4),
    TileConfig(128, 256, 64, 16, 8, 4),
    TileConfig(128, 256, 64, 32, 8, 4),
    TileConfig(128, 256, 64, 16, 8, 3),
    TileConfig(256, 128, 64, 16, 8, 4),
    TileConfig(128, 128, 64, 16, 8, 4),
    TileConfig(128, 256, 128, 16, 8, 2),
]
"""Tiles for the two logits kernels (forward, grad_logits); eager CUDA runs the gradient
GEMMs in cuBLAS, so their tiles are not swept here."""
SLABS = [2048, 8192]
SHAPES = {"gemma2": (8192, 2304, 256000), "llama3": (8192, 4096, 128256), "qwen25": (16384, 896, 151936)}


def bench(fn, rep_ms: int) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="gemma2,llama3,qwen25")
    parser.add_argument("--budget-s", type=float, default=150.0, help="sweep time per shape")
    parser.add_argument("--out", default="sweep.json")
    args = parser.parse_args()
    results = []
    for name in args.shapes.split(","):
        n, d, v = SHAPES[name]
        e, c, targets = make_inputs("zipf", (n,), v, d, torch.bfloat16, seed=0, device="cuda")
        gemm_ms = bench(lambda: e @ c.T, 100)
        base = heuristic_config(problem_key(e, c, 0.0))

        def time_config(config: KernelConfig) -> tuple[float, float]:
            e.requires_grad_(False)
            with cce_compile.override_config(config), torch.no_grad():
                fwd = bench(lambda: cce_compile.linear_cross_entropy(e, c, targets), 100)
            e.requires_grad_(True)
            c.requires_grad_(True)

            def step():
                e.grad = c.grad = None
                cce_compile.linear_cross_entropy(e, c, targets).backward()

            with cce_compile.override_config(config):
                both = bench(step, 200)
            c.requires_grad_(False)
            return fwd, both

        best = base
        fwd, both = time_config(best)
        record = {"shape": name, "gemm_ms": gemm_ms, "trials": [("base", best.to_dict(), fwd, both)]}
        print(f"{name}: gemm {gemm_ms:.2f} ms; base fwd {fwd / gemm_ms:.2f}x fwd+bwd {both / gemm_ms:.2f}x", flush=True)
        start = time.time()
        trials = [(k, {k: tile}) for k in ("forward", "grad_logits") for tile in CANDIDATES]
        trials += [("slab_v", {"slab_v": slab}) for slab in SLABS]
        for kernel, change in trials:
            if time.time() - start > args.budget_s or all(getattr(best, k) == x for k, x in change.items()):
                continue
            candidate = replace(best, **change)
            try:
                f, b = time_config(candidate)
            except Exception as exc:  # out of resources etc.: record and go on
                record["trials"].append((kernel, candidate.to_dict(), repr(exc)[:200], None))
                continue
            record["trials"].append((kernel, candidate.to_dict(), f, b))
            score, best_score = (f, fwd) if kernel == "forward" else (b, both)
            print(f"  {kernel:16s} {change} fwd {f / gemm_ms:.2f}x fwd+bwd {b / gemm_ms:.2f}x", flush=True)
            if score < best_score:
                best, fwd, both = candidate, (f if kernel == "forward" else fwd), b
        # Memory and error with the best config.
        e.requires_grad_(True)
        c.requires_grad_(True)
        e.grad = c.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with cce_compile.override_config(best):
            loss = cce_compile.linear_cross_entropy(e, c, targets)
            loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        grads = (n * d + v * d) * 2
        de, dc = e.grad.float(), c.grad.float()
        e.grad = c.grad = None
        torch.backends.cuda.matmul.allow_tf32 = False
        ee, cc = e.detach().float().requires_grad_(), c.detach().float().requires_grad_()
        ref = torch.nn.functional.cross_entropy(ee @ cc.T, targets)
        ref.backward()
        err = lambda a, b: float((a - b).norm() / b.norm())
        record.update(best=best.to_dict(), fwd_x=fwd / gemm_ms, fwd_bwd_x=both / gemm_ms,
                      memory_x=peak / grads, loss=float(ref), err_loss=abs(float(loss) - float(ref)) / float(ref),
                      err_de=err(de, ee.grad), err_dc=err(dc, cc.grad))
        del ee, cc, ref, de, dc
        torch.cuda.empty_cache()
        print(f"{name}: best fwd {record['fwd_x']:.2f}x fwd+bwd {record['fwd_bwd_x']:.2f}x mem {record['memory_x']:.3f}x "
              f"loss {record['loss']:.2f} err dE {record['err_de']:.1e} dC {record['err_dc']:.1e}", flush=True)
        results.append(record)
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
