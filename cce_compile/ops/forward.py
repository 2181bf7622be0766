"""The forward op: per-token loss and lse, registered as a torch.library triton_op."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.library import triton_op, wrap_triton
from triton.tools.tensor_descriptor import TensorDescriptor

from ..config.kernel_config import TileConfig
from ..kernels.forward import lse_forward_kernel, lse_forward_tma_kernel, merge_tile_lse_kernel
from ..kernels.warp_specialized import lse_forward_ws_kernel
from .cpu_path import forward_cpu
from .dispatch import cdiv, config_for, device_limits, kernel_flags, relaunches_directly, tensor_descriptors_fit, use_triton
from .filtering import backward_tile_stats, in_vocab_order, vocab_order
from .launch import KernelLauncher
from .loss_terms import token_loss
from .warp_specialized import (
    PROGRAMS_PER_SM, WARP_SPECIALIZED_TILE, launch_options, operand_descriptors, plain_loss, programs_for, tiles_of,
    warp_specialized_fits,
)

WARP_SPECIALIZED_MAX_K_STEPS = 16
"""The plain exact forward runs lse_forward_ws_kernel where a tile's dot takes at most this
many K steps (D <= 1024): at D = 896 it took 1.14 x GEMM against lse_forward_tma_kernel's 1.21,
at D = 2304-8192 it lost (1.09-1.30 against 1.06-1.10), and at 1536 and 2048 too (32 steps,
alternated in one process, ab-h200-v21-forward-ws-mid-d.log: forward 14.0 -> 14.6 ms at
16384 x 1536 x 151936, 14.7 -> 16.2 ms at 16384 x 2048 x 128256, 7.2 -> 8.0 at N = 8192)."""

FORWARD_CHUNK_ROWS = 2048
"""The persistent forwards (tensor-descriptor and Gluon) launch once per this many rows of e (a
group of 16 row blocks, so each launch's programs sweep c together). One grid over all of N
lets its programs drift apart along their tiles, and the operands they hold at once then
outgrow L2: ncu on the H200 read 15.6 GB of DRAM for Llama-3's head at N = 8192 and 139.5 GB at
32768 (4 x the work). Back to back (benchmarks/results/probe-forward-chunks-h200.*), one grid
against 2048-row launches: Llama-3's head 1.08-1.09 -> 1.07 x GEMM at N = 8192 and 1.15 -> 1.07
at 32768, Qwen2.5's (Gluon) 1.14-1.15 -> 1.11, Gemma-2's 1.09 -> 1.08, D = 8192 1.06 -> 1.05;
4096 rows level with 2048, 1024 slower (1.09-1.13)."""


def row_chunks(n: int, chunk_rows: int) -> list[tuple[int, int]]:
    """(first row, rows) of each launch of a persistent forward over n rows."""
    return [(start, min(chunk_rows, n - start)) for start in range(0, n, chunk_rows)]


@triton_op("cce::linear_cross_entropy_forward", mutates_args=())
def linear_cross_entropy_forward(
    e: Tensor, c: Tensor, targets: Tensor, bias: Tensor | None, weight: Tensor | None,
    ignore_index: int, label_smoothing: float, softcap: float, filter_eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """e (N, D), c (V, D), targets (N,) -> (loss (N,), lse (N,), kept_tiles, tile_lse, vocab_order).

    loss and lse are fp32. `softcap` 0 means none. 16-bit inputs whose rows suit tensor
    descriptors run the persistent lse_forward_tma_kernel (on a Hopper GPU with D <= 1024 and
    no bias, soft-cap, weights, smoothing or filter, the warp-specialized lse_forward_ws_kernel),
    others lse_forward_kernel (vocab splits). With filter_eps > 0 (filtered mode) the forward also returns what the backward
    filters with (ops/filtering.py): the vocabulary order and, on the Triton path, the kept
    tiles and tile log-sum-exps that filtering.backward_tile_stats makes of the kernel's tile
    statistics (each row's largest logit and log-sum-exp per vocab tile of that order);
    otherwise all three are empty.
    """
    n, v = e.shape[0], c.shape[0]
    config = config_for(e, c, filter_eps)
    need_weighted_sum = label_smoothing > 0.0
    filtered = filter_eps > 0.0
    order = vocab_order(e, c, bias) if filtered else targets.new_empty((0,))
    tile = config.forward
    vocab_tiles = cdiv(v, tile.block_n)
    on_triton = use_triton(e)
    tile_stats = torch.empty((2, n, vocab_tiles) if filtered and on_triton else (0, 0), dtype=torch.float32,
                             device=e.device)
    plain = plain_loss(bias, weight, softcap, label_smoothing) and not filtered
    if plain and warp_specialized_fits(WARP_SPECIALIZED_MAX_K_STEPS, e, c):
        # The tile named, not defaulted: benchmarks/ab_switch.py switches it.
        lse_by_tile, target_logit = forward_warp_specialized(e, c, targets, WARP_SPECIALIZED_TILE)
        lse, weighted_sum = merge_tile_lse(lse_by_tile), None
    elif on_triton and tensor_descriptors_fit(e, c):
        # Filtered mode hands the kernel the vocabulary in vocab order (its tiles' maxima are
        # by position in it); the copy of c is freed when the forward returns.
        c_walk, bias_walk, weight_walk, targets_walk = (
            in_vocab_order(order, c, bias, weight, targets) if filtered else (c, bias, weight, targets)
        )
        # Filtered mode's kernel writes each tile's maximum and log-sum-exp into tile_stats only
        # (its tile-maxima buffer); other calls merge lse from the (vocab tiles, N) log-sum-exps.
        lse_by_tile = tile_stats if filtered else torch.empty((vocab_tiles, n), dtype=torch.float32, device=e.device)
        target_logit = torch.zeros(n, dtype=torch.float32, device=e.device)
        tile_weighted_sum = (
            torch.empty((vocab_tiles, n), dtype=torch.float32, device=e.device) if need_weighted_sum else lse_by_tile
        )
        sms = device_limits(e.device)[0]
        # An eager call's launch skips Triton's binding of its ~25 arguments where an earlier
        # call compiled the same kernel, as the backward's steps do.
        launch = KernelLauncher(lse_forward_tma_kernel, relaunches_directly(e))
        e_desc = TensorDescriptor.from_tensor(e, [tile.block_m, tile.block_k])
        c_desc = TensorDescriptor.from_tensor(c_walk, [tile.block_n, tile.block_k])
        for row_start, rows in row_chunks(n, FORWARD_CHUNK_ROWS):
            launch(
                (programs_for(e.device, tiles_of(rows, v, tile), 1),), e_desc, c_desc,
                bias_walk, targets_walk, weight_walk, lse_by_tile, target_logit, tile_weighted_sum,
                lse_by_tile, n, row_start, rows, v, e.shape[1], sms, softcap,
                HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap > 0.0, HAS_WEIGHT=weight is not None,
                NEED_WEIGHTED_SUM=need_weighted_sum, STORE_TILE_MAX=filtered, BLOCK_M=tile.block_m,
                BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
                num_warps=tile.num_warps, num_stages=tile.num_stages, **kernel_flags(e),
            )
        lse = merge_tile_lse(tile_stats[1].T if filtered else lse_by_tile)
        weighted_sum = tile_weighted_sum.sum(dim=0) if need_weighted_sum else None
        # Filtered mode's copies in vocab order (c's as large as dC) are freed before the
        # statistics below; the launcher holds them through the descriptor.
        del launch, c_desc, c_walk, bias_walk, weight_walk
    elif on_triton:
        tiles_per_split = cdiv(vocab_tiles, min(config.vocab_splits, vocab_tiles))
        num_splits = cdiv(vocab_tiles, tiles_per_split)
        partial = torch.empty((4 if need_weighted_sum else 3, num_splits, n), dtype=torch.float32, device=e.device)
        grid = (cdiv(n, tile.block_m) * num_splits,)
        wrap_triton(lse_forward_kernel)[grid](
            e, c, bias, targets, weight, order if filtered else targets,
            partial, tile_stats if filtered else partial,
            n, v, e.shape[1], tiles_per_split, num_splits, num_splits * n, vocab_tiles,
            e.stride(0), e.stride(1), c.stride(0), c.stride(1), softcap,
            HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap > 0.0, HAS_WEIGHT=weight is not None,
            NEED_WEIGHTED_SUM=need_weighted_sum, FILTER=filtered,
            BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
            EVEN_K=e.shape[1] % tile.block_k == 0,
            num_warps=tile.num_warps, num_stages=tile.num_stages, **kernel_flags(e),
        )
        split_max = partial[0].amax(dim=0)
        shift = torch.where(split_max == float("-inf"), 0.0, split_max)
        lse = shift + torch.log((partial[1] * torch.exp(partial[0] - shift)).sum(dim=0))
        target_logit = partial[2].sum(dim=0)
        weighted_sum = partial[3].sum(dim=0) if need_weighted_sum else None
    else:
        lse, target_logit, weighted_sum = forward_cpu(
            e, c, targets, bias, weight, softcap, need_weighted_sum, chunk_v=config.slab_v
        )
    loss = token_loss(lse, target_logit, weighted_sum, targets, weight, v, ignore_index, label_smoothing)
    if filtered and on_triton:
        kept_tiles, tile_lse = backward_tile_stats(
            tile_stats, lse, targets, order, filter_eps, tile.block_n, config.grad_logits.block_m,
            config.grad_logits.block_n,
        )
    else:
        kept_tiles = torch.empty((0, 0), dtype=torch.int8, device=e.device)
        tile_lse = torch.empty((0, 0), dtype=torch.float16, device=e.device)
    return loss, lse, kept_tiles, tile_lse, order


def merge_tile_lse(tile_lse: Tensor) -> Tensor:
    """Each row's log-sum-exp from its per-tile ones (tile_lse: (tiles, N), any strides), with
    no temporary the size of tile_lse. Launched directly: only the eager persistent forwards
    (tensor descriptors, Gluon) make per-tile log-sum-exps."""
    num_tiles, n = tile_lse.shape
    lse = torch.empty(n, dtype=torch.float32, device=tile_lse.device)
    block_rows = 64
    merge_tile_lse_kernel[(cdiv(n, block_rows),)](
        tile_lse, lse, n, num_tiles, tile_lse.stride(0), tile_lse.stride(1), BLOCK_ROWS=block_rows, BLOCK_TILES=32,
    )
    return lse


def forward_warp_specialized(
    e: Tensor, c: Tensor, targets: Tensor, tile: TileConfig = WARP_SPECIALIZED_TILE, per_sm: int = PROGRAMS_PER_SM,
) -> tuple[Tensor, Tensor]:
    """(tile_lse (vocab tiles, N), target_logit (N,)) from lse_forward_ws_kernel; the tile and
    programs per SM are the probe's knobs (benchmarks/probe_forward_ws.py)."""
    n, v = e.shape[0], c.shape[0]
    tile_lse = torch.empty((cdiv(v, tile.block_n), n), dtype=torch.float32, device=e.device)
    target_logit = torch.zeros(n, dtype=torch.float32, device=e.device)
    # Through the launcher, as the persistent forward: Triton's binding of the descriptors took
    # ~0.2 ms of host time a call on the H200 (the GPU idled for it in synced passes).
    launch = KernelLauncher(lse_forward_ws_kernel, True)
    descriptors = operand_descriptors(e, c, tile)
    for row_start, rows in row_chunks(n, FORWARD_CHUNK_ROWS):
        launch(
            (programs_for(e.device, tiles_of(rows, v, tile), per_sm),),
            *descriptors, targets, tile_lse, target_logit, n, row_start, rows, v, e.shape[1],
            GROUP_M=tile.group_m, STAGES=tile.num_stages, **launch_options(per_sm),
        )
    return tile_lse, target_logit
