"""Every option, and random combinations of them, against a float64 reference on CPU.

The plain-PyTorch path runs here; test_op_interpreter.py runs the same checks through the
Triton kernels."""

from __future__ import annotations

import random

import pytest
import torch

import cce_compile

from .op_cases import FROZEN_MODES, check_against_reference, check_frozen_operands, make_inputs, relative_error

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def random_options(rng: random.Random) -> dict:
    return {
        "reduction": rng.choice(["mean", "sum", "none"]),
        "label_smoothing": rng.choice([0.0, 0.0, 0.1, 0.3]),
        "z_loss": rng.choice([0.0, 0.0, 1e-3]),
        "softcap": rng.choice([None, None, 7.5, 30.0]),
        "shift": rng.choice([False, True]),
        "ignore_index": rng.choice([-100, 3]),
    }


def make_case(seed: int, dtype: torch.dtype, lead=(2, 63), v=257, d=40, kind=None):
    rng = random.Random(seed)
    options = random_options(rng)
    kind = kind or rng.choice(["signed", "peaked", "zipf"])
    e, c, targets = make_inputs(kind, lead, v, d, dtype, seed)
    mask = torch.rand(targets.shape, generator=torch.Generator().manual_seed(seed)) < rng.choice([0.0, 0.2])
    targets = torch.where(mask, options["ignore_index"], targets)
    bias = (torch.randn(v, generator=torch.Generator().manual_seed(seed + 1)) * 0.5).to(dtype) if rng.random() < 0.5 else None
    weight = torch.rand(v, generator=torch.Generator().manual_seed(seed + 2)) + 0.5 if rng.random() < 0.3 else None
    return e, c, targets, options, bias, weight


@pytest.mark.parametrize("seed", range(36))
def test_random_option_combinations(seed: int) -> None:
    e, c, targets, options, bias, weight = make_case(seed, DTYPES[seed % 3])
    check_against_reference(e, c, targets, options, bias=bias, weight=weight)


@pytest.mark.parametrize("kind", ["signed", "peaked", "zipf"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_odd_shape_each_input_kind(kind: str, dtype: torch.dtype) -> None:
    """N=253, V=1031, D=97: nothing a tile multiple."""
    e, c, targets = make_inputs(kind, (253,), 1031, 97, dtype, seed=7)
    check_against_reference(e, c, targets, {})


@pytest.mark.parametrize("fraction", [0.2, 1.0])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_ignored_targets(fraction: float, reduction: str) -> None:
    e, c, targets = make_inputs("zipf", (4, 30), 301, 33, torch.float32, seed=3)
    ignored = torch.rand(targets.shape, generator=torch.Generator().manual_seed(0)) < fraction
    targets = torch.where(ignored, -100, targets)
    check_against_reference(e, c, targets, {"reduction": reduction, "z_loss": 1e-3})


@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=pytest.mark.interpreter)], ids=["cpu", "kernels"])
@pytest.mark.parametrize(("reduction", "z_loss"), [("none", 1e-3), ("sum", 1e-4), ("mean", 1e-3)])
def test_z_loss_at_the_temperature_floor(kernels: bool, reduction: str, z_loss: float) -> None:
    """At temperature 1e-20 lse reaches ~5e20: lse * lse overflows fp32 while z_loss * lse**2
    (z_loss 1e-3: up to 2.6e38, the mean 1.2e38, the sum 5e38 past fp32) fits; the z term is
    formed as (z_loss * lse) * lse, and a mean scales before it sums. check_against_reference
    runs the op with its lse (the recompute's path) and a scalar loss alone (the fused
    forward's)."""
    g = torch.Generator().manual_seed(0)
    e, c, targets = torch.randn(4, 8, generator=g), torch.randn(11, 8, generator=g), torch.randint(0, 11, (4,), generator=g)
    check_against_reference(e, c, targets, {"temperature": 1e-20, "z_loss": z_loss, "reduction": reduction})


def test_all_ignored_gives_zero_loss_and_zero_gradients() -> None:
    e, c, targets = make_inputs("signed", (16,), 50, 8, torch.float32, seed=0)
    e.requires_grad_()
    c.requires_grad_()
    loss = cce_compile.linear_cross_entropy(e, c, torch.full_like(targets, -100), z_loss=1e-2)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(e.grad) == 0 and torch.count_nonzero(c.grad) == 0


def test_single_token_and_leading_batch_dims() -> None:
    for lead in [(1,), (2, 3, 5)]:
        e, c, targets = make_inputs("peaked", lead, 77, 12, torch.float32, seed=11)
        check_against_reference(e, c, targets, {"reduction": "none"})


