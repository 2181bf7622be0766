"""Filtered mode's backward: the vocabulary walked in the forward's vocab_order, only the
d-logits tiles the forward kept recomputed (grad_logits_kernel into one slot per kept tile),
the two gradient GEMMs block-sparse over the slots (sparse_matmul_kernel), from work lists
built for all steps in one launch (ops/filtering.py). What the skipped tiles hold comes back
as their row sums and tilt (filtering.SkippedTiles, Tilt): dE's accumulator starts from them,
dC's rows get them by vocab tile. Steps span as many vocab tiles as their kept tiles fill the
slots; read back by the host, where most tiles are kept (a flat softmax) the dense path runs
instead."""

from __future__ import annotations

import torch
from torch import Tensor

from ..config.keys import n_bucket
from ..kernels.backward import grad_logits_kernel, sparse_matmul_kernel
from ..kernels.dropped_tiles import add_tile_rows_kernel, tile_row_sums_kernel
from .backward_call import BackwardCall, Gradients
from .backward_dense import DenseBackward
from .filtering import (
    FilterStats, SkippedEntropy, Tilt, chunk_tile_mask, dense_is_faster, filtered_steps, skipped_tiles, step_lists,
    tilt_sample_size,
)
from .launch import KernelLauncher
from .problem import cdiv, device_limits
from .recompute import launch_pointer_recompute

