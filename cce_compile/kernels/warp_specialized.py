"""Logits kernels in Gluon for short K: a producer warp and a consumer warpgroup per program,
two programs per SM. The forward (lse_forward_ws_kernel) and the backward's recompute
(grad_logits_ws_kernel) share the producer and the MMA loop; each has its own epilogue.

The Triton logits kernels run one 8-warp program per SM whose two warpgroups share each
128 x 256 tile: both run their MMAs, then both the epilogue (an ex2 per logit at 16 a clock,
~2000 cycles a tile) with the tensor cores idle. Where K is short that idle share is large: at
D = 896 (14 K steps a tile) the forward took 1.21 x a cuBLAS GEMM on the H200 and the
recompute 1.54 x. Here each program's producer warp streams K steps through a ring of
shared-memory stages with the copy engine and its consumer warpgroup runs a 128 x 128 tile's
MMAs from it, then the epilogue; two programs share each SM, so one's MMAs run while the
other's epilogue does (docs/notes/gluon-warp-specialized.md: the forward 1.14 x at
D = 896; at D >= 2304, where the epilogue is a small share, the 128 x 256 kernel stays faster:
1.10 against 1.20-1.30 x). The recompute, whose epilogue is a larger share of its tile, gains
further: 1.54 -> 1.20 x at D = 896, and it beats the persistent kernel up to
D = 4096. Two consumer warpgroups in one program (CUTLASS's
ping-pong) faulted on the H200 (Triton 3.6).

All serve exact mode's plain loss only (no bias, soft-cap, class weights or label smoothing);
the forward and the recompute also linear_log_probs' entropy.
A kernel's tiles cover rows [row_start, row_start + rows) of e and vocab rows [col_start,
col_start + cols) of c; the copy engine zero-fills what lies past the tensors.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from .tiles import exp_shifted, grouped_tile, log_sumexp_about_max

tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
"""The copy engine's global-to-shared load: async_copy_global_to_shared up to Triton 3.6,
async_load (same arguments) after."""
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
"""Its shared-to-global store, renamed alike."""


@gluon.jit
def program_tile(step, num_m, num_n, GROUP_M: gl.constexpr):
    """The program's step-th tile as (row block, vocab tile), in the Triton kernels' grouped order
    (concurrent programs share operands in L2)."""
    return grouped_tile(gl.program_id(0) + step * gl.num_programs(0), num_m, num_n, GROUP_M)


@gluon.jit
def program_extent(e_desc, c_desc, rows, cols, D):
    """(row blocks, vocab tiles, K steps per tile, tiles of this program)."""
    num_m = gl.cdiv(rows, e_desc.block_type.shape[0])
    num_n = gl.cdiv(cols, c_desc.block_type.shape[0])
    return num_m, num_n, gl.cdiv(D, e_desc.block_type.shape[1]), gl.cdiv(num_m * num_n - gl.program_id(0),
                                                                          gl.num_programs(0))


@gluon.jit
def load_operands(e_desc, c_desc, e_ring, c_ring, ready, free, row_start, rows, col_start, cols, D,
                  GROUP_M: gl.constexpr):
    """The producer warp: every K step of every tile of the program, in order, into the ring."""
    BLOCK_M: gl.constexpr = e_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = e_desc.block_type.shape[1]
    STAGES: gl.constexpr = e_ring.type.shape[0]
    num_m, num_n, k_steps, steps = program_extent(e_desc, c_desc, rows, cols, D)
    slot = 0
    for step in range(steps):
        pid_m, pid_n = program_tile(step, num_m, num_n, GROUP_M)
        for k in range(k_steps):
            stage = slot % STAGES
            # Barriers start as if phase 1 had completed: the first pass over the ring waits for nothing.
            mbarrier.wait(free.index(stage), (slot // STAGES & 1) ^ 1)
            mbarrier.expect(ready.index(stage), e_desc.block_type.nbytes + c_desc.block_type.nbytes)
            tma_load(e_desc, [row_start + pid_m * BLOCK_M, k * BLOCK_K], ready.index(stage), e_ring.index(stage))
            tma_load(c_desc, [col_start + pid_n * BLOCK_N, k * BLOCK_K], ready.index(stage), c_ring.index(stage))
            slot += 1


@gluon.jit
def tile_dot(e_ring, c_ring, ready, free, slot, k_steps, mma_layout: gl.constexpr):
    """The consumer's MMAs for one tile from the ring, a stage freed once its wgmma has retired:
    (fp32 e @ c.T tile, the ring slot after it). The accumulator is made per tile, not
    carried from the last: a carried one would stay live beside the epilogue's (spilled)."""
    STAGES: gl.constexpr = e_ring.type.shape[0]
    BLOCK_M: gl.constexpr = e_ring.type.shape[1]
    BLOCK_N: gl.constexpr = c_ring.type.shape[1]
    acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, mma_layout)
    for k in range(k_steps):
        stage = slot % STAGES
        mbarrier.wait(ready.index(stage), slot // STAGES & 1)
        acc = warpgroup_mma(e_ring.index(stage), c_ring.index(stage).permute((1, 0)), acc, use_acc=k > 0,
                            is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        mbarrier.arrive(free.index((slot + STAGES - 1) % STAGES), pred=k > 0)
        slot += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(free.index((slot + STAGES - 1) % STAGES))
    return acc, slot


@gluon.constexpr_function
def mma_layout_for(block_n):
    """The consumer warpgroup's wgmma accumulator layout for tiles block_n wide."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, block_n, 16])


@gluon.jit
def allocate_ring(e_desc, c_desc, STAGES: gl.constexpr):
    """The operand ring and its barriers: `ready` (a stage's copies landed) and `free` (its
    wgmma retired)."""
    e_ring = gl.allocate_shared_memory(e_desc.dtype, [STAGES] + e_desc.block_type.shape, e_desc.layout)
    c_ring = gl.allocate_shared_memory(c_desc.dtype, [STAGES] + c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(free.index(i), count=1)
    return e_ring, c_ring, ready, free


@gluon.jit
def consume_tiles(epilogue: gl.constexpr, e_desc, c_desc, e_ring, c_ring, ready, free, rows, cols, D,
                  GROUP_M: gl.constexpr, LOGIT_SCALE: gl.constexpr, epilogue_args):
    """The consumer warpgroup: each of the program's tiles from the ring, scaled by LOGIT_SCALE
    (1 / temperature, as kernels/tiles.finish_logits), then epilogue(acc, row block, vocab tile,
    the tile's row indices, epilogue_args)."""
    mma_layout: gl.constexpr = mma_layout_for(c_desc.block_type.shape[0])
    num_m, num_n, k_steps, steps = program_extent(e_desc, c_desc, rows, cols, D)
    BLOCK_M: gl.constexpr = e_desc.block_type.shape[0]
    slot = 0
    for step in range(steps):
        pid_m, pid_n = program_tile(step, num_m, num_n, GROUP_M)
        acc, slot = tile_dot(e_ring, c_ring, ready, free, slot, k_steps, mma_layout)
        if LOGIT_SCALE != 1.0:
            acc = acc * LOGIT_SCALE
        tile_rows = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_layout))
        epilogue(acc, pid_m, pid_n, tile_rows, epilogue_args)


@gluon.jit
def store_target_logit(values, cols, targets, hit, target_logit_ptr):
    """Where a row's target falls in the tile (`hit`), its logit (of `values`) to target_logit_ptr."""
    if gl.max(hit.to(gl.int32), axis=0) > 0:  # the search for targets only where one is
        is_target = cols[None, :] == targets[:, None]
        gl.store(target_logit_ptr, gl.sum(gl.where(is_target, values, 0.0), axis=1), mask=hit)


@gluon.jit
def forward_epilogue(acc, pid_m, pid_n, local_rows, args):
    """The forward's: the rows' log-sum-exp over the tile's columns into tile_lse[tile column,
    row] (row = row_start + local row, of e's N), and the target's logit where the target falls
    in the tile."""
    targets_ptr, tile_lse_ptr, target_logit_ptr, tile_entropy_ptr, N, row_start, rows_in_launch, V = args
    BLOCK_N: gl.constexpr = acc.type.shape[1]
    cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc.type.layout))
    row_mask = local_rows < rows_in_launch
    rows = row_start + local_rows
    # Past V the copy engine's zero fill gives logits of 0.
    logits = gl.where((cols < V)[None, :], acc, float("-inf"))
    targets = gl.load(targets_ptr + rows, mask=row_mask, other=-1)
    hit = row_mask & (targets >= pid_n * BLOCK_N) & (targets < gl.minimum(pid_n * BLOCK_N + BLOCK_N, V))
    store_target_logit(logits, cols, targets, hit, target_logit_ptr + rows)
    tile_max = gl.max(logits, axis=1)
    shift = gl.where(tile_max == float("-inf"), 0.0, tile_max)  # all masked: shift by 0
    tile_lse = shift + gl.log(gl.sum(exp_shifted(logits, shift), axis=1))
    gl.store(tile_lse_ptr + pid_n.to(gl.int64) * N + rows, tile_lse, mask=row_mask)


