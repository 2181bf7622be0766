"""ops/launch.py: when a relaunch may reuse an earlier launch's compiled kernel.

The reuse itself needs a GPU (tests/test_gpu.py runs the backward with it on and off); what
decides it, launch_key, is tested here: a key too coarse would launch a kernel compiled for
other arguments."""

from __future__ import annotations

import torch

from cce_compile.ops.launch import launch_key

FREE = frozenset({1})


def test_free_integers_differ_only_across_32_bits() -> None:
    assert launch_key((7, 128, 5), {}, FREE) == launch_key((7, 4096 + 3, 5), {}, FREE)
    assert launch_key((7, 128, 5), {}, FREE) != launch_key((7, 2**31, 5), {}, FREE)
    assert launch_key((7, -(2**31), 5), {}, FREE) != launch_key((7, -(2**31) - 1, 5), {}, FREE)


def test_specialized_scalars_match_by_value() -> None:
    assert launch_key((7, 1, 5), {}, FREE) != launch_key((16, 1, 5), {}, FREE)
    assert launch_key((7, 1, 0.5), {}, FREE) != launch_key((7, 1, 0.25), {}, FREE)
    assert launch_key((None, 1, True), {}, FREE) != launch_key((None, 1, False), {}, FREE)
    assert launch_key((None, 1, 2), {}, FREE) == launch_key((None, 1, 2), {}, FREE)


def test_tensors_match_by_identity_only() -> None:
    a = torch.arange(8.0)
    same_values = a.clone()
    assert launch_key((a, 1), {}, FREE) == launch_key((a, 2), {}, FREE)
    assert launch_key((a, 1), {}, FREE) != launch_key((same_values, 1), {}, FREE)
    assert launch_key((a, 1), {}, FREE) != launch_key((a[1:], 1), {}, FREE)


def test_constexprs_and_launch_options_are_part_of_the_key() -> None:
    base = launch_key((7, 1), {"ACCUMULATE": False, "num_warps": 8}, FREE)
    assert base == launch_key((7, 2), {"ACCUMULATE": False, "num_warps": 8}, FREE)
    assert base != launch_key((7, 1), {"ACCUMULATE": True, "num_warps": 8}, FREE)
    assert base != launch_key((7, 1), {"ACCUMULATE": False, "num_warps": 4}, FREE)
