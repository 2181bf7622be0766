"""Exact mode's recompute: a slab's logits, recomputed from e and c, into d-logits in a
(chunk rows, slab_v) buffer, by the kernel plan.recompute names."""

from __future__ import annotations

from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from ..config.kernel_config import TileConfig
from ..kernels.backward import grad_logits_kernel, grad_logits_tma_kernel
from ..kernels.warp_specialized import grad_logits_ws_kernel
from .backward_call import BackwardCall
from .gluon import gluon_descriptor, launch_options, operand_descriptors, programs_for, tiles_of
from .launch import KernelLauncher
from .problem import cdiv, device_limits, stages_beside_output


class Recompute:
    """`recompute(row_start, rows, col_start, cols)` writes d-logits of rows x cols from
    (row_start, col_start) into the buffer's top-left corner. The descriptors are made once
    per call: each costs host time that a backward of many small steps lacks."""

    def __init__(self, call: BackwardCall, grad_logits: Tensor) -> None:
        self.call = call
        self.grad_logits = grad_logits
        e, c = call.e, call.c
        tile = call.config.grad_logits
        kind = call.plan.recompute
        if kind == "gluon":
            self.launch = KernelLauncher(grad_logits_ws_kernel, call.plan.direct_launch)
            self.descriptors = recompute_descriptors(e, c, grad_logits, call.plan.gluon_tile)
        elif kind == "tma":
            self.launch = KernelLauncher(grad_logits_tma_kernel, call.plan.direct_launch)
            self.sms, shared_memory = device_limits(e.device)
            self.stages = stages_beside_output(tile, e.element_size(), shared_memory)
            self.descriptors = (
                TensorDescriptor.from_tensor(e, [tile.block_m, tile.block_k]),
                TensorDescriptor.from_tensor(c, [tile.block_n, tile.block_k]),
                TensorDescriptor.from_tensor(grad_logits, [tile.block_m, tile.block_n]),
            )
        else:
            self.launch = KernelLauncher(grad_logits_kernel, call.plan.direct_launch)

    def __call__(self, row_start: int, rows: int, col_start: int, cols: int) -> None:
        call, tile = self.call, self.call.config.grad_logits
        kind = call.plan.recompute
        if kind == "gluon":
            recompute_warp_specialized(
                self.launch, self.descriptors, call.targets, call.lse, call.coef_softmax, call.coef_target,
                call.entropy_coefficients, call.coef_entropy is not None, call.scale, call.scaled, row_start, rows,
                col_start, cols, call.plan.gluon_tile, call.plan.gluon_programs_per_sm, call.plan.logit_scale,
            )
        elif kind == "tma":
            programs = cdiv(rows, tile.block_m) * cdiv(cols, tile.block_n)
            self.launch(
                (min(programs, self.sms),), *self.descriptors, call.bias, call.targets, call.weight, call.lse,
                call.coef_softmax, call.coef_target, call.coef_smooth, call.entropy_coefficients, call.scale,
                row_start, rows, col_start, cols, call.d, self.sms, call.softcap,
                **call.loss_flags(), SCALED=call.scaled,
                BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
                num_warps=tile.num_warps, num_stages=self.stages, **call.flags,
            )
        else:
            launch_pointer_recompute(self.launch, call, self.grad_logits, row_start, rows, col_start, cols)


def launch_pointer_recompute(
    launch: KernelLauncher, call: BackwardCall, grad_logits: Tensor, row_start: int, rows: int, col_start: int,
    cols: int, programs: int | None = None, lists: tuple[Tensor, Tensor, int, int] | None = None,
    strided: bool = False, tile_bias_sums: Tensor | None = None,
) -> None:
    """grad_logits_kernel: a dense slab, or with `lists` (filtered mode: step tiles, step
    counts, step index, slots) a step's kept tiles in vocab order, one per program (`strided`:
    each program walks the step's slots, `programs` apart), with a bias their column sums
    added to `tile_bias_sums` (chunk tile rows x vocab tiles' columns, fp32)."""
    tile = call.config.grad_logits
    filtered = lists is not None
    if programs is None:
        programs = cdiv(rows, tile.block_m) * cdiv(cols, tile.block_n)
    if filtered and call.bias is not None and tile_bias_sums is None:
        raise ValueError("tile_bias_sums: a filtered recompute with a bias adds its tiles' column sums there")
    step_tiles, step_counts, step_index, capacity = lists if filtered else (call.targets, call.targets, 0, 0)
    e, c = call.e, call.c
    launch(
        (programs,), e, c, call.bias, call.targets, call.weight, call.lse, call.coef_softmax, call.coef_target,
        call.coef_smooth, call.entropy_coefficients, call.scale, call.vocab_order if filtered else call.targets,
        grad_logits, tile_bias_sums if tile_bias_sums is not None else call.lse,  # the latter never written
        step_tiles, step_counts, step_index, capacity, call.chunk_tile_rows,
        row_start, row_start + rows, col_start, col_start + cols, call.d,
        e.stride(0), e.stride(1), c.stride(0), c.stride(1),
        grad_logits.stride(0), grad_logits.stride(1), call.softcap,
        **call.loss_flags(), FILTER=filtered, STRIDED=strided, SCALED=call.scaled,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        GROUP_M=tile.group_m, EVEN_K=call.d % tile.block_k == 0,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **call.flags,
    )


def recompute_descriptors(e: Tensor, c: Tensor, grad_logits: Tensor, tile: TileConfig) -> tuple:
    """grad_logits_ws_kernel's descriptors: e and c in the tile's K steps, the d-logits buffer
    in the half tiles its epilogue stores (kernels/warp_specialized.py)."""
    return (*operand_descriptors(e, c, tile), gluon_descriptor(grad_logits, [tile.block_m, tile.block_n // 2]))


def recompute_warp_specialized(
    launch: KernelLauncher, descriptors: tuple, targets: Tensor, lse: Tensor, coef_softmax: Tensor,
    coef_target: Tensor, coef_entropy: Tensor, has_entropy: bool, scale: Tensor, scaled: bool, row_start: int,
    rows: int, col_start: int, cols: int, tile: TileConfig, per_sm: int, logit_scale: float,
) -> None:
    """One slab's d logits (rows x cols from (row_start, col_start)) by grad_logits_ws_kernel
    into the buffer recompute_descriptors describes (coef_entropy read with has_entropy only:
    linear_log_probs' entropy term)."""
    launch(
        (programs_for(lse.device, tiles_of(rows, cols, tile), per_sm),), *descriptors, targets, lse,
        coef_softmax, coef_target, coef_entropy, scale, row_start, rows, col_start, cols, descriptors[0].shape[1],  # D
        GROUP_M=tile.group_m, STAGES=tile.num_stages, SCALED=scaled, HAS_ENTROPY=has_entropy,
        LOGIT_SCALE=logit_scale, **launch_options(per_sm),
    )
