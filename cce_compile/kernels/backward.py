"""Backward kernels: recompute a slab of logits into its gradient, then two GEMMs."""

import triton
import triton.language as tl

from .tiles import finish_gemm, grouped_tile, load_tile, logits_tile, mma


@triton.jit
def grad_logits_kernel(
    e_ptr, c_ptr, bias_ptr, targets_ptr, weight_ptr, lse_ptr,
    coef_softmax_ptr, coef_target_ptr, coef_smooth_ptr, scale_ptr, vocab_order_ptr,
    grad_logits_ptr, tile_mask_ptr, mask_offset,
    row_start, row_end, col_start, col_end, D,
    stride_en, stride_ed, stride_cv, stride_cd, stride_gm, stride_gn, stride_mask,
    softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr, FILTER: tl.constexpr, SCALED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """d loss / d logits for rows [row_start, row_end) x cols [col_start, col_end).

    With p = softmax, y the target and per-row coefficients a, b, s computed by the op:
        d_logit[i, j] = a[i] * p[i, j] - b[i] * [j == y_i] - s[i] * w[j]
    then the soft-cap's chain rule. The tile is written in the input dtype at
    (i - row_start, j - col_start) of the slab buffer; rows or columns outside the
    ranges are left alone (the GEMMs that follow mask them).
    With FILTER, columns are positions in `vocab_order` (likely tokens first, so the few
    tiles that matter cluster), and a program whose tile the forward's statistics dropped
    (tile_mask[mask_offset + tile row * stride_mask + tile col] == 0) returns at once: no
    recompute, nothing written (the block-sparse GEMMs never read the tile).
    With SCALED (fp16), the tile is divided by scale_ptr[0] (the largest coefficient) so
    small gradients stay in fp16's normal range; the GEMMs multiply it back.
    """
    num_m = tl.cdiv(row_end - row_start, BLOCK_M)
    num_n = tl.cdiv(col_end - col_start, BLOCK_N)
    pid_m, pid_n = grouped_tile(tl.program_id(0), num_m, num_n, GROUP_M)
    if FILTER:
        if tl.load(tile_mask_ptr + mask_offset + pid_m * stride_mask + pid_n) == 0:
            return
    local_rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    local_cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = row_start + local_rows
    cols = col_start + local_cols
    row_mask = rows < row_end
    col_mask = cols < col_end
    vocab = cols
    if FILTER:
        vocab = tl.load(vocab_order_ptr + cols, mask=col_mask, other=0)

    logits = logits_tile(
        e_ptr, c_ptr, bias_ptr, rows, vocab, row_mask, col_mask, D,
        stride_en, stride_ed, stride_cv, stride_cd, softcap,
        HAS_BIAS, HAS_SOFTCAP, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, UPCAST, IEEE,
    )
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    targets = tl.load(targets_ptr + rows, mask=row_mask, other=-1)
    coef_softmax = tl.load(coef_softmax_ptr + rows, mask=row_mask, other=0.0)
    coef_target = tl.load(coef_target_ptr + rows, mask=row_mask, other=0.0)

    softmax = tl.exp(logits - lse[:, None])
    is_target = (vocab[None, :] == targets[:, None]) & col_mask[None, :]
    grad = coef_softmax[:, None] * softmax - tl.where(is_target, coef_target[:, None], 0.0)
    if HAS_SMOOTHING:
        coef_smooth = tl.load(coef_smooth_ptr + rows, mask=row_mask, other=0.0)
        if HAS_WEIGHT:
            w = tl.load(weight_ptr + vocab, mask=col_mask, other=0.0).to(tl.float32)
            grad -= coef_smooth[:, None] * w[None, :]
        else:
            grad -= coef_smooth[:, None]
    if HAS_SOFTCAP:
        capped = logits / softcap
        grad = grad * (1.0 - capped * capped)
    inside = row_mask[:, None] & col_mask[None, :]
    grad = tl.where(inside, grad, 0.0)
    if SCALED:
        grad = grad / tl.load(scale_ptr)
    out = (grad_logits_ptr + local_rows.to(tl.int64)[:, None] * stride_gm
           + local_cols.to(tl.int64)[None, :] * stride_gn)
    tl.store(out, grad.to(grad_logits_ptr.dtype.element_ty), mask=inside)


@triton.jit
def matmul_kernel(
    a_ptr, a_offset, b_ptr, b_offset, out_ptr, out_offset, final_ptr, final_offset, scale_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_om, stride_on, stride_fm, stride_fn,
    ACCUMULATE: tl.constexpr, FINAL: tl.constexpr, SCALED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """out[M, N] (+)= a[M, K] @ b[K, N] with fp32 accumulation, on strided operands.

    The backward's two gradient GEMMs are this kernel: dC slab (+)= d_logits.T @ e chunk
    (stored, or accumulated over token chunks) and dE chunk += d_logits @ c slab (into an
    fp32 accumulator). ACCUMULATE, FINAL and SCALED: see finish_gemm. Operands come as base
    tensors plus element offsets, never as views, so torch.compile sees whole buffers mutated.
    """
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        offs_k = k * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = load_tile(a_ptr + a_offset, offs_m, offs_k, m_mask, k_mask, stride_am, stride_ak)
        b = load_tile(b_ptr + b_offset, offs_k, offs_n, k_mask, n_mask, stride_bk, stride_bn)
        acc = mma(acc, a, b, UPCAST, IEEE)
    rows, cols = offs_m.to(tl.int64)[:, None], offs_n.to(tl.int64)[None, :]
    finish_gemm(
        acc, out_ptr + out_offset + rows * stride_om + cols * stride_on,
        final_ptr + final_offset + rows * stride_fm + cols * stride_fn,
        m_mask[:, None] & n_mask[None, :], scale_ptr, ACCUMULATE, FINAL, SCALED,
    )


@triton.jit
def sparse_matmul_kernel(
    a_ptr, b_ptr, b_offset, b_index_ptr, out_ptr, out_offset, out_index_ptr, final_ptr, final_offset,
    kept_lists_ptr, lists_offset, stride_list, kept_counts_ptr, counts_offset, stride_count, scale_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn,
    GATHER_B: tl.constexpr, SCATTER_OUT: tl.constexpr,
    ACCUMULATE: tl.constexpr, FINAL: tl.constexpr, SCALED: tl.constexpr,
    TILE_M: tl.constexpr, TILE_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """out[M, N] (+)= a[M, K] @ b[K, N] over the (TILE_M x TILE_K) tiles of `a` that the
    filter kept (the first kept_counts[m tile] of kept_lists[m tile], from ops/filtering.py's
    kept_tile_lists; both at an element offset, rows `stride_list` / `stride_count` apart):
    filtered mode's two gradient GEMMs on the d-logits slab.

    dE chunk += d_logits @ c[vocab_order[slab]]: B's rows gathered (GATHER_B: row k of b is
    b_index[k]); dC[vocab_order[slab]] (+)= d_logits.T @ e chunk: out's rows scattered
    (SCATTER_OUT: row m of out is out_index[m]). Out, final: row-major with N columns.
    ACCUMULATE, FINAL and SCALED as in finish_gemm; an accumulating program with no kept
    tile leaves `out` untouched.
    """
    PARTS: tl.constexpr = TILE_K // BLOCK_K
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, TILE_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * TILE_M + tl.arange(0, TILE_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    kept = tl.load(kept_counts_ptr + counts_offset + pid_m * stride_count)
    tiles_ptr = kept_lists_ptr + lists_offset + pid_m * stride_list
    acc = tl.zeros((TILE_M, BLOCK_N), dtype=tl.float32)
    # One flat loop over (kept tile, part of it): no branch, so the loads pipeline.
    for step in range(0, kept * PARTS):
        tile = tl.load(tiles_ptr + step // PARTS)
        offs_k = tile * TILE_K + (step % PARTS) * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = load_tile(a_ptr, offs_m, offs_k, m_mask, k_mask, stride_am, stride_ak)
        if GATHER_B:
            b_rows = tl.load(b_index_ptr + offs_k, mask=k_mask, other=0)
            b = load_tile(b_ptr + b_offset, b_rows, offs_n, k_mask, n_mask, stride_bk, stride_bn)
        else:
            b = load_tile(b_ptr + b_offset, offs_k, offs_n, k_mask, n_mask, stride_bk, stride_bn)
        acc = mma(acc, a, b, UPCAST, IEEE)
    out_rows = offs_m.to(tl.int64)
    if SCATTER_OUT:
        out_rows = tl.load(out_index_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    live_m = M
    if ACCUMULATE and not FINAL:
        live_m = tl.where(kept > 0, M, 0)
    out = out_rows[:, None] * N + offs_n.to(tl.int64)[None, :]
    finish_gemm(
        acc, out_ptr + out_offset + out, final_ptr + final_offset + out,
        (offs_m < live_m)[:, None] & n_mask[None, :], scale_ptr, ACCUMULATE, FINAL, SCALED,
    )
