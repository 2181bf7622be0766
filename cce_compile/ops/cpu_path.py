"""The plain-PyTorch path (CPU, and tracing on CPU): the same algorithm as the kernels,
chunked over the vocabulary in fp32 so the (N, V) logits never exist at once."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from ..config.keys import n_bucket
from .filtering import (
    Tilt, dense_is_faster, flat_rows, kept_tile_mask, mass_sample_rows, tile_widths, tilt_sample_size,
)


class RowStats(NamedTuple):
    """Every row's statistics from a forward, fp32 (N,); those not asked for are None."""

    lse: Tensor
    target_logit: Tensor
    weighted_sum: Tensor | None = None  # sum_j w_j l_j (label smoothing's)
    entropy: Tensor | None = None  # -sum_j p_j log p_j, summed about the row's max
    lse_minus_mean: Tensor | None = None  # lse, as stored, less sum_j p_j l_j: the entropy's backward's (lse_minus_mean)


def scale_and_cap(logits: Tensor, logit_scale: float, softcap: float) -> Tensor:
    """What kernels/tiles.finish_logits does after the bias: the logit scale, then the soft-cap
    (`softcap` in scaled units)."""
    if logit_scale != 1.0:
        logits = logits * logit_scale
    if softcap > 0.0:
        logits = softcap * torch.tanh(logits / softcap)
    return logits


def _logits(e32: Tensor, c: Tensor, bias: Tensor | None, ids: slice | Tensor, softcap: float,
            logit_scale: float) -> Tensor:
    """As kernels/tiles.finish_logits: the bias, the logit scale, then the soft-cap."""
    logits = e32 @ c[ids].to(torch.float32).T
    if bias is not None:
        logits = logits + bias[ids].to(torch.float32)
    return scale_and_cap(logits, logit_scale, softcap)


def rebased_gap_sum(gap_sum: Tensor, sumexp: Tensor, old_max: Tensor, shift: Tensor, rescale: Tensor) -> Tensor:
    """sum_j exp(l_j - old_max) (old_max - l_j) rebased to sum_j exp(l_j - shift) (shift - l_j),
    `rescale` exp(old_max - shift); a sum of no columns (sumexp 0, old_max -inf) gives 0, not
    inf * 0."""
    return torch.where(sumexp > 0, rescale * (gap_sum + (shift - old_max) * sumexp), 0.0)


def entropy_about_max(sumexp: Tensor, strict_sum: Tensor, gap_sum: Tensor) -> Tensor:
    """-sum_j p_j log p_j from sums about the row's max m: sumexp = sum_j exp(l_j - m), its terms
    of the logits below m (`strict_sum`) and the gap sum sum_j exp(l_j - m) (m - l_j), as
    log(sumexp) + gap_sum / sumexp, two terms >= 0; the log is log1p(strict_sum) near 1, as
    kernels/tiles.log_sumexp_about_max takes it."""
    log_sumexp = torch.where(sumexp < 1.5, torch.log1p(strict_sum), torch.log(sumexp))
    return log_sumexp + gap_sum / sumexp


def lse_minus_mean(lse: Tensor, shift: Tensor, gap_sum: Tensor, sumexp: Tensor) -> Tensor:
    """Each row's stored lse less its mean logit sum_j p_j l_j, from sums about `shift` (its
    largest logit, or 0): sumexp = sum_j exp(l_j - shift) and the gap sum sum_j exp(l_j -
    shift) (shift - l_j), as kernels/forward.lse_minus_mean takes it."""
    return (lse - shift) + gap_sum / sumexp


