"""Bad input raises a clear error that names the argument and what was expected."""

from __future__ import annotations

from fractions import Fraction

import numpy
import pytest
import torch

import cce_compile
from cce_compile import api

from .op_cases import on_kernels


def good():
    return torch.randn(6, 8), torch.randn(20, 8), torch.randint(0, 20, (6,))


@pytest.mark.parametrize(
    ("change", "error", "pattern"),
    [
        (lambda e, c, t: (e[:, :5], c, t), ValueError, r"e's last dimension \(5\) must equal c's D \(8\)"),
        (lambda e, c, t: (e, c[None], t), ValueError, r"c must be 2-D"),
        (lambda e, c, t: (e, c, t.float()), TypeError, r"targets must be an integer tensor"),
        (lambda e, c, t: (e, c, t[:4]), ValueError, r"targets must have shape \(6,\)"),
        (lambda e, c, t: (e, c.double(), t), TypeError, r"c must have e's dtype"),
        (lambda e, c, t: (e.double(), c.double(), t), TypeError, r"e must be float32, float16 or bfloat16"),
        (lambda e, c, t: (e, c.to("meta"), t), ValueError, r"c is on meta but e is on cpu"),
        (lambda e, c, t: ([1.0], c, t), TypeError, r"e must be a torch.Tensor"),
        (lambda e, c, t: (e.to("meta"), c.to("meta"), t.to("meta")), ValueError, r"e is on the meta device"),
        (lambda e, c, t: (e, c, t.bool()), TypeError, r"integer dtype that fits int64, e.g. int64 or int32"),
        # 2**64 - 100 read as int64 is -100, ignore_index: the token was silently ignored
        (lambda e, c, t: (e, c, torch.tensor([1, 2, 3, 4, 5, 2**64 - 100], dtype=torch.uint64)), TypeError,
         r"targets must be an integer tensor that fits int64 .* got torch.uint64"),
        (lambda e, c, t: (e[:, :0], c[:, :0], t), ValueError, r"hidden size D >= 1, got D = 0"),
        (lambda e, c, t: (e, c[:0], t), ValueError, r"c must have at least one row \(a vocabulary V >= 1\), got V = 0"),
    ],
)
def test_bad_tensors(change, error, pattern) -> None:
    e, c, t = change(*good())
    with pytest.raises(error, match=pattern):
        cce_compile.linear_cross_entropy(e, c, t)


@pytest.mark.parametrize(("name", "layout"), [
    *((name, "sparse_coo") for name in ("e", "c", "targets", "bias", "weight", "tokens")),
    *((name, "sparse_csr") for name in ("e", "c")),  # CSR is 2-D
])
def test_a_sparse_operand_is_named(name: str, layout: str) -> None:
    """A sparse operand failed inside torch ('reshape is not implemented for sparse tensors',
    'Could not run aten::as_strided ... SparseCPU', a CSR c's 'do not have strides'), naming
    no argument."""
    e, c, t = good()
    operands = {"e": e, "c": c, "targets": t, "tokens": t, "bias": torch.randn(20), "weight": torch.rand(20)}
    operands[name] = operands[name].to_sparse() if layout == "sparse_coo" else operands[name].to_sparse_csr()
    pattern = rf"{name} must be a dense \(strided\) tensor, got layout torch.{layout}"
    with pytest.raises(TypeError, match=pattern):
        if name in ("tokens",):
            cce_compile.linear_log_probs(operands["e"], operands["c"], operands["tokens"])
        else:
            cce_compile.linear_cross_entropy(operands["e"], operands["c"], operands["targets"], bias=operands["bias"],
                                             weight=operands["weight"])