def test_module_matches_function() -> None:
    e, c, targets = make_inputs("zipf", (3, 20), 90, 16, torch.float32, seed=5)
    weight = torch.rand(90) + 0.1
    module = cce_compile.LinearCrossEntropyLoss(label_smoothing=0.1, weight=weight, shift=True)
    expected = cce_compile.linear_cross_entropy(e, c, targets, label_smoothing=0.1, weight=weight, shift=True)
    torch.testing.assert_close(module(e, c, targets), expected)


def test_shift_does_not_copy_hidden_states() -> None:
    """shift scores position t against target t+1 by moving targets, never e."""
    e, c, targets = make_inputs("signed", (2, 9), 40, 8, torch.float32, seed=2)
    shifted = cce_compile.linear_cross_entropy(e, c, targets, shift=True, reduction="none")
    manual = cce_compile.linear_cross_entropy(e[:, :-1], c, targets[:, 1:], reduction="none")
    torch.testing.assert_close(shifted[:, :-1], manual)
    assert torch.all(shifted[:, -1] == 0)


@pytest.mark.skipif(not hasattr(torch.nn.functional, "linear_cross_entropy"), reason="torch has no F.linear_cross_entropy")
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_torch_linear_cross_entropy(reduction: str) -> None:
    e, c, targets = make_inputs("zipf", (120,), 333, 24, torch.float32, seed=9)
    targets[::7] = -100
    bias = torch.randn(333) * 0.1
    weight = torch.rand(333) + 0.5
    ours = cce_compile.linear_cross_entropy(e, c, targets, bias=bias, weight=weight, reduction=reduction,
                                            label_smoothing=0.05)
    theirs = torch.nn.functional.linear_cross_entropy(e, c, targets, linear_bias=bias, weight=weight,
                                                      reduction=reduction, ignore_index=-100, label_smoothing=0.05)
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-5, atol=1e-6)


def test_out_of_range_target_is_a_clear_error_on_cpu() -> None:
    e, c, targets = make_inputs("signed", (8,), 20, 4, torch.float32, seed=0)
    targets[3] = 20
    with pytest.raises(ValueError, match="targets must be in \\[0, 20\\)"):
        cce_compile.linear_cross_entropy(e, c, targets)


def test_filtered_mode_puts_back_what_it_skips(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an LM-like head whose rows share a mean direction (cce_compile.bench.inputs), the
    tiles filtered mode skips hold part of each row's softmax mass; dropping it outright
    biases dE by that mass times the mean (~5% here). Put back as each skipped tile's row
    sums, the gradients stay within issue 5's 1e-2 of exact mode's and several times closer
    than without (the CPU path, which recomputes the softmax it filters)."""
    from cce_compile.ops import cpu_path

    e, c, targets = make_inputs("zipf", (256,), 32768, 256, torch.float32, seed=2)

    def grads(filter_eps: float | None) -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() for t in (e, c)]
        cce_compile.linear_cross_entropy(*leaves, targets, filter_eps=filter_eps).backward()
        return [t.grad for t in leaves]

    exact, filtered = grads(None), grads(2.0**-12)
    monkeypatch.setattr(cpu_path, "_tile_row_means", lambda x, block_n: torch.zeros_like(x))
    monkeypatch.setattr(cpu_path, "tilt_sample_size", lambda n, v, d: 0)
    dropped = grads(2.0**-12)
    for exact_grad, filtered_grad, dropped_grad in zip(exact, filtered, dropped):
        assert relative_error(filtered_grad, exact_grad) < 1e-2
    assert relative_error(dropped[0], exact[0]) > 3e-2, "the skipped tiles held little: the test shows nothing"
    assert relative_error(dropped[0], exact[0]) > 4 * relative_error(filtered[0], exact[0])


def test_filtered_mode_puts_back_the_skipped_tiles_tilt(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a skipped tile a row's softmax leans to the columns it scores higher, which a
    tile's mean misses (filtering.Tilt): on an LM-like head, dE's error against exact mode is
    most of filtered mode's error without the tilt, and several times smaller with it; dC is
    left as it was (the tilt is dE's)."""
    from cce_compile.bench.inputs import lm_like_inputs
    from cce_compile.ops import cpu_path

    e, c, targets = lm_like_inputs(256, 256, 32768, torch.float32, "cpu", seed=2)

    def grads(filter_eps: float | None) -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() for t in (e, c)]
        cce_compile.linear_cross_entropy(*leaves, targets, filter_eps=filter_eps).backward()
        return [t.grad for t in leaves]

    exact, tilted = grads(None), grads(2.0**-12)
    monkeypatch.setattr(cpu_path, "tilt_sample_size", lambda n, v, d: 0)
    untilted = grads(2.0**-12)
    assert relative_error(untilted[0], exact[0]) > 5e-3, "little mass was skipped: the test shows nothing"
    assert relative_error(tilted[0], exact[0]) < relative_error(untilted[0], exact[0]) / 4
    torch.testing.assert_close(tilted[1], untilted[1], rtol=0, atol=0)


