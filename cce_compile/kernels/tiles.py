"""Triton helpers shared by the op's kernels: program ordering, dots, and the logits tile."""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Map a linear program id to (pid_m, pid_n) so GROUP_M row blocks sweep the columns
    together: programs that run at the same time then share operands in L2."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def mma(acc, a, b, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """acc += a @ b in fp32. UPCAST works around the interpreter's wrong bf16 dots;
    IEEE keeps fp32 inputs out of TF32, as torch's own matmul does by default."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def exp_shifted(x, shift):
    """exp(x - shift[:, None]) in one fused multiply-add and one MUFU.EX2 per element: tl.exp2
    compiles to ex2.approx.ftz on sm_90, while tl.exp(x - shift) adds a subtract, a multiply
    and a guard for denormal results (a compare and two predicated multiplies). The logits
    epilogues run once per logit, beside idle tensor cores, so these count. Results below
    2**-126 flush to zero: a probability that small changes no sum and no gradient."""
    return tl.exp2(x * LOG2E - (shift * LOG2E)[:, None])


@triton.jit
def log1p(x):
    """log(1 + x) for x >= 0 to a few roundings of relative error however small x is, free
    of libdevice (which the interpreter lacks): log(u) * x / (u - 1) with u = 1 + x rounded,
    whose rounding the ratio undoes (Goldberg), and x itself where u rounds to 1."""
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.log(u) * (x / tl.where(u == 1.0, 1.0, u - 1.0)))


@triton.jit
def log_sumexp_about_max(sumexp, strict_sum):
    """log(sumexp) for sumexp = sum_j exp(logit_j - max logit), given `strict_sum`, its terms
    of the logits below the max (kernels/forward.tile_entropy_sums): the largest logit's own 1
    plus them. Near 1, log(sumexp) loses what the fp32 sum rounded away beside that 1 (every
    term under 6e-8 added to it, so up to all of a peaked row's rest: ~1 / (1 + gap) of a
    near one-hot row's entropy); log1p of the strict sum keeps it. From 1.5 up, where a tie
    for the max may count in sumexp too, log(sumexp) is as accurate."""
    return tl.where(sumexp < 1.5, log1p(strict_sum), tl.log(sumexp))


@triton.jit
def tanh(x):
    """tanh(x) in fp32 to within a few roundings of relative error for every x, free of
    libdevice (which the interpreter lacks).

    Below |x| = 0.25 the odd Taylor series to x**9 (truncation error under 1e-8 relative);
    above, sign(x) * (1 - t) / (1 + t) with t = exp(-2|x|), which is exactly +-1 at the tails
    (t underflows to 0). An exp form alone cancels for small |x| to an absolute error of
    ~eps, and the soft-cap, softcap * tanh(logit / softcap), multiplies that by softcap.
    tests/test_op_interpreter.py sweeps it against float64."""
    x2 = x * x
    series = x2 * 0.021869488536155203 - 0.05396825396825397  # 62/2835, 17/315
    series = series * x2 + 0.13333333333333333  # 2/15
    series = series * x2 - 0.3333333333333333
    series = x + x * (x2 * series)
    t = tl.exp2(tl.abs(x) * (-2.0 * LOG2E))
    folded = (1.0 - t) / (1.0 + t)
    return tl.where(tl.abs(x) < 0.25, series, tl.where(x < 0.0, -folded, folded))


@triton.jit
def load_tile(ptr, rows, cols, row_mask, col_mask, stride_r, stride_c):
    """A [rows x cols] tile, zero outside the masks: a gradient GEMM's operand.

    Masked, not clamped like logits_tile's indices: a clamp (`tl.where(mask, offs, 0)`)
    hides that offsets run contiguously, and on the operand's contiguous dimension that
    turns 16-byte vector loads into 2-byte ones that do not pipeline (the d-logits operand
    of dC is contiguous along M, both B operands along N). With extents that are multiples
    of 16 the masks are uniform over each vector and the loads vectorize."""
    offsets = rows.to(tl.int64)[:, None] * stride_r + cols.to(tl.int64)[None, :] * stride_c
    return tl.load(ptr + offsets, mask=row_mask[:, None] & col_mask[None, :], other=0.0)