def test_a_nested_hidden_state_is_named() -> None:
    e, c, t = good()
    nested_e = torch.nested.nested_tensor([e[:4], e[4:]], layout=torch.jagged)
    nested_t = torch.nested.nested_tensor([t[:4], t[4:]], layout=torch.jagged)
    with pytest.raises(TypeError, match=r"e must be a dense \(strided\) tensor, got layout torch.jagged"):
        cce_compile.linear_cross_entropy(nested_e, c, nested_t)


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({"reduction": "avg"}, r"reduction must be one of"),
        ({"label_smoothing": -0.1}, r"label_smoothing must be a finite number in \[0, 1\], got -0.1"),
        ({"ignore_index": 2**70}, r"ignore_index must fit in int64"),
        ({"softcap": 0.0}, r"softcap must be a finite number > 0 \(or None\)"),
        ({"softcap": -3.0}, r"softcap must be a finite number > 0"),
        ({"softcap": float("inf")}, r"softcap must be a finite number > 0 \(or None\), got inf"),
        ({"z_loss": -1.0}, r"z_loss must be a finite number in \[0, 3.4e38\]"),
        ({"z_loss": float("nan")}, r"z_loss must be a finite number in \[0, 3.4e38\], got nan"),
        # a float32 constant of the kernels: 1e39 was inf there, and every loss with it
        ({"z_loss": 1e39}, r"z_loss must be a finite number in \[0, 3.4e38\], got 1e\+39"),
        # an int or a fraction past float's range compared finite, then float() raised OverflowError
        ({"label_smoothing": Fraction(10**400)}, r"label_smoothing must be a finite number in \[0, 1\]"),
        ({"temperature": 0}, r"temperature must be a finite number >= 1e-20, got 0"),
        ({"temperature": 1e-300}, r"temperature must be a finite number >= 1e-20, got 1e-300"),
        ({"filter_eps": 2.0}, r"filter_eps must be None, 'auto' or a float in \(0, 1\)"),
        ({"bias": torch.randn(19)}, r"bias must have shape \(20,\)"),
        ({"weight": torch.ones(20, dtype=torch.int64)}, r"weight must be None or a 1-D float tensor of shape \(20,\)"),
        ({"weight": torch.ones(20, requires_grad=True)}, r"weight must not require grad"),
    ],
)
def test_bad_options(options, pattern) -> None:
    with pytest.raises(ValueError, match=pattern):
        cce_compile.linear_cross_entropy(*good(), **options)


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({"label_smoothing": "0.1"}, r"label_smoothing must be a number in \[0, 1\], got str"),
        ({"z_loss": None}, r"z_loss must be a number in \[0, 3.4e38\], got NoneType"),
        ({"softcap": True}, r"softcap must be a number > 0 \(or None\), got bool"),
        ({"ignore_index": 0.5}, r"ignore_index must be an int, got float"),
        ({"bias": [0.0] * 20}, r"bias must be None or a torch.Tensor, got list"),
        ({"weight": [1.0] * 20}, r"weight must be None or a torch.Tensor, got list"),
        ({"shift": "false"}, r"shift must be a bool, got str"),
        ({"return_lse": "no"}, r"return_lse must be a bool, got str"),
        ({"shift": numpy.bool_(True)}, r"shift must be a bool, got numpy.bool"),
    ],
)
def test_options_of_the_wrong_type(options, pattern) -> None:
    """An option of the wrong Python type is named, not left to fail deep inside the call."""
    with pytest.raises(TypeError, match=pattern):
        cce_compile.linear_cross_entropy(*good(), **options)


@pytest.mark.parametrize(
    "options",
    [{"label_smoothing": 0.1}, {"z_loss": 1e-3}, {"softcap": 30.0}, {"temperature": 0.7}, {"filter_eps": 1e-3}],
)
def test_numpy_float32_options_are_taken_as_floats(options) -> None:
    """A config read through numpy hands float32 scalars: each float option takes them as the float."""
    as_numpy = {name: numpy.float32(value) for name, value in options.items()}
    as_float = {name: float(value) for name, value in as_numpy.items()}
    inputs = good()
    torch.testing.assert_close(cce_compile.linear_cross_entropy(*inputs, **as_numpy),
                               cce_compile.linear_cross_entropy(*inputs, **as_float))


