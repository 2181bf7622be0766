"""The fused forward (memory="workspace"): gradients computed in the forward for a scalar
loss, scaled by the backward; what autograd users do with it, and when it applies."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import cce_compile
from cce_compile.config.kernel_config import KernelConfig
from cce_compile.plan.launch import Options, gradients_in_forward, workspace_rows
from cce_compile.plan.policy import Policy

from .op_cases import SMALL_TILES, TOLERANCE, make_inputs, relative_error
from .reference import reference_loss

PATHS = [  # the interpreter mark runs the Triton kernels (tests/conftest.py)
    pytest.param(False, id="cpu"), pytest.param(True, id="interpreter", marks=pytest.mark.interpreter)]
SMALL_CHUNKS = replace(SMALL_TILES, workspace_rows=128)
"""Tiles the interpreter runs quickly, and token chunks of 128 rows: several per call."""


def leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_() for t in tensors]


def grads(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.grad.clone() for t in tensors]


@pytest.mark.parametrize("path", PATHS)
def test_several_chunks_match_float64(path: bool) -> None:
    e, c, targets = make_inputs("zipf", (300,), 500, 32, torch.float32, seed=3)
    targets[::7] = -100
    bias = torch.randn(500) * 0.1
    weight = torch.rand(500) + 0.5
    ours, ref = leaves(e, c, bias), leaves(e.double(), c.double(), bias.double())
    # a sum: a class-weighted mean with z-loss takes the recompute (test_op_options)
    options = {"label_smoothing": 0.1, "z_loss": 1e-3, "reduction": "sum"}
    with cce_compile.override_config(SMALL_CHUNKS):
        loss = cce_compile.linear_cross_entropy(*ours[:2], targets, bias=ours[2], weight=weight, **options)
    expected = reference_loss(*ref[:2], targets, bias=ref[2], weight=weight, **options)
    assert loss.grad_fn.name().startswith("GeneratedBackwardFor_cce_linear_cross_entropy_fused")
    (loss * 1.5).backward()
    (expected * 1.5).backward()
    assert relative_error(loss, expected) < 1e-6
    for got, want in zip(ours, ref):
        assert relative_error(got.grad, want.grad) < 1e-5


FUSED_OPTIONS = {
    "plain": {},
    "softcap": {"softcap": 4.0},
    "bias and softcap": {"bias": True, "softcap": 3.0},
    "weights, smoothing, z-loss, sum": {"weight": True, "label_smoothing": 0.1, "z_loss": 1e-3, "reduction": "sum"},
    "sum, ignore_index": {"reduction": "sum", "ignore_index": 7},
    "shift, temperature": {"shift": True, "temperature": 0.8},
    "frozen head": {"frozen": "c"},
    "frozen hidden states": {"frozen": "e", "bias": True},
    "autocast": {"autocast": True},
}
"""Every option the fused forward takes (plan.launch.gradients_in_forward), one at a time or
as users combine them."""


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", FUSED_OPTIONS)
def test_every_option_on_the_fused_path_matches_float64(case: str, dtype: torch.dtype, path: bool,
                                                       launch_plans: list) -> None:
    """The fused forward's loss and gradients against float64, per option, on the plain-PyTorch
    path and the interpreted kernels (bf16's on tensor descriptors, fp32's on pointers), over
    several token chunks; the call did take the fused forward. Autocast runs fp32 inputs in bf16."""
    options = dict(FUSED_OPTIONS[case])
    frozen, autocast = options.pop("frozen", None), options.pop("autocast", False)
    temperature = options.pop("temperature", 1.0)
    e, c, targets = make_inputs("zipf", (2, 75), 301, 40, torch.float32 if autocast else dtype, seed=31)
    if "ignore_index" in options:
        targets[targets == 3] = options["ignore_index"]
    g = torch.Generator().manual_seed(32)
    bias = (torch.randn(301, generator=g) * 0.3).to(e.dtype) if options.pop("bias", False) else None
    weight = torch.rand(301, generator=g) + 0.5 if options.pop("weight", False) else None
    tensors = (e, c) + ((bias,) if bias is not None else ())
    ours, ref = leaves(*tensors), leaves(*(t.double() for t in tensors))
    for name, ours_leaf, ref_leaf in zip("ec", ours, ref):
        if name == frozen:
            ours_leaf.requires_grad_(False)
            ref_leaf.requires_grad_(False)
    with cce_compile.override_config(SMALL_CHUNKS), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        loss = cce_compile.linear_cross_entropy(*ours[:2], targets, bias=ours[2] if bias is not None else None,
                                                weight=weight, temperature=temperature, **options)
    assert loss.grad_fn.name().startswith("GeneratedBackwardFor_cce_linear_cross_entropy_fused")
    kernel = "tma" if autocast or dtype == torch.bfloat16 else "pointer"
    assert [plan.fused for plan in launch_plans] == [kernel if path else "cpu"]
    scaled = [t / temperature for t in ref[:1] + ref[2:]]  # logits / T: e and bias divided
    expected = reference_loss(scaled[0], ref[1], targets, bias=scaled[1] if bias is not None else None,
                              weight=weight, **options)
    (loss * 1.5).backward()
    (expected * 1.5).backward()
    tol = TOLERANCE[torch.bfloat16 if autocast else dtype]
    assert relative_error(loss, expected) < tol
    for got, want in zip(ours, ref):
        if not want.requires_grad:
            assert got.grad is None
            continue
        assert got.grad.dtype == got.dtype and relative_error(got.grad, want.grad) < tol, relative_error(got.grad, want.grad)


@pytest.mark.interpreter
def test_rows_far_above_their_shift_are_done_again() -> None:
    """Rows whose logits spread by hundreds (lse hundreds above the mean logit, where
    exp(logit - mean) overflows) take their largest logit as the shift and stay exact."""
    e, c, targets = make_inputs("signed", (150,), 300, 32, torch.float32, seed=5)
    e[:20] *= 80.0
    ours, ref = leaves(e, c), leaves(e.double(), c.double())
    with cce_compile.override_config(SMALL_CHUNKS):
        loss = cce_compile.linear_cross_entropy(*ours, targets)
    expected = reference_loss(*ref, targets)
    loss.backward()
    expected.backward()
    assert torch.isfinite(loss) and relative_error(loss, expected) < 1e-6
    for got, want in zip(ours, ref):
        assert relative_error(got.grad, want.grad) < 1e-5


@pytest.mark.interpreter
@pytest.mark.parametrize("sampled_scale", [30.0, -30.0])
def test_a_shift_from_an_unrepresentative_sample_of_the_vocabulary_stays_exact(sampled_scale: float) -> None:
    """The shift averages every Policy.fused_shift_stride-th row of c and bias. Rows of c (and
    bias entries) in that sample made unlike the rest, their logits 30 x the others' (the shift
    near the largest logit) or -30 x (far below, so the rows are done again): still exact."""
    stride = Policy().fused_shift_stride
    e, c, targets = make_inputs("signed", (150,), 300, 32, torch.float32, seed=7)
    bias = torch.randn(300) * 0.5
    c[::stride] *= sampled_scale
    bias[::stride] *= sampled_scale
    ours, ref = leaves(e, c, bias), leaves(e.double(), c.double(), bias.double())
    with cce_compile.override_config(SMALL_CHUNKS):
        loss = cce_compile.linear_cross_entropy(*ours[:2], targets, bias=ours[2])
    expected = reference_loss(*ref[:2], targets, bias=ref[2])
    assert loss.grad_fn.name().startswith("GeneratedBackwardFor_cce_linear_cross_entropy_fused")
    loss.backward()
    expected.backward()
    assert torch.isfinite(loss) and relative_error(loss, expected) < 1e-6
    for got, want in zip(ours, ref):
        assert relative_error(got.grad, want.grad) < 1e-5


@pytest.mark.interpreter
@pytest.mark.parametrize("masked", ["one sampled", "every sampled"])
def test_a_minus_inf_bias_in_the_shift_sample_redoes_no_row(masked: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens a -inf bias masks (padding rows of the vocabulary) are left out of the shift's
    mean: in it, one would make every shift -inf and every row of every chunk run its logits
    pass again. Where the whole sample is masked the rows are redone: exact either way."""
    from cce_compile.ops import forward_fused

    stride = Policy().fused_shift_stride
    e, c, targets = make_inputs("signed", (150,), 300, 32, torch.float32, seed=9)
    bias = torch.randn(300) * 0.5
    if masked == "one sampled":
        bias[stride * 3] = float("-inf")
    else:
        bias[::stride] = float("-inf")
    targets = torch.where(torch.isinf(bias[targets]), 1, targets)  # no target is masked
    redone = []
    run = forward_fused.FusedKernels.run

    def counting(self, row_start, rows, scale, losses):
        run(self, row_start, rows, scale, losses)
        redone.append(int(self.redo_rows[:rows].sum()))

    monkeypatch.setattr(forward_fused.FusedKernels, "run", counting)
    ours, ref = leaves(e, c, bias), leaves(e.double(), c.double(), bias.double())
    with cce_compile.override_config(SMALL_CHUNKS):
        loss = cce_compile.linear_cross_entropy(*ours[:2], targets, bias=ours[2])
    expected = reference_loss(*ref[:2], targets, bias=ref[2])
    loss.backward()
    expected.backward()
    assert sum(redone) == (0 if masked == "one sampled" else 150)
    assert torch.isfinite(loss) and relative_error(loss, expected) < 1e-6
    for got, want in zip(ours, ref):
        assert relative_error(got.grad, want.grad) < 1e-5