@pytest.mark.usefixtures("block_sparse_always")
def test_filtered_mode_is_close_and_exact_is_default() -> None:
    """filter_eps drops only tiles whose |softmax - onehot| is tiny, so on a peaked softmax
    the gradient stays close; without it every entry contributes."""
    e, c, targets = make_inputs("peaked", (128,), 1024, 32, torch.float32, seed=4)
    ec = [t.clone().requires_grad_() for t in (e, c)]
    cce_compile.linear_cross_entropy(*ec, targets, filter_eps=2.0**-12).backward()
    ref = [t.clone().requires_grad_() for t in (e, c)]
    cce_compile.linear_cross_entropy(*ref, targets).backward()
    assert not torch.equal(ec[1].grad, ref[1].grad), "no tile was filtered: the test shows nothing"
    assert relative_error(ec[0].grad, ref[0].grad) < 1e-2
    assert relative_error(ec[1].grad, ref[1].grad) < 1e-2


def test_filtered_mode_runs_exact_with_class_weighted_smoothing() -> None:
    """Label smoothing's d-logit term, -s_i w_j, is even over a tile's columns only where the
    class weights are; the put-back spread a skipped tile's sum evenly, so a few never-target
    classes of weight 1000 took dC 4.6e-2 off float64 at "auto" (dE 2.4e-2). With both options
    the backward runs exact."""
    from cce_compile.bench.inputs import lm_like_inputs

    e, c, targets = lm_like_inputs(192, 64, 4096, torch.float32, "cpu", seed=1)
    weight = torch.ones(4096)
    heavy = torch.randperm(4096, generator=torch.Generator().manual_seed(0))[:20]
    weight[heavy[~torch.isin(heavy, targets)]] = 1000.0

    def grads(filter_eps) -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() for t in (e, c)]
        cce_compile.linear_cross_entropy(*leaves, targets, weight=weight, label_smoothing=0.1, filter_eps=filter_eps,
                                         reduction="sum").backward()
        return [leaf.grad for leaf in leaves]

    for filtered, exact in zip(grads("auto"), grads(None)):
        assert relative_error(filtered, exact) < 1e-5


@pytest.mark.usefixtures("block_sparse_always")
def test_auto_filter_is_a_quarter_of_the_papers_eps_over_32() -> None:
    """filter_eps="auto" is the dtype's epsilon / 8 (2^-10 for bf16 and fp32): the put-back and
    tilt keep that coarser filter accurate (docs/notes/filtered-put-back.md)."""
    from cce_compile.api import _resolve_filter_eps

    assert _resolve_filter_eps("auto", torch.bfloat16) == 2.0**-10
    assert _resolve_filter_eps("auto", torch.float16) == 2.0**-13
    assert _resolve_filter_eps("auto", torch.float32) == 2.0**-10
    e, c, targets = make_inputs("zipf", (64,), 512, 32, torch.bfloat16, seed=1)

    def grad_e(filter_eps) -> torch.Tensor:
        leaf = e.clone().requires_grad_()
        cce_compile.linear_cross_entropy(leaf, c, targets, filter_eps=filter_eps).backward()
        return leaf.grad

    torch.testing.assert_close(grad_e("auto"), grad_e(2.0**-10), rtol=0, atol=0)


