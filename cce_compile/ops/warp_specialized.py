"""When and how the Gluon logits kernels (kernels/warp_specialized.py) launch: exact mode's
plain forward and recompute where K is short, in eager calls on a Hopper GPU."""

from __future__ import annotations

import torch
from torch import Tensor
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

from ..config.kernel_config import TileConfig
from .dispatch import cdiv, device_limits, relaunches_directly, runs_wgmma, tensor_descriptors_fit

WARP_SPECIALIZED_TILE = TileConfig(block_m=128, block_n=128, block_k=64, group_m=16, num_warps=4, num_stages=3)
"""The Gluon kernels' tile, two programs per SM. On the H200, Qwen2.5's 16384 x 896 x 151936
forward (benchmarks/results/probe-forward-ws-h200*.json, two runs): 1.14-1.15 x GEMM against
1.17-1.18 with group_m 8 and 1.14 with 32, 1.20-1.23 at one program per SM with 4-6 stages,
1.59 on 64 x 128 tiles; lse_forward_tma_kernel 1.21 in the same runs."""

PROGRAMS_PER_SM = 2
"""Two programs of 5 warps (the consumer warpgroup and the producer warp) at 128 registers a
thread: the consumer takes what the producer's 24 leave (232)."""


def plain_loss(bias: Tensor | None, weight: Tensor | None, softcap: float, label_smoothing: float) -> bool:
    """Whether the loss is the one the Gluon kernels compute: no bias, class weights, soft-cap
    or label smoothing."""
    return bias is None and weight is None and softcap == 0.0 and label_smoothing == 0.0


def short_k(d: int, max_k_steps: int) -> bool:
    """Whether a tile's dot over hidden size d takes at most max_k_steps K steps of the Gluon
    tile (each op measured its own limit); the op and the tuner ask the same question."""
    return cdiv(d, WARP_SPECIALIZED_TILE.block_k) <= max_k_steps


def warp_specialized_fits(max_k_steps: int, *tensors: Tensor) -> bool:
    """Whether a Gluon kernel can take a call on these tensors (e first): an eager call on a
    Hopper GPU (the kernels are Gluon, with wgmma), tensors that suit tensor descriptors, a
    short K loop."""
    e = tensors[0]
    return (
        relaunches_directly(e) and runs_wgmma(e.device) and tensor_descriptors_fit(*tensors)
        and short_k(e.shape[1], max_k_steps)
    )


def gluon_descriptor(t: Tensor, block: list[int]) -> GluonDescriptor:
    """A Gluon tensor descriptor of 2-D 16-bit `t` in `block` blocks, in the shared-memory
    layout wgmma and the copy engine take."""
    element = gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16
    return GluonDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, element))


def operand_descriptors(e: Tensor, c: Tensor, tile: TileConfig) -> tuple[GluonDescriptor, GluonDescriptor]:
    """e's and c's descriptors in the tile's K steps."""
    return gluon_descriptor(e, [tile.block_m, tile.block_k]), gluon_descriptor(c, [tile.block_n, tile.block_k])


def programs_for(device: torch.device, tiles: int, per_sm: int = PROGRAMS_PER_SM) -> int:
    """A persistent launch's programs: per_sm on every SM, or one a tile where tiles are fewer."""
    return min(per_sm * device_limits(device)[0], tiles)


def launch_options(per_sm: int = PROGRAMS_PER_SM) -> dict[str, int]:
    """num_warps (the consumer warpgroup; the producer warp is a worker) and the register cap
    that lets per_sm programs share an SM."""
    return {"num_warps": 4, "maxnreg": 128 if per_sm == 2 else 168}


def tiles_of(rows: int, cols: int, tile: TileConfig = WARP_SPECIALIZED_TILE) -> int:
    return cdiv(rows, tile.block_m) * cdiv(cols, tile.block_n)
