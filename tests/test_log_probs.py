"""linear_log_probs (per-token log-probs and entropies for RL) and the temperature option,
against float64 on materialized logits: values and gradients under random upstream gradients,
on the plain-PyTorch path and the interpreted kernels; compile, no_grad, bad input."""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import re
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo.testing

import cce_compile
from cce_compile import ops
from cce_compile.api import shift_targets
from cce_compile.bench.inputs import lm_like_inputs
from cce_compile.ops import forward as forward_ops
from cce_compile.ops import log_probs as log_probs_ops
from cce_compile.ops.problem import config_for, encode_settings
from cce_compile.plan.policy import active_policy

from .op_cases import SMALL_TILES, TOLERANCE, make_inputs, on_kernels, relative_error, with_row_stride
from .reference import reference_log_probs, reference_loss

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
OPTIONS = [
    {},
    {"temperature": 0.7},
    {"temperature": 1.3, "softcap": 4.0},
    {"softcap": 2.5, "bias": True},
    {"temperature": 0.5, "bias": True, "shift": True},
    {"ignore_index": 5, "temperature": 2.0},
]


def _case(seed: int, dtype: torch.dtype, options: dict, lead: tuple[int, ...] = (3, 29), v: int = 157, d: int = 40):
    e, c, tokens = make_inputs("zipf", lead, v, d, dtype, seed)
    g = torch.Generator().manual_seed(seed)
    tokens.view(-1)[:: 7] = options.get("ignore_index", -100)
    options = dict(options)
    bias = (torch.randn(v, generator=g) * 0.5).to(dtype) if options.pop("bias", False) else None
    if options.pop("ruled_out", False):  # a -inf bias rules tokens out, as a sampler's mask does
        bias[::5] = float("-inf")
        flat = tokens.view(-1)
        flat[(flat >= 0) & (flat % 5 == 0)] = 1
    return e, c, tokens, bias, options


def check_log_probs(e, c, tokens, bias, options: dict, entropy: bool = True, drive: str = "both") -> None:
    """Values and gradients (upstream: random for the outputs `drive` names) against float64, a
    temperature held to the same bound as none (the kernels apply it to their fp32 logits)."""
    tol = TOLERANCE[e.dtype]
    leaves = [t.detach().clone().requires_grad_() for t in (e, c) + ((bias,) if bias is not None else ())]
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    g = torch.Generator().manual_seed(7)
    up_lp = torch.randn(tokens.shape, generator=g, dtype=torch.float64)
    up_h = torch.randn(tokens.shape, generator=g, dtype=torch.float64)
    results = []
    for (ee, cc, *bb), fn in ((leaves, cce_compile.linear_log_probs), (ref_leaves, reference_log_probs)):
        out = fn(ee, cc, tokens, bias=bb[0] if bb else None, entropy=entropy, **options)
        log_probs, entropies = out if entropy else (out, None)
        objective = 0.0
        if drive in ("both", "log_probs"):
            objective = objective + (log_probs.double() * up_lp).sum()
        if drive in ("both", "entropy"):
            objective = objective + (entropies.double() * up_h).sum()
        objective.backward()
        results.append((log_probs, entropies))
    (log_probs, entropies), (ref_lp, ref_h) = results
    assert log_probs.dtype == torch.float32 and log_probs.shape == tokens.shape
    assert relative_error(log_probs, ref_lp) <= tol, relative_error(log_probs, ref_lp)
    ignore_index = options.get("ignore_index", -100)
    scored = shift_targets(tokens, ignore_index) if options.get("shift") else tokens
    ignored = scored == ignore_index
    assert bool(ignored.any()) and torch.all(log_probs[ignored] == 0.0)
    if entropy:
        assert entropies.dtype == torch.float32 and torch.all(entropies[ignored] == 0.0)
        assert relative_error(entropies, ref_h) <= tol, relative_error(entropies, ref_h)
    for name, leaf, ref in zip(("e", "c", "bias"), leaves, ref_leaves):
        assert leaf.grad is not None and leaf.grad.dtype == leaf.dtype
        err = relative_error(leaf.grad, ref.grad)
        assert err <= tol, f"d{name}: relative error {err:.2e} > {tol:.0e} with {options}, entropy={entropy}"


@pytest.mark.parametrize(("dtype", "options"), list(itertools.product(DTYPES, OPTIONS)))
def test_every_option_on_the_cpu_path(dtype: torch.dtype, options: dict) -> None:
    e, c, tokens, bias, options = _case(11, dtype, options)
    check_log_probs(e, c, tokens, bias, options)


@pytest.mark.parametrize("drive", ["log_probs", "entropy"])
def test_one_output_driven(drive: str) -> None:
    """Only one output's upstream gradient (autograd hands the op None for the other)."""
    e, c, tokens, bias, options = _case(12, torch.float32, {"temperature": 0.8, "bias": True})
    check_log_probs(e, c, tokens, bias, options, drive=drive)


def test_log_probs_alone() -> None:
    e, c, tokens, bias, options = _case(13, torch.float32, {"softcap": 3.0, "bias": True})
    check_log_probs(e, c, tokens, bias, options, entropy=False, drive="log_probs")


@pytest.mark.interpreter
@pytest.mark.parametrize(("dtype", "options"), [
    (torch.float32, {"temperature": 0.7, "bias": True}),
    (torch.bfloat16, {}),
    (torch.bfloat16, {"temperature": 1.3, "softcap": 4.0}),
    (torch.float16, {"softcap": 2.5, "bias": True}),
    (torch.float32, {"softcap": 1e6}),  # logits / softcap ~1e-5: the kernels' tanh keeps its relative error
])
def test_kernels_under_the_interpreter(dtype: torch.dtype, options: dict) -> None:
    """The Triton kernels: lse_forward_kernel (fp32) or lse_forward_tma_kernel (16-bit) with the
    entropy statistic, and grad_logits_kernel with the entropy term."""
    e, c, tokens, bias, options = _case(21, dtype, options, lead=(2, 37), v=203, d=45)
    check_log_probs(e, c, tokens, bias, options)


