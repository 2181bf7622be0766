"""ops/graphs.py off the GPU: what keys a graph, when a loop runs eagerly, and that only eager
CUDA calls go through the graphs (tests/test_gpu.py captures and replays them on a GPU)."""

from __future__ import annotations

import warnings

import pytest
import torch

import cce_compile
from cce_compile.ops import graphs

from .op_cases import make_inputs


def test_tensor_key_names_address_layout_and_dtype() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    key = graphs.tensor_key(base)
    assert graphs.tensor_key(base) == key
    assert graphs.tensor_key(None) is None
    others = [base[1:], base.T, base.reshape(6, 4), base.view(torch.int32), base.clone()]
    assert len({key, *map(graphs.tensor_key, others)}) == len(others) + 1


def test_a_loop_that_cannot_be_captured_runs_eagerly_and_warns_once() -> None:
    """Here capture fails for want of CUDA; on a GPU the loop's synchronizing call fails it."""
    loops = graphs.LoopGraphs("a loop")
    runs: list[int] = []

    def loop() -> None:
        runs.append(1)
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    device = torch.device("cuda", 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            loops.run("key", loop, device)
    assert len(runs) == 4 + torch.cuda.is_available()  # a GPU's failed capture ran it once more
    assert sum("cannot be captured" in str(w.message) for w in caught) == 1
    assert (loops.captures, loops.replays, list(loops.graphs)) == (0, 0, [])


def test_keys_seen_are_bounded() -> None:
    loops = graphs.LoopGraphs("a loop", capacity=2)
    for key in ("a", "b", "c"):
        loops.run(key, lambda: None, torch.device("cuda", 0))
    assert list(loops.seen) == ["b", "c"]


@pytest.mark.interpreter
def test_calls_off_cuda_never_reach_the_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter's calls on CPU tensors run the slab loop as they are, however often."""
    loops = graphs.LoopGraphs("a loop")
    monkeypatch.setattr(graphs, "SLAB_LOOPS", loops)
    e, c, targets = make_inputs("zipf", (64,), 300, 32, torch.bfloat16, seed=3)
    e.requires_grad_()
    for _ in range(2):
        cce_compile.linear_cross_entropy(e, c, targets).backward()
    assert list(loops.seen) == [] and loops.captures == 0
