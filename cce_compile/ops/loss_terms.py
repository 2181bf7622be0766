"""The per-token algebra shared by the Triton and the plain-PyTorch paths.

With l the (bias-added, soft-capped) logits, lse its log-sum-exp, y the target, w the class
weights (all ones without `weight`), W = sum(w) and eps the label smoothing, F.cross_entropy's
per-token loss is

    loss = (1 - eps) * w_y * (lse - l_y) + eps / V * (W * lse - sum_j w_j l_j)

and its gradient with respect to l_j, given upstream g (loss) and h (lse), is

    g * ((1 - eps) * w_y + eps * W / V) * p_j + h * p_j - g * (1 - eps) * w_y * [j == y]
    - g * eps / V * w_j,

i.e. `coef_softmax * p_j - coef_target * [j == y] - coef_smooth * w_j`.
Ignored tokens have loss 0 and take no gradient through it; their lse stays defined and
differentiable (h flows). A target outside [0, V) that is not ignore_index gives a NaN loss:
there is no host sync to raise from, and nothing is read at that index. Its upstream gradient
g is taken as NaN too (`upstream_gradient`), whatever it was, so that token's d-logits are
NaN, and with them its row of dE and all of dC and dbias (the fused forward, whose one scale
serves every row, makes every non-ignored row of dE NaN: forward_fused.gradient_scale): a
grad scaler reads the gradients, not the loss, and would otherwise apply a step computed as
if the token were not there.
"""

from __future__ import annotations

import torch
from torch import Tensor


def target_weight(targets: Tensor, weight: Tensor | None, valid: Tensor, v: int) -> Tensor:
    """Each token's weight in a mean: its target's class weight (1 without weights), 0 where not valid."""
    if weight is None:
        return valid.to(torch.float32)
    safe = targets.clamp(0, v - 1)
    return torch.where(valid, weight.to(torch.float32)[safe], 0.0)


def in_vocab(targets: Tensor, v: int) -> Tensor:
    """The tokens whose target indexes a class: in [0, V)."""
    return (targets >= 0) & (targets < v)


def out_of_range(targets: Tensor, v: int, ignore_index: int) -> Tensor:
    """The tokens whose target is neither ignore_index nor in [0, V): their loss is NaN."""
    return (targets != ignore_index) & ~in_vocab(targets, v)


def upstream_gradient(grad: Tensor, valid: Tensor, in_range: Tensor) -> Tensor:
    """A token's upstream gradient in fp32: 0 where ignored, NaN where its (valid) target is
    out of range, so its d-logits are NaN as its loss or log-prob is (the module doc); one
    select over N more than the 0 alone, no host sync."""
    return torch.where(valid, torch.where(in_range, grad.to(torch.float32), float("nan")), 0.0)


def _total_weight(weight: Tensor | None, v: int) -> Tensor | float:
    return float(v) if weight is None else weight.to(torch.float32).sum()


def token_loss(
    lse: Tensor, target_logit: Tensor, weighted_sum: Tensor | None, targets: Tensor,
    weight: Tensor | None, v: int, ignore_index: int, label_smoothing: float,
) -> Tensor:
    """Per-token loss (fp32) from the forward's row statistics."""
    valid = targets != ignore_index
    in_range = in_vocab(targets, v)
    w_y = target_weight(targets, weight, valid & in_range, v)
    return loss_of_terms(lse, target_logit, weighted_sum, valid, in_range, w_y, _total_weight(weight, v), v,
                         label_smoothing)


def loss_of_terms(
    lse: Tensor, target_logit: Tensor, weighted_sum: Tensor | None, valid: Tensor, in_range: Tensor,
    target_weight: Tensor, total_weight: Tensor | float, v: int, label_smoothing: float,
) -> Tensor:
    """The module doc's per-token loss from its terms: w_y (`target_weight`, 0 where not
    valid) and W (`total_weight`) given, so a caller holding the weights in shards (the
    vocabulary-parallel loss) combines them first. Differentiable in every tensor term."""
    loss = (1.0 - label_smoothing) * target_weight * (lse - target_logit)
    if label_smoothing > 0.0:
        assert weighted_sum is not None
        smooth = (total_weight * lse - weighted_sum) * (label_smoothing / v)
        loss = loss + torch.where(valid, smooth, 0.0)
    loss = torch.where(valid, loss, 0.0)
    # NaN by a factor, not a select: autograd through it (the vocabulary-parallel loss) takes
    # the NaN into that token's gradients too, where a select would give them 0. The factor in
    # the loss's own dtype: a select of two Python floats is in the default dtype, float64 under
    # torch.set_default_dtype(torch.float64), which made the loss float64 where the op's fake
    # function says float32, and a compiled graph read those float64 losses as float32.
    return loss * torch.where(valid & ~in_range, float("nan"), loss.new_ones(()))


def mean_scale(denominator: Tensor) -> Tensor:
    """1 / denominator, and 0 where it is 0: a mean over no weight (no valid token, or class
    weights of the targets that cancel) is 0, gradients too, where F.cross_entropy gives NaN."""
    nonzero = denominator != 0
    return torch.where(nonzero, 1.0 / torch.where(nonzero, denominator, 1.0), 0.0)