@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=pytest.mark.interpreter)], ids=["cpu", "kernels"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tokens_a_minus_inf_bias_rules_out(kernels: bool, dtype: torch.dtype) -> None:
    """A bias of -inf on some tokens (p = 0 there): the entropy's p log p and its gradient's
    p * logit count 0, not NaN, in the forward's entropy sums and in the backward's d-logits."""
    e, c, tokens, bias, options = _case(23, dtype, {"bias": True, "ruled_out": True}, lead=(70,), v=190, d=48)
    with on_kernels(kernels):
        check_log_probs(e, c, tokens, bias, options)


@pytest.mark.interpreter
@pytest.mark.usefixtures("descriptor_kernels")
def test_tensor_descriptor_recompute_under_the_interpreter() -> None:
    """grad_logits_tma_kernel with the entropy term (the recompute long K rows take)."""
    e, c, tokens, bias, options = _case(22, torch.bfloat16, {"bias": True, "temperature": 0.9}, lead=(70,), v=190,
                                        d=48)
    check_log_probs(e, c, tokens, bias, options)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_and_descriptor_forwards_agree_with_the_cpu_path(dtype: torch.dtype) -> None:
    """The kernels' entropy merges across vocab splits (fp32: lse_forward_kernel) and tiles
    (bf16: lse_forward_tma_kernel) as the CPU path's does, on peaked rows."""
    e, c, tokens = make_inputs("peaked", (90,), 700, 32, dtype, seed=3)
    kernels = cce_compile.linear_log_probs(e, c, tokens, entropy=True)
    with on_kernels(False):
        cpu = cce_compile.linear_log_probs(e, c, tokens, entropy=True)
    for got, want in zip(kernels, cpu):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_frozen_head_skips_its_gradient() -> None:
    e, c, tokens, _, _ = _case(14, torch.float32, {})
    ee = e.clone().requires_grad_()
    lp, h = cce_compile.linear_log_probs(ee, c, tokens, entropy=True)
    (lp.sum() + h.sum()).backward()
    ref_e = e.clone().requires_grad_()
    ref_lp, ref_h = reference_log_probs(ref_e, c, tokens, entropy=True)
    (ref_lp.sum() + ref_h.sum()).backward()
    assert relative_error(ee.grad, ref_e.grad) <= TOLERANCE[torch.float32]


def test_no_grad_is_one_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """The old and reference policies' pass: one forward over the vocabulary, no backward, no graph."""
    calls = []
    row_stats = forward_ops.row_stats
    monkeypatch.setattr(forward_ops, "row_stats", lambda *args: calls.append(1) or row_stats(*args))
    monkeypatch.setattr(log_probs_ops, "backward_from_coefficients", lambda *args: pytest.fail("backward ran"))
    # filter_eps is the backward's: without one, no vocabulary order nor tile statistics either
    monkeypatch.setattr(forward_ops, "vocab_order", lambda *args: pytest.fail("filtered forward ran"))
    e, c, tokens, _, _ = _case(15, torch.float32, {})
    with torch.no_grad():
        lp, h = cce_compile.linear_log_probs(e.requires_grad_(), c.requires_grad_(), tokens, entropy=True,
                                             filter_eps="auto")
    assert calls == [1] and lp.grad_fn is None and h.grad_fn is None
    ref_lp, ref_h = reference_log_probs(e, c, tokens, entropy=True)
    assert relative_error(lp, ref_lp) <= 2e-5 and relative_error(h, ref_h) <= 2e-5


@pytest.mark.parametrize("kernels", [False, True], ids=["cpu", "interpreter"])
@pytest.mark.parametrize("memory", ["workspace", "low"])
@pytest.mark.parametrize("options", [
    {"temperature": 0.6}, {"temperature": 1.7, "softcap": 5.0, "label_smoothing": 0.1},
])
def test_linear_cross_entropy_temperature(memory: str, options: dict, kernels: bool) -> None:
    """The loss of softmax(logits / T), soft-cap first; the fused forward (workspace) and the
    recompute backward (low) alike, with the bias's gradient."""
    e, c, targets, bias, _ = _case(16, torch.float32, {"bias": True})
    leaves = [t.clone().requires_grad_() for t in (e, c, bias)]
    with on_kernels(kernels):
        loss = cce_compile.linear_cross_entropy(*leaves[:2], targets, bias=leaves[2], memory=memory, **options)
        loss.backward()
    ref_leaves = [t.double().requires_grad_() for t in (e, c, bias)]
    temperature, softcap = options["temperature"], options.get("softcap")
    # softcap(l) / T = (s / T) * tanh((l / T) / (s / T)): the reference on e / T, bias / T, s / T
    ref = reference_loss(ref_leaves[0] / temperature, ref_leaves[1], targets, bias=ref_leaves[2] / temperature,
                         softcap=None if softcap is None else softcap / temperature,
                         label_smoothing=options.get("label_smoothing", 0.0))
    ref.backward()
    assert relative_error(loss, ref) <= 2e-5
    for leaf, ref_leaf in zip(leaves, ref_leaves):
        assert relative_error(leaf.grad, ref_leaf.grad) <= 2e-5


def _peaked_errors(kernels: bool, temperature: float) -> tuple[float, float, list[float]]:
    """linear_log_probs in bf16 on rows as peaked as a trained model's against float64: the
    largest log-prob and entropy errors (nats) and dE's and dC's relative errors."""
    n, d, v = (64, 128, 1024) if kernels else (256, 512, 4000)
    e, c, tokens = lm_like_inputs(n, d, v, torch.bfloat16, "cpu", seed=3, target_loss=0.3)
    leaves = [t.clone().requires_grad_() for t in (e, c)]
    ref_leaves = [t.double().requires_grad_() for t in (e, c)]
    g = torch.Generator().manual_seed(5)
    up_lp, up_h = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)
    with on_kernels(kernels):
        log_probs, entropy = cce_compile.linear_log_probs(*leaves, tokens, temperature=temperature, entropy=True)
    ref_lp, ref_h = reference_log_probs(*ref_leaves, tokens, temperature=temperature, entropy=True)
    ((log_probs.double() * up_lp).sum() + (entropy.double() * up_h).sum()).backward()
    ((ref_lp * up_lp).sum() + (ref_h * up_h).sum()).backward()
    assert float(ref_h.mean()) < 0.5, "rows not peaked"
    if temperature != 1.0:
        rounded = reference_log_probs((e / temperature).double(), c.double(), tokens)
        assert float((rounded - ref_lp).abs().max()) > 2e-3, "e / T rounded to bf16 moves these rows"
    return (float((log_probs.double() - ref_lp).abs().max()), float((entropy.double() - ref_h).abs().max()),
            [relative_error(leaf.grad, ref_leaf.grad) for leaf, ref_leaf in zip(leaves, ref_leaves)])


@pytest.mark.parametrize("kernels", [False, True], ids=["cpu", "interpreter"])
def test_bf16_temperature_on_peaked_rows(kernels: bool) -> None:
    """A temperature costs bf16 no accuracy on rows as peaked as a trained model's (mean entropy
    ~0.1 nat): the kernels scale their fp32 logits, where e / T rounded to bf16 (what the op did
    before) moves these log-probs by up to ~1e-2 nat, past RL's 5e-3 bounds. The gradients keep
    the path's own error at temperature 1 (bf16 d-logits on the kernels' path)."""
    log_prob_error, entropy_error, grad_errors = _peaked_errors(kernels, 0.7)
    _, _, grad_errors_at_one = _peaked_errors(kernels, 1.0)
    assert log_prob_error < 1e-4 and entropy_error < 1e-4
    for error, at_one in zip(grad_errors, grad_errors_at_one):
        assert error < 1.25 * at_one


