"""torch.library and torch.compile integration: opcheck, fullgraph, dynamic N."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch._dynamo.testing
from torch._dynamo.utils import counters

import cce_compile
from cce_compile import ops
from cce_compile.config.keys import n_bucket
from cce_compile.ops.problem import config_for, encode_settings
from cce_compile.plan.policy import active_policy

from .op_cases import make_inputs


def _op_args(n: int, with_extras: bool):
    e, c, targets = make_inputs("zipf", (n,), 97, 24, torch.float32, seed=n)
    targets[::4] = -100
    bias = torch.randn(97) * 0.1 if with_extras else None
    weight = torch.rand(97) + 0.5 if with_extras else None
    return e.requires_grad_(), c.requires_grad_(), targets, bias, weight


@pytest.mark.parametrize("with_extras", [False, True])
def test_opcheck_forward(with_extras: bool) -> None:
    e, c, targets, bias, weight = _op_args(33, with_extras)
    if bias is not None:
        bias.requires_grad_()
    args = (e, c, targets, bias, weight, -100, 0.1 if with_extras else 0.0, 15.0 if with_extras else 0.0, 0.0)
    torch.library.opcheck(ops.linear_cross_entropy_forward, args)


@pytest.mark.parametrize(("need_grad_e", "need_grad_c"), [(True, True), (True, False), (False, True)])
def test_opcheck_backward(need_grad_e: bool, need_grad_c: bool) -> None:
    e, c, targets, bias, _ = _op_args(29, True)
    loss, lse, kept_tiles, tile_lse, order = ops.linear_cross_entropy_forward(
        e, c, targets, bias, None, -100, 0.0, 0.0, 0.0)
    policy = active_policy()
    args = (torch.randn(29), torch.randn(29), e.detach(), c.detach(), targets, bias, None, lse.detach(),
            kept_tiles, tile_lse, order, -100, 0.0, 0.0, 0.0, 1.0, need_grad_e, need_grad_c,
            encode_settings(config_for(e, c, False, policy), policy))
    torch.library.opcheck(ops.linear_cross_entropy_backward, args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_fused_with_a_bias(dtype: torch.dtype) -> None:
    """dbias is a tensor of its own, as the fake's (fp32's was a view past the losses in their block)."""
    e, c, targets, bias, weight = _op_args(31, True)
    e, c, bias = (t.detach().to(dtype).requires_grad_() for t in (e, c, bias))
    args = (e, c, targets, bias, weight, -100, 0.1, 0.0, 1e-4, "mean", True, True)
    torch.library.opcheck(ops.linear_cross_entropy_fused, args)


class RMSNormHead(torch.nn.Module):
    """The end of a decoder: RMSNorm -> classifier + loss, as a training step sees it."""

    def __init__(self, d: int, v: int, memory: str = "workspace") -> None:
        super().__init__()
        self.norm = torch.nn.RMSNorm(d)
        self.classifier = torch.nn.Linear(d, v, bias=False)
        self.memory = memory

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return cce_compile.linear_cross_entropy(self.norm(hidden), self.classifier.weight, targets,
                                                shift=True, z_loss=1e-4, label_smoothing=0.05, memory=self.memory)


@pytest.mark.parametrize("memory", ["workspace", "low"])
def test_fullgraph_training_step_matches_eager(memory: str) -> None:
    torch.manual_seed(0)
    model = RMSNormHead(32, 211, memory)
    hidden = torch.randn(2, 40, 32, requires_grad=True)
    targets = torch.randint(0, 211, (2, 40))
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    loss = compiled(hidden, targets)
    loss.backward()  # AOTAutograd's compiled backward
    compiled_grads = [p.grad.clone() for p in model.parameters()] + [hidden.grad.clone()]
    for p in list(model.parameters()) + [hidden]:
        p.grad = None
    expected = model(hidden, targets)
    expected.backward()
    eager_grads = [p.grad for p in model.parameters()] + [hidden.grad]
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for got, want in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert counter.frame_count == 1


@pytest.mark.parametrize("memory", ["workspace", "low"])
def test_frozen_head_compiles_without_its_gradient(memory: str, backward_outputs: list, fused_outputs: list) -> None:
    """A LoRA-style step (the classifier frozen) under fullgraph: the traced op (the fused
    forward, or the backward) is asked for dE alone, and the step's gradients are eager's."""
    torch.manual_seed(0)
    model = RMSNormHead(32, 211, memory)
    model.classifier.weight.requires_grad_(False)
    hidden = torch.randn(2, 40, 32, requires_grad=True)
    targets = torch.randint(0, 211, (2, 40))
    # The spy sees the op only while AOTAutograd traces the backward: no cached graph may skip that.
    with torch._functorch.config.patch(enable_autograd_cache=False):
        torch.compile(model, fullgraph=True)(hidden, targets).backward()
    compiled_grads = [model.norm.weight.grad.clone(), hidden.grad.clone()]
    outputs = fused_outputs if memory == "workspace" else backward_outputs
    assert outputs and all(grad_c == 0 for _, grad_c in outputs)
    model.norm.weight.grad = hidden.grad = None
    model(hidden, targets).backward()
    assert model.classifier.weight.grad is None
    for got, want in zip(compiled_grads, [model.norm.weight.grad, hidden.grad]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("call", ["workspace", "low", "none", "log_probs"])
def test_tokens_a_mask_selects_compile_fullgraph(call: str) -> None:
    """N data-dependent (a boolean mask's selection, as a boolean-mask logits_to_keep makes): one
    graph with no break, eager's loss and gradients. The traced settings' N bucket and the
    fused backward's size test guarded on it and failed to compile."""
    torch.manual_seed(0)
    hidden, c, targets = torch.randn(2, 24, 32), torch.randn(300, 32), torch.randint(0, 300, (2, 24))
    mask = torch.rand(2, 24) > 0.5
    upstream = torch.linspace(-1, 1, 48).reshape(2, 24)

    def step(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        e, targets = e[mask], targets[mask]
        if call == "log_probs":
            log_probs, entropy = cce_compile.linear_log_probs(e, c, targets, entropy=True)
            return (log_probs * upstream[mask]).sum() + entropy.sum()
        if call == "none":
            return cce_compile.linear_cross_entropy(e, c, targets, reduction="none").square().sum()
        return cce_compile.linear_cross_entropy(e, c, targets, memory=call)

    results = []
    for fn in (torch.compile(step, fullgraph=True), step):
        leaves = hidden.clone().requires_grad_(), c.clone().requires_grad_()
        value = fn(*leaves, targets, mask)
        value.backward()
        results.append((value, *(leaf.grad for leaf in leaves)))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_no_graph_breaks() -> None:
    model = RMSNormHead(16, 50)
    hidden = torch.randn(3, 8, 16)
    targets = torch.randint(0, 50, (3, 8))
    explanation = torch._dynamo.explain(model)(hidden, targets)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.parametrize("memory", ["workspace", "low"])
def test_dynamic_n_does_not_recompile_within_a_bucket(memory: str) -> None:
    torch._dynamo.reset()
    model = RMSNormHead(16, 64, memory)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    for n in (70, 90, 100, 127):  # one power-of-two bucket (65..128) of N = 1 x n
        hidden = torch.randn(1, n, 16, requires_grad=True)
        torch._dynamo.mark_dynamic(hidden, 1)
        targets = torch.randint(0, 64, (1, n))
        torch._dynamo.mark_dynamic(targets, 1)
        compiled(hidden, targets).backward()
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames for one bucket"
    if memory == "low":  # a traced config: the next bucket compiles once more
        hidden, targets = torch.randn(1, 200, 16, requires_grad=True), torch.randint(0, 64, (1, 200))
        torch._dynamo.mark_dynamic(hidden, 1)
        torch._dynamo.mark_dynamic(targets, 1)
        compiled(hidden, targets).backward()
        assert counter.frame_count == 2, f"{counter.frame_count} frames for two buckets"


@pytest.fixture
def traced_buckets(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The N bucket of each config a trace resolves into its settings (problem._settings_for_key)."""
    from cce_compile.ops import problem

    buckets: list[int] = []
    settings_for_key = problem._settings_for_key

    @torch.compiler.assume_constant_result
    def spy(on_cuda: bool, v: int, d: int, dtype: str, bucket: int, filtered: bool, gpu: int | None) -> str:
        buckets.append(bucket)
        return settings_for_key(on_cuda, v, d, dtype, bucket, filtered, gpu)

    monkeypatch.setattr(problem, "_settings_for_key", spy)
    return buckets


def _recompute_step(reduction: str, memory: str):
    """A loss on the recompute path (memory="low", or reduction="none" with uneven upstream gradients)."""
    def step(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        out = cce_compile.linear_cross_entropy(e, c, targets, reduction=reduction, memory=memory)
        return out.square().sum() if reduction == "none" else out
    return step


def _matches_eager(compiled, step, e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor, dim: int,
                   **range_: int) -> None:
    """One compiled call, e's and targets' dimension `dim` marked dynamic (with `range_`, min
    and max), against eager's loss and gradients."""
    results = []
    for fn in (compiled, step):
        leaves = e.clone().requires_grad_(), c.clone().requires_grad_()
        if fn is compiled:
            torch._dynamo.mark_dynamic(leaves[0], dim, **range_)
            torch._dynamo.mark_dynamic(targets, dim, **range_)
        value = fn(*leaves, targets)
        value.backward()
        results.append((value, *(leaf.grad for leaf in leaves)))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("reduction", "memory", "largest"),
                         [("mean", "low", 8192), ("none", "workspace", 8192), ("mean", "low", sys.maxsize)])
def test_mark_dynamic_with_a_declared_range_compiles_one_graph_for_the_range(
        reduction: str, memory: str, largest: int, traced_buckets: list[int]) -> None:
    """mark_dynamic(e, 0, min=2, max=8192) refuses any guard that narrows the range: the call
    keys its config on the bucket of the declared max, without a guard, and one graph serves
    every N of the range with eager's loss and gradients. The bucket's guard (65 <= N <= 128 at
    N = 100) raised ConstraintViolationError; so did a max past 2^48 (a max near sys.maxsize
    stands for none, where a min alone is refused), taken for unbounded."""
    torch._dynamo.reset()
    c = torch.randn(97, 16)
    step = _recompute_step(reduction, memory)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    for n in (100, 300, 1000, 5000):
        e, targets = torch.randn(n, 16), torch.randint(0, 97, (n,))
        _matches_eager(compiled, step, e, c, targets, 0, min=2, max=largest)
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames for one declared range"
    assert traced_buckets == [n_bucket(largest)]


@pytest.mark.parametrize(("reduction", "memory", "backend"), [
    ("mean", "low", "aot_eager"), ("none", "workspace", "aot_eager"), ("mean", "low", "inductor"),
])
def test_mark_dynamic_batch_of_two_compiles_without_pinning_the_batch(
        reduction: str, memory: str, backend: str, traced_buckets: list[int]) -> None:
    """A marked batch dimension B of (B, T, D) traced at B = 2: N = 2T is alone in its bucket
    (T, 2T], whose guard would pin B to 2 ("specialized it to be a constant"); the call guards
    N <= 4T instead, one graph for B = 2 to 4, and B = 5 and 8 compile the next bucket's, with
    eager's loss and gradients."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    c = torch.randn(97, 16)
    step = _recompute_step(reduction, memory)
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    frames = []
    for batch in (2, 3, 5, 8):
        e, targets = torch.randn(batch, 64, 16), torch.randint(0, 97, (batch, 64))
        _matches_eager(compiled, step, e, c, targets, 0)
        frames.append(counter.frame_count)
    assert frames == [1, 1, 2, 2], f"frames after each batch {frames}"
    assert traced_buckets == [256, 512]


@pytest.mark.parametrize("call", ["workspace", "low", "log_probs"])
def test_shift_under_a_declared_range_from_two_compiles_one_graph(call: str) -> None:
    """shift=True on a batch of one, its sequence marked dynamic from 2 (mark_dynamic(e, 1,
    min=2, max=8192)): one graph for every length, with eager's loss and gradients. Slicing
    the targets before padding them made a tensor of T - 1 elements whose metadata guarded
    T >= 3, and the range refused it (ConstraintViolationError)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    c = torch.randn(97, 16)

    def step(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if call == "log_probs":
            log_probs, entropy = cce_compile.linear_log_probs(e, c, targets, entropy=True, shift=True)
            return log_probs.sum() + entropy.sum()
        return cce_compile.linear_cross_entropy(e, c, targets, shift=True, memory=call)

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    for t in (40, 100):
        e, targets = torch.randn(1, t, 16), torch.randint(0, 97, (1, t))
        _matches_eager(compiled, step, e, c, targets, 1, min=2, max=8192)
    assert counter.frame_count == 1


@pytest.mark.interpreter
def test_a_graph_serving_batches_past_its_bucket_plans_each_for_its_own_n(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton path's backward plan, the memory it takes, is made as the opaque op runs,
    for N itself: the graph traced at batch 2 of 16 (config bucket 64, N <= 64) plans batch 2's
    N = 32 for 32 tokens and batch 4's for 64, not both for the config's bucket."""
    from cce_compile.plan import launch

    planned: list[int] = []
    plan_backward = launch.plan_backward

    def spy(n, *args, **kwargs):
        planned.append(n)
        return plan_backward(n, *args, **kwargs)

    monkeypatch.setattr(launch, "plan_backward", spy)
    torch._dynamo.reset()
    c = torch.randn(97, 16)
    step = _recompute_step("mean", "low")
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    for batch in (2, 4):
        e, targets = torch.randn(batch, 16, 16), torch.randint(0, 97, (batch, 16))
        _matches_eager(compiled, step, e, c, targets, 0)
    assert counter.frame_count == 1
    assert all(type(n) is int for n in planned) and sorted(set(planned)) == [32, 64], planned


@pytest.mark.parametrize("memory", ["workspace", "low"])
def test_dynamic_true_with_inductor_does_not_recompile_within_a_bucket(memory: str) -> None:
    """torch.compile(dynamic=True) through Inductor: the frames the first call compiles (the
    step's, and the restart that makes z_loss's default a graph input) serve every N of the
    bucket, with eager's gradients."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = RMSNormHead(16, 64, memory)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    frames = []
    for n in (70, 90, 127):
        hidden = torch.randn(1, n, 16, requires_grad=True)
        targets = torch.randint(0, 64, (1, n))
        compiled(hidden, targets).backward()
        got = [t.grad.clone() for t in (hidden, *model.parameters())]
        for t in (hidden, *model.parameters()):
            t.grad = None
        model(hidden, targets).backward()
        for g, t in zip(got, (hidden, *model.parameters())):
            torch.testing.assert_close(g, t.grad, rtol=1e-4, atol=1e-6)
            t.grad = None
        frames.append(counter.frame_count)
    assert frames[0] == frames[-1], f"recompiled within the bucket: frames after each call {frames}"


def test_max_autotune_matches_eager(fused_outputs: list) -> None:
    """mode="max-autotune": Inductor may benchmark its own kernels around the op; the step
    goes through the op's fused forward and its gradients are eager's."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = RMSNormHead(32, 211)
    hidden = torch.randn(2, 40, 32, requires_grad=True)
    targets = torch.randint(0, 211, (2, 40))
    compiled = torch.compile(model, fullgraph=True, mode="max-autotune")
    compiled(hidden, targets).backward()
    assert fused_outputs, "the compiled step did not go through the op's fused forward"
    got = [p.grad.clone() for p in model.parameters()] + [hidden.grad.clone()]
    for p in list(model.parameters()) + [hidden]:
        p.grad = None
    model(hidden, targets).backward()
    for g, want in zip(got, [p.grad for p in model.parameters()] + [hidden.grad]):
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("memory", ["workspace", "low"])
def test_a_whole_compiled_training_step_matches_eager(memory: str) -> None:
    """torch.compile of a whole step (forward, backward() under compiled autograd, AdamW's
    step): compiled autograd captures the backward, three steps land on eager's parameters,
    and the later steps compile nothing new."""

    def train(compile_step: bool) -> tuple[list[torch.Tensor], list[int]]:
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = RMSNormHead(32, 211, memory)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        hidden, targets = torch.randn(2, 40, 32), torch.randint(0, 211, (2, 40))

        def step() -> torch.Tensor:
            loss = model(hidden, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss

        counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
        frames = []
        with torch._dynamo.config.patch(compiled_autograd=compile_step):  # read when torch.compile wraps
            run = torch.compile(step, backend=counter) if compile_step else step
            for _ in range(3):
                run()
                frames.append(counter.frame_count)
        return [p.detach().clone() for p in model.parameters()], frames

    (compiled, frames), captures = train(True), counters["compiled_autograd"]["captures"]
    eager, _ = train(False)
    assert captures >= 1, "compiled autograd did not capture the backward"
    assert frames[0] > 0 and frames[1] == frames[2] == frames[0], f"frames after each step: {frames}"
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_compiled_autograd_traces_an_eager_fused_losss_backward_whole() -> None:
    """Compiled autograd over a loss computed eagerly (a model compiled per block, the loss
    outside): Dynamo traces the fused loss's backward on the real gradients its forward left,
    fullgraph, one graph for every step, with eager's gradients. is_fake (a function Dynamo
    skips) and the retain_graph query (a pybind builtin) broke that graph in two places."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    c = torch.randn(97, 16)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiler = torch.compile(backend=counter, fullgraph=True)
    for step in range(3):
        e, targets = torch.randn(40, 16), torch.randint(0, 97, (40,))
        grads = []
        for compiled in (True, False):
            leaves = e.clone().requires_grad_(), c.clone().requires_grad_()
            loss = cce_compile.linear_cross_entropy(*leaves, targets) * (step + 1)
            if compiled:
                with torch._dynamo.compiled_autograd._enable(compiler):
                    loss.backward()
            else:
                loss.backward()
            grads.append([leaf.grad for leaf in leaves])
        for got, want in zip(*grads):
            torch.testing.assert_close(got, want)
    assert counter.frame_count == 1


@pytest.mark.interpreter
def test_compiled_graph_runs_the_interpreted_kernels() -> None:
    """Inductor calls the op, opaque, and the real Triton kernels run on CPU."""
    e, c, targets, _, _ = _op_args(45, False)

    def loss_fn(e, c, targets):
        return cce_compile.linear_cross_entropy(e, c, targets, label_smoothing=0.1)

    compiled = torch.compile(loss_fn, fullgraph=True)
    loss = compiled(e, c, targets)
    loss.backward()
    ref_e, ref_c = (t.detach().clone().requires_grad_() for t in (e, c))
    expected = loss_fn(ref_e, ref_c, targets)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(e.grad, ref_e.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.interpreter
def test_filtered_mode_compiles_with_its_tile_statistics() -> None:
    """Filtered mode under torch.compile(fullgraph=True), the op opaque: the forward's
    kept tiles (int8) and fp16 tile log-sum-exps propagate as fake tensors, are saved for the
    backward and reach it, and the compiled step gives eager's loss and gradients."""
    e, c, targets = make_inputs("zipf", (96,), 512, 32, torch.bfloat16, seed=1)

    def loss_fn(e, c, targets):
        return cce_compile.linear_cross_entropy(e, c, targets, filter_eps=2.0**-12)

    compiled_leaves = [t.clone().requires_grad_() for t in (e, c)]
    loss = torch.compile(loss_fn, fullgraph=True)(*compiled_leaves, targets)
    loss.backward()
    eager_leaves = [t.clone().requires_grad_() for t in (e, c)]
    expected = loss_fn(*eager_leaves, targets)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for compiled_leaf, eager_leaf in zip(compiled_leaves, eager_leaves):
        torch.testing.assert_close(compiled_leaf.grad, eager_leaf.grad)


def inductor_code_of_a_step(v: int, memory: str) -> str:
    """Inductor's code for one compiled forward + backward of the op on the CPU path."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    e, c, targets = make_inputs("zipf", (64,), v, 32, torch.float32, seed=v)
    e.requires_grad_()
    c.requires_grad_()
    compiled = torch.compile(lambda e, c, t: cce_compile.linear_cross_entropy(e, c, t, memory=memory), fullgraph=True)

    def step() -> None:
        compiled(e, c, targets).backward()

    with torch._functorch.config.patch(enable_autograd_cache=False):
        _, code = run_and_get_code(step)
    return "\n".join(code)


@pytest.mark.parametrize("memory", ["workspace", "low"])
def test_compiled_graph_does_not_grow_with_the_slab_count(memory: str) -> None:
    """Inductor sees the op as opaque ops (the fused forward, or the forward and the backward):
    4 slabs of the CPU path's vocabulary or 64, the generated code is the same size and calls
    each op once."""
    slab_v = config_for(torch.empty(64, 32), torch.empty(65536, 32), False, active_policy()).slab_v
    assert 65536 // slab_v >= 32, "the large head must take many slabs for the test to show anything"
    small, large = inductor_code_of_a_step(4 * slab_v, memory), inductor_code_of_a_step(65536, memory)
    calls = {"workspace": {"fused": 1, "forward": 0, "backward": 0}, "low": {"fused": 0, "forward": 1, "backward": 1}}
    for code in (small, large):
        for op, count in calls[memory].items():
            assert code.count(f"cce.linear_cross_entropy_{op}.default(") == count, op
    assert abs(len(large.splitlines()) - len(small.splitlines())) <= 4


_RETAIN_GRAPH_SCRIPT = """
import sys, torch, cce_compile
torch.manual_seed(0)
e, c, t = torch.randn(37, 20), torch.randn(150, 20), torch.randint(0, 150, (37,))
compiled = torch.compile(lambda e, c, t: cce_compile.linear_cross_entropy(e, c, t), fullgraph=True)
ee, cc = e.clone().requires_grad_(), c.clone().requires_grad_()
loss = compiled(ee, cc, t)
if sys.argv[1] == "train":
    loss.backward()
    sys.exit()
try:
    (3 * loss).backward(retain_graph=True)
    (0.5 * loss).backward()
except RuntimeError as error:
    print("refused:", str(error)[:60])
    sys.exit()
reference = e.clone().requires_grad_()
(3.5 * cce_compile.linear_cross_entropy(reference, c, t)).backward()
print("ratio", (ee.grad / reference.grad)[reference.grad.abs() > 1e-4].mean().item())
"""


def test_a_cached_compiled_backward_with_retain_graph_is_right_or_refused(tmp_path: Path) -> None:
    """A second process reuses the first's Inductor cache, then backpropagates twice through
    a retained graph: the gradients are eager's or PyTorch refuses (its donated-buffer check),
    never silently wrong. An unconditional autocast context in the traced graph made
    AOTAutograd skip its own cache while Inductor's handed back a backward that overwrote
    its saved gradients (4.5 g for 3.5 g: ops/precision.py)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    env.pop("TRITON_INTERPRET", None)
    runs = [subprocess.run([sys.executable, "-c", _RETAIN_GRAPH_SCRIPT, phase], env=env, capture_output=True,
                           text=True, timeout=600) for phase in ("train", "retain")]
    assert all(run.returncode == 0 for run in runs), runs[-1].stderr[-2000:]
    answer = runs[1].stdout.strip()
    assert answer.startswith("refused:") or abs(float(answer.split()[-1]) - 1.0) < 1e-5, answer


_TILES_SCRIPT = """
import sys, torch, cce_compile
from cce_compile.config.kernel_config import KernelConfig, TileConfig
torch.manual_seed(0)
e, c, t = torch.randn(96, 32) * 3, torch.randn(1024, 32), torch.randint(0, 1024, (96,))
tile = TileConfig(32, int(sys.argv[1]), 16, 4, 4, 1)
with cce_compile.override_config(KernelConfig(tile, tile, tile, tile, slab_v=256, vocab_splits=2)):
    compiled = torch.compile(lambda e, c, t: cce_compile.linear_cross_entropy(e, c, t, filter_eps=2.0**-10),
                             fullgraph=True)
    ee = e.clone().requires_grad_()
    compiled(ee, c, t).backward()
print("ok", ee.grad.norm().item())
"""


@pytest.fixture(scope="module")
def inductor_cache_of_a_first_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A process that compiled filtered mode with 32-wide tiles, leaving torch.compile's
    on-disk caches behind: the environment of the runs after it."""
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path_factory.mktemp("inductor"))}
    first = _run_tiles(env, 32)
    assert first.returncode == 0, first.stderr[-2000:]
    return env


def _run_tiles(env: dict[str, str], block_n: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _TILES_SCRIPT, str(block_n)], env=env, capture_output=True,
                          text=True, timeout=600)


def test_a_later_run_that_resolves_other_tiles_compiles_for_them(
        inductor_cache_of_a_first_run: dict[str, str]) -> None:
    """The op's settings (config and Policy) are a constant of the traced graph, so
    torch.compile's on-disk caches key on them: a later process that resolves other tiles
    (new tuned configs, an override) compiles for them. When the op resolved them inside its
    fake function instead, the cache handed back the first run's graph and filtered mode
    failed Inductor's size check on the forward's tile statistics."""
    run = _run_tiles(inductor_cache_of_a_first_run, 64)
    assert run.returncode == 0, run.stderr[-2000:]


_FUSED_GRAD_SCRIPT = """
import torch, cce_compile
assert cce_compile.__file__.startswith(__import__("os").getcwd()), cce_compile.__file__
torch.manual_seed(0)
e, c, t = torch.randn(64, 16) * 3, torch.randn(300, 16), torch.randint(0, 300, (64,))
ee = e.clone().requires_grad_()
torch.compile(lambda e, c, t: cce_compile.linear_cross_entropy(e, c, t), fullgraph=True)(ee, c, t).backward()
print(ee.grad.norm().item())
"""


def test_a_compiled_graph_of_another_version_of_the_package_is_not_reused(tmp_path: Path) -> None:
    """torch.compile's on-disk caches key on the traced graph, not on the Python behind the
    ops' autograd; the settings every traced call carries hold the package's source version.
    A copy of the package compiles the fused loss, then its backward's code changes (the
    gradients doubled) and a new process sharing the caches must run the new backward: the
    graph the first process traced holds the old one."""
    import shutil

    shutil.copytree(Path(cce_compile.__file__).parent, tmp_path / "cce_compile",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "PYTHONPATH": str(tmp_path)}

    def grad_norm() -> float:
        run = subprocess.run([sys.executable, "-c", _FUSED_GRAD_SCRIPT], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        return float(run.stdout.split()[-1])

    before = grad_norm()
    library = tmp_path / "cce_compile" / "ops" / "library.py"
    traced_product = "return gradient * grad_loss  #"
    assert traced_product in library.read_text()
    library.write_text(library.read_text().replace(traced_product, "return gradient * grad_loss * 2  #"))
    assert grad_norm() == pytest.approx(2 * before, rel=1e-6)


@pytest.mark.interpreter
def test_a_compiled_call_keeps_the_policy_it_was_traced_with_until_a_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside one process a compiled call runs with the Policy it was traced under (its
    backward's plan here), whatever is active later, until torch._dynamo.reset() retraces:
    what an A/B of a Policy under torch.compile must do between arms (benchmarks/ab_switch.py)."""
    import dataclasses

    from cce_compile.ops import backward_filtered
    from cce_compile.plan.backward import BackwardPlan
    from cce_compile.plan.policy import override_policy

    slots = []
    filtered_steps = backward_filtered.filtered_steps
    monkeypatch.setattr(backward_filtered, "filtered_steps", lambda mask, capacity, read_back: (
        slots.append(capacity), filtered_steps(mask, capacity, read_back))[1])
    e, c, targets = make_inputs("zipf", (96,), 1024, 32, torch.float32, seed=3)
    compiled = torch.compile(lambda e, c, t: cce_compile.linear_cross_entropy(e, c, t, filter_eps=2.0**-10),
                             fullgraph=True)

    def step(capacity: int) -> int:
        policy = dataclasses.replace(active_policy(), triton_on_cpu=True, filtered_read_back=False, dense_fraction=1.0,
                                     backward_plan=BackwardPlan(1, 256, False, slots=capacity))
        with override_policy(policy):
            compiled((e * 3).requires_grad_(), c, targets).backward()
        return slots[-1]

    torch._dynamo.reset()
    assert step(64) == 64
    assert step(128) == 64
    torch._dynamo.reset()
    assert step(128) == 128


@pytest.mark.parametrize("memory", ["workspace", "low"])
def test_cpp_wrapper_compiles_the_ops_string_arguments(memory: str) -> None:
    """Inductor's C++ wrapper writes the ops' string arguments (the traced settings, the
    backward's) into its C++ source unescaped: they hold no quote or newline."""
    e, c, targets = make_inputs("zipf", (37,), 150, 20, torch.float32, seed=8)
    torch._dynamo.reset()
    compiled = torch.compile(lambda e, c, t: cce_compile.linear_cross_entropy(e, c, t, memory=memory), fullgraph=True,
                             options={"cpp_wrapper": True})
    ee, reference = e.clone().requires_grad_(), e.clone().requires_grad_()
    compiled(ee, c, targets).backward()
    cce_compile.linear_cross_entropy(reference, c, targets, memory=memory).backward()
    torch.testing.assert_close(ee.grad, reference.grad)


def test_calls_without_traced_settings_compile_no_graph_per_power_of_two() -> None:
    """The fused loss (the default) and no-grad calls (filtered ones too: the filter is the
    backward's) depend on no traced config, so a dynamic N across five powers of two compiles
    as before the settings existed (two graphs: N = 5, then every N), not one per power of two."""
    c = torch.randn(300, 16, requires_grad=True)
    calls = {
        "fused": (lambda e, t: cce_compile.linear_cross_entropy(e, c, t), True),
        "no-grad log-probs": (lambda e, t: cce_compile.linear_log_probs(e, c, t, entropy=True), False),
        "no-grad filtered loss": (lambda e, t: cce_compile.linear_cross_entropy(e, c, t, filter_eps="auto"), False),
    }
    for name, (fn, grad) in calls.items():
        torch._dynamo.reset()
        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
        for n in (5, 9, 17, 33, 65):
            e, t = torch.randn(n, 16, requires_grad=grad), torch.randint(0, 300, (n,))
            with torch.set_grad_enabled(grad):
                out = compiled(e, t)
            if grad:
                out.backward()
        assert counter.frame_count <= 2, (name, counter.frame_count)


@pytest.mark.parametrize("call", ["loss", "log_probs"])
def test_a_filter_eps_that_changes_between_calls_compiles(call: str) -> None:
    """filter_eps as Dynamo sees it after a second value (automatic dynamic: a SymFloat), or
    from the first call under dynamic=True: whether the call is filtered picks its config's
    key, a constant of the trace. `eps > 0` reached the traced settings as a SymBool, which
    their assume_constant_result function cannot take, and fullgraph failed ("assume_constant_result
    argument conversion failed"): two LinearCrossEntropyLoss(filter_eps=...) modules of one process did."""
    torch.manual_seed(0)
    e, c, targets = torch.randn(12, 8) * 2, torch.randn(50, 8), torch.randint(0, 50, (12,))

    def step(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor, eps: float) -> torch.Tensor:
        if call == "log_probs":
            log_probs, entropy = cce_compile.linear_log_probs(e, c, targets, entropy=True, filter_eps=eps)
            return log_probs.sum() + entropy.sum()
        return cce_compile.linear_cross_entropy(e, c, targets, filter_eps=eps)

    for dynamic in (None, True):
        torch._dynamo.reset()
        compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=dynamic)
        for eps in (1e-3, 2e-3):
            results = []
            for fn in (compiled, step):
                leaf = e.clone().requires_grad_()
                value = fn(leaf, c, targets, eps)
                value.backward()
                results.append((value, leaf.grad))
            for got, want in zip(*results):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("option", ["label_smoothing", "softcap"])
def test_a_bad_option_dynamo_made_symbolic_keeps_its_message_under_fullgraph(option: str) -> None:
    """Under fullgraph a bad argument surfaces as Dynamo's Unsupported, the package's message in
    its developer context; formatting a value Dynamo made symbolic (dynamic=True) into that
    message failed the trace with a type error instead, and the message was lost."""
    torch.manual_seed(0)
    e, c, targets = torch.randn(12, 8), torch.randn(50, 8), torch.randint(0, 50, (12,))
    bad = {"label_smoothing": 2.0, "softcap": 1e-40}[option]
    torch._dynamo.reset()
    compiled = torch.compile(lambda e, c, t, x: cce_compile.linear_cross_entropy(e, c, t, **{option: x}),
                             backend="aot_eager", fullgraph=True, dynamic=True)
    compiled(e, c, targets, 0.5)
    with pytest.raises(Exception, match=f"{option} (/ temperature )?must be"):
        compiled(e, c, targets, bad)



@pytest.mark.parametrize("call", ["loss", "log_probs"])
def test_a_compiled_vmap_differentiates_its_batched_operands(call: str) -> None:
    """torch.compile of a vmap: Dynamo traces the transform, so the eager check of the
    interpreters does not run, and a batched operand reports requires_grad False. The loss (e
    batched, c shared) once took the fused forward, which computed no dE for the batched e
    (autograd: "invalid gradient ... got [0]"), and linear_log_probs (e and c batched) ran a
    forward without the statistics its entropy's backward reads."""
    e, c, t = make_inputs("zipf", (2, 20), 30, 16, torch.float32, seed=4)
    t[:, ::4] = -100
    heads = torch.stack([c, 2 * c]) if call == "log_probs" else c

    def per_item(x: torch.Tensor, head: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if call == "loss":
            return cce_compile.linear_cross_entropy(x, head, y)
        log_probs, entropy = cce_compile.linear_log_probs(x, head, y, entropy=True)
        return (log_probs + 0.5 * entropy).sum()

    in_dims = (0, 0 if call == "log_probs" else None, 0)
    compiled = [e.clone().requires_grad_(), heads.clone().requires_grad_()]
    eager = [tensor.detach().clone().requires_grad_() for tensor in compiled]
    batched = torch.func.vmap(per_item, in_dims)
    for leaves, run in ((compiled, torch.compile(batched, fullgraph=True, backend="aot_eager")), (eager, batched)):
        (run(*leaves, t) * torch.tensor([1.0, 3.0])).sum().backward()
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got.grad, want.grad)


@pytest.mark.parametrize(("memory", "reduction"), [("low", "mean"), ("low", "sum"), ("workspace", "none")])
def test_a_float64_default_dtype_keeps_the_loss_float32_eager_and_compiled(memory: str, reduction: str) -> None:
    """Under torch.set_default_dtype(torch.float64) the loss is float32, as the op's fake
    function says: a factor built from two Python floats came out float64, the per-token loss
    with it, and a compiled graph that read those float64 losses as float32 gave a mean 3.8 off
    (a sum 73) without an error."""
    torch._dynamo.reset()
    e, c, targets = make_inputs("zipf", (20,), 96, 16, torch.float32, seed=3)
    targets[3] = -100
    expected = torch.nn.functional.cross_entropy(e.double() @ c.double().T, targets, reduction=reduction)

    def loss_of(e, c, targets):
        return cce_compile.linear_cross_entropy(e, c, targets, memory=memory, reduction=reduction)

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        for fn in (loss_of, torch.compile(loss_of, fullgraph=True)):
            loss = fn(e.clone().requires_grad_(), c, targets)
            assert loss.dtype == torch.float32
            torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_default_dtype(previous)
        torch._dynamo.reset()


def _scalar_of_e(call: str) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """(e, a scalar function of e): the loss in memory mode `call`, or the summed log-probs."""
    e, c, t = make_inputs("zipf", (6,), 30, 8, torch.float32, seed=5)

    def loss(x: torch.Tensor) -> torch.Tensor:
        if call == "log_probs":
            return cce_compile.linear_log_probs(x, c, t).sum()
        return cce_compile.linear_cross_entropy(x, c, t, memory=call)

    return e, loss


@pytest.mark.parametrize("transform", ["jvp", "jacfwd"])
@pytest.mark.parametrize("call", ["workspace", "low", "log_probs"])
def test_a_compiled_jvp_is_refused_not_given_a_zero_tangent(transform: str, call: str) -> None:
    """torch.compile of a jvp (jacfwd: a vmap of jvps): Dynamo traces the transform, so the
    eager check of the interpreters does not run, and the custom ops gave the tangent 0 without
    an error. Dynamo traces the dual level and the operands' tangents, so the refusal is made
    there: as Dynamo's Unsupported under fullgraph, the package's message in it, and without
    fullgraph the eager call's error."""
    e, loss = _scalar_of_e(call)

    def forward_mode(x: torch.Tensor) -> torch.Tensor:
        if transform == "jvp":
            return torch.func.jvp(loss, (x,), (torch.ones_like(x),))[1]
        return torch.func.jacfwd(loss)(x)

    for fullgraph in (True, False):
        torch._dynamo.reset()
        with pytest.raises(Exception, match="forward-mode AD|torch.func's jvp"):
            torch.compile(forward_mode, backend="aot_eager", fullgraph=fullgraph)(e)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: loss(x), backend="aot_eager", fullgraph=True)
    with torch.autograd.forward_ad.dual_level():  # plain tensors inside a dual level are not refused
        torch.testing.assert_close(compiled(e), loss(e))


@pytest.mark.interpreter
@pytest.mark.parametrize("call", ["loss", "log_probs"])
def test_filtered_mode_on_the_kernels_compiles_a_declared_range_whose_row_blocks_may_be_one(call: str) -> None:
    """On the Triton path the forward returns its kept tiles, whose row blocks (N / block_m) are
    1 at a declared range's small N: recording a 2-D output, torch.compile guarded that count != 1,
    which mark_dynamic(min=2, max=...) refused (ConstraintViolationError), so filtered mode could
    not compile the range the docs recommend. The ops pass the kept tiles flat."""
    torch._dynamo.reset()

    def step(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if call == "loss":
            return cce_compile.linear_cross_entropy(e, c, targets, memory="low", filter_eps="auto")
        log_probs, entropy = cce_compile.linear_log_probs(e, c, targets, entropy=True, filter_eps="auto")
        return (log_probs + 0.3 * entropy).sum()

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    for n in (40, 150):
        e, c, targets = make_inputs("zipf", (n,), 160, 32, torch.float32, seed=n)
        targets[::7] = -100
        _matches_eager(compiled, step, e, c, targets, 0, min=2, max=512)
    assert counter.frame_count == 1
