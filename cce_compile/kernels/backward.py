"""Backward kernels: recompute a slab of logits into its gradient, then two GEMMs."""

import triton
import triton.language as tl

from .tiles import exp_shifted, finish_gemm, grouped_tile, load_tile, logits_tile, logits_tile_tma, mma


@triton.jit
def grad_from_logits(
    logits, rows, vocab, row_mask, col_mask, vocab_first, vocab_last, targets_ptr, weight_ptr, lse_ptr,
    coef_softmax_ptr, coef_target_ptr, coef_smooth_ptr, coef_entropy_ptr, scale_ptr, softcap,
    HAS_SOFTCAP: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_ENTROPY: tl.constexpr,
    SCALED: tl.constexpr,
):
    """d loss / d logits of one tile, whatever it holds outside the masks (callers mask).

    With p = softmax, y the target and per-row coefficients a, b, s computed by the op:
        d_logit[i, j] = a[i] * p[i, j] - b[i] * [j == y_i] - s[i] * w[j] - h[i] * p[i, j] * (logit[i, j] - lse[i])
    (the last with HAS_ENTROPY: linear_log_probs' entropy, about lse so that it stays bounded), then the soft-cap's chain rule
    (`logits` are the capped ones; the coefficients carry a temperature's 1 / T already). With
    SCALED (fp16), the tile is divided by scale_ptr[0] (a bound on the call's d-logits over
    ops/backward.FP16_HEADROOM) so small gradients stay in fp16's normal range; the GEMMs
    multiply it back. Every vocab id of the tile lies in
    [vocab_first, vocab_last]: tiles that no row's target can fall in skip the search for it.
    """
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    targets = tl.load(targets_ptr + rows, mask=row_mask, other=-1)
    coef_softmax = tl.load(coef_softmax_ptr + rows, mask=row_mask, other=0.0)

    softmax = exp_shifted(logits, lse)
    grad = coef_softmax[:, None] * softmax
    if HAS_ENTROPY:
        coef_entropy = tl.load(coef_entropy_ptr + rows, mask=row_mask, other=0.0)
        # p * log p is 0 where p is (a -inf bias), not NaN
        grad -= coef_entropy[:, None] * tl.where(softmax > 0.0, softmax * (logits - lse[:, None]), 0.0)
    if tl.max(((targets >= vocab_first) & (targets <= vocab_last)).to(tl.int32), axis=0) > 0:
        coef_target = tl.load(coef_target_ptr + rows, mask=row_mask, other=0.0)
        is_target = (vocab[None, :] == targets[:, None]) & col_mask[None, :]
        grad -= tl.where(is_target, coef_target[:, None], 0.0)
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
    if SCALED:
        grad = grad / tl.load(scale_ptr)
    return grad