@pytest.mark.parametrize("temperature", [0.1, 0.01])
def test_fp16_entropy_gradient_where_every_logit_is_capped(temperature: float) -> None:
    """fp16's d-logits are stored divided by a bound on them (ops/backward._d_logits_bound). With
    the entropy written about 0, its row coefficient h mu - g grew with the mean logit (as 1 / T^2,
    to the soft-cap's size here, where |hidden| ~ 300 caps every logit); a bound of it left the
    true d-logits in fp16's subnormals or at zero: dE 4.2e-2 and 0.15 off float64 at T = 0.1 and
    0.01. The bound is the d-logits' own (1.4-1.6e-3)."""
    g = torch.Generator().manual_seed(1)
    torch.randn(8, 16, generator=g)  # unused: the draws in the order of the probe that found it
    c = torch.randn(64, 16, generator=g).half()
    tokens = torch.randint(0, 64, (8,), generator=g)
    tokens[3] = -100
    e = (torch.randn(8, 16, generator=g) * 300).half()
    leaves, ref_leaves = [t.clone().requires_grad_() for t in (e, c)], [t.double().requires_grad_() for t in (e, c)]
    with on_kernels(True):
        log_probs, entropy = cce_compile.linear_log_probs(*leaves, tokens, temperature=temperature, entropy=True,
                                                          softcap=30.0)
        (log_probs.sum() + 0.3 * entropy.sum()).backward()
    ref_lp, ref_h = reference_log_probs(*ref_leaves, tokens, temperature=temperature, entropy=True, softcap=30.0)
    (ref_lp.sum() + 0.3 * ref_h.sum()).backward()
    for leaf, ref in zip(leaves, ref_leaves):
        assert relative_error(leaf.grad, ref.grad) < TOLERANCE[torch.float16]


@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=pytest.mark.interpreter)], ids=["cpu", "kernels"])
@pytest.mark.parametrize("temperature", [1e-5, 1e-20])
def test_entropy_gradient_where_the_mean_logit_dwarfs_the_spread(kernels: bool, temperature: float) -> None:
    """The entropy's d-logits, p_j (l_j - mu), are written about the row's lse (-p_j log p_j
    and the entropy: both bounded) rather than about 0: with the mean logit mu in a row
    coefficient (h mu - g), a mu far above the spread (a low temperature's 1 / T) rounded the
    log-prob's g away, dE 6.9e-3 off at T = 1e-5, and at the lowest temperature accepted h mu / T
    overflowed to inf - inf = NaN."""
    e, c, tokens, bias, _ = _case(23, torch.float32, {"bias": True}, lead=(2, 11), v=97, d=32)
    with on_kernels(kernels):
        check_log_probs(e, c, tokens, bias, {"temperature": temperature})


def _shifted_rows(dtype: torch.dtype, shift: float = 50.0) -> tuple[torch.Tensor, ...]:
    """(e, c, tokens, bias): logits N(0, 1) plus `shift` (the bias), token 7's raised by a gap
    that grows over the rows from 0 to 30 (a hidden unit only its head row reads), so the rows
    run from flat (entropy ~5 nats) to one-hot to fp32's resolution (~5e-10 nats), every logit
    near `shift` or above it."""
    n, v, d = 48, 203, 32
    g = torch.Generator().manual_seed(4)
    e, c = torch.randn(n, d, generator=g), torch.randn(v, d, generator=g) / d**0.5
    c[:, -1] = 0.0
    c[7, -1] = 1.0
    e[:, -1] = torch.linspace(0.0, 30.0, n)
    tokens = torch.randint(0, v, (n,), generator=g)
    return e.to(dtype), c.to(dtype), tokens, torch.full((v,), shift).to(dtype)


@pytest.mark.parametrize(("kernels", "dtype", "filter_eps"), [
    (False, torch.float32, None), (False, torch.float32, 2.0**-7),
    pytest.param(True, torch.float32, None, marks=pytest.mark.interpreter),  # lse_forward_kernel's splits
    pytest.param(True, torch.float32, 2.0**-7, marks=pytest.mark.interpreter),  # ... with filtered mode's tile planes
    pytest.param(True, torch.bfloat16, None, marks=pytest.mark.interpreter),  # lse_forward_tma_kernel's tiles, merged
    pytest.param(True, torch.bfloat16, 2.0**-7, marks=pytest.mark.interpreter),  # ... from filtered mode's planes
], ids=["cpu", "cpu-filtered", "split", "split-filtered", "tma", "tma-filtered"])
def test_entropy_of_large_logits_is_accurate_and_never_negative(
        kernels: bool, dtype: torch.dtype, filter_eps: float | None, launch_plans: list) -> None:
    """The entropy is summed about the row's largest logit, in two terms >= 0 (the log of the
    sum of exponentials, taken as log1p of its terms below the max, and the mean gap below the
    max): written as lse - sum_j p_j l_j, two numbers near the logits (~50-80 here) cancelled
    to within fp32's rounding of them, 1-3e-5 nats off, a near one-hot row's entropy 0 (and at
    a shift of 100 negative). Every row's entropy, 5e-10 to 5 nats, stays within 5e-5 of
    float64 relatively (the logits' own rounding moves it by up to ~1e-5), on every forward
    kernel the interpreter runs, filtered mode's included."""
    e, c, tokens, bias = _shifted_rows(dtype)
    _, reference = reference_log_probs(e.double(), c.double(), tokens, bias=bias.double(), entropy=True)
    with cce_compile.override_config(SMALL_TILES), on_kernels(kernels):
        _, entropy = cce_compile.linear_log_probs(e.clone().requires_grad_(), c, tokens, bias=bias, entropy=True,
                                                  filter_eps=filter_eps)  # a gradient to come: the filter applies
    if kernels:
        assert (launch_plans[0].forward, launch_plans[0].filtered) == (
            "split" if dtype == torch.float32 else "tma", filter_eps is not None)
    assert float(reference.min()) < 1e-8 and float(reference.max()) > 4.0, "rows not from one-hot to flat"
    error = (entropy.detach().double() - reference).abs()
    assert float((error / reference).max()) <= 5e-5, float((error / reference).max())
    assert bool((entropy >= 0.0).all()), float(entropy.min())


