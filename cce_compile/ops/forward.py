"""The forward's runners, one per plan.forward kernel: each gives every row's log-sum-exp and
target logit (for label smoothing its weighted logit sum, for linear_log_probs its entropy);
`run_forward` turns them into the per-token loss and, in filtered mode, what the
backward filters with."""

from __future__ import annotations

import torch
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from ..config.kernel_config import KernelConfig
from ..kernels.forward import lse_forward_kernel, lse_forward_tma_kernel, merge_tile_stats_kernel
from ..kernels.warp_specialized import lse_forward_ws_kernel
from ..plan.launch import LaunchPlan
from .cpu_path import RowStats, entropy_about_max, forward_cpu, lse_minus_mean, rebased_gap_sum
from .filtering import FilterStats, backward_tile_stats, in_vocab_order, vocab_order
from .gluon import launch_options, operand_descriptors, programs_for, tiles_of
from .launch import KernelLauncher
from .loss_terms import token_loss
from .problem import cdiv, device_limits, kernel_flags

def row_chunks(n: int, chunk_rows: int) -> list[tuple[int, int]]:
    """(first row, rows) of each launch of a persistent forward over n rows."""
    return [(start, min(chunk_rows, n - start)) for start in range(0, n, chunk_rows)]


def run_forward(
    plan: LaunchPlan, config: KernelConfig, e: Tensor, c: Tensor, targets: Tensor, bias: Tensor | None,
    weight: Tensor | None, ignore_index: int, label_smoothing: float, softcap: float, filter_eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (loss, lse, kept_tiles, tile_lse, vocab_order), as the forward op returns them."""
    stats, filter_stats = row_and_filter_stats(
        plan, config, e, c, targets, bias, weight, softcap, label_smoothing > 0.0, False, filter_eps)
    loss = token_loss(stats.lse, stats.target_logit, stats.weighted_sum, targets, weight, c.shape[0], ignore_index,
                      label_smoothing)
    return loss, stats.lse, filter_stats.kept_tiles, filter_stats.tile_lse, filter_stats.vocab_order


def row_and_filter_stats(
    plan: LaunchPlan, config: KernelConfig, e: Tensor, c: Tensor, targets: Tensor, bias: Tensor | None,
    weight: Tensor | None, softcap: float, need_weighted_sum: bool, need_entropy: bool, filter_eps: float,
    need_lse_minus_mean: bool = False,
) -> tuple[RowStats, FilterStats]:
    """row_stats and, in filtered mode, what the backward filters with: the vocabulary's
    order, and on the Triton path the tile statistics the kernel records walking it, turned
    into kept tiles (filtering.backward_tile_stats)."""
    n, v = e.shape[0], c.shape[0]
    order = vocab_order(e, c, bias) if plan.filtered else targets.new_empty((0,))
    on_triton = plan.forward != "cpu"
    # Filtered mode's tile maxima, log-sum-exps and (entropy) entropies, by position in `order`,
    # and (the tensor-descriptor forward) the tiles' lse less their mean logit.
    planes = 2 + need_entropy + (need_lse_minus_mean and plan.forward == "tma")
    tile_stats = torch.empty((planes, n, cdiv(v, config.forward.block_n)) if plan.filtered and on_triton else (0, 0),
                             dtype=torch.float32, device=e.device)
    stats = row_stats(plan, config, e, c, targets, bias, weight, softcap, need_weighted_sum, need_entropy, order,
                      tile_stats, need_lse_minus_mean)
    if plan.filtered and on_triton:
        return stats, backward_tile_stats(
            tile_stats, stats.lse, targets, order, filter_eps, config.forward.block_n, config.grad_logits.block_m,
            config.grad_logits.block_n,
        )
    return stats, FilterStats.empty(e.device, order if plan.filtered else None)


def row_stats(
    plan: LaunchPlan, config: KernelConfig, e: Tensor, c: Tensor, targets: Tensor, bias: Tensor | None,
    weight: Tensor | None, softcap: float, need_weighted_sum: bool, need_entropy: bool, order: Tensor,
    tile_stats: Tensor, need_lse_minus_mean: bool = False,
) -> RowStats:
    """Every row's statistics by the kernel plan.forward names, `need_lse_minus_mean` with
    need_entropy (the Gluon forward computes no weighted sum nor lse less the mean logit:
    plan_launch does not pick it for options that need them)."""
    if plan.forward == "gluon":
        return forward_gluon(plan, e, c, targets, need_entropy)
    if plan.forward == "tma":
        return forward_tma(plan, config, e, c, targets, bias, weight, softcap, need_weighted_sum, need_entropy,
                           order, tile_stats, need_lse_minus_mean)
    if plan.forward == "split":
        return forward_split(plan, config, e, c, targets, bias, weight, softcap, need_weighted_sum, need_entropy,
                             order, tile_stats, need_lse_minus_mean)
    return forward_cpu(e, c, targets, bias, weight, softcap, need_weighted_sum, chunk_v=config.slab_v,
                       need_entropy=need_entropy, logit_scale=plan.logit_scale, need_lse_minus_mean=need_lse_minus_mean)


def forward_gluon(plan: LaunchPlan, e: Tensor, c: Tensor, targets: Tensor, need_entropy: bool) -> RowStats:
    """lse_forward_ws_kernel per plan.forward_chunk_rows rows: each (vocab tile, row)'s
    log-sum-exp (and entropy), merged after."""
    n, v = e.shape[0], c.shape[0]
    tile, per_sm = plan.gluon_tile, plan.gluon_programs_per_sm
    tile_lse = torch.empty((cdiv(v, tile.block_n), n), dtype=torch.float32, device=e.device)
    tile_entropy = torch.empty_like(tile_lse) if need_entropy else tile_lse
    target_logit = torch.zeros(n, dtype=torch.float32, device=e.device)
    launch = KernelLauncher(lse_forward_ws_kernel, plan.direct_launch)
    descriptors = operand_descriptors(e, c, tile)
    for row_start, rows in row_chunks(n, plan.forward_chunk_rows):
        launch(
            (programs_for(e.device, tiles_of(rows, v, tile), per_sm),),
            *descriptors, targets, tile_lse, target_logit, tile_entropy, n, row_start, rows, v, e.shape[1],
            GROUP_M=tile.group_m, STAGES=tile.num_stages, NEED_ENTROPY=need_entropy,
            LOGIT_SCALE=plan.logit_scale, **launch_options(per_sm),
        )
    lse, entropy, _ = merge_tile_stats(tile_lse, tile_entropy if need_entropy else None)
    return RowStats(lse, target_logit, None, entropy)


def forward_tma(
    plan: LaunchPlan, config: KernelConfig, e: Tensor, c: Tensor, targets: Tensor, bias: Tensor | None,
    weight: Tensor | None, softcap: float, need_weighted_sum: bool, need_entropy: bool, order: Tensor,
    tile_stats: Tensor, need_lse_minus_mean: bool,
) -> RowStats:
    """lse_forward_tma_kernel, persistent on tensor descriptors, per plan.forward_chunk_rows
    rows: a grid over all of N lets its programs drift apart along their tiles until the
    operands they hold at once outgrow L2. Filtered mode walks the vocabulary in `order` (a
    copy of c, freed when this returns: the copy engine cannot gather rows) and writes each
    tile's maximum, log-sum-exp and (linear_log_probs) entropy and lse less its mean logit
    into tile_stats; other calls merge lse from per-tile ones (the entropy's two planes in
    one buffer, as merge_tile_stats reads them)."""
    n, v = e.shape[0], c.shape[0]
    tile = config.forward
    vocab_tiles = cdiv(v, tile.block_n)
    c_walk, bias_walk, weight_walk, targets_walk = (
        in_vocab_order(order, c, bias, weight, targets) if plan.filtered else (c, bias, weight, targets)
    )
    lse_by_tile = tile_stats if plan.filtered else torch.empty((vocab_tiles, n), dtype=torch.float32, device=e.device)
    target_logit = torch.zeros(n, dtype=torch.float32, device=e.device)
    tile_weighted_sum = (
        torch.empty((vocab_tiles, n), dtype=torch.float32, device=e.device) if need_weighted_sum else lse_by_tile
    )
    tile_entropy = lse_by_tile  # an unread stand-in without the entropy
    if need_entropy:
        tile_entropy = (tile_stats[2].T if plan.filtered
                        else torch.empty((1 + need_lse_minus_mean, vocab_tiles, n), dtype=torch.float32,
                                         device=e.device)[0])
    sms = device_limits(e.device)[0]
    launch = KernelLauncher(lse_forward_tma_kernel, plan.direct_launch)
    e_desc = TensorDescriptor.from_tensor(e, [tile.block_m, tile.block_k])
    c_desc = TensorDescriptor.from_tensor(c_walk, [tile.block_n, tile.block_k])
    for row_start, rows in row_chunks(n, plan.forward_chunk_rows):
        launch(
            (programs_for(e.device, tiles_of(rows, v, tile), 1),), e_desc, c_desc,
            bias_walk, targets_walk, weight_walk, lse_by_tile, target_logit, tile_weighted_sum,
            lse_by_tile, tile_entropy, n, row_start, rows, v, e.shape[1], sms, softcap,
            HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap > 0.0, LOGIT_SCALE=plan.logit_scale,
            HAS_WEIGHT=weight is not None,
            NEED_WEIGHTED_SUM=need_weighted_sum, NEED_ENTROPY=need_entropy, NEED_LSE_MINUS_MEAN=need_lse_minus_mean,
            STORE_TILE_MAX=plan.filtered,
            BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
            num_warps=tile.num_warps, num_stages=tile.num_stages, **kernel_flags(e),
        )
    tile_lse = tile_stats[1].T if plan.filtered else lse_by_tile
    lse, entropy, row_lse_minus_mean = merge_tile_stats(tile_lse, tile_entropy if need_entropy else None,
                                                        need_lse_minus_mean)
    weighted_sum = tile_weighted_sum.sum(dim=0) if need_weighted_sum else None
    return RowStats(lse, target_logit, weighted_sum, entropy, row_lse_minus_mean)


def forward_split(
    plan: LaunchPlan, config: KernelConfig, e: Tensor, c: Tensor, targets: Tensor, bias: Tensor | None, weight: Tensor | None,
    softcap: float, need_weighted_sum: bool, need_entropy: bool, order: Tensor, tile_stats: Tensor,
    need_lse_minus_mean: bool,
) -> RowStats:
    """lse_forward_kernel: row blocks x vocab splits of pointer loads, each split's running
    maximum and sum merged after (tensors the copy engine cannot take: fp32, odd strides), the
    entropy's sums too (split_entropy_sums), whence lse less the mean logit."""
    n, v = e.shape[0], c.shape[0]
    tile = config.forward
    filtered = plan.filtered
    vocab_tiles = cdiv(v, tile.block_n)
    tiles_per_split = cdiv(vocab_tiles, min(config.vocab_splits, vocab_tiles))
    num_splits = cdiv(vocab_tiles, tiles_per_split)
    stats = 3 + need_weighted_sum + 2 * need_entropy
    partial = torch.empty((stats, num_splits, n), dtype=torch.float32, device=e.device)
    lse_forward_kernel[(cdiv(n, tile.block_m) * num_splits,)](
        e, c, bias, targets, weight, order if filtered else targets,
        partial, tile_stats if filtered else partial,
        n, v, e.shape[1], tiles_per_split, num_splits, num_splits * n, vocab_tiles,
        e.stride(0), e.stride(1), c.stride(0), c.stride(1), softcap,
        HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap > 0.0, LOGIT_SCALE=plan.logit_scale,
        HAS_WEIGHT=weight is not None,
        NEED_WEIGHTED_SUM=need_weighted_sum, NEED_ENTROPY=need_entropy, FILTER=filtered,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
        EVEN_K=e.shape[1] % tile.block_k == 0,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **kernel_flags(e),
    )
    split_max = partial[0].amax(dim=0)
    shift = torch.where(split_max == float("-inf"), 0.0, split_max)
    rescale = torch.exp(partial[0] - shift)
    sumexp = (partial[1] * rescale).sum(dim=0)
    lse = shift + torch.log(sumexp)
    stats = RowStats(lse, partial[2].sum(dim=0), partial[3].sum(dim=0) if need_weighted_sum else None)
    if not need_entropy:
        return stats
    gap_sum, strict_sum = split_entropy_sums(partial[0], partial[1], partial[-2], partial[-1], split_max, shift,
                                             rescale)
    return stats._replace(
        entropy=entropy_about_max(sumexp, strict_sum, gap_sum),
        lse_minus_mean=lse_minus_mean(lse, shift, gap_sum, sumexp) if need_lse_minus_mean else None)


def split_entropy_sums(split_max: Tensor, split_sumexp: Tensor, split_gap_sum: Tensor, split_strict_sum: Tensor,
                       row_max: Tensor, shift: Tensor, rescale: Tensor) -> tuple[Tensor, Tensor]:
    """The rows' entropy sums (N,) about `shift` (the rows' largest logit `row_max`, 0 where it
    is -inf), the gap sum and the strict sum of cpu_path.entropy_about_max, from
    lse_forward_kernel's splits' (splits, N) maxima, sums of exp(logit - max), gap sums and
    strict sums (kernels/forward.tile_entropy_sums: about each split's max), each split's
    `rescale` exp(max - shift): rebased to the shift as the kernel rebases them
    (rebased_gap_sum; a split below the row's max counts all its sum as strict)."""
    gap_sum = rebased_gap_sum(split_gap_sum, split_sumexp, split_max, shift, rescale).sum(dim=0)
    strict_sum = torch.where(split_max < row_max, rescale * split_sumexp, split_strict_sum).sum(dim=0)
    return gap_sum, strict_sum


def merge_tile_stats(tile_lse: Tensor, tile_entropy: Tensor | None = None, need_lse_minus_mean: bool = False,
                     ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Each row's log-sum-exp from its per-tile ones (tile_lse: (tiles, N), any strides) and,
    given the tiles' entropies (tiles, N), the row's, and with `need_lse_minus_mean` its lse
    less its mean logit from the tiles' (tiles, N) that lie N * tiles past their entropies in
    memory (merge_tile_stats_kernel): one pass over them, no temporary of their size, no
    buffer changed (filtered mode's backward still reads its tile log-sum-exps). Each tensor
    returned is its own (N,) but the entropy, a view of the kernel's output."""
    num_tiles, n = tile_lse.shape
    lse = torch.empty(n, dtype=torch.float32, device=tile_lse.device)
    entropies, entropy = tile_lse, lse  # unread stand-ins without the entropy
    if tile_entropy is not None:
        entropies = tile_entropy
        entropy = torch.empty((1 + need_lse_minus_mean, n), dtype=torch.float32, device=tile_lse.device)
    block_rows = 64
    merge_tile_stats_kernel[(cdiv(n, block_rows),)](
        tile_lse, entropies, lse, entropy, n, num_tiles,
        tile_lse.stride(0), tile_lse.stride(1), entropies.stride(0), entropies.stride(1),
        NEED_ENTROPY=tile_entropy is not None, NEED_LSE_MINUS_MEAN=need_lse_minus_mean, BLOCK_ROWS=block_rows,
        BLOCK_TILES=32,
    )
    if tile_entropy is None:
        return lse, None, None
    # lse less the mean logit leaves as a tensor of its own: linear_log_probs_forward returns it,
    # and a view N floats into this buffer has a storage offset its fake's tensor has not
    return lse, entropy[0], entropy[1].clone() if need_lse_minus_mean else None
