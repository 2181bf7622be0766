"""The benchmark on CPU: LM-like inputs, the float32 reference, the harness's flow (CUDA timing
and memory calls stubbed out) eager and under torch.compile, its refusal without a GPU, the
results CSV and what is rendered from it, and the tables in the docs that come from it."""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from cce_compile.bench import harness, report, results
from cce_compile.bench.harness import Settings, Shape
from cce_compile.bench.inputs import _tile_fraction, heavy_tail_inputs, lm_like_inputs, softmax_stats, uniform_inputs
from cce_compile.bench.peers import (
    IMPLS, Impl, ImplUnavailable, Loaded, resolve_compile_modes, resolve_impls, with_compile_modes,
)

REPO = Path(__file__).resolve().parents[1]

SMALL = (256, 97, 1031)  # N, D, V: the shape the inputs module promises to build fast


def test_lm_like_inputs_are_deterministic_and_never_zero() -> None:
    first = lm_like_inputs(*SMALL, torch.bfloat16, "cpu", seed=3)
    again = lm_like_inputs(*SMALL, torch.bfloat16, "cpu", seed=3)
    other = lm_like_inputs(*SMALL, torch.bfloat16, "cpu", seed=4)
    for x, y in zip(first, again):
        assert torch.equal(x, y)
    assert not torch.equal(first[0], other[0])
    e, c, targets = first
    assert e.shape == (256, 97) and c.shape == (1031, 97) and targets.shape == (256,)
    assert e.dtype == c.dtype == torch.bfloat16 and targets.dtype == torch.int64
    assert bool((e != 0).all()) and bool((c != 0).all())
    assert int(targets.min()) >= 0 and int(targets.max()) < 1031


def test_lm_like_inputs_refuse_a_hidden_size_of_one() -> None:
    """At D = 1 every input came out NaN (nothing is orthogonal to the shared direction), and
    `cce tune` dropped every candidate against a NaN reference and exited 0."""
    assert lm_like_inputs(4, 2, 16, torch.float32, "cpu", seed=0)[0].isfinite().all()
    for make in (lm_like_inputs, heavy_tail_inputs):
        with pytest.raises(ValueError, match="hidden size of 2 at least, got 1"):
            make(4, 1, 16, torch.float32, "cpu", seed=0)


def test_lm_like_loss_is_calibrated_on_rows_it_was_not_calibrated_on() -> None:
    e, c, targets = lm_like_inputs(768, 97, 1031, torch.float32, "cpu", seed=0, target_loss=3.0)
    held_out = softmax_stats(e[256:], c, targets[256:], rows=512)
    assert held_out["rows"] == 512
    assert 2.5 < held_out["mean_loss"] < 3.5
    assert held_out["median_loss"] < held_out["mean_loss"]  # skewed, as an LM's per-token loss


def test_lm_like_softmax_is_sparse_where_uniform_is_flat() -> None:
    """At this small D the boosts' cross-talk widens the bulk: more entries pass 2^-12 than
    at model sizes (a few tens per row there), but still a small fraction of V."""
    shape = (256, 97, 20011)
    lm_like = softmax_stats(*lm_like_inputs(*shape, torch.float32, "cpu", seed=0))
    uniform = softmax_stats(*uniform_inputs(*shape, torch.float32, "cpu", seed=0))
    assert abs(lm_like["mean_loss"] - 3.0) < 0.05
    assert 1e-4 < lm_like["frac_above_eps"] < 2e-2
    assert 10 < lm_like["entries_above_eps_per_row"] < 300
    assert uniform["mean_loss"] > math.log(20011)  # flat: no entry stands out


def test_heavy_tail_inputs_hold_more_mass_under_the_filter() -> None:
    """heavy_tail_inputs: the same mean loss as lm_like, with much more of the softmax's mass in
    entries under 2^-12, which filtering skips."""
    shape = (256, 97, 20011)

    def tail_mass(e: torch.Tensor, c: torch.Tensor) -> float:
        softmax = torch.softmax(e @ c.T, dim=1)
        return torch.where(softmax < 2.0**-12, softmax, 0.0).sum(dim=1).mean().item()

    lm_like = lm_like_inputs(*shape, torch.float32, "cpu", seed=0)
    heavy = heavy_tail_inputs(*shape, torch.float32, "cpu", seed=0)
    assert abs(softmax_stats(*heavy)["mean_loss"] - 3.0) < 0.05
    assert tail_mass(*heavy[:2]) > 1.5 * tail_mass(*lm_like[:2])


