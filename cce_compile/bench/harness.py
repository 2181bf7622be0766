"""Times, sizes and checks every implementation on the same inputs, in one process, on one GPU.

For each shape and input kind: one bf16 `e @ c.T` GEMM of the same shape is timed in the
same run as the yardstick (ratios to it carry across machines); each implementation gets
its relative errors against a float32 reference, its peak memory above the inputs during
forward+backward, and median forward and forward+backward times from
`triton.testing.do_bench` (which clears L2 before every timed call), cycling over a few
input sets so no timing rides on one draw of the data. A failing implementation is
recorded and the run goes on.
"""

from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from torch import Tensor

from cce_compile.bench.inputs import (
    InputSet, SoftmaxStats, cycling, heavy_tail_inputs, lm_like_inputs, softmax_stats, uniform_inputs,
)
from cce_compile.bench.metrics import relative_error
from cce_compile.bench.peers import Impl, LossFn, try_load
from cce_compile.bench.shapes import QUICK_SHAPES, SHAPES, Shape, parse_shape  # noqa: F401 - the harness's shapes

DTYPE = torch.bfloat16
DEVICE = "cuda"
MIB = 2**20
INPUT_KINDS = {"lm_like": lm_like_inputs, "heavy_tail": heavy_tail_inputs, "uniform": uniform_inputs}
DEFAULT_KINDS = ["lm_like", "uniform"]
"""heavy_tail (filtered mode's harder case) runs when asked for."""
_REFERENCE_CHUNK_ELEMENTS = 2**28  # float32 logits of one token chunk: 1 GiB
_REASON_CHARS = 400
_LOG_WIDTH = 220


def resolve_kinds(kinds: list[str] | None) -> list[str]:
    """The named input kinds, checked; None or empty means DEFAULT_KINDS."""
    unknown = sorted(set(kinds or []) - INPUT_KINDS.keys())
    if unknown:
        raise ValueError(f"unknown input kinds {unknown}; choose from {list(INPUT_KINDS)}")
    return list(kinds) if kinds else list(DEFAULT_KINDS)


@dataclass(frozen=True)
class Settings:
    """Timing knobs. `min_reps` stretches do_bench's repetition time for slow calls so a
    median is never taken over one sample; `budget_s` skips what would start after it."""

    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    min_reps: int = 5
    input_sets: int = 2
    seed: int = 0
    budget_s: float | None = None
    uniform_all: bool = False
    frozen_head: bool = False
    """c frozen, as in a LoRA run: backward asks for dE alone, memory is over dE's own bytes,
    and dC's error is not measured."""


class BenchmarkUnavailable(RuntimeError):
    """The benchmark cannot run on this machine; the message says what it needs."""


def require_cuda() -> None:
    if not torch.cuda.is_available():
        raise BenchmarkUnavailable(
            "cce bench times CUDA kernels and needs a CUDA GPU, but torch.cuda.is_available() is False "
            "here. Run it on a GPU machine; saved results can be re-rendered anywhere with "
            "`cce bench --render`."
        )


@dataclass
class ImplResult:
    impl: str
    """The results' impl column (peers.Impl.row_name)."""
    label: str
    status: str  # ok | failed | unavailable | skipped
    compiled: bool = False
    note: str = ""
    reason: str | None = None
    rel_err_loss: float | None = None
    rel_err_de: float | None = None
    rel_err_dc: float | None = None
    peak_mib: float | None = None
    memory_x_grads: float | None = None
    fwd_bwd_ms: float | None = None
    fwd_bwd_x_gemm: float | None = None
    fwd_ms: float | None = None
    fwd_x_gemm: float | None = None


@dataclass
class RunResult:
    shape: Shape
    kind: str
    input_sets: int
    gemm_ms: float
    grad_mib: float
    reference_loss: float
    input_stats: SoftmaxStats
    impls: list[ImplResult] = field(default_factory=list)


@dataclass(frozen=True)
class Reference:
    loss: float
    de: Tensor
    dc: Tensor


@contextlib.contextmanager
def _float32_matmul(precision: str) -> Iterator[None]:
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


