"""Exact mode's per-step gradient GEMMs in cuBLAS, alone: is the dE accumulator's layout worth
changing? The op sums dE over slabs into a row-major fp32 accumulator (chunk rows x D); stored
column-major, cuBLAS sees the transposed problem and may pick other kernels and tile counts.
The same for dC's in-place update, asked as dC[slab].T += e[chunk].T @ d_logits (where D is not
a multiple of the 256-wide tile cuBLAS takes for dC, 896 = 3.5 x 256, an eighth of its MMAs fall
past the edge).

    PYTHONPATH=$PWD python benchmarks/probe_grad_gemms.py --step 2048x4096x896 --step 1536x16384x3584

Each --step is ROWSxSLABxD (a token chunk's rows, a slab's columns, the hidden size). Prints the
median ms of one step's dE GEMM in both layouts and of its dC GEMM, and the steps' rate in
TFLOP/s (one step of each is 2 x rows x slab x D FLOPs). CUDA only; inputs are random normal,
not zeros (cuBLAS's speed does not depend on values, its power draw does).
"""

from __future__ import annotations

import argparse

import torch
import triton.testing


def step_timings(rows: int, slab: int, d: int, rep_ms: float) -> dict[str, float]:
    """Median ms of one step's GEMMs: dE into each accumulator layout (beta = 1), and dC."""
    device = torch.device("cuda")
    d_logits = torch.randn(rows, slab, device=device, dtype=torch.bfloat16)
    c_slab = torch.randn(slab, d, device=device, dtype=torch.bfloat16)
    e_chunk = torch.randn(rows, d, device=device, dtype=torch.bfloat16)
    grad_c_slab = torch.randn(slab, d, device=device, dtype=torch.bfloat16)
    row_major = torch.zeros(rows, d, device=device, dtype=torch.float32)
    column_major = torch.zeros(d, rows, device=device, dtype=torch.float32).T

    def bench(call) -> float:
        return triton.testing.do_bench(call, warmup=25, rep=rep_ms, return_mode="median")

    timings = {
        "dE row-major": bench(lambda: torch.addmm(row_major, d_logits, c_slab, out_dtype=torch.float32, out=row_major)),
        "dE column-major": bench(
            lambda: torch.addmm(column_major, d_logits, c_slab, out_dtype=torch.float32, out=column_major)),
        "dC": bench(lambda: grad_c_slab.addmm_(d_logits.T, e_chunk)),
        "dC transposed": bench(lambda: grad_c_slab.T.addmm_(e_chunk.T, d_logits)),
    }
    for name, update in (("dC", lambda out: out.addmm_(d_logits.T, e_chunk)),
                         ("dC transposed", lambda out: out.T.addmm_(e_chunk.T, d_logits))):
        out = torch.zeros_like(grad_c_slab)
        update(out)
        reference = d_logits.float().T @ e_chunk.float()
        error = ((out.float() - reference).norm() / reference.norm()).item()
        if error > 1e-2:
            raise SystemExit(f"{name}: relative error {error:.1e} against fp32")
    expected = d_logits.float() @ c_slab.float()
    for name, accumulator in (("row-major", row_major), ("column-major", column_major)):
        accumulator.zero_()
        torch.addmm(accumulator, d_logits, c_slab, out_dtype=torch.float32, out=accumulator)
        error = ((accumulator - expected).norm() / expected.norm()).item()
        if error > 1e-3:
            raise SystemExit(f"dE {name}: relative error {error:.1e} against fp32")
    return timings


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
