"""linear_log_probs as torch.library sees it: per-token log-probabilities and, optionally,
entropies of softmax(e @ c.T + bias) (soft-capped), a forward and a backward op and the
autograd that joins them, opaque to torch.compile as the loss's ops are (ops/library.py).

The forward is the loss forward's kernels (ops/forward.row_and_filter_stats): one GEMM's work,
each row's log-sum-exp and target logit and, for entropy, the entropy itself, summed about the
row's largest logit so that no two large terms cancel (kernels/forward.tile_entropy_sums). The
backward is the loss's recompute backward (ops/backward.backward_from_coefficients) with
coefficients for arbitrary upstream gradients of both outputs (loss_terms.log_prob_coefficients),
the entropy's p_j * l_j term a flag of the d-logits kernel. With filter_eps > 0 both take the
loss's filtered mode (ops/filtering.py): the backward skips the tiles whose softmax stays under
it and puts back their sums, the entropy's from each tile's mean logit (SkippedEntropy).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from ..config.kernel_config import KernelConfig
from ..plan.launch import Options, plan_launch
from ..plan.policy import Policy
from .backward import Coefficients, backward_from_coefficients
from .filtering import FilterStats
from .forward import row_and_filter_stats
from .launch import on_device_of
from .library import fake_filter_stats, fake_gradients, gradient_outputs, kept_tiles_of, no_double_backward
from .loss_terms import log_prob_coefficients, log_prob_terms
from .precision import without_autocast
from .problem import backward_settings, launch_backward_with_config, launch_with_config, options_of, problem_of

LogProbOutputs = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


def _options(bias: Tensor | None, softcap: float, entropy: bool, filter_eps: float, logit_scale: float,
             entropy_backward: bool = False) -> Options:
    return replace(options_of(bias, None, softcap, 0.0, filter_eps, logit_scale), has_entropy=entropy,
                   entropy_backward=entropy_backward)


@torch.library.custom_op("cce::linear_log_probs_forward", mutates_args=())
def linear_log_probs_forward(
    e: Tensor, c: Tensor, tokens: Tensor, bias: Tensor | None, ignore_index: int, softcap: float, entropy: bool,
    entropy_backward: bool, filter_eps: float, logit_scale: float = 1.0, settings: str = "",
) -> LogProbOutputs:
    """e (N, D), c (V, D), tokens (N,) -> (log_probs, entropy, lse, lse_minus_mean, kept_tiles,
    tile_lse, tile_mean_logit, vocab_order): the first four fp32 (N,), entropy empty without
    `entropy`, lse_minus_mean (each row's lse less its mean logit, ignored tokens' too: what
    the entropy's backward reads, kernels/forward.lse_minus_mean) empty without
    `entropy_backward` (the entropy's backward will run; a no-grad pass skips its work); the
    last four what filtered mode's backward filters with (filtering.FilterStats, the kept tiles
    flat: library.kept_tiles_of; empty with `filter_eps` 0, exact mode). `softcap` 0 means none;
    `logit_scale` (1 / temperature) multiplies the logits before it (ops/library.py).
    `settings`: problem.traced_settings (the traced config and policy; without them the call
    resolves its own)."""
    with on_device_of(e):
        entropy_backward = entropy and entropy_backward
        options = _options(bias, softcap, entropy, filter_eps, logit_scale, entropy_backward)

        def launch(config: KernelConfig, policy: Policy) -> LogProbOutputs:
            plan = plan_launch(problem_of(e, c), options, config, policy)
            stats, filter_stats = row_and_filter_stats(
                plan, config, e, c, tokens, bias, None, softcap, False, entropy, filter_eps, entropy_backward)
            log_probs, entropies = log_prob_terms(stats.lse, stats.target_logit, stats.entropy, tokens, c.shape[0],
                                                  ignore_index)
            lse_minus_mean = stats.lse_minus_mean
            # empties where absent, two of them: a custom op's outputs may not alias
            kept_tiles, tile_lse, tile_mean_logit, order = filter_stats
            return (log_probs, stats.lse.new_empty((0,)) if entropies is None else entropies, stats.lse,
                    stats.lse.new_empty((0,)) if lse_minus_mean is None else lse_minus_mean,
                    kept_tiles.reshape(-1), tile_lse, tile_mean_logit, order)  # flat: library.kept_tiles_of

        return launch_with_config(e, c, filter_eps > 0.0, settings, launch)


@linear_log_probs_forward.register_fake
def _forward_fake(e, c, tokens, bias, ignore_index, softcap, entropy, entropy_backward, filter_eps, logit_scale=1.0,
                  settings="") -> LogProbOutputs:
    n = e.shape[0]
    return (e.new_empty((n,), dtype=torch.float32), e.new_empty((n,) if entropy else (0,), dtype=torch.float32),
            e.new_empty((n,), dtype=torch.float32),
            e.new_empty((n,) if entropy and entropy_backward else (0,), dtype=torch.float32),
            *fake_filter_stats(e, c, tokens, filter_eps, entropy, settings))


@torch.library.custom_op("cce::linear_log_probs_backward", mutates_args=())
def linear_log_probs_backward(
    grad_log_probs: Tensor, grad_entropy: Tensor | None, e: Tensor, c: Tensor, tokens: Tensor, bias: Tensor | None,
    lse: Tensor, lse_minus_mean: Tensor, kept_tiles: Tensor, tile_lse: Tensor, tile_mean_logit: Tensor,
    vocab_order: Tensor, ignore_index: int, softcap: float, filter_eps: float, logit_scale: float, need_grad_e: bool,
    need_grad_c: bool, settings: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """-> (grad_e, grad_c, grad_bias) for upstream gradients of the log-probs and (where not
    None) the entropies, with the forward's lse less the mean logit (read with grad_entropy
    only), filter statistics, config and policy (`settings`; problem.launch_backward_with_config
    says when it takes another). A gradient not needed comes back empty, grad_bias empty without
    a bias."""
    with on_device_of(e):
        entropy = grad_entropy is not None
        options = _options(bias, softcap, entropy, filter_eps, logit_scale)
        row_lse_minus_mean = lse_minus_mean if entropy else None
        coef_softmax, coef_target, coef_entropy = log_prob_coefficients(
            grad_log_probs, grad_entropy, row_lse_minus_mean, tokens, c.shape[0], ignore_index)
        coefficients = Coefficients(coef_softmax, coef_target, coef_target, coef_entropy, row_lse_minus_mean)

        def launch(config: KernelConfig, policy: Policy) -> tuple[Tensor, Tensor, Tensor]:
            plan = plan_launch(problem_of(e, c), options, config, policy)
            return gradient_outputs(c, *backward_from_coefficients(
                plan, config, coefficients, e, c, tokens, bias,
                None, lse, FilterStats(kept_tiles_of(kept_tiles, c, config), tile_lse, tile_mean_logit, vocab_order),
                0.0, softcap, filter_eps,
                need_grad_e, need_grad_c,
            ))

        return launch_backward_with_config(e, c, filter_eps > 0.0, settings, launch)


@linear_log_probs_backward.register_fake
def _backward_fake(grad_log_probs, grad_entropy, e, c, tokens, bias, lse, lse_minus_mean, kept_tiles, tile_lse,
                   tile_mean_logit, vocab_order, ignore_index, softcap, filter_eps, logit_scale, need_grad_e, need_grad_c,
                   settings):
    return fake_gradients(e, c, bias, need_grad_e, need_grad_c)


def _setup_context(ctx, inputs, output) -> None:
    e, c, tokens, bias, ignore_index, softcap, entropy, _, filter_eps, logit_scale, settings = inputs
    _, _, *kept = output  # lse, lse_minus_mean and the filter statistics
    ctx.save_for_backward(e, c, tokens, bias, *kept)
    ctx.mark_non_differentiable(*kept)
    ctx.options = (ignore_index, softcap, filter_eps, logit_scale)
    ctx.entropy = entropy
    ctx.settings = backward_settings(settings, e, c, filter_eps > 0.0)


def _backward(ctx, grad_log_probs, grad_entropy, *_grad_kept):
    e, c, tokens, bias, lse, lse_minus_mean, *filter_stats = ctx.saved_tensors
    grad_log_probs = torch.zeros_like(lse) if grad_log_probs is None else grad_log_probs
    if not ctx.entropy:
        grad_entropy = None  # no entropy term in the d-logits at all
    elif lse_minus_mean.numel() != lse.numel():
        raise RuntimeError("cce::linear_log_probs_forward ran with entropy_backward=False, so its backward lacks "
                           "each row's lse less its mean logit; pass True where autograd will run it")
    elif grad_entropy is None:
        grad_entropy = torch.zeros_like(lse)
    need_grad_e, need_grad_c = ctx.needs_input_grad[:2]
    with without_autocast(e.device.type):  # the op's fp32 math is its own
        grad_e, grad_c, grad_bias = linear_log_probs_backward(
            grad_log_probs, grad_entropy, e, c, tokens, bias, lse, lse_minus_mean, *filter_stats, *ctx.options,
            need_grad_e, need_grad_c, ctx.settings,
        )
    return (grad_e if need_grad_e else None, grad_c if need_grad_c else None, None,
            grad_bias if bias is not None else None, None, None, None, None, None, None, None)


linear_log_probs_forward.register_autograd(_backward, setup_context=_setup_context)
linear_log_probs_backward.register_autograd(no_double_backward("linear_log_probs"))
