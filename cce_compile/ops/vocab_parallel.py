"""The ops of the vocabulary-parallel loss (cce_compile/parallel/vocab_parallel.py): one rank's
classifier shard, its rows' statistics forward and their gradients backward.

`shard_row_stats` gives each row's log-sum-exp, target logit and (for label smoothing)
weighted logit sum over the shard's logits only; the caller combines the shards'. Its
backward takes the upstream gradients of those three statistics, which is all the loss needs:
d lse / d logit_j = p_j (the shard's softmax, from the shard's lse), d target_logit / d
logit_j = [j == y], d weighted_sum / d logit_j = w_j, so the d-logits are the backward
kernels' `coef_softmax * p - coef_target * [j == y] - coef_smooth * w` with coefficients
(grad_lse, -grad_target_logit, -grad_weighted_sum) and nothing the backward kernels do not
already do. Both are opaque to torch.compile, like the unsharded ops (ops/library.py).

With `grad_e_group` (a process group's name) the backward sums dE over that group with a
functional all-reduce, which AOTAutograd traces into the compiled backward.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from ..config.kernel_config import KernelConfig
from ..plan.launch import plan_launch
from ..plan.policy import Policy
from .backward import Coefficients, backward_from_coefficients
from .filtering import FilterStats
from .forward import row_stats
from .launch import on_device_of
from .library import fake_gradients, gradient_outputs
from .precision import without_autocast
from .problem import backward_settings, decode_settings, launch_with_config, options_of, problem_of

# the label smoothing the plans and runners are told of: they read only whether it is on
_SMOOTHING_ON = 1.0


@torch.library.custom_op("cce::shard_row_stats", mutates_args=())
def shard_row_stats(
    e: Tensor, c: Tensor, targets: Tensor, bias: Tensor | None, weight: Tensor | None, softcap: float,
    need_weighted_sum: bool, grad_e_group: str, config_v: int, logit_scale: float = 1.0, settings: str = "",
) -> tuple[Tensor, Tensor, Tensor]:
    """e (N, D), the shard c (V_shard, D), targets (N,) as shard-local ids (any id outside
    [0, V_shard) - a target in another shard, an ignored token - has target logit 0) ->
    (lse, target_logit, weighted_sum) over the shard, fp32 (N,); weighted_sum (sum_j w_j
    logit_j, w = weight or ones) is empty without need_weighted_sum. `grad_e_group`: see the
    module doc ("" for none). The kernel config is the one for vocabulary size `config_v`:
    shards differ in size, and one key for all of them has one rank resolve it for every rank
    (resolve/ladder._from_first_rank).
    `logit_scale`: as the unsharded forward op's.
    `settings`: problem.traced_settings (the traced config and policy; without them the call
    resolves its own)."""
    with on_device_of(e):
        options = options_of(bias, weight, softcap, _SMOOTHING_ON if need_weighted_sum else 0.0, 0.0, logit_scale)

        def launch(config: KernelConfig, policy: Policy) -> tuple[Tensor, Tensor, Tensor]:
            plan = plan_launch(problem_of(e, c), options, config, policy)
            none = targets.new_empty((0,))
            lse, target_logit, weighted_sum, *_ = row_stats(plan, config, e, c, targets, bias, weight, softcap,
                                                           need_weighted_sum, False, none,
                                                           none.new_empty((0, 0), dtype=torch.float32))
            return lse, target_logit, weighted_sum if weighted_sum is not None else lse.new_empty((0,))

        return launch_with_config(e, c, False, settings, launch, config_v)


@shard_row_stats.register_fake
def _row_stats_fake(e, c, targets, bias, weight, softcap, need_weighted_sum, grad_e_group, config_v, logit_scale=1.0,
                    settings=""):
    n = e.shape[0]
    return (e.new_empty((n,), dtype=torch.float32), e.new_empty((n,), dtype=torch.float32),
            e.new_empty((n,) if need_weighted_sum else (0,), dtype=torch.float32))


@torch.library.custom_op("cce::shard_row_stats_backward", mutates_args=())
def shard_row_stats_backward(
    grad_lse: Tensor, grad_target_logit: Tensor, grad_weighted_sum: Tensor, e: Tensor, c: Tensor, targets: Tensor,
    bias: Tensor | None, weight: Tensor | None, lse: Tensor, softcap: float, has_smoothing: bool, logit_scale: float,
    need_grad_e: bool, need_grad_c: bool, settings: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """-> (grad_e, grad_c, grad_bias) of the shard's statistics given their upstream
    gradients; grad_weighted_sum is read only with has_smoothing. As the unsharded backward
    op: a gradient not needed comes back empty, grad_bias is empty without a bias."""
    with on_device_of(e):
        kernel_config, launch_policy = decode_settings(settings)
        options = options_of(bias, weight, softcap, _SMOOTHING_ON if has_smoothing else 0.0, 0.0, logit_scale)
        plan = plan_launch(problem_of(e, c), options, kernel_config, launch_policy)
        coef_softmax = grad_lse.to(torch.float32).contiguous()
        coef_target = grad_target_logit.to(torch.float32).neg().contiguous()
        # without smoothing no runner reads coef_smooth: coef_target stands in for it
        coef_smooth = grad_weighted_sum.to(torch.float32).neg().contiguous() if has_smoothing else coef_target
        # A shard whose every logit of a row is -inf (a sampler's mask on its whole slice) has lse
        # -inf there and no share of the softmax: a finite stand-in keeps exp(l - lse) at 0, not NaN.
        lse = torch.where(torch.isneginf(lse), 0.0, lse)
        return gradient_outputs(c, *backward_from_coefficients(
            plan, kernel_config, Coefficients(coef_softmax, coef_target, coef_smooth), e, c, targets, bias, weight, lse,
            FilterStats.empty(e.device), 1.0 if has_smoothing else 0.0, softcap, 0.0, need_grad_e, need_grad_c,
        ))


@shard_row_stats_backward.register_fake
def _row_stats_backward_fake(grad_lse, grad_target_logit, grad_weighted_sum, e, c, targets, bias, weight, lse, softcap,
                             has_smoothing, logit_scale, need_grad_e, need_grad_c, settings):
    return fake_gradients(e, c, bias, need_grad_e, need_grad_c)


def _setup_context(ctx, inputs, output) -> None:
    e, c, targets, bias, weight, softcap, need_weighted_sum, grad_e_group, config_v, logit_scale, settings = inputs
    ctx.save_for_backward(e, c, targets, bias, weight if need_weighted_sum else None, output[0])
    ctx.options = (softcap, need_weighted_sum, grad_e_group, logit_scale)
    ctx.settings = backward_settings(settings, e, c, False, config_v)


def _backward(ctx, grad_lse, grad_target_logit, grad_weighted_sum):
    e, c, targets, bias, weight, lse = ctx.saved_tensors
    softcap, need_weighted_sum, grad_e_group, logit_scale = ctx.options
    grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse
    grad_target_logit = torch.zeros_like(lse) if grad_target_logit is None else grad_target_logit
    if not need_weighted_sum:
        grad_weighted_sum = lse.new_empty((0,))
    elif grad_weighted_sum is None:
        grad_weighted_sum = torch.zeros_like(lse)
    need_grad_e, need_grad_c = ctx.needs_input_grad[:2]
    with without_autocast(e.device.type):
        grad_e, grad_c, grad_bias = shard_row_stats_backward(
            grad_lse, grad_target_logit, grad_weighted_sum, e, c, targets, bias, weight, lse, softcap,
            need_weighted_sum, logit_scale, need_grad_e, need_grad_c, ctx.settings,
        )
    if need_grad_e and grad_e_group:
        grad_e = funcol.wait_tensor(funcol.all_reduce(grad_e, "sum", grad_e_group))
    return (grad_e if need_grad_e else None, grad_c if need_grad_c else None, None,
            grad_bias if bias is not None else None, None, None, None, None, None, None, None)


shard_row_stats.register_autograd(_backward, setup_context=_setup_context)
