"""The backward's entry: the d-logits' coefficients, the gradients' buffers, and the runner
plan.backward names (the plain-PyTorch path, backward_dense or backward_filtered)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from ..config.kernel_config import KernelConfig
from ..plan.launch import LaunchPlan
from .backward_call import BackwardCall, Gradients
from .backward_dense import DenseBackward
from .backward_filtered import FilteredBackward
from .cpu_path import backward_cpu
from .filtering import FilterStats
from .loss_terms import grad_coefficients
from .problem import kernel_flags


class Coefficients(NamedTuple):
    """The d-logits' per-token coefficients (ops/loss_terms.py), fp32 (N,): `smooth` is read
    only with label smoothing, `entropy` is None but for linear_log_probs' entropy, whose
    `lse_minus_mean` (each row's lse less its mean logit, its entropy within lse's rounding)
    bounds fp16's d-logits."""

    softmax: Tensor
    target: Tensor
    smooth: Tensor
    entropy: Tensor | None = None
    lse_minus_mean: Tensor | None = None


def run_backward(
    plan: LaunchPlan, config: KernelConfig, grad_loss: Tensor, grad_lse: Tensor, e: Tensor, c: Tensor,
    targets: Tensor, bias: Tensor | None, weight: Tensor | None, lse: Tensor, kept_tiles: Tensor, tile_lse: Tensor,
    vocab_order: Tensor, ignore_index: int, label_smoothing: float, softcap: float, filter_eps: float,
    need_grad_e: bool, need_grad_c: bool,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """-> (grad_e, grad_c, grad_bias or None) of the loss; a gradient not needed comes back empty."""
    coefficients = Coefficients(*grad_coefficients(
        grad_loss, grad_lse, targets, weight, c.shape[0], ignore_index, label_smoothing))
    filter_stats = FilterStats(kept_tiles, tile_lse, tile_lse.new_empty((0, 0)), vocab_order)
    return backward_from_coefficients(
        plan, config, coefficients, e, c, targets, bias, weight, lse, filter_stats, label_smoothing, softcap, filter_eps,
        need_grad_e, need_grad_c,
    )


def backward_from_coefficients(
    plan: LaunchPlan, config: KernelConfig, coefficients: Coefficients, e: Tensor, c: Tensor, targets: Tensor,
    bias: Tensor | None, weight: Tensor | None, lse: Tensor, filter_stats: FilterStats, label_smoothing: float,
    softcap: float, filter_eps: float, need_grad_e: bool, need_grad_c: bool,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """-> (grad_e, grad_c, grad_bias or None) for d-logits of the given coefficients (d loss / d
    the logits the kernels compute, scaled by plan.logit_scale here: the chain rule's
    factor for a temperature, so no runner needs it but in the logits it recomputes)."""
    v = c.shape[0]
    vocab_order = filter_stats.vocab_order
    coefficients = _scaled(coefficients, plan.logit_scale)
    coef_softmax, coef_target, coef_smooth, coef_entropy, _ = coefficients
    if plan.filtered and vocab_order.shape[0] != v:
        raise ValueError(f"vocab_order: filtered mode needs the forward's order of all {v} tokens")
    if plan.backward is None:
        tile = config.grad_logits
        return backward_cpu(
            e, c, targets, bias, weight, lse, coef_softmax, coef_target,
            coef_smooth if label_smoothing > 0.0 else None, softcap, filter_eps,
            chunk_v=max(config.slab_v, config.forward.block_n), filter_tile=(tile.block_m, tile.block_n),
            vocab_order=vocab_order if plan.filtered else None, forward_block_n=config.forward.block_n,
            need_grad_e=need_grad_e, need_grad_c=need_grad_c, coef_entropy=coef_entropy,
            logit_scale=plan.logit_scale, dense_fraction=plan.dense_fraction if plan.read_back_steps else None,
        )
    if e.shape[0] == 0:  # no token: nothing flows back
        grad_bias = torch.zeros(v, dtype=torch.float32, device=e.device) if bias is not None else None
        return (e.new_empty(e.shape if need_grad_e else (0,)),
                torch.zeros_like(c) if need_grad_c else c.new_empty((0,)), grad_bias)
    # fp16's range is narrow: d logits of a mean loss (~p / N), or of tokens whose upstream
    # gradients lie far below the call's largest, would fall below it, so they are stored scaled
    # up; otherwise `lse` stands in for the unread pointer.
    scaled = e.dtype == torch.float16
    scale = (_d_logits_scale(coefficients, weight, label_smoothing) if scaled else lse)
    call = BackwardCall(
        e, c, targets, bias, weight, lse, vocab_order, coef_softmax, coef_target, coef_smooth, scale, scaled,
        softcap, label_smoothing, need_grad_e, need_grad_c, config, plan, kernel_flags(e), coef_entropy,
    )
    if plan.filtered:
        runner = FilteredBackward(call, filter_stats)  # before the gradients exist: see its doc
        gradients = Gradients.allocate(call)
        grad_bias = runner.run(gradients)
    else:
        gradients = Gradients.allocate(call)
        grad_bias = DenseBackward(call, gradients).run()
    return gradients.grad_e, gradients.grad_c, grad_bias


def _scaled(coefficients: Coefficients, logit_scale: float) -> Coefficients:
    """d loss / d (the kernels' unscaled logits) is logit_scale (1 / T) times d loss / d (the
    logits the softmax sees): every coefficient times it."""
    if logit_scale == 1.0:
        return coefficients
    softmax, target, smooth, entropy, _ = coefficients
    return coefficients._replace(softmax=softmax * logit_scale, target=target * logit_scale,
                                 smooth=smooth * logit_scale, entropy=None if entropy is None else entropy * logit_scale)


FP16_HEADROOM = 2.0**15
"""The largest |d logit| fp16's stored d-logits take: about half fp16's largest (65504), so a bound
off by fp32's rounding cannot overflow, and the 15 binades above 1 are used: with per-token
upstream gradients spanning 8 decades (reduction="none" weights, a loss scale, linear_log_probs'
advantages), scaled to at most 1 most stored d-logits sink to fp16's subnormals or 0 and dE
rows err by up to 0.22 relative; scaled to this, within 6e-4, where fp32 d-logits (the
plain-PyTorch path) err by 3e-4 (interpreter, LM-like 96 x 512 x 32)."""


def _d_logits_scale(coefficients: Coefficients, weight: Tensor | None, label_smoothing: float) -> Tensor:
    """fp16's d-logits scale, a (1,) fp32 tensor: d-logits / scale are at most FP16_HEADROOM."""
    return (_d_logits_bound(coefficients, weight, label_smoothing).clamp_min(1e-30) / FP16_HEADROOM).reshape(1)


def _d_logits_bound(coefficients: Coefficients, weight: Tensor | None, label_smoothing: float) -> Tensor:
    """A bound on every |d logit| of the call, so the stored d-logits neither overflow nor sink
    below fp16's normal range. Without entropy, d_j = a p_j - b [j == y] - s w_j (a, b, s the
    softmax, target and smoothing coefficients; s read only with label smoothing), so with
    p_j in [0, 1] |d_j| <= max(|a|, |b|, |a - b|) + |s| max |w|; the soft-cap's slope is at
    most 1. With entropy (linear_log_probs), d_j = p_j (s - h (l_j - lse)) - t [j == y] with
    s = -(g + h K), t = -g and K = lse - mu (mu the softmax-weighted mean logit; K is the row's
    entropy H within lse's rounding), that is -g p_j - h p_j (l_j - mu) + g [j == y], so
    |d_j| <= 2 |t| + |h| max(H, 1/e): p_j (l_j - mu) is at most H above mu and 1/e below it. NaN coefficients (an out-of-range target's,
    loss_terms.upstream_gradient) count 0: a NaN bound would make every row's d-logits NaN,
    where the other paths leave the other tokens' dE rows as they are."""
    if coefficients.entropy is None:
        a, b = coefficients.softmax, coefficients.target
        bound = torch.maximum(torch.maximum(_magnitude(a), _magnitude(b)), _magnitude(a - b))
        if label_smoothing > 0.0:
            largest_weight = 1.0 if weight is None else weight.to(torch.float32).abs().max()
            bound = bound + _magnitude(coefficients.smooth) * largest_weight
        return bound.max()
    assert coefficients.lse_minus_mean is not None, "an entropy term comes with its rows' lse less mean logit"
    h, lse_minus_mean = coefficients.entropy.abs(), coefficients.lse_minus_mean
    spread = torch.where(h != 0, h * torch.clamp_min(lse_minus_mean, 1.0 / math.e), 0.0)  # a row of no token: 0
    return (2 * _magnitude(coefficients.target) + spread).max()


def _magnitude(coefficient: Tensor) -> Tensor:
    """|coefficient|, 0 where it is NaN."""
    return torch.where(torch.isnan(coefficient), 0.0, coefficient.abs())
