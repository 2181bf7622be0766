"""The forward that finishes the gradients too, for a scalar loss (mean or sum): three GEMMs
of work for forward and backward, where the recompute takes four.

Per token chunk (plan.workspace_rows rows):
1. shift = each row's mean logit, e @ mean(c) (+ mean bias): one GEMV, before the chunk.
2. The fused kernel (kernels/fused_forward.py) tiles the chunk's logits once: the workspace
   gets q = exp(z - shift) (times soft-capping's derivative), the statistics each row's sum
   of exp(z - shift) and largest logit, so lse = shift + log(sum). A row whose lse runs more
   than SAFE_GAP above its shift is done again with its largest logit as the shift (a rare,
   very peaked row; nothing overflows then).
3. With the chunk's coefficients (ops/loss_terms.py; the loss's 1/denominator and z-loss
   folded in), d_logits = s * q - coef_smooth * w with s = coef_softmax * exp(shift - lse)
   per row, and the target's -coef_target folded into its own workspace entry. So
   dE[chunk] = s * (q @ c) - coef_smooth * (w @ c) and dC += q.T @ (s * e[chunk]) are cuBLAS
   GEMMs on the workspace as the kernel left it, and label smoothing's rank-one share of dC
   is added once at the end.

Everything the chunk loop writes is allocated before it, so where the plan says so a call that
recurs on the same tensors replays the loop as one CUDA graph (ops/graphs.py): at small D the
loop's ~90 launches a chunk cost more host time than the GPU spends on them.
"""

from __future__ import annotations

import torch
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from ..config.kernel_config import KernelConfig
from ..kernels.fused_forward import MAX, SUM, WEIGHTED, fused_forward_kernel, fused_forward_tma_kernel
from ..kernels.warp_specialized import fused_forward_ws_kernel
from ..plan.launch import LaunchPlan
from . import graphs
from .cpu_path import backward_cpu, forward_cpu
from .gluon import gluon_descriptor, launch_options, operand_descriptors, programs_for, tiles_of
from .launch import KernelLauncher
from .loss_terms import grad_coefficients, target_weight, token_loss
from .problem import cdiv, device_limits, kernel_flags, stages_beside_output

SAFE_GAP = 60.0
"""How far a row's lse may lie above its shift: q <= exp(gap) stays inside fp32 and bf16 and
s = coef * exp(-gap) stays normal in them."""


