"""The log-probs contenders (linear_log_probs with entropy, RL's per-token outputs), in the
harness's `(e, c, targets) -> mean loss` form: the loss is -mean(log_probs) + 0 * mean(entropy),
so the harness's cross-entropy reference checks its value and gradients, and the backward
still carries the entropy's term (its upstream gradient is a tensor of zeros, not None).
The no-grad forward it times is the old and reference policies' pass."""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import inspect
import sys
from types import ModuleType
from typing import Callable

import torch
from torch import Tensor

from .peers import ImplUnavailable, Loaded

VERL_KERNEL_MODULE = "verl.utils.kernel.linear_cross_entropy"
"""verl's fused log-probs + entropy kernel (`LinearCrossEntropy`, an autograd.Function)."""

TRL_KERNEL_MODULE = "trl.kernels.chunked_logprob"
"""TRL's chunked log-probs (`ChunkedLogProbFunction`: cuBLAS tiles folded by a Triton kernel,
the backward recomputing them), behind its trainers' fused LM head since TRL 1.x."""

TRL_VOCAB_CHUNK = 32768
"""The vocabulary chunk TRL's fused LM head passes (trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE)."""


def as_loss(log_probs: Tensor, entropy: Tensor) -> Tensor:
    return -log_probs.float().mean() + 0.0 * entropy.float().mean()


def _load_cce_log_probs(filter_eps: str | None = None) -> Loaded:
    from cce_compile import linear_log_probs

    return Loaded(lambda e, c, targets: as_loss(*linear_log_probs(e, c, targets, entropy=True, filter_eps=filter_eps)))


def materialized_log_probs(e: Tensor, c: Tensor, targets: Tensor) -> Tensor:
    """What RL trainers do without a fused kernel: float32 logits, log_softmax, gather, entropy."""
    log_softmax = torch.log_softmax((e @ c.T).float(), dim=-1)
    log_probs = log_softmax.gather(-1, targets[:, None])[:, 0]
    entropy = -(log_softmax.exp() * log_softmax).sum(dim=-1)
    return as_loss(log_probs, entropy)


def _load_compiled_log_probs() -> Loaded:
    return Loaded(torch.compile(materialized_log_probs, dynamic=False))


def import_kernel_module(name: str, alone: bool = False) -> ModuleType:
    """A peer's kernel module; ImplUnavailable, with the reason, where its package is not
    installed or the module does not import. `alone`: without running its parent packages'
    __init__ (verl's imports the whole framework). A second call returns the module the first
    loaded."""
    if name in sys.modules:
        return sys.modules[name]
    package = name.split(".")[0]
    spec = None if package in sys.modules else importlib.util.find_spec(package)
    if package not in sys.modules and spec is None:
        raise ImplUnavailable(f"{package} is not installed")
    try:
        return _module_alone(name, spec) if alone else importlib.import_module(name)
    except Exception as err:  # noqa: BLE001 - a broken install is "unavailable", with its reason
        raise ImplUnavailable(f"{name} does not import: {type(err).__name__}: {err}") from err


def _module_alone(name: str, top_spec: importlib.machinery.ModuleSpec | None) -> ModuleType:
    """`name`'s parents not yet imported become bare packages over their directories (each
    with a spec, so later lookups of them work; the top one's from `top_spec`, the others'
    under their parent's), so the module and its own relative imports load from the
    installed files. A failed import takes back the bare packages it made."""
    if top_spec is not None and not top_spec.submodule_search_locations:
        raise ImportError(f"{top_spec.name} is not a package")
    parts = name.split(".")
    made = []
    for depth in range(1, len(parts)):
        package = ".".join(parts[:depth])
        if package in sys.modules:
            continue
        path = (list(top_spec.submodule_search_locations) if depth == 1
                else [f"{sys.modules['.'.join(parts[:depth - 1])].__path__[0]}/{parts[depth - 1]}"])
        spec = importlib.machinery.ModuleSpec(package, None, is_package=True)
        spec.submodule_search_locations = path
        sys.modules[package] = importlib.util.module_from_spec(spec)
        made.append(package)
    try:
        return importlib.import_module(name)
    except BaseException:
        for package in made:
            sys.modules.pop(package, None)
        raise


def _load_verl() -> Loaded:
    """verl's kernel where its wheel is installed (the GPU machine): `LinearCrossEntropy.apply(
    hidden, weight, labels[, temperature], reduction)` -> (log_probs, entropy); releases before
    the temperature argument take none."""
    function = import_kernel_module(VERL_KERNEL_MODULE, alone=True).LinearCrossEntropy
    takes_temperature = "temperature" in inspect.signature(function.forward).parameters

    def loss(e: Tensor, c: Tensor, targets: Tensor) -> Tensor:
        args = (e, c, targets, 1.0, "none") if takes_temperature else (e, c, targets, "none")
        return as_loss(*function.apply(*args))

    return Loaded(loss, "temperature argument" if takes_temperature else "no temperature argument")


def _load_trl() -> Loaded:
    """TRL's kernel where its wheel is installed: `ChunkedLogProbFunction.apply(hidden, weight,
    bias, targets, temperature, vocab chunk, softcap, logit scale, outputs)` -> (log_probs,
    entropy, and three outputs not asked for), as its fused LM head calls it. TRL's package
    loads lazily, so the kernel's module imports without the trainers' dependencies; its
    backward imports trl.trainer.utils (the trainers) for one helper, maybe_gather_lm_head_ctx,
    which gathers DeepSpeed ZeRO-3 shards and is a null context otherwise: where that module
    does not import (no datasets, accelerate, pandas), it is registered as that helper alone,
    for the rest of the process (the trainers could not import there anyway)."""
    function = import_kernel_module(TRL_KERNEL_MODULE).ChunkedLogProbFunction
    try:
        importlib.import_module("trl.trainer.utils")
    except Exception:  # noqa: BLE001 - any missing dependency of the trainers
        utils = ModuleType("trl.trainer.utils")
        utils.maybe_gather_lm_head_ctx = lambda *params: contextlib.nullcontext()
        sys.modules["trl.trainer.utils"] = utils

    def loss(e: Tensor, c: Tensor, targets: Tensor) -> Tensor:
        log_probs, entropy, *_ = function.apply(e, c, None, targets, 1.0, TRL_VOCAB_CHUNK, None, 1.0,
                                                ("log_probs", "entropy"))
        return as_loss(log_probs, entropy)

    return Loaded(loss)


LOG_PROB_LOADERS: dict[str, Callable[[], Loaded]] = {
    "cce_log_probs": _load_cce_log_probs,
    "cce_log_probs_filtered": lambda: _load_cce_log_probs("auto"),
    "torch_compile_log_probs": _load_compiled_log_probs,
    "verl_log_probs": _load_verl,
    "trl_log_probs": _load_trl,
}
"""The loaders of peers.IMPLS' log-probs rows."""
