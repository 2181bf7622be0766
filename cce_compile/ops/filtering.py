"""Filtered mode's bookkeeping: the vocabulary order both passes walk, and which
d-logits tiles the backward computes at all.

The forward walks the vocabulary in `vocab_order`, records each row's largest logit and
log-sum-exp per vocab tile (`tile_stats`) and, as it ends, decides the tiles the backward
keeps (backward_tile_stats): those where some row's softmax reaches filter_eps (tile_max -
lse >= log eps) or a row's target falls; the backward never recomputes the rest, and adds
back their row sums (SkippedTiles; linear_log_probs' entropy term from each tile's mean
logit, SkippedEntropy) and their tilt (Tilt). The CPU path
decides from the recomputed softmax, the same test. The backward's steps (filtered_steps) and its
kernels' work lists (step_lists) come from the kept tiles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np
import torch
import triton
from torch import Tensor
from torch.nn import functional as F

from ..kernels.step_lists import step_lists_kernel
from .problem import cdiv


def vocab_order(e: Tensor, c: Tensor, bias: Tensor | None) -> Tensor:
    """The vocabulary sorted by mean logit over the batch (likely tokens first), so that the
    few tiles that matter cluster in the first vocab tiles. The mean logit of token j is
    mean(e) . c_j + b_j: one matrix-vector product, no logits."""
    mean_e = e.mean(dim=0, dtype=torch.float32).to(c.dtype)
    mean_logit = (c @ mean_e).float()  # never a float copy of c: it may be gigabytes
    if bias is not None:
        mean_logit = mean_logit + bias.float()
    return torch.argsort(mean_logit, descending=True, stable=True)


def target_positions(order: Tensor, targets: Tensor) -> Tensor:
    """Each target's position in `order`; targets outside the vocabulary (ignore_index) stay
    as they are, outside it."""
    v = order.shape[0]
    position = torch.empty_like(order).scatter_(0, order, torch.arange(v, device=order.device))
    valid = (targets >= 0) & (targets < v)
    return torch.where(valid, position[targets.clamp(0, v - 1)], targets)


def in_vocab_order(
    order: Tensor, c: Tensor, bias: Tensor | None, weight: Tensor | None, targets: Tensor
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor]:
    """(c, bias, weight, targets) with the vocabulary permuted into `order`, for the
    persistent forward: the copy engine loads tiles of whole rows and cannot gather them
    through `order` (Hopper has no row gather), so c is copied once, in order. The copy is as
    large as dC and lives for the forward only, so it adds nothing to the backward's peak."""
    return (
        c.index_select(0, order),
        None if bias is None else bias.index_select(0, order),
        None if weight is None else weight.index_select(0, order),
        target_positions(order, targets),
    )