def test_shift_of_sequences_of_no_position_gives_empty_outputs() -> None:
    """(B, 0) positions shifted: nothing to score, no padding column (which made (B, 1))."""
    e, c = torch.randn(2, 0, 8), torch.randn(100, 8)
    tokens = torch.zeros(2, 0, dtype=torch.long)
    assert cce_compile.linear_log_probs(e, c, tokens, shift=True).shape == (2, 0)
    assert cce_compile.linear_cross_entropy(e, c, tokens, shift=True, reduction="none").shape == (2, 0)
    assert cce_compile.linear_cross_entropy(e, c, tokens, shift=True).item() == 0.0


def test_error_leaves_no_state_behind() -> None:
    """A rejected call changes nothing: the next good call gives the reference answer."""
    e, c, t = good()
    with pytest.raises(ValueError):
        cce_compile.linear_cross_entropy(e, c, t, reduction="bad")
    expected = torch.nn.functional.cross_entropy(e @ c.T, t)
    torch.testing.assert_close(cce_compile.linear_cross_entropy(e, c, t), expected)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_targets_of_any_integer_dtype_give_the_int64_answer(dtype: torch.dtype) -> None:
    """Shifted too: the ignored last position's -100 is not wrapped into the narrow dtype."""
    e, c, t = good()
    for shift in (False, True):
        expected = cce_compile.linear_cross_entropy(e, c, t, shift=shift)
        torch.testing.assert_close(cce_compile.linear_cross_entropy(e, c, t.to(dtype), shift=shift), expected)


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({"reduction": "avg"}, r"reduction must be one of"),
        ({"label_smoothing": 1.5}, r"label_smoothing must be a finite number in \[0, 1\]"),
        ({"softcap": 0.0}, r"softcap must be a finite number > 0"),
        ({"z_loss": -1.0}, r"z_loss must be a finite number in \[0, 3.4e38\]"),
        ({"temperature": 0.0}, r"temperature must be a finite number >= 1e-20"),
        ({"memory": "huge"}, r"memory must be one of"),
        ({"filter_eps": "fast"}, r"filter_eps must be None, 'auto' or a float"),
        ({"weight": torch.ones(3, 3)}, r"weight must be None or a 1-D float tensor"),
        ({"weight": torch.ones(20, requires_grad=True)}, r"weight must not require grad"),
    ],
)
def test_the_module_checks_its_options_at_construction(options, pattern) -> None:
    """As the function checks them (a bad one once passed construction and failed at the
    first call)."""
    with pytest.raises(ValueError, match=pattern):
        cce_compile.LinearCrossEntropyLoss(**options)


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({"weight": [1.0] * 20}, r"weight must be None or a torch.Tensor, got list"),
        ({"vocab_parallel": "x"}, r"vocab_parallel must be a VocabParallel or None, got str"),
    ],
)
def test_the_module_checks_its_options_types_at_construction(options, pattern) -> None:
    with pytest.raises(TypeError, match=pattern):
        cce_compile.LinearCrossEntropyLoss(**options)


def test_the_module_repr_shows_its_options() -> None:
    module = cce_compile.LinearCrossEntropyLoss(reduction="sum", label_smoothing=0.1, filter_eps="auto",
                                                weight=torch.ones(20))
    shown = repr(module)
    for part in ("reduction='sum'", "label_smoothing=0.1", "filter_eps='auto'", "ignore_index=-100",
                 "memory='workspace'", "weight=(20,) float32"):
        assert part in shown, shown


def test_the_module_takes_every_option_of_the_function() -> None:
    """LinearCrossEntropyLoss(**options) for every keyword option of linear_cross_entropy (bias
    is the forward's argument); flags of the wrong type are refused at construction."""
    import inspect

    function = set(inspect.signature(cce_compile.linear_cross_entropy).parameters) - {"e", "c", "targets", "bias"}
    assert function == set(inspect.signature(cce_compile.LinearCrossEntropyLoss).parameters)
    with pytest.raises(TypeError, match="return_lse must be a bool, got list"):
        cce_compile.LinearCrossEntropyLoss(return_lse=[0])
    with pytest.raises(TypeError, match="shift must be a bool, got str"):
        cce_compile.linear_log_probs(*good(), shift="no")


