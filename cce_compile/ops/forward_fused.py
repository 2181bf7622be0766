"""The forward that finishes the gradients too, for a scalar loss (mean or sum): three GEMMs
of work for forward and backward, where the recompute takes four.

Per token chunk (plan.workspace_rows rows):
1. shift = each row's mean logit over a sample of the vocabulary (every plan.shift_stride-th row
   of c and bias): one GEMV, before the chunk.
2. The fused kernel (kernels/fused_forward.py) tiles the chunk's logits once: the workspace
   gets q = exp(z - shift) (times soft-capping's derivative), the statistics each row's sum
   of exp(z - shift) and largest logit, so lse = shift + log(sum). A row whose lse runs more
   than SAFE_GAP above its shift is done again with its largest logit as the shift (a rare,
   very peaked row; nothing overflows then): kernels/fused_rows.py flags them.
3. With the chunk's coefficients (ops/loss_terms.py's algebra, in kernels/fused_rows.py; the
   loss's 1/denominator, z-loss and a temperature's 1/T folded in), d_logits = s * q - coef_smooth * w with
   s = coef_softmax * exp(shift - lse) per row, and the target's -coef_target folded into its
   own workspace entry. So dE[chunk] = s * (q @ c) - coef_smooth * (w @ c) and
   dC += q.T @ (s * e[chunk]) are cuBLAS GEMMs on the workspace as the kernel left it (dE on a
   second stream beside dC where the plan says so), and label smoothing's rank-one share of dC
   is added once at the end.

Everything the chunk loop writes is allocated before it, so where the plan says so a call that
recurs on the same tensors replays the loop as one CUDA graph (ops/graphs.py): at small D the
loop's ~90 launches a chunk cost more host time than the GPU spends on them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from ..config.kernel_config import KernelConfig
from ..kernels.fused_forward import REDO_SPLITS, fused_forward_kernel, fused_forward_tma_kernel, scale_unless_one_kernel
from ..kernels.fused_rows import row_finish_kernel, row_shift_kernel
from ..kernels.warp_specialized import fused_forward_ws_kernel
from ..plan.launch import LaunchPlan
from . import graphs, streams
from .cpu_path import backward_cpu, forward_cpu, scale_and_cap
from .gluon import gluon_descriptor, launch_options, operand_descriptors, programs_for, tiles_of
from .launch import AheadCompiler, KernelLauncher, RecentKinds, integer_class
from .loss_terms import grad_coefficients, mean_scale, out_of_range, target_weight, token_loss, z_loss_terms
from .problem import cdiv, device_limits, kernel_flags, stages_beside_output

SAFE_GAP = 60.0
"""How far a row's lse may lie above its shift: q <= exp(gap) stays inside fp32 and bf16 and
s = coef * exp(-gap) stays normal in them."""
SHIFT_ROWS, FINISH_ROWS, TILE_BLOCK = 8, 16, 512
"""Rows per program of row_shift_kernel (a chunk of Qwen2.5's 896 rows gets 112 programs: its
pass over the statistics, 2 x 4 bytes x 1187 tiles a row there, is bound by how many SMs
read) and of row_finish_kernel, and vocab tiles per load: few dependent loads per program."""

CALLS_COMPILED_AHEAD = RecentKinds(capacity=256)
"""The kinds of call (FusedForward.compile_ahead's key) whose kernels were compiled ahead: a
later call of the kind skips the bookkeeping. A forgotten kind's next call only walks its
launch keys again, all compiled by then."""
SCALE_BLOCK = 8192
"""Elements per program of scale_unless_one_kernel."""


def scale_unless_one(launch: Any, gradient: Tensor, scale: Tensor) -> None:
    """gradient *= scale (a one-element fp32 tensor) through `launch`, a KernelLauncher or
    AheadCompiler of scale_unless_one_kernel: the backward's only kernel, which skips the pass
    when the upstream gradient is 1 (a loss's own backward) without a host sync to ask."""
    launch((cdiv(gradient.numel(), SCALE_BLOCK),), gradient, gradient.numel(), scale, BLOCK=SCALE_BLOCK)


def fp32_product(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    """a @ b summed and returned in fp32 (into `out` where given): cuBLASLt's 16-bit operands
    with an fp32 result on CUDA (no fp32 copies of the operands), fp32 operands elsewhere."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32, out=out)
    return torch.mm(a.float(), b.float(), out=out)


def reduction_scale(targets: Tensor, weight: Tensor | None, v: int, ignore_index: int, reduction: str) -> Tensor:
    """d loss / d (a token's loss): 1 for "sum", 1 / (the valid tokens, or their weights) for
    "mean" (0 where that is 0: loss_terms.mean_scale); 0-d fp32 on the device, no host sync."""
    if reduction == "sum":
        return torch.ones((), dtype=torch.float32, device=targets.device)
    return mean_scale(target_weight(targets, weight, targets != ignore_index, v).sum())


def gradient_scale(scale: Tensor, logit_scale: float, targets: Tensor, v: int, ignore_index: int) -> Tensor:
    """What the gradients scale by (0-d fp32): the reduction's `scale`, times the chain rule's
    1/T with a temperature, and NaN where any target is out of range. Such a token's loss is
    NaN (loss_terms); one scale serves every row here, so all its gradients are NaN (the
    ignored tokens' dE rows stay 0), for a grad scaler to skip the step. A few ops over the
    N targets once a call, no host sync."""
    grad_scale = scale * logit_scale if logit_scale != 1.0 else scale
    return torch.where(out_of_range(targets, v, ignore_index).any(), float("nan"), grad_scale)


def run_fused(
    plan: LaunchPlan, config: KernelConfig, e: Tensor, c: Tensor, targets: Tensor, bias: Tensor | None,
    weight: Tensor | None, ignore_index: int, label_smoothing: float, softcap: float, z_loss: float, reduction: str,
    need_grad_e: bool, need_grad_c: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> (loss 0-d fp32, grad_e, grad_c, grad_bias): the gradients of the reduced loss, each
    empty where not needed (grad_bias without a bias)."""
    fused = FusedForward(plan, config, e, c, targets, bias, weight, ignore_index, label_smoothing, softcap, z_loss,
                         reduction, need_grad_e, need_grad_c)
    if plan.compile_ahead:
        fused.compile_ahead()
    if plan.cuda_graphs:
        graphs.CHUNK_LOOPS.run(fused.graph_key(), fused.chunk_loop, e.device, fused.side_streams())
    else:
        fused.chunk_loop()
    return fused.finish()


class FusedForward:
    """The call's gradients and loss, filled chunk by chunk (`chunk`), then `finish`ed."""

    def __init__(self, plan: LaunchPlan, config: KernelConfig, e: Tensor, c: Tensor, targets: Tensor,
                 bias: Tensor | None, weight: Tensor | None, ignore_index: int, label_smoothing: float,
                 softcap: float, z_loss: float, reduction: str, need_grad_e: bool, need_grad_c: bool) -> None:
        self.plan, self.config = plan, config
        self.ignore_index, self.label_smoothing, self.softcap, self.z_loss = ignore_index, label_smoothing, softcap, z_loss
        self.need_grad_e, self.need_grad_c = need_grad_e, need_grad_c
        n, d = e.shape
        v = c.shape[0]
        scale = reduction_scale(targets, weight, v, ignore_index, reduction)
        grad_scale = gradient_scale(scale, plan.logit_scale, targets, v, ignore_index)
        # per token, summed by finish(); and dbias's fp32 sum (under 1 MiB at 128k classes: carved
        # with the losses, out of the small pool a graphed loop's key must not name)
        self.losses, grad_bias = graphs.carve(e.device, ((n,), torch.float32),
                                              ((v if bias is not None else 0,), torch.float32), large_pool=plan.cuda_graphs)
        self.grad_bias = grad_bias.zero_() if bias is not None else None
        self.grad_e = torch.empty(e.shape if need_grad_e else (0,), dtype=e.dtype, device=e.device)
        self.grad_c = torch.empty(c.shape if need_grad_c else (0,), dtype=c.dtype, device=c.device)
        # the plain-PyTorch path sums dC over the token chunks in fp32 and rounds once (finish):
        # summed in bf16, each chunk's rounding added to the last, 64 chunks doubled its error
        self.grad_c_sum = (torch.zeros(c.shape, dtype=torch.float32, device=c.device)
                           if plan.fused == "cpu" and need_grad_c and c.dtype != torch.float32 else None)
        self.smoothing = label_smoothing > 0.0
        # label smoothing's -coef_smooth * w share on the kernels' path: w @ c for dE, sum of
        # coef_smooth * e for dC (the plain-PyTorch path's chunks take it in backward_cpu)
        kernels_smoothing = self.smoothing and plan.fused != "cpu"
        smoothing_weights = (weight.to(torch.float32) if weight is not None
                             else torch.ones(v, dtype=torch.float32, device=e.device)) if kernels_smoothing else None
        smoothing_of_c = (smoothing_weights.to(c.dtype) @ c).float() if kernels_smoothing and need_grad_e else None
        smoothing_of_e = torch.zeros(d, dtype=torch.float32, device=e.device) if kernels_smoothing else None
        read = (e, c, targets, bias, weight, scale, grad_scale, smoothing_weights, smoothing_of_c, smoothing_of_e)
        (self.e, self.c, self.targets, self.bias, self.weight, self.scale, self.grad_scale, self.smoothing_weights,
         self.smoothing_of_c, self.smoothing_of_e) = graphs.staged(*read) if plan.cuda_graphs else read
        if plan.fused != "cpu":
            self.kernels = FusedKernels(plan, config, self.e, self.c, self.bias, self.weight, self.targets, softcap,
                                        label_smoothing, ignore_index, z_loss, need_grad_e, need_grad_c)
        # dE's GEMM on its own stream where dC's runs beside it
        self.grad_e_stream = (streams.grad_e_stream(e.device)
                              if plan.grad_e_side_stream and need_grad_e and need_grad_c else None)

    def compile_ahead(self) -> None:
        """On the first call of its kind (what picks the kernels' variants: plan, config, shape,
        dtype, options), start compiling what the chunk loop and the backward's scaling will
        launch, side by side, before the first launch: the first call pays the longest compile,
        not their sum."""
        kind = (self.plan, self.config, tuple(self.e.shape), self.e.dtype, self.e.device, self.bias is not None,
                self.weight is not None, self.softcap > 0.0, self.smoothing, self.z_loss > 0.0, self.need_grad_e,
                self.need_grad_c)
        if not CALLS_COMPILED_AHEAD.first_of_kind(kind):
            return
        self.kernels.compile_ahead(self.grad_scale, self.losses)
        for gradient in (self.grad_e, self.grad_c):  # the backward's scaling, the scale standing in for its own
            if gradient.numel():
                scale_unless_one(AheadCompiler(scale_unless_one_kernel), gradient, self.scale.reshape(1))

    def side_streams(self) -> tuple[torch.cuda.Stream, ...]:
        """The streams the chunk loop forks to besides the caller's (a capture must warm them)."""
        return (self.grad_e_stream,) if self.grad_e_stream is not None else ()

    def chunk_loop(self) -> None:
        """Every token chunk, into the gradients, the per-token losses and the buffers made above."""
        n, rows = self.e.shape[0], self.plan.workspace_rows
        for row_start in range(0, n, rows):
            self.chunk(row_start, min(rows, n - row_start))

    def graph_tensors(self) -> tuple[Tensor | None, ...]:
        """Every tensor the chunk loop's launches read or write (the kernels' buffers on CUDA)."""
        return (self.e, self.c, self.targets, self.bias, self.weight, self.scale, self.grad_scale, self.losses,
                self.grad_e, self.grad_c, self.grad_bias, self.smoothing_weights, self.smoothing_of_c,
                self.smoothing_of_e, *self.kernels.buffers())

    def graph_key(self) -> tuple:
        """Where each tensor the chunk loop touches is, and the settings."""
        return (*map(graphs.tensor_key, self.graph_tensors()), self.plan, self.config, self.ignore_index,
                self.label_smoothing, self.softcap, self.z_loss, self.need_grad_e, self.need_grad_c,
                graphs.matmul_settings())

    def chunk(self, row_start: int, rows: int) -> None:
        if self.plan.fused == "cpu":
            self.cpu_chunk(row_start, rows)
        else:
            self.kernels.run(row_start, rows, self.grad_scale, self.losses)
            self.gradients(row_start, rows)

    def gradients(self, row_start: int, rows: int) -> None:
        """The chunk's share of dE, dC and dbias from the workspace the kernels left; with a
        dE stream, dE runs there beside dC, and the next chunk's kernels wait for both."""
        row_end = row_start + rows
        e_rows = self.e[row_start:row_end]
        workspace = self.kernels.workspace[:rows]
        s = self.kernels.row_scale[:rows]  # the softmax's row scale on the workspace
        coef_smooth = self.kernels.coef_smooth[:rows]
        if self.need_grad_e:
            with streams.forked(self.grad_e_stream):
                self.grad_e_rows(workspace, s, coef_smooth, row_start, row_end)
        if self.need_grad_c:
            scaled_e = self.kernels.scaled_e[:rows]
            if row_start == 0:  # the first chunk writes dC, the later ones add to it
                torch.mm(workspace.T, scaled_e, out=self.grad_c)
            else:
                self.grad_c.addmm_(workspace.T, scaled_e)
        if self.smoothing:
            self.smoothing_of_e += coef_smooth @ e_rows.float()
        if self.grad_bias is not None:
            self.grad_bias += torch.mv(workspace.T, s.to(workspace.dtype)).float()
            if self.smoothing:
                self.grad_bias -= coef_smooth.sum() * self.smoothing_weights
        if self.grad_e_stream is not None:  # the next chunk's kernels write what dE reads
            torch.cuda.current_stream(self.e.device).wait_stream(self.grad_e_stream)

    def grad_e_rows(self, workspace: Tensor, s: Tensor, coef_smooth: Tensor, row_start: int, row_end: int) -> None:
        """dE of the chunk's rows: the workspace's product with c, summed in fp32, row-scaled."""
        grad_e = fp32_product(workspace, self.c, out=self.kernels.grad_e_sum[:row_end - row_start])
        if self.smoothing:
            grad_e.mul_(s[:, None]).addr_(coef_smooth, self.smoothing_of_c, alpha=-1)
            self.grad_e[row_start:row_end].copy_(grad_e)
        else:
            torch.mul(grad_e, s[:, None], out=self.grad_e[row_start:row_end])

    def cpu_chunk(self, row_start: int, rows: int) -> None:
        """The plain-PyTorch path's chunk: its forward and backward on the chunk's rows."""
        row_end = row_start + rows
        e_rows, targets = self.e[row_start:row_end], self.targets[row_start:row_end]
        lse, target_logit, weighted_sum, *_ = forward_cpu(
            e_rows, self.c, targets, self.bias, self.weight, self.softcap, self.smoothing, chunk_v=self.config.slab_v,
            logit_scale=self.plan.logit_scale)
        v = self.c.shape[0]
        valid = targets != self.ignore_index
        losses = token_loss(lse, target_logit, weighted_sum, targets, self.weight, v, self.ignore_index,
                            self.label_smoothing)
        if self.z_loss > 0.0:
            losses = losses + z_loss_terms(lse, self.z_loss, valid)
        self.losses[row_start:row_end] = losses
        grad_loss = torch.where(valid, self.grad_scale, 0.0).expand(rows)
        grad_lse = torch.where(valid, 2.0 * self.z_loss * self.grad_scale * lse, 0.0)
        coef_softmax, coef_target, coef_smooth = grad_coefficients(
            grad_loss, grad_lse, targets, self.weight, v, self.ignore_index, self.label_smoothing)
        tile = self.config.grad_logits
        grad_e, grad_c, grad_bias = backward_cpu(
            e_rows, self.c, targets, self.bias, self.weight, lse,
            coef_softmax, coef_target, coef_smooth if self.smoothing else None, self.softcap, 0.0,
            chunk_v=max(self.config.slab_v, self.config.forward.block_n), filter_tile=(tile.block_m, tile.block_n),
            vocab_order=None, need_grad_e=self.need_grad_e, need_grad_c=self.need_grad_c,
            logit_scale=self.plan.logit_scale, fp32_grad_c=True,
        )
        if self.need_grad_e:
            self.grad_e[row_start:row_end].copy_(grad_e)
        if self.need_grad_c:
            grad_c_sum = self.grad_c if self.grad_c_sum is None else self.grad_c_sum
            if row_start == 0:
                grad_c_sum.copy_(grad_c)
            else:
                grad_c_sum.add_(grad_c)
        if self.grad_bias is not None:
            self.grad_bias += grad_bias

    def finish(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        if self.e.shape[0] == 0:  # no token: nothing flows back
            if self.need_grad_c:
                self.grad_c.zero_()
        elif self.grad_c_sum is not None:
            self.grad_c.copy_(self.grad_c_sum)
        elif self.smoothing and self.need_grad_c and self.plan.fused != "cpu":
            self.grad_c.addr_(self.smoothing_weights.to(self.grad_c.dtype), self.smoothing_of_e.to(self.grad_c.dtype),
                              alpha=-1)
        # a tensor of its own, as the fake's: fp32 dbias is otherwise a view past the losses in their block
        grad_bias = self.grad_bias.to(self.bias.dtype, copy=True) if self.bias is not None else self.c.new_empty((0,))
        # scaled before the sum, as loss_terms.reduce_token_loss: a mean that fits does not overflow in it
        return (self.losses * self.scale).sum(), self.grad_e, self.grad_c, grad_bias


def shift_sample_weights(rows: int, bias_sample: Tensor | None, dtype: torch.dtype,
                         device: torch.device) -> tuple[Tensor, Tensor | None]:
    """(weights of the sampled rows of c in the shift's GEMV, in `dtype`; the sampled bias's
    mean, fp32 0-d, or None without a bias). A row a -inf (or NaN) bias rules out, a masked or
    padding token, is left out of both: the mean of the other sampled logits is still at most
    each row's largest, and one -inf in the mean would make every shift -inf and every row of
    the chunk run its logits pass twice (row_shift_kernel's redo). Where every sampled bias is
    -inf the shift is -inf and the rows are redone: any finite stand-in could lie above every
    logit and underflow the row's sum."""
    if bias_sample is None:
        return torch.full((rows,), 1.0 / rows, dtype=dtype, device=device), None
    finite = torch.isfinite(bias_sample)
    count = finite.sum(dtype=torch.float32)
    any_finite, kept = count > 0, count.clamp_min(1.0)
    weights = torch.where(any_finite, finite.to(torch.float32) / kept, 1.0 / rows).to(dtype)
    mean_bias = torch.where(any_finite, torch.where(finite, bias_sample.float(), 0.0).sum() / kept, float("-inf"))
    return weights, mean_bias


class FusedLaunches(NamedTuple):
    """How a chunk's four kernels are launched (KernelLaunchers, or AheadCompilers): its pass
    over the vocabulary, the redo of its rows shifted too far, and the two per-row kernels."""

    chunk: Any
    redo: Any
    row_shift: Any
    row_finish: Any


def fused_kernels(plan: LaunchPlan) -> tuple[Any, Any, Any, Any]:
    """The kernels behind FusedLaunches' fields: the plan's kind of chunk pass (Gluon, tensor
    descriptors or pointers); the redo is always the pointer kernel, in the same tiles."""
    chunk = {"gluon": fused_forward_ws_kernel, "tma": fused_forward_tma_kernel}.get(plan.fused, fused_forward_kernel)
    return chunk, fused_forward_kernel, row_shift_kernel, row_finish_kernel


class FusedKernels:
    """The fused kernel's buffers and launches for one call: the workspace (its rows padded to
    16 bytes, as the copy engine and cuBLAS take them), the statistics, the shift, and what the
    per-row kernels leave for the gradient GEMMs."""

    def __init__(self, plan: LaunchPlan, config: KernelConfig, e: Tensor, c: Tensor, bias: Tensor | None,
                 weight: Tensor | None, targets: Tensor, softcap: float, label_smoothing: float, ignore_index: int,
                 z_loss: float, need_grad_e: bool, need_grad_c: bool) -> None:
        self.plan, self.config = plan, config
        self.e, self.c, self.bias, self.weight, self.targets = e, c, bias, weight, targets
        self.softcap, self.label_smoothing, self.smoothing = softcap, label_smoothing, label_smoothing > 0.0
        self.ignore_index, self.z_loss, self.need_grad_c = ignore_index, z_loss, need_grad_c
        v, d = c.shape
        rows = plan.workspace_rows
        padded_v = -(-v // 8) * 8
        self.tile = plan.gluon_tile if plan.fused == "gluon" else config.grad_logits
        self.vocab_tiles = cdiv(v, self.tile.block_n)
        self.stats_count = 3 if self.smoothing else 2
        f32 = torch.float32
        # One block (ops/graphs.carve) for every buffer the launches read or write: the workspace,
        # the statistics, per-row results, dE's fp32 product (made here as everything the chunk
        # loop writes, on either stream), the weights' total, c's mean row (the shift's GEMV) and the
        # sampled bias's mean.
        (workspace, self.stats_buffer, self.target_logit, self.redo_rows, self.lse, self.weighted_sum, self.row_scale,
         self.coef_smooth, self.scaled_e, self.grad_e_sum, self.total_weight, mean_c, mean_bias) = graphs.carve(
            e.device, ((rows, padded_v), e.dtype), ((self.stats_count * self.vocab_tiles * rows,), f32), ((rows,), f32),
            ((rows,), torch.int32), ((rows,), f32), ((rows if self.smoothing else 0,), f32), ((rows,), f32),
            ((rows if self.smoothing else 0,), f32), ((rows, d) if need_grad_c else (0, d), e.dtype),
            ((rows, d) if need_grad_e else (0, d), f32), ((), f32), ((d,), c.dtype),
            ((() if bias is not None else (0,)), f32), large_pool=plan.cuda_graphs)
        self.workspace = workspace[:, :v]
        if weight is not None:
            torch.sum(weight, dim=0, dtype=f32, out=self.total_weight)
        else:
            self.total_weight.fill_(float(v))
        # Any shift at most the rows' largest logits serves: their mean over a sample of the vocabulary
        # (plan.shift_stride), in c's own dtype, with no fp32 copy of c.
        sample = c[::plan.shift_stride]
        sample_weights, sampled_bias_mean = shift_sample_weights(
            sample.shape[0], None if bias is None else bias[::plan.shift_stride], c.dtype, c.device)
        torch.mv(sample.T, sample_weights, out=mean_c)
        self.mean_c = mean_c[:, None]
        self.mean_bias = None if sampled_bias_mean is None else mean_bias.copy_(sampled_bias_mean)
        self.flags = kernel_flags(e)
        if plan.fused == "gluon":
            self.descriptors = (*operand_descriptors(e, c, self.tile),
                                gluon_descriptor(self.workspace, [self.tile.block_m, self.tile.block_n // 2]))
        elif plan.fused == "tma":
            self.descriptors = (
                TensorDescriptor.from_tensor(e, [self.tile.block_m, self.tile.block_k]),
                TensorDescriptor.from_tensor(c, [self.tile.block_n, self.tile.block_k]),
                TensorDescriptor.from_tensor(self.workspace, [self.tile.block_m, self.tile.block_n]),
            )
        self.launchers = FusedLaunches(*(KernelLauncher(kernel, plan.direct_launch) for kernel in fused_kernels(plan)))

    def buffers(self) -> tuple[Tensor | None, ...]:
        """Every tensor the launches read or write besides the call's own."""
        return (self.workspace, self.stats_buffer, self.target_logit, self.redo_rows, self.lse, self.weighted_sum,
                self.row_scale, self.coef_smooth, self.scaled_e, self.grad_e_sum, self.total_weight, self.mean_c,
                self.mean_bias)

    def run(self, row_start: int, rows: int, scale: Tensor, losses: Tensor) -> None:
        """The chunk's workspace, row scales (and coef_smooth) and scaled rows of e, and its
        tokens' losses into `losses`; `scale` is d loss / d (a token's loss), times the logit
        scale (the gradients' chain rule; the losses do not read it)."""
        e_rows = self.e[row_start:row_start + rows]
        shift = fp32_product(e_rows, self.mean_c)[:, 0]
        if self.mean_bias is not None:
            shift += self.mean_bias
        shift = scale_and_cap(shift, self.plan.logit_scale, self.softcap)
        self.launch_all(self.launchers, row_start, rows, shift, scale, losses)

    def compile_ahead(self, scale: Tensor, losses: Tensor) -> None:
        """Start compiling every kernel the chunk loop will launch, side by side on threads: one
        chunk's launches per distinct (row_start's integer class, rows), which is what their
        launch keys differ by, with the lse buffer standing in for the shift (fp32, aligned)."""
        n, rows = self.e.shape[0], self.plan.workspace_rows
        compilers = FusedLaunches(*(AheadCompiler(launcher.kernel) for launcher in self.launchers))
        chunks = {(integer_class(start), min(rows, n - start)): start for start in range(0, n, rows)}
        for (_, chunk_rows), row_start in chunks.items():
            self.launch_all(compilers, row_start, chunk_rows, self.lse[:chunk_rows], scale, losses)

    def launch_all(self, launches: FusedLaunches, row_start: int, rows: int, shift: Tensor, scale: Tensor,
                   losses: Tensor) -> None:
        """The chunk's four launches through `launches` (launchers, or compilers ahead of them)."""
        # (stat, vocab tile, row) of this chunk's rows, as the kernels index it
        stats = self.stats_buffer[: self.stats_count * self.vocab_tiles * rows]
        stat_stride = self.vocab_tiles * rows
        self.launch_chunk(launches, self.plan.fused, row_start, rows, shift, stats)
        # Rows shifted too far below their lse (or overflowed) again, shifted by their largest logit.
        launches.row_shift(
            (cdiv(rows, SHIFT_ROWS),), stats, shift, self.redo_rows, self.lse, self.weighted_sum, rows,
            self.vocab_tiles, stat_stride, SAFE_GAP, SMOOTHING=self.smoothing, BLOCK_R=SHIFT_ROWS, BLOCK_T=TILE_BLOCK,
            num_warps=4)
        self.launch_chunk(launches, "pointer", row_start, rows, shift, stats, self.redo_rows)
        e = self.e
        # After the redo each row's statistics match its shift: lse as row_shift_kernel took it, or again.
        launches.row_finish(
            (cdiv(rows, FINISH_ROWS),), stats, shift, self.redo_rows, self.lse, self.weighted_sum, self.targets, self.weight,
            self.target_logit, scale, self.total_weight, losses,
            self.row_scale, self.coef_smooth, self.workspace, e, self.scaled_e, row_start, rows, self.c.shape[0],
            e.shape[1], self.vocab_tiles, stat_stride, self.workspace.stride(0), e.stride(0), e.stride(1),
            self.scaled_e.stride(0), self.ignore_index, self.label_smoothing, self.z_loss, self.softcap,
            HAS_WEIGHT=self.weight is not None, SMOOTHING=self.smoothing, HAS_Z_LOSS=self.z_loss > 0.0,
            HAS_SOFTCAP=self.softcap > 0.0, SCALE_E=self.need_grad_c, BLOCK_R=FINISH_ROWS, BLOCK_T=TILE_BLOCK, BLOCK_D=128,
            num_warps=4,
        )

    def launch_chunk(self, launches: FusedLaunches, kind: str, row_start: int, rows: int, shift: Tensor,
                     stats: Tensor, redo: Tensor | None = None) -> None:
        e, c, v, d = self.e, self.c, self.c.shape[0], self.e.shape[1]
        stat_stride = self.vocab_tiles * rows
        if kind == "gluon":
            tile, per_sm = self.tile, self.plan.gluon_programs_per_sm
            launches.chunk(
                (programs_for(e.device, tiles_of(rows, v, tile), per_sm),), *self.descriptors, self.targets, shift,
                stats, self.target_logit, stat_stride, row_start, rows, v, d,
                GROUP_M=tile.group_m, STAGES=tile.num_stages, LOGIT_SCALE=self.plan.logit_scale,
                **launch_options(per_sm),
            )
            return
        common = dict(
            HAS_BIAS=self.bias is not None, HAS_SOFTCAP=self.softcap > 0.0, LOGIT_SCALE=self.plan.logit_scale,
            HAS_WEIGHT=self.weight is not None, NEED_WEIGHTED_SUM=self.smoothing, UPCAST=self.flags["UPCAST"],
            IEEE=self.flags["IEEE"],
        )
        if kind == "tma":
            tile = self.tile
            sms, shared_memory = device_limits(e.device)
            stages = stages_beside_output(tile, e.element_size(), shared_memory)  # beside the staged output tile
            launches.chunk(
                (min(sms, tiles_of(rows, v, tile)),), *self.descriptors, self.bias, self.targets, self.weight, shift,
                stats, self.target_logit, row_start, rows, v, d, stat_stride, sms, self.softcap,
                BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
                num_warps=tile.num_warps, num_stages=stages, **common,
            )
            return
        # The pointer kernel: the chunk's whole pass, or the rows to do again with their new shift,
        # in the first pass's tiles (the statistics are laid out by them).
        tile = self.tile
        programs = cdiv(rows, tile.block_m) * (REDO_SPLITS.value if redo is not None else self.vocab_tiles)
        (launches.redo if redo is not None else launches.chunk)(
            (programs,), e, c, self.bias, self.targets, self.weight, shift,
            self.workspace, stats, self.target_logit, redo if redo is not None else shift, row_start, rows, v, d,
            stat_stride, e.stride(0), e.stride(1), c.stride(0), c.stride(1), self.workspace.stride(0), self.softcap,
            REDO=redo is not None, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
            GROUP_M=tile.group_m, EVEN_K=d % tile.block_k == 0, num_warps=tile.num_warps,
            num_stages=tile.num_stages, **common,
        )