def forward_cpu(
    e: Tensor, c: Tensor, targets: Tensor, bias: Tensor | None, weight: Tensor | None,
    softcap: float, need_weighted_sum: bool, chunk_v: int, need_entropy: bool = False, logit_scale: float = 1.0,
    need_lse_minus_mean: bool = False,
) -> RowStats:
    """The rows' statistics, those asked for. The entropy is summed about the running max m as
    the kernels sum it (kernels/forward.tile_entropy_sums, tiles.log_sumexp_about_max):
    log(sum_j exp(l_j - m)) + sum_j p_j (m - l_j), terms >= 0 that never cancel, where
    lse - sum_j p_j l_j is off by the logits' rounding; `need_lse_minus_mean` (with
    need_entropy) adds lse less the mean logit from the same sums."""
    n, v = e.shape[0], c.shape[0]
    e32 = e.to(torch.float32)
    row_max = e32.new_full((n,), float("-inf"))
    row_sumexp = e32.new_zeros((n,))
    target_logit = e32.new_zeros((n,))
    weighted_sum = e32.new_zeros((n,)) if need_weighted_sum else None
    gap_sum = e32.new_zeros((n,))  # sum_j exp(l_j - row_max) (row_max - l_j), rebased as row_max grows
    strict_sum = e32.new_zeros((n,))  # sum_j exp(l_j - row_max) over l_j < row_max
    for start in range(0, v, chunk_v):
        stop = min(start + chunk_v, v)
        logits = _logits(e32, c, bias, slice(start, stop), softcap, logit_scale)
        new_max = torch.maximum(row_max, logits.amax(dim=1))
        shift = torch.where(new_max == float("-inf"), 0.0, new_max)
        rescale = torch.exp(row_max - shift)
        exps = torch.exp(logits - shift[:, None])
        if need_entropy:  # p = 0 (a -inf logit, its gap clamped) counts 0; so does a gap before any column
            gaps = (shift[:, None] - logits).clamp_max(3.0e38)
            below = torch.where(gaps > 0, exps, 0.0)
            gap_sum = rebased_gap_sum(gap_sum, row_sumexp, row_max, shift, rescale) + (below * gaps).sum(dim=1)
            strict_sum = torch.where(new_max > row_max, rescale * row_sumexp, strict_sum) + below.sum(dim=1)
        row_sumexp = row_sumexp * rescale + exps.sum(dim=1)
        row_max = new_max
        local = targets - start
        hit = (local >= 0) & (local < stop - start)
        picked = logits.gather(1, local.clamp(0, stop - start - 1)[:, None]).squeeze(1)
        target_logit = target_logit + torch.where(hit, picked, 0.0)
        if weighted_sum is not None:
            w = weight[start:stop].to(torch.float32) if weight is not None else None
            weighted_sum = weighted_sum + (logits * w if w is not None else logits).sum(dim=1)
    lse = row_max + torch.log(row_sumexp)
    if not need_entropy:
        return RowStats(lse, target_logit, weighted_sum)
    shift = torch.where(row_max == float("-inf"), 0.0, row_max)
    return RowStats(lse, target_logit, weighted_sum, entropy_about_max(row_sumexp, strict_sum, gap_sum),
                    lse_minus_mean(lse, shift, gap_sum, row_sumexp) if need_lse_minus_mean else None)


