"""What a sampling temperature costs linear_log_probs and linear_cross_entropy: accuracy against
fp32 on peaked LM-like rows (beside the old way, hidden / T rounded to the input dtype) and time
at T against T = 1, alternated in rounds, x one GEMM of the shape (docs/notes/h200-runs.md).

    python benchmarks/temperature.py --shapes 8192x2048x128256,8192x896x151936 --out t.json
    python benchmarks/temperature.py --small --out t.json   # CPU smoke run: accuracy only
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

import cce_compile
from cce_compile.bench.inputs import lm_like_inputs
from cce_compile.bench.metrics import relative_error


def fp32_reference(e: Tensor, c: Tensor, tokens: Tensor, temperature: float, up_lp: Tensor, up_h: Tensor,
                   rows: int = 1024) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """log-probs, entropies, dE and dC of sum(up_lp * log_probs + up_h * entropy) on fp32
    logits materialized `rows` rows at a time."""
    n = e.shape[0]
    log_probs, entropy = e.new_empty(n, dtype=torch.float32), e.new_empty(n, dtype=torch.float32)
    grad_e = torch.empty(e.shape, dtype=torch.float32, device=e.device)
    grad_c = torch.zeros(c.shape, dtype=torch.float32, device=e.device)
    c32 = c.float()
    for start in range(0, n, rows):
        part = slice(start, start + rows)
        e32 = e[part].float()
        log_softmax = torch.log_softmax(e32 @ c32.T / temperature, dim=-1)
        p = log_softmax.exp()
        log_probs[part] = log_softmax.gather(1, tokens[part, None])[:, 0]
        entropy[part] = -(p * log_softmax).sum(-1)
        d_logits = -up_lp[part, None] * p  # d / d logits of up_lp * log p_y + up_h * H
        d_logits.scatter_add_(1, tokens[part, None], up_lp[part, None])
        d_logits -= up_h[part, None] * p * (log_softmax + entropy[part, None])
        d_logits /= temperature
        grad_e[part] = d_logits @ c32
        grad_c += d_logits.T @ e32
    return log_probs, entropy, grad_e, grad_c


def accuracy(e: Tensor, c: Tensor, tokens: Tensor, temperature: float) -> dict[str, float]:
    g = torch.Generator(device=e.device).manual_seed(5)
    up_lp = torch.randn(e.shape[0], device=e.device, generator=g)
    up_h = torch.randn(e.shape[0], device=e.device, generator=g) * 0.1
    ref_lp, ref_h, ref_e, ref_c = fp32_reference(e, c, tokens, temperature, up_lp, up_h)
    leaves = [t.clone().requires_grad_() for t in (e, c)]
    log_probs, entropy = cce_compile.linear_log_probs(*leaves, tokens, temperature=temperature, entropy=True)
    ((log_probs * up_lp).sum() + (entropy * up_h).sum()).backward()
    log_probs, entropy = log_probs.detach(), entropy.detach()
    with torch.no_grad():
        rounded = cce_compile.linear_log_probs((e.float() / temperature).to(e.dtype), c, tokens)
    return {
        "mean entropy": float(ref_h.mean()), "log-prob max error": float((log_probs - ref_lp).abs().max()),
        "entropy max error": float((entropy - ref_h).abs().max()),
        "hidden / T rounded: log-prob max error": float((rounded - ref_lp).abs().max()),
        "dE relative error": relative_error(leaves[0].grad, ref_e),
        "dC relative error": relative_error(leaves[1].grad, ref_c),
    }


def median_ms(fn: Callable[[], None]) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, return_mode="median")


def timing(e: Tensor, c: Tensor, tokens: Tensor, temperature: float, rounds: int) -> dict[str, dict[str, float]]:
    """x one GEMM at T = 1 and at `temperature`, alternated `rounds` times: each path's median."""
    leaves = [t.clone().requires_grad_() for t in (e, c)]
    up = torch.randn(e.shape[0], device=e.device)
    gemm_out = torch.empty(e.shape[0], c.shape[0], dtype=e.dtype, device=e.device)

    def paths(t: float) -> dict[str, Callable[[], None]]:
        def no_grad() -> None:
            with torch.no_grad():
                cce_compile.linear_log_probs(e, c, tokens, temperature=t)

        def log_probs_and_entropy() -> None:
            leaves[0].grad = leaves[1].grad = None
            log_probs, entropy = cce_compile.linear_log_probs(*leaves, tokens, temperature=t, entropy=True)
            ((log_probs * up).sum() + 0.1 * entropy.sum()).backward()

        def loss() -> None:
            leaves[0].grad = leaves[1].grad = None
            cce_compile.linear_cross_entropy(*leaves, tokens, temperature=t).backward()

        return {"no-grad log-probs": no_grad, "fwd+bwd log-probs + entropy": log_probs_and_entropy,
                "fwd+bwd loss": loss}

    times: dict[float, dict[str, list[float]]] = {1.0: {}, temperature: {}}
    gemms = []
    for _ in range(rounds):
        gemms.append(median_ms(lambda: torch.mm(e, c.T, out=gemm_out)))
        for t in times:
            for name, fn in paths(t).items():
                times[t].setdefault(name, []).append(median_ms(fn))
    gemm = statistics.median(gemms)
    return {f"T={t}": {name: round(statistics.median(ms) / gemm, 3) for name, ms in by_path.items()}
            for t, by_path in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8192x2048x128256,8192x896x151936,8192x4096x128256")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--target-loss", type=float, default=0.5, help="the rows' mean loss: lower is more peaked")
    parser.add_argument("--small", action="store_true", help="one tiny shape on CPU, accuracy only")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = "cpu" if args.small else "cuda"
    shapes = [(256, 512, 4000)] if args.small else [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    found: dict[str, object] = {"device": "cpu" if args.small else torch.cuda.get_device_name(),
                                "temperature": args.temperature}
    for n, d, v in shapes:
        e, c, tokens = lm_like_inputs(n, d, v, torch.bfloat16, device, seed=3, target_loss=args.target_loss)
        row: dict[str, object] = {"accuracy": accuracy(e, c, tokens, args.temperature)}
        if not args.small:
            row["x GEMM"] = timing(e, c, tokens, args.temperature, args.rounds)
        found[f"{n}x{d}x{v}"] = row
        print(f"{n}x{d}x{v}", json.dumps(row), flush=True)
    args.out.write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