@triton.jit
def grad_logits_kernel(
    e_ptr, c_ptr, bias_ptr, targets_ptr, weight_ptr, lse_ptr,
    coef_softmax_ptr, coef_target_ptr, coef_smooth_ptr, coef_entropy_ptr, scale_ptr, vocab_order_ptr,
    grad_logits_ptr, tile_bias_sums_ptr, step_tiles_ptr, step_counts_ptr, step_index, capacity, chunk_tile_rows,
    row_start, row_end, col_start, col_end, D,
    stride_en, stride_ed, stride_cv, stride_cd, stride_gm, stride_gn,
    softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, LOGIT_SCALE: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr, HAS_ENTROPY: tl.constexpr, FILTER: tl.constexpr, STRIDED: tl.constexpr,
    SCALED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """d loss / d logits (grad_from_logits) for rows [row_start, row_end) x cols [col_start, col_end).

    The tile is written in the input dtype at (i - row_start, j - col_start) of the slab
    buffer; rows or columns outside the ranges are left alone (the GEMMs that follow mask them).
    With FILTER, columns are positions in `vocab_order` (likely tokens first, so the few
    tiles that matter cluster) and only the kept tiles are computed: program k computes tile
    step_tiles[step_index, k] (tile column * chunk_tile_rows + tile row of the chunk) into
    slot k of the compact buffer (BLOCK_M x BLOCK_N, row-major, zero outside the ranges),
    with HAS_BIAS adding its column sums in fp32 to tile_bias_sums [tile row, vocab position]
    (dbias's share: a token chunk computes each tile once, so no two programs add to the same
    sums, and no pass over the slots reads them back); programs past step_counts[step_index]
    return at once (ops/filtering.py's StepLists). With
    STRIDED as well, program k computes slots k, k + programs, ... up to the count: a launch
    of a program per SM serves a step of any size, and an empty step costs only those.
    """
    if FILTER:
        slot = tl.program_id(0)
        if STRIDED:  # a call of its own: folding the plain call into this loop would change that kernel's code
            for slot in range(slot, tl.load(step_counts_ptr + step_index), tl.num_programs(0)):
                tile = tl.load(step_tiles_ptr + step_index * capacity + slot)
                grad_logits_tile(
                    e_ptr, c_ptr, bias_ptr, targets_ptr, weight_ptr, lse_ptr, coef_softmax_ptr, coef_target_ptr,
                    coef_smooth_ptr, coef_entropy_ptr, scale_ptr, vocab_order_ptr, grad_logits_ptr,
                    tile_bias_sums_ptr, slot, tile % chunk_tile_rows, tile // chunk_tile_rows, row_start, row_end,
                    col_start, col_end, D, stride_en, stride_ed, stride_cv, stride_cd, stride_gm, stride_gn, softcap,
                    HAS_BIAS, HAS_SOFTCAP, LOGIT_SCALE, HAS_WEIGHT, HAS_SMOOTHING, HAS_ENTROPY, FILTER, SCALED,
                    BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, UPCAST, IEEE,
                )
            return
        if slot >= tl.load(step_counts_ptr + step_index):
            return
        tile = tl.load(step_tiles_ptr + step_index * capacity + slot)
        pid_m, pid_n = tile % chunk_tile_rows, tile // chunk_tile_rows
    else:
        slot = 0
        num_m = tl.cdiv(row_end - row_start, BLOCK_M)
        num_n = tl.cdiv(col_end - col_start, BLOCK_N)
        pid_m, pid_n = grouped_tile(tl.program_id(0), num_m, num_n, GROUP_M)
    grad_logits_tile(
        e_ptr, c_ptr, bias_ptr, targets_ptr, weight_ptr, lse_ptr, coef_softmax_ptr, coef_target_ptr,
        coef_smooth_ptr, coef_entropy_ptr, scale_ptr, vocab_order_ptr, grad_logits_ptr, tile_bias_sums_ptr, slot,
        pid_m, pid_n, row_start, row_end, col_start, col_end, D, stride_en, stride_ed, stride_cv, stride_cd,
        stride_gm, stride_gn, softcap, HAS_BIAS, HAS_SOFTCAP, LOGIT_SCALE, HAS_WEIGHT, HAS_SMOOTHING, HAS_ENTROPY,
        FILTER, SCALED,
        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, UPCAST, IEEE,
    )


@triton.jit
def grad_logits_tile(
    e_ptr, c_ptr, bias_ptr, targets_ptr, weight_ptr, lse_ptr,
    coef_softmax_ptr, coef_target_ptr, coef_smooth_ptr, coef_entropy_ptr, scale_ptr, vocab_order_ptr,
    grad_logits_ptr, tile_bias_sums_ptr, slot, pid_m, pid_n, row_start, row_end, col_start, col_end, D,
    stride_en, stride_ed, stride_cv, stride_cd, stride_gm, stride_gn, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, LOGIT_SCALE: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr, HAS_ENTROPY: tl.constexpr, FILTER: tl.constexpr, SCALED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """grad_logits_kernel's tile (pid_m, pid_n) of the slab, stored there or (FILTER) in `slot`."""
    local_rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    local_cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = row_start + local_rows
    cols = col_start + local_cols
    row_mask = rows < row_end
    col_mask = cols < col_end
    vocab = cols
    vocab_first, vocab_last = col_start + pid_n * BLOCK_N, col_start + pid_n * BLOCK_N + BLOCK_N - 1
    if FILTER:  # positions in the vocab order: any id
        vocab = tl.load(vocab_order_ptr + cols, mask=col_mask, other=0)
        vocab_first, vocab_last = 0, 2**31 - 1

    logits = logits_tile(
        e_ptr, c_ptr, bias_ptr, rows, vocab, row_mask, col_mask, D,
        stride_en, stride_ed, stride_cv, stride_cd, softcap,
        HAS_BIAS, HAS_SOFTCAP, LOGIT_SCALE, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, UPCAST, IEEE,
    )
    grad = grad_from_logits(
        logits, rows, vocab, row_mask, col_mask, vocab_first, vocab_last, targets_ptr, weight_ptr, lse_ptr,
        coef_softmax_ptr, coef_target_ptr, coef_smooth_ptr, coef_entropy_ptr, scale_ptr, softcap,
        HAS_SOFTCAP, HAS_WEIGHT, HAS_SMOOTHING, HAS_ENTROPY, SCALED,
    )
    if FILTER:  # the sparse GEMMs read whole slots
        out = (grad_logits_ptr + tl.cast(slot, tl.int64) * (BLOCK_M * BLOCK_N)
               + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :])
        grad = tl.where(row_mask[:, None] & col_mask[None, :], grad, 0.0)
        tl.store(out, grad.to(grad_logits_ptr.dtype.element_ty))
        if HAS_BIAS:
            sums = (tile_bias_sums_ptr + tl.cast(pid_m, tl.int64) * (tl.cdiv(col_end - col_start, BLOCK_N) * BLOCK_N)
                    + local_cols)
            tl.store(sums, tl.load(sums) + tl.sum(grad, axis=0))
    else:
        out = (grad_logits_ptr + local_rows.to(tl.int64)[:, None] * stride_gm
               + local_cols.to(tl.int64)[None, :] * stride_gn)
        inside = row_mask[:, None] & col_mask[None, :]
        tl.store(out, grad.to(grad_logits_ptr.dtype.element_ty), mask=inside)


@triton.jit
def grad_logits_tma_kernel(
    e_desc, c_desc, grad_logits_desc, bias_ptr, targets_ptr, weight_ptr, lse_ptr,
    coef_softmax_ptr, coef_target_ptr, coef_smooth_ptr, coef_entropy_ptr, scale_ptr,
    row_start, rows, col_start, cols, D, num_programs, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, LOGIT_SCALE: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr, HAS_ENTROPY: tl.constexpr, SCALED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """grad_logits_kernel's dense slab (exact mode) as a persistent kernel on tensor
    descriptors: num_programs programs walk the slab's tiles, loading through the copy engine
    and storing each bf16/fp16 tile with an asynchronous bulk copy, which overlaps the next
    tile's loads. It wins where the K loop is long (on the H200, in the op: 1.05 against
    grad_logits_kernel's 1.19 x GEMM at D = 8192), so the op picks it by K steps
    (Policy.recompute_tma_min_k_steps).

    The descriptors view all of e and c and the whole d-logits buffer (built once per
    backward, not per slab: Python's per-launch cost counts where slabs are many); the
    slab is rows x cols from (row_start, col_start). Rows and columns past it are loaded (the
    next chunk or slab, or the copy engine's zero fill past the tensors), computed unmasked
    and stored only within the buffer, where neither the GEMMs nor the bias sum read them.
    """
    num_m = tl.cdiv(rows, BLOCK_M)
    num_n = tl.cdiv(cols, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_m * num_n, num_programs):
        pid_m, pid_n = grouped_tile(tile, num_m, num_n, GROUP_M)
        local_rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        local_cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = local_rows < rows
        col_mask = local_cols < cols
        vocab = col_start + local_cols
        logits = logits_tile_tma(
            e_desc, c_desc, bias_ptr, row_start + pid_m * BLOCK_M, col_start + pid_n * BLOCK_N, vocab, col_mask,
            D, softcap, HAS_BIAS, HAS_SOFTCAP, LOGIT_SCALE, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, IEEE,
        )
        grad = grad_from_logits(
            logits, row_start + local_rows, vocab, row_mask, col_mask, col_start + pid_n * BLOCK_N,
            col_start + pid_n * BLOCK_N + BLOCK_N - 1, targets_ptr, weight_ptr, lse_ptr,
            coef_softmax_ptr, coef_target_ptr, coef_smooth_ptr, coef_entropy_ptr, scale_ptr, softcap,
            HAS_SOFTCAP, HAS_WEIGHT, HAS_SMOOTHING, HAS_ENTROPY, SCALED,
        )
        grad_logits_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], grad.to(grad_logits_desc.dtype))


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
    begin_ptr, count_ptr, lists_offset, m_tiles, step_bounds_ptr, step_index,
    entry_slots_ptr, entry_tiles_ptr, entries_offset,
    scale_ptr, M, N, K,
    stride_bk, stride_bn,
    BY_COLUMN: tl.constexpr, STRIDED: tl.constexpr, SKIP_EMPTY: tl.constexpr, ACCUMULATE: tl.constexpr,
    FINAL: tl.constexpr, SCALED: tl.constexpr, TILE_M: tl.constexpr, TILE_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """out[M, N] (+)= a @ b[K, N] where `a` is the d-logits tiles the filter kept, stored
    compactly by grad_logits_kernel (one BLOCK_M x BLOCK_N row-major tile per slot): filtered
    mode's two gradient GEMMs for one backward step (ops/filtering.py's StepLists).

    The launch covers m_tiles m tiles (dE: from 0; dC: from the step's first tile column
    step_bounds[step_index] and before the next step's, both read here, so a launch enqueued
    while only the device knows the step's columns can run past them; STRIDED, each program
    walks the step's columns m_tiles apart from its own, so a launch of a few programs per
    SM covers a step of any width and an empty step costs only those); m tile t walks the entries
    [begin[t], begin[t] + count[t]) (begin and count at lists_offset; the entries at
    entries_offset, the step's first), one per kept tile: its slot in `a` and its tile on K.
    - dE (BY_COLUMN false): m tiles are tile rows, an entry's slot and tile column come from
      entry_slots / entry_tiles; dE chunk += tiles @ c[vocab_order[...]] (b's rows gathered
      through b_index), M = chunk rows, K = V.
    - dC (BY_COLUMN): m tiles are tile columns, whose slots are contiguous (the entries are
      the slots) and entry_tiles gives each slot's tile row; dC[vocab_order[...]] (+)=
      tiles.T @ e chunk (out's rows scattered through out_index), M = V, K = chunk rows.
    Out, final: row-major with N columns. ACCUMULATE, FINAL and SCALED as in finish_gemm; an
    accumulating program with no kept tile leaves `out` untouched, and with SKIP_EMPTY (dE's
    launches of steps only the device knows, most of them empty; not FINAL) returns before the
    tile's setup.
    """
    pid_m, pid_n = grouped_tile(tl.program_id(0), m_tiles, tl.cdiv(N, BLOCK_N), GROUP_M)
    if BY_COLUMN:
        first = tl.load(step_bounds_ptr + step_index)
        if STRIDED:  # a call of its own: folding the plain call into this loop would change that kernel's code
            for m_tile in range(first + pid_m, tl.load(step_bounds_ptr + step_index + 1), m_tiles):
                sparse_tile(
                    a_ptr, b_ptr, b_offset, b_index_ptr, out_ptr, out_offset, out_index_ptr, final_ptr, final_offset,
                    begin_ptr, count_ptr, lists_offset, entry_slots_ptr, entry_tiles_ptr, entries_offset, scale_ptr,
                    M, N, K, stride_bk, stride_bn, m_tile, pid_n, BY_COLUMN, ACCUMULATE, FINAL, SCALED, TILE_M,
                    TILE_K, BLOCK_N, BLOCK_K, UPCAST, IEEE,
                )
            return
        m_tile = pid_m + first
        if m_tile >= tl.load(step_bounds_ptr + step_index + 1):
            return
    else:
        m_tile = pid_m
    if SKIP_EMPTY and ACCUMULATE and not FINAL:
        if tl.load(count_ptr + lists_offset + m_tile) == 0:
            return
    sparse_tile(
        a_ptr, b_ptr, b_offset, b_index_ptr, out_ptr, out_offset, out_index_ptr, final_ptr, final_offset,
        begin_ptr, count_ptr, lists_offset, entry_slots_ptr, entry_tiles_ptr, entries_offset, scale_ptr,
        M, N, K, stride_bk, stride_bn, m_tile, pid_n, BY_COLUMN, ACCUMULATE, FINAL, SCALED, TILE_M,
        TILE_K, BLOCK_N, BLOCK_K, UPCAST, IEEE,
    )


