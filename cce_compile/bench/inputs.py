"""Benchmark inputs whose softmax looks like a trained language model's.

Gradient filtering (skipping tiles whose softmax is below 2**-12) is only as good as the
data it meets: on plain random inputs the softmax is flat, every entry is about 1/V and
almost every tile is skipped, which flatters filtered kernels. `lm_like_inputs` builds
e and c so that the logits of row i are

    logit_ij = tau * z_ij + alpha * log p_j + [j = t_i] * b_i + sum_k [j = k_ik] * s_ik

with z_ij ~ N(0, 1) (the bulk), p a Zipf law over a random permutation of the vocabulary
(the unigram prior; targets t_i are drawn from p too), a few strong competitors k_ik drawn
from p, and a target boost b_i whose mean is calibrated so the mean loss is `target_loss`.
What it aims for, at vocabulary sizes of 100k and more and hidden sizes of about 1000 and
more (see `softmax_stats`; at small D the boosts' cross-talk widens the bulk):
- mean loss about 3 nats, median lower (the per-token loss is skewed like an LM's);
- about 0.02-0.1% of softmax entries above 2**-12 (a few tens per row), mostly on the
  frequent tokens; at small V the same few tens per row are a larger fraction;
- the entries above 2**-12 are spread over many 128x128 tiles unless the vocabulary is
  sorted by mean logit, which gathers the frequent tokens into few column blocks;
- the rows of c share a mean direction (half a row's own norm), as a trained head's do. The
  softmax never sees it (it shifts a row's logits alike), a gradient does: dE = sum_j p_ij
  c_j - c_target carries it times the softmax mass, so a filter that drops the tail's mass
  (10-20% of a row's) errs by that mass times the mean. Without it the tail's c_j cancel and
  such a filter looks 10-20 x more accurate than it is (Apple's filtered dE on the H200:
  ~1e-2 here without the mean, 1.0-1.3e-1 with it, 1.6-2.2e-1 on
  ../shared/reference/anchors-h200.md's inputs).

Everything is drawn from one generator seeded with `seed` on `device`, so a seed gives the
same inputs on the same device; no value is zero.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, TypedDict

import torch
from torch import Tensor

FILTER_EPS = 2.0**-12
"""The paper's threshold (bf16 eps / 32), Apple's default: the inputs' statistics count entries above it."""
TILE = 128
"""Side of the square tiles that `softmax_stats` counts."""

InputSet = tuple[Tensor, Tensor, Tensor]
"""(e, c, targets), as the op takes them."""
LM_LIKE_MIN_HIDDEN = 2
"""The LM-like model needs a direction beside the shared one: at D = 1 the classifier's own
parts (orthogonal to it) are zero, and dividing by their norms makes every input NaN."""

_ZIPF_EXPONENT = 1.05
_ZIPF_OFFSET = 2.7  # Zipf-Mandelbrot offset: the most frequent token has p ~ 0.1 at V ~ 1e5.
_PRIOR_WEIGHT = 0.7  # alpha: how much of log p the logits carry
_BULK_STD = 1.0  # tau: spread of the logits that neither prior nor context explains
_COMPETITORS = 4
_COMPETITOR_BOOST = 6.0
_BOOST_STD = 2.5  # per-row spread of target and competitor boosts: a skewed loss distribution
_MEAN_DIRECTION_NORM = 0.5  # |mean of c's rows| over a row's own norm (~1)
_CALIBRATION_ROWS = 256
_BISECTION_STEPS = 30


class SoftmaxStats(TypedDict):
    rows: int
    mean_loss: float
    median_loss: float
    frac_above_eps: float
    entries_above_eps_per_row: float
    tile_frac_above_eps: float
    tile_frac_above_eps_sorted: float


