"""The op's fp32 accumulation is its own: an autocast region around a call must not recast
its inner matmuls."""

from __future__ import annotations

import contextlib

import torch


def without_autocast(device_type: str) -> contextlib.AbstractContextManager[None]:
    """Autocast turned off where it is on, and nothing entered where it is off: an autocast
    context inside a traced graph keeps AOTAutograd from caching the graph, and Inductor's
    own cache then hands back a backward that overwrites its saved tensors even under
    retain_graph=True, silently wrong gradients from a second backward (PyTorch's fault, met
    here on every call while the context was unconditional)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()