@pytest.mark.parametrize("path", PATHS)
def test_retain_graph_accumulation_and_checkpointing(path: bool) -> None:
    """A second backward through a retained graph, gradient accumulation over two calls, and
    activation checkpointing (the forward run again under grad) all give the recompute's
    gradients."""
    e, c, targets = make_inputs("zipf", (200,), 400, 32, torch.float32, seed=7)

    def run(memory: str, how: str) -> list[torch.Tensor]:
        ee, cc = leaves(e, c)

        def loss_of(hidden: torch.Tensor) -> torch.Tensor:
            return cce_compile.linear_cross_entropy(hidden, cc, targets, memory=memory)

        with cce_compile.override_config(SMALL_CHUNKS):
            if how == "retained":
                loss = loss_of(ee)
                loss.backward(retain_graph=True)
                (2.0 * loss).backward()
            elif how == "accumulated":
                loss_of(ee).backward()
                loss_of(ee * 0.5).backward()
            else:
                checkpoint(loss_of, ee, use_reentrant=how == "reentrant").backward()
        return grads([ee, cc])

    for how in ("retained", "accumulated", "reentrant", "non-reentrant"):
        for got, want in zip(run("workspace", how), run("low", how)):
            assert relative_error(got, want) < 1e-5, how


def test_double_backward_is_a_clear_error() -> None:
    """A second backward through the op's gradients is a named error on every path; the fused
    forward, whose gradients exist before any backward, refuses to record their graph at all,
    while the recompute's and log-probs' record it, so that a second order through other
    parameters (a penalty on their gradients) runs."""
    e, c, targets = make_inputs("zipf", (40,), 100, 16, torch.float32, seed=1)
    ee, cc = leaves(e, c)
    with pytest.raises(RuntimeError, match="cannot record a backward graph"):
        torch.autograd.grad(cce_compile.linear_cross_entropy(ee, cc, targets), ee, create_graph=True)
    cc = torch.nn.Parameter(c.clone())  # as an lm_head's weight is
    other = torch.randn(5, requires_grad=True)
    for output in (cce_compile.linear_cross_entropy(ee, cc, targets, memory="low"),
                   cce_compile.linear_cross_entropy(ee, cc, targets, reduction="none").sum(),
                   cce_compile.linear_log_probs(ee, cc, targets).sum()):
        grad_e, grad_other = torch.autograd.grad(output + (other**4).sum(), (ee, other), create_graph=True)
        (grad_other**2).sum().backward(retain_graph=True)  # second order elsewhere: fine
        with pytest.raises(RuntimeError, match="has no double backward: its gradients come from kernels"):
            (grad_e**2).sum().backward()