def _seeded(device: torch.device | str, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def uniform_inputs(
    n: int, d: int, v: int, dtype: torch.dtype, device: torch.device | str, seed: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Plain randn inputs (logits ~ N(0, 1), flat softmax): the case filtering finds easy."""
    gen = _seeded(device, seed)
    e = torch.randn(n, d, generator=gen, device=device)
    c = torch.randn(v, d, generator=gen, device=device) / math.sqrt(d)
    targets = torch.randint(0, v, (n,), generator=gen, device=device)
    return e.to(dtype), c.to(dtype), targets


def _without_component(x: Tensor, unit: Tensor) -> Tensor:
    return x - (x @ unit)[:, None] * unit


def _mean_loss(base: Tensor, target_dir_logits: Tensor, targets: Tensor, boosts: Tensor) -> float:
    logits = base + boosts[:, None] * target_dir_logits
    target_logits = logits.gather(1, targets[:, None])[:, 0]
    return (torch.logsumexp(logits, 1) - target_logits).mean().item()


def _calibrate_boost(base: Tensor, target_dir_logits: Tensor, targets: Tensor, spread: Tensor, target_loss: float) -> float:
    """Bisects the mean target boost b0 so the subsample's mean loss is `target_loss`.

    The logits are linear in the boost (base + (b0 + spread_i) * target_dir_logits) and the
    loss falls as the boost grows, so 30 halvings of a wide bracket pin it down.
    """
    low, high = -40.0, 80.0
    for _ in range(_BISECTION_STEPS):
        mid = (low + high) / 2
        if _mean_loss(base, target_dir_logits, targets, mid + spread) > target_loss:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def lm_like_inputs(
    n: int, d: int, v: int, dtype: torch.dtype, device: torch.device | str, seed: int, target_loss: float = 3.0,
    prior_weight: float = _PRIOR_WEIGHT,
) -> tuple[Tensor, Tensor, Tensor]:
    """(e, c, targets) with a Zipfian, peaked softmax; see the module docstring for the model
    (`prior_weight` is its alpha).

    Built in float32 on `device` and cast to `dtype` at the end. c_j = g_j + alpha log p_j /
    sqrt(D) u + m with g_j ~ N(0, I/D) orthogonal to a shared unit direction u and a shared
    mean m (norm 0.5); e_i = tau h_i + sqrt(D) u plus boosts along g_k / |g_k|^2, which raise
    logit k by the boost exactly (m adds e_i . m to all of row i's logits, which the softmax
    ignores). Only a 256-row subsample's logits are ever formed (for the calibration).
    """
    if d < LM_LIKE_MIN_HIDDEN:
        raise ValueError(f"LM-like inputs need a hidden size of {LM_LIKE_MIN_HIDDEN} at least, got {d}")
    gen = _seeded(device, seed)
    ranks = torch.arange(v, device=device, dtype=torch.float64)
    zipf = (ranks + _ZIPF_OFFSET) ** -_ZIPF_EXPONENT
    token_of_rank = torch.randperm(v, generator=gen, device=device)
    prob = torch.empty(v, device=device, dtype=torch.float64)
    prob[token_of_rank] = zipf / zipf.sum()
    log_prior = prior_weight * (prob.log() - prob.log().mean())

    unit = torch.randn(d, generator=gen, device=device)
    unit /= unit.norm()
    g = _without_component(torch.randn(v, d, generator=gen, device=device) / math.sqrt(d), unit)
    c = g + (log_prior.float() / math.sqrt(d))[:, None] * unit
    e = _without_component(_BULK_STD * torch.randn(n, d, generator=gen, device=device), unit) + math.sqrt(d) * unit

    targets = torch.multinomial(prob.float(), n, replacement=True, generator=gen)
    competitors = torch.multinomial(prob.float(), n * _COMPETITORS, replacement=True, generator=gen).view(n, -1)
    competitor_boost = _COMPETITOR_BOOST + _BOOST_STD * torch.randn(n, _COMPETITORS, generator=gen, device=device)
    g_norm2 = g.square().sum(1)
    for k in range(_COMPETITORS):
        e += competitor_boost[:, k : k + 1] * g[competitors[:, k]] / g_norm2[competitors[:, k], None]
    target_dir = g[targets] / g_norm2[targets, None]
    spread = _BOOST_STD * torch.randn(n, generator=gen, device=device)

    sub = min(n, _CALIBRATION_ROWS)
    base = e[:sub] @ c.T
    b0 = _calibrate_boost(base, target_dir[:sub] @ c.T, targets[:sub], spread[:sub], target_loss)
    e += (b0 + spread)[:, None] * target_dir
    mean_direction = torch.randn(d, generator=gen, device=device)
    c += _MEAN_DIRECTION_NORM / mean_direction.norm() * mean_direction
    return e.to(dtype), c.to(dtype), targets


HEAVY_TAIL_PRIOR_WEIGHT = 0.4


def heavy_tail_inputs(
    n: int, d: int, v: int, dtype: torch.dtype, device: torch.device | str, seed: int
) -> tuple[Tensor, Tensor, Tensor]:
    """lm_like_inputs with a weaker unigram prior (alpha 0.4 for 0.7), the same mean loss: the
    sorted vocabulary's tail, which filtering skips, holds ~27% of a row's softmax mass instead
    of ~11%, and ~0.013% of entries reach 2^-12. Dropping that tail errs ~1.9e-1 in dE (CPU, 256
    rows of Qwen2.5's head), as Apple's filter does on ../shared/reference/anchors-h200.md's
    inputs (1.6-2.2e-1) against 1.0-1.3e-1 on lm_like: the harder case for a filtered backward."""
    return lm_like_inputs(n, d, v, dtype, device, seed, prior_weight=HEAVY_TAIL_PRIOR_WEIGHT)


def _tile_fraction(above: Tensor) -> float:
    """Fraction of TILE x TILE tiles (edges padded with False) holding any True."""
    rows, cols = above.shape
    padded = torch.nn.functional.pad(above, (0, -cols % TILE, 0, -rows % TILE))
    tiles = padded.view(padded.shape[0] // TILE, TILE, padded.shape[1] // TILE, TILE)
    return tiles.any(3).any(1).float().mean().item()


@torch.no_grad()
def softmax_stats(e: Tensor, c: Tensor, targets: Tensor, rows: int = _CALIBRATION_ROWS) -> SoftmaxStats:
    """How LM-like the inputs are, on the first `rows` rows in float32.

    The sorted tile fraction orders the vocabulary by mean logit over the subsample (as
    vocabulary sorting in filtered kernels does); with only a few row blocks in the
    subsample it is a lower bound on what a full batch sees.
    """
    rows = min(rows, e.shape[0])
    logits = e[:rows].float() @ c.float().T
    lse = torch.logsumexp(logits, 1)
    loss = lse - logits.gather(1, targets[:rows, None])[:, 0]
    above = logits - lse[:, None] > math.log(FILTER_EPS)
    order = logits.mean(0).argsort(descending=True)
    return SoftmaxStats(
        rows=rows,
        mean_loss=loss.mean().item(),
        median_loss=loss.median().item(),
        frac_above_eps=above.float().mean().item(),
        entries_above_eps_per_row=above.sum(1).float().mean().item(),
        tile_frac_above_eps=_tile_fraction(above),
        tile_frac_above_eps_sorted=_tile_fraction(above[:, order]),
    )


def cycling(step: Callable[[Tensor, Tensor, Tensor], object], sets: list[InputSet]) -> Callable[[], None]:
    """A callable to time that runs `step` on the next input set at every call, so no
    timing rides on a warm L2 or on one draw of the data."""
    upcoming = itertools.cycle(sets)

    def call() -> None:
        step(*next(upcoming))

    return call
