"""The user-facing API: checks arguments, shapes them for the op, reduces its per-token loss;
linear_log_probs gives per-token log-probabilities and entropies (reinforcement learning)."""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor, nn
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
from torch._subclasses.fake_tensor import is_fake
from torch.autograd import forward_ad

from . import ops
from .ops.loss_terms import out_of_range, reduce_with_z_loss, target_weight
from .ops.precision import without_autocast
from .ops.problem import SUPPORTED_DTYPES, dtype_name, needs_grad, options_of, traced_settings
from .parallel.vocab_parallel import (
    VocabParallel, check_vocab_parallel, is_dtensor, sharded_operands, vocab_parallel_loss,
)
from .plan.launch import Memory, gradients_in_forward

Reduction = Literal["mean", "sum", "none"]
_REDUCTIONS = ("mean", "sum", "none")
_MEMORY = ("workspace", "low")


def _resolve_filter_eps(filter_eps: float | str | None, dtype: torch.dtype) -> float:
    """The op's filter_eps, 0.0 (exact mode) for None. "auto": the dtype's epsilon / 8 (2**-10 for bf16 and fp32), four times
    the paper's eps / 32: what is skipped comes back as each tile's row sums and tilt
    (ops/filtering.SkippedTiles, Tilt), so the coarser filter keeps dE within 2.5-7e-3 of fp32
    on LM-like and heavy-tailed heads at 1.8-2.3 x a GEMM on the H200, where 2^-12 took 1.9-3.4 x
    (docs/notes/filtered-put-back.md)."""
    if filter_eps is None:
        return 0.0
    if filter_eps == "auto":
        return torch.finfo(dtype).eps / 8 if dtype != torch.float32 else 2.0**-10
    real = isinstance(filter_eps, numbers.Real) and not isinstance(filter_eps, bool)  # numpy's floats too
    if not (real and 0.0 < filter_eps < 1.0):
        raise ValueError(f"filter_eps must be None, 'auto' or a float in (0, 1), got {filter_eps!r}")
    return float(filter_eps)


