"""ops/graphs.py off the GPU: what keys a graph, when a loop runs eagerly, and that only eager
CUDA calls go through the graphs (tests/test_gpu.py captures and replays them on a GPU)."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Hashable
from dataclasses import replace

import pytest
import torch

import cce_compile
from cce_compile.ops import graphs

from .op_cases import SMALL_TILES, make_inputs, with_row_stride


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


def in_large_pool(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() > graphs.SMALL_POOL_BYTES


def test_carve_makes_aligned_disjoint_views_of_one_block_from_the_large_pool() -> None:
    layouts = (((3, 5), torch.bfloat16), ((), torch.float32), ((0, 4), torch.float32), ((7,), torch.int64))
    tensors = graphs.carve(torch.device("cpu"), *layouts, large_pool=True)
    assert [(tuple(t.shape), t.dtype) for t in tensors] == [(shape, dtype) for shape, dtype in layouts]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    assert all(t.is_contiguous() and in_large_pool(t) for t in tensors)
    assert all((t.data_ptr() - t.untyped_storage().data_ptr()) % graphs.ALIGNMENT == 0 for t in tensors if t.numel())
    for value, t in enumerate(tensors):
        t.fill_(value + 1)
    assert [t.unique().tolist() for t in tensors] == [[1.0], [2.0], [], [4]]  # no view wrote another's bytes


def test_staged_copies_only_the_small_tensors_into_the_large_pool() -> None:
    """Padded rows stay padded (tensor descriptors were planned on the row stride); a tensor
    given twice is copied once."""
    small = torch.arange(12, dtype=torch.float32).reshape(3, 4).T  # not contiguous
    padded = with_row_stride(torch.randn(5, 6).to(torch.bfloat16), 8)
    scalar, large = torch.tensor(2.5), torch.ones(graphs.SMALL_POOL_BYTES // 4 + 1)
    staged = graphs.staged(small, padded, scalar, large, None, scalar)
    assert staged[3] is large and staged[4] is None and staged[5] is staged[2]
    for copy, original in zip(staged[:3], (small, padded, scalar)):
        assert torch.equal(copy, original) and copy.dtype == original.dtype and in_large_pool(copy)
        assert copy.data_ptr() != original.data_ptr()
    assert staged[1].stride() == (8, 1)


@pytest.mark.interpreter
@pytest.mark.parametrize("rows", ["contiguous", "padded"])
@pytest.mark.parametrize("memory", ["workspace", "low"])
def test_graphed_loops_touch_only_the_large_pool_and_compute_the_same(memory: str, rows: str, use_policy,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A training loop keeps small tensors alive across steps, so the allocator's small blocks come
    back elsewhere each step and a key naming one never repeats: a graphed loop reads and writes
    only the caller's large tensors, its outputs, and carved or staged blocks. Graphs forced here
    off CUDA, with a loop table that runs each loop as it is: the loss and gradients are the
    ungraphed plan's to the bit (a bias, whose sampled mean the shift reads, class weights,
    label smoothing, several chunks and slabs; and
    e and c in padded rows that tensor descriptors take, D = 100 not, where a staged copy
    without the padding failed the descriptors)."""

    def results() -> list[torch.Tensor]:
        leaves = [(with_row_stride(t, 104) if rows == "padded" else t.clone()).requires_grad_() for t in (e, c)]
        leaves.append(bias.clone().requires_grad_())  # dbias, summed in place in the graphed loops, compared too
        with cce_compile.override_config(replace(SMALL_TILES, workspace_rows=128)):
            loss = cce_compile.linear_cross_entropy(*leaves[:2], targets.clone(), bias=leaves[2], weight=weight.clone(),
                                                    reduction="sum", label_smoothing=0.1, memory=memory)
        loss.backward()
        return [loss, *(t.grad for t in leaves)]

    runners = _recorded_loops(monkeypatch)
    e, c, targets = make_inputs("zipf", (300,), 300, 32, torch.bfloat16, seed=5)
    if rows == "padded":
        use_policy(recompute_tma_min_k_steps=1)
        e, c = (t[:, :25].repeat(1, 4) for t in (e, c))
    weight = torch.rand(300) + 0.5
    bias = torch.randn(300).to(torch.bfloat16)
    ungraphed = results()
    _force_graphs(monkeypatch)
    graphed = results()
    assert all(torch.equal(a, b) for a, b in zip(ungraphed, graphed))
    (runner,) = runners
    tensors, outputs = ((runner, runner) if memory == "workspace" else (runner.call, runner.gradients))
    touched = [t for t in runner.graph_tensors()
               if t is not None and t.numel() and t is not outputs.grad_e and t is not outputs.grad_c]
    assert len(touched) > 8 and all(in_large_pool(t) for t in touched)
    assert tensors.e.stride() == tensors.c.stride() == ((104, 1) if rows == "padded" else (32, 1))


