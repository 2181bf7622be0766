"""Exact mode's per-step gradient GEMMs in cuBLAS, alone: is the dE accumulator's layout worth
changing? The op sums dE over slabs into a row-major fp32 accumulator (chunk rows x D); stored
column-major, cuBLAS sees the transposed problem and may pick other kernels and tile counts.
The same for dC's in-place update, asked as dC[slab].T += e[chunk].T @ d_logits (where D is not
a multiple of the 256-wide tile cuBLAS takes for dC, 896 = 3.5 x 256, an eighth of its MMAs fall
past the edge).

    PYTHONPATH=$PWD python benchmarks/probe_grad_gemms.py --step 2048x4096x896 --step 1536x16384x3584

Each --step is ROWSxSLABxD (a token chunk's rows, a slab's columns, the hidden size). Prints the
median ms of one step's dE and dC GEMMs, each in both layouts, and the steps' rate in
TFLOP/s (one step of each is 2 x rows x slab x D FLOPs). CUDA only; inputs are random normal,
not zeros (cuBLAS's speed does not depend on values, its power draw does).
"""

from __future__ import annotations

import argparse

import torch
import triton.testing


def step_timings(rows: int, slab: int, d: int, rep_ms: float) -> dict[str, float]:
    """Median ms of one step's GEMMs, each in its layouts: dE into the fp32 accumulator
    (beta = 1) and dC in place; each is first checked against fp32."""
    device = torch.device("cuda")
    d_logits = torch.randn(rows, slab, device=device, dtype=torch.bfloat16)
    c_slab = torch.randn(slab, d, device=device, dtype=torch.bfloat16)
    e_chunk = torch.randn(rows, d, device=device, dtype=torch.bfloat16)
    grad_c_slab = torch.empty(slab, d, device=device, dtype=torch.bfloat16)
    grad_e = d_logits.float() @ c_slab.float()
    grad_c = d_logits.float().T @ e_chunk.float()

    def grad_e_update(out: torch.Tensor) -> None:
        torch.addmm(out, d_logits, c_slab, out_dtype=torch.float32, out=out)

    # name: (the output it updates in place, the update, the update's fp32 value from zero, tolerance)
    updates = {
        "dE row-major": (torch.empty(rows, d, device=device), grad_e_update, grad_e, 1e-3),
        "dE column-major": (torch.empty(d, rows, device=device).T, grad_e_update, grad_e, 1e-3),
        "dC": (grad_c_slab, lambda out: out.addmm_(d_logits.T, e_chunk), grad_c, 1e-2),
        "dC transposed": (grad_c_slab, lambda out: out.T.addmm_(e_chunk.T, d_logits), grad_c, 1e-2),
    }
    for name, (out, update, expected, tolerance) in updates.items():
        out.zero_()
        update(out)
        error = ((out.float() - expected).norm() / expected.norm()).item()
        if error > tolerance:
            raise SystemExit(f"{name}: relative error {error:.1e} against fp32")
    # Timed from the checks' results, not zeros.
    return {
        name: triton.testing.do_bench(lambda out=out, update=update: update(out), warmup=25, rep=rep_ms,
                                      return_mode="median")
        for name, (out, update, _, _) in updates.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step", action="append", required=True, metavar="ROWSxSLABxD")
    parser.add_argument("--rep-ms", type=float, default=200.0)
    args = parser.parse_args()
    for spec in args.step:
        rows, slab, d = (int(part) for part in spec.split("x"))
        tflop = 2 * rows * slab * d / 1e12
        timings = step_timings(rows, slab, d, args.rep_ms)
        line = ", ".join(f"{name} {ms * 1e3:.1f} us ({tflop / ms * 1e3:.0f} TFLOP/s)" for name, ms in timings.items())
        print(f"{spec}: {line}", flush=True)


if __name__ == "__main__":
    main()
