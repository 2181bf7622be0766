"""Does the order of c's rows change how fast the same work runs? A probe.

    PYTHONPATH=$PWD python benchmarks/probe_vocab_order.py --out probe.json

On the H200 (profile-h200-v12-*.json) filtered mode's forward kernel, which walks a copy of c
sorted by mean logit, ran ~10% faster than exact mode's launch of the same kernel on c as
given (Qwen2.5 with the same tile config: 1.08 against 1.20 x GEMM). The work is identical, so
the suspect is the data: rows of similar logits side by side may switch fewer bits in the
tensor cores, draw less power and keep the clocks up. This times, per shape on LM-like bf16
inputs, cuBLAS's e @ c.T and exact mode's forward op with c as given, sorted by mean logit,
and randomly permuted, each against the GEMM on c as given (targets as given: the work
does not depend on them).
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
from cce_compile.ops.filtering import vocab_order  # noqa: E402
from cce_compile.ops.forward import linear_cross_entropy_forward  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", action="append", default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    report = {"device": torch.cuda.get_device_name(), "shapes": {}}
    for shape in args.shape or ["8192x2304x256000", "8192x4096x128256", "16384x896x151936", "4096x8192x128256"]:
        s = parse_shape(shape)
        e, c, targets = lm_like_inputs(s.n, s.d, s.v, torch.bfloat16, "cuda", seed=0)
        orders = {"given": None, "sorted": vocab_order(e, c, None),
                  "shuffled": torch.randperm(s.v, device="cuda", generator=torch.Generator("cuda").manual_seed(1))}
        gemm_ms = triton.testing.do_bench(lambda: e @ c.T)
        row = {}
        for name, order in orders.items():
            walked = c if order is None else c.index_select(0, order)
            row[f"gemm {name}"] = triton.testing.do_bench(lambda: e @ walked.T) / gemm_ms
            row[f"forward {name}"] = triton.testing.do_bench(
                lambda: linear_cross_entropy_forward(e, walked, targets, None, None, -100, 0.0, 0.0, 0.0)) / gemm_ms
            del walked
        report["shapes"][shape] = {"gemm_ms": gemm_ms, "x_gemm": row}
        print(shape, f"GEMM {gemm_ms:.3f} ms;", ", ".join(f"{k} {v:.3f}" for k, v in row.items()))
    args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
