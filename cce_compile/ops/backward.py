"""The backward op: dE, dC, dbias from the forward's lse, registered as a triton_op.

Triton path, per token chunk and vocab slab (sizes from config.plan, within the scratch
budget): grad_logits_kernel recomputes the slab's logits into d logits (input dtype),
then matmul_kernel does dC[slab] (+)= d_logits.T @ e[chunk] and
dE_acc[chunk] += d_logits @ c[slab] (fp32). Four GEMMs' worth of work for fwd+bwd,
never more than the slab's logits in memory. Filtered mode walks the vocabulary in the
forward's vocab_order, recomputes only the d-logits tiles that ops/filtering.py keeps from
the forward's tile maxima, lists every slab's kept tiles at once (in torch) and runs the
two GEMMs block-sparse over them (sparse_matmul_kernel).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch.library import triton_op, wrap_triton

from ..config.plan import n_bucket, plan_backward
from ..kernels.backward import grad_logits_kernel, matmul_kernel, sparse_matmul_kernel
from .cpu_path import backward_cpu
from .dispatch import cdiv, config_for, kernel_flags, use_triton
from .filtering import kept_tile_lists, kept_tile_mask
from .loss_terms import grad_coefficients

GEMM_BACKEND = "cublas"
"""The backward's two gradient GEMMs on CUDA: "cublas" (torch.mm, fp16 excepted) or
"triton" (matmul_kernel, always used under the interpreter and for fp16)."""


@triton_op("cce::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward(
    grad_loss: Tensor, grad_lse: Tensor, e: Tensor, c: Tensor, targets: Tensor,
    bias: Tensor | None, weight: Tensor | None, lse: Tensor, tile_max: Tensor, vocab_order: Tensor,
    ignore_index: int, label_smoothing: float, softcap: float, filter_eps: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """-> (grad_e, grad_c, grad_bias); grad_bias is empty when there is no bias.

    tile_max and vocab_order are the forward's (empty in exact mode)."""
    n, d = e.shape
    v = c.shape[0]
    config = config_for(e, c, filter_eps)
    coef_softmax, coef_target, coef_smooth = grad_coefficients(
        grad_loss, grad_lse, targets, weight, v, ignore_index, label_smoothing
    )
    has_smoothing = label_smoothing > 0.0
    filtered = filter_eps > 0.0
    if filtered and vocab_order.shape[0] != v:
        raise ValueError(f"vocab_order: filtered mode needs the forward's order of all {v} tokens")
    if not use_triton(e):
        tile = config.grad_logits
        grad_e, grad_c, grad_bias = backward_cpu(
            e, c, targets, bias, weight, lse, coef_softmax, coef_target,
            coef_smooth if has_smoothing else None, softcap, filter_eps,
            chunk_v=config.slab_v, filter_tile=(tile.block_m, tile.block_n),
            vocab_order=vocab_order if filtered else None,
        )
        return grad_e, grad_c, grad_bias if grad_bias is not None else c.new_empty((0,))

    plan = plan_backward(n_bucket(n), v, d, e.element_size(), config)
    logits_tile, dc_tile, de_tile = config.grad_logits, config.grad_classifier, config.grad_hidden
    chunk_rows = plan.chunk_rows(n, logits_tile.block_m)
    flags = kernel_flags(e)
    # Filtered mode: which d-logits tiles to compute (all rows, all slabs), and per tile row /
    # tile column of each slab the list of kept tiles the block-sparse GEMMs loop over; built
    # before the gradients and scratch exist, so its temporaries never add to their peak.
    chunk_tile_rows, slab_tiles = cdiv(chunk_rows, logits_tile.block_m), cdiv(plan.slab_v, logits_tile.block_n)
    n_slabs = cdiv(v, plan.slab_v)
    if filtered:
        if tile_max.shape != (n, cdiv(v, config.forward.block_n)):
            raise ValueError("tile_max: filtered mode needs the forward's (N, vocab tiles) tile maxima")
        tile_mask = kept_tile_mask(
            tile_max, lse, targets, vocab_order, filter_eps,
            config.forward.block_n, logits_tile.block_m, logits_tile.block_n,
        )
        row_lists, row_counts, col_lists, col_counts = kept_tile_lists(
            tile_mask, plan.n_chunks, chunk_tile_rows, n_slabs, slab_tiles
        )
    else:
        tile_mask = torch.empty((1, 1), dtype=torch.int8, device=e.device)
    grad_e = torch.empty(e.shape, dtype=e.dtype, device=e.device)
    grad_c = torch.empty(c.shape, dtype=c.dtype, device=c.device)
    grad_logits = torch.empty((chunk_rows, plan.slab_v), dtype=e.dtype, device=e.device)
    # 16-bit dE is summed over slabs in fp32; an fp32 dE is its own accumulator.
    acc = torch.empty((chunk_rows, d), dtype=torch.float32, device=e.device) if plan.fp32_accumulator else grad_e
    order_arg = vocab_order if filtered else targets  # unread unless filtered
    # fp16's range is narrow: d logits of a mean loss (~p / N) would fall below it.
    scaled = e.dtype == torch.float16
    # A traced call (torch.compile) keeps the Triton GEMMs, whose whole-buffer mutations
    # Inductor handles without copies.
    cublas = gradient_gemms_in_cublas(e.is_cuda and not is_fake(e), e.dtype, filtered)
    # The d-logits scale (fp16 only); otherwise `lse` stands in for the unread pointer.
    scale = (
        torch.maximum(coef_softmax.abs().max(), coef_target.abs().max()).clamp_min(1e-30).reshape(1)
        if scaled else lse
    )
    # The sparse GEMMs step through whole d-logits tiles, in parts of their block_k.
    sparse_k = min(dc_tile.block_k, de_tile.block_k, logits_tile.block_m, logits_tile.block_n)
    bias_chunks: list[Tensor] = []
    last_slab = (v - 1) // plan.slab_v * plan.slab_v

    for chunk in range(plan.n_chunks):
        row_start = chunk * chunk_rows
        rows = torch.sym_max(torch.sym_min(chunk_rows, n - row_start), 0)
        row_end = row_start + rows
        acc_offset = 0 if plan.fp32_accumulator else row_start * d
        bias_slabs: list[Tensor] = []
        for col_start in range(0, v, plan.slab_v):
            col_end = min(col_start + plan.slab_v, v)
            cols = col_end - col_start
            mask_offset = (row_start // logits_tile.block_m) * tile_mask.stride(0) + col_start // logits_tile.block_n
            if filtered and bias is not None:
                grad_logits.zero_()  # the bias sums the whole slab; skipped tiles are not written
            wrap_triton(grad_logits_kernel)[(cdiv(rows, logits_tile.block_m) * cdiv(cols, logits_tile.block_n),)](
                e, c, bias, targets, weight, lse, coef_softmax, coef_target, coef_smooth, scale, order_arg,
                grad_logits, tile_mask, mask_offset, row_start, row_end, col_start, col_end, d,
                e.stride(0), e.stride(1), c.stride(0), c.stride(1),
                grad_logits.stride(0), grad_logits.stride(1), tile_mask.stride(0), softcap,
                HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap > 0.0, HAS_WEIGHT=weight is not None,
                HAS_SMOOTHING=has_smoothing, FILTER=filtered, SCALED=scaled,
                BLOCK_M=logits_tile.block_m, BLOCK_N=logits_tile.block_n, BLOCK_K=logits_tile.block_k,
                GROUP_M=logits_tile.group_m, EVEN_K=d % logits_tile.block_k == 0,
                num_warps=logits_tile.num_warps,
                num_stages=logits_tile.num_stages, **flags,
            )
            final = plan.fp32_accumulator and col_start == last_slab
            if filtered:
                tile_rows, tile_cols = cdiv(rows, logits_tile.block_m), cdiv(cols, logits_tile.block_n)
                slab = col_start // plan.slab_v
                # dC[order[slab]] (+)= d_logits.T @ e[chunk] over kept tiles: M = cols, K = rows.
                slab_order = order_arg[col_start:]
                wrap_triton(sparse_matmul_kernel)[(tile_cols * cdiv(d, dc_tile.block_n),)](
                    grad_logits, e, row_start * e.stride(0), slab_order, grad_c, 0, slab_order, grad_c, 0,
                    col_lists, col_lists.stride(1) * slab + col_lists.stride(0) * chunk, col_lists.stride(2),
                    col_counts, col_counts.stride(1) * slab + col_counts.stride(0) * chunk, col_counts.stride(2),
                    scale, cols, d, rows,
                    grad_logits.stride(1), grad_logits.stride(0), e.stride(0), e.stride(1),
                    GATHER_B=False, SCATTER_OUT=True, ACCUMULATE=chunk > 0, FINAL=False, SCALED=scaled,
                    TILE_M=logits_tile.block_n, TILE_K=logits_tile.block_m, BLOCK_N=dc_tile.block_n,
                    BLOCK_K=sparse_k, GROUP_M=dc_tile.group_m, num_warps=dc_tile.num_warps,
                    num_stages=dc_tile.num_stages, **flags,
                )
                # dE[chunk] += d_logits @ c[order[slab]] over kept tiles: M = rows, K = cols.
                wrap_triton(sparse_matmul_kernel)[(tile_rows * cdiv(d, de_tile.block_n),)](
                    grad_logits, c, 0, slab_order, acc, acc_offset, slab_order, grad_e, row_start * d,
                    row_lists, row_lists.stride(0) * chunk_tile_rows * chunk + row_lists.stride(1) * slab,
                    row_lists.stride(0),
                    row_counts, row_counts.stride(0) * chunk_tile_rows * chunk + row_counts.stride(1) * slab,
                    row_counts.stride(0),
                    scale, rows, d, cols,
                    grad_logits.stride(0), grad_logits.stride(1), c.stride(0), c.stride(1),
                    GATHER_B=True, SCATTER_OUT=False, ACCUMULATE=col_start > 0, FINAL=final, SCALED=scaled,
                    TILE_M=logits_tile.block_m, TILE_K=logits_tile.block_n, BLOCK_N=de_tile.block_n,
                    BLOCK_K=sparse_k, GROUP_M=de_tile.group_m, num_warps=de_tile.num_warps,
                    num_stages=de_tile.num_stages, **flags,
                )
            elif cublas:
                # cuBLAS on CUDA for bf16/fp32: dC rows written in place, dE summed in fp32
                # by cuBLASLt (bf16 operands, fp32 C), so no temporaries.
                d_logits = grad_logits[:rows, :cols]
                grad_c_slab = grad_c[col_start:col_end]
                if chunk == 0:
                    torch.mm(d_logits.T, e[row_start:row_end], out=grad_c_slab)
                else:
                    grad_c_slab.addmm_(d_logits.T, e[row_start:row_end])
                acc_rows = acc[:rows] if plan.fp32_accumulator else grad_e[row_start:row_end]
                if col_start == 0:
                    torch.mm(d_logits, c[col_start:col_end], out_dtype=acc.dtype, out=acc_rows)
                else:
                    torch.addmm(acc_rows, d_logits, c[col_start:col_end], out_dtype=acc.dtype, out=acc_rows)
                if final:
                    grad_e[row_start:row_end].copy_(acc_rows)
            else:
                # dC[slab] (+)= d_logits.T @ e[chunk]: M = cols, N = d, K = rows.
                wrap_triton(matmul_kernel)[(cdiv(cols, dc_tile.block_m) * cdiv(d, dc_tile.block_n),)](
                    grad_logits, 0, e, row_start * e.stride(0), grad_c, col_start * d, grad_c, 0, scale,
                    cols, d, rows,
                    grad_logits.stride(1), grad_logits.stride(0), e.stride(0), e.stride(1), d, 1, d, 1,
                    ACCUMULATE=chunk > 0, FINAL=False, SCALED=scaled,
                    BLOCK_M=dc_tile.block_m, BLOCK_N=dc_tile.block_n, BLOCK_K=dc_tile.block_k,
                    GROUP_M=dc_tile.group_m, num_warps=dc_tile.num_warps, num_stages=dc_tile.num_stages, **flags,
                )
                # dE[chunk] += d_logits @ c[slab]: M = rows, N = d, K = cols; the last slab
                # writes dE itself.
                wrap_triton(matmul_kernel)[(cdiv(rows, de_tile.block_m) * cdiv(d, de_tile.block_n),)](
                    grad_logits, 0, c, col_start * c.stride(0), acc, acc_offset, grad_e, row_start * d, scale,
                    rows, d, cols,
                    grad_logits.stride(0), grad_logits.stride(1), c.stride(0), c.stride(1), d, 1, d, 1,
                    ACCUMULATE=col_start > 0, FINAL=final, SCALED=scaled,
                    BLOCK_M=de_tile.block_m, BLOCK_N=de_tile.block_n, BLOCK_K=de_tile.block_k,
                    GROUP_M=de_tile.group_m, num_warps=de_tile.num_warps, num_stages=de_tile.num_stages, **flags,
                )
            if bias is not None:
                slab_sum = grad_logits[:rows, :cols].sum(dim=0, dtype=torch.float32)
                bias_slabs.append(slab_sum * scale if scaled else slab_sum)
        if bias is not None:
            bias_chunks.append(torch.cat(bias_slabs))
    if bias is None:
        return grad_e, grad_c, c.new_empty((0,))
    grad_bias = torch.stack(bias_chunks).sum(dim=0)
    if filtered:  # slab columns were positions in the vocab order
        grad_bias = torch.empty_like(grad_bias).index_copy_(0, vocab_order, grad_bias)
    return grad_e, grad_c, grad_bias.to(bias.dtype)


def gradient_gemms_in_cublas(on_cuda: bool, dtype: torch.dtype, filtered: bool) -> bool:
    """Whether an eager call runs the two gradient GEMMs in cuBLAS: on CUDA for bf16 and fp32
    in exact mode. fp16's d-logits are scaled (which the Triton GEMMs undo) and filtered
    mode's GEMMs are block-sparse, so those stay Triton; the tuner asks the same question."""
    return on_cuda and dtype != torch.float16 and not filtered and GEMM_BACKEND == "cublas"
