"""Coordinate descent over the op's launch parameters, one kernel at a time, from the
heuristic config, within a time budget.

Kernels are timed through the op, as training calls them: the forward as a no-grad call,
the backward kernels as forward+backward minus the forward (their launches interleave
inside the backward, so they have no time of their own). Before a candidate is timed its
loss, dE and dC are compared with the default config's on the same inputs: a config that
computes something else is dropped, never timed. Inputs are LM-like (Zipfian softmax) and
rotate over a few copies, so no timing rides on a warm L2 or on one draw of the data.
"""

from __future__ import annotations

import functools
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Protocol

import torch
from torch import Tensor

from cce_compile.api import linear_cross_entropy
from cce_compile.bench.inputs import InputSet, cycling, lm_like_inputs
from cce_compile.bench.metrics import relative_error
from cce_compile.bench.peers import LossFn
from cce_compile.config.kernel_config import KernelConfig
from cce_compile.resolve.heuristic import heuristic_config
from cce_compile.resolve.ladder import override_config

from .candidates import KernelSpace, Problem

TOLERANCE = {"bfloat16": 1e-2, "float16": 1e-2, "float32": 1e-5}
"""Largest relative error of loss, dE and dC against the default config's."""
MIN_GAIN = 0.005
"""A candidate replaces the current best only if it is this much faster (not on noise)."""


@dataclass(frozen=True)
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float

    def minus(self, ms: float) -> Timing:
        return Timing(self.median_ms - ms, self.p20_ms - ms, self.p80_ms - ms)


class Timer(Protocol):
    """Times a call; `method` names how, as the tuning database records it."""

    method: str

    def __call__(self, fn: Callable[[], object]) -> Timing: ...


@dataclass(frozen=True)
class DoBenchTimer:
    """triton.testing.do_bench quantiles (it flushes L2 before every call), with the
    repetition time stretched so a slow call still gets `min_samples` samples."""

    warmup_ms: float = 10.0
    rep_ms: float = 100.0
    min_samples: int = 10
    method: str = "triton.do_bench"

    def __call__(self, fn: Callable[[], object]) -> Timing:
        from triton.testing import do_bench

        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        once_ms = (time.perf_counter() - start) * 1e3
        rep_ms = max(self.rep_ms, self.min_samples * once_ms)
        p20, median, p80 = do_bench(fn, warmup=self.warmup_ms, rep=rep_ms, quantiles=[0.2, 0.5, 0.8])
        return Timing(median, p20, p80)


@dataclass(frozen=True)
class WallClockTimer:
    """time.perf_counter around whole calls: for CPU and the Triton interpreter, which run
    synchronously."""

    warmup: int = 1
    runs: int = 3
    method: str = "wall_clock"

    def __call__(self, fn: Callable[[], object]) -> Timing:
        for _ in range(self.warmup):
            fn()
        samples = []
        for _ in range(self.runs):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        levels = torch.tensor([0.2, 0.5, 0.8], dtype=torch.float64)
        p20, median, p80 = torch.tensor(samples, dtype=torch.float64).quantile(levels).tolist()
        return Timing(median, p20, p80)


def default_timer(device: str) -> Timer:
    return DoBenchTimer() if device == "cuda" else WallClockTimer()


@dataclass(frozen=True)
class Trial:
    """One candidate: `status` "timed", "dropped" (its results differ from the default
    config's) or "failed" (it raised, e.g. out of resources); `time` is its kernel's stage
    time, `whole` its forward+backward when that was timed."""

    kernel: str
    config: KernelConfig
    status: str
    detail: str = ""
    time: Timing | None = None
    whole: Timing | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "kernel": self.kernel,
            "config": self.config.to_dict(),
            "status": self.status,
            "detail": self.detail,
            "time": None if self.time is None else asdict(self.time),
            "whole": None if self.whole is None else asdict(self.whole),
        }


@dataclass(frozen=True)
class KernelResult:
    """A kernel's stage time under the default config and under its fastest candidate."""

    default: Timing
    best: Timing
    best_config: KernelConfig

    @property
    def speedup(self) -> float:
        return self.default.median_ms / self.best.median_ms


