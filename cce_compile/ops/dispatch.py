"""Where an op call runs, and the config it launches with."""

from __future__ import annotations

import os

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from ..config.kernel_config import KernelConfig
from ..config.plan import n_bucket
from ..config.resolve import ProblemKey, resolve_config

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
"""Triton reads this when kernels are decorated; the op follows the same switch."""

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def use_triton(e: Tensor) -> bool:
    """Triton on CUDA; on CPU only under the interpreter and with real tensors (tracing a
    Triton launch on a machine with no GPU driver fails, so fake CPU tensors take the
    plain-PyTorch path)."""
    if e.is_cuda:
        return True
    return INTERPRET and e.device.type == "cpu" and not is_fake(e)


def problem_key(e: Tensor, c: Tensor, filter_eps: float) -> ProblemKey:
    device = "cuda" if e.is_cuda else ("interpreter" if INTERPRET else "cpu")
    return ProblemKey(
        device=device,
        v=int(c.shape[0]),
        d=int(c.shape[1]),
        dtype=str(e.dtype).removeprefix("torch."),
        n_bucket=n_bucket(e.shape[0]),
        mode="filtered" if filter_eps > 0.0 else "exact",
    )


def config_for(e: Tensor, c: Tensor, filter_eps: float) -> KernelConfig:
    return resolve_config(problem_key(e, c, filter_eps))


def kernel_flags(e: Tensor) -> dict[str, bool]:
    """UPCAST: the interpreter multiplies bf16 bit patterns in tl.dot (triton#11584), so
    operands go to fp32 there. IEEE: fp32 inputs get fp32 dots, not TF32."""
    upcast = INTERPRET and not e.is_cuda and e.dtype == torch.bfloat16
    return {"UPCAST": upcast, "IEEE": upcast or e.dtype == torch.float32}


def cdiv(a, b):
    """Ceil division that works on ints and SymInts alike."""
    return (a + b - 1) // b
