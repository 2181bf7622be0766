"""ops/launch.py: when a relaunch may reuse an earlier launch's compiled kernel.

The reuse itself needs a GPU (tests/test_gpu.py runs the backward with it on and off); what
decides it, launch_key, is tested here: a key coarser than Triton's specialization would
launch a kernel compiled for other arguments."""

from __future__ import annotations

import pytest
import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from cce_compile.ops.launch import RecentKinds, identity_key, launch_key


def test_integers_match_by_what_triton_specializes() -> None:
    assert launch_key((32, 7), {}) == launch_key((4096, 23), {})  # 16-divisible; neither
    assert launch_key((32,), {}) != launch_key((33,), {})  # the alignment hint
    assert launch_key((1,), {}) != launch_key((3,), {})  # 1 is compiled in as a constant
    assert launch_key((16,), {}) != launch_key((2**31,), {})  # i32 against i64
    assert launch_key((2**62,), {}) != launch_key((2**63,), {})  # i64 against u64
    assert launch_key((-16,), {}) == launch_key((16,), {})


def test_other_scalars_match_by_value() -> None:
    assert launch_key((0.5,), {}) != launch_key((0.25,), {})
    assert launch_key((True,), {}) != launch_key((False,), {})
    assert launch_key((True,), {}) != launch_key((1,), {})  # a bool is not the integer 1
    assert launch_key((None, 2.0), {}) == launch_key((None, 2.0), {})


def test_tensors_match_by_dtype_device_and_alignment() -> None:
    a = torch.arange(64.0)
    assert launch_key((a, 1), {}) == launch_key((a.clone(), 1), {})
    assert launch_key((a,), {}) == launch_key((a[4:],), {})  # 16 bytes on: still aligned
    assert launch_key((a,), {}) != launch_key((a[1:],), {})  # the pointer's alignment hint
    assert launch_key((a,), {}) != launch_key((a.double(),), {})
    assert launch_key((a,), {}) != launch_key((None,), {})


def test_tensor_descriptors_match_by_block_shape_and_classes() -> None:
    a = torch.zeros(64, 32, dtype=torch.bfloat16)
    base = launch_key((TensorDescriptor.from_tensor(a, [16, 16]),), {})
    assert base == launch_key((TensorDescriptor.from_tensor(a.clone(), [16, 16]),), {})
    assert base != launch_key((TensorDescriptor.from_tensor(a, [32, 16]),), {})
    assert base != launch_key((TensorDescriptor.from_tensor(a[:33], [16, 16]),), {})  # 33 rows: no hint
    assert base != launch_key((TensorDescriptor.from_tensor(a.float(), [16, 16]),), {})


def test_gluon_descriptors_match_by_block_shape_and_layout() -> None:
    from cce_compile.ops.gluon import gluon_descriptor

    a = torch.zeros(256, 128, dtype=torch.bfloat16)
    base = launch_key((gluon_descriptor(a, [128, 64]),), {})
    assert base == launch_key((gluon_descriptor(a.clone(), [128, 64]),), {})
    assert base != launch_key((gluon_descriptor(a, [128, 32]),), {})  # another block and swizzle
    assert base != launch_key((TensorDescriptor.from_tensor(a, [128, 64]),), {})


def test_unknown_arguments_are_refused() -> None:
    with pytest.raises(TypeError, match="no launch class for a list"):
        launch_key(([1, 2],), {})


def test_constexprs_and_launch_options_are_part_of_the_key() -> None:
    base = launch_key((32,), {"ACCUMULATE": False, "num_warps": 8})
    assert base == launch_key((48,), {"ACCUMULATE": False, "num_warps": 8})
    assert base != launch_key((32,), {"ACCUMULATE": True, "num_warps": 8})
    assert base != launch_key((32,), {"ACCUMULATE": False, "num_warps": 4})


def test_identity_keys_are_no_coarser_than_launch_keys() -> None:
    """Within one call the launcher looks launches up by identity_key: two launches with
    equal identity keys must need the same compiled kernel."""
    a, b = torch.arange(64.0), torch.arange(64.0)[1:]
    cases = [(a, 32, 0.5, None, True), (a, 48, 0.5, None, True), (b, 32, 0.5, None, True), (a, 1, 0.5, None, False)]
    for first in cases:
        for second in cases:
            if identity_key(first, {}) == identity_key(second, {}):
                assert launch_key(first, {}) == launch_key(second, {})
    assert identity_key((a,), {}) != identity_key((a.clone(),), {})


def test_a_launch_takes_a_compile_started_ahead_once_and_compiles_itself_after_a_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What AheadCompiler started is taken by the one launch whose key it is; a compile that
    failed on its thread hands nothing over, so the launch compiles through Triton's JIT and
    raises the error where the caller sees it."""
    from concurrent.futures import Future

    from cce_compile.ops import launch

    compiled, failed = Future(), Future()
    compiled.set_result("the compiled kernel")
    failed.set_exception(RuntimeError("ptxas ran out of registers"))
    monkeypatch.setattr(launch, "AHEAD", {"key": compiled, "failed key": failed})
    monkeypatch.setattr(launch, "COMPILED", {})
    assert launch.compiled_ahead("key") == "the compiled kernel"
    assert launch.compiled_ahead("key") is None  # taken
    assert launch.compiled_ahead("failed key") is None
    assert launch.compiled_ahead("never started") is None
    assert launch.AHEAD == {}


def test_recent_kinds_forget_the_oldest_past_capacity_and_survive_threads() -> None:
    """A kind is first once until it is forgotten; the latest seen are kept, the oldest go; and
    threads that see and evict kinds at once never lose one's answer to another's eviction."""
    import threading

    recent = RecentKinds(capacity=2)
    assert [recent.first_of_kind(kind) for kind in "aab"] == [True, False, True]
    assert recent.first_of_kind("a") is False  # seen again: now the most recent, b the oldest
    assert recent.first_of_kind("c") is True  # evicts b
    assert [recent.first_of_kind(kind) for kind in "acb"] == [False, False, True]
    assert len(recent.kinds) == 2

    shared, errors = RecentKinds(capacity=4), []

    def churn(offset: int) -> None:
        try:
            for step in range(5000):
                shared.first_of_kind((offset + step) % 9)
        except Exception as err:  # noqa: BLE001 - what the test looks for
            errors.append(err)

    threads = [threading.Thread(target=churn, args=(offset,)) for offset in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(shared.kinds) == 4
