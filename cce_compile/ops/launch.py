"""Launching one Triton kernel many times, at less host time per launch, and compiling a
call's kernels side by side before its first launch.

The backward launches its kernels once per slab step: 304 steps on Qwen2.5's shape. Each
Triton launch binds and specializes every argument (~40 of them) before it finds its compiled
kernel: on the H200's host 20-70 us of a step whose GPU work is ~80 us, so the GPU waited.

A kernel's first launch compiles it: 0.3-1.5 s each for sm_90, one after another as the call
reaches them. AheadCompiler takes the same arguments and compiles on threads instead
(Triton's compiler and ptxas mostly release the GIL), so a call that knows its launches can
start all their compiles before the first; each launch then waits only for its own.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from typing import Any

import torch
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
from triton.runtime import driver
from triton.tools.tensor_descriptor import TensorDescriptor

def on_device_of(tensor: torch.Tensor) -> Any:
    """A context running the op's launches on `tensor`'s GPU. The dispatcher gives a custom op no
    device guard, and Triton launches on the current device: with Hugging Face's
    device_map="auto", the head's tensors are on the last GPU while the current one is cuda:0."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


INT32 = range(-(2**31), 2**31)
INT64 = range(-(2**63), 2**63)


def integer_class(value: int) -> tuple[bool, bool, bool, bool]:
    """What Triton compiles from an integer argument: whether it is 1 (made a constant),
    divisible by 16 (an alignment hint), and its width (i32, i64 or u64)."""
    return value == 1, value % 16 == 0, value in INT32, value in INT64


SCALARS = (int, bool, float, str, type(None))
"""Arguments classed by value (integers by integer_class), in either key."""


def argument_class(arg: Any) -> Any:
    """What Triton specializes one argument on, or finer: integers by integer_class, other
    scalars by value, tensors by dtype, device and 16-byte alignment, tensor descriptors (Triton's
    and Gluon's) by kind, their base's class, block shape, padding, shared-memory layout (Gluon's)
    and the classes of their shape and strides."""
    if isinstance(arg, SCALARS):
        return integer_class(arg) if type(arg) is int else arg
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.device, arg.data_ptr() % 16 == 0
    if isinstance(arg, (TensorDescriptor, GluonDescriptor)):
        return (type(arg), argument_class(arg.base), tuple(arg.block_shape), arg.padding, getattr(arg, "layout", None),
                tuple(map(integer_class, arg.shape)), tuple(map(integer_class, arg.strides)))
    raise TypeError(f"no launch class for a {type(arg).__name__} argument")


def launch_key(args: tuple, kwargs: dict[str, Any]) -> tuple:
    """What decides the compiled kernel a launch needs, at least as finely as Triton does:
    each argument's class, and the constexprs and launch options."""
    return tuple(map(argument_class, args)) + tuple(kwargs.items())


def identity_key(args: tuple, kwargs: dict[str, Any]) -> tuple:
    """launch_key's cheap stand-in within one op call: objects by identity, which the
    launcher keeps alive, so equal identity keys mean equal launch keys."""
    return tuple(
        integer_class(arg) if type(arg) is int else arg if isinstance(arg, SCALARS) else id(arg) for arg in args
    ) + tuple(kwargs.items())


COMPILED: dict[tuple, Any] = {}
"""Compiled kernels by (kernel, launch_key), shared by every launcher of the process: an op
call's first launches reuse what earlier calls compiled (a JIT launch after the filtered
backward's host sync held its next step back)."""


AHEAD: dict[tuple, Future] = {}
"""Compiles started by AheadCompiler, by the same key as COMPILED; the launch that needs one
takes it from here into COMPILED."""