@gluon.jit
def forward_entropy_epilogue(acc, pid_m, pid_n, local_rows, args):
    """forward_epilogue, and the entropy of the rows' softmax over the tile into
    tile_entropy[tile column, row] (linear_log_probs' entropy; the op merges the tiles' as
    lse_forward_tma_kernel's), about the tile's largest logit as
    kernels/forward.tile_softmax_entropy sums it: log_sumexp_about_max of the sum of exps and
    of their sum below the max, plus sum_j exp_j (tile max - logit_j) / (sum of exps), two
    terms >= 0. Every statistic comes from acc, masked where it is used: the masked logits
    held beside acc (which the entropy needs) would spill (ptxas for sm_90: ~800 bytes a
    thread); past V acc holds the zero fill's 0, finite (so its gap needs no clamp, unlike
    tile_entropy_sums' -inf logits), beside an exponential of 0."""
    targets_ptr, tile_lse_ptr, target_logit_ptr, tile_entropy_ptr, N, row_start, rows_in_launch, V = args
    BLOCK_N: gl.constexpr = acc.type.shape[1]
    cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc.type.layout))
    in_vocab = (cols < V)[None, :]  # past V the zero fill's logits of 0 are masked out
    row_mask = local_rows < rows_in_launch
    rows = row_start + local_rows
    targets = gl.load(targets_ptr + rows, mask=row_mask, other=-1)
    hit = row_mask & (targets >= pid_n * BLOCK_N) & (targets < gl.minimum(pid_n * BLOCK_N + BLOCK_N, V))
    store_target_logit(acc, cols, targets, hit, target_logit_ptr + rows)
    tile_max = gl.max(gl.where(in_vocab, acc, float("-inf")), axis=1)
    shift = gl.where(tile_max == float("-inf"), 0.0, tile_max)
    exps = gl.where(in_vocab, exp_shifted(acc, shift), 0.0)
    tile_sumexp = gl.sum(exps, axis=1)
    out = pid_n.to(gl.int64) * N + rows
    gaps = shift[:, None] - acc
    below = gl.where(gaps > 0.0, exps, 0.0)
    tile_gap, tile_strict = gl.sum(below * gaps, axis=1), gl.sum(below, axis=1)
    tile_entropy = log_sumexp_about_max(tile_sumexp, tile_strict) + tile_gap / tile_sumexp
    gl.store(tile_entropy_ptr + out, tile_entropy, mask=row_mask)
    gl.store(tile_lse_ptr + out, shift + gl.log(tile_sumexp), mask=row_mask)


