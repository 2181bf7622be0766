"""Launching one Triton kernel many times within one op call, at less host time per launch.

The backward launches its kernels once per slab step: 304 steps on Qwen2.5's shape. Each
Triton launch binds and specializes every argument (~40 of them) before it finds its compiled
kernel; on the H200's host that took ~70 us of a ~190 us step, against ~80 us of GPU work
per step, so the GPU waited (benchmarks/results/probe-host-h200.json).
"""

from __future__ import annotations

from typing import Any

from torch.library import wrap_triton

INT32 = range(-(2**31), 2**31)


def launch_key(args: tuple, kwargs: dict[str, Any], free: frozenset[int]) -> tuple:
    """What decides the compiled kernel a launch needs, strictly: scalars by value, tensors and
    other objects by identity, and the positions in `free` (the kernel's do_not_specialize
    arguments) only by whether they fit in 32 bits, the one thing Triton compiles from them."""
    return tuple(
        (arg in INT32) if position in free
        else arg if arg is None or isinstance(arg, (int, float, str))
        else id(arg)
        for position, arg in enumerate(args)
    ) + tuple(kwargs.items())


class KernelLauncher:
    """`launcher(grid, *args, **kwargs)` launches `kernel` as `wrap_triton(kernel)[grid]` does
    (what torch.compile traces). With `reuse` (eager CUDA calls) a launch whose launch_key
    matches an earlier one's goes straight to the driver with that launch's compiled kernel,
    skipping Triton's binding and cache lookup. Arguments that change between a kernel's
    launches in one op call must be named in its do_not_specialize, or every launch takes
    Triton's own path (correct, only slower). One launcher serves one op call: it holds the
    objects its keys name, so no identity is reused while it lives."""

    def __init__(self, kernel: Any, reuse: bool) -> None:
        self.kernel = kernel
        self.reuse = reuse
        self.free = frozenset(param.num for param in kernel.params if param.do_not_specialize) if reuse else frozenset()
        self.compiled: dict[tuple, tuple[Any, tuple]] = {}

    def __call__(self, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        if not self.reuse:
            wrap_triton(self.kernel)[grid](*args, **kwargs)
            return
        key = launch_key(args, kwargs, self.free)
        entry = self.compiled.get(key)
        if entry is None:
            self.compiled[key] = (self.kernel[grid](*args, **kwargs), args)
            return
        # The compiled kernel takes a 3-D grid and every parameter in order, constexprs
        # included (it skips them).
        constexprs = (kwargs[name] for name in self.kernel.arg_names[len(args):])
        entry[0][(*grid, 1, 1)[:3]](*args, *constexprs)