def test_a_second_backward_without_retain_graph_is_a_clear_error() -> None:
    """The gradients were handed to the first backward (scaled in place): a second one says so
    and how to keep them, instead of scaling them again."""
    e, c, targets = make_inputs("zipf", (40,), 100, 16, torch.float32, seed=1)
    ee, cc = leaves(e, c)
    loss = cce_compile.linear_cross_entropy(ee, cc, targets)
    loss.backward()
    with pytest.raises(RuntimeError, match="already backpropagated.*retain_graph=True"):
        loss.backward()


def test_a_forward_without_grad_runs_the_plain_forward(fused_outputs: list) -> None:
    """Evaluation (no_grad), a loss nobody differentiates, reduction="none" and return_lse
    never take the fused forward; a training call does."""
    e, c, targets = make_inputs("zipf", (40,), 100, 16, torch.float32, seed=2)
    ee, cc = leaves(e, c)
    with torch.no_grad():
        cce_compile.linear_cross_entropy(ee, cc, targets)
    cce_compile.linear_cross_entropy(e, c, targets)
    cce_compile.linear_cross_entropy(ee, cc, targets, reduction="none")
    cce_compile.linear_cross_entropy(ee, cc, targets, return_lse=True)
    assert fused_outputs == []
    cce_compile.linear_cross_entropy(ee, cc, targets)
    assert fused_outputs == [(40 * 16, 100 * 16)]


