"""Loops of many small launches, replayed as one CUDA graph once a call recurs.

Two loops enqueue more kernels than the host keeps up with: exact mode's recompute backward
(Qwen2.5's shape, 16384 x 896 x 151936: ~900 dependent kernels a call, 304 steps of a recompute
and two GEMMs, at 24-40 ms of host time against ~24 ms of GPU work; docs/notes/cuda-graph-slab-loop.md)
and the fused forward's token chunks (the same shape: 19 chunks of ~90 launches; profiled with 26
chunks, 42 ms of host time against 26 ms of GPU work; docs/notes/fused-forward.md). A training loop calls the op step
after step on tensors the caching allocator puts at the same addresses: the second call on the
same tensors (addresses, shapes, strides, dtypes, and the loop's settings) captures the loop's
launches into a graph, and every later one replays it in one launch. Any other call runs the
loop as before. A graph reads its tensors when it runs, so new values at the same addresses are
what it computes on; what the loop writes lives in the call's own tensors. Which calls take this
path is the launch plan's `cuda_graphs`.

Same addresses hold for the allocator's large pool (blocks above 1 MiB), not its small one: a
training loop keeps small tensors alive across steps (the last step's loss, logged scalars), so
its small blocks come back elsewhere each step (an HF Llama under AdamW never replayed in 8 steps,
docs/notes/cuda-graph-slab-loop.md). So a graphed loop makes its buffers with `carve` and copies
the small tensors it reads with `staged`: every address in its key then lies in the large pool
but its outputs' (dE, dC), which lie in the small one only for heads of 1 MiB or less.
"""

from __future__ import annotations

import math
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch
from torch import Tensor

from ..plan.launch import SMALL_POOL_BYTES
from .streams import warm_streams

CAPACITY = 8
"""Graphs kept (least recently replayed dropped first): a training loop needs one per set of
addresses it cycles through, usually one or two."""


def tensor_key(t: Tensor | None) -> Hashable:
    """What a captured launch depends on of a tensor: where it is and how it is laid out."""
    return None if t is None else (t.data_ptr(), t.dtype, t.device, tuple(t.shape), t.stride())


def matmul_settings() -> Hashable:
    """torch's cuBLAS settings as a graphed loop's GEMMs read them at capture: TF32 for fp32
    operands, reduced-precision reductions for 16-bit ones (and whether split-K may use them) and
    fp16 accumulation for fp16 ones. A replay keeps the captured ones, so a loop's key names
    them: a user turning TF32 off gets a new capture, not TF32."""
    matmul = torch.backends.cuda.matmul
    # fp32_precision reflects the legacy setters too (allow_tf32, set_float32_matmul_precision),
    # and reading it never raises, where the legacy getters do once a user mixed the two APIs.
    # The split-K switches are newer than torch 2.11, whose cuBLAS module has no such attribute.
    return (matmul.fp32_precision, matmul.allow_bf16_reduced_precision_reduction,
            matmul.allow_fp16_reduced_precision_reduction, matmul.allow_fp16_accumulation,
            getattr(matmul, "allow_bf16_reduced_precision_reduction_split_k", None),
            getattr(matmul, "allow_fp16_reduced_precision_reduction_split_k", None))


ALIGNMENT = 256
"""Byte alignment of each carved tensor: what cuBLAS, TMA descriptors and vector loads take."""


