"""Forward kernel: per-row log-sum-exp of e @ c.T without storing the logits."""

import triton
import triton.language as tl

from .tiles import LOG2E, exp_shifted, grouped_tile, log_sumexp_about_max, logits_tile, logits_tile_tma


@triton.jit
def tile_target_logit(logits, vocab, col_mask, targets):
    """Each row's target logit if its target is one of the tile's columns, else 0."""
    is_target = (vocab[None, :] == targets[:, None]) & col_mask[None, :]
    return tl.sum(tl.where(is_target, logits, 0.0), axis=1)


@triton.jit
def tile_weighted_sum(logits, vocab, col_mask, weight_ptr, HAS_WEIGHT: tl.constexpr):
    """sum_j w_j * logit_j over the tile's columns (w = 1 without weights): label smoothing's term."""
    if HAS_WEIGHT:
        w = tl.load(weight_ptr + vocab, mask=col_mask, other=0.0).to(tl.float32)
        return tl.sum(tl.where(col_mask[None, :], logits * w[None, :], 0.0), axis=1)
    return tl.sum(tl.where(col_mask[None, :], logits, 0.0), axis=1)


@triton.jit
def tile_entropy_sums(logits, exps, shift):
    """The entropy's two sums over the tile's columns about `shift` (each row's, at least its
    logits; `exps` the exponentials exp(logit_j - shift)): sum_j exp_j * (shift - logit_j),
    whence entropy = log(sum of exps) + it / (sum of exps), and the sum of exp_j over the
    logits below the shift (with the shift the row's largest logit, its sum of exps less the
    largest's own 1, which log_sumexp_about_max takes log1p of). Every term is >= 0, so
    nothing cancels; the same sum about 0 (sum_j p_j logit_j) is the size of the logits, and
    lse less it would be off by their rounding (~|logit| * 6e-8), negative for a near one-hot
    row. Masked columns and tokens a -inf bias rules out hold -inf logits and 0
    exponentials: their infinite gap is clamped to a finite one, so that they count 0 (as
    p log p does at p = 0), not 0 * inf = NaN."""
    gaps = tl.minimum(shift[:, None] - logits, 3.0e38)
    below = tl.where(gaps > 0.0, exps, 0.0)
    return tl.sum(below * gaps, axis=1), tl.sum(below, axis=1)


@triton.jit
def rebased_gap_sum(gap_sum, sumexp, old_max, shift, rescale):
    """tile_entropy_sums' gap sum about `shift` from the same sum about old_max <= shift
    (`gap_sum`), the sum of exp(logit - old_max) (`sumexp`) and rescale = exp(old_max -
    shift): the online softmax's rescaling, plus each column's gap growing by shift -
    old_max. 0 before any column (old_max -inf and sumexp 0, whose product would be NaN)."""
    return tl.where(sumexp > 0.0, rescale * (gap_sum + (shift - old_max) * sumexp), 0.0)


@triton.jit
def rebased_strict_sum(strict_sum, sumexp, old_max, new_max, rescale):
    """tile_entropy_sums' strict sum about new_max from the same about old_max (`strict_sum`),
    the sum of exp(logit - old_max) (`sumexp`) and rescale = exp(old_max - new_max): where the
    max rose, every column so far lies below it, so their whole sum, rescaled; else
    unchanged. 0 before any column (sumexp 0)."""
    return tl.where(new_max > old_max, rescale * sumexp, strict_sum)


@triton.jit
def tile_softmax_entropy(logits, exps, shift, sumexp):
    """Each row's entropy of its softmax over the tile's columns, `shift` its largest logit
    there, `exps` and `sumexp` the exponentials about it and their sum: log_sumexp_about_max
    plus the mean gap (tile_entropy_sums), two terms >= 0; and that mean gap, shift less the
    mean logit (whence lse_minus_mean). NaN for a row of no column."""
    gap_sum, strict_sum = tile_entropy_sums(logits, exps, shift)
    return log_sumexp_about_max(sumexp, strict_sum) + gap_sum / sumexp, gap_sum / sumexp


@triton.jit
def lse_minus_mean(lse, shift, mean_gap):
    """A row's stored lse less its softmax-weighted mean logit, from its mean gap below
    `shift` (its largest logit or tile lse): what the entropy's backward reads as lse - mean
    logit (ops/loss_terms.log_prob_coefficients). The entropy is that plus lse's rounding,
    which on a near one-hot row is as large as the entropy; there lse - shift is exact."""
    return (lse - shift) + mean_gap


