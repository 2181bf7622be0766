"""The op as torch.library sees it: the forward and backward custom ops, their fake (shape)
functions, and the autograd that joins them.

Both are opaque to torch.compile: Dynamo and AOTAutograd see one node per direction (the fake
functions give their outputs' shapes, so a dynamic N traces without specializing), and
Inductor calls each as an extern kernel that runs the same code as an eager call: the same
kernels, cuBLAS for the gradient GEMMs, the slab loop's CUDA graph. So the compiled graph's
size does not grow with the backward's slab count, and compiled and eager calls launch alike.
The forward picks its config and policy when it runs, or, traced by torch.compile through
the API, takes the ones resolved where it was traced (its `settings` argument,
ops/problem.traced_settings; a direct call of the op that omits it resolves as it runs);
the autograd passes them to the backward as one string, so the backward launches with the
forward's (filtered mode's kept tiles are laid out by its tiles), on whatever thread
autograd runs it.

The fused op computes a scalar loss and its gradients in one call (ops/forward_fused.py); its
backward only scales them by the loss's upstream gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from ..config.kernel_config import KernelConfig
from ..kernels.fused_forward import scale_unless_one_kernel
from ..plan.launch import plan_launch, runs_triton
from ..plan.policy import Policy
from .backward import run_backward
from .filtering import FilterStats
from .forward import run_forward
from .forward_fused import run_fused, scale_unless_one
from .launch import KernelLauncher, on_device_of
from .precision import without_autocast
from .problem import (backward_settings, cdiv, launch_backward_with_config, launch_settings, launch_with_config,
                      options_of, problem_of)

ForwardOutputs = tuple[Tensor, Tensor, Tensor, Tensor, Tensor]


@torch.library.custom_op("cce::linear_cross_entropy_forward", mutates_args=())
def linear_cross_entropy_forward(
    e: Tensor, c: Tensor, targets: Tensor, bias: Tensor | None, weight: Tensor | None,
    ignore_index: int, label_smoothing: float, softcap: float, filter_eps: float, logit_scale: float = 1.0,
    settings: str = "",
) -> ForwardOutputs:
    """e (N, D), c (V, D), targets (N,) -> (loss (N,), lse (N,), kept_tiles (flat), tile_lse, vocab_order).

    loss and lse are fp32; `softcap` 0 means none, `filter_eps` 0 exact mode, `logit_scale` (1 /
    temperature) multiplies the logits before the soft-cap (whose `softcap` is in scaled units). With
    filter_eps > 0 the forward also returns what the backward filters with: the vocabulary
    order and, on the Triton path, the kept tiles and tile log-sum-exps (ops/filtering.py);
    otherwise these are empty.
    `settings`: problem.traced_settings (the traced config and policy; without them the call
    resolves its own)."""
    with on_device_of(e):
        options = options_of(bias, weight, softcap, label_smoothing, filter_eps, logit_scale)

        def launch(config: KernelConfig, policy: Policy) -> ForwardOutputs:
            plan = plan_launch(problem_of(e, c), options, config, policy)
            loss, lse, kept_tiles, tile_lse, order = run_forward(
                plan, config, e, c, targets, bias, weight, ignore_index, label_smoothing, softcap, filter_eps)
            return loss, lse, kept_tiles.reshape(-1), tile_lse, order

        return launch_with_config(e, c, filter_eps > 0.0, settings, launch)


def kept_tiles_of(flat: Tensor, c: Tensor, config: KernelConfig) -> Tensor:
    """A forward op's kept tiles, which it returns flat, as the backward reads them: (row blocks,
    vocab tiles), or (0, 0) outside filtered mode's kernels. Flat because a 2-D output's row
    blocks (N / block_m) may be 1 at a small N, and torch.compile, recording an output, guards
    every such dimension != 1, which a declared mark_dynamic range from 2 refuses
    (ConstraintViolationError); the flat size is a multiple of the vocab tiles."""
    if not flat.numel():
        return flat.view(0, 0)
    return flat.view(-1, cdiv(c.shape[0], config.grad_logits.block_n))


def fake_filter_stats(e: Tensor, c: Tensor, targets: Tensor, filter_eps: float, entropy: bool,
                      settings: str) -> FilterStats:
    """The shapes forward.row_and_filter_stats gives its FilterStats, for the fake functions,
    the kept tiles flat as the forward ops return them (kept_tiles_of)."""
    n, v = e.shape[0], c.shape[0]
    filtered = filter_eps > 0.0
    kept_shape, tile_shape = (0,), (0, 0)
    if filtered:
        config, policy = launch_settings(settings, e, c, True)
        if runs_triton(problem_of(e, c), policy):
            kept_shape = (cdiv(n, config.grad_logits.block_m) * cdiv(v, config.grad_logits.block_n),)
            tile_shape = (n, cdiv(v, config.forward.block_n))
    return FilterStats(
        e.new_empty(kept_shape, dtype=torch.int8),
        e.new_empty(tile_shape, dtype=torch.float16),
        e.new_empty(tile_shape if entropy else (0, 0), dtype=torch.float16),
        targets.new_empty((v,) if filtered else (0,), dtype=torch.int64),
    )


@linear_cross_entropy_forward.register_fake
def _forward_fake(e, c, targets, bias, weight, ignore_index, label_smoothing, softcap, filter_eps, logit_scale=1.0,
                  settings="") -> ForwardOutputs:
    n = e.shape[0]
    kept_tiles, tile_lse, _, order = fake_filter_stats(e, c, targets, filter_eps, False, settings)
    return e.new_empty((n,), dtype=torch.float32), e.new_empty((n,), dtype=torch.float32), kept_tiles, tile_lse, order


@torch.library.custom_op("cce::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward(
    grad_loss: Tensor, grad_lse: Tensor, e: Tensor, c: Tensor, targets: Tensor,
    bias: Tensor | None, weight: Tensor | None, lse: Tensor, kept_tiles: Tensor, tile_lse: Tensor,
    vocab_order: Tensor, ignore_index: int, label_smoothing: float, softcap: float, filter_eps: float,
    logit_scale: float, need_grad_e: bool, need_grad_c: bool, settings: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """-> (grad_e, grad_c, grad_bias), with the forward's config and policy (`settings`,
    problem.encode_settings; problem.launch_backward_with_config says when it takes another).
    A gradient not needed (a frozen head under LoRA: need_grad_c False) comes back empty and its
    GEMMs never run; grad_bias is empty when there is no bias."""
    with on_device_of(e):
        options = options_of(bias, weight, softcap, label_smoothing, filter_eps, logit_scale)

        def launch(config: KernelConfig, policy: Policy) -> tuple[Tensor, Tensor, Tensor]:
            plan = plan_launch(problem_of(e, c), options, config, policy)
            return gradient_outputs(c, *run_backward(
                plan, config, grad_loss, grad_lse, e, c, targets, bias, weight, lse,
                kept_tiles_of(kept_tiles, c, config), tile_lse,
                vocab_order, ignore_index, label_smoothing, softcap, filter_eps, need_grad_e, need_grad_c,
            ))

        return launch_backward_with_config(e, c, filter_eps > 0.0, settings, launch)


def gradient_outputs(c: Tensor, grad_e: Tensor, grad_c: Tensor,
                     grad_bias: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """A backward op's (grad_e, grad_c, grad_bias) from a runner's: dbias in c's dtype, a
    tensor of its own (an fp32 runner's sum may be a carved block padded past 1 MiB, which
    bias.grad would pin), and empty without a bias (an op's output cannot be None)."""
    return grad_e, grad_c, c.new_empty((0,)) if grad_bias is None else grad_bias.to(c.dtype, copy=True)


def fake_gradients(e: Tensor, c: Tensor, bias: Tensor | None, need_grad_e: bool,
                   need_grad_c: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The shapes gradient_outputs gives, for the fake functions: a gradient not needed, or
    dbias without a bias, empty."""
    return (
        e.new_empty(e.shape if need_grad_e else (0,)),
        c.new_empty(c.shape if need_grad_c else (0,)),
        c.new_empty(c.shape[:1] if bias is not None else (0,)),
    )


@linear_cross_entropy_backward.register_fake
def _backward_fake(grad_loss, grad_lse, e, c, targets, bias, weight, lse, kept_tiles, tile_lse, vocab_order,
                   ignore_index, label_smoothing, softcap, filter_eps, logit_scale, need_grad_e, need_grad_c, settings):
    return fake_gradients(e, c, bias, need_grad_e, need_grad_c)


def _setup_context(ctx, inputs, output) -> None:
    e, c, targets, bias, weight, ignore_index, label_smoothing, softcap, filter_eps, logit_scale, settings = inputs
    _, lse, kept_tiles, tile_lse, order = output
    ctx.save_for_backward(e, c, targets, bias, weight, lse, kept_tiles, tile_lse, order)
    ctx.mark_non_differentiable(kept_tiles, tile_lse, order)
    ctx.options = (ignore_index, label_smoothing, softcap, filter_eps, logit_scale)
    ctx.settings = backward_settings(settings, e, c, filter_eps > 0.0)


def no_double_backward(op: str) -> Callable[..., tuple[Tensor | None, ...]]:
    """The autograd formula of a backward op: a second backward that reaches it (a Hessian
    product, a gradient penalty through the loss) gets a named error instead of torch's "no
    autograd formula"; a create_graph=True backward whose second order goes elsewhere runs."""

    def refuse(ctx, *grads: Tensor) -> tuple[Tensor | None, ...]:
        raise RuntimeError(f"{op} has no double backward: its gradients come from kernels that are not "
                           "themselves differentiable")

    return refuse


def _backward(ctx, grad_loss, grad_lse, _grad_kept_tiles, _grad_tile_lse, _grad_order):
    e, c, targets, bias, weight, lse, kept_tiles, tile_lse, order = ctx.saved_tensors
    grad_loss = torch.zeros_like(lse) if grad_loss is None else grad_loss
    grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse
    need_grad_e, need_grad_c = ctx.needs_input_grad[:2]
    # backward() may be called inside an autocast region: keep the op's fp32 math its own.
    with without_autocast(e.device.type):
        grad_e, grad_c, grad_bias = linear_cross_entropy_backward(
            grad_loss, grad_lse, e, c, targets, bias, weight, lse, kept_tiles, tile_lse, order, *ctx.options,
            need_grad_e, need_grad_c, ctx.settings,
        )
    return (grad_e if need_grad_e else None, grad_c if need_grad_c else None, None,
            grad_bias if bias is not None else None, None, None, None, None, None, None, None)


linear_cross_entropy_forward.register_autograd(_backward, setup_context=_setup_context)
linear_cross_entropy_backward.register_autograd(no_double_backward("linear_cross_entropy"))


@torch.library.custom_op("cce::linear_cross_entropy_fused", mutates_args=())
def linear_cross_entropy_fused(
    e: Tensor, c: Tensor, targets: Tensor, bias: Tensor | None, weight: Tensor | None, ignore_index: int,
    label_smoothing: float, softcap: float, z_loss: float, reduction: str, need_grad_e: bool, need_grad_c: bool,
    logit_scale: float = 1.0, settings: str = "",
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> (loss, grad_e, grad_c, grad_bias): the loss reduced ("mean" or "sum"; 0-d fp32),
    z-loss included, and its gradients (empty where not needed, grad_bias without a bias).
    `logit_scale` as in linear_cross_entropy_forward;
    `settings`: problem.traced_settings (the traced config and policy; without them the call
    resolves its own)."""
    with on_device_of(e):
        options = options_of(bias, weight, softcap, label_smoothing, 0.0, logit_scale)

        def launch(config: KernelConfig, policy: Policy) -> tuple[Tensor, Tensor, Tensor, Tensor]:
            plan = plan_launch(problem_of(e, c), options, config, policy)
            return run_fused(plan, config, e, c, targets, bias, weight, ignore_index, label_smoothing, softcap, z_loss,
                             reduction, need_grad_e, need_grad_c)

        return launch_with_config(e, c, False, settings, launch)


@linear_cross_entropy_fused.register_fake
def _fused_fake(e, c, targets, bias, weight, ignore_index, label_smoothing, softcap, z_loss, reduction, need_grad_e,
                need_grad_c, logit_scale=1.0, settings=""):
    return e.new_empty((), dtype=torch.float32), *fake_gradients(e, c, bias, need_grad_e, need_grad_c)


def _fused_setup_context(ctx, inputs, output) -> None:
    _, grad_e, grad_c, grad_bias = output
    ctx.mark_non_differentiable(grad_e, grad_c, grad_bias)
    # No zeros for the gradient outputs nobody differentiates: they would double the peak.
    ctx.set_materialize_grads(False)
    # Held as attributes, detached: saving outputs of this node for its own backward would make
    # a reference cycle through their grad_fn that frees them only at a garbage collection.
    ctx.gradients = (grad_e.detach(), grad_c.detach(), grad_bias.detach())


def _keep_graph() -> bool:
    """Whether this backward keeps the graph (retain_graph=True): then the gradients held for
    a later backward must not be scaled in place."""
    keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if keep_graph is None else keep_graph()


def scaled(gradient: Tensor, grad_loss: Tensor, traced: bool, in_place: bool) -> Tensor:
    """`gradient` times the loss's upstream gradient, in float32: rounded to bf16 first, a
    mean's 1/3 biased every entry by 0.18%. In place where nothing else will read the unscaled
    one; on the GPU in the kernel that skips the pass when the scale is 1."""
    if traced:
        return gradient * grad_loss  # a 0-dim float32 operand: Inductor computes in float32
    if not in_place:
        gradient = gradient.clone()
    if gradient.is_cuda and gradient.numel():
        scale_unless_one(KernelLauncher(scale_unless_one_kernel, True), gradient, grad_loss.to(torch.float32).reshape(1))
        return gradient
    return gradient.mul_(grad_loss.to(torch.float32))  # on CPU a 0-dim operand is applied in float32


def _fused_backward(ctx, grad_loss, _grad_e, _grad_c, _grad_bias):
    # torch.compile's AOTAutograd traces this with fake or functional tensors, compiled autograd's
    # Dynamo with the real ones (where is_fake and _keep_graph broke its graph): no kernel launch, no in-place.
    traced = torch.compiler.is_compiling() or (
        ctx.gradients is not None and any(is_fake(g) or type(g) is not Tensor for g in ctx.gradients))
    if torch.is_grad_enabled() and not traced:
        raise RuntimeError(
            "linear_cross_entropy computes its gradients in the forward (memory='workspace'), so it cannot record "
            "a backward graph (create_graph=True); memory='low' can, though with no double backward of its own")
    if ctx.gradients is None:
        raise RuntimeError("linear_cross_entropy: this graph was already backpropagated; pass retain_graph=True "
                           "to the first backward to run another")
    gradients = ctx.gradients
    if grad_loss is None:  # the loss itself reached nothing that is differentiated
        return (None,) * 14
    in_place = not traced and not _keep_graph()  # traced, the product is Inductor's to place
    if in_place:
        ctx.gradients = None  # handed to autograd, which may keep them as .grad without a copy
    # Traced, an empty gradient's product is empty too; no size test, which a data-dependent N cannot answer.
    grad_e, grad_c, grad_bias = (scaled(g, grad_loss, traced, in_place) if traced or g.numel() else g
                                 for g in gradients)
    need_grad_e, need_grad_c, need_grad_bias = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[3]
    return (grad_e if need_grad_e else None, grad_c if need_grad_c else None, None,
            grad_bias if need_grad_bias else None, None, None, None, None, None, None, None, None, None, None)


linear_cross_entropy_fused.register_autograd(_fused_backward, setup_context=_fused_setup_context)
