"""The backward op: dE, dC, dbias from the forward's lse, registered as a triton_op.

Triton path, per token chunk and vocab slab (sizes from config.plan, within the scratch
budget): grad_logits_kernel recomputes the slab's logits into d logits (input dtype; for
16-bit inputs with long K loops grad_logits_tma_kernel, persistent on tensor descriptors; with
short ones on a Hopper GPU, for the plain loss, the warp-specialized Gluon grad_logits_ws_kernel),
then matmul_kernel (or cuBLAS in eager calls) does dC[slab] (+)= d_logits.T @ e[chunk] and
dE_acc[chunk] += d_logits @ c[slab] (fp32). Four GEMMs' worth of work for fwd+bwd,
never more than the slab's logits in memory. Filtered mode walks the vocabulary in the
forward's vocab_order and recomputes only the d-logits tiles the forward kept
(ops/filtering.py, from its tile maxima), into a compact buffer (one slot per kept tile); the two
GEMMs run block-sparse over the slots (sparse_matmul_kernel), from work lists built for all
steps in one launch (step_lists_kernel), and the tiles it skips keep their row sums (dE's
accumulator starts from them, dC's rows get them by vocab tile: kernels/dropped_tiles.py).
In eager calls a step spans as many vocab tiles as its kept tiles fill the scratch (few, full
steps where the vocabulary's tail is mostly dropped); traced calls take fixed slabs. Where
most tiles are kept (a flat softmax), it runs the dense path. Eager CUDA calls replay exact
mode's slab loop as a CUDA graph once they recur on the same tensors (ops/graphs.py).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch.library import triton_op, wrap_triton
from triton.tools.tensor_descriptor import TensorDescriptor

from ..config.kernel_config import TileConfig
from ..config.plan import n_bucket, plan_backward
from ..kernels.backward import grad_logits_kernel, grad_logits_tma_kernel, matmul_kernel, sparse_matmul_kernel
from ..kernels.dropped_tiles import add_tile_rows_kernel, tile_row_sums_kernel
from ..kernels.warp_specialized import grad_logits_ws_kernel
from .cpu_path import backward_cpu
from .dispatch import (
    cdiv, config_for, device_limits, kernel_flags, relaunches_directly, stages_beside_output, tensor_descriptors_fit,
    use_triton,
)
from . import graphs
from .filtering import Tilt, chunk_tile_mask, filtered_steps, skipped_tiles, step_lists, tilt_sample_size
from .launch import KernelLauncher
from .loss_terms import grad_coefficients
from .warp_specialized import (
    PROGRAMS_PER_SM, WARP_SPECIALIZED_TILE, gluon_descriptor, launch_options, operand_descriptors, plain_loss,
    programs_for, tiles_of, warp_specialized_fits,
)

PERSISTENT_MIN_K_STEPS = 32
"""The recompute runs persistent (grad_logits_tma_kernel) where a tile's dot takes at least
this many BLOCK_K steps. Each tile restarts the K pipeline; measured in the op on the H200
(benchmarks/results/profile-h200-v11-*), its slab cost against the pointer kernel's was 1.05
against 1.19 x GEMM at D = 8192 (128 steps), 1.18 / 1.24 at 4096, 1.30 / 1.32 at 2304 and
1.63 / 1.48 at 896 (14 steps)."""


def recompute_is_persistent(d: int, tile: TileConfig) -> bool:
    """Whether exact mode's recompute takes grad_logits_tma_kernel (where tensor descriptors
    fit): the op and the tuner ask the same question."""
    return cdiv(d, tile.block_k) >= PERSISTENT_MIN_K_STEPS

WARP_SPECIALIZED_MAX_K_STEPS = 64
"""Exact mode's plain recompute (no bias, soft-cap, weights or smoothing) runs
grad_logits_ws_kernel where a tile's dot takes at most this many K steps (D <= 4096). On the
H200 at D = 896 (Qwen2.5, benchmarks/results/*-v18-*): 1.20 x GEMM against grad_logits_kernel's
1.54; the pass 5.21 -> 4.88 x. Against the persistent grad_logits_tma_kernel, alternated in one
process (ab-h200-v19-recompute-ws.log): the pass 4.315 -> 4.297 x at D = 2304 (4 rounds of 4),
4.318 -> 4.261 at 4096 (3 of 3), but 4.227 -> 4.292 at 8192 (128 steps) and 4.555 -> 4.608
at 5120 (80 steps, 8192 x 5120 x 152064, ab-h200-v21-recompute-ws-d5120.log), where the 128 x 128
tile's extra operand traffic outweighs the overlapped epilogue (the Gluon forward loses from
D = 2304 already: its epilogue is a smaller share of its tile's time than the recompute's)."""

GEMM_BACKEND = "cublas"
"""The backward's two gradient GEMMs on CUDA: "cublas" (torch.mm, fp16 excepted) or
"triton" (matmul_kernel, always used under the interpreter and for fp16)."""


@triton_op("cce::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward(
    grad_loss: Tensor, grad_lse: Tensor, e: Tensor, c: Tensor, targets: Tensor,
    bias: Tensor | None, weight: Tensor | None, lse: Tensor, kept_tiles: Tensor, tile_lse: Tensor,
    vocab_order: Tensor, ignore_index: int, label_smoothing: float, softcap: float, filter_eps: float,
    need_grad_e: bool = True, need_grad_c: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """-> (grad_e, grad_c, grad_bias); grad_bias is empty when there is no bias.

    kept_tiles, tile_lse and vocab_order are the forward's (empty in exact mode and on the CPU
    path, which filters from its recomputed softmax). A gradient not needed (a frozen head
    under LoRA: need_grad_c=False) comes back empty and its GEMMs are never run: the pass
    does three GEMMs' work instead of four and never allocates that gradient."""
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
            chunk_v=max(config.slab_v, config.forward.block_n), filter_tile=(tile.block_m, tile.block_n),
            vocab_order=vocab_order if filtered else None, forward_block_n=config.forward.block_n,
            need_grad_e=need_grad_e, need_grad_c=need_grad_c,
        )
        return grad_e, grad_c, grad_bias if grad_bias is not None else c.new_empty((0,))

    plan = plan_backward(n, v, d, e.element_size(), config, filtered)
    logits_tile, dc_tile, de_tile = config.grad_logits, config.grad_classifier, config.grad_hidden
    chunk_rows = plan.chunk_rows(n, logits_tile.block_m)
    chunk_tile_rows, slab_tiles = cdiv(chunk_rows, logits_tile.block_m), cdiv(plan.slab_v, logits_tile.block_n)
    vocab_tiles = cdiv(v, logits_tile.block_n)
    # Filtered mode: the kept tiles and the steps' work lists, built on the device before the
    # gradients and scratch exist, so their temporaries never add to the peak.
    packed = filtered and not is_fake(e)
    eager_cuda = e.is_cuda and not is_fake(e)
    capacity = plan.slots if packed and plan.slots else chunk_tile_rows * slab_tiles
    if filtered:
        forward_n = config.forward.block_n
        if kept_tiles.shape != (cdiv(n, logits_tile.block_m), vocab_tiles):
            raise ValueError("kept_tiles: filtered mode needs the forward's (row blocks, vocab tiles) kept tiles")
        if tile_lse.shape != (n, cdiv(v, forward_n)):
            raise ValueError("tile_lse: filtered mode needs the forward's (N, vocab tiles) tile log-sum-exps")
        mask = chunk_tile_mask(kept_tiles, plan.n_chunks, chunk_tile_rows)
        steps = filtered_steps(mask, capacity, slab_tiles, packed)
        lists = step_lists(mask, steps, capacity)
        # What the skipped tiles put back (SkippedTiles): c summed per forward tile, per tile
        # what each of its columns gets in dC and dbias, summed over the token chunks, and dE's
        # tilt (Tilt). dE's share is one GEMM per token chunk: [d_logits | the tilt's columns]
        # against [c_tile_sums; the tilt's rows] (bf16 operands on the tensor cores in eager
        # CUDA calls).
        skipped = skipped_tiles(kept_tiles, vocab_order, weight, has_smoothing, forward_n,
                                logits_tile.block_m, logits_tile.block_n)
        forward_tiles = tile_lse.shape[1]
        if need_grad_e:  # dE's put-back: c summed per forward tile, and the tilt
            c_tile_sums = torch.empty((forward_tiles, d), dtype=torch.float32, device=e.device)
            wrap_triton(tile_row_sums_kernel)[(forward_tiles, cdiv(d, 64))](
                c, vocab_order, c_tile_sums, v, d, c.stride(0), c.stride(1), TILE_N=forward_n, BLOCK_D=64,
            )
            sample_size = tilt_sample_size(n_bucket(n), v, d)
            tilt = Tilt.estimate(
                c, bias, vocab_order, skipped.tile_mass(tile_lse, coef_softmax), forward_n, sample_size, eager_cuda,
                tile_sums=c_tile_sums,
            ) if sample_size else None
            put_back_rows = torch.cat([c_tile_sums, tilt.rows()]) if tilt is not None else c_tile_sums
            if eager_cuda:
                put_back_rows = put_back_rows.bfloat16()
        if need_grad_c:
            grad_c_per_tile = torch.zeros((forward_tiles, d), dtype=torch.float32, device=e.device)
        grad_bias_per_tile = (
            torch.zeros(forward_tiles, dtype=torch.float32, device=e.device) if bias is not None else None
        )
    grad_e = torch.empty(e.shape if need_grad_e else (0,), dtype=e.dtype, device=e.device)
    grad_c = torch.empty(c.shape if need_grad_c else (0,), dtype=c.dtype, device=c.device)
    # 16-bit dE is summed over slabs in fp32; an fp32 dE is its own accumulator.
    acc = (torch.empty((chunk_rows, d), dtype=torch.float32, device=e.device)
           if plan.fp32_accumulator and need_grad_e else grad_e)
    # fp16's range is narrow: d logits of a mean loss (~p / N) would fall below it.
    scaled = e.dtype == torch.float16
    # The d-logits scale (fp16 only); otherwise `lse` stands in for the unread pointer.
    scale = (
        torch.maximum(coef_softmax.abs().max(), coef_target.abs().max()).clamp_min(1e-30).reshape(1)
        if scaled else lse
    )
    flags = kernel_flags(e)
    # Eager CUDA calls relaunch each step's kernels without Triton's per-launch binding.
    reuse = relaunches_directly(e)
    launch_grad_logits = KernelLauncher(grad_logits_kernel, reuse)
    launch_sparse_matmul = KernelLauncher(sparse_matmul_kernel, reuse)
    persistent = warp_specialized = False  # decided with the dense path's buffer, below

    def recompute(programs: int, row_start, row_end, col_start, col_end, step_index: int = 0) -> None:
        """grad_logits_kernel: a slab's d-logits (exact), or a step's kept tiles (filtered);
        for the slab where tensor descriptors fit, grad_logits_ws_kernel where the K loop is
        short (plain loss) and grad_logits_tma_kernel where it is long."""
        if warp_specialized:  # the tile named, not defaulted: benchmarks/ab_switch.py switches it
            recompute_warp_specialized(
                launch_grad_logits, descriptors, targets, lse, coef_softmax, coef_target, scale, scaled,
                row_start, row_end - row_start, col_start, col_end - col_start, WARP_SPECIALIZED_TILE,
            )
            return
        if persistent:
            launch_grad_logits(
                (min(programs, sms),), *descriptors, bias, targets, weight, lse,
                coef_softmax, coef_target, coef_smooth, scale,
                row_start, row_end - row_start, col_start, col_end - col_start, d, sms, softcap,
                HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap > 0.0, HAS_WEIGHT=weight is not None,
                HAS_SMOOTHING=has_smoothing, SCALED=scaled,
                BLOCK_M=logits_tile.block_m, BLOCK_N=logits_tile.block_n, BLOCK_K=logits_tile.block_k,
                GROUP_M=logits_tile.group_m, num_warps=logits_tile.num_warps,
                num_stages=persistent_stages, **flags,
            )
            return
        step_tiles, step_counts = (lists.step_tiles, lists.step_counts) if filtered else (targets, targets)
        launch_grad_logits(
            (programs,), e, c, bias, targets, weight, lse, coef_softmax, coef_target, coef_smooth, scale,
            vocab_order if filtered else targets, grad_logits, step_tiles, step_counts, step_index, capacity,
            chunk_tile_rows, row_start, row_end, col_start, col_end, d,
            e.stride(0), e.stride(1), c.stride(0), c.stride(1),
            grad_logits.stride(0), grad_logits.stride(1), softcap,
            HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap > 0.0, HAS_WEIGHT=weight is not None,
            HAS_SMOOTHING=has_smoothing, FILTER=filtered, SCALED=scaled,
            BLOCK_M=logits_tile.block_m, BLOCK_N=logits_tile.block_n, BLOCK_K=logits_tile.block_k,
            GROUP_M=logits_tile.group_m, EVEN_K=d % logits_tile.block_k == 0,
            num_warps=logits_tile.num_warps, num_stages=logits_tile.num_stages, **flags,
        )

    def token_chunks():
        """(chunk, first row, rows, the dE accumulator's element offset) per token chunk; the
        last chunk may be short (rows is symbolic under torch.compile)."""
        for chunk in range(plan.n_chunks):
            row_start = chunk * chunk_rows
            rows = torch.sym_max(torch.sym_min(chunk_rows, n - row_start), 0)
            yield chunk, row_start, rows, 0 if plan.fp32_accumulator else row_start * d

    if filtered:
        grad_logits = torch.empty((capacity, logits_tile.block_m, logits_tile.block_n), dtype=e.dtype, device=e.device)
        # The sparse GEMMs step through whole d-logits tiles, in parts of their block_k.
        sparse_k = min(dc_tile.block_k, de_tile.block_k, logits_tile.block_m, logits_tile.block_n)
        if bias is not None:  # summed over every chunk's kept tiles, by vocab position
            bias_sum = torch.zeros(vocab_tiles * logits_tile.block_n, dtype=torch.float32, device=e.device)
            slot_ids = torch.arange(capacity, device=e.device)
            in_tile = torch.arange(logits_tile.block_n, device=e.device)

        def put_back_skipped_tiles(row_start, rows) -> None:
            """A token chunk's skipped tiles (SkippedTiles): dE's accumulator starts from their
            share, dC's and dbias's per-tile shares are summed for the end."""
            row_end = row_start + rows
            d_logits, row_mass = skipped.d_logits(
                tile_lse[row_start:row_end], coef_softmax[row_start:row_end],
                coef_smooth[row_start:row_end] if has_smoothing else None, row_start,
            )
            e_rows = e[row_start:row_end]
            if need_grad_e:
                acc_rows = acc[:rows] if plan.fp32_accumulator else grad_e[row_start:row_end]
                columns = torch.empty((rows, put_back_rows.shape[0]), dtype=put_back_rows.dtype, device=e.device)
                columns[:, :forward_tiles].copy_(d_logits)
                if tilt is not None:
                    tilt.columns(e_rows, row_mass, out=columns[:, forward_tiles:])
            if eager_cuda:  # on the tensor cores: bf16 operands (fp32's range), fp32 sums
                if need_grad_e:
                    torch.mm(columns, put_back_rows, out_dtype=torch.float32, out=acc_rows)
                if need_grad_c:
                    d_logits_t = columns[:, :forward_tiles].T if need_grad_e else d_logits.T.bfloat16()
                    grad_c_per_tile.add_(torch.mm(d_logits_t, e_rows.bfloat16(), out_dtype=torch.float32))
            else:
                if need_grad_e:
                    torch.mm(columns, put_back_rows, out=acc_rows)
                if need_grad_c:
                    grad_c_per_tile.addmm_(d_logits.T, e_rows.to(torch.float32))
            if grad_bias_per_tile is not None:
                grad_bias_per_tile.add_(d_logits.sum(dim=0))

        def step_gemms(chunk: int, step: int, row_start, rows, acc_offset, first_column, columns, last: bool) -> None:
            """A step's dC and dE GEMMs (and bias sums) over its kept tiles. `columns` may run
            past the step's, whose end the dC GEMM reads on the device; `last`: the chunk's
            last step, which writes dE itself."""
            step_index = chunk * steps.n_steps + step
            if step == 0:
                put_back_skipped_tiles(row_start, rows)
            # dC[order[step's columns]] (+)= tiles.T @ e[chunk]: M = V, K = chunk rows.
            if need_grad_c:
                launch_sparse_matmul(
                    (columns * cdiv(d, dc_tile.block_n),),
                    grad_logits, e, row_start * e.stride(0), vocab_order, grad_c, 0, vocab_order, grad_c, 0,
                    lists.dc_begin, lists.dc_count, chunk * vocab_tiles, first_column, columns,
                    steps.step_bounds, chunk * steps.step_bounds.stride(0) + step + 1,
                    lists.dc_rows, lists.dc_rows, step_index * capacity, scale, v, d, rows,
                    e.stride(0), e.stride(1),
                    BY_COLUMN=True, ACCUMULATE=chunk > 0, FINAL=False, SCALED=scaled,
                    TILE_M=logits_tile.block_n, TILE_K=logits_tile.block_m, BLOCK_N=dc_tile.block_n,
                    BLOCK_K=sparse_k, GROUP_M=dc_tile.group_m, num_warps=dc_tile.num_warps,
                    num_stages=dc_tile.num_stages, **flags,
                )
            # dE[chunk] += tiles @ c[order[...]]: M = chunk rows, K = V.
            tile_rows = cdiv(rows, logits_tile.block_m)
            if need_grad_e:
                launch_sparse_matmul(
                    (tile_rows * cdiv(d, de_tile.block_n),),
                    grad_logits, c, 0, vocab_order, acc, acc_offset, vocab_order, grad_e, row_start * d,
                    lists.de_begin, lists.de_count, step_index * chunk_tile_rows, 0, tile_rows, steps.step_bounds, 0,
                    lists.de_slots, lists.de_cols, step_index * capacity, scale, rows, d, v,
                    c.stride(0), c.stride(1),
                    BY_COLUMN=False, ACCUMULATE=True, FINAL=plan.fp32_accumulator and last, SCALED=scaled,
                    TILE_M=logits_tile.block_m, TILE_K=logits_tile.block_n, BLOCK_N=de_tile.block_n,
                    BLOCK_K=sparse_k, GROUP_M=de_tile.group_m, num_warps=de_tile.num_warps,
                    num_stages=de_tile.num_stages, **flags,
                )
            if bias is not None:
                # Slots past the step's count hold whatever was there (NaN too): selected away.
                live = slot_ids < lists.step_counts[chunk, step]
                tile_sums = torch.where(live[:, None], grad_logits.sum(dim=1, dtype=torch.float32), 0.0)
                tile_sums = tile_sums * scale if scaled else tile_sums
                tiles = torch.where(live, lists.step_tiles[chunk, step], 0)
                positions = (tiles // chunk_tile_rows)[:, None] * logits_tile.block_n
                bias_sum.index_add_(0, (positions + in_tile).reshape(-1), tile_sums.reshape(-1))

        # The first step is enqueued before the host sync (which waits only for the steps'
        # copy, on a side stream: filtering.HostCopy), its kernels sized for any step (programs
        # past its kept tiles or columns return at once): the GPU works on it while the host
        # reads back the steps and enqueues the next.
        _, first_row, first_rows, first_acc_offset = next(token_chunks())
        recompute(capacity, first_row, first_row + first_rows, 0, v)
        step_gemms(0, 0, first_row, first_rows, first_acc_offset, 0, vocab_tiles, last=False)
        steps = steps.on_host()
        # Where most tiles are kept (flat softmaxes), exact mode's dense path is faster and exact.
        filtered = not steps.dense_is_faster(cdiv(n, logits_tile.block_m), vocab_tiles)
        if not filtered:
            del grad_logits  # and with it the step computed ahead (the dense path rewrites all)
    if not filtered:
        grad_logits = torch.empty((chunk_rows, plan.slab_v), dtype=e.dtype, device=e.device)
        warp_specialized = (plain_loss(bias, weight, softcap, label_smoothing)
                            and warp_specialized_fits(WARP_SPECIALIZED_MAX_K_STEPS, e, c, grad_logits))
        persistent = (not warp_specialized and recompute_is_persistent(d, logits_tile)
                      and tensor_descriptors_fit(e, c, grad_logits))
    if warp_specialized:
        launch_grad_logits = KernelLauncher(grad_logits_ws_kernel, reuse)
        descriptors = recompute_descriptors(e, c, grad_logits, WARP_SPECIALIZED_TILE)
    if persistent:
        launch_grad_logits = KernelLauncher(grad_logits_tma_kernel, reuse)
        sms, shared_memory = device_limits(e.device)
        persistent_stages = stages_beside_output(logits_tile, e.element_size(), shared_memory)
        descriptors = (
            TensorDescriptor.from_tensor(e, [logits_tile.block_m, logits_tile.block_k]),
            TensorDescriptor.from_tensor(c, [logits_tile.block_n, logits_tile.block_k]),
            TensorDescriptor.from_tensor(grad_logits, [logits_tile.block_m, logits_tile.block_n]),
        )

    # The bias gradient is the d-logits' column sums: one sum by vocab position (filtered
    # mode), or one per chunk.
    if filtered:
        for chunk, row_start, rows, acc_offset in token_chunks():
            chunk_steps = steps.columns[chunk]
            for step, (first_column, end_column) in enumerate(chunk_steps):
                if chunk == step == 0:
                    continue  # went ahead of the sync
                programs = capacity if steps.counts is None else steps.counts[chunk][step]
                recompute(programs, row_start, row_start + rows, 0, v, chunk * steps.n_steps + step)
                step_gemms(chunk, step, row_start, rows, acc_offset, first_column, end_column - first_column,
                           last=step == len(chunk_steps) - 1)
            if chunk == 0 and len(chunk_steps) == 1 and plan.fp32_accumulator and need_grad_e:
                grad_e[:rows].copy_(acc[:rows])  # its one step went ahead, not knowing it was the last
        # The skipped tiles' share of dC, added to each column of theirs (and of dbias).
        if need_grad_c:
            wrap_triton(add_tile_rows_kernel)[(cdiv(v, 64), cdiv(d, 64))](
                grad_c, vocab_order, grad_c_per_tile, v, d, grad_c.stride(0), grad_c.stride(1),
                TILE_N=forward_n, BLOCK_P=64, BLOCK_D=64,
            )
        if bias is not None:
            bias_sum[:v] += grad_bias_per_tile.repeat_interleave(forward_n)[:v]
    else:
        # A traced call (torch.compile) keeps the Triton GEMMs, whose whole-buffer mutations
        # Inductor handles without copies.
        cublas = gradient_gemms_in_cublas(eager_cuda, e.dtype, filtered=False)
        last_slab = (v - 1) // plan.slab_v * plan.slab_v
        if cublas:  # views made once, not per step: each costs host time that small slabs lack
            c_slabs, grad_c_slabs = c.split(plan.slab_v), grad_c.split(plan.slab_v)
        bias_chunks: list[Tensor] = []

        def slab_loop() -> None:
            """Every token chunk's recompute and gradient GEMMs, slab by slab."""
            for chunk, row_start, rows, acc_offset in token_chunks():
                row_end = row_start + rows
                if cublas:
                    e_chunk = e[row_start:row_end]
                    acc_rows = acc[:rows] if plan.fp32_accumulator else grad_e[row_start:row_end]
                    d_logits_rows = grad_logits[:rows]
                    whole_slab = (d_logits_rows, d_logits_rows.T)
                bias_slabs: list[Tensor] = []
                for slab, col_start in enumerate(range(0, v, plan.slab_v)):
                    col_end = min(col_start + plan.slab_v, v)
                    cols = col_end - col_start
                    recompute(cdiv(rows, logits_tile.block_m) * cdiv(cols, logits_tile.block_n),
                              row_start, row_end, col_start, col_end)
                    final = plan.fp32_accumulator and col_start == last_slab
                    if cublas:
                        # cuBLAS on CUDA for bf16/fp32: dC rows written in place, dE summed in fp32
                        # by cuBLASLt (bf16 operands, fp32 C), so no temporaries.
                        d_logits, d_logits_t = (
                            whole_slab if cols == plan.slab_v else (d_logits_rows[:, :cols], d_logits_rows[:, :cols].T)
                        )
                        if need_grad_c and chunk == 0:
                            torch.mm(d_logits_t, e_chunk, out=grad_c_slabs[slab])
                        elif need_grad_c:
                            grad_c_slabs[slab].addmm_(d_logits_t, e_chunk)
                        if need_grad_e and col_start == 0:
                            torch.mm(d_logits, c_slabs[slab], out_dtype=acc.dtype, out=acc_rows)
                        elif need_grad_e:
                            torch.addmm(acc_rows, d_logits, c_slabs[slab], out_dtype=acc.dtype, out=acc_rows)
                        if need_grad_e and final:
                            grad_e[row_start:row_end].copy_(acc_rows)
                    else:
                        # dC[slab] (+)= d_logits.T @ e[chunk]: M = cols, N = d, K = rows.
                        if need_grad_c:
                            wrap_triton(matmul_kernel)[(cdiv(cols, dc_tile.block_m) * cdiv(d, dc_tile.block_n),)](
                                grad_logits, 0, e, row_start * e.stride(0), grad_c, col_start * d, grad_c, 0, scale,
                                cols, d, rows,
                                grad_logits.stride(1), grad_logits.stride(0), e.stride(0), e.stride(1), d, 1, d, 1,
                                ACCUMULATE=chunk > 0, FINAL=False, SCALED=scaled,
                                BLOCK_M=dc_tile.block_m, BLOCK_N=dc_tile.block_n, BLOCK_K=dc_tile.block_k,
                                GROUP_M=dc_tile.group_m, num_warps=dc_tile.num_warps, num_stages=dc_tile.num_stages,
                                **flags,
                            )
                        # dE[chunk] += d_logits @ c[slab]: M = rows, N = d, K = cols; the last slab
                        # writes dE itself.
                        if need_grad_e:
                            wrap_triton(matmul_kernel)[(cdiv(rows, de_tile.block_m) * cdiv(d, de_tile.block_n),)](
                                grad_logits, 0, c, col_start * c.stride(0), acc, acc_offset, grad_e, row_start * d, scale,
                                rows, d, cols,
                                grad_logits.stride(0), grad_logits.stride(1), c.stride(0), c.stride(1), d, 1, d, 1,
                                ACCUMULATE=col_start > 0, FINAL=final, SCALED=scaled,
                                BLOCK_M=de_tile.block_m, BLOCK_N=de_tile.block_n, BLOCK_K=de_tile.block_k,
                                GROUP_M=de_tile.group_m, num_warps=de_tile.num_warps, num_stages=de_tile.num_stages,
                                **flags,
                            )
                    if bias is not None:
                        slab_sum = grad_logits[:rows, :cols].sum(dim=0, dtype=torch.float32)
                        bias_slabs.append(slab_sum * scale if scaled else slab_sum)
                if bias is not None:
                    bias_chunks.append(torch.cat(bias_slabs))

        if graphs.eligible(eager_cuda, bias):
            key = (*map(graphs.tensor_key, (e, c, targets, weight, lse, coef_softmax, coef_target, coef_smooth,
                                             scale, grad_e, grad_c, acc, grad_logits)),
                   plan, config, softcap, label_smoothing, warp_specialized, persistent, cublas, WARP_SPECIALIZED_TILE,
                   need_grad_e, need_grad_c)
            graphs.SLAB_LOOPS.run(key, slab_loop, e.device)
        else:
            slab_loop()
    if bias is None:
        return grad_e, grad_c, c.new_empty((0,))
    if filtered:  # back from positions in the vocab order
        grad_bias = torch.empty(v, dtype=torch.float32, device=e.device).index_copy_(0, vocab_order, bias_sum[:v])
    else:
        grad_bias = torch.stack(bias_chunks).sum(dim=0)
    return grad_e, grad_c, grad_bias.to(bias.dtype)


def gradient_gemms_in_cublas(on_cuda: bool, dtype: torch.dtype, filtered: bool) -> bool:
    """Whether an eager call runs the two gradient GEMMs in cuBLAS: on CUDA for bf16 and fp32
    in exact mode. fp16's d-logits are scaled (which the Triton GEMMs undo) and filtered
    mode's GEMMs are block-sparse, so those stay Triton; the tuner asks the same question."""
    return on_cuda and dtype != torch.float16 and not filtered and GEMM_BACKEND == "cublas"


def recompute_descriptors(e: Tensor, c: Tensor, grad_logits: Tensor, tile: TileConfig = WARP_SPECIALIZED_TILE) -> tuple:
    """grad_logits_ws_kernel's descriptors, made once per backward: e and c in the tile's K
    steps, the d-logits buffer in the half tiles its epilogue stores (kernels/warp_specialized.py)."""
    return (*operand_descriptors(e, c, tile), gluon_descriptor(grad_logits, [tile.block_m, tile.block_n // 2]))


def recompute_warp_specialized(
    launch: KernelLauncher, descriptors: tuple, targets: Tensor, lse: Tensor, coef_softmax: Tensor,
    coef_target: Tensor, scale: Tensor, scaled: bool, row_start: int, rows: int, col_start: int, cols: int,
    tile: TileConfig = WARP_SPECIALIZED_TILE, per_sm: int = PROGRAMS_PER_SM,
) -> None:
    """One slab's d logits (rows x cols from (row_start, col_start)) by grad_logits_ws_kernel
    into the buffer recompute_descriptors describes; the tile and programs per SM are the
    probe's knobs (benchmarks/probe_recompute_ws.py)."""
    launch(
        (programs_for(lse.device, tiles_of(rows, cols, tile), per_sm),), *descriptors, targets, lse,
        coef_softmax, coef_target, scale, row_start, rows, col_start, cols, descriptors[0].shape[1],  # D
        GROUP_M=tile.group_m, STAGES=tile.num_stages, SCALED=scaled, **launch_options(per_sm),
    )