@dataclass(frozen=True)
class TuneResult:
    problem: Problem
    device: str
    method: str
    budget_s: float
    elapsed_s: float
    default_config: KernelConfig
    best_config: KernelConfig
    default_whole: Timing
    best_whole: Timing
    kernels: dict[str, KernelResult]
    trials: list[Trial]
    stopped: bool = False
    """Whether `Tuner.stop` ended the search before its budget did."""

    @property
    def speedup(self) -> float:
        return self.default_whole.median_ms / self.best_whole.median_ms

    def to_json(self) -> dict[str, Any]:
        return {
            "problem": asdict(self.problem),
            "device": self.device,
            "method": self.method,
            "budget_s": self.budget_s,
            "elapsed_s": self.elapsed_s,
            "stopped": self.stopped,
            "default_config": self.default_config.to_dict(),
            "best_config": self.best_config.to_dict(),
            "whole": {"default": asdict(self.default_whole), "best": asdict(self.best_whole), "speedup": self.speedup},
            "kernels": {
                name: {
                    "default": asdict(kernel.default),
                    "best": asdict(kernel.best),
                    "speedup": kernel.speedup,
                    "best_config": kernel.best_config.to_dict(),
                }
                for name, kernel in self.kernels.items()
            },
            "trials": [trial.to_json() for trial in self.trials],
        }


@dataclass(frozen=True)
class Outputs:
    loss: Tensor
    grad_e: Tensor
    grad_c: Tensor


def relative_errors(outputs: Outputs, reference: Outputs) -> dict[str, float]:
    """Relative error of the loss and the norm-wise relative errors of dE and dC."""
    loss_error = abs(outputs.loss.item() - reference.loss.item()) / max(abs(reference.loss.item()), 1e-30)
    return {
        "loss": loss_error,
        "dE": relative_error(outputs.grad_e, reference.grad_e, floor=1e-30),
        "dC": relative_error(outputs.grad_c, reference.grad_c, floor=1e-30),
    }