@pytest.mark.parametrize("transform", ["jvp", "grad", "vmap of jvp", "dual tensors"])
@pytest.mark.parametrize("function", ["loss", "log_probs"])
def test_function_transforms_and_forward_mode_are_refused_by_name(transform: str, function: str) -> None:
    """torch.library's custom ops give jvp and dual tensors a zero tangent without an error
    (once a silently wrong directional derivative) and fail grad in torch's internals."""
    e, c, t = good()
    call = {"loss": lambda x: cce_compile.linear_cross_entropy(x, c, t),
            "log_probs": lambda x: cce_compile.linear_log_probs(x, c, t)}[function]
    with pytest.raises(NotImplementedError, match=r"torch.func's (jvp|grad)|forward-mode AD") as raised:
        if transform == "jvp":
            torch.func.jvp(call, (e,), (torch.randn_like(e),))
        elif transform == "grad":
            torch.func.grad(lambda x: call(x).sum())(e)
        elif transform == "vmap of jvp":
            torch.func.vmap(lambda x: torch.func.jvp(call, (x,), (x,))[1])(e[None].expand(2, -1, -1))
        else:
            with torch.autograd.forward_ad.dual_level():
                call(torch.autograd.forward_ad.make_dual(e, torch.randn_like(e)))
    assert "backward()" in str(raised.value)
    with torch.autograd.forward_ad.dual_level():  # plain tensors inside a dual level are not refused
        assert torch.isfinite(call(e)).all()


@pytest.mark.parametrize("memory", ["workspace", "low"])
def test_vmap_runs(memory: str) -> None:
    """vmap over a batch of hidden states, with and without gradients (the refusal above once
    took vmap with it; the fused forward, asked for no dE by the batched e's requires_grad,
    once failed autograd's shape check)."""
    e, c, t = good()
    batch = torch.stack([e, 2 * e])
    per_item = torch.func.vmap(lambda x: cce_compile.linear_cross_entropy(x, c, t, reduction="sum", memory=memory))
    torch.testing.assert_close(per_item(batch), torch.stack([cce_compile.linear_cross_entropy(
        x, c, t, reduction="sum", memory=memory) for x in batch]))
    leaves, expected = [batch.clone().requires_grad_(), c.clone().requires_grad_()], [batch.clone(), c.clone()]
    torch.func.vmap(lambda x: cce_compile.linear_cross_entropy(x, leaves[1], t, reduction="sum", memory=memory))(
        leaves[0]).sum().backward()
    expected = [tensor.requires_grad_() for tensor in expected]
    sum(cce_compile.linear_cross_entropy(x, expected[1], t, reduction="sum", memory=memory)
        for x in expected[0]).backward()
    for leaf, reference in zip(leaves, expected):
        torch.testing.assert_close(leaf.grad, reference.grad)


def test_vmap_over_targets_runs() -> None:
    """vmap over the targets too (a batch of sequences, each its tokens): the eager range check
    once branched on a batched tensor's values, which vmap refuses ("data-dependent control flow")."""
    e, c, t = good()
    tokens = torch.stack([t, t.roll(1)])
    batch = torch.stack([e, 2 * e])
    with torch.no_grad():
        log_probs = torch.func.vmap(lambda x, y: cce_compile.linear_log_probs(x, c, y))(batch, tokens)
        losses = torch.func.vmap(lambda x, y: cce_compile.linear_cross_entropy(x, c, y, reduction="sum"))(batch, tokens)
        torch.testing.assert_close(log_probs, torch.stack([cce_compile.linear_log_probs(x, c, y)
                                                           for x, y in zip(batch, tokens)]))
        torch.testing.assert_close(losses, torch.stack([cce_compile.linear_cross_entropy(x, c, y, reduction="sum")
                                                        for x, y in zip(batch, tokens)]))
        out_of_range = t.clone()
        out_of_range[0] = c.shape[0]
        with pytest.raises(ValueError, match="targets must be in"):  # targets vmap does not batch are checked
            torch.func.vmap(lambda x: cce_compile.linear_cross_entropy(x, c, out_of_range, reduction="sum"))(batch)