def reduce_token_loss(loss: Tensor, reduction: str, valid: Tensor, target_weight: Tensor | None) -> Tensor:
    """"none", "sum", or "mean": the sum over the valid tokens' weight (their count without
    class weights; `target_weight` 0 where not valid), as F.cross_entropy, whatever the
    weights' sign; 0 where that is 0 (mean_scale). A mean scales the tokens before summing
    them, so a mean that fits fp32 does not overflow in its sum."""
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    denominator = valid.sum().to(torch.float32) if target_weight is None else target_weight.sum()
    return (loss * mean_scale(denominator)).sum()


def z_loss_terms(lse: Tensor, z_loss: float, valid: Tensor) -> Tensor:
    """z_loss * lse**2 per valid token, 0 elsewhere, as (z_loss * lse) * lse: lse * lse
    overflows fp32 from |lse| ~ 1.8e19 (a temperature near its floor) where the term, with
    z_loss < 1, still fits. kernels/fused_rows.py orders it the same way."""
    return torch.where(valid, (z_loss * lse) * lse, 0.0)


def reduce_with_z_loss(loss: Tensor, lse: Tensor, z_loss: float, reduction: str, valid: Tensor,
                       target_weight: Tensor | None) -> Tensor:
    """The token losses reduced as reduce_token_loss, plus z_loss_terms reduced alike but
    unweighted: a mean's z term is over the valid tokens' count whatever the class weights,
    so scaling the weights leaves it (and the loss) unchanged."""
    reduced = reduce_token_loss(loss, reduction, valid, target_weight)
    if z_loss > 0.0:
        reduced = reduced + reduce_token_loss(z_loss_terms(lse, z_loss, valid), reduction, valid, None)
    return reduced


def grad_coefficients(
    grad_loss: Tensor, grad_lse: Tensor, targets: Tensor, weight: Tensor | None,
    v: int, ignore_index: int, label_smoothing: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """(coef_softmax, coef_target, coef_smooth) per token, fp32, as in the module doc."""
    valid = targets != ignore_index
    in_range = in_vocab(targets, v)
    g = upstream_gradient(grad_loss, valid, in_range)
    w_y = target_weight(targets, weight, valid & in_range, v)
    coef_target = g * (1.0 - label_smoothing) * w_y
    coef_smooth = g * (label_smoothing / v)
    coef_softmax = coef_target + coef_smooth * _total_weight(weight, v) + grad_lse.to(torch.float32)
    return coef_softmax.contiguous(), coef_target.contiguous(), coef_smooth.contiguous()


def log_prob_terms(
    lse: Tensor, target_logit: Tensor, row_entropy: Tensor | None, tokens: Tensor, v: int, ignore_index: int,
) -> tuple[Tensor, Tensor | None]:
    """linear_log_probs' outputs from the forward's row statistics, fp32 (N,): log p_y =
    l_y - lse and, with `row_entropy` (the forward's, summed about the row's max), the entropy.
    Both are 0 at ignored tokens; a token outside [0, V) that is not ignore_index has a NaN
    log-prob."""
    valid = tokens != ignore_index
    in_range = in_vocab(tokens, v)
    log_probs = torch.where(valid, target_logit - lse, 0.0)
    log_probs = torch.where(valid & ~in_range, float("nan"), log_probs)
    entropy = None if row_entropy is None else torch.where(valid, row_entropy, 0.0)
    return log_probs, entropy


def log_prob_coefficients(
    grad_log_probs: Tensor, grad_entropy: Tensor | None, lse_minus_mean: Tensor | None, tokens: Tensor, v: int,
    ignore_index: int,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(coef_softmax, coef_target, coef_entropy) of linear_log_probs' d-logits, fp32 (N,).

    With upstream g (log-prob) and h (entropy), mu = sum_j p_j l_j and K = lse - mu:
        d log p_y / d l_j = [j == y] - p_j,   d H / d l_j = -p_j * (l_j - mu) = -p_j * (l_j - lse) - p_j * K,
    so d l_j = -(g + h * K) * p_j + g * [j == y] - h * p_j * (l_j - lse): coef_softmax = -(g + h K),
    coef_target = -g, coef_entropy = h in the d-logits kernel's terms (kernels/backward.py). Written
    about lse, every term is bounded (p_j |l_j - lse| <= 1/e); about 0, a mean logit far above
    the spread (1 / T, a constant in the bias) would round g away in h * mu - g.
    `lse_minus_mean` is the forward's K for the lse it stored (kernels/forward.lse_minus_mean):
    the entropy H in its place is off by lse's rounding, as large as a near one-hot row's H.
    Ignored tokens take no gradient; a token outside [0, V) (NaN log-prob) takes g NaN
    (upstream_gradient), so its d-logits are NaN whatever the upstream gradients, the entropies'
    alone included."""
    valid = tokens != ignore_index
    g = upstream_gradient(grad_log_probs, valid, in_vocab(tokens, v))
    coef_target = (-g).contiguous()
    if grad_entropy is None:
        return coef_target, coef_target, None
    h = torch.where(valid, grad_entropy.to(torch.float32), 0.0)
    return (-(g + h * lse_minus_mean)).contiguous(), coef_target, h.contiguous()