@triton.jit
def lse_forward_kernel(
    e_ptr, c_ptr, bias_ptr, targets_ptr, weight_ptr, vocab_order_ptr,
    partial_ptr, tile_max_ptr,
    N, V, D, tiles_per_split, num_splits, stat_stride, stride_tile_max,
    stride_en, stride_ed, stride_cv, stride_cd, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, LOGIT_SCALE: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    NEED_WEIGHTED_SUM: tl.constexpr, NEED_ENTROPY: tl.constexpr, FILTER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """One program: BLOCK_M rows against `tiles_per_split` vocab tiles of BLOCK_N columns.

    Writes partial[stat, split, row] for stat = the running max and sum of exp (an online
    softmax, merged across splits by the op), the target's logit if the target falls in
    this split, (NEED_WEIGHTED_SUM) sum_j w_j * logit_j for label smoothing, and
    (NEED_ENTROPY, at the next two stats) the entropy's sums about the running max, rebased as
    it grows: sum_j exp(logit_j - max) * (max - logit_j) and the sum of exp(logit_j - max)
    over the logits below the max (tile_entropy_sums, rebased_gap_sum, rebased_strict_sum);
    the op merges the splits' (ops/forward.split_entropy_sums) into the entropy and, for the
    entropy's backward, lse less the mean logit.
    Out-of-range targets match no column, so nothing is ever read at a target index. With
    FILTER (filtered mode), columns are positions in `vocab_order`, and each row's largest
    logit per vocab tile goes to tile_max[0, row, tile], its log-sum-exp over the tile to
    tile_max[1, row, tile], with NEED_ENTROPY the entropy of its softmax over the tile to
    tile_max[2, row, tile]: the backward skips the tiles where the largest is far below the
    row's lse, and restores the mass of those it skips from the second (the entropy's term
    from the second less the third, the tile's mean logit, stored in fp16: there the tile's
    entropy is taken about the running max, not about its own largest logit).
    """
    pid_m, pid_s = grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_M), num_splits, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < N
    targets = tl.load(targets_ptr + rows, mask=row_mask, other=-1)

    row_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    row_sumexp = tl.zeros((BLOCK_M,), dtype=tl.float32)
    target_logit = tl.zeros((BLOCK_M,), dtype=tl.float32)
    weighted_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    gap_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    strict_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for t in range(0, tiles_per_split):
        tile = pid_s * tiles_per_split + t
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < V
        vocab = cols
        if FILTER:
            vocab = tl.load(vocab_order_ptr + cols, mask=col_mask, other=0)
        logits = logits_tile(
            e_ptr, c_ptr, bias_ptr, rows, vocab, row_mask, col_mask, D,
            stride_en, stride_ed, stride_cv, stride_cd, softcap,
            HAS_BIAS, HAS_SOFTCAP, LOGIT_SCALE, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, UPCAST, IEEE,
        )
        # Columns past V (with FILTER their vocab id reads as 0) are never a target.
        target_logit += tile_target_logit(logits, vocab, col_mask, targets)
        if NEED_WEIGHTED_SUM:
            weighted_sum += tile_weighted_sum(logits, vocab, col_mask, weight_ptr, HAS_WEIGHT)
        logits = tl.where(col_mask[None, :], logits, float("-inf"))
        tile_row_max = tl.max(logits, axis=1)
        new_max = tl.maximum(row_max, tile_row_max)
        # A row whose columns are all masked keeps max -inf; shift by 0 there, not by -inf.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        exps = exp_shifted(logits, shift)
        tile_sumexp = tl.sum(exps, axis=1)
        if NEED_ENTROPY:
            tile_gap, tile_strict = tile_entropy_sums(logits, exps, shift)
            rescale = tl.exp2((row_max - shift) * LOG2E)
            gap_sum = rebased_gap_sum(gap_sum, row_sumexp, row_max, shift, rescale) + tile_gap
            strict_sum = rebased_strict_sum(strict_sum, row_sumexp, row_max, new_max, rescale) + tile_strict
        if FILTER:
            live = row_mask & (rows * 0 + tile * BLOCK_N < V)  # the last split may run past V
            at = tile_max_ptr + rows.to(tl.int64) * stride_tile_max + tile
            tl.store(at, tile_row_max, mask=live)
            tl.store(at + tl.cast(N, tl.int64) * stride_tile_max, shift + tl.log(tile_sumexp), mask=live)
            if NEED_ENTROPY:  # log 0 + 0 / 0 where the tile's exponentials all underflow: a tile of no mass
                entropy_over_tile = tl.log(tile_sumexp) + tile_gap / tile_sumexp
                tl.store(at + 2 * tl.cast(N, tl.int64) * stride_tile_max, entropy_over_tile, mask=live)
        row_sumexp = row_sumexp * tl.exp2((row_max - shift) * LOG2E) + tile_sumexp
        row_max = new_max

    out = partial_ptr + pid_s.to(tl.int64) * N + rows
    stat_step = tl.cast(stat_stride, tl.int64)  # 3 x (splits x N) passes 2^31 first
    tl.store(out, row_max, mask=row_mask)
    tl.store(out + stat_step, row_sumexp, mask=row_mask)
    tl.store(out + 2 * stat_step, target_logit, mask=row_mask)
    if NEED_WEIGHTED_SUM:
        tl.store(out + 3 * stat_step, weighted_sum, mask=row_mask)
    if NEED_ENTROPY:
        entropy_stat = 3
        if NEED_WEIGHTED_SUM:
            entropy_stat = 4
        tl.store(out + entropy_stat * stat_step, gap_sum, mask=row_mask)
        tl.store(out + (entropy_stat + 1) * stat_step, strict_sum, mask=row_mask)


