"""Launching one Triton kernel many times within one op call, at less host time per launch.

The backward launches its kernels once per slab step: 304 steps on Qwen2.5's shape. Each
Triton launch binds and specializes every argument (~40 of them) before it finds its compiled
kernel: on the H200's host 20-70 us of a step whose GPU work is ~80 us, so the GPU waited
(benchmarks/results/probe-host-h200-*.json).
"""

from __future__ import annotations

from typing import Any

from torch.library import wrap_triton

INT32 = range(-(2**31), 2**31)
INT64 = range(-(2**63), 2**63)


def integer_class(value: int) -> tuple[bool, bool, bool, bool]:
    """What Triton compiles from an integer argument: whether it is 1 (made a constant),
    divisible by 16 (an alignment hint), and its width (i32, i64 or u64)."""
    return value == 1, value % 16 == 0, value in INT32, value in INT64


def launch_key(args: tuple, kwargs: dict[str, Any]) -> tuple:
    """What decides the compiled kernel a launch needs, at least as finely as Triton does:
    integers by integer_class, other scalars by value, tensors and other objects (tensor
    descriptors) by identity, and the constexprs and launch options."""
    return tuple(
        integer_class(arg) if type(arg) is int
        else arg if arg is None or isinstance(arg, (bool, float, str))
        else id(arg)
        for arg in args
    ) + tuple(kwargs.items())


class KernelLauncher:
    """`launcher(grid, *args, **kwargs)` launches `kernel` as `wrap_triton(kernel)[grid]` does
    (what torch.compile traces). With `reuse` (eager CUDA calls) a launch whose launch_key
    matches an earlier one's goes straight to the driver with that launch's compiled kernel,
    skipping Triton's binding and cache lookup. One launcher serves one op call: it holds the
    objects its keys name, so no identity is reused while it lives."""

    def __init__(self, kernel: Any, reuse: bool) -> None:
        self.kernel = kernel
        self.reuse = reuse
        self.compiled: dict[tuple, tuple[Any, tuple]] = {}

    def __call__(self, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        if not self.reuse:
            wrap_triton(self.kernel)[grid](*args, **kwargs)
            return
        key = launch_key(args, kwargs)
        entry = self.compiled.get(key)
        if entry is None:
            self.compiled[key] = (self.kernel[grid](*args, **kwargs), args)
            return
        # The compiled kernel takes a 3-D grid and every parameter in order, constexprs
        # included (it skips them).
        constexprs = (kwargs[name] for name in self.kernel.arg_names[len(args):])
        entry[0][(*grid, 1, 1)[:3]](*args, *constexprs)