@gluon.jit
def lse_forward_ws_kernel(e_desc, c_desc, targets_ptr, tile_lse_ptr, target_logit_ptr, tile_entropy_ptr, N,
                          row_start, rows_in_launch, V, D, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                          NEED_ENTROPY: gl.constexpr, LOGIT_SCALE: gl.constexpr):
    """The forward over rows [row_start, row_start + rows_in_launch) of e's N (the op launches
    it per row chunk, as lse_forward_tma_kernel), with NEED_ENTROPY the tiles' entropies too.
    Launched with num_warps=4 (the consumer; the producer is a one-warp worker) and
    maxnreg=128, so two programs fit an SM: the consumer takes what the producer's 24
    registers a thread leave."""
    e_ring, c_ring, ready, free = allocate_ring(e_desc, c_desc, STAGES)
    epilogue: gl.constexpr = forward_entropy_epilogue if NEED_ENTROPY else forward_epilogue
    gl.warp_specialize([
        (consume_tiles, (epilogue, e_desc, c_desc, e_ring, c_ring, ready, free, rows_in_launch, V, D, GROUP_M,
                         LOGIT_SCALE, (targets_ptr, tile_lse_ptr, target_logit_ptr, tile_entropy_ptr, N,
                                       row_start, rows_in_launch, V))),
        (load_operands, (e_desc, c_desc, e_ring, c_ring, ready, free, row_start, rows_in_launch, 0, V, D, GROUP_M)),
    ], [1], [24])


