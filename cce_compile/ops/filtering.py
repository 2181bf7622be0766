"""Filtered mode's bookkeeping in torch: the vocabulary order both passes walk, and which
d-logits tiles the backward computes at all.

The forward walks the vocabulary in `vocab_order` and records each row's largest logit per
vocab tile (`tile_max`); the backward keeps a tile when some row's softmax there reaches
filter_eps (tile_max - lse >= log eps) or a row's target falls in it, and never recomputes
the rest. The CPU path decides from the recomputed softmax, the same test.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.nn import functional as F

from .dispatch import cdiv


def vocab_order(e: Tensor, c: Tensor, bias: Tensor | None) -> Tensor:
    """The vocabulary sorted by mean logit over the batch (likely tokens first), so that the
    few tiles that matter cluster in the first vocab tiles. The mean logit of token j is
    mean(e) . c_j + b_j: one matrix-vector product, no logits."""
    mean_e = e.mean(dim=0, dtype=torch.float32).to(c.dtype)
    mean_logit = (c @ mean_e).float()  # never a float copy of c: it may be gigabytes
    if bias is not None:
        mean_logit = mean_logit + bias.float()
    return torch.argsort(mean_logit, descending=True, stable=True)


def kept_tile_mask(
    tile_max: Tensor, lse: Tensor, targets: Tensor, order: Tensor, filter_eps: float,
    forward_block_n: int, block_m: int, block_n: int,
) -> Tensor:
    """(ceil(N / block_m), ceil(V / block_n)) int8: 1 where the backward's d-logits tile
    (rows, positions in `order`) holds a softmax >= filter_eps or a target.

    tile_max is (N, ceil(V / forward_block_n)) in the same positions; tile widths are powers
    of two, so a backward tile spans whole forward tiles or lies inside one, which then
    decides for it (conservative: a kept forward tile keeps every backward tile inside it)."""
    n, v = tile_max.shape[0], order.shape[0]
    keep = (tile_max >= (lse[:, None] + math.log(filter_eps))).to(torch.int8)
    if forward_block_n > block_n:
        keep = keep.repeat_interleave(forward_block_n // block_n, dim=1)
    elif forward_block_n < block_n:
        ratio = block_n // forward_block_n
        keep = F.pad(keep, (0, (-keep.shape[1]) % ratio)).reshape(n, -1, ratio).amax(dim=2)
    keep = keep[:, : cdiv(v, block_n)].contiguous()
    # A target's -1 is never small: its tile stays whatever its softmax.
    position = torch.empty_like(order).scatter_(0, order, torch.arange(v, device=order.device))
    valid = (targets >= 0) & (targets < v)
    target_tile = torch.where(valid, position[targets.clamp(0, v - 1)] // block_n, 0)[:, None]
    keep.scatter_(1, target_tile, torch.maximum(keep.gather(1, target_tile), valid[:, None].to(torch.int8)))
    keep = F.pad(keep, (0, 0, 0, (-n) % block_m))
    return keep.reshape(-1, block_m, keep.shape[1]).amax(dim=1)


def kept_tile_lists(
    tile_mask: Tensor, n_chunks: int, chunk_tile_rows, n_slabs: int, slab_tiles: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The block-sparse GEMMs' work lists for every (token chunk, vocab slab), built at once
    (a kernel launch per slab cost more host time than the GPU work in narrow-D models).

    -> row_lists (n_chunks * chunk_tile_rows, n_slabs, slab_tiles): a tile row's kept tile
    columns within the slab, in order, the first row_counts[row, slab] of them valid;
    col_lists (n_chunks, n_slabs, slab_tiles, chunk_tile_rows): a tile column's kept tile
    rows within the chunk, in order, the first col_counts[chunk, slab, column] valid.
    All int32; tiles past the mask count as dropped."""
    rows, cols = tile_mask.shape
    mask = F.pad(tile_mask, (0, n_slabs * slab_tiles - cols, 0, n_chunks * chunk_tile_rows - rows))
    # A stable descending sort of 0/1 puts the kept positions first, in order.
    by_row = mask.reshape(n_chunks * chunk_tile_rows, n_slabs, slab_tiles)
    row_lists = torch.argsort(by_row, dim=2, descending=True, stable=True).to(torch.int32)
    row_counts = by_row.sum(dim=2, dtype=torch.int32)
    by_col = mask.reshape(n_chunks, chunk_tile_rows, n_slabs, slab_tiles).permute(0, 2, 3, 1)
    col_lists = torch.argsort(by_col, dim=3, descending=True, stable=True).to(torch.int32)
    col_counts = by_col.sum(dim=3, dtype=torch.int32)
    return row_lists, row_counts, col_lists.contiguous(), col_counts