def _autocast_operands(e: Tensor, c: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """Under torch.autocast the op runs in autocast's dtype, as the F.linear it replaces would:
    fp32 master weights under autocast(bf16) get bf16 tensor-core speed, not an IEEE fp32
    loss head. The casts are differentiable, so gradients reach fp32 leaves in fp32."""
    if not isinstance(e, Tensor) or e.device.type == "meta" or not torch.is_autocast_enabled(e.device.type):
        return e, c, bias  # not a tensor, or on meta (which autocast rejects): _check_inputs says what is wrong
    dtype = torch.get_autocast_dtype(e.device.type)

    def cast(t):
        return t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() else t

    return cast(e), cast(c), cast(bias)


def _check_inputs(
    e: Tensor, c: Tensor, targets: Tensor, bias: Tensor | None, weight: Tensor | None,
    reduction: str, label_smoothing: float, z_loss: float, softcap: float | None, memory: str,
    temperature: float, ignore_index: int, targets_name: str = "targets",
) -> None:
    for name, value in (("e", e), ("c", c), (targets_name, targets)):
        if not isinstance(value, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if bias is not None and not isinstance(bias, Tensor):
        raise TypeError(f"bias must be None or a torch.Tensor, got {type(bias).__name__}")
    for name, value in (("e", e), ("c", c), (targets_name, targets), ("bias", bias), ("weight", weight)):
        # sparse or nested operands failed inside torch (reshape, as_strided, strides), naming none
        if isinstance(value, Tensor) and (value.layout != torch.strided or value.is_nested):
            raise TypeError(f"{name} must be a dense (strided) tensor, got layout {value.layout}")
        if is_dtensor(value):  # left over from sharded_operands: nothing else reads one
            raise TypeError(f"{name} is a DTensor: pass {name}.to_local() (this rank's part) or {name}.full_tensor(); "
                            "only linear_cross_entropy's c (and its bias and weight) may be one, sharded Shard(0) "
                            "over the vocabulary (docs/vocab_parallel.md)")
    _refuse_function_transforms(e, c, bias)
    if e.device.type == "meta":
        raise ValueError("e is on the meta device, which holds no values to compute a loss from; "
                         "move the model to cpu or cuda (or trace shapes with torch.compile, whose fake tensors work)")
    if c.dim() != 2:
        raise ValueError(f"c must be 2-D (V, D), got shape {tuple(c.shape)}")
    if e.dim() < 1:
        raise ValueError("e must have shape (..., D), got a 0-d tensor")
    if e.shape[-1] != c.shape[1]:
        raise ValueError(f"e's last dimension ({e.shape[-1]}) must equal c's D ({c.shape[1]})")
    if c.shape[1] == 0:
        raise ValueError("e and c must have a hidden size D >= 1, got D = 0")
    if c.shape[0] == 0:
        raise ValueError("c must have at least one row (a vocabulary V >= 1), got V = 0")
    if e.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"e must be float32, float16 or bfloat16, got {e.dtype}")
    if c.dtype != e.dtype:
        raise TypeError(f"c must have e's dtype {e.dtype}, got {c.dtype}")
    check_target_dtype(targets, targets_name)
    if tuple(targets.shape) != tuple(e.shape[:-1]):
        raise ValueError(f"{targets_name} must have shape {tuple(e.shape[:-1])} (e's leading dims), "
                         f"got {tuple(targets.shape)}")
    _check_weight(weight, c.shape[0])
    for name, value in (("c", c), (targets_name, targets), ("bias", bias), ("weight", weight)):
        if value is not None and value.device != e.device:
            raise ValueError(f"{name} is on {value.device} but e is on {e.device}; put them on one device")
    v = c.shape[0]
    if bias is not None and (bias.shape != (v,) or bias.dtype != c.dtype):
        raise ValueError(f"bias must have shape ({v},) and dtype {c.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    check_loss_options(reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing,
                       z_loss=z_loss, softcap=softcap, memory=memory, temperature=temperature)


def check_target_dtype(targets: Tensor, name: str) -> None:
    """Targets are read as int64 (shift_targets casts them so): a float one would be truncated to
    a token (3.7 scored as 3), a bool one scored as tokens 0 and 1, so only integer dtypes pass."""
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor (an integer dtype that fits int64, e.g. int64 or int32), got {targets.dtype}")
    if targets.dtype == torch.uint64:  # read as int64, values from 2**63 would wrap to negative ones (ignore_index too)
        raise TypeError(f"{name} must be an integer tensor that fits int64 (e.g. int64, int32 or uint32), "
                        "got torch.uint64")


def _check_weight(weight: object, v: int | None) -> None:
    """The class weights: None or a 1-D float tensor of `v` entries (None: any, as a module
    built before it sees c), not requiring grad."""
    if weight is None:
        return
    if not isinstance(weight, Tensor):
        raise TypeError(f"weight must be None or a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 1 or (v is not None and weight.shape[0] != v) or not weight.dtype.is_floating_point:
        raise ValueError(f"weight must be None or a 1-D float tensor of shape ({'V' if v is None else v},), "
                         f"got {tuple(weight.shape)} {weight.dtype}")
    if weight.requires_grad:
        raise ValueError("weight must not require grad: the loss is not differentiated by the class weights "
                         "(as F.cross_entropy's); pass weight.detach()")


def _refuse_function_transforms(*operands: Tensor | None) -> None:
    """Forward-mode AD does not reach through torch.library's custom ops: torch.func.jvp and
    dual tensors get a zero tangent without an error, and torch.func.grad (vjp, jacrev) fails
    in torch's internals. Both are refused here by name; reverse mode (backward,
    torch.autograd.grad) is the supported way. vmap runs, gradients too (on the recompute). Under
    torch.compile, where Dynamo traces the transforms itself and the interpreters are not read,
    a jvp (jacfwd) is refused by its operands' tangents, which Dynamo traces with the dual level
    (the check below); a compiled grad fails in torch's internals: see docs/integrations.md."""
    transforms = _active_transforms()  # none while compiling
    refused = sorted(transforms & {"jvp", "grad"})
    if refused:
        raise NotImplementedError(f"linear_cross_entropy and linear_log_probs do not support torch.func's "
                                  f"{' and '.join(refused)}; use backward() or torch.autograd.grad")
    if not transforms and forward_ad._current_level >= 0 and any(
        operand is not None and forward_ad.unpack_dual(operand).tangent is not None for operand in operands
    ):
        raise NotImplementedError("linear_cross_entropy and linear_log_probs have no forward-mode AD (dual tensors "
                                  "would get a zero tangent); use backward() or torch.autograd.grad")


def _active_transforms() -> set[str]:
    """The torch.func transforms wrapping this call ("vmap", "grad", "jvp", ...); none seen
    inside torch.compile, where Dynamo traces them itself."""
    if torch.compiler.is_compiling():
        return set()
    return {interpreter.key().name.lower() for interpreter in retrieve_all_functorch_interpreters()}


def _in_transform(*operands: Tensor | None) -> bool:
    """Whether this call runs inside a torch.func transform (vmap), where a batched operand
    reports requires_grad False while autograd still wants its gradient. Eagerly, any active
    transform; while Dynamo traces one (torch.compile of a vmap), where the interpreters are
    not read, an operand it batches (torch._C._functorch.is_batchedtensor, which it folds)."""
    if torch.compiler.is_compiling():
        return any(t is not None and torch._C._functorch.is_batchedtensor(t) for t in operands)
    return bool(_active_transforms())


def check_flags(**flags: object) -> None:
    """Each flag is a bool (numpy's included by name in the error)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {_type_name(value)}")


def _type_name(value: object) -> str:
    """A value's type as an error names it: numpy's bool is "numpy.bool", not a second "bool"."""
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _got(value: object) -> str:
    """An error's ", got <value>"; empty while Dynamo traces, where formatting a value it made
    symbolic (dynamic=True, or one that changed between calls) fails the trace with a type
    error that hides the message."""
    return "" if torch.compiler.is_compiling() else f", got {value!r}"


def _check_number(name: str, value: object, expected: str, holds: Callable[[float], bool]) -> None:
    """value is a finite real number (not a bool) for which `holds` is true."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number {expected}, got {_type_name(value)}")
    # NaN fails both; a traced float too. An int or fraction past float's range compares finite
    # but would raise OverflowError where the call converts it with float()
    too_large = isinstance(value, numbers.Rational) and abs(value) > sys.float_info.max
    if not (-math.inf < value < math.inf and not too_large and holds(value)):
        raise ValueError(f"{name} must be a finite number {expected}{_got(value)}")


def check_loss_options(
    *, reduction: str = "mean", ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
    softcap: float | None = None, filter_eps: float | str | None = None, memory: str = "workspace",
    temperature: float = 1.0,
) -> None:
    """The options that do not depend on the tensors: checked on every call, and where a module
    or an integration is built (LinearCrossEntropyLoss, LossOptions, add_fused_lm_head), so a bad
    one fails there, not at the first training step."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    _check_number("label_smoothing", label_smoothing, "in [0, 1]", lambda x: 0.0 <= x <= 1.0)
    # A float32 constant of the kernels: past float32's largest (the literal below) it is inf, and so
    # every loss. Bounds are literals: Dynamo made a module-level float a graph input, and
    # comparing against it added a guard that recompiled a dynamic=True graph on its next call.
    _check_number("z_loss", z_loss, "in [0, 3.4e38]", lambda x: 0.0 <= x <= 3.4028234663852886e38)
    if softcap is not None:
        _check_number("softcap", softcap, "> 0 (or None)", lambda x: x > 0.0)
    # The kernels scale float32 logits by 1 / temperature: below 1e-20 logits of everyday size would
    # leave float32's range (1e-300 gave NaN). Literals: Dynamo made a module-level float a graph input.
    _check_number("temperature", temperature, ">= 1e-20", lambda x: x >= 1e-20)
    # The kernels soft-cap the scaled logits at softcap / temperature, a float32 constant: past
    # float32's range it is inf (inf * tanh(l / inf) is NaN), below its smallest normal 0 (0 / 0)
    if softcap is not None and not 1.1754943508222875e-38 <= softcap / temperature <= 3.4028234663852886e38:
        raise ValueError("softcap / temperature must be within float32's normal range (1.175e-38 to "
                         f"3.403e+38), the cap the kernels apply to the scaled logits: (softcap, "
                         f"temperature){_got((softcap, temperature))}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"ignore_index must be an int, got {_type_name(ignore_index)}")
    if not -(2**63) <= ignore_index < 2**63:
        raise ValueError(f"ignore_index must fit in int64 (the targets' dtype), got {ignore_index}")
    if memory not in _MEMORY:
        raise ValueError(f"memory must be one of {_MEMORY}, got {memory!r}")
    _resolve_filter_eps(filter_eps, torch.float32)  # "auto" is resolved per call, by the input's dtype


def _check_target_range(targets: Tensor, v: int, ignore_index: int, name: str = "targets") -> None:
    """Eager CPU calls get a clear error for an out-of-range target; on the GPU and under
    torch.compile that would cost a host sync, and targets that torch.func's vmap batches
    cannot be branched on, so there the op gives that token a NaN loss and NaN gradients
    (ops/loss_terms.py), for a grad scaler to skip the step."""
    if _without_values(targets) or targets.device.type != "cpu" or targets.numel() == 0:
        return
    bad = out_of_range(targets, v, ignore_index)
    if bool(bad.any()):
        first = int(targets[bad][0])
        raise ValueError(f"{name} must be in [0, {v}) or ignore_index ({ignore_index}); found {first}")


def _without_values(t: Tensor) -> bool:
    """Whether `t` holds no values to branch on: while torch.compile traces, a functorch wrapper
    (vmap, grad), a fake tensor (FakeTensorMode's shape propagation) or any tensor while a fake
    or proxy dispatch mode traces (make_fx), where reading one raises a data-dependent error
    from inside torch instead of a result."""
    modes = torch._C._TorchDispatchModeKey
    return (torch.compiler.is_compiling() or torch._C._functorch.is_functorch_wrapped_tensor(t) or is_fake(t)
            or torch._C._get_dispatch_mode(modes.FAKE) is not None
            or torch._C._get_dispatch_mode(modes.PROXY) is not None)


def _temperature_scale(softcap: float | None, temperature: float) -> tuple[float, float]:
    """(softcap, logit_scale) as the ops take them for logits divided by `temperature`, the
    soft-cap applied first (as a sampler divides a model's soft-capped logits):
    s * tanh(l / s) / T = (s / T) * tanh((l / T) / (s / T)). The kernels multiply their fp32
    logits by logit_scale = 1 / T before the soft-cap (kernels/tiles.finish_logits), so no
    operand is scaled and rounded to a 16-bit dtype. Each temperature is a compile-time
    constant of the kernels: the first call at a new one compiles them (as a new dtype does),
    and under torch.compile it is a graph of its own (docs/rl.md)."""
    logit_scale = 1.0 / float(temperature)
    return float(softcap or 0.0) * logit_scale, logit_scale


def _flat_indices(targets: Tensor) -> Tensor:
    """targets as the kernels read them: one dense int64 vector (a strided or expanded view
    is copied; e and c, by contrast, the kernels take with their strides)."""
    return targets.reshape(-1).to(torch.int64).contiguous()


def shift_targets(targets: Tensor, ignore_index: int) -> Tensor:
    """Position t is scored against target t+1; the last position of each sequence is
    ignored. Only targets move: e is never copied. In int64, which holds any ignore_index
    (-100 would wrap in uint8). Padded, then sliced (a sequence of none stays empty): sliced
    first, a batch of one's T - 1 targets made torch.compile guard T >= 3, which a
    mark_dynamic range from 2 refused (ConstraintViolationError)."""
    pad = targets.new_full((*targets.shape[:-1], 1), ignore_index, dtype=torch.int64)
    return torch.cat([targets.to(torch.int64), pad], dim=-1)[..., 1:]


def linear_cross_entropy(
    e: Tensor,
    c: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    weight: Tensor | None = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    shift: bool = False,
    return_lse: bool = False,
    filter_eps: float | str | None = None,
    memory: Memory = "workspace",
    temperature: float = 1.0,
    vocab_parallel: VocabParallel | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """cross_entropy(e @ c.T + bias, targets) without materializing the logits.

    Same value and gradients as F.cross_entropy(logits, targets, weight, ignore_index,
    reduction, label_smoothing) on logits = e @ c.T + bias (soft-capped as
    softcap * tanh(logits / softcap) when softcap is set); z_loss adds z_loss * lse**2 per
    non-ignored token, summed, per token, or with "mean" averaged over those tokens (by their
    count, whatever the class weights). A batch with no valid token has loss 0; a mean whose
    targets' class weights sum to 0 has a cross-entropy term of 0.
    Returns the loss (float32 whatever the input dtype), or (loss, lse) with return_lse
    (lse per token, float32, differentiable).

    memory="workspace" (the default): where autograd will want the gradients of a mean or sum
    loss, the forward computes them too, in token chunks whose logits live in a workspace
    (three GEMMs of work in all, the call peaking under ~2x the gradients' memory), and the
    backward only scales them. memory="low" keeps only each token's log-sum-exp for a backward
    that recomputes the logits (four GEMMs, ~1.1x). reduction="none", return_lse, filtered
    mode, fp16, soft-capping with label smoothing and a class-weighted mean with z_loss always
    take the second.

    temperature (>= 1e-20) divides the (soft-capped) logits first: the loss of softmax(logits / T),
    lse included.

    vocab_parallel: c (with bias and weight) is this rank's shard of the classifier's rows,
    and the loss and dE are the whole classifier's (docs/vocab_parallel.md); a DTensor c
    sharded Shard(0) on a 1-D mesh says its shard itself. That takes the recompute.
    """
    e, c, bias = _autocast_operands(e, c, bias)
    c, bias, weight, vocab_parallel = sharded_operands(c, bias, weight, vocab_parallel)
    _check_inputs(e, c, targets, bias, weight, reduction, label_smoothing, z_loss, softcap, memory, temperature,
                  ignore_index)
    check_flags(shift=shift, return_lse=return_lse)
    scaled_softcap, logit_scale = _temperature_scale(softcap, temperature)
    bias, weight = (None if vector is None else vector.contiguous() for vector in (bias, weight))  # read as dense
    eps = _resolve_filter_eps(filter_eps, e.dtype)
    if shift:
        if targets.dim() < 1:
            raise ValueError("shift=True needs targets with a sequence dimension")
        targets = shift_targets(targets, ignore_index)
    v, d = c.shape
    lead_shape = targets.shape
    flat_targets = _flat_indices(targets)
    _check_target_range(flat_targets, v if vocab_parallel is None else vocab_parallel.vocab_size, ignore_index)
    if vocab_parallel is not None:
        out, lse = vocab_parallel_loss(
            e.reshape(-1, d), c, flat_targets, vocab_parallel, bias=bias, weight=weight, ignore_index=int(ignore_index),
            reduction=reduction, label_smoothing=float(label_smoothing), z_loss=float(z_loss),
            softcap=scaled_softcap, filter_eps=eps, logit_scale=logit_scale)
        out = out.reshape(lead_shape) if reduction == "none" else out
        return (out, lse.reshape(lead_shape)) if return_lse else out
    backward = needs_grad(e, c, bias)
    if not backward:
        eps = 0.0  # as in linear_log_probs: no tile statistics, no graph per power of two of N
    if label_smoothing > 0.0 and weight is not None:
        # smoothing's d-logit term -s_i w_j is uneven over a tile's columns where the class
        # weights are, and the put-back spreads a skipped tile's sum evenly: the backward runs exact
        eps = 0.0
    options = options_of(bias, weight, scaled_softcap, float(label_smoothing), eps, logit_scale)
    flat_e = e.reshape(-1, d)
    if backward and not return_lse and gradients_in_forward(
            options, dtype_name(e.dtype), reduction, memory, has_z_loss=z_loss > 0.0,
            in_transform=_in_transform(e, c, bias, targets)):
        with without_autocast(e.device.type):
            loss, *_ = ops.linear_cross_entropy_fused(
                flat_e, c, flat_targets, bias, weight, int(ignore_index), float(label_smoothing),
                scaled_softcap, float(z_loss), reduction, e.requires_grad, c.requires_grad, logit_scale,
                traced_settings(flat_e, c, False, config_in_backward=False),
            )
        return loss
    # The op accumulates in fp32 on purpose: autocast must not recast its inner matmuls.
    with without_autocast(e.device.type):
        loss, lse, *_ = ops.linear_cross_entropy_forward(
            flat_e, c, flat_targets, bias, weight,
            int(ignore_index), float(label_smoothing), scaled_softcap, eps, logit_scale,
            traced_settings(flat_e, c, eps > 0.0, config_in_backward=backward),
        )
    valid = flat_targets != ignore_index
    weights = None if weight is None else target_weight(flat_targets, weight, valid, v)
    out = reduce_with_z_loss(loss, lse, float(z_loss), reduction, valid, weights)
    out = out.reshape(lead_shape) if reduction == "none" else out
    if return_lse:
        return out, lse.reshape(lead_shape)
    return out


def linear_log_probs(
    e: Tensor,
    c: Tensor,
    tokens: Tensor,
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    bias: Tensor | None = None,
    softcap: float | None = None,
    ignore_index: int = -100,
    shift: bool = False,
    filter_eps: float | str | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """log_softmax(z)[token] per token, z = e @ c.T + bias (soft-capped as
    softcap * tanh(z / softcap)) divided by `temperature`, without materializing the logits:
    the log-probabilities RL fine-tuning (GRPO, PPO) scores sampled tokens by.

    Returns log_probs (fp32, the shape of `tokens`), or (log_probs, entropy) with `entropy`:
    each position's entropy -sum_j p_j log p_j of the same softmax. Ignored positions
    (tokens == ignore_index) are 0 in both and take no gradient; a token outside [0, V) past
    the eager CPU check (on the GPU, under torch.compile) has a NaN log-prob and makes the
    gradients NaN (README); with `shift`, position t
    scores token t+1 (the last of each sequence ignored). Both outputs are differentiable
    w.r.t. e, c and bias under any upstream gradients (the backward recomputes the logits:
    a frozen policy's call under torch.no_grad() is one forward pass, one GEMM's work).

    filter_eps ("auto" or a float, as in linear_cross_entropy): the backward skips the
    vocabulary tiles where every softmax entry stays under it and puts back their sums (the
    entropy's term too), for a backward of a fraction of the work; the outputs stay exact, the
    gradients within 1.2-3.3e-3 of exact mode's on LM-like heads under an entropy gradient of
    up to a tenth of the log-prob's (docs/notes/filtered-log-probs.md). Under no_grad it does
    nothing.
    """
    e, c, bias = _autocast_operands(e, c, bias)
    _check_inputs(e, c, tokens, bias, None, "none", 0.0, 0.0, softcap, "low", temperature, ignore_index,
                  targets_name="tokens")
    check_flags(entropy=entropy, shift=shift)
    scaled_softcap, logit_scale = _temperature_scale(softcap, temperature)
    bias = None if bias is None else bias.contiguous()  # the kernels read it as a dense vector
    eps = _resolve_filter_eps(filter_eps, e.dtype)
    backward = needs_grad(e, c, bias)
    if not backward:
        eps = 0.0  # the filter is the backward's: a pass without one skips its bookkeeping
    if shift:
        if tokens.dim() < 1:
            raise ValueError("shift=True needs tokens with a sequence dimension")
        tokens = shift_targets(tokens, ignore_index)
    flat_tokens = _flat_indices(tokens)
    _check_target_range(flat_tokens, c.shape[0], ignore_index, name="tokens")
    flat_e = e.reshape(-1, c.shape[1])
    with without_autocast(e.device.type):  # fp32 accumulation is the op's own
        log_probs, entropies, *_ = ops.linear_log_probs_forward(
            flat_e, c, flat_tokens, bias, int(ignore_index), scaled_softcap, entropy,
            backward or _in_transform(e, c, bias, tokens), eps, logit_scale,  # vmap's operands hide requires_grad
            traced_settings(flat_e, c, eps > 0.0, config_in_backward=backward))
    if entropy:
        return log_probs.reshape(tokens.shape), entropies.reshape(tokens.shape)
    return log_probs.reshape(tokens.shape)


class LinearCrossEntropyLoss(nn.Module):
    """Module form of linear_cross_entropy with its options fixed at construction."""

    def __init__(
        self,
        *,
        ignore_index: int = -100,
        reduction: Reduction = "mean",
        weight: Tensor | None = None,
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        softcap: float | None = None,
        shift: bool = False,
        return_lse: bool = False,
        filter_eps: float | str | None = None,
        memory: Memory = "workspace",
        temperature: float = 1.0,
        vocab_parallel: VocabParallel | None = None,
    ) -> None:
        super().__init__()
        check_loss_options(reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing,
                           z_loss=z_loss, softcap=softcap, filter_eps=filter_eps, memory=memory,
                           temperature=temperature)
        check_flags(shift=shift, return_lse=return_lse)
        _check_weight(weight, None)
        check_vocab_parallel(vocab_parallel, filter_eps)
        self.register_buffer("weight", weight)
        self.options = dict(
            ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
            z_loss=z_loss, softcap=softcap, shift=shift, return_lse=return_lse, filter_eps=filter_eps, memory=memory,
            temperature=temperature, vocab_parallel=vocab_parallel,
        )

    def extra_repr(self) -> str:
        shown = [f"{name}={value!r}" for name, value in self.options.items()]
        if self.weight is not None:
            shown.append(f"weight=({self.weight.shape[0]},) {dtype_name(self.weight.dtype)}")
        return ", ".join(shown)

    def forward(self, e: Tensor, c: Tensor, targets: Tensor, bias: Tensor | None = None):
        return linear_cross_entropy(e, c, targets, bias=bias, weight=self.weight, **self.options)
