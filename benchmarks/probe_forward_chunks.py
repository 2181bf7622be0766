"""How many rows should one launch of the persistent forward walk?

    PYTHONPATH=$PWD python benchmarks/probe_forward_chunks.py --shape 32768x4096x128256 --chunk-rows 2048,4096,8192

One grid over a large N lets the persistent programs drift apart along their ~1000 tiles each,
and the operands in flight at once outgrow L2 (ncu, Llama-3's head: 15.6 GB of DRAM reads at
N = 8192, 139.5 GB at 32768; docs/performance.md v29), so the op launches its persistent
forwards per ops.forward.FORWARD_CHUNK_ROWS rows. This times, back to back at the power limit
and alternated over --rounds, the op's forward with that switch at each of --chunk-rows (and at
N: one grid), beside one cuBLAS e @ c.T, and checks that all give the same lse. Prints and
writes ms and joules per pass (NVML; ms alone where the board has no counter). Runs on CPU
under TRITON_INTERPRET=1 as a smoke check (times meaningless there).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cce_compile.bench.harness import parse_shape  # noqa: E402
from cce_compile.bench.inputs import lm_like_inputs  # noqa: E402
from cce_compile.ops import forward as op_forward  # noqa: E402
from probe_joules import back_to_back, energy_counter  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", help="NxDxV (repeatable) [Llama-3's head at N = 32768]")
    parser.add_argument("--chunk-rows", default="2048,4096,8192", help="comma-separated rows per launch")
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    energy_mj = energy_counter()
    report: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "shapes": {}}
    for spec in args.shape or ["32768x4096x128256"]:
        shape = parse_shape(spec)
        e, c, targets = lm_like_inputs(shape.n, shape.d, shape.v, torch.bfloat16, device, seed=0)
        logits = torch.empty((shape.n, shape.v), dtype=torch.bfloat16, device=device)

        def forward_at(chunk_rows: int) -> Callable[[], torch.Tensor]:
            def forward() -> torch.Tensor:
                op_forward.FORWARD_CHUNK_ROWS = chunk_rows
                return op_forward.linear_cross_entropy_forward(e, c, targets, None, None, -100, 0.0, 0.0, 0.0)[1]
            return forward

        chunk_rows = sorted({min(int(rows), shape.n) for rows in args.chunk_rows.split(",")} | {shape.n})
        calls = {"gemm": lambda out=logits: torch.mm(e, c.T, out=out)}
        calls.update({"one grid" if rows == shape.n else f"grids of {rows} rows": forward_at(rows) for rows in chunk_rows})
        with torch.no_grad():
            lse = {rows: forward_at(rows)() for rows in chunk_rows}
            for rows in chunk_rows:
                torch.testing.assert_close(lse[rows], lse[shape.n], rtol=1e-5, atol=1e-5)
            rounds = [{name: back_to_back(call, args.seconds, energy_mj) for name, call in calls.items()}
                      for _ in range(args.rounds)]
        del calls, logits  # the next shape's GEMM output is allocated without this one's
        report["shapes"][spec] = {"chunk_rows": chunk_rows, "rounds": rounds}
        print(f"{spec}, rows per launch {chunk_rows} (lse agree):")
        for index, measured in enumerate(rounds, 1):
            gemm = measured["gemm"]
            for name, result in measured.items():
                joules = (f", {result['joules']:.3f} J = {result['joules'] / gemm['joules']:.3f} x GEMM"
                          if "joules" in result else "")
                print(f"  round {index} {name:>22}: {result['ms']:9.3f} ms = {result['ms'] / gemm['ms']:.3f} x GEMM{joules}",
                      flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
