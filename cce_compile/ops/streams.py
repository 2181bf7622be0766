"""Side streams whose cuBLAS workspaces exist before they are needed: the CUDA-graph capture
stream (ops/graphs.py) and the stream the fused forward runs dE on beside dC
(ops/forward_fused.py).

torch gives each (cuBLAS handle, stream) pair its own workspace (32 MiB on Hopper), made at the
pair's first GEMM, and each thread its own handle: the autograd engine's device thread, which
runs backwards, and the caller's thread, which runs forwards, each need one per stream. Made
inside a graph capture or a measured call, it lands there (on the H200 a capture that made one
added 32 MiB to its call's peak), so each thread makes its own at its first use of the stream."""

from __future__ import annotations

import threading
from functools import lru_cache

import torch

_warmed = threading.local()


def _ready(stream: torch.cuda.Stream) -> torch.cuda.Stream:
    """`stream`, with this thread's cuBLAS and cuBLASLt workspaces for it made."""
    done: set[int] = _warmed.__dict__.setdefault("streams", set())
    if stream.cuda_stream not in done:
        with torch.cuda.stream(stream):
            one = torch.ones((1, 1), dtype=torch.bfloat16, device=stream.device)
            torch.mm(one, one)
            torch.mm(one, one, out_dtype=torch.float32)  # the cuBLASLt path of the fp32-summed GEMMs
        done.add(stream.cuda_stream)
    return stream


@lru_cache(maxsize=None)
def _stream(device: torch.device, role: str) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """One stream per device to capture graphs on (a capture cannot run on the default
    stream); graphs replay on the caller's stream."""
    return _ready(_stream(device, "capture"))


def grad_e_stream(device: torch.device) -> torch.cuda.Stream:
    """One stream per device for the fused forward's dE GEMMs, beside dC's on the caller's."""
    return _ready(_stream(device, "grad_e"))