@dataclass
class Tuner:
    """Tunes one problem on one device. `spaces` are searched in order (the forward first);
    the search starts no candidate after `budget_s` from the start of `run`, and each
    kernel gets an equal share of what is left when its turn comes. `loss_fn` is the op
    call (a seam for tests); `on_trial` sees every candidate as it finishes. `stop()` (from a
    signal handler, say) ends the search at the next candidate, as the budget's end does."""

    problem: Problem
    device: str
    spaces: list[KernelSpace]
    timer: Timer
    budget_s: float
    input_sets: int = 3
    seed: int = 0
    loss_fn: LossFn | None = None
    on_trial: Callable[[Trial], None] | None = None
    _inputs: list[InputSet] = field(init=False, default_factory=list)
    _forward: dict[tuple[object, ...], Timing] = field(init=False, default_factory=dict)
    _whole: dict[KernelConfig, Timing] = field(init=False, default_factory=dict)
    _trials: dict[tuple[object, ...], Trial] = field(init=False, default_factory=dict)
    _reference: Outputs | None = field(init=False, default=None)
    _stopped: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        if self.loss_fn is None:
            filter_eps = "auto" if self.problem.mode == "filtered" else None
            self.loss_fn = functools.partial(linear_cross_entropy, filter_eps=filter_eps)

    @property
    def default_config(self) -> KernelConfig:
        return heuristic_config(self.problem.key(self.device))

    def stop(self) -> None:
        """Start no further candidate; `run` then finishes with what was measured."""
        self._stopped = True

    def _searching(self, deadline: float) -> bool:
        return not self._stopped and time.monotonic() < deadline

    def run(self) -> TuneResult:
        started = time.monotonic()
        deadline = started + self.budget_s
        self._make_inputs()
        default = self.default_config
        self._reference = self._outputs(default)
        default_whole = self._whole_time(default)  # the baseline, timed first
        best = default
        improved = True
        while improved and self._searching(deadline):
            improved = False
            for index, space in enumerate(self.spaces):
                share = (deadline - time.monotonic()) / (len(self.spaces) - index)
                best, changed = self._descend(space, best, time.monotonic() + share)
                improved |= changed
        if best != default and self._whole_time(best).median_ms >= default_whole.median_ms:
            best = default  # the kernels' gains did not add up to a faster op
        return TuneResult(
            problem=self.problem,
            device=self.device,
            method=self.timer.method,
            budget_s=self.budget_s,
            elapsed_s=time.monotonic() - started,
            default_config=default,
            best_config=best,
            default_whole=default_whole,
            best_whole=self._whole_time(best),
            kernels={space.kernel: self._kernel_result(space.kernel, default) for space in self.spaces},
            trials=list(self._trials.values()),
            stopped=self._stopped,
        )

    def _descend(self, space: KernelSpace, start: KernelConfig, deadline: float) -> tuple[KernelConfig, bool]:
        """One sweep of every axis of `space` from `start`, keeping each faster value."""
        best = start
        best_time = self._stage_time(space.kernel, best)
        for axis in space.axes:
            for candidate in space.along(best, axis):
                if not self._searching(deadline):
                    return best, best != start
                trial = self._trials.get((space.kernel, space.launches(candidate))) or self._try(space, candidate)
                if trial.time is not None and trial.time.median_ms < best_time.median_ms * (1 - MIN_GAIN):
                    best, best_time = candidate, trial.time
        return best, best != start

    def _try(self, space: KernelSpace, candidate: KernelConfig) -> Trial:
        """Check `candidate` against the default config's results, then time its kernel.

        Remembered by the kernel's launches: the same tile (and split or slab plan) is not
        checked again in a later sweep where only the other kernels' settings differ."""
        kernel = space.kernel
        tolerance = TOLERANCE[self.problem.dtype]
        try:
            errors = relative_errors(self._outputs(candidate), self._reference)
            wrong = {name: error for name, error in errors.items() if not error <= tolerance}  # NaN is wrong
            if wrong:
                detail = "; ".join(f"{name} relative error {error:.2e} > {tolerance:g}" for name, error in wrong.items())
                trial = Trial(kernel, candidate, "dropped", detail)
            else:
                stage = self._stage_time(kernel, candidate)
                trial = Trial(kernel, candidate, "timed", time=stage, whole=self._whole.get(candidate))
        except Exception as error:  # a config that cannot launch (out of resources, compile error)
            trial = Trial(kernel, candidate, "failed", f"{type(error).__name__}: {error}"[:300])
        self._trials[(kernel, space.launches(candidate))] = trial
        if self.on_trial is not None:
            self.on_trial(trial)
        return trial

    def _kernel_result(self, kernel: str, default: KernelConfig) -> KernelResult:
        default_time = self._stage_time(kernel, default)
        timed = [t for t in self._trials.values() if t.kernel == kernel and t.time is not None]
        fastest = min(timed, key=lambda t: t.time.median_ms, default=None)
        if fastest is None or fastest.time.median_ms >= default_time.median_ms:
            return KernelResult(default_time, default_time, default)
        return KernelResult(default_time, fastest.time, fastest.config)

    # --- running and timing the op ------------------------------------------------------

    def _make_inputs(self) -> None:
        device = "cuda" if self.device == "cuda" else "cpu"
        dtype = getattr(torch, self.problem.dtype)
        p = self.problem
        for index in range(self.input_sets):
            e, c, targets = lm_like_inputs(p.n, p.d, p.v, dtype, device, seed=self.seed + index)
            self._inputs.append((e.requires_grad_(True), c.requires_grad_(True), targets))

    def _outputs(self, config: KernelConfig) -> Outputs:
        """Loss, dE and dC of one forward+backward on the first input set."""
        e, c, targets = self._inputs[0]
        e.grad = c.grad = None
        with override_config(config):
            loss = self.loss_fn(e, c, targets)
            loss.backward()
        outputs = Outputs(loss.detach(), e.grad, c.grad)
        e.grad = c.grad = None
        return outputs

    def _stage_time(self, kernel: str, config: KernelConfig) -> Timing:
        """The forward's time, or the backward's (forward+backward minus forward)."""
        forward = self._forward_time(config)
        return forward if kernel == "forward" else self._whole_time(config).minus(forward.median_ms)

    def _forward_time(self, config: KernelConfig) -> Timing:
        key = (config.forward, config.vocab_splits)  # all the forward launch depends on
        if key not in self._forward:
            def forward(e: Tensor, c: Tensor, targets: Tensor) -> None:
                with torch.no_grad():
                    self.loss_fn(e, c, targets)

            with override_config(config):
                self._forward[key] = self.timer(cycling(forward, self._inputs))
        return self._forward[key]

    def _whole_time(self, config: KernelConfig) -> Timing:
        if config not in self._whole:
            def forward_backward(e: Tensor, c: Tensor, targets: Tensor) -> None:
                e.grad = c.grad = None
                self.loss_fn(e, c, targets).backward()

            with override_config(config):
                self._whole[config] = self.timer(cycling(forward_backward, self._inputs))
        return self._whole[config]

