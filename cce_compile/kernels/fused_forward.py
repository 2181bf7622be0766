"""The forward that also prepares the gradients (three GEMMs for forward and backward).

Per token chunk, a kernel tiles the chunk's logits z = e @ c.T (+ bias, soft-capped) once and
stores q = exp(z - shift) (times the soft-cap's derivative) in the input dtype into a
(chunk rows x V) workspace, with each row's `shift` fixed before the launch (the row's mean
logit, ops/forward_fused.py). The row's softmax is then p = q exp(shift - lse), a per-row
scale, so the gradient GEMMs (cuBLAS) take the workspace as it is and scale rows: no pass
over the workspace between the logits GEMM and the gradient GEMMs. Each tile also writes
per-row statistics into stats[stat, vocab tile, chunk row]: the sum of exp(z - shift), the
largest logit (rows whose lse runs too far above their shift are recomputed with it), and
label smoothing's sum of w_j z_j; and each row's target logit where its target falls.
"""

import triton
import triton.language as tl

from .forward import tile_target_logit, tile_weighted_sum
from .tiles import exp_shifted, grouped_tile, logits_tile, logits_tile_tma

SUM, MAX, WEIGHTED = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
"""The stats' rows (`.value` on the host)."""
REDO_SPLITS = tl.constexpr(8)
"""Programs per row block of the redo launch (`.value` on the host)."""