def carve(device: torch.device, *layouts: tuple[tuple[int, ...], torch.dtype], large_pool: bool) -> tuple[Tensor, ...]:
    """Empty tensors of these (shape, dtype) layouts, views of one allocation; `large_pool`
    (a graphed loop's buffers) pads it above SMALL_POOL_BYTES where they are smaller."""
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in layouts]
    starts = [sum(-(-size // ALIGNMENT) * ALIGNMENT for size in sizes[:i]) for i in range(len(sizes))]
    total = (starts[-1] + sizes[-1]) if layouts else 0
    block = torch.empty(max(total, SMALL_POOL_BYTES + 1) if large_pool else total, dtype=torch.uint8, device=device)
    return tuple(block[start:start + size].view(dtype).view(shape)
                 for (shape, dtype), start, size in zip(layouts, starts, sizes))


def staged(*tensors: Tensor | None) -> tuple[Tensor | None, ...]:
    """`tensors` with each small one (SMALL_POOL_BYTES or less) copied into one carved block of
    the large pool, the others (None too) as they are: what a graphed loop reads, at addresses
    a training loop's next step finds again. A tensor given twice is copied once; a matrix
    keeps its padded rows (tensor descriptors were planned on its row stride)."""
    small = {id(t): t for t in tensors if t is not None and t.numel() * t.element_size() <= SMALL_POOL_BYTES}
    if not small:
        return tensors
    blocks = carve(next(iter(small.values())).device, *map(_padded_layout, small.values()), large_pool=True)
    copies = {key: block[:, :t.shape[1]].copy_(t) if block.shape != t.shape else block.copy_(t)
              for (key, t), block in zip(small.items(), blocks)}
    return tuple(copies.get(id(t), t) for t in tensors)


def _padded_layout(t: Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    """A row-major matrix with padded rows: (rows, row stride); any other tensor its shape."""
    if t.dim() == 2 and t.stride(1) == 1 and t.stride(0) > t.shape[1]:
        return (t.shape[0], t.stride(0)), t.dtype
    return tuple(t.shape), t.dtype


CAPTURING = threading.Lock()
"""One capture at a time: threads share the capture streams."""


class LoopGraphs:
    """Graphs of a loop of launches, by a key naming everything the launches read.

    `run(key, loop)`: the first call with a key runs `loop` eagerly (compiling what it
    launches), the second captures it and replays the capture, later ones replay. A loop that
    cannot be captured runs eagerly from then on, with one warning."""

    def __init__(self, name: str, capacity: int = CAPACITY) -> None:
        self.name, self.capacity = name, capacity
        self.graphs: OrderedDict[Hashable, torch.cuda.CUDAGraph] = OrderedDict()
        self.seen: OrderedDict[Hashable, None] = OrderedDict()
        self.uncapturable: OrderedDict[Hashable, None] = OrderedDict()
        self.captures = self.replays = 0

    def run(self, key: Hashable, loop: Callable[[], None], device: torch.device,
            side_streams: tuple[torch.cuda.Stream, ...] = ()) -> None:
        """`side_streams`: the streams `loop` forks to besides the one it runs on."""
        graph = self.graphs.get(key)
        if graph is None and key not in self.uncapturable:
            if key in self.seen:
                graph = self._capture(key, loop, device, side_streams)
            else:  # the first call makes the workspaces, so the capturing one (usually) need not
                self._remember(self.seen, key, None)
                self._try(key, _warm_streams_alone, device, side_streams)
        if graph is None:
            loop()
            return
        self.graphs.move_to_end(key)
        graph.replay()
        self.replays += 1

    def _capture(self, key: Hashable, loop: Callable[[], None], device: torch.device,
                 side_streams: tuple[torch.cuda.Stream, ...]) -> torch.cuda.CUDAGraph | None:
        def capture() -> torch.cuda.CUDAGraph:
            graph = torch.cuda.CUDAGraph()
            with CAPTURING, torch.cuda.stream(warm_streams(device, side_streams, again=True)):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    loop()
                finally:
                    graph.capture_end()
            return graph

        graph = self._try(key, capture)
        if graph is not None:
            self._remember(self.graphs, key, graph)
            self.captures += 1
        return graph

    def _try(self, key: Hashable, step: Callable, *args):
        """`step(*args)`, or None and the key marked uncapturable (with a warning) where CUDA
        refuses it."""
        try:
            return step(*args)
        except RuntimeError as err:
            self._remember(self.uncapturable, key, None)
            warnings.warn(f"cce_compile: {self.name} cannot be captured as a CUDA graph, so it runs eagerly ({err})",
                          RuntimeWarning, stacklevel=4)
            return None

    def _remember(self, table: OrderedDict, key: Hashable, value) -> None:
        table[key] = value
        table.move_to_end(key)
        while len(table) > self.capacity:
            table.popitem(last=False)


def _warm_streams_alone(device: torch.device, side_streams: tuple[torch.cuda.Stream, ...]) -> None:
    """warm_streams, once per thread and stream, while no other thread captures on the capture stream."""
    with CAPTURING:
        warm_streams(device, side_streams, again=False)


SLAB_LOOPS = LoopGraphs("the backward's slab loop")
"""The process's graphs of exact mode's backward slab loop (ops/backward_dense.py)."""

CHUNK_LOOPS = LoopGraphs("the fused forward's chunk loop")
"""The process's graphs of the fused forward's token-chunk loop (ops/forward_fused.py)."""