@triton.jit
def finish_gemm(acc, out_ptrs, final_ptrs, mask, scale_ptr,
                ACCUMULATE: tl.constexpr, FINAL: tl.constexpr, SCALED: tl.constexpr):
    """The gradient GEMMs' epilogue: undo grad_logits_kernel's fp16 scale (SCALED), add what
    `out` holds (ACCUMULATE), and store to `out`, or in `final`'s dtype to `final` (FINAL:
    dE after its last slab)."""
    if SCALED:
        acc = acc * tl.load(scale_ptr)
    if ACCUMULATE:
        acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    if FINAL:
        tl.store(final_ptrs, acc.to(final_ptrs.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptrs, acc.to(out_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def logits_tile(
    e_ptr, c_ptr, bias_ptr, rows, cols, row_mask, col_mask, D,
    stride_en, stride_ed, stride_cv, stride_cd, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, LOGIT_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """fp32 logits of rows x cols: e[rows] @ c[cols].T (+ bias), then finish_logits.

    Rows and columns outside the masks read row 0 / column 0 instead of being masked, so
    the loads carry no row/column predicates (callers mask what they store); with EVEN_K
    (D a multiple of BLOCK_K) they carry none at all. Both operands are contiguous along D,
    which the clamps leave alone (see load_tile). Offsets are 64-bit, so operands past
    2**31 elements address correctly.
    """
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    safe_rows = tl.where(row_mask, rows, 0).to(tl.int64)
    safe_cols = tl.where(col_mask, cols, 0).to(tl.int64)
    e_ptrs = e_ptr + safe_rows[:, None] * stride_en + offs_k[None, :] * stride_ed
    c_ptrs = c_ptr + offs_k[:, None] * stride_cd + safe_cols[None, :] * stride_cv
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(D, BLOCK_K)):
        if EVEN_K:
            e_tile = tl.load(e_ptrs)
            c_tile = tl.load(c_ptrs)
        else:
            k_mask = offs_k < D - k * BLOCK_K
            e_tile = tl.load(e_ptrs, mask=k_mask[None, :], other=0.0)
            c_tile = tl.load(c_ptrs, mask=k_mask[:, None], other=0.0)
        acc = mma(acc, e_tile, c_tile, UPCAST, IEEE)
        e_ptrs += BLOCK_K * stride_ed
        c_ptrs += BLOCK_K * stride_cd
    return finish_logits(acc, bias_ptr, cols, col_mask, softcap, HAS_BIAS, HAS_SOFTCAP, LOGIT_SCALE)


@triton.jit
def logits_tile_tma(
    e_desc, c_desc, bias_ptr, row0, col0, cols, col_mask, D, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, LOGIT_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """logits_tile through tensor descriptors (TMA on Hopper): e rows from row0 and c rows
    from col0 of the descriptors' views; the copy engine zero-fills what lies past their
    extents, so neither the loads nor the K tail need masks."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(D, BLOCK_K)):
        e_tile = e_desc.load([row0, k * BLOCK_K])
        c_tile = c_desc.load([col0, k * BLOCK_K])
        acc = mma(acc, e_tile, c_tile.T, UPCAST, IEEE)
    return finish_logits(acc, bias_ptr, cols, col_mask, softcap, HAS_BIAS, HAS_SOFTCAP, LOGIT_SCALE)


@triton.jit
def finish_logits(acc, bias_ptr, cols, col_mask, softcap, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                  LOGIT_SCALE: tl.constexpr):
    """The bias, the logit scale (1 / temperature, applied in fp32 where a scaled e would be
    rounded to its dtype; a compile-time constant, so 1 costs nothing) and the soft-cap (whose
    `softcap` is then in scaled units), applied to a tile of raw dot products."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if LOGIT_SCALE != 1.0:
        acc = acc * LOGIT_SCALE
    if HAS_SOFTCAP:
        acc = softcap * tanh(acc / softcap)
    return acc