@triton.jit
def scaled_exp_tile(
    logits, local_rows, cols, row_mask, col_mask, pid_n, shift_ptr, targets_ptr, weight_ptr, stats_ptr,
    target_logit_ptr, stat_stride, rows_total, row_start, V, softcap,
    HAS_SOFTCAP: tl.constexpr, HAS_WEIGHT: tl.constexpr, NEED_WEIGHTED_SUM: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """What a tile of (capped) fp32 logits leaves: its statistics and target logits stored,
    the workspace tile returned (0 past V). Rows are the chunk's (local_rows), tokens
    row_start + local_rows; the tile's columns start at pid_n * BLOCK_N."""
    tokens = row_start + local_rows
    shift = tl.load(shift_ptr + local_rows, mask=row_mask, other=0.0)
    at = stats_ptr + tl.cast(pid_n, tl.int64) * rows_total + local_rows
    if NEED_WEIGHTED_SUM:
        tl.store(at + WEIGHTED * stat_stride, tile_weighted_sum(logits, cols, col_mask, weight_ptr, HAS_WEIGHT),
                 mask=row_mask)
    # A select per logit: it also gives the branch below a copy to read (a branch reading the
    # dot's result itself makes ptxas serialize the kernel's wgmmas).
    masked = tl.where(col_mask[None, :], logits, float("-inf"))
    targets = tl.load(targets_ptr + tokens, mask=row_mask, other=-1)
    first_col = pid_n * BLOCK_N
    hit = row_mask & (targets >= first_col) & (targets < tl.minimum(first_col + BLOCK_N, V))
    if tl.max(hit.to(tl.int32), axis=0) > 0:  # the search for targets only in tiles that hold one
        tl.store(target_logit_ptr + local_rows, tile_target_logit(masked, cols, col_mask, targets), mask=hit)
    q = exp_shifted(masked, shift)
    tl.store(at + SUM * stat_stride, tl.sum(q, axis=1), mask=row_mask)
    tl.store(at + MAX * stat_stride, tl.max(masked, axis=1), mask=row_mask)
    if HAS_SOFTCAP:
        capped = logits / softcap
        q = q * (1.0 - capped * capped)
    return q


@triton.jit
def fused_tile(
    e_ptr, c_ptr, bias_ptr, targets_ptr, weight_ptr, shift_ptr, workspace_ptr, stats_ptr, target_logit_ptr,
    redo_ptr, pid_m, pid_n, row_start, rows, V, D, stat_stride, stride_en, stride_ed, stride_cv, stride_cd, stride_w,
    softcap, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, LOGIT_SCALE: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    NEED_WEIGHTED_SUM: tl.constexpr, REDO: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """One (row block, vocab tile) of the chunk: its workspace tile and statistics. With REDO
    only the rows whose redo[row] is set are loaded and written."""
    local_rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = local_rows < rows
    if REDO:
        row_mask = row_mask & (tl.load(redo_ptr + local_rows, mask=row_mask, other=0) != 0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < V
    logits = logits_tile(
        e_ptr, c_ptr, bias_ptr, row_start + local_rows, cols, row_mask, col_mask, D,
        stride_en, stride_ed, stride_cv, stride_cd, softcap,
        HAS_BIAS, HAS_SOFTCAP, LOGIT_SCALE, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, UPCAST, IEEE,
    )
    q = scaled_exp_tile(
        logits, local_rows, cols, row_mask, col_mask, pid_n, shift_ptr, targets_ptr, weight_ptr, stats_ptr,
        target_logit_ptr, stat_stride, rows, row_start, V, softcap, HAS_SOFTCAP, HAS_WEIGHT, NEED_WEIGHTED_SUM,
        BLOCK_N,
    )
    out = workspace_ptr + local_rows.to(tl.int64)[:, None] * stride_w + cols.to(tl.int64)[None, :]
    tl.store(out, q.to(workspace_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def fused_forward_kernel(
    e_ptr, c_ptr, bias_ptr, targets_ptr, weight_ptr, shift_ptr, workspace_ptr, stats_ptr, target_logit_ptr,
    redo_ptr, row_start, rows, V, D, stat_stride,
    stride_en, stride_ed, stride_cv, stride_cd, stride_w, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, LOGIT_SCALE: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    NEED_WEIGHTED_SUM: tl.constexpr, REDO: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """One program per (row block, vocab tile) of the chunk's rows x V, on pointers (fp32,
    strides the copy engine cannot take, the interpreter). With REDO, REDO_SPLITS programs
    per row block, each over every REDO_SPLITS-th vocab tile, and only the rows whose
    redo[row] is set: the rows the first pass shifted too far from their lse, again with their
    new shift (the others keep the first pass's entries, which their lse was taken from). (That launch follows every chunk and almost never has work:
    few programs, so it costs a few microseconds.)"""
    num_m = tl.cdiv(rows, BLOCK_M)
    num_n = tl.cdiv(V, BLOCK_N)
    if REDO:
        pid_m = tl.program_id(0) // REDO_SPLITS
        local_rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        if tl.max(tl.load(redo_ptr + local_rows, mask=local_rows < rows, other=0), axis=0) == 0:
            return
        for pid_n in range(tl.program_id(0) % REDO_SPLITS, num_n, REDO_SPLITS):
            fused_tile(
                e_ptr, c_ptr, bias_ptr, targets_ptr, weight_ptr, shift_ptr, workspace_ptr, stats_ptr,
                target_logit_ptr, redo_ptr, pid_m, pid_n, row_start, rows, V, D, stat_stride, stride_en, stride_ed,
                stride_cv, stride_cd, stride_w, softcap, HAS_BIAS, HAS_SOFTCAP, LOGIT_SCALE, HAS_WEIGHT,
                NEED_WEIGHTED_SUM, REDO, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, UPCAST, IEEE,
            )
    else:
        pid_m, pid_n = grouped_tile(tl.program_id(0), num_m, num_n, GROUP_M)
        fused_tile(
            e_ptr, c_ptr, bias_ptr, targets_ptr, weight_ptr, shift_ptr, workspace_ptr, stats_ptr, target_logit_ptr,
            redo_ptr, pid_m, pid_n, row_start, rows, V, D, stat_stride, stride_en, stride_ed, stride_cv, stride_cd,
            stride_w, softcap, HAS_BIAS, HAS_SOFTCAP, LOGIT_SCALE, HAS_WEIGHT, NEED_WEIGHTED_SUM, REDO, BLOCK_M, BLOCK_N,
            BLOCK_K, EVEN_K, UPCAST, IEEE,
        )


@triton.jit
def fused_forward_tma_kernel(
    e_desc, c_desc, workspace_desc, bias_ptr, targets_ptr, weight_ptr, shift_ptr, stats_ptr, target_logit_ptr,
    row_start, rows, V, D, stat_stride, num_programs, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, LOGIT_SCALE: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    NEED_WEIGHTED_SUM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """fused_forward_kernel as a persistent kernel on tensor descriptors (16-bit inputs): the
    copy engine loads the next tile's operands while this tile's epilogue runs, and stores
    each workspace tile asynchronously (it clips what lies past the chunk's rows and V)."""
    num_m = tl.cdiv(rows, BLOCK_M)
    num_n = tl.cdiv(V, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_m * num_n, num_programs, flatten=True):
        pid_m, pid_n = grouped_tile(tile, num_m, num_n, GROUP_M)
        local_rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = local_rows < rows
        col_mask = cols < V
        logits = logits_tile_tma(
            e_desc, c_desc, bias_ptr, row_start + pid_m * BLOCK_M, pid_n * BLOCK_N, cols, col_mask, D, softcap,
            HAS_BIAS, HAS_SOFTCAP, LOGIT_SCALE, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, IEEE,
        )
        q = scaled_exp_tile(
            logits, local_rows, cols, row_mask, col_mask, pid_n, shift_ptr, targets_ptr, weight_ptr, stats_ptr,
            target_logit_ptr, stat_stride, rows, row_start, V, softcap, HAS_SOFTCAP, HAS_WEIGHT, NEED_WEIGHTED_SUM,
            BLOCK_N,
        )
        workspace_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], q.to(workspace_desc.dtype))


@triton.jit
def scale_unless_one_kernel(x_ptr, n, scale_ptr, BLOCK: tl.constexpr):
    """x *= scale[0] in place, unless it is 1 (a loss's own backward): then nothing is read or
    written. The backward of the fused forward, without a host sync to ask."""
    scale = tl.load(scale_ptr)
    if scale == 1.0:
        return
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask)
    tl.store(x_ptr + offsets, (x.to(tl.float32) * scale).to(x.dtype), mask=mask)
