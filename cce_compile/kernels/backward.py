"""Backward kernels: recompute a slab of logits into its gradient, then two GEMMs."""

import triton
import triton.language as tl

from .tiles import grouped_tile, logits_tile, mma


@triton.jit
def grad_logits_kernel(
    e_ptr, c_ptr, bias_ptr, targets_ptr, weight_ptr, lse_ptr,
    coef_softmax_ptr, coef_target_ptr, coef_smooth_ptr, scale_ptr, vocab_order_ptr,
    grad_logits_ptr, tile_mask_ptr,
    row_start, row_end, col_start, col_end, D,
    stride_en, stride_ed, stride_cv, stride_cd, stride_gm, stride_gn, stride_mask,
    softcap, filter_eps,
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
    tiles that matter cluster), a tile whose |softmax - onehot| stays below filter_eps is
    written as 0, and tile_mask[tile row, tile col] records whether it was kept, for the
    block-sparse GEMMs.
    With SCALED (fp16), the tile is divided by scale_ptr[0] (the largest coefficient) so
    small gradients stay in fp16's normal range; the GEMMs multiply it back.
    """
    num_m = tl.cdiv(row_end - row_start, BLOCK_M)
    num_n = tl.cdiv(col_end - col_start, BLOCK_N)
    pid_m, pid_n = grouped_tile(tl.program_id(0), num_m, num_n, GROUP_M)
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
    is_target = vocab[None, :] == targets[:, None]
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
    if FILTER:
        distance = tl.where(is_target, 1.0, softmax)
        keep = tl.max(tl.max(tl.where(inside, distance, 0.0), axis=1), axis=0) >= filter_eps
        grad = grad * keep.to(tl.float32)
        tl.store(tile_mask_ptr + pid_m * stride_mask + pid_n, keep.to(tl.int8))

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
    fp32 accumulator). ACCUMULATE reads `out` first; FINAL writes the sum to `final`
    instead (dE in its own dtype, after the last slab). SCALED multiplies the product by
    scale_ptr[0], undoing grad_logits_kernel's scaling. Operands come as base tensors plus
    element offsets, never as views, so torch.compile sees whole buffers mutated.
    """
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    # Out-of-range rows/columns read row/column 0 (never stored), so loads mask only K.
    safe_m = tl.where(m_mask, offs_m, 0).to(tl.int64)
    safe_n = tl.where(n_mask, offs_n, 0).to(tl.int64)
    a_ptrs = a_ptr + a_offset + safe_m[:, None] * stride_am + offs_k.to(tl.int64)[None, :] * stride_ak
    b_ptrs = b_ptr + b_offset + offs_k.to(tl.int64)[:, None] * stride_bk + safe_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None], other=0.0)
        acc = mma(acc, a, b, UPCAST, IEEE)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if SCALED:
        acc = acc * tl.load(scale_ptr)
    mask = m_mask[:, None] & n_mask[None, :]
    out_ptrs = out_ptr + out_offset + offs_m.to(tl.int64)[:, None] * stride_om + offs_n.to(tl.int64)[None, :] * stride_on
    if ACCUMULATE:
        acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    if FINAL:
        final_ptrs = (final_ptr + final_offset + offs_m.to(tl.int64)[:, None] * stride_fm
                      + offs_n.to(tl.int64)[None, :] * stride_fn)
        tl.store(final_ptrs, acc.to(final_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def sparse_grad_hidden_kernel(
    grad_logits_ptr, tile_mask_ptr, c_ptr, vocab_order_ptr, scale_ptr,
    acc_ptr, acc_offset, final_ptr, final_offset,
    rows, cols, col_start, D,
    stride_gm, stride_gn, stride_mask, stride_cv, stride_cd,
    ACCUMULATE: tl.constexpr, FINAL: tl.constexpr, SCALED: tl.constexpr,
    TILE_M: tl.constexpr, TILE_N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """Filtered mode's dE[chunk] += d_logits @ c[vocab_order[slab]], skipping the d-logits
    tiles (TILE_M x TILE_N, grad_logits_kernel's tiles) that the filter zeroed.

    One program: TILE_M rows x BLOCK_N of D, summing over the slab's kept tiles of its row
    block. acc and final are (rows, D) row-major, as in matmul_kernel.
    """
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(rows, TILE_M), tl.cdiv(D, BLOCK_N), GROUP_M)
    offs_m = pid_m * TILE_M + tl.arange(0, TILE_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < rows
    n_mask = offs_n < D
    safe_n = tl.where(n_mask, offs_n, 0).to(tl.int64)
    acc = tl.zeros((TILE_M, BLOCK_N), dtype=tl.float32)
    for tile in range(0, tl.cdiv(cols, TILE_N)):
        if tl.load(tile_mask_ptr + pid_m * stride_mask + tile) != 0:
            for part in tl.static_range(TILE_N // BLOCK_K):
                offs_k = tile * TILE_N + part * BLOCK_K + tl.arange(0, BLOCK_K)
                k_mask = offs_k < cols
                a = tl.load(grad_logits_ptr + offs_m.to(tl.int64)[:, None] * stride_gm
                            + offs_k.to(tl.int64)[None, :] * stride_gn,
                            mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                vocab = tl.load(vocab_order_ptr + col_start + offs_k, mask=k_mask, other=0).to(tl.int64)
                b = tl.load(c_ptr + vocab[:, None] * stride_cv + safe_n[None, :] * stride_cd,
                            mask=k_mask[:, None], other=0.0)
                acc = mma(acc, a, b, UPCAST, IEEE)
    if SCALED:
        acc = acc * tl.load(scale_ptr)
    mask = m_mask[:, None] & n_mask[None, :]
    out = offs_m.to(tl.int64)[:, None] * D + offs_n.to(tl.int64)[None, :]
    if ACCUMULATE:
        acc += tl.load(acc_ptr + acc_offset + out, mask=mask, other=0.0).to(tl.float32)
    if FINAL:
        tl.store(final_ptr + final_offset + out, acc.to(final_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(acc_ptr + acc_offset + out, acc.to(acc_ptr.dtype.element_ty), mask=mask)


@triton.jit
def sparse_grad_classifier_kernel(
    grad_logits_ptr, tile_mask_ptr, e_ptr, vocab_order_ptr, scale_ptr, grad_c_ptr,
    rows, cols, row_start, col_start, D,
    stride_gm, stride_gn, stride_mask, stride_en, stride_ed,
    ACCUMULATE: tl.constexpr, SCALED: tl.constexpr,
    TILE_M: tl.constexpr, TILE_N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """Filtered mode's dC[vocab_order[slab]] (+)= d_logits.T @ e[chunk], skipping zeroed
    d-logits tiles; rows of dC are written at their tokens' own positions.

    One program: TILE_N slab columns x BLOCK_N of D, summing over the chunk's kept tiles of
    its tile column. A tile column with no kept tile still writes its zeros (or keeps the
    previous chunks' sum with ACCUMULATE). grad_c is (V, D) row-major.
    """
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(cols, TILE_N), tl.cdiv(D, BLOCK_N), GROUP_M)
    offs_m = pid_m * TILE_N + tl.arange(0, TILE_N)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < cols
    n_mask = offs_n < D
    safe_n = tl.where(n_mask, offs_n, 0).to(tl.int64)
    acc = tl.zeros((TILE_N, BLOCK_N), dtype=tl.float32)
    for tile in range(0, tl.cdiv(rows, TILE_M)):
        if tl.load(tile_mask_ptr + tile * stride_mask + pid_m) != 0:
            for part in tl.static_range(TILE_M // BLOCK_K):
                offs_k = tile * TILE_M + part * BLOCK_K + tl.arange(0, BLOCK_K)
                k_mask = offs_k < rows
                a = tl.load(grad_logits_ptr + offs_k.to(tl.int64)[None, :] * stride_gm
                            + offs_m.to(tl.int64)[:, None] * stride_gn,
                            mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                b = tl.load(e_ptr + (row_start + offs_k).to(tl.int64)[:, None] * stride_en
                            + safe_n[None, :] * stride_ed, mask=k_mask[:, None], other=0.0)
                acc = mma(acc, a, b, UPCAST, IEEE)
    if SCALED:
        acc = acc * tl.load(scale_ptr)
    vocab = tl.load(vocab_order_ptr + col_start + offs_m, mask=m_mask, other=0).to(tl.int64)
    mask = m_mask[:, None] & n_mask[None, :]
    out = grad_c_ptr + vocab[:, None] * D + offs_n.to(tl.int64)[None, :]
    if ACCUMULATE:
        acc += tl.load(out, mask=mask, other=0.0).to(tl.float32)
    tl.store(out, acc.to(grad_c_ptr.dtype.element_ty), mask=mask)