@pytest.mark.parametrize(("kernels", "dtype", "filter_eps", "bound"), [
    (False, torch.float32, None, 1e-4), (False, torch.float32, 2.0**-7, 1e-4),
    pytest.param(True, torch.float32, None, 1e-4, marks=pytest.mark.interpreter),
    pytest.param(True, torch.float32, 2.0**-7, 1e-4, marks=pytest.mark.interpreter),
    pytest.param(True, torch.bfloat16, None, 1e-2, marks=pytest.mark.interpreter),
    pytest.param(True, torch.bfloat16, 2.0**-7, 1e-2, marks=pytest.mark.interpreter),
], ids=["cpu", "cpu-filtered", "split", "split-filtered", "tma", "tma-filtered"])
def test_entropy_gradient_of_peaked_rows(kernels: bool, dtype: torch.dtype, filter_eps: float | None, bound: float,
                                         launch_plans: list) -> None:
    """The entropy's d-logits are -p_j (l_j - lse) - p_j (lse - mean logit) for the lse the
    backward reads: with the entropy in lse - mean logit's place, off from it by lse's fp32
    rounding (~|lse| * 6e-8, as large as a near one-hot row's entropy), dE of such rows under
    an entropy-only upstream was 5e-2 off float64 (fp32) and 5.5e-2 (bf16). The forward gives
    lse less the mean logit itself (kernels/forward.lse_minus_mean): every row within `bound`
    of float64, per row (fp32: 4.5e-6 to 1.0e-5; bf16's d-logits and dE round by 2-8e-3 on
    every row, flat or peaked)."""
    e, c, tokens, bias = _shifted_rows(dtype)
    upstream = torch.randn(e.shape[0], generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    e64 = e.double().requires_grad_()
    _, reference = reference_log_probs(e64, c.double(), tokens, bias=bias.double(), entropy=True)
    (expected,) = torch.autograd.grad(reference, e64, upstream)
    peaked = reference.detach() < 1e-2
    assert int(peaked.sum()) >= 20, "too few near one-hot rows"
    leaf = e.clone().requires_grad_()
    with cce_compile.override_config(SMALL_TILES), on_kernels(kernels):
        _, entropy = cce_compile.linear_log_probs(leaf, c, tokens, bias=bias, entropy=True, filter_eps=filter_eps)
        (got,) = torch.autograd.grad(entropy, leaf, upstream.to(torch.float32))
    if kernels:
        assert launch_plans[0].forward == ("split" if dtype == torch.float32 else "tma")
    row_error = (got.double() - expected).norm(dim=1) / expected.norm(dim=1)
    assert float(row_error[peaked].max()) <= bound, float(row_error[peaked].max())


def test_no_grad_pass_leaves_out_lse_minus_mean(monkeypatch: pytest.MonkeyPatch) -> None:
    """lse less the mean logit is the entropy's backward's alone (a third per-tile plane on
    the tensor-descriptor forward): a pass under no_grad, an old or reference policy's, asks
    for none."""
    asked = []
    real = log_probs_ops.row_and_filter_stats
    monkeypatch.setattr(log_probs_ops, "row_and_filter_stats",
                        lambda *args: asked.append(args[-1]) or real(*args))
    e, c, tokens, _, _ = _case(19, torch.float32, {})
    with torch.no_grad():
        cce_compile.linear_log_probs(e.requires_grad_(), c, tokens, entropy=True)
    cce_compile.linear_log_probs(e, c, tokens, entropy=True)[1].sum().backward()
    assert asked == [False, True]


def test_loss_module_takes_a_temperature() -> None:
    e, c, targets, _, _ = _case(17, torch.float32, {})
    module = cce_compile.LinearCrossEntropyLoss(temperature=0.5, reduction="sum")
    expected = cce_compile.linear_cross_entropy(e, c, targets, temperature=0.5, reduction="sum")
    torch.testing.assert_close(module(e, c, targets), expected)
    log_probs = cce_compile.linear_log_probs(e, c, targets, temperature=0.5)
    assert float(-log_probs.sum()) == pytest.approx(float(expected), rel=1e-5)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"temperature": 0.0}, ValueError, "temperature must be a finite number >= 1e-20"),
    ({"temperature": -1.0}, ValueError, "temperature"),
    ({"temperature": float("nan")}, ValueError, "temperature"),
    ({"temperature": True}, TypeError, "temperature must be a number >= 1e-20, got bool"),
    ({"entropy": 1}, TypeError, "entropy must be a bool"),
    ({"softcap": 0.0}, ValueError, "softcap"),
    # past float's range an int compared finite, then float() raised OverflowError
    ({"temperature": 10**400}, ValueError, "temperature must be a finite number"),
    ({"softcap": 10**400}, ValueError, "softcap must be a finite number"),
    # softcap / temperature past float32's range: the kernels' cap was inf, every output NaN
    ({"temperature": 1e-20, "softcap": 1e30}, ValueError, r"softcap / temperature must be within float32's normal"),
    # below float32's smallest normal the cap was 0, and 0 / 0 NaN
    ({"temperature": 1e50, "softcap": 30.0}, ValueError, r"softcap / temperature must be within .*\(softcap, "
     r"temperature\), got \(30.0, 1e\+50\)"),
    ({"filter_eps": 1.5}, ValueError, r"filter_eps must be None, 'auto' or a float in \(0, 1\)"),
    ({"filter_eps": "fast"}, ValueError, "filter_eps"),
])
def test_bad_options_raise(kwargs: dict, error: type, match: str) -> None:
    e, c, tokens, _, _ = _case(18, torch.float32, {})
    with pytest.raises(error, match=match):
        cce_compile.linear_log_probs(e, c, tokens, **kwargs)


def test_bad_tensors_raise() -> None:
    e, c, tokens, _, _ = _case(19, torch.float32, {})
    with pytest.raises(TypeError, match="tokens must be an integer tensor"):
        cce_compile.linear_log_probs(e, c, tokens.float())
    with pytest.raises(TypeError, match="tokens must be an integer tensor that fits int64"):
        cce_compile.linear_log_probs(e, c, tokens.to(torch.uint64))
    with pytest.raises(ValueError, match=r"tokens must have shape \(3, 29\)"):
        cce_compile.linear_log_probs(e, c, tokens[:, :5])
    with pytest.raises(TypeError, match="c must have e's dtype"):
        cce_compile.linear_log_probs(e, c.double(), tokens)
    with pytest.raises(ValueError, match="e's last dimension"):
        cce_compile.linear_log_probs(e[..., :7], c, tokens)
    with pytest.raises(ValueError, match="bias must have shape"):
        cce_compile.linear_log_probs(e, c, tokens, bias=torch.zeros(3))
    with pytest.raises(ValueError, match=r"tokens must be in \[0, 157\)"):
        cce_compile.linear_log_probs(e, c, tokens + 1000)
    with pytest.raises(ValueError, match="temperature"):
        cce_compile.linear_cross_entropy(e, c, tokens, temperature=0)