def test_filtered_mode_tilt_covers_a_bias(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a bias that varies inside tiles (here partly along c's rows), the softmax also leans
    to the columns whose bias is higher: the tilt's K (c's covariance with the bias) takes that
    share off dE's error, beyond S alone."""
    from cce_compile.bench.inputs import lm_like_inputs
    from cce_compile.ops import cpu_path, filtering

    e, c, targets = lm_like_inputs(256, 256, 32768, torch.float32, "cpu", seed=2)
    g = torch.Generator().manual_seed(0)
    bias = torch.randn(32768, generator=g) + 0.5 * (c @ torch.randn(256, generator=g))

    def grad_e(filter_eps: float | None) -> torch.Tensor:
        leaf = e.clone().requires_grad_()
        cce_compile.linear_cross_entropy(leaf, c, targets, bias=bias, filter_eps=filter_eps).backward()
        return leaf.grad

    exact, tilted = grad_e(None), grad_e(2.0**-12)
    zero_k = lambda self: torch.cat([self.covariance, 0 * self.bias_covariance[None]])  # noqa: E731
    monkeypatch.setattr(filtering.Tilt, "rows", zero_k)
    without_k = grad_e(2.0**-12)
    monkeypatch.setattr(cpu_path, "tilt_sample_size", lambda n, v, d: 0)
    untilted = grad_e(2.0**-12)
    assert relative_error(tilted, exact) < 0.7 * relative_error(without_k, exact)
    assert relative_error(without_k, exact) < 0.7 * relative_error(untilted, exact)


@pytest.mark.usefixtures("block_sparse_always")
@pytest.mark.parametrize("mode", FROZEN_MODES)
def test_frozen_head_or_hidden_states_skip_that_gradient(mode: str, backward_outputs: list, fused_outputs: list) -> None:
    """LoRA freezes the classifier: its gradient is never computed (the op returns it empty),
    and the other gradients are unchanged bit for bit."""
    e, c, targets = make_inputs("zipf", (3, 41), 389, 24, torch.bfloat16, seed=5)
    targets[:, ::7] = -100
    bias = torch.randn(389).bfloat16()
    check_frozen_operands(e, c, targets, {**FROZEN_MODES[mode], "label_smoothing": 0.1}, bias=bias)
    outputs = fused_outputs if mode == "fused" else backward_outputs
    assert outputs == [(3 * 41 * 24, 389 * 24), (3 * 41 * 24, 0), (0, 389 * 24)]


def check_mean_over_cancelling_weights(memory: str) -> None:
    """A class-weighted mean whose targets' weights sum to 0 is 0, with zero gradients (the
    README's convention; F.cross_entropy gives NaN): where label smoothing's term is not 0,
    where signed weights cancel, and with z-loss, whose own mean over the tokens remains."""
    e, c, targets = make_inputs("zipf", (12,), 40, 16, torch.float32, seed=3)
    targets[:6], targets[6:] = 0, 1
    targets_weigh_nothing = torch.ones(40).index_fill_(0, torch.tensor([0, 1]), 0.0)
    cancelling = torch.ones(40).index_fill_(0, torch.tensor([1]), -1.0)
    for weight, options in ((targets_weigh_nothing, {"label_smoothing": 0.1}), (cancelling, {})):
        leaf_e, leaf_c = e.clone().requires_grad_(), c.clone().requires_grad_()
        loss = cce_compile.linear_cross_entropy(leaf_e, leaf_c, targets, weight=weight, memory=memory, **options)
        loss.backward()
        assert loss.item() == 0.0 and not leaf_e.grad.any() and not leaf_c.grad.any(), (options, loss.item())
    # (a class-weighted mean with z-loss takes the recompute whatever `memory` says)
    check_against_reference(e, c, targets, {"z_loss": 1e-2, "label_smoothing": 0.1}, weight=targets_weigh_nothing)


@pytest.mark.parametrize("memory", ["workspace", "low"])
def test_mean_over_cancelling_weights_is_zero(memory: str) -> None:
    check_mean_over_cancelling_weights(memory)


@pytest.mark.parametrize("memory", ["workspace", "low"])
def test_class_weights_of_any_sign_and_scale(memory: str) -> None:
    """A class-weighted mean divides by the targets' weights as F.cross_entropy does, negative
    or mixed-sign sums included; with z-loss, scaling the weights leaves the loss unchanged
    (the z term is a mean over the tokens, whatever the weights)."""
    e, c, targets = make_inputs("zipf", (40,), 64, 16, torch.float32, seed=5)
    targets[::5] = -100
    weight = torch.rand(64, generator=torch.Generator().manual_seed(6)) + 0.5
    for signed in (-weight, weight * torch.where(torch.arange(64) % 3 == 0, -1.0, 1.0)):
        leaf = e.clone().requires_grad_()
        loss = cce_compile.linear_cross_entropy(leaf, c, targets, weight=signed, memory=memory)
        expected = torch.nn.functional.cross_entropy(e.double() @ c.double().T, targets, signed.double())
        assert relative_error(loss, expected) < 1e-6
        loss.backward()
    losses = [cce_compile.linear_cross_entropy(e, c, targets, weight=weight * scale, z_loss=1e-2, memory=memory)
              for scale in (1.0, 10.0, 0.1)]
    assert relative_error(losses[1], losses[0]) < 1e-6 and relative_error(losses[2], losses[0]) < 1e-6
    check_against_reference(e, c, targets, {"z_loss": 1e-2}, weight=weight)