def _tile_keep(distance: Tensor, block_m: int, block_n: int, row0: int, col0: int, eps: float) -> Tensor:
    """Per-element mask of the (block_m x block_n) tiles, aligned at (row0, col0) in the
    global grid, whose largest |softmax - onehot| reaches eps: the kernels' filter."""
    rows, cols = distance.shape
    pad_r = (-(rows + row0 % block_m)) % block_m
    pad_c = (-(cols + col0 % block_n)) % block_n
    padded = torch.nn.functional.pad(distance, (col0 % block_n, pad_c, row0 % block_m, pad_r))
    tiles = padded.reshape(padded.shape[0] // block_m, block_m, padded.shape[1] // block_n, block_n)
    keep = (tiles.amax(dim=(1, 3)) >= eps).repeat_interleave(block_m, 0).repeat_interleave(block_n, 1)
    return keep[row0 % block_m: row0 % block_m + rows, col0 % block_n: col0 % block_n + cols]


def _tile_row_maxima(x: Tensor, block_n: int) -> Tensor:
    """(rows, ceil(cols / block_n)): each row's largest entry in each block_n-column tile."""
    rows, cols = x.shape
    padded = torch.nn.functional.pad(x, (0, (-cols) % block_n), value=float("-inf"))
    return padded.reshape(rows, padded.shape[1] // block_n, block_n).amax(dim=2)


def _tile_row_means(x: Tensor, block_n: int) -> Tensor:
    """Each row's mean over each block_n-column tile (the last may be short), repeated over
    the tile's columns."""
    rows, cols = x.shape
    padded = torch.nn.functional.pad(x, (0, (-cols) % block_n))
    sums = padded.reshape(rows, padded.shape[1] // block_n, block_n).sum(dim=2)  # no -1: rows may be 0
    return (sums / tile_widths(cols, block_n, x.device)).repeat_interleave(block_n, dim=1)[:, :cols]


def backward_cpu(
    e: Tensor, c: Tensor, targets: Tensor, bias: Tensor | None, weight: Tensor | None, lse: Tensor,
    coef_softmax: Tensor, coef_target: Tensor, coef_smooth: Tensor | None,
    softcap: float, filter_eps: float, chunk_v: int, filter_tile: tuple[int, int], vocab_order: Tensor | None,
    forward_block_n: int = 128, need_grad_e: bool = True, need_grad_c: bool = True,
    coef_entropy: Tensor | None = None, tilt_tokens: int | None = None, logit_scale: float = 1.0,
    fp32_grad_c: bool = False,
    dense_fraction: float | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(dE, dC, dbias) in the inputs' dtypes, accumulated in fp32; a gradient not needed comes
    back empty, its GEMMs skipped. `fp32_grad_c`: dC and dbias stay fp32, for a caller that
    sums them over token chunks and rounds once (the fused forward's chunks). The
    coefficients are d loss / d (scaled logits) times `logit_scale` (ops/backward.py scales
    them): the chain rule's factor.

    With `vocab_order` (filtered mode), slabs and filter tiles run over the vocabulary in
    that order, as the kernels do, and the gradients land back at each token's own row. As in
    the kernels, a tile is skipped whole, `filter_tile` rows by the wider of its columns and
    the forward's tile (`forward_block_n`, whose statistics decide there); a skipped forward
    tile's d-logits are replaced by their row means over it, as the kernels' path puts their
    row sums back (ops/filtering.SkippedTiles), and dE gains their tilt (filtering.Tilt, from
    the skipped softmax mass per row and per forward tile); flat rows (filtering.flat_rows)
    keep every tile. `tilt_tokens` sizes the tilt's sample (tilt_sample_size) for that many
    tokens instead of the call's: a probe of a few rows, as a full batch's call has it. With
    `dense_fraction` (LaunchPlan.read_back_steps: the kernels' backward knows its kept tiles)
    the call runs exact where the kernels' would (filtering.dense_is_faster on
    kept_tile_mask's tiles)."""
    v = c.shape[0]
    e32 = e.to(torch.float32)
    if filter_eps > 0.0:  # one pass more over the logits: the forward tiles' maxima, as the kernels' forward keeps
        order = vocab_order if vocab_order is not None else torch.arange(v, device=e.device)
        step = max(chunk_v // forward_block_n, 1) * forward_block_n
        tile_max = torch.cat([
            _tile_row_maxima(_logits(e32, c, bias, order[start:start + step], softcap, logit_scale), forward_block_n)
            for start in range(0, v, step)
        ], dim=1)
        if dense_fraction is not None:
            kept = kept_tile_mask(tile_max, lse, targets, order, filter_eps, forward_block_n, *filter_tile)
            if dense_is_faster(int(kept.sum()), *kept.shape, dense_fraction):
                filter_eps = 0.0
    if filter_eps > 0.0:
        flat = flat_rows(tile_max.amax(dim=1) - lse >= math.log(filter_eps), (targets >= 0) & (targets < v))
        row_mass = e32.new_zeros((e.shape[0],))  # coef_softmax * softmax mass in skipped tiles
        tile_mass = e32.new_zeros((-(-v // forward_block_n),))  # |coef_softmax| * that, over the sample
        sample = mass_sample_rows(e.shape[0], e.device)
        keep_tile = (filter_tile[0], max(filter_tile[1], forward_block_n))
    grad_e = torch.zeros(e.shape if need_grad_e else (0,), dtype=torch.float32, device=e.device)
    grad_c = torch.empty(c.shape if need_grad_c else (0,), dtype=torch.float32, device=c.device)
    grad_bias = torch.empty((v,), dtype=torch.float32, device=c.device) if bias is not None else None
    for start in range(0, v, chunk_v):
        stop = min(start + chunk_v, v)
        if vocab_order is None:
            ids: slice | Tensor = slice(start, stop)
            vocab = torch.arange(start, stop, device=e.device)
        else:
            ids = vocab = vocab_order[start:stop]
        logits = _logits(e32, c, bias, ids, softcap, logit_scale)
        softmax = torch.exp(logits - lse[:, None])
        is_target = targets[:, None] == vocab[None, :]
        grad = coef_softmax[:, None] * softmax - torch.where(is_target, coef_target[:, None], 0.0)
        if coef_entropy is not None:
            grad = grad - coef_entropy[:, None] * torch.where(softmax > 0, softmax * (logits - lse[:, None]), 0.0)
        if coef_smooth is not None:
            w = weight[ids].to(torch.float32) if weight is not None else 1.0
            grad = grad - coef_smooth[:, None] * w
        # the soft-cap's slope; a skipped entry's tilt weight takes it squared (filtering.SkippedTiles)
        slope = 1.0 - (logits / softcap) ** 2 if softcap > 0.0 else None
        if slope is not None:
            grad = grad * slope
        if filter_eps > 0.0:
            distance = torch.where(is_target | flat[:, None], 1.0, softmax)
            skipped = ~_tile_keep(distance, *keep_tile, 0, start, filter_eps)
            grad = torch.where(skipped, _tile_row_means(torch.where(skipped, grad, 0.0), forward_block_n), grad)
            skipped_mass = torch.where(skipped, softmax, 0.0)
            leaning_mass = skipped_mass if slope is None else skipped_mass * slope**2
            row_mass += coef_softmax * leaning_mass.sum(dim=1)
            if coef_entropy is not None:  # the entropy's tilt (filtering.SkippedEntropy); p = 0 counts 0
                row_mass -= coef_entropy * torch.where(
                    skipped & (softmax > 0), leaning_mass * (logits - lse[:, None] + 1.0), 0.0).sum(dim=1)
            tile_of_column = torch.arange(start, stop, device=e.device) // forward_block_n
            tile_mass.index_add_(0, tile_of_column, coef_softmax[sample].abs() @ skipped_mass[sample])
        if need_grad_e:
            grad_e += grad @ c[ids].to(torch.float32)
        if need_grad_c:
            grad_c[ids] = grad.T @ e32
        if grad_bias is not None:
            grad_bias[ids] = grad.sum(dim=0)
    tokens = e.shape[0] if tilt_tokens is None else tilt_tokens
    sample_size = tilt_sample_size(n_bucket(tokens), v, e.shape[1]) if filter_eps > 0.0 else 0
    if sample_size and need_grad_e:
        order = vocab_order if vocab_order is not None else torch.arange(v, device=c.device)
        tilt = Tilt.estimate(c, bias, order, tile_mass, forward_block_n, sample_size, tensor_cores=False,
                             logit_scale=logit_scale)
        tilt_rows = tilt.rows()
        grad_e.addmm_(tilt.columns(e32, row_mass, out=e32.new_empty((e.shape[0], tilt_rows.shape[0]))), tilt_rows)
    return (
        grad_e.to(e.dtype),
        grad_c if fp32_grad_c else grad_c.to(c.dtype),
        grad_bias if fp32_grad_c or grad_bias is None or bias is None else grad_bias.to(bias.dtype),
    )
