"""How far linear_log_probs' filtered backward lands from exact mode's, on the plain-PyTorch
path (CPU, no GPU needed): LM-like heads, 256 token rows, random log-prob upstream gradients
and entropy ones `--entropy-weights` their size. Exact mode's gradients are the op's own
(autograd through linear_log_probs), so the probe's coefficients are checked with the filter.

    PYTHONPATH=$PWD python benchmarks/probe_filtered_log_probs.py --shapes 896x151936

The CPU path puts back the skipped tiles' exact row sums and the tilt from the recomputed
softmax; the kernels do the same from the forward's tile statistics (tests/test_log_probs.py
checks the two agree). The tilt's sample is sized for the benchmark's N of the head
(bench/shapes.py; 8192 for other heads), since at 256 rows its cost bound would leave it out
where the GPU run has it.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace

import torch

from cce_compile import linear_log_probs
from cce_compile.bench.inputs import lm_like_inputs
from cce_compile.bench.shapes import SHAPES
from cce_compile.ops.cpu_path import backward_cpu, forward_cpu
from cce_compile.ops.filtering import vocab_order
from cce_compile.ops.loss_terms import log_prob_coefficients
from cce_compile.plan.policy import active_policy, override_policy

ROWS = 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["896x151936", "2304x256000", "4096x128256"], help="DxV")
    parser.add_argument("--entropy-weights", nargs="+", type=float, default=[0.0, 0.1, 1.0])
    parser.add_argument("--filter-eps", type=float, default=2.0**-10)
    parser.add_argument("--forward-block-n", type=int, default=256, help="the forward's tile width (H200's bundled: 256)")
    parser.add_argument("--tile", default="128x256", help="the backward's d-logits tile (H200's bundled: 128x256)")
    args = parser.parse_args()
    filter_tile = tuple(int(x) for x in args.tile.split("x"))
    print(f"filter_eps 2^{math.log2(args.filter_eps):.0f}, tiles {args.tile}, forward tiles {args.forward_block_n}")
    print("| D x V | entropy weight | dE vs exact | dC vs exact |")
    print("|---|---|---|---|")
    for shape in args.shapes:
        d, v = (int(x) for x in shape.split("x"))
        batch_tokens = next((head.n for head in SHAPES.values() if (head.d, head.v) == (d, v)), 8192)  # the tilt's N
        e, c, tokens = lm_like_inputs(ROWS, d, v, torch.bfloat16, "cpu", seed=1)
        e, c = e.float(), c.float()  # bf16 values, fp32 math: what is measured is the filter alone
        stats = forward_cpu(e, c, tokens, None, None, 0.0, False, chunk_v=8192, need_entropy=True,
                            need_lse_minus_mean=True)
        order = vocab_order(e, c, None)
        generator = torch.Generator().manual_seed(0)
        up_log_probs = torch.randn(ROWS, generator=generator)
        for weight in args.entropy_weights:
            up_entropy = weight * torch.randn(ROWS, generator=generator)
            coef_softmax, coef_target, coef_entropy = log_prob_coefficients(
                up_log_probs, up_entropy if weight else None, stats.lse_minus_mean, tokens, v, -100)
            filtered = backward_cpu(
                e, c, tokens, None, None, stats.lse, coef_softmax, coef_target, None, 0.0, args.filter_eps, chunk_v=8192,
                filter_tile=filter_tile, vocab_order=order, forward_block_n=args.forward_block_n,
                coef_entropy=coef_entropy, tilt_tokens=batch_tokens)[:2]
            errors = [((got - want).norm() / want.norm()).item()
                      for got, want in zip(filtered, exact_grads(e, c, tokens, up_log_probs, up_entropy))]
            print(f"| {d} x {v} | {weight:g} | {errors[0]:.2e} | {errors[1]:.2e} |", flush=True)


def exact_grads(e: torch.Tensor, c: torch.Tensor, tokens: torch.Tensor, up_log_probs: torch.Tensor,
                up_entropy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dE, dC) of sum(up_log_probs * log_probs + up_entropy * entropy), autograd through the
    op's exact mode on the plain-PyTorch path."""
    leaves = [e.clone().requires_grad_(), c.clone().requires_grad_()]
    with override_policy(replace(active_policy(), triton_on_cpu=False)):
        log_probs, entropy = linear_log_probs(*leaves, tokens, entropy=True)
    (log_probs * up_log_probs + entropy * up_entropy).sum().backward()
    return leaves[0].grad, leaves[1].grad


if __name__ == "__main__":
    main()