@pytest.mark.usefixtures("block_sparse_always")
def test_opcheck_forward_and_backward() -> None:
    e, c, tokens = make_inputs("zipf", (33,), 97, 24, torch.float32, seed=2)
    tokens[::4] = -100
    bias = (torch.randn(97) * 0.1).requires_grad_()
    e.requires_grad_()
    c.requires_grad_()
    for entropy, entropy_backward, filter_eps in itertools.product((False, True), (False, True), (0.0, 2.0**-6)):
        # an entropy's backward without lse less the mean logit refuses to run: a no-grad pass's leaves
        operands = (e, c, bias) if entropy_backward or not entropy else (e.detach(), c.detach(), bias.detach())
        torch.library.opcheck(ops.linear_log_probs_forward,
                              (*operands[:2], tokens, operands[2], -100, 3.0, entropy, entropy_backward, filter_eps,
                               1.25))
    policy = active_policy()
    for filter_eps in (0.0, 2.0**-6):
        _, _, *kept = ops.linear_log_probs_forward(e, c, tokens, bias, -100, 3.0, True, True, filter_eps, 1.25)
        settings = encode_settings(config_for(e, c, filter_eps > 0.0, policy), policy)
        for grad_entropy, need_c in ((torch.randn(33), True), (None, False)):
            args = (torch.randn(33), grad_entropy, e.detach(), c.detach(), tokens, bias.detach(),
                    *(t.detach() for t in kept), -100, 3.0, filter_eps, 1.25, True, need_c, settings)
            torch.library.opcheck(ops.linear_log_probs_backward, args)



@pytest.mark.interpreter
@pytest.mark.parametrize("filter_eps", [0.0, 2.0**-7], ids=["exact", "filtered"])
def test_fake_forward_matches_the_tensor_descriptor_forward(filter_eps: float, launch_plans: list) -> None:
    """The tensor-descriptor forward merges the rows' entropy and lse less the mean logit into
    one (2, N) buffer: the second, handed out as a view N floats into it, had a storage offset
    the fake's fresh tensor has not (opcheck: "mismatched storage offset" for output[3])."""
    e, c, tokens, bias = _shifted_rows(torch.bfloat16)
    e.requires_grad_()
    with cce_compile.override_config(SMALL_TILES):
        torch.library.opcheck(ops.linear_log_probs_forward, (e, c, tokens, bias, -100, 0.0, True, True, filter_eps, 1.0),
                              test_utils=("test_faketensor",))
    assert launch_plans[0].forward == "tma"


