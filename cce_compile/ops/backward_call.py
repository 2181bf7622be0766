"""One backward call's inputs and outputs, as the backward runners share them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from torch import Tensor

from ..config.kernel_config import KernelConfig
from ..plan.backward import BackwardPlan
from ..plan.launch import LaunchPlan
from . import graphs
from .problem import cdiv


@dataclass(frozen=True)
class BackwardCall:
    """The tensors and settings of one backward call on the Triton path.

    coef_softmax, coef_target, coef_smooth and coef_entropy (None but for linear_log_probs'
    entropy) are the d-logits' per-token coefficients (ops/loss_terms.py); `scale` divides
    fp16's d-logits back (they are stored scaled up, fp16's range being narrow), otherwise it is an unread stand-in (`scaled` False)."""

    e: Tensor
    c: Tensor
    targets: Tensor
    bias: Tensor | None
    weight: Tensor | None
    lse: Tensor
    vocab_order: Tensor  # filtered mode's walk through the vocabulary (empty in exact mode)
    coef_softmax: Tensor
    coef_target: Tensor
    coef_smooth: Tensor
    scale: Tensor
    scaled: bool
    softcap: float
    label_smoothing: float
    need_grad_e: bool
    need_grad_c: bool
    config: KernelConfig
    plan: LaunchPlan
    flags: dict[str, bool]  # UPCAST and IEEE (ops/problem.kernel_flags)
    coef_entropy: Tensor | None = None

    @property
    def entropy_coefficients(self) -> Tensor:
        """coef_entropy, or an unread stand-in for the kernels' pointer."""
        return self.coef_softmax if self.coef_entropy is None else self.coef_entropy

    @property
    def n(self) -> int:
        return self.e.shape[0]

    @property
    def v(self) -> int:
        return self.c.shape[0]

    @property
    def d(self) -> int:
        return self.e.shape[1]

    @property
    def steps(self) -> BackwardPlan:
        assert self.plan.backward is not None, "the plain-PyTorch path has no backward plan"
        return self.plan.backward

    @property
    def chunk_rows(self) -> int:
        return self.steps.chunk_rows(self.n, self.config.grad_logits.block_m)

    @property
    def chunk_tile_rows(self) -> int:
        return cdiv(self.chunk_rows, self.config.grad_logits.block_m)

    def loss_flags(self) -> dict[str, bool | float]:
        """The kernels' constexpr switches for the loss's options."""
        return {"HAS_BIAS": self.bias is not None, "HAS_SOFTCAP": self.softcap > 0.0,
                "LOGIT_SCALE": self.plan.logit_scale,
                "HAS_WEIGHT": self.weight is not None, "HAS_SMOOTHING": self.label_smoothing > 0.0,
                "HAS_ENTROPY": self.coef_entropy is not None}

    def token_chunks(self) -> Iterator[tuple[int, int, int, int]]:
        """(chunk, first row, rows, the dE accumulator's element offset) of each non-empty token
        chunk; the last may be short."""
        for chunk in range(self.steps.n_chunks):
            row_start = chunk * self.chunk_rows
            rows = min(self.chunk_rows, self.n - row_start)
            if rows > 0:
                yield chunk, row_start, rows, 0 if self.steps.fp32_accumulator else row_start * self.d


@dataclass(frozen=True)
class Gradients:
    """The backward's outputs, and dE's accumulator: fp32 chunk rows for 16-bit inputs, summed
    over slabs, or dE itself (fp32 inputs, or no dE asked). A gradient not asked for is empty."""

    grad_e: Tensor
    grad_c: Tensor
    acc: Tensor

    @staticmethod
    def allocate(call: BackwardCall) -> "Gradients":
        e, c = call.e, call.c
        grad_e = torch.empty(e.shape if call.need_grad_e else (0,), dtype=e.dtype, device=e.device)
        grad_c = torch.empty(c.shape if call.need_grad_c else (0,), dtype=c.dtype, device=c.device)
        acc = (graphs.carve(e.device, ((call.chunk_rows, call.d), torch.float32), large_pool=call.plan.cuda_graphs)[0]
               if call.steps.fp32_accumulator and call.need_grad_e else grad_e)
        return Gradients(grad_e, grad_c, acc)

    def acc_rows(self, call: BackwardCall, row_start: int, rows: int) -> Tensor:
        """The accumulator's rows of a token chunk."""
        return self.acc[:rows] if call.steps.fp32_accumulator else self.grad_e[row_start:row_start + rows]
