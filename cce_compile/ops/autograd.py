"""Autograd for the forward op: its backward is the backward op (a triton_op too), so
torch.compile traces both without a graph break."""

from __future__ import annotations

import contextlib

import torch

from ..config.resolve import active_override, override_config
from .backward import linear_cross_entropy_backward
from .forward import linear_cross_entropy_forward


def _setup_context(ctx, inputs, output) -> None:
    e, c, targets, bias, weight, ignore_index, label_smoothing, softcap, filter_eps = inputs
    _, lse, kept_tiles, tile_lse, order = output
    ctx.save_for_backward(e, c, targets, bias, weight, lse, kept_tiles, tile_lse, order)
    ctx.mark_non_differentiable(kept_tiles, tile_lse, order)
    ctx.options = (ignore_index, label_smoothing, softcap, filter_eps)
    # The backward must launch with the forward's config (filtered mode's kept tiles and tile
    # log-sum-exps are laid out by its tiles); an override does not reach autograd's CUDA device thread.
    ctx.override = active_override()


def _backward(ctx, grad_loss, grad_lse, _grad_kept_tiles, _grad_tile_lse, _grad_order):
    e, c, targets, bias, weight, lse, kept_tiles, tile_lse, order = ctx.saved_tensors
    grad_loss = torch.zeros_like(lse) if grad_loss is None else grad_loss
    grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse
    # backward() may be called inside an autocast region: keep the op's fp32 math its own.
    override = contextlib.nullcontext() if ctx.override is None else override_config(ctx.override)
    # Only the gradients autograd asks for are computed: a frozen head (LoRA) skips dC's GEMMs.
    need_grad_e, need_grad_c = ctx.needs_input_grad[:2]
    with torch.autocast(e.device.type, enabled=False), override:
        grad_e, grad_c, grad_bias = linear_cross_entropy_backward(
            grad_loss, grad_lse, e, c, targets, bias, weight, lse, kept_tiles, tile_lse, order, *ctx.options,
            need_grad_e, need_grad_c,
        )
    return (grad_e if need_grad_e else None, grad_c if need_grad_c else None, None,
            grad_bias if bias is not None else None, None, None, None, None, None)


linear_cross_entropy_forward.register_autograd(_backward, setup_context=_setup_context)
