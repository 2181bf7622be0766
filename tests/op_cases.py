"""Inputs and comparisons shared by the op's test files."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import ContextManager

import torch
from torch import Tensor

import cce_compile
from cce_compile.config.kernel_config import KernelConfig, TileConfig
from cce_compile.plan.policy import active_policy, override_policy
from cce_compile.bench.inputs import lm_like_inputs

from .reference import reference_loss

TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2.5e-2}
"""Relative error allowed against float64 (norm ratio): fp32 accumulation, inputs rounded."""


def on_kernels(kernels: bool) -> ContextManager[None]:
    """CPU calls in the block run the Triton kernels (interpreter) or the plain-PyTorch path."""
    return override_policy(replace(active_policy(), triton_on_cpu=kernels))


def make_inputs(kind: str, lead: tuple[int, ...], v: int, d: int, dtype: torch.dtype, seed: int,
                device: str = "cpu") -> tuple[Tensor, Tensor, Tensor]:
    """(e, c, targets). kind: "signed" (plain signed randn), "peaked" (a few dominant logits
    per row, the target often among them), "zipf" (the benchmark's LM-like inputs:
    Zipfian targets, a unigram prior in the logits, a sparse softmax)."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(lead)
    e = torch.randn(n, d, generator=g) / d**0.25
    c = torch.randn(v, d, generator=g) / d**0.25
    targets = torch.randint(0, v, (n,), generator=g)
    if kind == "peaked":
        e = e * 4.0
        c[targets] += 2.0 * e / e.norm(dim=1, keepdim=True) * d**0.25
    elif kind == "zipf":
        e, c, targets = lm_like_inputs(n, d, v, torch.float32, "cpu", seed)
    elif kind != "signed":
        raise ValueError(kind)
    return (e.reshape(*lead, d).to(dtype).to(device), c.to(dtype).to(device), targets.reshape(lead).to(device))


CUBLAS_WORKSPACES = 2 * 32 * 2**20
"""What a process's calls may leave allocated between them, all told, after the first: the capture
stream's cuBLAS workspace on the caller's thread and on autograd's (32 MiB each on Hopper), made
again after CUDA graph trees free them (see call_peak)."""


