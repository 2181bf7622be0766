"""Does the persistent forward lose per FLOP at large N because one grid walks too many tiles?

    PYTHONPATH=$PWD python benchmarks/probe_forward_chunks.py --shape 32768x4096x128256 --chunk-rows 8192

At N = 32768 the op's forward cost 1.225 x a GEMM's joules against 1.083 at N = 8192, on the same
tile config (docs/performance.md, v28c). The suspect: each of the 132 persistent programs walks
972 tiles there against 243, so the programs drift apart and the columns of c in flight at once
outgrow L2. This times, back to back at the power limit and alternated over --rounds, the op's
forward on all N rows (one persistent grid) against the same forward called per --chunk-rows
rows (a grid per chunk), beside one cuBLAS e @ c.T, and checks that both give the same lse.
Prints and writes ms and joules per pass (NVML; ms alone where the board has no counter). Runs
on CPU under TRITON_INTERPRET=1 as a smoke check (times meaningless there).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cce_compile.bench.harness import parse_shape  # noqa: E402
from cce_compile.bench.inputs import lm_like_inputs  # noqa: E402
from cce_compile.ops.forward import linear_cross_entropy_forward  # noqa: E402
from probe_joules import back_to_back, energy_counter  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", help="NxDxV (repeatable) [Llama-3's head at N = 32768]")
    parser.add_argument("--chunk-rows", type=int, default=8192)
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
        chunks = [(start, min(start + args.chunk_rows, shape.n)) for start in range(0, shape.n, args.chunk_rows)]
        logits = torch.empty((shape.n, shape.v), dtype=torch.bfloat16, device=device)

        def forward(rows: tuple[int, int] = (0, shape.n)) -> torch.Tensor:
            first, end = rows
            return linear_cross_entropy_forward(e[first:end], c, targets[first:end], None, None, -100, 0.0, 0.0, 0.0)[1]

        calls = {
            "gemm": lambda out=logits: torch.mm(e, c.T, out=out),
            "one grid": forward,
            f"grids of {args.chunk_rows} rows": lambda: [forward(rows) for rows in chunks],
        }
        with torch.no_grad():
            whole, chunked = forward(), torch.cat([forward(rows) for rows in chunks])
            torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)
            rounds = [{name: back_to_back(call, args.seconds, energy_mj) for name, call in calls.items()}
                      for _ in range(args.rounds)]
        del calls, logits  # the next shape's GEMM output is allocated without this one's
        report["shapes"][spec] = {"chunk_rows": args.chunk_rows, "rounds": rounds}
        print(f"{spec}, {len(chunks)} chunks of {args.chunk_rows} rows (lse agree):")
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
