"""Side streams, and their cuBLAS workspaces made before a graph capture needs them: the
CUDA-graph capture stream (ops/graphs.py) and the stream the fused forward runs dE on beside
dC (ops/forward_fused.py).

torch gives each (cuBLAS handle, stream) pair its own workspace (32 MiB on Hopper), made at the
pair's first GEMM, and each thread its own handle (the autograd engine's device thread runs
backwards, the caller's thread forwards); and one made earlier may be gone again (CUDA graph
trees, torch.compile's reduce-overhead, free them all at each warm-up and recording). A workspace made
inside our capture lands in the capturing call (on the H200, 32 MiB over the call's memory
bound), so `warm_streams` runs a GEMM on each stream a loop uses, on the capturing thread, just
before every capture, and at a loop's first call."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from functools import lru_cache

import torch

_local = threading.local()


def warm(stream: torch.cuda.Stream) -> None:
    """This thread's cuBLAS and cuBLASLt workspaces for `stream`, made now if missing (two 1 x 1 GEMMs)."""
    with torch.cuda.stream(stream):
        one = torch.ones((1, 1), dtype=torch.bfloat16, device=stream.device)
        torch.mm(one, one)
        torch.mm(one, one, out_dtype=torch.float32)  # the cuBLASLt path of the fp32-summed GEMMs


@lru_cache(maxsize=None)
def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """One stream per device to capture graphs on, one capture at a time (graphs.CAPTURING; a
    capture cannot run on the default stream); graphs replay on the caller's stream."""
    return torch.cuda.Stream(device)


def warm_streams(device: torch.device, side_streams: tuple[torch.cuda.Stream, ...], *,
                 again: bool) -> torch.cuda.Stream:
    """The capture stream, after a GEMM on it and on each side stream (outside any capture):
    each time with `again` (before a capture), else only where this thread has not warmed it
    (a loop's first call, which every call of a loop that never recurs is)."""
    warmed: set[int] = _local.__dict__.setdefault("warmed", set())
    stream = capture_stream(device)
    for each in (stream, *side_streams):
        if again or each.cuda_stream not in warmed:
            warm(each)
            warmed.add(each.cuda_stream)
    return stream


def grad_e_stream(device: torch.device) -> torch.cuda.Stream:
    """This thread's stream for the fused forward's dE GEMMs, beside dC's on the caller's: one
    per thread, so no thread's work lands in a stream another thread's capture has forked."""
    streams: dict[torch.device, torch.cuda.Stream] = _local.__dict__.setdefault("grad_e", {})
    if device not in streams:
        streams[device] = torch.cuda.Stream(device)
    return streams[device]


@contextlib.contextmanager
def forked(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Work queued in the block runs on `stream`, after all the current stream has queued (with
    no stream, on the current one). The caller joins it back (`current.wait_stream(stream)`)
    before anything the block reads is written again."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        yield
