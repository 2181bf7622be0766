"""A float64 reference for every option of linear_cross_entropy, built from F.cross_entropy."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def reference_loss(
    e: Tensor, c: Tensor, targets: Tensor, *, bias: Tensor | None = None, ignore_index: int = -100,
    reduction: str = "mean", weight: Tensor | None = None, label_smoothing: float = 0.0,
    z_loss: float = 0.0, softcap: float | None = None, shift: bool = False, return_lse: bool = False,
    temperature: float = 1.0,
) -> Tensor | tuple[Tensor, Tensor]:
    """Materializes the logits in float64: the ground truth, for small shapes only."""
    if shift:
        targets = torch.cat([targets[..., 1:], targets.new_full((*targets.shape[:-1], 1), ignore_index)], -1)
    lead = targets.shape
    logits = e.reshape(-1, e.shape[-1]).double() @ c.double().T
    if bias is not None:
        logits = logits + bias.double()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits / temperature
    flat = targets.reshape(-1)
    valid = flat != ignore_index
    w = weight.double() if weight is not None else None
    per_token = F.cross_entropy(logits, flat, w, ignore_index=ignore_index, reduction="none",
                                label_smoothing=label_smoothing)
    lse = torch.logsumexp(logits, dim=-1)
    z_terms = z_loss * torch.where(valid, lse**2, 0.0)
    if reduction == "none":
        loss = (per_token + z_terms).reshape(lead)
    elif reduction == "sum":
        loss = per_token.sum() + z_terms.sum()
    else:  # F.cross_entropy's weighted mean (0 where its weights sum to 0) and the z terms' plain mean
        count = valid.sum().double()
        denom = count if w is None else torch.where(valid, w[flat.clamp(0, c.shape[0] - 1)], 0.0).sum()
        mean = per_token.sum() / torch.where(denom != 0, denom, 1.0)
        loss = torch.where(denom != 0, mean, 0.0) + z_terms.sum() / count.clamp(min=1)
    return (loss, lse.reshape(lead)) if return_lse else loss


def reference_log_probs(
    e: Tensor, c: Tensor, tokens: Tensor, *, temperature: float = 1.0, entropy: bool = False,
    bias: Tensor | None = None, softcap: float | None = None, ignore_index: int = -100, shift: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """linear_log_probs on materialized float64 logits: log_softmax, gathered, and -sum p log p."""
    if shift:
        tokens = torch.cat([tokens[..., 1:], tokens.new_full((*tokens.shape[:-1], 1), ignore_index)], -1)
    logits = e.reshape(-1, e.shape[-1]).double() @ c.double().T
    if bias is not None:
        logits = logits + bias.double()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    log_softmax = torch.log_softmax(logits / temperature, dim=-1)
    flat = tokens.reshape(-1)
    valid = flat != ignore_index
    log_probs = torch.where(valid, log_softmax.gather(1, flat.clamp(0, c.shape[0] - 1)[:, None])[:, 0], 0.0)
    if not entropy:
        return log_probs.reshape(tokens.shape)
    # p log p is 0 at p = 0 (a -inf bias); the where keeps log p's -inf out of the product and its gradient
    entropies = torch.where(valid, -(log_softmax.exp() * torch.where(log_softmax > -torch.inf, log_softmax, 0.0)).sum(
        dim=-1), 0.0)
    return log_probs.reshape(tokens.shape), entropies.reshape(tokens.shape)
