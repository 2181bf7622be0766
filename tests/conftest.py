"""Test setup: the Triton interpreter on CPU-only machines, and the `interpreter` marker.

TRITON_INTERPRET is read when kernels are decorated, so it is set before anything imports
cce_compile. Tests marked `interpreter` run the real Triton kernels on CPU tensors (the
policy's triton_on_cpu), all others the plain-PyTorch path.
"""

import contextlib
import os
import sys
from dataclasses import replace
from typing import Callable

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cce_compile.plan.launch import LaunchPlan  # noqa: E402
from cce_compile.plan.policy import Policy, active_policy, override_policy  # noqa: E402

pytest_plugins = ["tests.db_fixtures"]  # the database fixtures (sqlite_url, db_url, engine, ...)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "interpreter: runs the Triton kernels under TRITON_INTERPRET=1 on CPU")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture
def use_policy() -> Callable[..., Policy]:
    """`use_policy(field=value, ...)`: the rest of the test runs under the active policy with
    those fields changed; returns that policy."""
    with contextlib.ExitStack() as stack:
        def change(**fields) -> Policy:
            policy = replace(active_policy(), **fields)
            stack.enter_context(override_policy(policy))
            return policy

        yield change


@pytest.fixture(autouse=True)
def _cpu_dispatch(request: pytest.FixtureRequest, use_policy: Callable[..., Policy]) -> None:
    wants_kernels = request.node.get_closest_marker("interpreter") is not None
    if wants_kernels and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the interpreter tests need TRITON_INTERPRET=1 set before import (CPU-only machines)")
    use_policy(triton_on_cpu=wants_kernels)


@pytest.fixture
def no_scratch_floor(use_policy: Callable[..., Policy]) -> None:
    """Shapes this small fit the scratch floor whole; without it the 10% budget splits them
    into token chunks and slabs, the paths big problems take."""
    use_policy(scratch_floor_bytes=0)


@pytest.fixture
def block_sparse_always(use_policy: Callable[..., Policy]) -> None:
    """Filtered mode's block-sparse backward however many tiles are kept, on the kernels and
    the plain-PyTorch path: tests of that path on small or dense shapes, where the dense
    fallback (Policy.dense_fraction) would run."""
    use_policy(dense_fraction=1.0)


@pytest.fixture
def launch_plans(monkeypatch: pytest.MonkeyPatch) -> list[LaunchPlan]:
    """Every launch plan the ops make (forward, then backward), in order: recorded in every
    cce_compile module that imported plan_launch (the loss's ops, linear_log_probs', any other)."""
    import cce_compile.ops  # noqa: F401 - loads every op module before the scan below
    from cce_compile.plan.launch import plan_launch

    plans: list[LaunchPlan] = []

    def recorded(*args) -> LaunchPlan:
        plans.append(plan_launch(*args))
        return plans[-1]

    for module in list(sys.modules.values()):
        if module.__name__.startswith("cce_compile.") and getattr(module, "plan_launch", None) is plan_launch:
            monkeypatch.setattr(module, "plan_launch", recorded)
    return plans


@pytest.fixture
def block_sparse_backwards(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per filtered backward (the kernels' or the plain-PyTorch path's) that chose
    the block-sparse path over the dense one: filtering.dense_is_faster spied on in every
    cce_compile module that imported it."""
    import cce_compile.ops  # noqa: F401 - loads every op module before the scan below
    from cce_compile.ops import filtering

    calls: list[int] = []
    dense_is_faster = filtering.dense_is_faster

    def spy(*args):
        dense = dense_is_faster(*args)
        if not dense:
            calls.append(1)
        return dense

    for module in list(sys.modules.values()):
        if module.__name__.startswith("cce_compile.") and getattr(module, "dense_is_faster", None) is dense_is_faster:
            monkeypatch.setattr(module, "dense_is_faster", spy)
    return calls


@pytest.fixture
def descriptor_kernels(use_policy: Callable[..., Policy]) -> None:
    """The tensor-descriptor kernels wherever they fit: the persistent recompute at any K
    length, so the tests' small D reaches it, and the Gluon kernels off (their own tests
    compare them with the tensor-descriptor kernels)."""
    use_policy(recompute_tma_min_k_steps=1, forward_gluon_max_k_steps=0, recompute_gluon_max_k_steps=0)


@pytest.fixture
def backward_outputs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(grad_e's, grad_c's element count) per call autograd makes to the backward op."""
    from cce_compile.ops import library

    outputs: list[tuple[int, int]] = []
    backward_op = library.linear_cross_entropy_backward

    def spy(*args):
        grad_e, grad_c, grad_bias = backward_op(*args)
        outputs.append((grad_e.numel(), grad_c.numel()))
        return grad_e, grad_c, grad_bias

    monkeypatch.setattr(library, "linear_cross_entropy_backward", spy)
    return outputs


@pytest.fixture
def fused_outputs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(grad_e's, grad_c's element count) per call the API makes to the fused op."""
    from cce_compile import ops

    outputs: list[tuple[int, int]] = []
    fused_op = ops.linear_cross_entropy_fused

    def spy(*args):
        loss, grad_e, grad_c, grad_bias = fused_op(*args)
        outputs.append((grad_e.numel(), grad_c.numel()))
        return loss, grad_e, grad_c, grad_bias

    monkeypatch.setattr(ops, "linear_cross_entropy_fused", spy)
    return outputs