OUT_OF_RANGE_CALLS = {
    # name: (call, its path: "fused" (the fused forward, which fp16 does not take), "filtered", or
    # None for the recompute)
    "mean, workspace": (lambda e, c, t, b: cce_compile.linear_cross_entropy(e, c, t), "fused"),
    "sum, smoothing, z-loss, bias, workspace": (lambda e, c, t, b: cce_compile.linear_cross_entropy(
        e, c, t, bias=b, reduction="sum", label_smoothing=0.1, z_loss=1e-3), "fused"),
    "mean, low": (lambda e, c, t, b: cce_compile.linear_cross_entropy(e, c, t, memory="low"), None),
    "none, weights, bias": (lambda e, c, t, b: cce_compile.linear_cross_entropy(
        e, c, t, bias=b, weight=torch.linspace(0.5, 1.5, c.shape[0]), reduction="none"), None),
    "filtered": (lambda e, c, t, b: cce_compile.linear_cross_entropy(e, c, t, filter_eps=2**-10), "filtered"),
    "log_probs, bias": (lambda e, c, t, b: cce_compile.linear_log_probs(e, c, t, bias=b), None),
    "log_probs, entropy": (lambda e, c, t, b: cce_compile.linear_log_probs(e, c, t, entropy=True), None),
    "log_probs, entropy, filtered": (
        lambda e, c, t, b: cce_compile.linear_log_probs(e, c, t, entropy=True, filter_eps=2**-10), "filtered"),
}


def _out_of_range_step(call, e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor, bias: torch.Tensor):
    """(outputs, dE, dC, dbias or None) of `call` under upstream gradients of every output:
    0 for tokens past V (as a loss that masks them with torch.where gives them), not 0 elsewhere."""
    leaves = [t.detach().clone().requires_grad_() for t in (e, c, bias)]
    outputs = call(*leaves[:2], targets, leaves[2])
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    upstream = [torch.where(targets >= c.shape[0], 0.0, torch.linspace(0.5, 1.5, out.numel())).reshape(out.shape)
                if out.dim() else torch.ones(()) for out in outputs]
    torch.autograd.backward(outputs, upstream)
    return outputs, *(leaf.grad for leaf in leaves)


@pytest.mark.usefixtures("block_sparse_always")
@pytest.mark.parametrize(("kernels", "dtype"), [
    (False, torch.float32), (False, torch.bfloat16),
    *(pytest.param(True, dtype, marks=pytest.mark.interpreter)
      for dtype in (torch.float32, torch.bfloat16, torch.float16)),
], ids=["cpu-fp32", "cpu-bf16", "kernels-fp32", "kernels-bf16", "kernels-fp16"])
@pytest.mark.parametrize("name", list(OUT_OF_RANGE_CALLS))
def test_out_of_range_target_makes_the_gradients_nan(
    name: str, kernels: bool, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch, launch_plans: list,
) -> None:
    """Past the eager CPU check (as on the GPU and under torch.compile) a target outside [0, V)
    gives its token a NaN loss or log-prob; its gradients must be NaN too, on every path, for a
    grad scaler (which reads the gradients, not the loss) to skip the step, not apply one
    computed as if the token were not there. All of dC and dbias, and dE at that token; an
    ignored token's dE row stays 0, and a batch of ignored tokens alone stays finite (zero)."""
    monkeypatch.setattr(api, "_check_target_range", lambda *args, **kwargs: None)
    call, path = OUT_OF_RANGE_CALLS[name]
    g = torch.Generator().manual_seed(0)
    n, v, d = 40, 64, 16
    e, c = (torch.randn(rows, d, generator=g).div(2).to(dtype) for rows in (n, v))
    bias = torch.randn(v, generator=g).div(4).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    targets[3], targets[5], targets[6] = -100, v + 10**9, v  # ignored, far past V, just past V
    targets[9] = -7
    bad = torch.tensor([5, 6, 9])
    with on_kernels(kernels):
        outputs, grad_e, grad_c, grad_bias = _out_of_range_step(call, e, c, targets, bias)
        assert all((p.backward is None) != kernels for p in launch_plans)
        fused = path == "fused" and dtype != torch.float16  # fp16 takes no fused forward
        assert len(launch_plans) == (1 if fused else 2), f"{name}: {len(launch_plans)} launch plans"
        assert all(p.filtered == (path == "filtered") for p in launch_plans)
        first = outputs[0]
        assert torch.isnan(first).all() if first.dim() == 0 else torch.isnan(first[bad]).all()
        assert torch.isnan(grad_c).all(), f"{name}: dC has finite entries"
        assert torch.isnan(grad_e[bad]).all(), f"{name}: dE of an out-of-range token is finite"
        assert grad_bias is None or torch.isnan(grad_bias).all(), f"{name}: dbias has finite entries"
        assert (grad_e[3] == 0).all(), f"{name}: an ignored token's dE row is not 0"
        _, grad_e, grad_c, grad_bias = _out_of_range_step(call, e, c, torch.full_like(targets, -100), bias)
        for grad in (grad_e, grad_c, grad_bias):
            assert grad is None or not grad.float().any(), f"{name}: an all-ignored batch's gradients are not 0"