def call_peak(call) -> tuple[int, int]:
    """The CUDA memory `call()` held at its peak beyond what it left allocated, and what it left
    allocated (the caller drops the call's outputs and gradients inside `call`). What stays is
    the process's, not the call's: torch keeps a cuBLAS workspace (32 MiB on Hopper) per handle
    and stream, and CUDA graph trees (torch.compile's reduce-overhead) free them all at each
    warm-up and recording (torch/_inductor/cudagraph_trees.py), so the next GEMM on a stream
    makes its workspace again, inside whatever call runs it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    call()
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before
    return torch.cuda.max_memory_allocated() - before - kept, kept


def steady_peaks(call, calls: int) -> list[int]:
    """The peaks of `calls` calls of `call` (call_peak's, each; the caller has called it once
    already, to compile and make the streams' workspaces), having checked that together they
    left no more allocated than CUBLAS_WORKSPACES."""
    measured = [call_peak(call) for _ in range(calls)]
    kept = sum(left for _, left in measured)
    assert kept <= CUBLAS_WORKSPACES, f"the calls left {kept / 2**20:.0f} MiB allocated"
    return [peak for peak, _ in measured]


def relative_error(actual: Tensor, expected: Tensor, floor: float = 1e-4) -> float:
    """||actual - expected|| / ||expected||, the denominator floored so a (near-)zero
    reference (a fully ignored batch, a perfectly predicted token) compares absolutely."""
    expected = expected.detach().double()
    diff = (actual.detach().double() - expected).norm()
    return float(diff / max(float(expected.norm()), floor))


def check_against_reference(e: Tensor, c: Tensor, targets: Tensor, options: dict, bias: Tensor | None = None,
                            weight: Tensor | None = None, tol: float | None = None) -> None:
    """Loss, lse and the gradients of e, c, bias agree with float64 within the dtype's tolerance."""
    tol = TOLERANCE[e.dtype] if tol is None else tol
    leaves = [t.detach().clone().requires_grad_() for t in (e, c) + ((bias,) if bias is not None else ())]
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    g = torch.Generator().manual_seed(1)
    outs = []
    for (ee, cc, *bb), fn in ((leaves, cce_compile.linear_cross_entropy), (ref_leaves, reference_loss)):
        out = fn(ee, cc, targets, bias=bb[0] if bb else None, weight=weight, return_lse=True, **options)
        outs.append(out)
    (loss, lse), (ref_loss, ref_lse) = outs
    assert loss.dtype == torch.float32 and lse.dtype == torch.float32
    assert torch.isfinite(loss).all(), loss
    assert relative_error(loss, ref_loss) <= tol, (relative_error(loss, ref_loss), options)
    assert relative_error(lse, ref_lse) <= tol
    # Drive both outputs with random upstream gradients so every path to e, c, bias is checked.
    up_loss = torch.randn(loss.shape, generator=g, dtype=torch.float64)
    up_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    ((loss.double() * up_loss).sum() + (lse.double() * up_lse).sum()).backward()
    ((ref_loss * up_loss).sum() + (ref_lse * up_lse).sum()).backward()
    for name, leaf, ref in zip(("e", "c", "bias"), leaves, ref_leaves):
        assert leaf.grad is not None and leaf.grad.dtype == leaf.dtype
        err = relative_error(leaf.grad, ref.grad)
        assert err <= tol, f"d{name}: relative error {err:.2e} > {tol:.0e} with {options}"
    if options.get("reduction", "mean") != "none":
        check_scalar_loss(e, c, targets, options, bias, weight, tol)


def check_scalar_loss(e: Tensor, c: Tensor, targets: Tensor, options: dict, bias: Tensor | None,
                      weight: Tensor | None, tol: float) -> None:
    """A mean or sum loss alone (no lse asked), under an upstream gradient other than 1: the
    fused forward's path where it applies (exact mode, memory="workspace"), against float64."""
    leaves = [t.detach().clone().requires_grad_() for t in (e, c) + ((bias,) if bias is not None else ())]
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    losses = []
    for (ee, cc, *bb), fn in ((leaves, cce_compile.linear_cross_entropy), (ref_leaves, reference_loss)):
        losses.append(fn(ee, cc, targets, bias=bb[0] if bb else None, weight=weight, **options))
    loss, ref_loss = losses
    assert relative_error(loss, ref_loss) <= tol, (relative_error(loss, ref_loss), options)
    (loss * 0.75).backward()
    (ref_loss * 0.75).backward()
    for name, leaf, ref in zip(("e", "c", "bias"), leaves, ref_leaves):
        err = relative_error(leaf.grad, ref.grad)
        assert err <= tol, f"d{name} of the scalar loss: relative error {err:.2e} > {tol:.0e} with {options}"


def grads_with_frozen(e: Tensor, c: Tensor, targets: Tensor, options: dict, e_trains: bool, c_trains: bool,
                      bias: Tensor | None = None) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """(e.grad, c.grad, bias.grad) of the summed loss with e and/or c frozen (requires_grad off)."""
    ee = e.detach().clone().requires_grad_(e_trains)
    cc = c.detach().clone().requires_grad_(c_trains)
    bb = None if bias is None else bias.detach().clone().requires_grad_()
    cce_compile.linear_cross_entropy(ee, cc, targets, bias=bb, **options).sum().backward()
    return ee.grad, cc.grad, None if bb is None else bb.grad


FROZEN_MODES = {"fused": {}, "recompute": {"memory": "low"}, "filtered": {"filter_eps": 2.0**-12}}
"""The three paths a frozen operand must skip its gradient on: the fused forward (a scalar
loss's default), the recompute backward, filtered mode."""


def check_frozen_operands(e: Tensor, c: Tensor, targets: Tensor, options: dict, bias: Tensor | None = None) -> None:
    """A frozen head (LoRA) or frozen hidden states change nothing in the other gradients:
    they are the ones a call training both gives, bit for bit."""
    both = grads_with_frozen(e, c, targets, options, True, True, bias)
    head_frozen = grads_with_frozen(e, c, targets, options, True, False, bias)
    hidden_frozen = grads_with_frozen(e, c, targets, options, False, True, bias)
    assert head_frozen[1] is None and hidden_frozen[0] is None
    assert torch.equal(head_frozen[0], both[0])
    assert torch.equal(hidden_frozen[1], both[1])
    if bias is not None:
        assert torch.equal(head_frozen[2], both[2]) and torch.equal(hidden_frozen[2], both[2])


def with_row_stride(t: torch.Tensor, stride: int) -> torch.Tensor:
    """`t` (2-D) in rows `stride` elements apart: an odd stride no tensor descriptor takes."""
    wide = torch.empty(t.shape[0], stride, dtype=t.dtype, device=t.device)
    return wide[:, : t.shape[1]].copy_(t)


SMALL_TILES = KernelConfig(*(TileConfig(32, 32, 16, 4, 4, 1),) * 4, slab_v=128, vocab_splits=2)
"""Tiles the interpreter runs quickly, equal in every kernel: the forward's and the backward's
filter the same vocabulary tiles."""
