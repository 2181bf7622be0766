"""Exact mode's backward steps with the next step's recompute running beside this step's GEMMs.

Each step recomputes a slab's d-logits (a Triton or Gluon kernel) and then reads them in two
cuBLAS GEMMs (dC, dE). One after the other, every kernel starts on an idle GPU and ends on a
draining one, and the GEMMs of short steps leave SMs unused (Qwen2.5's 2048 x 896 dE GEMM has
112 output tiles for 132 SMs). With two slab buffers the recompute of step i + 1 runs on a side
stream while step i's GEMMs run on the caller's, so each fills what the other leaves. The
recompute needs no cuBLAS, so the side stream gets no cuBLAS workspace.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import TypeVar

import torch

Step = TypeVar("Step")


@lru_cache(maxsize=None)
def recompute_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def run_steps(
    steps: Sequence[Step], recompute: Callable[[Step, int], None], gemms: Callable[[Step, int], None],
    buffers: int, device: torch.device,
) -> None:
    """`recompute(step, buffer)` then `gemms(step, buffer)` for every step, in order. With two
    buffers, step i uses buffer i % 2 and the recompute runs one step ahead on a side stream:
    it waits for the GEMMs that last read its buffer, the GEMMs wait for their recompute, and
    the caller's stream waits for the side stream at the end (so the buffers may be freed, and
    a CUDA graph capture joins its fork)."""
    if buffers == 1:
        for step in steps:
            recompute(step, 0)
            gemms(step, 0)
        return
    caller, side = torch.cuda.current_stream(device), recompute_stream(device)
    recomputed = [torch.cuda.Event(), torch.cuda.Event()]
    read = [torch.cuda.Event(), torch.cuda.Event()]
    side.wait_stream(caller)
    for index in range(len(steps) + 1):
        if index < len(steps):  # recompute step `index`, ahead of its GEMMs
            with torch.cuda.stream(side):
                if index >= 2:
                    side.wait_event(read[index % 2])
                recompute(steps[index], index % 2)
                recomputed[index % 2].record(side)
        if index >= 1:  # the GEMMs of the step before
            previous = index - 1
            caller.wait_event(recomputed[previous % 2])
            gemms(steps[previous], previous % 2)
            read[previous % 2].record(caller)
    caller.wait_stream(side)
