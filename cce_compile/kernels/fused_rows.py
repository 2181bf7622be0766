"""The fused forward's per-row work around its logits kernel, one launch each.

After a chunk's logits pass, `row_shift_kernel` sums each row's statistics over the vocab
tiles, takes its lse and flags the rows whose lse lies too far above their shift (they are
done again with their largest logit as the shift). After that redo, `row_finish_kernel`
takes each row's loss and gradient coefficients (the algebra of ops/loss_terms.py), writes
the softmax's row scale s, folds the target's coefficient into the workspace and scales the
chunk's rows of e by s for dC. Per chunk these were ~80 small torch launches: at small D
(Qwen2.5's 896) their launch latency cost ~0.5 x a GEMM of GPU time.
"""

import triton
import triton.language as tl

from .fused_forward import MAX, SUM, WEIGHTED


@triton.jit
def tile_stat_sum(stats_ptr, stat, local_rows, row_mask, vocab_tiles, rows, stat_stride, BLOCK_T: tl.constexpr):
    """sum over vocab tiles of stats[stat, tile, row], fp32: the statistics a redone row
    needs again (row_shift_kernel reads all of them in one pass instead)."""
    total = tl.zeros(local_rows.shape, dtype=tl.float32)
    for start in range(0, vocab_tiles, BLOCK_T):
        tiles = start + tl.arange(0, BLOCK_T)
        at = stats_ptr + stat * stat_stride + tiles.to(tl.int64)[:, None] * rows + local_rows[None, :]
        total += tl.sum(tl.load(at, mask=(tiles < vocab_tiles)[:, None] & row_mask[None, :], other=0.0), axis=0)
    return total