@gluon.jit
def store_half_tiles(values, out_half, out_desc, row0, col0):
    """A tile stored through the copy engine a half tile at a time via `out_half` (a whole
    tile's staging would leave the ring two stages in the shared memory two programs share)."""
    BLOCK_M: gl.constexpr = values.type.shape[0]
    HALF_N: gl.constexpr = values.type.shape[1] // 2
    left, right = gl.split(gl.permute(gl.reshape(values.to(out_half.dtype), [BLOCK_M, 2, HALF_N]), [0, 2, 1]))
    tma.store_wait(0)  # the last tile's right half has left the staging buffer
    out_half.store(left)
    fence_async_shared()
    tma_store(out_desc, [row0, col0], out_half)
    tma.store_wait(0)
    out_half.store(right)
    fence_async_shared()
    tma_store(out_desc, [row0, col0 + HALF_N], out_half)


@gluon.jit
def grad_logits_epilogue(acc, pid_m, pid_n, local_rows, args):
    """The recompute's: d loss / d logits = coef_softmax * softmax - coef_target at the target
    (- coef_entropy * softmax * (logit - lse) with HAS_ENTROPY: linear_log_probs' entropy), as
    kernels/backward.grad_from_logits without its other options, stored in the input dtype at
    (row - row_start, col - col_start) of the d-logits buffer by the copy engine (store_half_tiles).
    Rows and columns past the slab are computed and stored
    within the buffer, where the GEMMs do not read them."""
    (grad_logits_desc, out_half, targets_ptr, lse_ptr, coef_softmax_ptr, coef_target_ptr, coef_entropy_ptr, scale_ptr,
     row_start, rows, col_start, SCALED, HAS_ENTROPY) = args
    BLOCK_M: gl.constexpr = acc.type.shape[0]
    BLOCK_N: gl.constexpr = acc.type.shape[1]
    row_mask = local_rows < rows
    token = row_start + local_rows
    lse = gl.load(lse_ptr + token, mask=row_mask, other=0.0)
    coef_softmax = gl.load(coef_softmax_ptr + token, mask=row_mask, other=0.0)
    if HAS_ENTROPY:
        coef_entropy = gl.load(coef_entropy_ptr + token, mask=row_mask, other=0.0)
        grad = (coef_softmax[:, None] - coef_entropy[:, None] * (acc - lse[:, None])) * exp_shifted(acc, lse)
    else:
        grad = coef_softmax[:, None] * exp_shifted(acc, lse)
    targets = gl.load(targets_ptr + token, mask=row_mask, other=-1)
    first_vocab = col_start + pid_n * BLOCK_N
    hit = (targets >= first_vocab) & (targets < first_vocab + BLOCK_N)
    if gl.max(hit.to(gl.int32), axis=0) > 0:  # the search for targets only where one is
        coef_target = gl.load(coef_target_ptr + token, mask=row_mask, other=0.0)
        vocab = first_vocab + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc.type.layout))
        grad -= gl.where(vocab[None, :] == targets[:, None], coef_target[:, None], 0.0)
    if SCALED:  # fp16: kernels/backward.grad_from_logits says why
        grad = grad / gl.load(scale_ptr)
    store_half_tiles(grad, out_half, grad_logits_desc, pid_m * BLOCK_M, pid_n * BLOCK_N)