def test_which_calls_take_the_fused_forward() -> None:
    plain = Options()
    assert gradients_in_forward(plain, "bfloat16", "mean", "workspace", has_z_loss=True)
    assert gradients_in_forward(plain, "float32", "sum", "workspace", has_z_loss=False)
    assert not gradients_in_forward(plain, "bfloat16", "mean", "low", has_z_loss=False)
    assert not gradients_in_forward(plain, "bfloat16", "none", "workspace", has_z_loss=False)
    assert not gradients_in_forward(plain, "float16", "mean", "workspace", has_z_loss=False)
    assert not gradients_in_forward(Options(filtered=True), "bfloat16", "mean", "workspace", has_z_loss=False)
    assert not gradients_in_forward(Options(has_softcap=True, has_smoothing=True), "bfloat16", "mean", "workspace",
                                    has_z_loss=False)
    weighted = Options(has_softcap=True, has_bias=True, has_weight=True)
    assert gradients_in_forward(weighted, "bfloat16", "mean", "workspace", has_z_loss=False)
    assert gradients_in_forward(weighted, "bfloat16", "sum", "workspace", has_z_loss=True)
    assert not gradients_in_forward(weighted, "bfloat16", "mean", "workspace", has_z_loss=True)  # two totals


@pytest.mark.parametrize(("n", "d", "v"), [(8192, 2304, 256000), (8192, 4096, 128256), (16384, 896, 151936),
                                           (4096, 8192, 128256), (300, 64, 50000)])