class RecentKinds:
    """The latest `capacity` kinds of call seen, for work a call does once per kind (compiling
    its kernels ahead): where a kind holds N and N varies from step to step (RL, packed
    batches), the oldest are forgotten rather than kept for the process's life. Thread-safe:
    autograd's threads call the op too."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.kinds: OrderedDict[Hashable, None] = OrderedDict()
        self.lock = threading.Lock()

    def first_of_kind(self, kind: Hashable) -> bool:
        """Whether `kind` is new (or forgotten); either way it becomes the most recent."""
        with self.lock:
            if kind in self.kinds:
                self.kinds.move_to_end(kind)
                return False
            self.kinds[kind] = None
            if len(self.kinds) > self.capacity:
                self.kinds.popitem(last=False)
            return True


@lru_cache(maxsize=1)
def compile_threads() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="cce-compile")


LAUNCHER_BUILDS: dict[Any, threading.Lock] = {}
"""One lock per kernel around its launcher's build: its variants (a ragged chunk's) mostly
share the launcher's C source, which the second then finds in Triton's cache, not in gcc."""


def compile_on_thread(kernel: Any, device: int, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any],
                      launcher_build: threading.Lock) -> Any:
    """The compiled kernel (Triton's warmup: into the kernel's own cache too), its launcher's
    C module built into Triton's file cache (gcc, per signature), both of which the first
    launch would otherwise do on the caller's thread. The launch still makes the launcher and
    loads the binary there, from the caches: nothing of the compiled kernel's state is set here."""
    with torch.cuda.device(device):
        compiled = kernel.warmup(*args, grid=grid, **kwargs)
    with launcher_build:
        driver.active.launcher_cls(compiled.src, compiled.metadata)
    return compiled


class AheadCompiler:
    """Called as a KernelLauncher of `kernel` is, it launches nothing: it starts compiling, on
    a thread, the kernel that launch would need, unless that is compiled or started already.
    Triton's driver and the kernel's binder are made here, on the caller's thread: making them
    is not thread-safe (the Gluon kernels' binder swaps a class attribute while it is made)."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel

    def __call__(self, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        key = (self.kernel, launch_key(args, kwargs))
        if key in COMPILED or key in AHEAD:
            return
        device = torch.cuda.current_device()
        self.kernel.device_caches[device]  # makes the binder (and the driver) where none is yet
        launcher_build = LAUNCHER_BUILDS.setdefault(self.kernel, threading.Lock())
        AHEAD[key] = compile_threads().submit(compile_on_thread, self.kernel, device, grid, args, kwargs,
                                              launcher_build)


def compiled_ahead(key: tuple) -> Any | None:
    """The kernel an AheadCompiler compiled for `key` (waiting for it), moved into COMPILED, or
    None where none was started or it failed: the launch then compiles it (or builds its
    launcher) through Triton's JIT and raises what went wrong on the caller's thread."""
    future = AHEAD.pop(key, None)
    if future is None or future.exception() is not None:
        return None
    COMPILED[key] = compiled = future.result()
    return compiled


class KernelLauncher:
    """`launcher(grid, *args, **kwargs)` launches `kernel` as `kernel[grid](...)` does. With
    `reuse` (CUDA calls) a launch whose launch_key matches an earlier one's, in this op call or
    an earlier, goes straight to the driver with that launch's compiled kernel, skipping
    Triton's binding and cache lookup; within the call it is found by identity_key, cheaper
    per step. One launcher serves one op call: it holds the objects its identity keys name.
    `jit_launches` counts the launches Triton bound."""

    def __init__(self, kernel: Any, reuse: bool) -> None:
        self.kernel = kernel
        self.reuse = reuse
        self.jit_launches = 0
        self.by_identity: dict[tuple, tuple[Any, tuple]] = {}

    def __call__(self, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        if not self.reuse:
            self.jit_launches += 1
            self.kernel[grid](*args, **kwargs)
            return
        identity = identity_key(args, kwargs)
        entry = self.by_identity.get(identity)
        if entry is None:
            key = (self.kernel, launch_key(args, kwargs))
            compiled = COMPILED.get(key)
            if compiled is None:
                compiled = compiled_ahead(key)
            if compiled is None:
                self.jit_launches += 1
                COMPILED[key] = compiled = self.kernel[grid](*args, **kwargs)
                self.by_identity[identity] = (compiled, args)
                return
            self.by_identity[identity] = entry = (compiled, args)
        # The compiled kernel takes a 3-D grid and every parameter in order, constexprs
        # included (it skips them).
        constexprs = (kwargs[name] for name in self.kernel.arg_names[len(args):])
        entry[0][(*grid, 1, 1)[:3]](*args, *constexprs)
