"""Test setup: the Triton interpreter on CPU-only machines, and the `interpreter` marker.

TRITON_INTERPRET is read when kernels are decorated, so it is set before anything imports
cce_compile. The op's CPU dispatch then follows `dispatch.INTERPRET`: tests marked
`interpreter` run the real Triton kernels on CPU tensors, all others the plain-PyTorch path.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cce_compile.ops import dispatch  # noqa: E402

pytest_plugins = ["tests.db_fixtures"]  # the database fixtures (sqlite_url, db_url, engine, ...)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "interpreter: runs the Triton kernels under TRITON_INTERPRET=1 on CPU")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _cpu_dispatch(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    wants_kernels = request.node.get_closest_marker("interpreter") is not None
    if wants_kernels and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the interpreter tests need TRITON_INTERPRET=1 set before import (CPU-only machines)")
    monkeypatch.setattr(dispatch, "INTERPRET", wants_kernels)


@pytest.fixture
def block_sparse_always(monkeypatch: pytest.MonkeyPatch) -> None:
    """Filtered mode's block-sparse backward however many tiles are kept: tests of that path
    on small or dense shapes, where the dense fallback (filtering.DENSE_FRACTION) would run."""
    from cce_compile.ops import filtering

    monkeypatch.setattr(filtering, "DENSE_FRACTION", 1.0)


@pytest.fixture
def block_sparse_backwards(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per filtered backward that chose the block-sparse path over the dense one."""
    from cce_compile.ops import filtering

    calls: list[int] = []
    dense_is_faster = filtering.Steps.dense_is_faster

    def spy(self, *args):
        dense = dense_is_faster(self, *args)
        if not dense:
            calls.append(1)
        return dense

    monkeypatch.setattr(filtering.Steps, "dense_is_faster", spy)
    return calls


@pytest.fixture
def descriptor_fits(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """One entry per choice the op makes between its tensor-descriptor and pointer kernels
    (forward, then backward), with the persistent recompute allowed at any K length so the
    tests' small D reaches it, and the Gluon kernels for short K off (their own tests compare
    them with the tensor-descriptor kernels)."""
    from cce_compile.ops import backward, forward

    fits: list[bool] = []

    def spy(*tensors: torch.Tensor) -> bool:
        fits.append(dispatch.tensor_descriptors_fit(*tensors))
        return fits[-1]

    for module in (forward, backward):
        monkeypatch.setattr(module, "tensor_descriptors_fit", spy)
    monkeypatch.setattr(backward, "PERSISTENT_MIN_K_STEPS", 1)
    for module in (forward, backward):
        monkeypatch.setattr(module, "WARP_SPECIALIZED_MAX_K_STEPS", 0)
    return fits


@pytest.fixture
def backward_outputs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(grad_e's, grad_c's element count) per call autograd makes to the backward op (the real
    op runs; traced calls record fake tensors' counts)."""
    from cce_compile.ops import autograd

    outputs: list[tuple[int, int]] = []
    backward_op = autograd.linear_cross_entropy_backward

    def spy(*args):
        grad_e, grad_c, grad_bias = backward_op(*args)
        outputs.append((grad_e.numel(), grad_c.numel()))
        return grad_e, grad_c, grad_bias

    monkeypatch.setattr(autograd, "linear_cross_entropy_backward", spy)
    return outputs