def test_the_workspace_stays_within_its_share_of_the_gradients(n: int, d: int, v: int) -> None:
    """The workspace and its per-row buffers fit the policy's share of the gradients, so
    with the gradients themselves the call stays under 2x them; tuned rows override."""
    policy = Policy()
    rows = workspace_rows(n, v, d, 2, KernelConfig(), policy)
    grad_bytes = (n * d + v * d) * 2
    assert rows % 128 == 0 and 128 <= rows <= -(-n // 128) * 128
    assert rows * (v * 2 + d * 6) <= policy.workspace_fraction * grad_bytes or rows == 128
    assert workspace_rows(n, v, d, 2, KernelConfig(workspace_rows=256), policy) == min(256, -(-n // 128) * 128)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["descriptors", "pointers"])
@pytest.mark.parametrize("options", [{}, {"label_smoothing": 0.1, "z_loss": 1e-3}, {"softcap": 20.0}],
                         ids=["plain", "smoothing", "softcap"])
def test_compile_ahead_starts_the_launches_the_chunk_loop_makes(dtype: torch.dtype, options: dict,
                                                                monkeypatch: pytest.MonkeyPatch, use_policy) -> None:
    """FusedKernels.compile_ahead starts exactly the compiles the chunk loop's launches need:
    the same (kernel, launch_key) pairs, with its stand-in shift and one chunk per distinct
    integer class (1000 rows in chunks of 128, the last ragged at 104). Compiling needs a GPU
    (tests/test_gpu.py); here both sides record what each launch would need compiled."""
    from cce_compile.ops import forward_fused
    from cce_compile.ops.launch import launch_key
    from cce_compile.ops.problem import options_of, problem_of
    from cce_compile.plan.launch import plan_launch

    needed: dict[str, set] = {"ahead": set(), "launched": set()}

    def recorder(side: str) -> type:
        class Recording:
            def __init__(self, kernel, reuse: bool = True) -> None:
                self.kernel = kernel

            def __call__(self, grid, *args, **kwargs) -> None:
                needed[side].add((self.kernel.fn.__name__, launch_key(args, kwargs)))

        return Recording

    policy = use_policy(triton_on_cpu=True)
    monkeypatch.setattr(forward_fused, "KernelLauncher", recorder("launched"))
    monkeypatch.setattr(forward_fused, "AheadCompiler", recorder("ahead"))
    e, c, targets = make_inputs("zipf", (1000,), 500, 32, dtype, seed=4)
    smoothing, softcap = options.get("label_smoothing", 0.0), options.get("softcap", 0.0)
    plan = plan_launch(problem_of(e, c), options_of(None, None, softcap, smoothing, 0.0, 1.0), SMALL_CHUNKS, policy)
    assert plan.fused == ("tma" if dtype == torch.bfloat16 else "pointer")
    fused = forward_fused.FusedForward(plan, SMALL_CHUNKS, e, c, targets, None, None, -100, smoothing, softcap,
                                       options.get("z_loss", 0.0), "mean", True, True)
    fused.kernels.compile_ahead(fused.scale, fused.losses)
    fused.chunk_loop()
    assert needed["ahead"] == needed["launched"]
    assert len({name for name, _ in needed["launched"]}) == (4 if plan.fused == "tma" else 3)  # the chunk pass is the redo's kernel
    assert len(needed["launched"]) > len({name for name, _ in needed["launched"]})  # the ragged chunk's variants


def test_bf16_gradients_of_the_classifier_are_summed_over_token_chunks_in_fp32(launch_plans: list) -> None:
    """The plain-PyTorch path's fused forward sums dC and dbias over its token chunks in fp32
    and rounds once, as the recompute's single GEMM over all tokens does: over 32 chunks of
    128 rows, within 1.2 x the rounding of float64's gradients to bf16 (both at 1.0 x). dC
    summed in bf16, each chunk's share rounded and added to the rounded sum, was 3.2 x that
    rounding (5.6e-3 against 1.8e-3); dbias, each chunk's rounded then summed in fp32, 1.03 x."""
    e, c, targets = make_inputs("zipf", (4096,), 301, 64, torch.bfloat16, seed=5)
    bias = (torch.randn(301, generator=torch.Generator().manual_seed(6)) * 0.3).bfloat16()
    ours, ref = leaves(e, c, bias), leaves(e.double(), c.double(), bias.double())
    with cce_compile.override_config(SMALL_CHUNKS):
        cce_compile.linear_cross_entropy(*ours[:2], targets, bias=ours[2]).backward()
    reference_loss(*ref[:2], targets, bias=ref[2]).backward()
    assert [(plan.fused, plan.workspace_rows) for plan in launch_plans] == [("cpu", 128)]
    for got, want in zip(ours[1:], ref[1:]):
        rounding = relative_error(want.grad.bfloat16(), want.grad)
        assert got.grad.dtype == torch.bfloat16
        assert relative_error(got.grad, want.grad) < 1.2 * rounding, (relative_error(got.grad, want.grad), rounding)