class FilteredBackward:
    """Made before the gradients are allocated (its work lists and put-back rows are built
    on the device first, so their temporaries never add to the peak); `run(gradients)` then
    fills them and returns dbias (or None)."""

    def __init__(self, call: BackwardCall, filter_stats: FilterStats) -> None:
        self.call = call
        kept_tiles, tile_lse = filter_stats.kept_tiles, filter_stats.tile_lse
        self.tile_lse = tile_lse
        self.tile_mean_logit = filter_stats.tile_mean_logit
        if call.coef_entropy is not None and self.tile_mean_logit.shape != tile_lse.shape:
            raise ValueError("tile_mean_logit: filtered mode's entropy needs the forward's (N, vocab tiles) "
                             "tile mean logits")
        e, v, d = call.e, call.v, call.d
        tile, forward_n = call.config.grad_logits, call.config.forward.block_n
        self.vocab_tiles = cdiv(v, tile.block_n)
        if kept_tiles.shape != (cdiv(call.n, tile.block_m), self.vocab_tiles):
            raise ValueError("kept_tiles: filtered mode needs the forward's (row blocks, vocab tiles) kept tiles")
        if tile_lse.shape != (call.n, cdiv(v, forward_n)):
            raise ValueError("tile_lse: filtered mode needs the forward's (N, vocab tiles) tile log-sum-exps")
        self.capacity = call.steps.step_slots(call.n, tile.block_m, tile.block_n)
        self.read_back = call.plan.read_back_steps
        mask = chunk_tile_mask(kept_tiles, call.steps.n_chunks, call.chunk_tile_rows)
        self.steps = filtered_steps(mask, self.capacity, self.read_back)
        self.lists = step_lists(mask, self.steps, self.capacity)
        self.skipped = skipped_tiles(kept_tiles, call.vocab_order, call.weight, call.label_smoothing > 0.0,
                                     forward_n, tile.block_m, tile.block_n)
        self.forward_tiles = tile_lse.shape[1]
        if call.need_grad_e:
            self.put_back_rows = self.dE_put_back_rows()
        if call.need_grad_c:
            self.grad_c_per_tile = torch.zeros((self.forward_tiles, d), dtype=torch.float32, device=e.device)
        self.grad_bias_per_tile = (torch.zeros(self.forward_tiles, dtype=torch.float32, device=e.device)
                                   if call.bias is not None else None)
        # Steps only the device knows: the recompute's and dC GEMM's programs stride over each
        # step's slots and columns, this many of them.
        strided_programs = call.plan.strided_programs_per_sm * device_limits(e.device)[0]
        column_blocks = cdiv(d, call.config.grad_classifier.block_n)
        self.strided_sizes = (min(self.capacity, strided_programs),
                              min(self.vocab_tiles, max(1, strided_programs // column_blocks)))
        self.launch_recompute = KernelLauncher(grad_logits_kernel, call.plan.direct_launch)
        self.launch_sparse_matmul = KernelLauncher(sparse_matmul_kernel, call.plan.direct_launch)

    def dE_put_back_rows(self) -> Tensor:
        """What the skipped tiles' columns of each chunk's put-back GEMM multiply: c summed per
        forward tile, then the tilt's rows (bf16 on CUDA, for the tensor cores)."""
        call = self.call
        c, v, d = call.c, call.v, call.d
        forward_n = call.config.forward.block_n
        c_tile_sums = torch.empty((self.forward_tiles, d), dtype=torch.float32, device=c.device)
        tile_row_sums_kernel[(self.forward_tiles, cdiv(d, 64))](
            c, call.vocab_order, c_tile_sums, v, d, c.stride(0), c.stride(1), TILE_N=forward_n, BLOCK_D=64,
        )
        sample_size = tilt_sample_size(n_bucket(call.n), v, d)
        self.tilt = Tilt.estimate(
            c, call.bias, call.vocab_order, self.skipped.tile_mass(self.tile_lse, call.coef_softmax), forward_n,
            sample_size, c.is_cuda, tile_sums=c_tile_sums, logit_scale=call.plan.logit_scale,
        ) if sample_size else None
        rows = torch.cat([c_tile_sums, self.tilt.rows()]) if self.tilt is not None else c_tile_sums
        return rows.bfloat16() if c.is_cuda else rows

    def run(self, gradients: Gradients) -> Tensor | None:
        call = self.call
        self.gradients = gradients
        tile = call.config.grad_logits
        self.grad_logits = torch.empty((self.capacity, tile.block_m, tile.block_n), dtype=call.e.dtype,
                                       device=call.e.device)
        # dbias's kept share: the recompute adds each kept tile's column sums, by tile row and vocab
        # position (no two tiles of a chunk share a place, so no atomics and no per-step pass; a
        # chunk's tile rows x V fp32, 0.01-0.06 x the gradients on the benchmark heads)
        self.tile_bias_sums = (torch.zeros((call.chunk_tile_rows, self.vocab_tiles * tile.block_n),
                                           dtype=torch.float32, device=call.e.device)
                               if call.bias is not None else None)
        if self.read_back:
            # The first step is enqueued before the host sync (which waits only for the steps'
            # copy, on a side stream: filtering.HostCopy), sized for any step: the GPU works on
            # it while the host reads back the steps and enqueues the next.
            _, first_row, first_rows, first_acc_offset = next(call.token_chunks())
            self.recompute(self.capacity, first_row, first_rows, 0)
            self.step_gemms(0, 0, first_row, first_rows, first_acc_offset, self.vocab_tiles, last=False)
            self.steps = self.steps.on_host()
            tile_rows = cdiv(call.n, tile.block_m)
            if dense_is_faster(self.steps.kept(), tile_rows, self.vocab_tiles, call.plan.dense_fraction):
                del self.grad_logits  # and with it the step computed ahead: the dense path rewrites all
                return DenseBackward(call, gradients).run()
        self.launch_steps()
        return self.finish()

    def launch_steps(self) -> None:
        """Each chunk's steps: those read back, each at its size (its kept tiles and columns;
        chunk 0's first ran before the sync), or, where only the device knows them, the most
        packing can make, each run by programs striding over its slots and columns
        (strided_sizes: an empty step costs its launches and writes nothing; the last writes dE
        from the fp32 accumulator, one pass over it as in eager)."""
        call, steps = self.call, self.steps
        for chunk, row_start, rows, acc_offset in call.token_chunks():
            if self.read_back:
                sizes = [(count, end - first) for count, (first, end) in zip(steps.counts[chunk], steps.columns[chunk])]
            else:
                sizes = [self.strided_sizes] * steps.n_steps
            for step, (programs, columns) in enumerate(sizes):
                if self.read_back and chunk == step == 0:
                    continue
                self.recompute(programs, row_start, rows, chunk * steps.n_steps + step)
                self.step_gemms(chunk, step, row_start, rows, acc_offset, columns, last=step == len(sizes) - 1)
            if self.read_back and chunk == 0 and len(sizes) == 1 and call.steps.fp32_accumulator and call.need_grad_e:
                # Its one step went ahead, not knowing it was the last.
                self.gradients.grad_e[:rows].copy_(self.gradients.acc[:rows])

    def finish(self) -> Tensor | None:
        """The skipped tiles' share of dC, added to each column of theirs; dbias back from
        positions in the vocab order."""
        call = self.call
        v, d, forward_n = call.v, call.d, call.config.forward.block_n
        grad_c = self.gradients.grad_c
        if call.need_grad_c:
            add_tile_rows_kernel[(cdiv(v, 64), cdiv(d, 64))](
                grad_c, call.vocab_order, self.grad_c_per_tile, v, d, grad_c.stride(0), grad_c.stride(1),
                TILE_N=forward_n, BLOCK_P=64, BLOCK_D=64,
            )
        if call.bias is None:
            return None
        bias_sum = self.tile_bias_sums.sum(dim=0)[:v]
        if call.scaled:
            bias_sum *= call.scale
        bias_sum += self.grad_bias_per_tile.repeat_interleave(forward_n)[:v]
        return torch.empty(v, dtype=torch.float32, device=call.e.device).index_copy_(0, call.vocab_order, bias_sum)

    def recompute(self, programs: int, row_start: int, rows: int, step_index: int) -> None:
        """The step's kept tiles into their slots: a program each, or, where only the device
        knows the step, `programs` striding over them."""
        lists = (self.lists.step_tiles, self.lists.step_counts, step_index, self.capacity)
        launch_pointer_recompute(self.launch_recompute, self.call, self.grad_logits, row_start, rows, 0, self.call.v,
                                 programs=programs, lists=lists, strided=not self.read_back,
                                 tile_bias_sums=self.tile_bias_sums)

    def put_back_skipped_tiles(self, row_start: int, rows: int) -> None:
        """A token chunk's skipped tiles (SkippedTiles): dE's accumulator starts from their
        share (one GEMM: [d_logits | the tilt's columns] against [c_tile_sums; the tilt's
        rows], bf16 operands and fp32 sums on CUDA); dC's and dbias's per-tile shares are
        summed for the end."""
        call, gradients = self.call, self.gradients
        row_end = row_start + rows
        coef_smooth = call.coef_smooth[row_start:row_end] if call.label_smoothing > 0.0 else None
        entropy = None if call.coef_entropy is None else SkippedEntropy(
            call.coef_entropy[row_start:row_end], self.tile_mean_logit[row_start:row_end])
        d_logits, row_mass = self.skipped.d_logits(
            self.tile_lse[row_start:row_end], call.coef_softmax[row_start:row_end], coef_smooth, row_start, entropy,
            call.lse[row_start:row_end], call.softcap)
        e_rows = call.e[row_start:row_end]
        on_cuda = call.e.is_cuda
        if call.need_grad_e:
            acc_rows = gradients.acc_rows(call, row_start, rows)
            columns = torch.empty((rows, self.put_back_rows.shape[0]), dtype=self.put_back_rows.dtype,
                                  device=call.e.device)
            columns[:, :self.forward_tiles].copy_(d_logits)
            if self.tilt is not None:
                self.tilt.columns(e_rows, row_mass, out=columns[:, self.forward_tiles:])
            mm_options = {"out_dtype": torch.float32} if on_cuda else {}
            torch.mm(columns, self.put_back_rows, out=acc_rows, **mm_options)
        if call.need_grad_c and on_cuda:
            d_logits_t = columns[:, :self.forward_tiles].T if call.need_grad_e else d_logits.T.bfloat16()
            self.grad_c_per_tile.add_(torch.mm(d_logits_t, e_rows.bfloat16(), out_dtype=torch.float32))
        elif call.need_grad_c:
            self.grad_c_per_tile.addmm_(d_logits.T, e_rows.to(torch.float32))
        if self.grad_bias_per_tile is not None:
            self.grad_bias_per_tile.add_(d_logits.sum(dim=0))

    def step_gemms(self, chunk: int, step: int, row_start: int, rows: int, acc_offset: int, columns: int,
                   last: bool) -> None:
        """A step's dC and dE GEMMs over its kept tiles. The dC GEMM reads the step's columns on
        the device: `columns` programs (per column block) may run past them or, where the host
        does not know them, stride over them; `last`: the chunk's last step, which writes dE
        itself."""
        call, lists, steps = self.call, self.lists, self.steps
        e, c, d, v = call.e, call.c, call.d, call.v
        tile, dc_tile, de_tile = call.config.grad_logits, call.config.grad_classifier, call.config.grad_hidden
        # The sparse GEMMs step through whole d-logits tiles, in parts of their block_k.
        sparse_k = min(dc_tile.block_k, de_tile.block_k, tile.block_m, tile.block_n)
        step_index = chunk * steps.n_steps + step
        if step == 0:
            self.put_back_skipped_tiles(row_start, rows)
        if call.need_grad_c:  # dC[order[step's columns]] (+)= tiles.T @ e[chunk]: M = V, K = chunk rows
            self.launch_sparse_matmul(
                (columns * cdiv(d, dc_tile.block_n),),
                self.grad_logits, e, row_start * e.stride(0), call.vocab_order, self.gradients.grad_c, 0,
                call.vocab_order, self.gradients.grad_c, 0,
                lists.dc_begin, lists.dc_count, chunk * self.vocab_tiles, columns,
                steps.step_bounds, chunk * steps.step_bounds.stride(0) + step,
                lists.dc_rows, lists.dc_rows, step_index * self.capacity, call.scale, v, d, rows,
                e.stride(0), e.stride(1),
                BY_COLUMN=True, STRIDED=not self.read_back, SKIP_EMPTY=False, ACCUMULATE=chunk > 0, FINAL=False,
                SCALED=call.scaled,
                TILE_M=tile.block_n, TILE_K=tile.block_m, BLOCK_N=dc_tile.block_n,
                BLOCK_K=sparse_k, GROUP_M=dc_tile.group_m, num_warps=dc_tile.num_warps,
                num_stages=dc_tile.num_stages, **call.flags,
            )
        tile_rows = cdiv(rows, tile.block_m)
        if call.need_grad_e:  # dE[chunk] += tiles @ c[order[...]]: M = chunk rows, K = V
            self.launch_sparse_matmul(
                (tile_rows * cdiv(d, de_tile.block_n),),
                self.grad_logits, c, 0, call.vocab_order, self.gradients.acc, acc_offset, call.vocab_order,
                self.gradients.grad_e, row_start * d,
                lists.de_begin, lists.de_count, step_index * call.chunk_tile_rows, tile_rows, steps.step_bounds, 0,
                lists.de_slots, lists.de_cols, step_index * self.capacity, call.scale, rows, d, v,
                c.stride(0), c.stride(1),
                BY_COLUMN=False, STRIDED=False, SKIP_EMPTY=not self.read_back, ACCUMULATE=True,
                FINAL=call.steps.fp32_accumulator and last, SCALED=call.scaled,
                TILE_M=tile.block_m, TILE_K=tile.block_n, BLOCK_N=de_tile.block_n,
                BLOCK_K=sparse_k, GROUP_M=de_tile.group_m, num_warps=de_tile.num_warps,
                num_stages=de_tile.num_stages, **call.flags,
            )
