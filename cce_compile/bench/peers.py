"""The implementations the benchmark compares, each as `(e, c, targets) -> mean loss`.

Peers are optional packages: every entry loads lazily, and a missing or broken one is
reported with its reason instead of stopping the run. Versions differ in what they offer
(Apple's `impl="cce_exact"` exists only on its newer releases), so each loader says which
form it used in the note the benchmark logs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import ModuleType
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


LossFn = Callable[[Tensor, Tensor, Tensor], Tensor]


class ImplUnavailable(RuntimeError):
    """The implementation cannot be loaded here; the message says why."""


@dataclass(frozen=True)
class Loaded:
    fn: LossFn
    note: str = ""


CompileMode = str
COMPILE_MODES = ("eager", "default", "reduce-overhead")
"""How an impl is called: as is, or inside torch.compile (fullgraph, static shapes) in that mode."""


@dataclass(frozen=True)
class Impl:
    """One contender. `on_uniform` marks those also timed on uniform inputs by default:
    the filtering kernels, whose speed depends on the softmax (uniform data flatters them),
    and this project's exact mode beside them, whose speed should not. `compilable` marks
    those a torch.compile'd model would call inside its graph; `compile_mode` is None for an
    eager call, else the torch.compile mode this variant runs under."""

    key: str
    label: str
    load: Callable[[], Loaded]
    on_uniform: bool
    compilable: bool = False
    compile_mode: CompileMode | None = None

    @property
    def row_name(self) -> str:
        """The results' impl column: the key, with the mode after a colon where it is not the
        default (the compiled column says compiled or not)."""
        return self.key if self.compile_mode in (None, "default") else f"{self.key}:{self.compile_mode}"


def _load_cce(filter_eps: float | str | None, memory: str = "workspace") -> Loaded:
    try:
        from cce_compile import linear_cross_entropy
    except ImportError as err:
        raise ImplUnavailable(f"cce_compile.linear_cross_entropy does not import: {err}") from err
    return Loaded(lambda e, c, targets: linear_cross_entropy(e, c, targets, filter_eps=filter_eps, memory=memory))


def _import_apple() -> ModuleType:
    try:
        import cut_cross_entropy
    except ImportError as err:
        raise ImplUnavailable(f"cut_cross_entropy is not installed: {err}") from err
    return cut_cross_entropy


def _load_apple_default() -> Loaded:
    apple = _import_apple()
    return Loaded(lambda e, c, targets: apple.linear_cross_entropy(e, c, targets))


def _load_apple_exact() -> Loaded:
    """impl="cce_exact" where the release has it; older ones are exact with filter_eps=None."""
    apple = _import_apple()
    if "CCE_EXACT" in apple.LinearCrossEntropyImpl.__members__:
        return Loaded(lambda e, c, targets: apple.linear_cross_entropy(e, c, targets, impl="cce_exact"), 'impl="cce_exact"')
    return Loaded(
        lambda e, c, targets: apple.linear_cross_entropy(e, c, targets, filter_eps=None),
        f"release {apple.__version__} has no cce_exact: impl=\"cce\", filter_eps=None",
    )


def _load_liger() -> Loaded:
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError as err:
        raise ImplUnavailable(f"liger_kernel is not installed: {err}") from err
    return Loaded(lambda e, c, targets: liger_fused_linear_cross_entropy(e, c, targets))


def materialized_loss(e: Tensor, c: Tensor, targets: Tensor) -> Tensor:
    """What HF models do: logits in the input dtype, cross-entropy in float32."""
    return F.cross_entropy((e @ c.T).float(), targets)


def _load_eager() -> Loaded:
    return Loaded(materialized_loss)


def _compiled(load: Callable[[], Loaded], mode: CompileMode) -> Callable[[], Loaded]:
    """`load`'s function inside torch.compile (fullgraph, static shapes: each benchmark shape
    gets its own graph, as a training run would). Under reduce-overhead each call starts a new
    CUDA-graph step, as a training loop's iteration does; the harness passes c as an
    nn.Parameter there, as a model's head weight is (harness._as_model_head). Plain tensors are
    not marked static: two draws marked so failed every row on the H200 (docs/notes/h200-runs.md)."""

    def load_compiled() -> Loaded:
        loaded = load()
        options = {} if mode == "default" else {"mode": mode}
        compiled = torch.compile(loaded.fn, fullgraph=True, dynamic=False, **options)
        if mode != "reduce-overhead":
            return Loaded(compiled, loaded.note)

        def stepped(e: Tensor, c: Tensor, targets: Tensor) -> Tensor:
            torch.compiler.cudagraph_mark_step_begin()
            return compiled(e, c, targets)

        return Loaded(stepped, loaded.note)

    return load_compiled


def _load_log_probs(key: str) -> Loaded:
    """The log-probs rows (RL's per-token outputs as a loss), loaded from bench/log_probs.py."""
    from .log_probs import LOG_PROB_LOADERS

    return LOG_PROB_LOADERS[key]()


IMPLS: dict[str, Impl] = {
    impl.key: impl
    for impl in (
        Impl("cce_exact", "cce_compile exact (workspace)", lambda: _load_cce(None, "workspace"), on_uniform=True,
             compilable=True),
        Impl("cce_exact_low", "cce_compile exact (low memory)", lambda: _load_cce(None, "low"), on_uniform=True,
             compilable=True),
        Impl("cce_filtered", "cce_compile filtered (auto: 2^-10)", lambda: _load_cce("auto"), on_uniform=True,
             compilable=True),
        Impl("torch", "torch (materialized logits)", _load_eager, on_uniform=False, compilable=True),
        Impl("apple_cce", "Apple cce (default, filtered)", _load_apple_default, on_uniform=True),
        Impl("apple_cce_exact", "Apple cce_exact", _load_apple_exact, on_uniform=False),
        Impl("liger", "Liger FLCE", _load_liger, on_uniform=False),
        Impl("cce_log_probs", "cce_compile linear_log_probs (+entropy)", lambda: _load_log_probs("cce_log_probs"),
             on_uniform=False, compilable=True),
        Impl("cce_log_probs_filtered", "cce_compile linear_log_probs (+entropy), filtered (auto: 2^-10)",
             lambda: _load_log_probs("cce_log_probs_filtered"), on_uniform=False, compilable=True),
        Impl("torch_compile_log_probs", "torch.compile log-probs (+entropy)",
             lambda: _load_log_probs("torch_compile_log_probs"), on_uniform=False),
        Impl("verl_log_probs", "verl LinearCrossEntropy (+entropy)", lambda: _load_log_probs("verl_log_probs"),
             on_uniform=False),
        Impl("trl_log_probs", "TRL ChunkedLogProbFunction (+entropy)", lambda: _load_log_probs("trl_log_probs"),
             on_uniform=False),
    )
}
"""In benchmark order: this project first, so a run cut short by its time budget still
has the numbers that matter most. "torch" is what HF models do (logits, then cross-entropy);
compiled, it is torch.compile's own fusion of the materialized loss."""




def resolve_impls(keys: list[str] | None) -> list[Impl]:
    """The named implementations in registry order; None means all."""
    if not keys:
        return list(IMPLS.values())
    unknown = sorted(set(keys) - IMPLS.keys())
    if unknown:
        raise ValueError(f"unknown impls {unknown}; choose from {list(IMPLS)}")
    return [impl for key, impl in IMPLS.items() if key in keys]


def resolve_compile_modes(modes: list[str] | None) -> list[CompileMode]:
    """The named call modes, checked; None or empty means all of COMPILE_MODES."""
    unknown = sorted(set(modes or []) - set(COMPILE_MODES))
    if unknown:
        raise ValueError(f"unknown compile modes {unknown}; choose from {list(COMPILE_MODES)}")
    return [mode for mode in COMPILE_MODES if not modes or mode in modes]


def with_compile_modes(impls: list[Impl], modes: list[CompileMode]) -> list[Impl]:
    """Each impl in every mode that applies to it (compiled modes for the compilable ones),
    an impl's modes together."""
    variants = []
    for impl in impls:
        for mode in modes:
            if mode == "eager":
                variants.append(impl)
            elif impl.compilable:
                label = f"{impl.label}, torch.compile" + ("" if mode == "default" else f" {mode}")
                variants.append(replace(impl, label=label, load=_compiled(impl.load, mode), compile_mode=mode))
    return variants


def try_load(impl: Impl) -> Loaded | str:
    """The loaded implementation, or why it does not load here (a peer's import can fail
    in many ways: missing, or built against another torch or triton)."""
    try:
        return impl.load()
    except Exception as err:  # noqa: BLE001 - any load-time failure means "not here"
        return f"{type(err).__name__}: {err}"