def fp32_product(a: Tensor, b: Tensor) -> Tensor:
    """a @ b summed and returned in fp32: cuBLASLt's 16-bit operands with an fp32 result on
    CUDA (no fp32 copies of the operands), fp32 operands elsewhere."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def reduction_scale(targets: Tensor, weight: Tensor | None, v: int, ignore_index: int, reduction: str) -> Tensor:
    """d loss / d (a token's loss): 1 for "sum", 1 / (the valid tokens, or their weights) for
    "mean"; 0-d fp32 on the device, no host sync."""
    if reduction == "sum":
        return torch.ones((), dtype=torch.float32, device=targets.device)
    denominator = target_weight(targets, weight, targets != ignore_index, v).sum()
    return 1.0 / torch.where(denominator > 0, denominator, 1.0)


def run_fused(
    plan: LaunchPlan, config: KernelConfig, e: Tensor, c: Tensor, targets: Tensor, bias: Tensor | None,
    weight: Tensor | None, ignore_index: int, label_smoothing: float, softcap: float, z_loss: float, reduction: str,
    need_grad_e: bool, need_grad_c: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> (loss 0-d fp32, grad_e, grad_c, grad_bias): the gradients of the reduced loss, each
    empty where not needed (grad_bias without a bias)."""
    fused = FusedForward(plan, config, e, c, targets, bias, weight, ignore_index, label_smoothing, softcap, z_loss,
                         reduction, need_grad_e, need_grad_c)
    if plan.cuda_graphs:
        graphs.CHUNK_LOOPS.run(fused.graph_key(), fused.chunk_loop, e.device)
    else:
        fused.chunk_loop()
    return fused.finish()


class FusedForward:
    """The call's gradients and loss, filled chunk by chunk (`chunk`), then `finish`ed."""

    def __init__(self, plan: LaunchPlan, config: KernelConfig, e: Tensor, c: Tensor, targets: Tensor,
                 bias: Tensor | None, weight: Tensor | None, ignore_index: int, label_smoothing: float,
                 softcap: float, z_loss: float, reduction: str, need_grad_e: bool, need_grad_c: bool) -> None:
        self.plan, self.config = plan, config
        self.e, self.c, self.targets, self.bias, self.weight = e, c, targets, bias, weight
        self.ignore_index, self.label_smoothing, self.softcap, self.z_loss = ignore_index, label_smoothing, softcap, z_loss
        self.need_grad_e, self.need_grad_c = need_grad_e, need_grad_c
        n, d = e.shape
        v = c.shape[0]
        self.scale = reduction_scale(targets, weight, v, ignore_index, reduction)
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=e.device)
        self.grad_e = torch.empty(e.shape if need_grad_e else (0,), dtype=e.dtype, device=e.device)
        self.grad_c = torch.empty(c.shape if need_grad_c else (0,), dtype=c.dtype, device=c.device)
        self.grad_bias = torch.zeros(v, dtype=torch.float32, device=e.device) if bias is not None else None
        self.smoothing = label_smoothing > 0.0
        # label smoothing's -coef_smooth * w share: w @ c for dE, sum of coef_smooth * e for dC
        self.smoothing_weights = (weight.to(torch.float32) if weight is not None
                                  else torch.ones(v, dtype=torch.float32, device=e.device)) if self.smoothing else None
        self.smoothing_of_c = (self.smoothing_weights.to(c.dtype) @ c).float() if self.smoothing and need_grad_e else None
        self.smoothing_of_e = torch.zeros(d, dtype=torch.float32, device=e.device) if self.smoothing else None
        if plan.fused != "cpu":
            self.kernels = FusedKernels(plan, config, e, c, bias, weight, targets, softcap, label_smoothing)

    def chunk_loop(self) -> None:
        """Every token chunk, into the gradients, the loss sum and the buffers made above."""
        n, rows = self.e.shape[0], self.plan.workspace_rows
        for row_start in range(0, n, rows):
            self.chunk(row_start, min(rows, n - row_start))

    def graph_key(self) -> tuple:
        """Everything the chunk loop's launches read or write: where each tensor is, and the
        settings (the kernels' buffers on CUDA)."""
        kernels = self.kernels
        tensors = (self.e, self.c, self.targets, self.bias, self.weight, self.scale, self.loss_sum, self.grad_e,
                   self.grad_c, self.grad_bias, self.smoothing_weights, self.smoothing_of_c, self.smoothing_of_e,
                   kernels.workspace, kernels.stats_buffer, kernels.target_logit, kernels.mean_c, kernels.mean_bias)
        return (*map(graphs.tensor_key, tensors), self.plan, self.config, self.ignore_index,
                self.label_smoothing, self.softcap, self.z_loss, self.need_grad_e, self.need_grad_c)

    def chunk(self, row_start: int, rows: int) -> None:
        row_end = row_start + rows
        targets = self.targets[row_start:row_end]
        if self.plan.fused == "cpu":
            lse, target_logit, weighted_sum, _ = forward_cpu(
                self.e[row_start:row_end], self.c, targets, self.bias, self.weight, self.softcap, self.smoothing,
                chunk_v=self.config.slab_v)
        else:
            lse, target_logit, weighted_sum, shift = self.kernels.run(row_start, rows)
        v = self.c.shape[0]
        valid = targets != self.ignore_index
        losses = token_loss(lse, target_logit, weighted_sum, targets, self.weight, v, self.ignore_index,
                            self.label_smoothing)
        if self.z_loss > 0.0:
            losses = losses + self.z_loss * torch.where(valid, lse * lse, 0.0)
        self.loss_sum += losses.sum()
        grad_loss = torch.where(valid, self.scale, 0.0).expand(rows)
        grad_lse = torch.where(valid, 2.0 * self.z_loss * self.scale * lse, 0.0)
        coefficients = grad_coefficients(grad_loss, grad_lse, targets, self.weight, v, self.ignore_index,
                                         self.label_smoothing)
        if self.plan.fused == "cpu":
            self.cpu_gradients(row_start, rows, lse, coefficients)
        else:
            self.gradients(row_start, rows, lse, shift, target_logit, coefficients)

    def gradients(self, row_start: int, rows: int, lse: Tensor, shift: Tensor, target_logit: Tensor,
                  coefficients: tuple[Tensor, Tensor, Tensor]) -> None:
        """The chunk's share of dE, dC and dbias from the workspace the kernels left."""
        coef_softmax, coef_target, coef_smooth = coefficients
        e_rows = self.e[row_start:row_start + rows]
        workspace = self.kernels.workspace[:rows]
        s = coef_softmax * torch.exp(shift - lse)  # the softmax's row scale on the workspace
        self.kernels.fold_targets(self.targets[row_start:row_start + rows], target_logit, shift, coef_target, s)
        if self.need_grad_e:
            grad_e = fp32_product(workspace, self.c).mul_(s[:, None])
            if self.smoothing:
                grad_e.sub_(coef_smooth[:, None] * self.smoothing_of_c[None, :])
            self.grad_e[row_start:row_start + rows].copy_(grad_e)
        if self.need_grad_c:
            scaled_e = (e_rows.float() * s[:, None]).to(e_rows.dtype)
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

    def cpu_gradients(self, row_start: int, rows: int, lse: Tensor, coefficients: tuple[Tensor, Tensor, Tensor]) -> None:
        """The plain-PyTorch path's share of the chunk: its backward, on the chunk's rows."""
        coef_softmax, coef_target, coef_smooth = coefficients
        row_end = row_start + rows
        tile = self.config.grad_logits
        grad_e, grad_c, grad_bias = backward_cpu(
            self.e[row_start:row_end], self.c, self.targets[row_start:row_end], self.bias, self.weight, lse,
            coef_softmax, coef_target, coef_smooth if self.smoothing else None, self.softcap, 0.0,
            chunk_v=max(self.config.slab_v, self.config.forward.block_n), filter_tile=(tile.block_m, tile.block_n),
            vocab_order=None, need_grad_e=self.need_grad_e, need_grad_c=self.need_grad_c,
        )
        if self.need_grad_e:
            self.grad_e[row_start:row_end].copy_(grad_e)
        if self.need_grad_c:
            if row_start == 0:
                self.grad_c.copy_(grad_c)
            else:
                self.grad_c.add_(grad_c)
        if self.grad_bias is not None:
            self.grad_bias += grad_bias.float()

    def finish(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        if self.e.shape[0] == 0:  # no token: nothing flows back
            if self.need_grad_c:
                self.grad_c.zero_()
        elif self.smoothing and self.need_grad_c and self.plan.fused != "cpu":
            self.grad_c.addr_(self.smoothing_weights.to(self.grad_c.dtype), self.smoothing_of_e.to(self.grad_c.dtype),
                              alpha=-1)
        grad_bias = self.grad_bias.to(self.bias.dtype) if self.bias is not None else self.c.new_empty((0,))
        return self.loss_sum * self.scale, self.grad_e, self.grad_c, grad_bias


class FusedKernels:
    """The fused kernel's buffers and launches for one call: the workspace (its rows padded to
    16 bytes, as the copy engine and cuBLAS take them), the statistics, the shift."""

    def __init__(self, plan: LaunchPlan, config: KernelConfig, e: Tensor, c: Tensor, bias: Tensor | None,
                 weight: Tensor | None, targets: Tensor, softcap: float, label_smoothing: float) -> None:
        self.plan, self.config = plan, config
        self.e, self.c, self.bias, self.weight, self.targets = e, c, bias, weight, targets
        self.softcap, self.smoothing = softcap, label_smoothing > 0.0
        v = c.shape[0]
        rows = plan.workspace_rows
        padded_v = -(-v // 8) * 8
        self.workspace = torch.empty((rows, padded_v), dtype=e.dtype, device=e.device)[:, :v]
        self.tile = plan.gluon_tile if plan.fused == "gluon" else config.grad_logits
        self.vocab_tiles = cdiv(v, self.tile.block_n)
        self.stats_count = 3 if self.smoothing else 2
        self.stats_buffer = torch.empty(self.stats_count * self.vocab_tiles * rows, dtype=torch.float32,
                                        device=e.device)
        self.target_logit = torch.empty(rows, dtype=torch.float32, device=e.device)
        # Any shift near the rows' logits serves: the mean of c in its own dtype, with no fp32 copy of c.
        self.mean_c = torch.mv(c.T, torch.full((v,), 1.0 / v, dtype=c.dtype, device=c.device)).float()
        self.mean_bias = bias.float().mean() if bias is not None else None
        self.flags = kernel_flags(e)
        self.redo = KernelLauncher(fused_forward_kernel, plan.direct_launch)
        if plan.fused == "gluon":
            self.launch = KernelLauncher(fused_forward_ws_kernel, plan.direct_launch)
            self.descriptors = (*operand_descriptors(e, c, self.tile),
                                gluon_descriptor(self.workspace, [self.tile.block_m, self.tile.block_n // 2]))
        elif plan.fused == "tma":
            self.launch = KernelLauncher(fused_forward_tma_kernel, plan.direct_launch)
            self.descriptors = (
                TensorDescriptor.from_tensor(e, [self.tile.block_m, self.tile.block_k]),
                TensorDescriptor.from_tensor(c, [self.tile.block_n, self.tile.block_k]),
                TensorDescriptor.from_tensor(self.workspace, [self.tile.block_m, self.tile.block_n]),
            )
        else:
            self.launch = self.redo

    def run(self, row_start: int, rows: int) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
        """The chunk's workspace, and its (lse, target logit, weighted logit sum or None, shift)."""
        e_rows = self.e[row_start:row_start + rows]
        shift = e_rows.float() @ self.mean_c
        if self.mean_bias is not None:
            shift += self.mean_bias
        if self.softcap > 0.0:
            shift = self.softcap * torch.tanh(shift / self.softcap)
        self.target_logit[:rows].zero_()
        # (stat, vocab tile, row) of this chunk's rows, as the kernels index it
        stats = self.stats_buffer[: self.stats_count * self.vocab_tiles * rows].view(-1, self.vocab_tiles, rows)
        self.launch_chunk(self.plan.fused, row_start, rows, shift, stats)
        lse = shift + torch.log(stats[SUM.value].sum(dim=0))
        # Rows shifted too far below their lse (or overflowed) again, shifted by their largest logit.
        redo_rows = ~(lse - shift <= SAFE_GAP)
        shift = torch.where(redo_rows, stats[MAX.value].amax(dim=0), shift)
        redo_blocks = torch.nn.functional.pad(redo_rows, (0, (-rows) % self.tile.block_m))
        redo_blocks = redo_blocks.view(-1, self.tile.block_m).any(dim=1).to(torch.int32)
        self.launch_chunk("pointer", row_start, rows, shift, stats, redo_blocks)
        lse = shift + torch.log(stats[SUM.value].sum(dim=0))
        weighted_sum = stats[WEIGHTED.value].sum(dim=0) if self.smoothing else None
        return lse, self.target_logit[:rows].clone(), weighted_sum, shift

    def launch_chunk(self, kind: str, row_start: int, rows: int, shift: Tensor, stats: Tensor,
                     redo: Tensor | None = None) -> None:
        e, c, v, d = self.e, self.c, self.c.shape[0], self.e.shape[1]
        stat_stride = self.vocab_tiles * rows
        if kind == "gluon":
            tile, per_sm = self.tile, self.plan.gluon_programs_per_sm
            self.launch(
                (programs_for(e.device, tiles_of(rows, v, tile), per_sm),), *self.descriptors, self.targets, shift,
                stats, self.target_logit, stat_stride, row_start, rows, v, d,
                GROUP_M=tile.group_m, STAGES=tile.num_stages, **launch_options(per_sm),
            )
            return
        common = dict(
            HAS_BIAS=self.bias is not None, HAS_SOFTCAP=self.softcap > 0.0, HAS_WEIGHT=self.weight is not None,
            NEED_WEIGHTED_SUM=self.smoothing, UPCAST=self.flags["UPCAST"], IEEE=self.flags["IEEE"],
        )
        if kind == "tma":
            tile = self.tile
            sms, shared_memory = device_limits(e.device)
            stages = stages_beside_output(tile, e.element_size(), shared_memory)  # beside the staged output tile
            self.launch(
                (min(sms, tiles_of(rows, v, tile)),), *self.descriptors, self.bias, self.targets, self.weight, shift,
                stats, self.target_logit, row_start, rows, v, d, stat_stride, sms, self.softcap,
                BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
                num_warps=tile.num_warps, num_stages=stages, **common,
            )
            return
        # The pointer kernel: the chunk's whole pass, or the rows to do again with their new shift,
        # in the first pass's tiles (the statistics are laid out by them).
        tile = self.tile
        self.redo(
            (cdiv(rows, tile.block_m) * self.vocab_tiles,), e, c, self.bias, self.targets, self.weight, shift,
            self.workspace, stats, self.target_logit, redo if redo is not None else shift, row_start, rows, v, d,
            stat_stride, e.stride(0), e.stride(1), c.stride(0), c.stride(1), self.workspace.stride(0), self.softcap,
            REDO=redo is not None, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
            GROUP_M=tile.group_m, EVEN_K=d % tile.block_k == 0, num_warps=tile.num_warps,
            num_stages=tile.num_stages, **common,
        )

    def fold_targets(self, targets: Tensor, target_logit: Tensor, shift: Tensor, coef_target: Tensor, s: Tensor) -> None:
        """Each row's -coef_target at its target, folded into the workspace: the entry becomes
        (s q - coef_target) g / s, q and g (soft-capping's derivative) from the exact fp32
        target logit. Rows whose s is 0 (ignored tokens, zero class weights) keep their entry."""
        v = self.c.shape[0]
        fold = coef_target != 0
        columns = torch.where(fold, targets, 0).clamp(0, v - 1)
        q = torch.exp(target_logit - shift)
        g = 1.0 - (target_logit / self.softcap) ** 2 if self.softcap > 0.0 else 1.0
        tiny = torch.finfo(torch.float32).tiny
        safe_s = torch.where(s.abs() < tiny, tiny, s)
        row_ids = torch.arange(targets.shape[0], device=targets.device)
        kept = self.workspace[row_ids, columns]
        self.workspace[row_ids, columns] = torch.where(fold, (q - coef_target / safe_s) * g, kept.float()).to(
            self.workspace.dtype)
