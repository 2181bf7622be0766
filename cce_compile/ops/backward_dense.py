"""Exact mode's backward: per token chunk and vocab slab, the recompute (ops/recompute.py)
writes the slab's d-logits, then dC[slab] (+)= d_logits.T @ e[chunk] and dE[chunk] +=
d_logits @ c[slab] (fp32 accumulator for 16-bit inputs). Four GEMMs' work for fwd+bwd, never
more than a slab's d-logits in memory. Where the plan says so the slab loop replays as one
CUDA graph (ops/graphs.py)."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from ..kernels.backward import matmul_kernel
from . import graphs
from .backward_call import BackwardCall, Gradients
from .problem import cdiv
from .recompute import Recompute


STAGED = ("e", "c", "bias", "targets", "weight", "lse", "coef_softmax", "coef_target", "coef_smooth", "coef_entropy",
          "scale")
"""The call's tensors the slab loop reads (staged where it is graphed: ops/graphs.py)."""


class DenseBackward:
    """`DenseBackward(call, gradients).run()` fills the gradients and returns dbias (or None)."""

    def __init__(self, call: BackwardCall, gradients: Gradients) -> None:
        if call.plan.cuda_graphs:  # what the graphed slab loop reads, where the next step finds it (ops/graphs.py)
            call = replace(call, **dict(zip(STAGED, graphs.staged(*(getattr(call, name) for name in STAGED)))))
        self.call = call
        self.gradients = gradients
        steps = call.steps
        (self.grad_logits,) = graphs.carve(call.e.device, ((call.chunk_rows, steps.slab_v), call.e.dtype),
                                            large_pool=call.plan.cuda_graphs)
        # dbias's fp32 sum, a block of its own: the caller may keep it (fp32 c) without the scratch.
        # Without a bias nothing: a large-pool block padded above 1 MiB for an empty tensor is memory
        # the plan does not count (held_bytes).
        (self.grad_bias,) = graphs.carve(call.e.device, ((call.v if call.bias is not None else 0,), torch.float32),
                                         large_pool=call.plan.cuda_graphs and call.bias is not None)
        self.grad_bias.zero_()
        self.recompute = Recompute(call, self.grad_logits)
        self.cublas = call.plan.gradient_gemms == "cublas"
        # Views made once, not per step: each costs host time that small slabs lack.
        self.c_slabs = call.c.split(steps.slab_v)
        self.grad_c_slabs = gradients.grad_c.split(steps.slab_v) if call.need_grad_c else ()
        self.last_slab = (call.v - 1) // steps.slab_v * steps.slab_v

    def run(self) -> Tensor | None:
        call = self.call
        if call.plan.cuda_graphs:
            graphs.SLAB_LOOPS.run(self.graph_key(), self.slab_loop, call.e.device)
        else:
            self.slab_loop()
        return self.grad_bias if call.bias is not None else None

    def graph_tensors(self) -> tuple[Tensor | None, ...]:
        """Every tensor the slab loop's launches read or write."""
        call, gradients = self.call, self.gradients
        return (*(getattr(call, name) for name in STAGED), gradients.grad_e, gradients.grad_c, gradients.acc,
                self.grad_logits, self.grad_bias)

    def graph_key(self) -> tuple:
        """Where each tensor the slab loop touches is, and the settings."""
        call = self.call
        return (*map(graphs.tensor_key, self.graph_tensors()), call.plan, call.config, call.softcap,
                call.label_smoothing, call.need_grad_e, call.need_grad_c, graphs.matmul_settings())

    def slab_loop(self) -> None:
        """Every token chunk's recompute and gradient GEMMs, slab by slab."""
        call = self.call
        for chunk, row_start, rows, acc_offset in call.token_chunks():
            views = self.chunk_views(row_start, rows) if self.cublas else None
            for slab, col_start in enumerate(range(0, call.v, call.steps.slab_v)):
                cols = min(call.steps.slab_v, call.v - col_start)
                self.recompute(row_start, rows, col_start, cols)
                if views is not None:
                    self.cublas_gemms(chunk, slab, col_start, cols, *views)
                else:
                    self.triton_gemms(chunk, row_start, rows, acc_offset, col_start, cols)
                if call.bias is not None:  # in place, so a replayed loop adds into the same sum
                    slab_sum = self.grad_logits[:rows, :cols].sum(dim=0, dtype=torch.float32)
                    self.grad_bias[col_start:col_start + cols] += slab_sum * call.scale if call.scaled else slab_sum

    def chunk_views(self, row_start: int, rows: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """A chunk's operands for cuBLAS, made once per chunk, not per step: (its rows of the
        d-logits buffer and their transpose, of e, of the dE accumulator, and of dE)."""
        call = self.call
        d_logits = self.grad_logits[:rows]
        return (d_logits, d_logits.T, call.e[row_start:row_start + rows],
                self.gradients.acc_rows(call, row_start, rows), self.gradients.grad_e[row_start:row_start + rows])

    def cublas_gemms(self, chunk: int, slab: int, col_start: int, cols: int, d_logits: Tensor, d_logits_t: Tensor,
                     e_chunk: Tensor, acc_rows: Tensor, grad_e_rows: Tensor) -> None:
        """dC rows written in place; dE summed in fp32 by cuBLASLt (16-bit operands, fp32 C),
        so no temporaries; the last slab writes dE from the accumulator."""
        call, acc = self.call, self.gradients.acc
        if cols != call.steps.slab_v:
            d_logits, d_logits_t = d_logits[:, :cols], d_logits[:, :cols].T
        if call.need_grad_c and chunk == 0:
            torch.mm(d_logits_t, e_chunk, out=self.grad_c_slabs[slab])
        elif call.need_grad_c:
            self.grad_c_slabs[slab].addmm_(d_logits_t, e_chunk)
        if not call.need_grad_e:
            return
        if col_start == 0:
            torch.mm(d_logits, self.c_slabs[slab], out_dtype=acc.dtype, out=acc_rows)
        else:
            torch.addmm(acc_rows, d_logits, self.c_slabs[slab], out_dtype=acc.dtype, out=acc_rows)
        if call.steps.fp32_accumulator and col_start == self.last_slab:
            grad_e_rows.copy_(acc_rows)

    def triton_gemms(self, chunk: int, row_start: int, rows: int, acc_offset: int, col_start: int, cols: int) -> None:
        """matmul_kernel (fp16, whose scaled d-logits it divides back, and the interpreter):
        dC[slab] (+)= d_logits.T @ e[chunk] (M = cols, N = D, K = rows) and dE[chunk] +=
        d_logits @ c[slab] (M = rows, N = D, K = cols), the last slab writing dE itself."""
        call, gradients, grad_logits = self.call, self.gradients, self.grad_logits
        e, c, d = call.e, call.c, call.d
        dc_tile, de_tile = call.config.grad_classifier, call.config.grad_hidden
        if call.need_grad_c:
            matmul_kernel[(cdiv(cols, dc_tile.block_m) * cdiv(d, dc_tile.block_n),)](
                grad_logits, 0, e, row_start * e.stride(0), gradients.grad_c, col_start * d, gradients.grad_c, 0,
                call.scale, cols, d, rows,
                grad_logits.stride(1), grad_logits.stride(0), e.stride(0), e.stride(1), d, 1, d, 1,
                ACCUMULATE=chunk > 0, FINAL=False, SCALED=call.scaled,
                BLOCK_M=dc_tile.block_m, BLOCK_N=dc_tile.block_n, BLOCK_K=dc_tile.block_k,
                GROUP_M=dc_tile.group_m, num_warps=dc_tile.num_warps, num_stages=dc_tile.num_stages, **call.flags,
            )
        if call.need_grad_e:
            final = call.steps.fp32_accumulator and col_start == self.last_slab
            matmul_kernel[(cdiv(rows, de_tile.block_m) * cdiv(d, de_tile.block_n),)](
                grad_logits, 0, c, col_start * c.stride(0), gradients.acc, acc_offset, gradients.grad_e,
                row_start * d, call.scale, rows, d, cols,
                grad_logits.stride(0), grad_logits.stride(1), c.stride(0), c.stride(1), d, 1, d, 1,
                ACCUMULATE=col_start > 0, FINAL=final, SCALED=call.scaled,
                BLOCK_M=de_tile.block_m, BLOCK_N=de_tile.block_n, BLOCK_K=de_tile.block_k,
                GROUP_M=de_tile.group_m, num_warps=de_tile.num_warps, num_stages=de_tile.num_stages, **call.flags,
            )