def test_tile_fraction_counts_padded_edge_tiles() -> None:
    above = torch.zeros(200, 300, dtype=torch.bool)  # 2 x 3 tiles, the last row and column partial
    above[199, 299] = True
    above[0, 0] = True
    assert _tile_fraction(above) == pytest.approx(2 / 6)


def test_reference_matches_autograd_in_float64() -> None:
    e, c, targets = lm_like_inputs(*SMALL, torch.float32, "cpu", seed=1)
    ref = harness.reference_loss_and_grads(e, c, targets)
    e64, c64 = e.double().requires_grad_(), c.double().requires_grad_()
    loss = F.cross_entropy(e64 @ c64.T, targets)
    loss.backward()
    assert ref.loss == pytest.approx(loss.item(), rel=1e-5)
    torch.testing.assert_close(ref.de, e64.grad.float(), rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(ref.dc, c64.grad.float(), rtol=1e-4, atol=1e-7)


def test_reference_is_the_same_in_token_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    e, c, targets = lm_like_inputs(*SMALL, torch.float32, "cpu", seed=1)
    whole = harness.reference_loss_and_grads(e, c, targets)
    monkeypatch.setattr(harness, "_REFERENCE_CHUNK_ELEMENTS", 37 * 1031)  # chunks of 37 tokens
    chunked = harness.reference_loss_and_grads(e, c, targets)
    assert chunked.loss == pytest.approx(whole.loss, rel=1e-6)
    torch.testing.assert_close(chunked.de, whole.de)
    torch.testing.assert_close(chunked.dc, whole.dc)


def test_harness_refuses_politely_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(harness.BenchmarkUnavailable, match="needs a CUDA GPU.*--render"):
        harness.run_benchmark([harness.SHAPES["gemma2-2b"]], ["lm_like"], resolve_impls(None), Settings())


def _bench(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """`cce bench ARGS` in this process: its exit status, and its one line of error if it failed."""
    from cce_compile.cli.main import app

    with pytest.raises(SystemExit) as done:
        app(["bench", *args])
    status, said = done.value.code, capsys.readouterr().err
    if status:
        assert len(said.splitlines()) == 1 and said.startswith("cce: error: "), said
    return status, said


def test_cli_refuses_politely_without_cuda(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    status, said = _bench(capsys, "--quick")
    assert status == 2 and "needs a CUDA GPU" in said


@pytest.mark.parametrize(("args", "said"), [
    pytest.param(["--sync", "README.md"], "use it with --render", id="sync-without-render"),
    pytest.param(["--shapes", "0x0x0"], "for --shapes: shape '0x0x0': N, D and V must each be at least 1",
                 id="empty-shape"),
    pytest.param(["--shapes", "100x0x1000"], "for --shapes: shape '100x0x1000'", id="zero-hidden-size"),
    pytest.param(["--shapes", "llama"], "for --shapes: shape 'llama' is neither", id="unknown-shape"),
    pytest.param(["--shapes", ",,"], "names nothing", id="no-shape-named"),
    pytest.param(["--impls", " "], "names nothing", id="no-impl-named"),
    pytest.param(["--budget-s", "-5"], "greater than or equal to 0", id="negative-budget"),
    pytest.param(["--impls", "nope"], "for --impls: unknown impls ['nope']", id="unknown-impl"),
    pytest.param(["--kinds", "zeros"], "for --kinds: unknown input kinds ['zeros']", id="unknown-kind"),
    pytest.param(["--compile", "max"], "for --compile: unknown compile modes ['max']", id="unknown-compile-mode"),
    pytest.param(["--out", "{tmp}/bench.csv"], "is not a folder", id="out-a-file"),
    pytest.param(["--out", "{tmp}/bench.csv/results"], "bench.csv is not a folder", id="out-below-a-file"),
    pytest.param(["--out", "{tmp}"], "bench.csv line 2: 2 cells", id="out-a-short-row"),
])
def test_cli_checks_its_arguments_before_asking_for_a_gpu(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, args: list[str], said: str
) -> None:
    """Each was accepted (a shape of zeros went to the harness, `--shapes ,,` ran every model
    shape, --sync was dropped, an --out whose bench.csv cannot take rows failed after the first
    shape's run) or, without a GPU, reported as the missing GPU instead; an unknown shape, impl,
    input kind or compile mode named no option."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (tmp_path / "bench.csv").write_text(",".join(results.COLUMNS) + "\nNVIDIA H200,2.11\n")
    args = [arg.replace("{tmp}", str(tmp_path)) for arg in args]
    status, error = _bench(capsys, *args)
    assert status == 2 and said in error and "CUDA" not in error, error


def test_shapes_impls_and_modes_resolve_by_name() -> None:
    assert harness.parse_shape("llama3-8b") == Shape("llama3-8b", 8192, 4096, 128256)
    assert harness.parse_shape("8192x4096x128256").name == "llama3-8b"  # a known shape's NxDxV keeps its name
    assert harness.parse_shape("100x64x1000") == Shape("100x64x1000", 100, 64, 1000)
    assert harness.parse_shape("100x64x1000").spec == "100x64x1000"
    with pytest.raises(ValueError, match="NxDxV"):
        harness.parse_shape("llama")
    with pytest.raises(ValueError, match="at least 1"):
        harness.parse_shape("100x64x0")
    assert [impl.key for impl in resolve_impls(["torch", "cce_exact"])] == ["cce_exact", "torch"]
    with pytest.raises(ValueError, match="unknown impls"):
        resolve_impls(["nope"])
    with pytest.raises(ValueError, match="unknown input kinds"):
        harness.resolve_kinds(["zeros"])
    assert harness.resolve_kinds(None) == ["lm_like", "uniform"]
    assert harness.resolve_kinds(["heavy_tail"]) == ["heavy_tail"]
    assert resolve_compile_modes(None) == ["eager", "default", "reduce-overhead"]
    with pytest.raises(ValueError, match="unknown compile modes"):
        resolve_compile_modes(["max-speed"])


def test_compile_modes_apply_to_the_compilable_impls_only() -> None:
    """Both exact memory modes and filtered mode are benchmarked; peers run eager alone."""
    assert {"cce_exact", "cce_exact_low", "cce_filtered"} <= IMPLS.keys()
    variants = with_compile_modes(resolve_impls(["cce_exact", "liger"]), ["eager", "default", "reduce-overhead"])
    assert [(v.row_name, v.compile_mode) for v in variants] == [
        ("cce_exact", None), ("cce_exact", "default"), ("cce_exact:reduce-overhead", "reduce-overhead"), ("liger", None)]
    assert variants[2].label.endswith("torch.compile reduce-overhead")


def _broken() -> Loaded:
    def fail(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("kernel exploded")

    return Loaded(fail)


def _missing() -> Loaded:
    raise ImplUnavailable("not installed here")


@pytest.fixture
def cpu_harness(monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness on CPU tensors, with CUDA's timing and memory calls stubbed out."""
    import triton.testing

    def one_call_do_bench(fn: Callable[[], None], warmup: float, rep: float, grad_to_none: list | None = None,
                          return_mode: str = "mean") -> float:
        assert return_mode == "median" and rep >= warmup
        fn()
        return 2.0

    monkeypatch.setattr(harness, "DEVICE", "cpu")
    monkeypatch.setattr(harness, "require_cuda", lambda: None)
    monkeypatch.setattr(triton.testing, "do_bench", one_call_do_bench)
    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 3 * 2**20)


ENV = {"gpu": "cpu", "torch": torch.__version__, "triton": "3.9.0", "commit": "abc1234", "date": "2026-12-03T07:00:00+00:00"}
TINY = Shape("tiny", 64, 48, 1000)


def test_harness_flow_records_errors_failures_and_budget(cpu_harness: None, tmp_path: Path) -> None:
    impls = [IMPLS["cce_exact"], IMPLS["cce_exact_low"], IMPLS["torch"], Impl("broken", "broken", _broken, on_uniform=True),
             Impl("missing", "missing", _missing, on_uniform=False)]
    seen = []
    runs = harness.run_benchmark([TINY], ["lm_like", "uniform"], impls, Settings(input_sets=2), on_run=seen.append)
    assert seen == runs and [run.kind for run in runs] == ["lm_like", "uniform"]
    lm_like, uniform = runs
    assert lm_like.gemm_ms == 2.0 and lm_like.grad_mib == (64 * 48 + 1000 * 48) * 2 / 2**20
    by_key = {result.impl: result for result in lm_like.impls}
    for key in ("cce_exact", "cce_exact_low", "torch"):
        ok = by_key[key]
        assert ok.status == "ok", ok.reason
        assert not ok.compiled
        assert ok.rel_err_loss < 1e-2 and ok.rel_err_de < 3e-2 and ok.rel_err_dc < 3e-2
        assert ok.fwd_bwd_x_gemm == 1.0 and ok.fwd_x_gemm == 1.0 and ok.peak_mib == 3.0
    assert by_key["broken"].status == "failed" and "kernel exploded" in by_key["broken"].reason
    assert by_key["missing"].status == "unavailable" and "not installed" in by_key["missing"].reason
    assert [result.impl for result in uniform.impls] == ["cce_exact", "cce_exact_low", "broken"]  # on_uniform only

    assert harness.run_benchmark([TINY], ["lm_like"], impls, Settings(budget_s=1e-9)) == []

    written = report.save(lm_like, ENV, tmp_path)
    assert written[:2] == [tmp_path / "bench.csv", tmp_path / "latest.md"]
    with (tmp_path / "bench.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [row["impl"] for row in rows] == ["cce_exact", "cce_exact_low", "torch"]  # nothing measured: no row
    assert rows[0]["shape"] == "64x48x1000" and rows[0]["inputs"] == "lm_like" and rows[0]["compiled"] == "0"
    assert float(rows[0]["fwdbwd_x_gemm"]) == 1.0 and float(rows[0]["err_dE"]) < 3e-2


def test_harness_times_the_op_compiled(cpu_harness: None, tmp_path: Path) -> None:
    """torch.compile'd variants (default and reduce-overhead) give compiled=1 rows whose errors
    match the eager call's."""
    variants = with_compile_modes(resolve_impls(["cce_exact", "torch"]), ["eager", "default", "reduce-overhead"])
    variants = [v for v in variants if v.key == "cce_exact" or v.compile_mode == "default"]
    (run,) = harness.run_benchmark([TINY], ["lm_like"], variants, Settings(input_sets=1))
    by_name = {(result.impl, result.compiled): result for result in run.impls}
    assert set(by_name) == {("cce_exact", False), ("cce_exact", True), ("cce_exact:reduce-overhead", True),
                            ("torch", True)}
    for result in by_name.values():
        assert result.status == "ok", result.reason
    eager = by_name["cce_exact", False]
    for key in (("cce_exact", True), ("cce_exact:reduce-overhead", True)):
        assert by_name[key].rel_err_de == pytest.approx(eager.rel_err_de, rel=1e-2)
    report.save(run, ENV, tmp_path)
    rows = results.read_rows(tmp_path / "bench.csv")
    assert [(row["impl"], row["compiled"]) for row in rows] == [
        ("cce_exact", "0"), ("cce_exact", "1"), ("cce_exact:reduce-overhead", "1"), ("torch", "1")]


@pytest.mark.parametrize("frozen_head", [False, True], ids=["trained head", "frozen head"])
def test_reduce_overhead_rows_take_c_as_one_model_parameter(cpu_harness: None, frozen_head: bool) -> None:
    """Under reduce-overhead every call gets c as one nn.Parameter (a model's head weight, which
    CUDA graph trees read in place instead of copying it in), frozen or not, with and without
    grad, holding the first draw's data (the reference's); the other modes get the plain draws."""
    seen: dict[str, list[torch.Tensor]] = {}

    def recording(mode: str) -> Callable[[], Loaded]:
        def load() -> Loaded:
            def fn(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
                seen.setdefault(mode, []).append(c)
                return F.cross_entropy(e.float() @ c.float().T, targets)
            return Loaded(fn)
        return load

    impls = [Impl("probe", "probe", recording(mode), on_uniform=False, compilable=True, compile_mode=mode)
             for mode in ("default", "reduce-overhead")]
    settings = Settings(input_sets=2, frozen_head=frozen_head)
    (run,) = harness.run_benchmark([TINY], ["lm_like"], impls, settings)
    assert [result.status for result in run.impls] == ["ok", "ok"], [result.reason for result in run.impls]
    static = seen["reduce-overhead"]
    assert all(type(c) is torch.nn.Parameter and c.requires_grad != frozen_head for c in static)
    assert len({id(c) for c in static}) == 1 and len(static) > 2
    first_draw = lm_like_inputs(TINY.n, TINY.d, TINY.v, harness.DTYPE, "cpu", settings.seed)[1]
    assert torch.equal(static[0].detach(), first_draw)
    assert seen["default"] and not any(isinstance(c, torch.nn.Parameter) for c in seen["default"])


def test_each_compiled_impl_gets_its_own_recompile_budget(cpu_harness: None) -> None:
    """cce_exact and cce_filtered are loaded from one lambda, so their graphs sit on one code
    object, whose recompile limit fullgraph=True turns into a failure: each compiled impl starts
    with the budget empty (here a limit of 2: each takes two graphs, with and without grad).
    The limit is set through config.patch: pytest 9's monkeypatch undoes a setattr on torch's
    config module by deleting the name, which hides the option from every later test."""
    variants = [v for v in with_compile_modes(resolve_impls(["cce_exact", "cce_filtered"]), ["default"])]
    with torch._dynamo.config.patch(recompile_limit=2):
        (run,) = harness.run_benchmark([TINY], ["lm_like"], variants, Settings(input_sets=1))
    assert [(result.impl, result.status) for result in run.impls] == [("cce_exact", "ok"), ("cce_filtered", "ok")], [
        result.reason for result in run.impls]


def test_reduce_overhead_compiles_one_graph_for_every_draw() -> None:
    """Under reduce-overhead e and c are plain inputs (marking them static failed every row on
    the H200, bench/peers._compiled): one graph serves every input draw, and each draw's loss
    and gradients are its own."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    (variant,) = with_compile_modes(resolve_impls(["torch"]), ["reduce-overhead"])
    fn = variant.load().fn
    draws = []
    for seed in (0, 1):
        e, c, targets = lm_like_inputs(32, 16, 300, torch.float32, "cpu", seed=seed)
        draws.append(([t.clone().requires_grad_() for t in (e, c)], targets))
    graphs_before = counters["stats"]["unique_graphs"]
    for leaves, targets in draws + draws:
        loss = fn(*leaves, targets)
        loss.backward()
        assert not any(hasattr(leaf, "_dynamo_static_input_type") for leaf in leaves)
        expected_leaves = [leaf.detach().clone().requires_grad_() for leaf in leaves]
        expected = F.cross_entropy(expected_leaves[0] @ expected_leaves[1].T, targets)
        expected.backward()
        torch.testing.assert_close(loss, expected)
        for leaf, expected_leaf in zip(leaves, expected_leaves):
            torch.testing.assert_close(leaf.grad, expected_leaf.grad)
            leaf.grad = None
    assert counters["stats"]["unique_graphs"] - graphs_before == 1


def test_harness_with_a_frozen_head_asks_for_de_alone(cpu_harness: None, tmp_path: Path) -> None:
    """--frozen-head: memory over dE's bytes, no dC error, and the rows say which inputs."""
    settings = Settings(input_sets=1, frozen_head=True)
    (run,) = harness.run_benchmark([TINY], ["lm_like"], [IMPLS["cce_exact"]], settings)
    assert run.grad_mib == 64 * 48 * 2 / 2**20
    (result,) = run.impls
    assert result.status == "ok", result.reason
    assert result.rel_err_de < 3e-2 and result.rel_err_dc is None
    report.save(run, ENV, tmp_path, frozen_head=True)
    (row,) = results.read_rows(tmp_path / "bench.csv")
    assert row["inputs"] == "lm_like+frozen_head" and row["err_dC"] == ""


def _row(**cells: object) -> dict[str, object]:
    base = {**ENV, "shape": "8192x2304x256000", "inputs": "lm_like", "impl": "cce_exact", "compiled": 0,
            "fwd_ms": 15.0, "fwdbwd_ms": 58.0, "gemm_ms": 14.3, "fwd_x_gemm": 1.05, "fwdbwd_x_gemm": 4.06,
            "peak_mib": 1200.0, "peak_x_grads": 1.03, "err_dE": 3e-3, "err_dC": 2e-3}
    return base | cells


def test_csv_appends_under_one_header_and_refuses_another(tmp_path: Path) -> None:
    path = tmp_path / "bench.csv"
    results.append_rows(path, [_row()])
    results.append_rows(path, [_row(impl="torch", compiled=1, err_dC=None)])
    lines = path.read_text().splitlines()
    assert lines[0] == ",".join(results.COLUMNS) and len(lines) == 3
    assert lines[2].endswith(",0.003,")  # None is an empty cell
    with pytest.raises(ValueError, match="unknown columns"):
        results.append_rows(path, [{"gpu": "x", "speed": 1}])
    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="does not have the results columns"):
        results.append_rows(other, [_row()])


def test_a_row_cut_short_is_named_by_its_line_and_never_appended_to(tmp_path: Path) -> None:
    """A run stopped mid-row leaves a short last line: rendering met its missing cells as None
    (AttributeError), and the next run's first row was glued onto it."""
    path = tmp_path / "bench.csv"
    results.append_rows(path, [_row(), _row(impl="torch")])
    whole = path.read_text()
    path.write_text(whole[: whole.rindex(",0.003,")])
    for call in (lambda: results.read_rows(path), lambda: results.render(path),
                 lambda: results.append_rows(path, [_row(impl="liger")])):
        with pytest.raises(ValueError, match=r"bench.csv line 3: 16 cells where the results have 18"):
            call()
    assert path.read_text() == whole[: whole.rindex(",0.003,")]
    path.write_text(whole + "1,2\n")
    with pytest.raises(ValueError, match="line 4: 2 cells"):
        results.read_rows(path)


def test_rows_appended_after_a_last_row_without_its_newline_start_a_line(tmp_path: Path) -> None:
    """A whole last row whose newline a hand edit dropped passes read_rows; the next run's first
    row was glued onto it (one line of 35 cells), and the file no longer read back."""
    path = tmp_path / "bench.csv"
    results.append_rows(path, [_row()])
    path.write_text(path.read_text().rstrip("\n"))
    results.append_rows(path, [_row(impl="torch")])
    assert [row["impl"] for row in results.read_rows(path)] == [_row()["impl"], "torch"]


def test_latest_keeps_the_newest_row_of_each_measurement(tmp_path: Path) -> None:
    path = tmp_path / "bench.csv"
    results.append_rows(path, [_row(fwdbwd_x_gemm=4.5, date="2026-12-01T00:00:00+00:00"),
                               _row(impl="torch", fwdbwd_x_gemm=3.3, date="2026-12-01T00:00:00+00:00")])
    results.append_rows(path, [_row(fwdbwd_x_gemm=4.2, date="2026-12-02T00:00:00+00:00"),
                               _row(compiled=1, fwdbwd_x_gemm=3.9, date="2026-12-02T00:00:00+00:00")])
    chosen = results.latest(results.read_rows(path))
    assert [(row["impl"], row["compiled"], row["fwdbwd_x_gemm"]) for row in chosen] == [
        ("torch", "0", "3.3"), ("cce_exact", "0", "4.2"), ("cce_exact", "1", "3.9")]
    table = results.markdown_table(chosen)
    assert "| 8192x2304x256000 (gemma2-2b) | lm_like | torch | 0 | 14.30 | 1.05 | 58.00 | 3.30 |" in table
    assert "|  |  | cce_exact | 1 |" in table  # one shape and inputs cell per group
    written = results.render(path)
    assert written == [tmp_path / "latest.md", tmp_path / "latest.png"]
    assert written[1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_marked_tables_are_rewritten_with_their_filters(tmp_path: Path) -> None:
    path = tmp_path / "bench.csv"
    results.append_rows(path, [_row(), _row(impl="torch"), _row(inputs="uniform")])
    doc = tmp_path / "doc.md"
    doc.write_text("intro\n<!-- cce-bench-table impl=cce_exact inputs=lm_like -->\nstale\n<!-- /cce-bench-table -->\nend\n")
    synced = results.synced_files(results.read_rows(path), [doc])
    assert list(synced) == [doc]
    text = synced[doc]
    assert "stale" not in text and text.startswith("intro\n") and text.endswith("<!-- /cce-bench-table -->\nend\n")
    assert text.count("| cce_exact |") == 1 and "| torch |" not in text
    doc.write_text(text)
    assert results.synced_files(results.read_rows(path), [doc]) == {}  # already in sync
    results.append_rows(path, [_row(gpu="NVIDIA H100 80GB HBM3", fwdbwd_x_gemm=4.9)])
    doc.write_text('<!-- cce-bench-table gpu="NVIDIA H100 80GB HBM3" impl=cce_exact -->\n<!-- /cce-bench-table -->\n')
    text = results.synced_files(results.read_rows(path), [doc])[doc]
    assert text.count("| cce_exact |") == 1 and "| 4.90 |" in text
    doc.write_text("<!-- cce-bench-table speed=1 -->\n<!-- /cce-bench-table -->\n")
    with pytest.raises(results.SyncError, match=f"{doc}: line 1: .*speed=1"):
        results.synced_files(results.read_rows(path), [doc])


def test_docs_tables_come_from_the_committed_csv() -> None:
    """The numbers in the README and docs/performance.md are the CSV's latest rows
    (`cce bench --render --sync README.md --sync docs/performance.md` rewrites them)."""
    rows = results.read_rows(REPO / "benchmarks/results/bench.csv")
    assert rows, "the committed results CSV has no rows"
    for doc in (REPO / "README.md", REPO / "docs/performance.md"):
        text = doc.read_text()
        assert "<!-- cce-bench-table" in text, doc
        assert results.synced_text(text, rows) == text, f"{doc} is out of sync with benchmarks/results/bench.csv"


def test_cli_render_needs_no_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, said = _bench(capsys, "--render", "--out", str(tmp_path))
    assert status == 2 and "no results" in said
    results.append_rows(tmp_path / "bench.csv", [_row()])
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- cce-bench-table -->\nstale\n<!-- /cce-bench-table -->\n")
    assert _bench(capsys, "--render", "--out", str(tmp_path), "--sync", str(doc)) == (0, "")
    assert (tmp_path / "latest.md").exists() and (tmp_path / "latest.png").exists()
    assert "stale" not in doc.read_text() and "| cce_exact |" in doc.read_text()


def test_cli_render_reads_a_csv_beginning_with_a_byte_order_mark(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An editor's UTF-8 byte order mark, which `cce import` takes, was read as part of the first
    column's name and the file refused (header: ['\\ufeffgpu', ...])."""
    path = tmp_path / "bench.csv"
    results.append_rows(path, [_row()])
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert _bench(capsys, "--render", "--out", str(tmp_path)) == (0, "")
    results.append_rows(path, [_row(impl="torch")])
    assert [row["impl"] for row in results.read_rows(path)] == ["cce_exact", "torch"]


@pytest.mark.parametrize(("content", "said"), [
    pytest.param(None, "bench.csv: cannot read it: Is a directory", id="a-directory"),
    pytest.param(b"a,b\n1,2\n", "bench.csv does not have the results columns", id="another-header"),
    pytest.param(b"\xef\xbb\xbf" + ",".join(results.COLUMNS).encode() + b"\n\xff\n",  # the mark counted
                 "bench.csv line 2: not UTF-8 (byte 145 of the file", id="not-utf-8"),
    pytest.param({"fwd_ms": "fast"}, "bench.csv line 2: fwd_ms 'fast' is not a number", id="not-a-number"),
    pytest.param({"shape": "huge"}, "bench.csv line 2: shape 'huge' is neither", id="not-a-shape"),
])
def test_cli_render_names_the_csv_and_the_line_it_cannot_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes | dict[str, str] | None, said: str
) -> None:
    """Each came out as the exception's class and text (`IsADirectoryError: [Errno 21] ...`,
    `ValueError: could not convert string to float: 'fast'`), the last two naming no file."""
    path = tmp_path / "bench.csv"
    if content is None:
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        results.append_rows(path, [_row(**content)])
    status, error = _bench(capsys, "--render", "--out", str(tmp_path))
    assert status == 1 and error.startswith(f"cce: error: --render: {tmp_path}") and said in error, error
    assert "Error" not in error and not (tmp_path / "latest.md").exists()


def test_cli_render_names_a_file_it_cannot_write(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A latest.md that is a folder came out as `IsADirectoryError: [Errno 21] ...`."""
    results.append_rows(tmp_path / "bench.csv", [_row()])
    (tmp_path / "latest.md").mkdir()
    status, error = _bench(capsys, "--render", "--out", str(tmp_path))
    assert status == 1 and f"--render: cannot write {tmp_path / 'latest.md'}: Is a directory" in error, error


@pytest.mark.parametrize(("content", "said"), [
    pytest.param(None, "Is a directory", id="a-directory"),
    pytest.param(b"# no table here\n", "no `<!-- cce-bench-table", id="no-table"),
    pytest.param(b"intro\n\n<!-- cce-bench-table impl=torch -->\n", "line 3: the table marker has no", id="no-end"),
    pytest.param(b"<!-- cce-bench-table foo=bar -->\n<!-- /cce-bench-table -->\n", "line 1: table marker filter 'foo=bar'",
                 id="unknown-filter"),
    pytest.param(b'<!-- cce-bench-table gpu="H100 -->\n<!-- /cce-bench-table -->\n', "No closing quotation",
                 id="unclosed-quote"),
    pytest.param(b"\xff\xfe<!-- cce-bench-table -->\n<!-- /cce-bench-table -->\n", "not UTF-8", id="not-utf-8"),
])
def test_cli_render_checks_every_sync_file_before_writing_any(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes | None, said: str
) -> None:
    """A bad second --sync file once failed after latest.md, latest.png and the first file had
    been rewritten, in a message naming neither the file nor --sync (a bare UnicodeDecodeError
    for one not UTF-8)."""
    results.append_rows(tmp_path / "bench.csv", [_row()])
    good, bad = tmp_path / "good.md", tmp_path / "bad"
    good.write_text("<!-- cce-bench-table -->\nstale\n<!-- /cce-bench-table -->\n")
    if content is None:
        bad.mkdir()
    else:
        bad.write_bytes(content)
    status, error = _bench(capsys, "--render", "--out", str(tmp_path), "--sync", str(good), "--sync", str(bad))
    assert status == 1 and f"--sync {bad}: " in error and said in error, error
    assert "stale" in good.read_text()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["bad", "bench.csv", "good.md"]


def test_cli_render_keeps_a_crlf_files_line_breaks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A file with CRLF line breaks (a Windows checkout) was rewritten with LF ones throughout,
    its whole text changed for one table."""
    results.append_rows(tmp_path / "bench.csv", [_row()])
    readme = tmp_path / "README.md"
    readme.write_bytes(b"# Title\r\n\r\nintro\r\n<!-- cce-bench-table -->\r\nstale\r\n<!-- /cce-bench-table -->\r\nend\r\n")
    status, error = _bench(capsys, "--render", "--out", str(tmp_path), "--sync", str(readme))
    assert status == 0, error
    content = readme.read_bytes()
    assert b"stale" not in content and b"| shape" in content
    assert content.startswith(b"# Title\r\n\r\nintro\r\n") and content.endswith(b"<!-- /cce-bench-table -->\r\nend\r\n")
    assert content.count(b"\n") == content.count(b"\r\n")
    assert not list(tmp_path.glob(".*.partial"))  # written beside it, then renamed over it
    mixed = content.replace(b"end\r\n", b"end\n")  # current tables, one LF line break among CRLF ones
    readme.write_bytes(mixed)
    assert _bench(capsys, "--render", "--out", str(tmp_path), "--sync", str(readme))[0] == 0
    assert readme.read_bytes() == mixed  # its tables unchanged: not rewritten


def test_cli_render_writes_through_a_link_and_keeps_the_files_mode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The synced file is written beside it and renamed over it: a README that is a link (to
    docs/README.md, say) became a plain file, its target left stale, and the new file took the
    umask's mode instead of the file's."""
    results.append_rows(tmp_path / "bench.csv", [_row()])
    (tmp_path / "docs").mkdir()
    target = tmp_path / "docs" / "README.md"
    target.write_text("<!-- cce-bench-table -->\nstale\n<!-- /cce-bench-table -->\n")
    target.chmod(0o640)
    link = tmp_path / "README.md"
    link.symlink_to(Path("docs") / "README.md")
    status, error = _bench(capsys, "--render", "--out", str(tmp_path), "--sync", str(link))
    assert status == 0, error
    assert link.is_symlink() and "| shape" in target.read_text()
    assert target.stat().st_mode & 0o777 == 0o640


def test_results_and_docs_stay_small() -> None:
    """At most 40 files in benchmarks/results/ (older logs live in git) and a performance doc
    a newcomer reads through (history goes to docs/notes/)."""
    results_dir = REPO / "benchmarks/results"
    assert len([path for path in results_dir.rglob("*") if path.is_file()]) <= 40
    assert len((REPO / "docs/performance.md").read_text().splitlines()) <= 400


def test_package_comments_carry_no_history() -> None:
    """Version tags, dates and result-file names belong in docs/notes/ or the git log, not in
    package code."""
    history = re.compile(r"\bv[0-9]{2}[a-d]?\b|benchmarks/results/|\b20[0-9]{2}-[0-9]{2}\b")
    found = [f"{path.relative_to(REPO)}:{number}: {line.strip()}"
             for package in ("cce_compile", "service", "tuning_db") for path in sorted((REPO / package).rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1) if history.search(line)]
    assert not found, "\n".join(found)


def test_a_budget_of_zero_starts_nothing(cpu_harness: None) -> None:
    """`--budget-s 0` is a budget spent before the first run, as `cce tune --budget-s 0` starts no
    candidate: it once read as no budget at all and ran every shape."""
    assert harness.run_benchmark([TINY], ["lm_like"], [IMPLS["cce_exact"]], Settings(budget_s=0.0)) == []
