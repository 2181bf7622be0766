"""Where an op call runs, and the config it launches with."""

from __future__ import annotations

import os
from functools import lru_cache

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from ..config.kernel_config import KernelConfig, TileConfig
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


def relaunches_directly(e: Tensor) -> bool:
    """Whether the op's KernelLaunchers reuse compiled kernels (ops/launch.py): eager CUDA calls.
    Traced calls must go through wrap_triton, and the interpreter compiles nothing."""
    return e.is_cuda and not is_fake(e) and not INTERPRET


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


def descriptor_rows_fit(element_bytes: int, row_stride: int) -> bool:
    """Whether rows of 16-bit elements this far apart suit the copy engine (16-byte aligned)."""
    return element_bytes == 2 and row_stride * element_bytes % 16 == 0


def tensor_descriptors_fit(*tensors: Tensor) -> bool:
    """Whether the persistent tensor-descriptor kernels can take these 2-D tensors: a real
    (not traced) call, no empty dimension (descriptors cannot describe one), a contiguous
    last dimension, 16-bit elements, 16-byte aligned bases and row strides. Otherwise the
    pointer kernels run."""
    return all(
        not is_fake(t) and t.numel() > 0 and t.stride(-1) == 1
        and descriptor_rows_fit(t.element_size(), t.stride(0)) and t.data_ptr() % 16 == 0
        for t in tensors
    )


@lru_cache(maxsize=None)
def device_limits(device: torch.device) -> tuple[int, int]:
    """(programs a persistent kernel launches, shared memory one program may opt into): one
    program per SM on a GPU; under the interpreter a few, so the loop over tiles runs more
    than once, and no memory limit. Cached per device: the Gluon recompute asks per slab."""
    if device.type != "cuda":
        return 3, 1 << 30
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count, props.shared_memory_per_block_optin


@lru_cache(maxsize=None)
def runs_wgmma(device: torch.device) -> bool:
    """Whether the GPU is a Hopper (sm_90), whose wgmma the Gluon kernels are written in; asked
    once per device, not per call."""
    return torch.cuda.get_device_capability(device)[0] == 9


def stages_beside_output(tile: TileConfig, element_bytes: int, shared_memory: int) -> int:
    """The tile's pipeline stages, as many as fit in `shared_memory` beside the output tile
    that a tensor-descriptor store stages there (1 KiB left for barriers)."""
    per_stage = (tile.block_m + tile.block_n) * tile.block_k * element_bytes
    room = shared_memory - tile.block_m * tile.block_n * element_bytes - 1024
    return max(1, min(tile.num_stages, room // per_stage))


def cdiv(a, b):
    """Ceil division that works on ints and SymInts alike."""
    return (a + b - 1) // b