@triton.jit
def row_shift_kernel(
    stats_ptr, shift_ptr, redo_ptr, lse_ptr, weighted_sum_ptr, rows, vocab_tiles, stat_stride, safe_gap,
    SMOOTHING: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Each row's lse = shift + log(sum of exp(z - shift)) and (SMOOTHING) its weighted logit
    sum, in one pass over the statistics. redo[row] = whether that log is not <= safe_gap
    (overflow and NaN included): those rows' shift becomes their largest logit, in place,
    and their lse is taken again after the redo (row_finish_kernel)."""
    local_rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = local_rows < rows
    total = tl.zeros((BLOCK_R,), dtype=tl.float32)
    weighted_sum = tl.zeros((BLOCK_R,), dtype=tl.float32)
    largest = tl.full((BLOCK_R,), float("-inf"), dtype=tl.float32)
    for start in range(0, vocab_tiles, BLOCK_T):
        tiles = start + tl.arange(0, BLOCK_T)
        at = stats_ptr + tiles.to(tl.int64)[:, None] * rows + local_rows[None, :]
        mask = (tiles < vocab_tiles)[:, None] & row_mask[None, :]
        total += tl.sum(tl.load(at + SUM * stat_stride, mask=mask, other=0.0), axis=0)
        largest = tl.maximum(largest, tl.max(tl.load(at + MAX * stat_stride, mask=mask, other=float("-inf")), axis=0))
        if SMOOTHING:
            weighted_sum += tl.sum(tl.load(at + WEIGHTED * stat_stride, mask=mask, other=0.0), axis=0)
    gap = tl.log(total)
    redo = ~(gap <= safe_gap)
    shift = tl.load(shift_ptr + local_rows, mask=row_mask, other=0.0)
    tl.store(lse_ptr + local_rows, shift + gap, mask=row_mask)
    tl.store(shift_ptr + local_rows, tl.where(redo, largest, shift), mask=row_mask)
    tl.store(redo_ptr + local_rows, redo.to(tl.int32), mask=row_mask)
    if SMOOTHING:
        tl.store(weighted_sum_ptr + local_rows, weighted_sum, mask=row_mask)


@triton.jit
def row_finish_kernel(
    stats_ptr, shift_ptr, redo_ptr, lse_ptr, weighted_sum_ptr, targets_ptr, weight_ptr, target_logit_ptr, scale_ptr,
    total_weight_ptr, losses_ptr, row_scale_ptr, coef_smooth_ptr, workspace_ptr, e_ptr, scaled_e_ptr,
    row_start, rows, V, D, vocab_tiles, stat_stride, stride_w, stride_en, stride_ed, stride_s,
    ignore_index, label_smoothing, z_loss, softcap,
    HAS_WEIGHT: tl.constexpr, SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    SCALE_E: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Per row of the chunk (token row_start + row): losses[token], row_scale = coef_softmax *
    exp(shift - lse), coef_smooth (with SMOOTHING), the workspace entry at the target made
    (q - coef_target / s) g, and with SCALE_E scaled_e[row] = e[token] * s in e's dtype."""
    local_rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = local_rows < rows
    tokens = row_start + local_rows
    shift = tl.load(shift_ptr + local_rows, mask=row_mask, other=0.0)
    lse = tl.load(lse_ptr + local_rows, mask=row_mask, other=0.0)
    redo = tl.load(redo_ptr + local_rows, mask=row_mask, other=0) != 0
    if tl.max(redo.to(tl.int32), axis=0) > 0:  # the rows done again: their new sum
        redone = shift + tl.log(tile_stat_sum(stats_ptr, SUM, local_rows, row_mask, vocab_tiles, rows, stat_stride,
                                              BLOCK_T))
        lse = tl.where(redo, redone, lse)
    targets = tl.load(targets_ptr + tokens, mask=row_mask, other=ignore_index)
    valid = targets != ignore_index
    in_range = (targets >= 0) & (targets < V)
    hit = row_mask & valid & in_range
    if HAS_WEIGHT:
        target_weight = tl.load(weight_ptr + targets, mask=hit, other=0.0).to(tl.float32)
    else:
        target_weight = hit.to(tl.float32)
    target_logit = tl.load(target_logit_ptr + local_rows, mask=hit, other=0.0)
    loss = (1.0 - label_smoothing) * target_weight * (lse - target_logit)
    if SMOOTHING:
        total_weight = tl.load(total_weight_ptr)
        weighted_sum = tl.load(weighted_sum_ptr + local_rows, mask=row_mask, other=0.0)
        loss += (total_weight * lse - weighted_sum) * (label_smoothing / V)
    loss = tl.where(valid, loss, 0.0)
    if HAS_Z_LOSS:
        loss += tl.where(valid, z_loss * lse * lse, 0.0)  # (z_loss * lse) * lse, as loss_terms.z_loss_terms
    loss = tl.where(valid & ~in_range, float("nan"), loss)
    tl.store(losses_ptr + tokens, loss, mask=row_mask)

    scale = tl.load(scale_ptr)
    grad_loss = tl.where(valid, scale, 0.0)
    coef_target = grad_loss * (1.0 - label_smoothing) * target_weight
    coef_softmax = coef_target
    if SMOOTHING:
        coef_smooth = grad_loss * (label_smoothing / V)
        coef_softmax += coef_smooth * total_weight
        tl.store(coef_smooth_ptr + local_rows, coef_smooth, mask=row_mask)
    if HAS_Z_LOSS:
        coef_softmax += tl.where(valid, 2.0 * z_loss * scale * lse, 0.0)
    row_scale = coef_softmax * tl.exp(shift - lse)
    tl.store(row_scale_ptr + local_rows, row_scale, mask=row_mask)

    # The target's -coef_target, folded into its workspace entry from the exact fp32 target logit.
    fold = hit & (coef_target != 0.0)  # in range: a NaN coefficient (an inf scale) writes nowhere else
    tiny = 1.1754943508222875e-38  # fp32's smallest normal
    safe_scale = tl.where(tl.abs(row_scale) < tiny, tiny, row_scale)
    folded = tl.exp(target_logit - shift) - coef_target / safe_scale
    if HAS_SOFTCAP:  # times the soft-cap's derivative, as the kernel's entries
        capped = target_logit / softcap
        folded = folded * (1.0 - capped * capped)
    at_target = workspace_ptr + local_rows.to(tl.int64) * stride_w + tl.where(fold, targets, 0)
    tl.store(at_target, folded.to(workspace_ptr.dtype.element_ty), mask=fold)

    if SCALE_E:
        for start in range(0, D, BLOCK_D):
            cols = start + tl.arange(0, BLOCK_D)
            mask = row_mask[:, None] & (cols < D)[None, :]
            e = tl.load(e_ptr + tokens.to(tl.int64)[:, None] * stride_en + cols[None, :] * stride_ed, mask=mask)
            out = scaled_e_ptr + local_rows.to(tl.int64)[:, None] * stride_s + cols[None, :]
            tl.store(out, (e.to(tl.float32) * row_scale[:, None]).to(scaled_e_ptr.dtype.element_ty), mask=mask)