@pytest.mark.interpreter
def test_a_graphed_slab_loop_without_a_bias_carves_no_dbias_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a bias dbias's sum is empty: carved from the large pool it was a block padded past
    1 MiB, held through the slab loop beside the scratch and counted nowhere (plan held_bytes)."""
    runners = _recorded_loops(monkeypatch)
    _force_graphs(monkeypatch)
    e, c, targets = make_inputs("zipf", (64,), 300, 32, torch.bfloat16, seed=3)
    e.requires_grad_()
    with cce_compile.override_config(SMALL_TILES):
        cce_compile.linear_cross_entropy(e, c, targets, memory="low").backward()
    (runner,) = runners
    assert runner.grad_bias.numel() == 0 and runner.grad_bias.untyped_storage().nbytes() == 0


@pytest.mark.interpreter
@pytest.mark.parametrize("memory", ["workspace", "low"])
def test_a_loops_key_names_the_matmul_precision(monkeypatch: pytest.MonkeyPatch, memory: str) -> None:
    """A replay keeps the cuBLAS settings of its capture: the same call with TF32 allowed for
    fp32 operands (16-bit reductions refused, fp16 accumulation) must key another graph, not
    replay the first. The keys are taken as each loop runs, where its settings are, and name
    tensors without their addresses (which differ between calls off CUDA), so that the same
    call with the same settings keys the same graph."""
    keys: list = []
    _eager_loops(monkeypatch, lambda key, loop: keys.append(key))
    monkeypatch.setattr(graphs, "tensor_key", lambda t: None if t is None else (t.dtype, tuple(t.shape), t.stride()))
    _force_graphs(monkeypatch)
    e, c, targets = make_inputs("zipf", (64,), 300, 32, torch.float32, seed=3)
    e.requires_grad_()
    matmul = torch.backends.cuda.matmul
    bf16_reduction = (matmul.allow_bf16_reduced_precision_reduction,
                      matmul.allow_bf16_reduced_precision_reduction_split_k)
    saved = matmul.fp32_precision, bf16_reduction, matmul.allow_fp16_accumulation

    def step() -> None:
        with cce_compile.override_config(SMALL_TILES):
            cce_compile.linear_cross_entropy(e, c, targets, memory=memory).backward()

    try:
        step()
        step()
        matmul.fp32_precision = "tf32" if saved[0] != "tf32" else "ieee"
        step()
        matmul.allow_bf16_reduced_precision_reduction = (not bf16_reduction[0], bf16_reduction[1])
        step()
        matmul.allow_bf16_reduced_precision_reduction = (not bf16_reduction[0], not bf16_reduction[1])  # split-K
        step()
        matmul.allow_fp16_accumulation = not saved[2]  # fp16 GEMMs accumulating in fp16
        step()
    finally:
        (matmul.fp32_precision, matmul.allow_bf16_reduced_precision_reduction,
         matmul.allow_fp16_accumulation) = saved
    assert len(keys) == 6 and keys[0] == keys[1] and len(set(keys)) == 5


@pytest.mark.interpreter
def test_a_graphed_fp32_dbias_is_a_tensor_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """An fp32 head's dbias was the slab loop's carved sum itself (to(fp32) copies nothing):
    bias.grad pinned a block padded past 1 MiB, moving the next step's carve off the graph's key.
    (The loops run as they are, keeping no runner: a second reference made autograd copy it.)"""
    _eager_loops(monkeypatch, lambda key, loop: None)
    _force_graphs(monkeypatch)
    e, c, targets = make_inputs("zipf", (64,), 300, 32, torch.float32, seed=3)
    e.requires_grad_()
    bias = torch.randn(300, requires_grad=True)
    with cce_compile.override_config(SMALL_TILES):
        cce_compile.linear_cross_entropy(e, c, targets, bias=bias, memory="low").backward()
    assert bias.grad.untyped_storage().nbytes() == 300 * 4


def _recorded_loops(monkeypatch: pytest.MonkeyPatch) -> list:
    """Loop tables that run each loop as it is (no capture off CUDA) and record its runner."""
    runners: list = []
    _eager_loops(monkeypatch, lambda key, loop: runners.append(loop.__self__))
    return runners


def _eager_loops(monkeypatch: pytest.MonkeyPatch, record: Callable[[Hashable, Callable[[], None]], None]) -> None:
    """Loop tables that show each loop's key and loop to `record`, then run it as it is (no
    capture off CUDA)."""

    class Recording(graphs.LoopGraphs):
        def run(self, key, loop, device, side_streams=()) -> None:
            record(key, loop)
            loop()

    for name in ("CHUNK_LOOPS", "SLAB_LOOPS"):
        monkeypatch.setattr(graphs, name, Recording(name))


def _force_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every plan made from here on says cuda_graphs, as an eager CUDA call's does."""
    from cce_compile.plan.launch import plan_launch

    for module in list(sys.modules.values()):
        if module.__name__.startswith("cce_compile.") and getattr(module, "plan_launch", None) is plan_launch:
            monkeypatch.setattr(module, "plan_launch", lambda *args: replace(plan_launch(*args), cuda_graphs=True))