@gluon.jit
def grad_logits_ws_kernel(e_desc, c_desc, grad_logits_desc, targets_ptr, lse_ptr, coef_softmax_ptr, coef_target_ptr,
                          coef_entropy_ptr, scale_ptr, row_start, rows, col_start, cols, D,
                          GROUP_M: gl.constexpr, STAGES: gl.constexpr, SCALED: gl.constexpr,
                          HAS_ENTROPY: gl.constexpr, LOGIT_SCALE: gl.constexpr):
    """Exact mode's recompute of one slab (rows x cols from (row_start, col_start)) into the
    d-logits buffer that grad_logits_desc views (half-tile blocks). Launched as
    lse_forward_ws_kernel is (num_warps=4, maxnreg=128, two programs per SM)."""
    e_ring, c_ring, ready, free = allocate_ring(e_desc, c_desc, STAGES)
    out_half = gl.allocate_shared_memory(grad_logits_desc.dtype, grad_logits_desc.block_type.shape,
                                         grad_logits_desc.layout)
    if not HAS_ENTROPY:  # a stand-in the epilogue reads: Triton 3.6 fails to lower a partition
        coef_entropy_ptr = coef_softmax_ptr  # argument that a pruned branch leaves unread
    gl.warp_specialize([
        (consume_tiles, (grad_logits_epilogue, e_desc, c_desc, e_ring, c_ring, ready, free, rows, cols, D, GROUP_M,
                         LOGIT_SCALE, (grad_logits_desc, out_half, targets_ptr, lse_ptr, coef_softmax_ptr,
                                       coef_target_ptr, coef_entropy_ptr, scale_ptr, row_start, rows, col_start,
                                       SCALED, HAS_ENTROPY))),
        (load_operands, (e_desc, c_desc, e_ring, c_ring, ready, free, row_start, rows, col_start, cols, D, GROUP_M)),
    ], [1], [24])
    tma.store_wait(0)  # the consumer's last d-logits store has left shared memory


@gluon.jit
def scaled_exp_epilogue(acc, pid_m, pid_n, local_rows, args):
    """The fused forward's (kernels/fused_forward.py, plain loss): q = exp(logit - shift) into
    the workspace, each row's sum of q, largest logit and target logit into the statistics."""
    (workspace_desc, out_half, targets_ptr, shift_ptr, stats_ptr, target_logit_ptr, stat_stride, row_start, rows,
     V) = args
    BLOCK_M: gl.constexpr = acc.type.shape[0]
    BLOCK_N: gl.constexpr = acc.type.shape[1]
    cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc.type.layout))
    row_mask = local_rows < rows
    # Past V the copy engine's zero fill gives logits of 0.
    logits = gl.where((cols < V)[None, :], acc, float("-inf"))
    targets = gl.load(targets_ptr + row_start + local_rows, mask=row_mask, other=-1)
    hit = row_mask & (targets >= pid_n * BLOCK_N) & (targets < gl.minimum(pid_n * BLOCK_N + BLOCK_N, V))
    if gl.max(hit.to(gl.int32), axis=0) > 0:  # the search for targets only where one is
        is_target = cols[None, :] == targets[:, None]
        gl.store(target_logit_ptr + local_rows, gl.sum(gl.where(is_target, logits, 0.0), axis=1), mask=hit)
    shift = gl.load(shift_ptr + local_rows, mask=row_mask, other=0.0)
    q = exp_shifted(logits, shift)
    at = stats_ptr + pid_n.to(gl.int64) * rows + local_rows
    gl.store(at, gl.sum(q, axis=1), mask=row_mask)
    gl.store(at + stat_stride, gl.max(logits, axis=1), mask=row_mask)
    store_half_tiles(q, out_half, workspace_desc, pid_m * BLOCK_M, pid_n * BLOCK_N)


@gluon.jit
def fused_forward_ws_kernel(e_desc, c_desc, workspace_desc, targets_ptr, shift_ptr, stats_ptr, target_logit_ptr,
                            stat_stride, row_start, rows, V, D, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                            LOGIT_SCALE: gl.constexpr):
    """The fused forward of one token chunk (rows of e from row_start, all of V) into the
    workspace that workspace_desc views (half-tile blocks), for the plain loss. Launched as
    lse_forward_ws_kernel is (num_warps=4, maxnreg=128, two programs per SM)."""
    e_ring, c_ring, ready, free = allocate_ring(e_desc, c_desc, STAGES)
    out_half = gl.allocate_shared_memory(workspace_desc.dtype, workspace_desc.block_type.shape, workspace_desc.layout)
    gl.warp_specialize([
        (consume_tiles, (scaled_exp_epilogue, e_desc, c_desc, e_ring, c_ring, ready, free, rows, V, D, GROUP_M,
                         LOGIT_SCALE, (workspace_desc, out_half, targets_ptr, shift_ptr, stats_ptr,
                                       target_logit_ptr, stat_stride, row_start, rows, V))),
        (load_operands, (e_desc, c_desc, e_ring, c_ring, ready, free, row_start, rows, 0, V, D, GROUP_M)),
    ], [1], [24])
    tma.store_wait(0)  # the consumer's last workspace store has left shared memory