def _policy_step(hidden: torch.Tensor, head: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    log_probs, entropy = cce_compile.linear_log_probs(hidden, head, tokens, temperature=0.9, entropy=True, shift=True)
    return (log_probs * 0.3).sum() + (entropy * 0.01).sum()


def _filtered_policy_step(hidden: torch.Tensor, head: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    log_probs, entropy = cce_compile.linear_log_probs(hidden, head, tokens, temperature=0.9, entropy=True, shift=True,
                                                      filter_eps=2.0**-6)
    return (log_probs * 0.3).sum() + (entropy * 0.01).sum()


POLICY_STEPS = {"exact": _policy_step, "filtered": _filtered_policy_step}
"""Module functions, not partials: Dynamo compiles a functools.partial twice."""


@pytest.mark.usefixtures("block_sparse_always")
@pytest.mark.parametrize("mode", POLICY_STEPS)
def test_fullgraph_compile_with_dynamic_n_matches_eager(mode: str) -> None:
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    step = POLICY_STEPS[mode]
    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    head = torch.randn(83, 16, requires_grad=True)
    for n in (70, 90, 127):
        hidden = torch.randn(1, n, 16, requires_grad=True)
        tokens = torch.randint(0, 83, (1, n))
        compiled(hidden, head, tokens).backward()
        got = (hidden.grad.clone(), head.grad.clone())
        hidden.grad = head.grad = None
        step(hidden, head, tokens).backward()
        torch.testing.assert_close(got[0], hidden.grad, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(got[1], head.grad, rtol=1e-4, atol=1e-6)
        head.grad = None
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames"


@pytest.mark.parametrize(("marked", "frames"), [(True, [1, 1, 2, 3, 3, 3]), (False, [1, 2, 3, 4, 4, 4])])
def test_packed_lengths_compile_one_graph_per_n_bucket(marked: bool, frames: list[int]) -> None:
    """Packed batches of 37, 64, 100, 129, 250 and 256 tokens, fullgraph: the traced config's
    only guard is N's power-of-two bucket, so (32, 64] and (128, 256] compile once each. With
    mark_dynamic, one graph per bucket; with automatic dynamic shapes, the static first call's
    graph, then one per bucket. Every call gives eager's gradients."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_policy_step, backend=counter, fullgraph=True)
    head = torch.randn(83, 16, requires_grad=True)
    got_frames = []
    for n in (37, 64, 100, 129, 250, 256):
        hidden, tokens = torch.randn(1, n, 16), torch.randint(0, 83, (1, n))
        grads = []
        for step in (compiled, _policy_step):
            leaf = hidden.clone().requires_grad_()
            if step is compiled and marked:
                torch._dynamo.mark_dynamic(leaf, 1)
                torch._dynamo.mark_dynamic(tokens, 1)
            step(leaf, head, tokens).backward()
            grads.append((leaf.grad, head.grad))
            head.grad = None
        for got, want in zip(*grads):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
        got_frames.append(counter.frame_count)
    assert got_frames == frames, f"frames after each call: {got_frames}"


@pytest.mark.interpreter
@pytest.mark.parametrize("mode", POLICY_STEPS)
def test_compiled_graph_runs_the_interpreted_kernels(mode: str) -> None:
    """Filtered, the fake gives the kernels' filter statistics their shapes."""
    hidden = torch.randn(1, 45, 16, requires_grad=True)
    head = torch.randn(83, 16, requires_grad=True)
    tokens = torch.randint(0, 83, (1, 45))
    step = POLICY_STEPS[mode]
    torch.compile(step, fullgraph=True)(hidden, head, tokens).backward()
    got = (hidden.grad.clone(), head.grad.clone())
    hidden.grad = head.grad = None
    step(hidden, head, tokens).backward()
    torch.testing.assert_close(got[0], hidden.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(got[1], head.grad, rtol=1e-4, atol=1e-6)


def _recipe() -> dict:
    """The python block of docs/rl.md, executed: the recipe the docs show is the one tested."""
    text = (Path(__file__).parents[1] / "docs" / "rl.md").read_text()
    block = re.search(r"```python\n(.*?)```", text, re.S)
    assert block, "docs/rl.md has no python block"
    namespace: dict = {}
    exec(compile(block.group(1), "docs/rl.md", "exec"), namespace)
    return namespace


def _reference_grpo_loss(hidden, head, tokens, old_log_probs, advantages, mask, clip_eps, entropy_coef, temperature):
    """The recipe's loss on float64 materialized logits."""
    logits = (hidden.double() @ head.double().T) / temperature
    log_softmax = torch.log_softmax(logits, dim=-1)
    log_probs = log_softmax.gather(-1, tokens.clamp(min=0)[..., None])[..., 0]
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    ratio = torch.exp(log_probs - old_log_probs)
    advantages = advantages[:, None]
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages)
    per_token = -surrogate - entropy_coef * entropy
    return (per_token * mask).sum() / mask.sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grpo_recipe_against_float64(dtype: torch.dtype) -> None:
    """docs/rl.md's clipped policy loss with an entropy bonus: old log-probs from a no_grad pass
    of a perturbed policy, group-normalized advantages, padding masked; loss and gradients of
    the hidden states and the head against float64."""
    recipe = _recipe()
    g = torch.Generator().manual_seed(5)
    batch, seq, v, d = 4, 23, 131, 32
    hidden = (torch.randn(batch, seq, d, generator=g) / d**0.25).to(dtype)
    head = (torch.randn(v, d, generator=g) / d**0.25).to(dtype)
    tokens = torch.randint(0, v, (batch, seq), generator=g)
    tokens[1, 15:] = -100  # a shorter completion
    with torch.no_grad():
        old_log_probs = cce_compile.linear_log_probs(hidden, (head.float() * 1.05).to(dtype), tokens, temperature=0.8)
    rewards = torch.randn(batch, generator=g)
    advantages = recipe["group_advantages"](rewards, group_size=2)
    leaves = [t.clone().requires_grad_() for t in (hidden, head)]
    loss = recipe["grpo_policy_loss"](*leaves, tokens, old_log_probs, advantages, clip_eps=0.2, entropy_coef=0.01,
                                      temperature=0.8)
    loss.backward()
    ref_leaves = [t.double().requires_grad_() for t in (hidden, head)]
    mask = (tokens != -100).double()
    ref = _reference_grpo_loss(*ref_leaves, tokens, old_log_probs.double(), advantages.double(), mask, 0.2, 0.01, 0.8)
    ref.backward()
    tol = TOLERANCE[dtype]
    assert loss.dtype == torch.float32 and relative_error(loss, ref) <= tol
    clipped = (torch.exp(cce_compile.linear_log_probs(hidden, head, tokens, temperature=0.8) - old_log_probs) - 1).abs()
    assert bool((clipped > 0.2).any()) and bool((clipped[tokens != -100] < 0.2).any()), "both sides of the clip"
    for leaf, ref_leaf in zip(leaves, ref_leaves):
        assert relative_error(leaf.grad, ref_leaf.grad) <= tol


def test_bench_contenders_agree_on_cpu() -> None:
    """The bench's log-probs rows: cce's and the materialized one give the cross-entropy the
    harness checks them against, with the same gradients, and so do verl's and TRL's kernels
    where installed; where not, each is reported unavailable with its reason rather than
    failing the run."""
    from cce_compile.bench import log_probs as bench_log_probs
    from cce_compile.bench.peers import IMPLS, try_load

    e, c, tokens = make_inputs("zipf", (64,), 97, 24, torch.float32, seed=9)
    results = []
    for fn in (try_load(IMPLS["cce_log_probs"]).fn, bench_log_probs.materialized_log_probs):
        leaves = [t.clone().requires_grad_() for t in (e, c)]
        loss = fn(*leaves, tokens)
        loss.backward()
        results.append((loss, *(leaf.grad for leaf in leaves)))
    expected = torch.nn.functional.cross_entropy(e @ c.T, tokens)
    torch.testing.assert_close(results[0][0], expected)
    for got, want in zip(results[0], results[1]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    filtered = try_load(IMPLS["cce_log_probs_filtered"]).fn(e, c, tokens)  # filtering leaves the value exact
    torch.testing.assert_close(filtered, expected)
    for peer in ("verl", "trl"):  # where installed (TRL's kernel folds its tiles in torch on CPU), as the others
        loaded = try_load(IMPLS[f"{peer}_log_probs"])
        if isinstance(loaded, str):
            assert peer in loaded
            continue
        leaves = [t.clone().requires_grad_() for t in (e, c)]
        loss = loaded.fn(*leaves, tokens)
        loss.backward()
        for got, want in zip((loss, *(leaf.grad for leaf in leaves)), results[1]):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_a_kernel_module_loads_alone_and_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """verl's kernel module loads without its package's __init__ (which imports the whole
    framework), and a second load (the bench's next shape) returns the same module; a module
    that does not import, or a package not installed, is unavailable with the reason."""
    from cce_compile.bench.log_probs import import_kernel_module
    from cce_compile.bench.peers import ImplUnavailable

    package = tmp_path / "heavy_framework" / "utils"
    package.mkdir(parents=True)
    (tmp_path / "heavy_framework" / "__init__.py").write_text("raise ImportError('the whole framework')\n")
    (package / "__init__.py").write_text("raise ImportError('the whole framework')\n")
    (package / "helpers.py").write_text("FACTOR = 3\n")
    (package / "kernel.py").write_text("from .helpers import FACTOR\n\ndef apply(x):\n    return FACTOR * x\n")
    (package / "broken.py").write_text("import a_dependency_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.startswith("heavy_framework")]:
        monkeypatch.delitem(sys.modules, name)
    first = import_kernel_module("heavy_framework.utils.kernel", alone=True)
    try:
        assert first.apply(2) == 6
        assert import_kernel_module("heavy_framework.utils.kernel", alone=True) is first
        assert importlib.util.find_spec("heavy_framework.utils") is not None  # the bare parents have specs
        with pytest.raises(ImplUnavailable, match="broken does not import: ModuleNotFoundError"):
            import_kernel_module("heavy_framework.utils.broken", alone=True)
        with pytest.raises(ImplUnavailable, match="no_such_framework is not installed"):
            import_kernel_module("no_such_framework.kernel")
        (tmp_path / "plain_module.py").write_text("VALUE = 1\n")
        importlib.invalidate_caches()
        with pytest.raises(ImplUnavailable, match="plain_module is not a package"):
            import_kernel_module("plain_module.sub.kernel", alone=True)
        assert "plain_module" not in sys.modules
    finally:
        for name in [m for m in sys.modules if m.startswith("heavy_framework")]:
            del sys.modules[name]
    # a first import that fails takes back the bare parents it made: the package imports as itself after
    (tmp_path / "other_framework" / "utils").mkdir(parents=True)
    (tmp_path / "other_framework" / "__init__.py").write_text("REAL = True\n")
    (tmp_path / "other_framework" / "utils" / "__init__.py").write_text("")
    (tmp_path / "other_framework" / "utils" / "broken.py").write_text("raise RuntimeError('half way')\n")
    importlib.invalidate_caches()
    try:
        with pytest.raises(ImplUnavailable, match="RuntimeError: half way"):
            import_kernel_module("other_framework.utils.broken", alone=True)
        assert not [m for m in sys.modules if m.startswith("other_framework")]
        assert importlib.import_module("other_framework").REAL
    finally:
        for name in [m for m in sys.modules if m.startswith("other_framework")]:
            del sys.modules[name]


def run_filtered(dtype: torch.dtype, kernels: bool, filter_eps: float | None, entropy: bool = True,
                 changed: dict[int, int] | None = None) -> list:
    """[log_probs, entropies (0 without), dE, dC, dbias] of an LM-like head whose skipped tiles hold
    real mass at a coarse filter_eps (2^-7), under random upstream gradients of both outputs;
    `changed`: tokens set to other ids (position: id)."""
    e, c, tokens = make_inputs("zipf", (160,), 4000, 32, dtype, seed=11)
    tokens[::9] = -100
    for position, token in (changed or {}).items():
        tokens[position] = token
    g = torch.Generator().manual_seed(12)
    bias = (torch.randn(4000, generator=g) * 0.1).to(dtype)
    up_lp, up_h = torch.randn(160, generator=g), torch.randn(160, generator=g)
    leaves = [t.clone().requires_grad_() for t in (e, c, bias)]
    with cce_compile.override_config(SMALL_TILES), on_kernels(kernels):
        out = cce_compile.linear_log_probs(leaves[0], leaves[1], tokens, bias=leaves[2], entropy=entropy,
                                           filter_eps=filter_eps)
    log_probs, entropies = out if entropy else (out, torch.zeros(()))
    ((log_probs * up_lp).sum() + (entropies * up_h).sum()).backward()
    return [log_probs.detach(), entropies.detach()] + [t.grad for t in leaves]


@pytest.mark.interpreter
@pytest.mark.usefixtures("no_scratch_floor", "block_sparse_always")
@pytest.mark.parametrize("entropy", [False, True])
def test_filtered_kernels_and_cpu_path_put_back_the_same_skipped_tiles(
        entropy: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """filter_eps: where the skipped tiles hold real mass (an LM-like head, a coarse 2^-7),
    the kernels put back each skipped tile's row sums and dE's tilt from the forward's tile
    statistics (for the entropy, its tile mean logits: filtering.SkippedEntropy), the CPU path
    from the recomputed softmax, and the two agree under random upstream gradients of both
    outputs, bias included; without the entropy's put-back, or its tilt term, they do not.
    The outputs stay exact."""
    from cce_compile.ops import filtering

    def run(kernels: bool, filter_eps: float | None = 2.0**-7) -> list:
        return run_filtered(torch.float32, kernels, filter_eps, entropy)

    kernels, cpu, exact = run(True), run(False), run(False, None)
    for got, want in zip(kernels[:2], exact[:2]):  # the kernels sum in vocab order
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert relative_error(cpu[2], exact[2]) > 1e-2, "the filter skipped little: the test shows nothing"
    for kernel_grad, cpu_grad in zip(kernels[2:], cpu[2:]):
        # fp16 tile log-sum-exps and mean logits on the kernels' side
        assert relative_error(kernel_grad, cpu_grad) < 1e-4, relative_error(kernel_grad, cpu_grad)
    if not entropy:
        return
    skipped_sums = filtering.SkippedEntropy.skipped_sums

    def without_tilt_term(self, *args):
        sums, _ = skipped_sums(self, *args)
        return sums, sums.sum(dim=1)

    def without_entropy(self, tile_lse, coef_softmax, computed, softcap_slopes=None):
        sums = filtering.SkippedTiles._skipped_mass(tile_lse, coef_softmax, computed)
        return sums, sums.sum(dim=1)

    monkeypatch.setattr(filtering.SkippedEntropy, "skipped_sums", without_tilt_term)
    assert relative_error(run(True)[2], kernels[2]) > 5e-3, "the entropy's tilt term moved dE little"
    monkeypatch.setattr(filtering.SkippedEntropy, "skipped_sums", without_entropy)
    without = run(True)
    for corrected, dropped in zip(kernels[2:], without[2:]):
        assert relative_error(dropped, corrected) > 5e-3, "the entropy's put-back moved the gradients little"


@pytest.mark.usefixtures("no_scratch_floor", "block_sparse_always")
@pytest.mark.parametrize(("kernels", "entropy"), [
    (False, False), (False, True), pytest.param(True, True, marks=pytest.mark.interpreter),  # the kernels: ~30 s
], ids=["cpu", "cpu-entropy", "kernels-entropy"])
def test_filtered_out_of_range_token_makes_its_gradients_nan(
        kernels: bool, entropy: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the eager CPU check (as on the GPU), a token outside [0, V) has a NaN log-prob, and
    in filtered mode its skipped tiles' put-back and the tilt's ranking of tiles take its NaN
    coefficient too: its dE row and all of dC and dbias are NaN (for a grad scaler to see),
    while the other tokens' dE rows stay what they are with it ignored and ignored rows 0."""
    from cce_compile import api

    monkeypatch.setattr(api, "_check_target_range", lambda *args, **kwargs: None)
    bad = {4: 4000 + 5, 7: -3}
    poisoned = run_filtered(torch.float32, kernels, 2.0**-7, entropy, changed=bad)
    ignored = run_filtered(torch.float32, kernels, 2.0**-7, entropy, changed=dict.fromkeys(bad, -100))
    rows = list(bad)
    assert torch.isnan(poisoned[0][rows]).all()
    assert torch.isnan(poisoned[2][rows]).all() and torch.isnan(poisoned[3]).all() and torch.isnan(poisoned[4]).all()
    others = torch.ones(160, dtype=torch.bool)
    others[rows] = False
    assert not poisoned[2][::9].any(), "an ignored token's dE row is not 0"
    # the tilt's covariance comes from other tiles where the NaN ranks first: only rounding moves
    torch.testing.assert_close(poisoned[2][others], ignored[2][others], rtol=1e-4, atol=1e-6)


@pytest.mark.interpreter
@pytest.mark.usefixtures("no_scratch_floor", "block_sparse_always")
@pytest.mark.parametrize("kernels", [False, True], ids=["cpu", "interpreter"])
def test_filtered_temperature_is_the_call_on_scaled_operands(kernels: bool) -> None:
    """In fp32 a temperature is the same call on e / T and bias / T (to rounding), filtered mode
    included: what it skips, puts back and tilts (filtering.Tilt) is in the scaled logits' units."""
    e, c, tokens = make_inputs("zipf", (160,), 4000, 32, torch.float32, seed=11)
    g = torch.Generator().manual_seed(12)
    bias = torch.randn(4000, generator=g) * 0.1
    up_lp, up_h = torch.randn(160, generator=g), torch.randn(160, generator=g)
    temperature = 0.6

    def run(e: torch.Tensor, bias: torch.Tensor, temperature: float) -> list:
        leaves = [t.clone().requires_grad_() for t in (e, c, bias)]
        with cce_compile.override_config(SMALL_TILES), on_kernels(kernels):
            log_probs, entropy = cce_compile.linear_log_probs(
                leaves[0], leaves[1], tokens, bias=leaves[2], entropy=True, filter_eps=2.0**-7, temperature=temperature)
        ((log_probs * up_lp).sum() + (entropy * up_h).sum()).backward()
        return [log_probs.detach(), entropy.detach()] + [t.grad for t in leaves]

    ours = run(e, bias, temperature)
    scaled = run(e / temperature, bias / temperature, 1.0)
    scaled[2], scaled[4] = scaled[2] / temperature, scaled[4] / temperature  # d/de, d/dbias of f(e / T, bias / T)
    for name, got, want in zip(("log_probs", "entropy", "dE", "dC", "dbias"), ours, scaled):
        assert relative_error(got, want) < 1e-4, name


@pytest.mark.usefixtures("block_sparse_always")
@pytest.mark.parametrize("entropy_weight", [0.0, 0.1])
def test_filtered_gradients_on_an_lm_like_head_against_float64(entropy_weight: float) -> None:
    """filter_eps="auto" on bf16 inputs of an LM-like head (a Zipfian, sparse softmax): dE and
    dC within 5e-3 of float64 under random log-prob upstream gradients (an RL policy loss) and
    entropy ones `entropy_weight` their size (an entropy bonus), where exact mode's bf16
    rounding alone is ~1.7e-3; and the filter did skip tiles."""
    e, c, tokens = lm_like_inputs(256, 64, 16384, torch.bfloat16, "cpu", seed=3)
    g = torch.Generator().manual_seed(1)
    up_lp = torch.randn(256, generator=g, dtype=torch.float64)
    up_h = entropy_weight * torch.randn(256, generator=g, dtype=torch.float64)

    def grads(fn, dtype: torch.dtype, **options) -> list[torch.Tensor]:
        leaves = [t.detach().to(dtype).requires_grad_() for t in (e, c)]
        log_probs, entropies = fn(*leaves, tokens, entropy=True, **options)
        ((log_probs.double() * up_lp).sum() + (entropies.double() * up_h).sum()).backward()
        return [t.grad for t in leaves]

    reference = grads(reference_log_probs, torch.float64)
    filtered = grads(cce_compile.linear_log_probs, torch.bfloat16, filter_eps="auto")
    exact = grads(cce_compile.linear_log_probs, torch.bfloat16)
    for name, got, want, unfiltered in zip(("dE", "dC"), filtered, reference, exact):
        assert relative_error(got, want) <= 5e-3, f"{name}: {relative_error(got, want):.2e}"
        assert relative_error(got, unfiltered) > 1e-3, "the filter skipped little: the test shows nothing"


@pytest.mark.interpreter
@pytest.mark.usefixtures("descriptor_kernels")
def test_filtered_forward_statistics_through_descriptors_and_pointers(launch_plans: list) -> None:
    """The persistent forward (lse_forward_tma_kernel, walking a copy of c in vocab order) and
    the pointer forward (lse_forward_kernel, odd row strides) record the same filter
    statistics for the entropy, tile mean logits included (each tile's, less lse, in fp16)."""
    e, c, tokens = make_inputs("zipf", (253,), 1031, 104, torch.bfloat16, seed=7)
    tokens[::7] = -100
    bias = (torch.randn(1031, generator=torch.Generator().manual_seed(8)) * 0.5).bfloat16()

    options = (tokens, bias, -100, 0.0, True, True, 2.0**-10)
    through_descriptors = ops.linear_log_probs_forward(e, c, *options)
    through_pointers = ops.linear_log_probs_forward(with_row_stride(e, 105), with_row_stride(c, 105), *options)
    assert [plan.forward for plan in launch_plans] == ["tma", "split"]
    tile_lse, tile_mean_logit = through_descriptors[5:7]
    assert tile_mean_logit.dtype == torch.float16 and tile_mean_logit.shape == tile_lse.shape
    assert (tile_mean_logit <= 1e-2).all() and (tile_mean_logit < -1.0).any()  # a tile's mean logit is under lse
    for got, expected in zip(through_descriptors, through_pointers):  # summed in other orders: 1e-4
        tolerance = {"rtol": 2e-3, "atol": 2e-3} if got.dtype == torch.float16 else {"rtol": 1e-4, "atol": 1e-4}
        torch.testing.assert_close(got, expected, **tolerance)


@pytest.mark.usefixtures("block_sparse_always")
@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=pytest.mark.interpreter)], ids=["cpu", "kernels"])
def test_filtered_with_tokens_a_minus_inf_bias_rules_out(kernels: bool) -> None:
    """Filtered, the ruled-out tokens (p = 0, logit -inf) sit in skipped tiles: their p * logit
    in the put-back and its tilt counts 0, so the gradients stay finite and near exact mode's."""
    e, c, tokens, bias, _ = _case(23, torch.float32, {"bias": True, "ruled_out": True}, lead=(70,), v=190, d=48)
    e = e * 3.0  # sharper rows: the filter skips tiles
    up = torch.randn(70, generator=torch.Generator().manual_seed(3))
    grads = []
    for filter_eps in (2.0**-7, None):
        leaves = [t.clone().requires_grad_() for t in (e, c)]
        with on_kernels(kernels):
            log_probs, entropies = cce_compile.linear_log_probs(*leaves, tokens, bias=bias, entropy=True,
                                                                filter_eps=filter_eps)
        ((log_probs + entropies) * up).sum().backward()
        grads.append([leaf.grad for leaf in leaves])
    for filtered, exact in zip(*grads):
        assert torch.isfinite(filtered).all()
        assert 0.0 < relative_error(filtered, exact) < 5e-2


@pytest.mark.interpreter
@pytest.mark.usefixtures("no_scratch_floor", "block_sparse_always")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_filtered_16_bit_kernels_agree_with_the_cpu_path_to_rounding(dtype: torch.dtype, launch_plans: list) -> None:
    """16-bit inputs through the kernels filtered mode takes (the persistent forward on tensor
    descriptors, its tile mean logits included; the block-sparse backward, fp16's d-logits
    scaled up) land as close to the CPU path as exact mode's kernels do (the dtype's rounding of
    the d-logits tiles and the gradients), well inside what the filter itself moves (2^-7)."""
    def grads(kernels: bool, filter_eps: float | None) -> list[torch.Tensor]:
        return run_filtered(dtype, kernels, filter_eps)[2:]

    filtered_kernels = grads(True, 2.0**-7)
    assert launch_plans[0].forward == "tma" and launch_plans[0].filtered
    filtered_cpu, exact_kernels, exact_cpu = grads(False, 2.0**-7), grads(True, None), grads(False, None)
    for name, fk, fc, ek, ec in zip(("e", "c", "bias"), filtered_kernels, filtered_cpu, exact_kernels, exact_cpu):
        rounding = relative_error(ek, ec)
        assert relative_error(fk, fc) <= 1.5 * rounding, f"d{name}: {relative_error(fk, fc):.1e} vs {rounding:.1e}"
        assert relative_error(fc, ec) >= 3.0 * rounding, f"d{name}: the filter moved it little"
