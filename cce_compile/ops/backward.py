"""The backward's entry: the d-logits' coefficients, the gradients' buffers, and the runner
plan.backward names (the plain-PyTorch path, backward_dense or backward_filtered)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..config.kernel_config import KernelConfig
from ..plan.launch import LaunchPlan
from .backward_call import BackwardCall, Gradients
from .backward_dense import DenseBackward
from .backward_filtered import FilteredBackward
from .cpu_path import backward_cpu
from .loss_terms import grad_coefficients
from .problem import kernel_flags


def run_backward(
    plan: LaunchPlan, config: KernelConfig, grad_loss: Tensor, grad_lse: Tensor, e: Tensor, c: Tensor,
    targets: Tensor, bias: Tensor | None, weight: Tensor | None, lse: Tensor, kept_tiles: Tensor, tile_lse: Tensor,
    vocab_order: Tensor, ignore_index: int, label_smoothing: float, softcap: float, filter_eps: float,
    need_grad_e: bool, need_grad_c: bool,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """-> (grad_e, grad_c, grad_bias or None); a gradient not needed comes back empty."""
    coefficients = grad_coefficients(grad_loss, grad_lse, targets, weight, c.shape[0], ignore_index, label_smoothing)
    return backward_from_coefficients(
        plan, config, coefficients, e, c, targets, bias, weight, lse, kept_tiles, tile_lse, vocab_order,
        label_smoothing > 0.0, softcap, filter_eps, need_grad_e, need_grad_c,
    )


def backward_from_coefficients(
    plan: LaunchPlan, config: KernelConfig, coefficients: tuple[Tensor, Tensor, Tensor], e: Tensor, c: Tensor,
    targets: Tensor, bias: Tensor | None, weight: Tensor | None, lse: Tensor, kept_tiles: Tensor, tile_lse: Tensor,
    vocab_order: Tensor, has_smoothing: bool, softcap: float, filter_eps: float, need_grad_e: bool,
    need_grad_c: bool,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The gradients of d_logit[i, j] = coef_softmax[i] * p[i, j] - coef_target[i] * [j == y_i]
    - coef_smooth[i] * w[j] (the last only with has_smoothing), p = exp(logit - lse), through
    the soft-cap: (grad_e, grad_c, grad_bias or None)."""
    v = c.shape[0]
    coef_softmax, coef_target, coef_smooth = coefficients
    label_smoothing = 1.0 if has_smoothing else 0.0  # the runners read only whether it is on
    if plan.filtered and vocab_order.shape[0] != v:
        raise ValueError(f"vocab_order: filtered mode needs the forward's order of all {v} tokens")
    if plan.backward is None:
        tile = config.grad_logits
        return backward_cpu(
            e, c, targets, bias, weight, lse, coef_softmax, coef_target,
            coef_smooth if label_smoothing > 0.0 else None, softcap, filter_eps,
            chunk_v=max(config.slab_v, config.forward.block_n), filter_tile=(tile.block_m, tile.block_n),
            vocab_order=vocab_order if plan.filtered else None, forward_block_n=config.forward.block_n,
            need_grad_e=need_grad_e, need_grad_c=need_grad_c,
        )
    if e.shape[0] == 0:  # no token: nothing flows back
        grad_bias = torch.zeros(v, dtype=torch.float32, device=e.device) if bias is not None else None
        return (e.new_empty(e.shape if need_grad_e else (0,)),
                torch.zeros_like(c) if need_grad_c else c.new_empty((0,)), grad_bias)
    # fp16's range is narrow: d logits of a mean loss (~p / N) would fall below it, so they
    # are stored scaled up; otherwise `lse` stands in for the unread pointer.
    scaled = e.dtype == torch.float16
    scale = (torch.maximum(coef_softmax.abs().max(), coef_target.abs().max()).clamp_min(1e-30).reshape(1)
             if scaled else lse)
    call = BackwardCall(
        e, c, targets, bias, weight, lse, vocab_order, coef_softmax, coef_target, coef_smooth, scale, scaled,
        softcap, label_smoothing, need_grad_e, need_grad_c, config, plan, kernel_flags(e),
    )
    if plan.filtered:
        runner = FilteredBackward(call, kept_tiles, tile_lse)  # before the gradients exist: see its doc
        gradients = Gradients.allocate(call)
        grad_bias = runner.run(gradients)
    else:
        gradients = Gradients.allocate(call)
        grad_bias = DenseBackward(call, gradients).run()
    return gradients.grad_e, gradients.grad_c, grad_bias