@torch.no_grad()
def reference_loss_and_grads(e: Tensor, c: Tensor, targets: Tensor) -> Reference:
    """Mean loss, dE and dC in float32 (TF32 off), over token chunks so the full logits
    never exist at once; dC accumulates in float32."""
    n, v = e.shape[0], c.shape[0]
    rows = max(1, _REFERENCE_CHUNK_ELEMENTS // v)
    e32, c32 = e.float(), c.float()
    de = torch.empty_like(e32)
    dc = torch.zeros_like(c32)
    loss_sum = torch.zeros((), dtype=torch.float64, device=e.device)
    with _float32_matmul("highest"):
        for start in range(0, n, rows):
            e_chunk, t_chunk = e32[start : start + rows], targets[start : start + rows]
            logits = e_chunk @ c32.T
            lse = torch.logsumexp(logits, 1)
            loss_sum += (lse - logits.gather(1, t_chunk[:, None])[:, 0]).double().sum()
            grad = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
            grad[torch.arange(len(t_chunk), device=e.device), t_chunk] -= 1.0
            grad /= n
            de[start : start + rows] = grad @ c32
            dc.addmm_(grad.T, e_chunk)
    return Reference(loss=(loss_sum / n).item(), de=de, dc=dc)


def relative_errors(fn: LossFn, e: Tensor, c: Tensor, targets: Tensor, ref: Reference) -> dict[str, float]:
    """One forward+backward of `fn` against `ref` (e a leaf requiring grad; c one too, or frozen,
    when dC's error is None)."""
    e.grad = c.grad = None
    loss = fn(e, c, targets)
    loss.backward()
    errors = {
        "rel_err_loss": abs(loss.item() - ref.loss) / abs(ref.loss),
        "rel_err_de": relative_error(e.grad, ref.de),
        "rel_err_dc": relative_error(c.grad, ref.dc) if c.requires_grad else None,
    }
    e.grad = c.grad = None
    return errors


def _peak_fwd_bwd_bytes(fn: LossFn, e: Tensor, c: Tensor, targets: Tensor) -> int:
    """Peak allocation above what exists before the call, gradients included."""
    e.grad = c.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn(e, c, targets).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    e.grad = c.grad = None
    return peak


def _median_ms(call: Callable[[], None], settings: Settings, estimate_ms: float, grads: list[Tensor] | None = None) -> float:
    import triton.testing

    rep_ms = max(settings.rep_ms, settings.min_reps * estimate_ms)
    return triton.testing.do_bench(call, warmup=settings.warmup_ms, rep=rep_ms, grad_to_none=grads, return_mode="median")


def _release_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _as_model_head(grad_set: InputSet) -> tuple[list[InputSet], list[InputSet]]:
    """Under reduce-overhead, c as a model's head weight is: an nn.Parameter, which CUDA graph
    trees read in place where they copy a plain input into the graph's own buffer at every call
    (2 x c's bytes of traffic, 0.02-0.05 x GEMM, that no training step pays). One draw, since the
    graph holds the parameter's address; e stays a plain input, copied in (N x D, small)."""
    e, c, targets = grad_set
    head = torch.nn.Parameter(c.detach(), requires_grad=c.requires_grad)
    return [(e, head, targets)], [(e.detach(), head, targets)]


def _measure_impl(impl: Impl, grad_sets: list[InputSet], plain_sets: list[InputSet], ref: Reference, run: RunResult,
                  settings: Settings) -> ImplResult:
    """Errors, then memory (the second call, after any compilation), then the two timings.
    Whatever was measured before a failure is kept."""
    compiled = impl.compile_mode is not None
    # A recompile budget of its own (impls loaded from one lambda share its code object's; some
    # compile inside their loader).
    torch._dynamo.reset()
    loaded = try_load(impl)
    if isinstance(loaded, str):
        return ImplResult(impl.row_name, impl.label, "unavailable", compiled, reason=loaded[:_REASON_CHARS])
    result = ImplResult(impl.row_name, impl.label, "ok", compiled, note=loaded.note)
    fn = loaded.fn
    if impl.compile_mode == "reduce-overhead":
        grad_sets, plain_sets = _as_model_head(grad_sets[0])
    grads = [t for e, c, _ in grad_sets for t in (e, c)]
    try:
        for name, value in relative_errors(fn, *grad_sets[0], ref).items():
            setattr(result, name, value)
        started = time.perf_counter()
        peak = _peak_fwd_bwd_bytes(fn, *grad_sets[0])
        estimate_ms = (time.perf_counter() - started) * 1e3
        result.peak_mib = peak / MIB
        result.memory_x_grads = result.peak_mib / run.grad_mib
        fwd_bwd = cycling(lambda e, c, t: fn(e, c, t).backward(), grad_sets)
        result.fwd_bwd_ms = _median_ms(fwd_bwd, settings, estimate_ms, grads)
        result.fwd_bwd_x_gemm = result.fwd_bwd_ms / run.gemm_ms
        with torch.no_grad():
            result.fwd_ms = _median_ms(cycling(fn, plain_sets), settings, estimate_ms)
        result.fwd_x_gemm = result.fwd_ms / run.gemm_ms
    except Exception as err:  # noqa: BLE001 - OOMs and kernel errors are results too
        result.status, result.reason = "failed", f"{type(err).__name__}: {err}"[:_REASON_CHARS]
    finally:
        for t in grads:
            t.grad = None
        _release_memory()
    return result


def _timed_impls(kind: str, impls: list[Impl], settings: Settings) -> list[Impl]:
    """Uniform inputs only change the speed of filtering kernels: the rest are timed on
    LM-like inputs alone unless `uniform_all`."""
    if kind == "uniform" and not settings.uniform_all:
        return [impl for impl in impls if impl.on_uniform]
    return impls


def _run_shape_kind(shape: Shape, kind: str, impls: list[Impl], settings: Settings, deadline: float,
                    progress: Progress, task: TaskID) -> RunResult:
    sets = [INPUT_KINDS[kind](shape.n, shape.d, shape.v, DTYPE, DEVICE, settings.seed + i) for i in range(settings.input_sets)]
    grad_sets = [(e.detach().requires_grad_(), c.detach().requires_grad_(not settings.frozen_head), t)
                 for e, c, t in sets]
    ref = reference_loss_and_grads(*sets[0])
    logits_out = torch.empty(shape.n, shape.v, dtype=DTYPE, device=DEVICE)
    gemm_ms = _median_ms(cycling(lambda e, c, _: torch.mm(e, c.T, out=logits_out), sets), settings, 0.0)
    del logits_out
    _release_memory()
    grad_bytes = sum(t.numel() * t.element_size() for t in grad_sets[0][:2] if t.requires_grad)
    run = RunResult(shape, kind, settings.input_sets, gemm_ms, grad_bytes / MIB, ref.loss, softmax_stats(*sets[0]))
    stats = run.input_stats
    progress.console.log(f"{shape.label} {kind}: GEMM {gemm_ms:.2f} ms; inputs: loss {stats['mean_loss']:.2f}, "
                         f"{100 * stats['frac_above_eps']:.3f}% of softmax > 2^-12")
    for impl in impls:
        if time.monotonic() > deadline:
            result = ImplResult(impl.row_name, impl.label, "skipped", impl.compile_mode is not None,
                                reason="the time budget (--budget-s) was spent")
        else:
            result = _measure_impl(impl, grad_sets, sets, ref, run, settings)
        run.impls.append(result)
        progress.advance(task)
        progress.console.log(_describe(shape.label, kind, result))
    return run


def run_benchmark(shapes: list[Shape], kinds: list[str], impls: list[Impl], settings: Settings,
                  on_run: Callable[[RunResult], None] | None = None) -> list[RunResult]:
    """Every (kind, shape) in turn, kinds outermost so a budget cut drops uniform inputs first.

    `on_run` sees each finished run (to save partial results). Raises BenchmarkUnavailable
    without CUDA. Runs that would start after the budget is spent are left out (and logged).
    """
    require_cuda()
    kinds = resolve_kinds(kinds)
    deadline = time.monotonic() + settings.budget_s if settings.budget_s is not None else float("inf")
    plan = [(kind, shape, _timed_impls(kind, impls, settings)) for kind in kinds for shape in shapes]
    runs: list[RunResult] = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    console = Console(log_path=False)
    if not console.is_terminal:
        console.width = _LOG_WIDTH  # a log file: one line per result, unwrapped
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("cce bench", total=sum(len(run_impls) for _, _, run_impls in plan))
        for kind, shape, run_impls in plan:
            if time.monotonic() > deadline:
                progress.console.log(f"{shape.label} {kind}: left out, the time budget (--budget-s) was spent")
                continue
            progress.update(task, description=f"{shape.label} {kind}")
            runs.append(_run_shape_kind(shape, kind, run_impls, settings, deadline, progress, task))
            _release_memory()
            if on_run is not None:
                on_run(runs[-1])
    return runs


def _describe(shape_label: str, kind: str, result: ImplResult) -> str:
    where = f"{shape_label} {kind} {result.label}"
    if result.status != "ok":
        return f"{where}: {result.status} ({result.reason})"
    dc = "" if result.rel_err_dc is None else f" dC {result.rel_err_dc:.1e}"
    note = f" ({result.note})" if result.note else ""
    return (f"{where}: fwd+bwd {result.fwd_bwd_ms:.2f} ms ({result.fwd_bwd_x_gemm:.2f}x GEMM), "
            f"fwd {result.fwd_ms:.2f} ms, {result.peak_mib:.0f} MiB ({result.memory_x_grads:.2f}x grads), "
            f"rel.err dE {result.rel_err_de:.1e}{dc}{note}")
