"""How the Gluon logits kernels (kernels/warp_specialized.py) launch: descriptors in the
shared-memory layout wgmma takes, and per_sm persistent programs on every SM."""

from __future__ import annotations

import torch
from torch import Tensor
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

from ..config.kernel_config import TileConfig
from .problem import cdiv, device_limits


def gluon_descriptor(t: Tensor, block: list[int]) -> GluonDescriptor:
    """A Gluon tensor descriptor of 2-D 16-bit `t` in `block` blocks, in the shared-memory
    layout wgmma and the copy engine take."""
    element = gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16
    return GluonDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, element))


def operand_descriptors(e: Tensor, c: Tensor, tile: TileConfig) -> tuple[GluonDescriptor, GluonDescriptor]:
    """e's and c's descriptors in the tile's K steps."""
    return gluon_descriptor(e, [tile.block_m, tile.block_k]), gluon_descriptor(c, [tile.block_n, tile.block_k])


def programs_for(device: torch.device, tiles: int, per_sm: int) -> int:
    """A persistent launch's programs: per_sm on every SM, or one a tile where tiles are fewer."""
    return min(per_sm * device_limits(device)[0], tiles)


def launch_options(per_sm: int) -> dict[str, int]:
    """num_warps (the consumer warpgroup; the producer warp is a worker) and the register cap
    that lets per_sm programs share an SM: at two, the consumer takes what the producer's 24
    registers leave of 2 x 128."""
    return {"num_warps": 4, "maxnreg": 128 if per_sm == 2 else 168}


def tiles_of(rows: int, cols: int, tile: TileConfig) -> int:
    return cdiv(rows, tile.block_m) * cdiv(cols, tile.block_n)