@triton.jit
def lse_forward_tma_kernel(
    e_desc, c_desc, bias_ptr, targets_ptr, weight_ptr, tile_lse_ptr, target_logit_ptr, tile_weighted_sum_ptr,
    tile_max_ptr, tile_entropy_ptr, N, row_start, rows_in_launch, V, D, num_programs, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, LOGIT_SCALE: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    NEED_WEIGHTED_SUM: tl.constexpr,
    NEED_ENTROPY: tl.constexpr, NEED_LSE_MINUS_MEAN: tl.constexpr, STORE_TILE_MAX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """lse_forward_kernel as a persistent kernel on tensor descriptors: num_programs programs
    walk the (row block, vocab tile) tiles in one flattened loop, so the copy engine loads the
    next tile's operands while this tile's softmax runs (on the H200, in the op: 0.95-1.17 x a
    GEMM against lse_forward_kernel's 1.14-1.17 x, docs/notes/persistent-forward.md).

    A launch walks rows [row_start, row_start + rows_in_launch) of e's N: the op launches it per
    row chunk, since one grid over a large N lets its programs drift apart over their ~1000 tiles
    each, and the operands in flight at once outgrow L2 (ncu on the H200, Llama-3's head: 15.6 GB
    of DRAM reads at N = 8192, 139.5 GB at 32768; docs/notes/persistent-forward.md).

    Per tile it writes tile_lse[tile column, row], the rows' log-sum-exp over the tile's
    columns (the op merges them), the target's logit to target_logit[row] where the target
    falls in the tile (one tile per row, so no two programs write a row; out-of-range targets
    match none), with NEED_WEIGHTED_SUM label smoothing's sum to tile_weighted_sum, with
    NEED_ENTROPY the entropy of the rows' softmax over the tile to tile_entropy
    (tile_softmax_entropy; merge_tile_stats_kernel merges the tiles'), with
    NEED_LSE_MINUS_MEAN (the entropy's backward will run) also the tile's stored lse less its
    mean logit, which the entropy and lse stored in fp32 have lost, to a second plane of
    tile_entropy, tile_entropy[1, tile column, row]. With
    STORE_TILE_MAX (filtered mode, whose op hands it the vocabulary already in vocab order)
    the rows' largest logit goes to tile_max[0, row, tile column] and their tile log-sum-exp
    to tile_max[1, row, tile column] instead of tile_lse (one (N, tiles) fp32 buffer less in
    the forward: 78 MB at Qwen2.5's shape), and with NEED_ENTROPY their tile entropy to
    tile_max[2, row, tile column] instead of tile_entropy (whence filtered mode's backward
    takes the tile mean logits it puts back for the entropy's skipped tiles), and with
    NEED_LSE_MINUS_MEAN the tile's lse less its mean logit to tile_max[3, row, tile column].
    """
    num_m = tl.cdiv(rows_in_launch, BLOCK_M)
    num_n = tl.cdiv(V, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_m * num_n, num_programs, flatten=True):
        pid_m, pid_n = grouped_tile(tile, num_m, num_n, GROUP_M)
        local_rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rows = row_start + local_rows
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = local_rows < rows_in_launch
        col_mask = cols < V
        logits = logits_tile_tma(
            e_desc, c_desc, bias_ptr, row_start + pid_m * BLOCK_M, pid_n * BLOCK_N, cols, col_mask, D, softcap,
            HAS_BIAS, HAS_SOFTCAP, LOGIT_SCALE, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, IEEE,
        )
        out = pid_n.to(tl.int64) * N + rows
        if NEED_WEIGHTED_SUM:
            tl.store(tile_weighted_sum_ptr + out, tile_weighted_sum(logits, cols, col_mask, weight_ptr, HAS_WEIGHT),
                     mask=row_mask)
        # Past V the copy engine's zero fill gives logits of 0; masking them is one select per logit,
        # and it also gives the branch below a copy to read: a branch that reads the dot's result
        # itself makes ptxas serialize every wgmma of the kernel (0.93 -> 1.24 x GEMM at D = 8192
        # on the H200).
        logits = tl.where(col_mask[None, :], logits, float("-inf"))
        targets = tl.load(targets_ptr + rows, mask=row_mask, other=-1)
        first_col = pid_n * BLOCK_N
        hit = row_mask & (targets >= first_col) & (targets < tl.minimum(first_col + BLOCK_N, V))
        # The search for targets, a compare, select and add per logit, only in the tiles that
        # hold one (few, under a Zipfian batch).
        if tl.max(hit.to(tl.int32), axis=0) > 0:
            tl.store(target_logit_ptr + rows, tile_target_logit(logits, cols, col_mask, targets), mask=hit)
        tile_max = tl.max(logits, axis=1)
        shift = tl.where(tile_max == float("-inf"), 0.0, tile_max)  # as in lse_forward_kernel
        exps = exp_shifted(logits, shift)
        tile_sumexp = tl.sum(exps, axis=1)
        tile_lse = shift + tl.log(tile_sumexp)
        if STORE_TILE_MAX:
            at = tile_max_ptr + rows.to(tl.int64) * num_n + pid_n
            plane = tl.cast(N, tl.int64) * num_n
            tl.store(at, tile_max, mask=row_mask)
            tl.store(at + plane, tile_lse, mask=row_mask)
            if NEED_ENTROPY:
                entropy_at = at + 2 * plane
                tile_entropy, mean_gap = tile_softmax_entropy(logits, exps, shift, tile_sumexp)
                tl.store(entropy_at, tile_entropy, mask=row_mask)
                if NEED_LSE_MINUS_MEAN:
                    tl.store(at + 3 * plane, lse_minus_mean(tile_lse, shift, mean_gap), mask=row_mask)
        else:
            if NEED_ENTROPY:
                entropy_at = tile_entropy_ptr + out
                tile_entropy, mean_gap = tile_softmax_entropy(logits, exps, shift, tile_sumexp)
                tl.store(entropy_at, tile_entropy, mask=row_mask)
                if NEED_LSE_MINUS_MEAN:  # the second plane
                    tl.store(tile_entropy_ptr + tl.cast(N, tl.int64) * num_n + out,
                             lse_minus_mean(tile_lse, shift, mean_gap), mask=row_mask)
            tl.store(tile_lse_ptr + out, tile_lse, mask=row_mask)


@triton.jit
def merge_tile_stats_kernel(
    tile_lse_ptr, tile_entropy_ptr, lse_ptr, entropy_ptr, N, num_tiles, stride_tile, stride_row,
    stride_entropy_tile, stride_entropy_row, NEED_ENTROPY: tl.constexpr, NEED_LSE_MINUS_MEAN: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_TILES: tl.constexpr,
):
    """lse[row] = log-sum-exp over tiles of tile_lse[tile, row] and (NEED_ENTROPY) entropy[row]
    from the tiles' entropies tile_entropy[tile, row]: sum_T w_T (H_T + lse - L_T) with w_T =
    exp(L_T - lse) the tile's share of the softmax, L_T its lse and H_T its entropy (the
    entropy of the shares plus the tiles' mean), every term >= 0: summed as lse_forward_kernel
    sums its columns' (tile_entropy_sums, log_sumexp_about_max), each tile a column of logit
    L_T holding H_T. With NEED_LSE_MINUS_MEAN, N * num_tiles past each tile's entropy its lse
    less its mean logit K_T, and N past each row's entropy its lse less its mean logit: lse
    - L_T + K_T averaged by w_T, summed as the entropy is. One streaming pass over the (tile,
    row) buffers, which stay as they are.

    torch.logsumexp made temporaries the size of its input, so the forward's peak was ~3x its
    per-tile buffer (on Qwen2.5's shape 285 MB against 78 MB); the entropy's merge in torch
    took four more passes. +inf stays +inf, all -inf gives -inf, NaN stays NaN."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < N
    row_max = tl.full((BLOCK_ROWS,), float("-inf"), dtype=tl.float32)
    row_sumexp = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
    gap_sum = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)  # sum of exp(L_T - row_max) * (H_T + row_max - L_T)
    mean_gap_sum = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)  # sum of exp(L_T - row_max) * (K_T + row_max - L_T)
    strict_sum = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)  # sum of exp(L_T - row_max) where L_T < row_max
    for start in range(0, num_tiles, BLOCK_TILES):
        tiles = start + tl.arange(0, BLOCK_TILES)
        tiles64, rows64 = tiles.to(tl.int64)[:, None], rows.to(tl.int64)[None, :]
        mask = (tiles < num_tiles)[:, None] & row_mask[None, :]
        x = tl.load(tile_lse_ptr + tiles64 * stride_tile + rows64 * stride_row, mask=mask, other=float("-inf"))
        new_max = tl.maximum(row_max, tl.max(x, axis=0))
        # Shift by 0 where the max is infinite: exp(-inf - -inf) and exp(inf - inf) would be NaN.
        shift = tl.where(tl.abs(new_max) == float("inf"), 0.0, new_max)
        rescale = tl.exp(row_max - shift)
        weights = tl.exp(x - shift[None, :])
        if NEED_ENTROPY:
            entropies = tl.load(tile_entropy_ptr + tiles64 * stride_entropy_tile + rows64 * stride_entropy_row,
                                mask=mask, other=0.0)
            # A tile of weight 0 adds nothing, whatever its entropy (a masked or empty tile's may be NaN).
            gaps = tl.where(weights > 0.0, weights * (entropies + (shift[None, :] - x)), 0.0)
            gap_sum = rebased_gap_sum(gap_sum, row_sumexp, row_max, shift, rescale) + tl.sum(gaps, axis=0)
            if NEED_LSE_MINUS_MEAN:
                plane = tl.cast(N, tl.int64) * num_tiles
                tile_k = tl.load(tile_entropy_ptr + plane + tiles64 * stride_entropy_tile + rows64 * stride_entropy_row,
                                 mask=mask, other=0.0)
                mean_gaps = tl.where(weights > 0.0, weights * (tile_k + (shift[None, :] - x)), 0.0)
                mean_gap_sum = (rebased_gap_sum(mean_gap_sum, row_sumexp, row_max, shift, rescale)
                                + tl.sum(mean_gaps, axis=0))
            strict_sum = (rebased_strict_sum(strict_sum, row_sumexp, row_max, new_max, rescale)
                          + tl.sum(tl.where(x < shift[None, :], weights, 0.0), axis=0))
        row_sumexp = row_sumexp * rescale + tl.sum(weights, axis=0)
        row_max = new_max
    shift = tl.where(tl.abs(row_max) == float("inf"), 0.0, row_max)
    tl.store(lse_ptr + rows, shift + tl.log(row_sumexp), mask=row_mask)
    if NEED_ENTROPY:
        entropy = log_sumexp_about_max(row_sumexp, strict_sum) + gap_sum / row_sumexp
        tl.store(entropy_ptr + rows, entropy, mask=row_mask)
        if NEED_LSE_MINUS_MEAN:
            lse = shift + tl.log(row_sumexp)  # the one stored above
            tl.store(entropy_ptr + N + rows, lse_minus_mean(lse, shift, mean_gap_sum / row_sumexp), mask=row_mask)
