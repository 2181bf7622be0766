"""Filtered mode's correction for the tiles it skips (ops/filtering.SkippedTiles):
each skipped tile's d-logits are replaced by their row sums spread evenly over its columns,
which takes c summed by vocab tile, and dC's rows added to by vocab tile, both through the
vocab order."""

import triton
import triton.language as tl


@triton.jit
def tile_row_sums_kernel(
    c_ptr, order_ptr, out_ptr, V, D, stride_cv, stride_cd,
    TILE_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out[tile, d] = sum of c[order[p], d] over the tile's positions p (fp32). One program
    per (vocab tile, BLOCK_D columns)."""
    tile = tl.program_id(0)
    dims = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    positions = tile * TILE_N + tl.arange(0, TILE_N)
    live = positions < V
    rows = tl.load(order_ptr + positions, mask=live, other=0).to(tl.int64)
    values = tl.load(c_ptr + rows[:, None] * stride_cv + dims[None, :] * stride_cd,
                     mask=live[:, None] & (dims < D)[None, :], other=0.0)
    tl.store(out_ptr + tile.to(tl.int64) * D + dims, tl.sum(values.to(tl.float32), axis=0), mask=dims < D)


@triton.jit
def add_tile_rows_kernel(
    grad_c_ptr, order_ptr, per_tile_ptr, V, D, stride_gv, stride_gd,
    TILE_N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """grad_c[order[p], d] += per_tile[p // TILE_N, d] for every position p: one program per
    (BLOCK_P positions, BLOCK_D columns); the sum is taken in fp32. Each row is written by one
    program (order is a permutation), so the result does not depend on scheduling."""
    positions = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    dims = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    live = (positions < V)[:, None] & (dims < D)[None, :]
    rows = tl.load(order_ptr + positions, mask=positions < V, other=0).to(tl.int64)
    at = grad_c_ptr + rows[:, None] * stride_gv + dims[None, :] * stride_gd
    current = tl.load(at, mask=live, other=0.0)
    tiles = (positions // TILE_N).to(tl.int64)
    added = tl.load(per_tile_ptr + tiles[:, None] * D + dims[None, :], mask=live, other=0.0)
    tl.store(at, (current.to(tl.float32) + added).to(current.dtype), mask=live)