@pytest.mark.parametrize("name", ["mean, workspace", "none, weights, bias", "log_probs, entropy"])
def test_out_of_range_target_under_compile_makes_the_gradients_nan(name: str) -> None:
    """Under torch.compile the eager range check is skipped (no host sync in a graph): the
    compiled call's gradients are NaN where its loss or log-prob is, as eager calls past it."""
    call, _ = OUT_OF_RANGE_CALLS[name]
    g = torch.Generator().manual_seed(0)
    e, c = torch.randn(8, 16, generator=g), torch.randn(20, 16, generator=g)
    bias = torch.randn(20, generator=g)
    targets = torch.randint(0, 20, (8,), generator=g)
    targets[1], targets[2] = -100, 25
    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
    outputs, grad_e, grad_c, _ = _out_of_range_step(compiled, e, c, targets, bias)
    assert torch.isnan(outputs[0]).all() if outputs[0].dim() == 0 else torch.isnan(outputs[0][2])
    assert torch.isnan(grad_c).all() and torch.isnan(grad_e[2]).all() and (grad_e[1] == 0).all()


@pytest.mark.parametrize("trace", ["FakeTensorMode", "make_fx real", "make_fx fake"])
def test_shape_propagation_with_fake_tensors_runs(trace: str) -> None:
    """FakeTensorMode (shape propagation) and make_fx trace the ops through their fake
    functions: the eager CPU range check, which reads the targets' values, once raised torch's
    DataDependentOutputException from inside it there (targets a fake tensor holds no values)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    e, c, t = good()

    def calls(e, c, t):
        loss = cce_compile.linear_cross_entropy(e, c, t, reduction="none")
        return loss, cce_compile.linear_cross_entropy(e, c, t, memory="low"), cce_compile.linear_log_probs(e, c, t)

    if trace == "FakeTensorMode":
        with FakeTensorMode() as mode:
            fake_e = mode.from_tensor(e).requires_grad_()
            per_token, mean, log_probs = calls(fake_e, mode.from_tensor(c), mode.from_tensor(t))
            (per_token.sum() + mean + log_probs.sum()).backward()
            assert per_token.shape == (6,) and mean.shape == () and log_probs.shape == (6,)
            assert per_token.dtype == torch.float32 and fake_e.grad.shape == e.shape
    else:
        graph = make_fx(calls, tracing_mode="real" if trace == "make_fx real" else "fake")(e, c, t)
        for got, want in zip(graph(e, c, t), calls(e, c, t)):
            torch.testing.assert_close(got, want)