@triton.jit
def sparse_tile(
    a_ptr, b_ptr, b_offset, b_index_ptr, out_ptr, out_offset, out_index_ptr, final_ptr, final_offset,
    begin_ptr, count_ptr, lists_offset, entry_slots_ptr, entry_tiles_ptr, entries_offset, scale_ptr,
    M, N, K, stride_bk, stride_bn, m_tile, pid_n,
    BY_COLUMN: tl.constexpr, ACCUMULATE: tl.constexpr, FINAL: tl.constexpr, SCALED: tl.constexpr,
    TILE_M: tl.constexpr, TILE_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """sparse_matmul_kernel's output tile (m_tile, pid_n): its kept tiles' products, stored."""
    PARTS: tl.constexpr = TILE_K // BLOCK_K
    TILE: tl.constexpr = TILE_M * TILE_K
    in_tile_m = tl.arange(0, TILE_M)
    offs_m = m_tile * TILE_M + in_tile_m
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    begin = entries_offset + tl.load(begin_ptr + lists_offset + m_tile)
    kept = tl.load(count_ptr + lists_offset + m_tile)
    acc = tl.zeros((TILE_M, BLOCK_N), dtype=tl.float32)
    # One flat loop over (kept tile, part of it): no branch, so the loads pipeline.
    for step in range(0, kept * PARTS):
        entry = begin + step // PARTS
        in_tile_k = (step % PARTS) * BLOCK_K + tl.arange(0, BLOCK_K)
        k_tile = tl.load(entry_tiles_ptr + entry)
        if BY_COLUMN:
            slot = entry - entries_offset
            a_offsets = in_tile_k[None, :] * TILE_M + in_tile_m[:, None]
        else:
            slot = tl.load(entry_slots_ptr + entry)
            a_offsets = in_tile_m[:, None] * TILE_K + in_tile_k[None, :]
        a = tl.load(a_ptr + slot.to(tl.int64) * TILE + a_offsets)
        offs_k = k_tile * TILE_K + in_tile_k
        k_mask = offs_k < K
        b_rows = offs_k
        if not BY_COLUMN:
            b_rows = tl.load(b_index_ptr + offs_k, mask=k_mask, other=0)
        b = load_tile(b_ptr + b_offset, b_rows, offs_n, k_mask, n_mask, stride_bk, stride_bn)
        acc = mma(acc, a, b, UPCAST, IEEE)
    out_rows = offs_m.to(tl.int64)
    if BY_COLUMN:
        out_rows = tl.load(out_index_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    live_m = M
    if ACCUMULATE and not FINAL:
        live_m = tl.where(kept > 0, M, 0)
    out = out_rows[:, None] * N + offs_n.to(tl.int64)[None, :]
    finish_gemm(
        acc, out_ptr + out_offset + out, final_ptr + final_offset + out,
        (offs_m < live_m)[:, None] & n_mask[None, :], scale_ptr, ACCUMULATE, FINAL, SCALED,
    )