def kept_tile_mask(
    tile_max: Tensor, lse: Tensor, targets: Tensor, order: Tensor, filter_eps: float,
    forward_block_n: int, block_m: int, block_n: int,
) -> Tensor:
    """(ceil(N / block_m), ceil(V / block_n)) int8: 1 where the backward's d-logits tile
    (rows, positions in `order`) holds a softmax >= filter_eps or a target.

    tile_max is (N, ceil(V / forward_block_n)) in the same positions; tile widths are powers
    of two, so a backward tile spans whole forward tiles or lies inside one, which then
    decides for it, targets included (conservative: a kept forward tile keeps every backward
    tile inside it). So what the backward skips is always whole forward tiles, whose mass the
    forward measured (SkippedTiles). A flat row (flat_rows) keeps every tile."""
    n, v = tile_max.shape[0], order.shape[0]
    keep = tile_max >= (lse[:, None] + math.log(filter_eps))
    # A target's -1 is never small: its tile stays whatever its softmax. Ignored targets stay
    # outside the vocabulary in target_positions, the one place that decides which count.
    positions = target_positions(order, targets)
    valid = (positions >= 0) & (positions < v)
    keep = (keep | flat_rows(keep.any(dim=1), valid)[:, None]).to(torch.int8)
    target_tile = torch.where(valid, positions // forward_block_n, 0)[:, None]
    keep.scatter_(1, target_tile, torch.maximum(keep.gather(1, target_tile), valid[:, None].to(torch.int8)))
    if forward_block_n > block_n:
        keep = keep.repeat_interleave(forward_block_n // block_n, dim=1)
    elif forward_block_n < block_n:
        ratio = block_n // forward_block_n
        keep = F.pad(keep, (0, (-keep.shape[1]) % ratio)).reshape(n, -1, ratio).amax(dim=2)
    keep = keep[:, : cdiv(v, block_n)].contiguous()
    keep = F.pad(keep, (0, 0, 0, (-n) % block_m))
    return keep.reshape(-1, block_m, keep.shape[1]).amax(dim=1).contiguous()  # the fake says contiguous


class FilterStats(NamedTuple):
    """What filtered mode's backward filters with, made by the forward: kept_tiles (row blocks
    x backward tiles, int8), tile_lse (N, forward tiles, fp16, less lse), tile_mean_logit (the
    same for each tile's softmax-weighted mean logit: linear_log_probs' entropy; else empty),
    vocab_order (V,). All empty in exact mode; on the plain-PyTorch path all but vocab_order."""

    kept_tiles: Tensor
    tile_lse: Tensor
    tile_mean_logit: Tensor
    vocab_order: Tensor

    @staticmethod
    def empty(device: torch.device, vocab_order: Tensor | None = None) -> "FilterStats":
        """Exact mode's (all empty), or the plain-PyTorch path's filtered mode's (`vocab_order`
        alone): each tensor its own, since a custom op's outputs may not alias."""
        return FilterStats(
            torch.empty((0, 0), dtype=torch.int8, device=device), torch.empty((0, 0), dtype=torch.float16, device=device),
            torch.empty((0, 0), dtype=torch.float16, device=device),
            torch.empty((0,), dtype=torch.int64, device=device) if vocab_order is None else vocab_order,
        )


def backward_tile_stats(
    tile_stats: Tensor, lse: Tensor, targets: Tensor, order: Tensor, filter_eps: float,
    forward_block_n: int, block_m: int, block_n: int,
) -> FilterStats:
    """What the backward needs of the forward kernel's tile statistics (N, forward tiles fp32:
    tile maxima, tile log-sum-exps and, for the entropy, tile entropies, stacked), decided as
    the forward ends so that only these live until the backward. kept_tiles is
    kept_tile_mask's; tile_lse is each row's log-sum-exp per forward tile less its lse, in fp16
    (what SkippedTiles puts back is exp of it: off by under 1% where a tile holds 1e-7 of a
    row's mass or more): a quarter of the statistics' bytes, on Qwen2.5's 16384 x 151936 head
    39 MB instead of 156 (docs/notes/filtered-tile-statistics.md). tile_mean_logit, each tile's
    mean logit (its log-sum-exp less its entropy) less lse, is stored the same way, a tile of no
    mass (whose mean is NaN) and fp16's overflow made finite. The entropies' plane is
    overwritten with the mean logits: nothing reads it after, nor a fourth plane (the tiles'
    lse less their mean logit, merged into each row's by the forward already)."""
    kept = kept_tile_mask(tile_stats[0], lse, targets, order, filter_eps, forward_block_n, block_m, block_n)
    if tile_stats.shape[0] > 2:
        torch.sub(tile_stats[1], tile_stats[2], out=tile_stats[2])
    relative = [torch.empty(tile_stats.shape[1:], dtype=torch.float16, device=lse.device) for _ in tile_stats[1:3]]
    for plane, out in zip(tile_stats[1:3], relative):
        torch.sub(plane, lse[:, None], out=out)  # in fp32, stored in fp16: one pass
    tile_lse, *tile_mean_logit = relative
    if tile_mean_logit:
        return FilterStats(kept, tile_lse, tile_mean_logit[0].nan_to_num_(nan=0.0), order)
    return FilterStats(kept, tile_lse, tile_lse.new_empty((0, 0)), order)


def flat_rows(reaches_eps: Tensor, counted: Tensor) -> Tensor:
    """(N,) bool: the rows whose softmax reaches filter_eps nowhere (`reaches_eps` False) and
    whose loss counts. Such a row is flat (an untrained head's): all its mass lies in tiles the
    filter would skip, where putting back each tile's mean misses the softmax's spread inside
    it (dE 1.7e-2 from exact on N(0, 1) logits at V = 256000), so filtered
    mode computes all of its tiles. A trained head's rows reach eps at their target and a few
    likely tokens: none is flat (docs/notes/filtered-host-sync-flat-rows.md)."""
    return counted & ~reaches_eps


def tile_widths(length: int, width: int, device: torch.device) -> Tensor:
    """(ceil(length / width),) fp32: how many of `length` positions each `width`-wide tile
    holds (the last may hold fewer). Computed on the device: setting the last element from
    Python is a pageable host-to-device copy, which waits for the stream (in the filtered
    backward, for the whole forward kernel: ~1 ms of GPU idle on Qwen2.5)."""
    first_positions = torch.arange(cdiv(length, width), device=device, dtype=torch.float32) * width
    return (length - first_positions).clamp_max(width)


@dataclass(frozen=True)
class SkippedTiles:
    """The tiles filtered mode skips, by (row block, forward tile), and what it puts back.

    Skipped d-logits are small one by one but not in sum: a trained head's rows share a mean
    direction, which the softmax cancels and a gradient does not, so dropping the tail's mass
    (10-20% of a row's) biases dE by that mass times the mean (docs/notes/filtered-put-back.md). So
    each skipped tile keeps its rows' sums, spread evenly over its columns: dE[i] gains
    sum_T d[i, T] * (c summed over T), dC[j] gains sum_i d[i, T(j)] * e[i], dbias[j]
    sum_i d[i, T(j)]. A row's sum over a tile is coef_softmax * exp(tile_lse - lse) -
    coef_smooth * (weights over the tile), from the forward's tile log-sum-exps: no logits are
    recomputed. Under a soft-cap s each softmax sum is times the cap's slope 1 - (y / s)^2 at the
    tile's log-mean-exp capped logit y (where the cap saturates, a logit moves its softmax entry
    a fraction as much), and the tilt's weight times its square (`softcap_slopes`); label
    smoothing's share, spread over all the tile's columns, keeps a slope of 1. Built once per
    backward; `d_logits` per token chunk.
    """

    computed: Tensor  # (row blocks, forward tiles) bool: the backward computes the tile
    columns: Tensor  # (forward tiles,) fp32
    smoothing_weights: Tensor | None  # (forward tiles,) fp32: label smoothing's weights per tile
    block_m: int

    def d_logits(
        self, tile_lse: Tensor, coef_softmax: Tensor, coef_smooth: Tensor | None, first_row,
        entropy: "SkippedEntropy | None" = None, lse: Tensor | None = None, softcap: float = 0.0,
    ) -> tuple[Tensor, Tensor]:
        """(rows, forward tiles) fp32 for the rows from `first_row` (a multiple of block_m), from
        their tile log-sum-exps less lse (backward_tile_stats): the d-logit each column of a
        skipped tile stands in for, 0 where the tile is computed; and (rows,) the tilt's weight
        (Tilt): the rows' softmax mass in skipped tiles times coef_softmax, with `entropy` the
        SkippedEntropy's. With `softcap` (in the softmax's units), `lse` the rows' log-sum-exps."""
        rows = tile_lse.shape[0]
        first_block = first_row // self.block_m
        computed = self.computed[first_block:first_block + cdiv(rows, self.block_m)]
        computed = computed.repeat_interleave(self.block_m, dim=0)[:rows]
        slopes = self.softcap_slopes(tile_lse, lse, softcap) if softcap > 0.0 else None
        if entropy is None:
            sums = self._skipped_mass(tile_lse, coef_softmax, computed)
            row_mass = (sums if slopes is None else sums * slopes.square()).sum(dim=1)
        else:
            sums, row_mass = entropy.skipped_sums(tile_lse, coef_softmax, computed, slopes)
        if slopes is not None:
            sums.mul_(slopes)
        if coef_smooth is not None:  # spread evenly over the columns, not where the softmax sits: no slope
            sums.sub_((coef_smooth[:, None] * self.smoothing_weights).masked_fill_(computed, 0.0))
        return sums.div_(self.columns), row_mass

    def softcap_slopes(self, tile_lse: Tensor, lse: Tensor, softcap: float) -> Tensor:
        """(rows, tiles) fp32: the soft-cap's slope d y / d logit = 1 - (y / softcap)^2 at each
        tile's log-mean-exp capped logit y, the logit its softmax mass sits nearest (0 where a
        tile holds no mass)."""
        capped = (tile_lse.float() + lse[:, None]).sub_(self.columns.log()).div_(softcap)
        return capped.square_().neg_().add_(1.0).clamp_(min=0.0)

    def tile_mass(self, tile_lse: Tensor, coef_softmax: Tensor) -> Tensor:
        """(forward tiles,) fp32: |coef_softmax| times the softmax mass each tile skips, summed
        over mass_sample_rows: which tiles the tilt is estimated from."""
        picked = mass_sample_rows(tile_lse.shape[0], tile_lse.device)
        computed = self.computed[picked // self.block_m]
        return self._skipped_mass(tile_lse[picked], coef_softmax[picked].abs(), computed).sum(dim=0)

    @staticmethod
    def _skipped_mass(tile_lse: Tensor, coef: Tensor | None, computed: Tensor) -> Tensor:
        """(rows, tiles) fp32: coef (None: 1) times each row's softmax mass per forward tile, 0
        where `computed` (rows, tiles). In place: a chunk's (rows, tiles) fp32 is the put-back's
        largest temporary (the entropy's put-back holds two, SkippedEntropy)."""
        mass = tile_lse.float().exp_()
        return (mass if coef is None else mass.mul_(coef[:, None])).masked_fill_(computed, 0.0)


class SkippedEntropy(NamedTuple):
    """The entropy's term in a token chunk's skipped tiles (linear_log_probs): there d l_j =
    (coef_softmax - h (l_j - lse)) p_j, h the entropy's coefficient, so a skipped tile's row sum
    is its mass m_T times (coef_softmax - h (mu_T - lse)), mu_T the tile's softmax-weighted mean
    logit. Its tilt (Tilt), to first order with the tile's c rows Gaussian about their mean:
    sum_T m_T (coef_softmax - h (mu_T - lse + 1)) S e, the extra -h m_T S e being the covariance
    of the logit with c under the tile's softmax (docs/notes/filtered-log-probs.md)."""

    coef_entropy: Tensor  # (rows,) fp32: h
    tile_mean_logit: Tensor  # (rows, forward tiles) fp16: mu_T less lse (backward_tile_stats)

    def skipped_sums(self, tile_lse: Tensor, coef_softmax: Tensor, computed: Tensor,
                     softcap_slopes: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(rows, tiles) each skipped tile's d-logit row sum, 0 where computed; (rows,) the tilt's
        weight, each tile's times its soft-cap slope squared where given (SkippedTiles)."""
        h = self.coef_entropy[:, None]
        mass = SkippedTiles._skipped_mass(tile_lse, None, computed)
        coef = self.tile_mean_logit.float().mul_(-h).add_(coef_softmax[:, None])
        sums = coef.mul_(mass)
        lean = mass.mul_(-h).add_(sums)
        if softcap_slopes is not None:
            lean.mul_(softcap_slopes.square())
        return sums, lean.sum(dim=1)


def skipped_tiles(
    kept: Tensor, order: Tensor, weight: Tensor | None, smoothing: bool, forward_block_n: int, block_m: int,
    block_n: int,
) -> SkippedTiles:
    """From the backward's kept mask (kept_tile_mask: row blocks x backward tiles), by forward
    tile, whose log-sum-exps the forward recorded."""
    v = order.shape[0]
    tiles = cdiv(v, forward_block_n)
    if forward_block_n >= block_n:  # the backward tiles inside a forward tile share its fate
        kept_forward = kept[:, :: forward_block_n // block_n]
    else:
        kept_forward = kept.repeat_interleave(block_n // forward_block_n, dim=1)
    columns = tile_widths(v, forward_block_n, kept.device)
    smoothing_weights = None
    if smoothing:
        smoothing_weights = columns if weight is None else F.pad(
            weight.index_select(0, order).to(torch.float32), (0, tiles * forward_block_n - v)
        ).reshape(tiles, forward_block_n).sum(dim=1)
    return SkippedTiles(kept_forward[:, :tiles] != 0, columns, smoothing_weights, block_m)


TILT_ROWS_PER_D = 32
"""Rows of c (in whole tiles) that estimate the tilt's covariance, per hidden unit. The
estimate's noise is ~sqrt(D / rows) of the tilt: on LM-like heads (CPU probe, 256 rows of
16384 x 896 x 151936 and 8192 x 2304 x 256000) 4, 8, 16 and 32 x D rows cut filtered mode's dE
error 2.1, 3.0, 4.3 and 6.2 x; all of V, 10 x."""

TILT_MIN_ROWS_PER_D = 4
"""Fewer rows than this per hidden unit (where the cost bound allows no more) and the tilt is
left out: it would take off under half of what it corrects."""

TILT_COST = 0.03
"""The tilt's FLOPs at most, as a share of the logits GEMM's: rows x D^2 for the covariance
and N x D^2 to apply it, against N x V x D. Affordable where D is small against N and V
(Qwen2.5's and Gemma-2's heads), which is where the tilt is largest: there a unit of
skipped mass moves dE the most against its norm."""

TILT_FREE_FLOPS = 2**32
"""Under this many FLOPs (small problems, tests) the tilt takes every whole tile."""

TILT_MASS_ROWS = 1024
"""Token rows (evenly strided) whose skipped mass picks the tilt's tiles: the ranking needs no
more, and all N rows' would be an (N, tiles) pass more."""


def mass_sample_rows(n: int, device: torch.device) -> Tensor:
    """The token rows (of n) whose skipped mass picks the tilt's tiles (TILT_MASS_ROWS)."""
    return torch.arange(0, n, max(1, n // TILT_MASS_ROWS), device=device)


def tilt_sample_size(n: int, v: int, d: int) -> int:
    """How many of c's rows estimate the tilt (Tilt) for an N x D x V problem (N a bucket,
    so traced calls do not specialize on it); 0: no tilt."""
    if (v + n) * d * d <= TILT_FREE_FLOPS:
        return v
    rows = min(v, TILT_ROWS_PER_D * d, int(TILT_COST * n * v / d) - n)
    return rows if rows >= min(v, TILT_MIN_ROWS_PER_D * d) else 0


@dataclass(frozen=True)
class Tilt:
    """What putting back a skipped tile's mean misses: inside the tile a row's softmax leans
    to the columns it scores higher (p_ij ~ exp(e_i . c_j)), so sum_j p_ij c_j is not the
    tile's mass times c's mean over it. To first order (exactly, for Gaussian c rows) it is
    that plus the mass times S e_i, with S the covariance of the tile's c rows about their
    mean (and, with a bias, plus the mass times the covariance of c and bias, K), both times the
    logit scale k where p_ij ~ exp(k (e_i . c_j + b_j)) (a temperature). One S and K
    stand for every tile: averaged over the whole skipped tiles that hold the most mass. On
    LM-like heads this is most of filtered mode's dE error (6.6e-3 -> 0.7e-3 with S from all
    of V, 256 rows of Qwen2.5's head on CPU; 1.4e-2 -> 1.3e-3 with a weaker unigram prior,
    where the tail holds 27% of the mass; weighting the tiles by their mass changed nothing).
    dE gains m_i (S e_i + K), m_i being coef_softmax times row i's softmax mass in skipped
    tiles (with linear_log_probs' entropy, SkippedEntropy's weight): the put-back's GEMM takes
    m_i e_i (and m_i) as more columns (`columns`) against S (and K) as more rows (`rows`)."""

    covariance: Tensor  # (D, D) fp32: S
    bias_covariance: Tensor | None  # (D,) fp32: K

    @staticmethod
    def estimate(
        c: Tensor, bias: Tensor | None, order: Tensor, tile_mass: Tensor, width: int, sample_size: int,
        tensor_cores: bool, tile_sums: Tensor | None = None, logit_scale: float = 1.0,
    ) -> "Tilt":
        """S and K over the cdiv(sample_size, width) whole tiles (of `width` positions in `order`)
        with the largest `tile_mass`: one Gram matrix of their c rows (bf16 operands on the
        tensor cores, fp32 sums) less their means' (from `tile_sums`, c summed per tile in
        fp32, where the caller has them). The Gram matrix's entries are up to ~10^3 x S's (c's
        rows share a mean) and carry fp32's 2^-24: S keeps ~1e-4 of itself."""
        v, d = c.shape
        whole = tile_mass[: v // width]
        tiles = min(cdiv(sample_size, width), whole.shape[0])
        if tiles == 0:  # V under one tile: nothing to estimate from, and nothing tilts
            zero = c.new_zeros((d + 1, d), dtype=torch.float32)
            return Tilt(zero[:d], None if bias is None else zero[d])
        top = torch.topk(whole, tiles).indices
        ids = order[top[:, None] * width + torch.arange(width, device=c.device)].reshape(-1)
        c_rows = c[ids].to(torch.bfloat16 if tensor_cores else torch.float32)  # (tiles * width, D)
        if tensor_cores:
            gram = torch.mm(c_rows.T, c_rows, out_dtype=torch.float32)
        else:
            gram = c_rows.T @ c_rows
        means = (tile_sums[top] / width if tile_sums is not None
                 else c_rows.view(tiles, width, d).mean(dim=1, dtype=torch.float32))
        covariance = (gram / (tiles * width) - means.T @ means / tiles) * logit_scale
        bias_covariance = None
        if bias is not None:
            bias_rows = bias.float()[ids]
            # A token a -inf bias rules out holds no mass to lean towards: it counts as bias 0.
            bias_rows = torch.where(torch.isfinite(bias_rows), bias_rows, 0.0)
            bias_means = bias_rows.view(tiles, width).mean(dim=1)
            bias_covariance = c_rows.float().T @ bias_rows / (tiles * width) - means.T @ bias_means / tiles
            bias_covariance = bias_covariance * logit_scale
        return Tilt(covariance, bias_covariance)

    def rows(self) -> Tensor:
        """(D or D + 1, D) fp32: S, and K where there is a bias."""
        if self.bias_covariance is None:
            return self.covariance
        return torch.cat([self.covariance, self.bias_covariance[None]])

    def columns(self, e_rows: Tensor, row_mass: Tensor, out: Tensor) -> Tensor:
        """`out` (rows, D or D + 1): m e, and m where there is a bias; against `rows()`."""
        d = e_rows.shape[1]
        torch.mul(e_rows, row_mass[:, None], out=out[:, :d])
        if self.bias_covariance is not None:
            out[:, d].copy_(row_mass)
        return out


@dataclass(frozen=True)
class StepLists:
    """Filtered mode's backward steps and the work lists of its three kernels.

    Per token chunk, the vocab tile columns fall into steps (contiguous column ranges); a
    step's kept d-logits tiles are stored compactly, in column-major order, in `capacity`
    slots of one scratch buffer. All int32, indexed [chunk, step, ...] except the per-column
    lists [chunk, tile column]; entries past a count are unread.

    step_tiles / step_counts: slot -> tile (column * chunk_tile_rows + row) for grad_logits.
    de_begin / de_count [chunk, step, row], de_slots / de_cols [chunk, step, entry]: the dE
    GEMM's K loop for a tile row (its kept tiles' slots and tile columns, by column).
    dc_begin / dc_count [chunk, column], dc_rows [chunk, step, slot]: the dC GEMM's K loop
    for a tile column (its slots are contiguous; the tile row of each slot).
    """

    step_tiles: Tensor
    step_counts: Tensor
    de_begin: Tensor
    de_count: Tensor
    de_slots: Tensor
    de_cols: Tensor
    dc_begin: Tensor
    dc_count: Tensor
    dc_rows: Tensor


def chunk_tile_mask(tile_mask: Tensor, n_chunks: int, chunk_tile_rows) -> Tensor:
    """(n_chunks, chunk_tile_rows, tile columns): the mask by token chunk; rows past it dropped."""
    rows, cols = tile_mask.shape
    mask = F.pad(tile_mask, (0, 0, 0, n_chunks * chunk_tile_rows - rows))
    return mask.reshape(n_chunks, chunk_tile_rows, cols)


@lru_cache(maxsize=None)
def side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for the read-back, made on first use."""
    return torch.cuda.Stream(device)


class HostCopy:
    """A CUDA tensor copied to pinned host memory on a side stream, from the point the current
    stream has reached when it is made: the current stream goes on with later work (the
    backward's first step) while the host waits for this copy alone."""

    def __init__(self, values: Tensor) -> None:
        self.values = values
        self.done: torch.cuda.Event | None = None
        if values.is_cuda:
            stream = side_stream(values.device)
            stream.wait_stream(torch.cuda.current_stream(values.device))
            self.values = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            with torch.cuda.stream(stream):
                self.values.copy_(values, non_blocking=True)
                self.done = torch.cuda.Event()
                self.done.record(stream)
            values.record_stream(stream)  # not handed out again before the copy has read it

    def numpy(self) -> np.ndarray:
        if self.done is not None:
            self.done.synchronize()
        return self.values.numpy()


@dataclass(frozen=True)
class Steps:
    """How the filtered backward cuts each token chunk's tile columns into steps: packed,
    consecutive columns sharing a step while their kept tiles fit the slots.

    filtered_steps packs them on the device, where the work lists are built at once
    (step_lists). Read back (`unread`), on_host() gives the host each step's columns and
    kept tiles (the backward's one sync), so it launches each step at its size. Not read back
    (under a caller's CUDA graph capture, where no sync may run) the host knows only
    `n_steps`, the most packing can make, and launches that many, each able to run any step."""

    step_bounds: Tensor  # [chunk, >= n_steps + 1] int32: step s spans columns [bounds[s], bounds[s + 1]) (none past the chunk's last)
    n_steps: int  # steps per chunk in the lists: the most packing can make (chunks with fewer end in empty ones)
    columns: list[list[tuple[int, int]]] | None  # per chunk, each step's tile columns [first, end); None when only the GPU knows
    counts: list[list[int]] | None  # per chunk and step, its kept tiles; None when only the GPU knows
    unread: HostCopy | None = None  # to be read back, before on_host: [chunk, bounds | kept tiles per column]

    def on_host(self) -> "Steps":
        """The steps with their columns and kept tiles read back (a host sync), where they are to be."""
        if self.unread is None:
            return self
        read = self.unread.numpy()
        cols = (read.shape[1] - 1) // 2
        bounds, column_counts = read[:, : cols + 1], read[:, cols + 1:]
        chunk_steps = (bounds < cols).sum(axis=1)
        kept_before = np.pad(np.cumsum(column_counts, axis=1), ((0, 0), (1, 0)))
        columns = [list(zip(b[:n].tolist(), b[1:n + 1].tolist())) for b, n in zip(bounds, chunk_steps)]
        counts = [(kept[b[1:n + 1]] - kept[b[:n]]).tolist() for kept, b, n in zip(kept_before, bounds, chunk_steps)]
        return Steps(self.step_bounds, self.n_steps, columns, counts)

    def kept(self) -> int:
        """The kept tiles of every chunk and step (read back)."""
        return sum(sum(chunk) for chunk in self.counts)


def dense_is_faster(kept: int, tile_rows: int, tile_columns: int, dense_fraction: float) -> bool:
    """Whether more than dense_fraction of the tile_rows x tile_columns d-logits tiles are
    kept (kept_tile_mask's), where the dense backward beats the block-sparse one: filtered
    mode's backward then runs exact, on the kernels and on the plain-PyTorch path alike."""
    return kept > dense_fraction * tile_rows * tile_columns


def filtered_steps(mask: Tensor, capacity: int, read_back: bool) -> Steps:
    """Packed steps: consecutive columns share a step while their kept tiles fit `capacity`
    slots, so where most tiles are dropped (the vocabulary's tail) a step spans many columns.
    They are found on the device, queued behind the forward's kernel (still running), and,
    with `read_back`, copied to the host on a side stream (HostCopy): the host learns them at
    Steps.on_host, the backward's one sync, which waits for that copy alone, not for the work
    queued after it. Their lists are sized for the most steps packing can make."""
    n_chunks, rows, cols = mask.shape
    column_counts = mask.sum(dim=1, dtype=torch.int32)  # [chunk, column]
    per_step = capacity + 1 - column_counts.amax().clamp_min(1)  # so no column straddles two steps
    step_of_column = (torch.cumsum(column_counts, dim=1) - column_counts) // per_step
    # Step numbers jump where a column is fuller than the room left in its step: renumber
    # them 0, 1, ... and find each step's first column (past the last step: `cols`).
    new_step = F.pad(step_of_column[:, 1:] != step_of_column[:, :-1], (1, 0), value=True)
    step_of_column = torch.cumsum(new_step, dim=1) - 1
    bounds = torch.searchsorted(step_of_column, torch.arange(cols + 1, device=mask.device).repeat(n_chunks, 1),
                                out_int32=True)
    # Steps are the distinct values of (kept tiles before a column) // per_step, at most one
    # per column; per_step >= capacity + 1 - rows.
    most_steps = min(cols, rows * cols // (capacity + 1 - rows) + 1)
    unread = HostCopy(torch.cat([bounds, column_counts], dim=1)) if read_back else None
    return Steps(bounds[:, : most_steps + 1], most_steps, None, None, unread)


def step_lists(mask: Tensor, steps: Steps, capacity: int) -> StepLists:
    """The work lists for `mask` (chunk_tile_mask) cut into `steps` (capacity slots each),
    in one launch of step_lists_kernel: one list builder for eager and traced calls. Packed
    steps' lists are built before the backward's host sync, so none of their work sits
    between the sync and the first step (a torch build of the same lists was ~120 small
    operations there, which the GPU waited for)."""
    n_chunks, rows, cols = mask.shape
    n_steps = steps.n_steps
    shapes = {
        "step_tiles": (n_chunks, n_steps, capacity), "step_counts": (n_chunks, n_steps),
        "de_begin": (n_chunks, n_steps, rows), "de_count": (n_chunks, n_steps, rows),
        "de_slots": (n_chunks, n_steps, capacity), "de_cols": (n_chunks, n_steps, capacity),
        "dc_begin": (n_chunks, cols), "dc_count": (n_chunks, cols), "dc_rows": (n_chunks, n_steps, capacity),
    }
    lists = StepLists(**{name: mask.new_empty(shape, dtype=torch.int32) for name, shape in shapes.items()})
    block_rows = triton.next_power_of_2(rows)
    step_lists_kernel[(n_chunks * n_steps,)](
        mask, steps.step_bounds, steps.step_bounds.stride(0), lists.step_tiles, lists.step_counts,
        lists.de_begin, lists.de_count, lists.de_slots, lists.de_cols, lists.dc_begin, lists.dc_count, lists.dc_rows,
        n_steps, rows, cols, capacity, BLOCK_C=max(4096 // block_rows, 1), BLOCK_R=block_rows, num_warps=4,
    )
    return lists
