"""The benchmark harness on CPU: LM-like inputs, the float32 reference, the harness's flow
(CUDA timing and memory calls stubbed out), its refusal without a GPU, and the report."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from cce_compile.bench import harness, report
from cce_compile.bench.harness import Settings, Shape
from cce_compile.bench.inputs import _tile_fraction, heavy_tail_inputs, lm_like_inputs, softmax_stats, uniform_inputs
from cce_compile.bench.peers import IMPLS, Impl, ImplUnavailable, Loaded, resolve_impls

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


def test_cli_refuses_politely_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    import typer
    from typer.testing import CliRunner

    from cce_compile.cli.bench import bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    app = typer.Typer()
    app.command()(bench)
    result = CliRunner().invoke(app, ["--quick"])
    assert result.exit_code == 2
    assert "needs a CUDA GPU" in result.output


def test_shapes_and_impls_resolve_by_name() -> None:
    assert harness.parse_shape("llama3-8b") == Shape("llama3-8b", 8192, 4096, 128256)
    assert harness.parse_shape("100x64x1000") == Shape("100x64x1000", 100, 64, 1000)
    with pytest.raises(ValueError, match="NxDxV"):
        harness.parse_shape("llama")
    assert [impl.key for impl in resolve_impls(["torch_eager", "cce_exact"])] == ["cce_exact", "torch_eager"]
    with pytest.raises(ValueError, match="unknown impls"):
        resolve_impls(["nope"])
    with pytest.raises(ValueError, match="unknown input kinds"):
        harness.resolve_kinds(["zeros"])
    assert harness.resolve_kinds(None) == ["lm_like", "uniform"]
    assert harness.resolve_kinds(["heavy_tail"]) == ["heavy_tail"]


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


def test_harness_flow_records_errors_failures_and_budget(cpu_harness: None, tmp_path: Path) -> None:
    impls = [IMPLS["cce_exact"], IMPLS["torch_eager"], Impl("broken", "broken", _broken, on_uniform=True),
             Impl("missing", "missing", _missing, on_uniform=False)]
    seen = []
    runs = harness.run_benchmark([Shape("tiny", 64, 48, 1000)], ["lm_like", "uniform"], impls,
                                 Settings(input_sets=2), on_run=seen.append)
    assert seen == runs and [run.kind for run in runs] == ["lm_like", "uniform"]
    lm_like, uniform = runs
    assert lm_like.gemm_ms == 2.0 and lm_like.grad_mib == (64 * 48 + 1000 * 48) * 2 / 2**20
    by_key = {result.impl: result for result in lm_like.impls}
    for key in ("cce_exact", "torch_eager"):
        ok = by_key[key]
        assert ok.status == "ok", ok.reason
        assert ok.rel_err_loss < 1e-2 and ok.rel_err_de < 3e-2 and ok.rel_err_dc < 3e-2
        assert ok.fwd_bwd_x_gemm == 1.0 and ok.fwd_x_gemm == 1.0 and ok.peak_mib == 3.0
    assert by_key["broken"].status == "failed" and "kernel exploded" in by_key["broken"].reason
    assert by_key["missing"].status == "unavailable" and "not installed" in by_key["missing"].reason
    assert [result.impl for result in uniform.impls] == ["cce_exact", "broken"]  # the on_uniform ones only

    late = harness.run_benchmark([Shape("tiny", 64, 48, 1000)], ["lm_like"], impls, Settings(budget_s=1e-9))
    assert late == []

    doc = report.build_document("flow", Settings(), {"shapes": [Shape("tiny", 64, 48, 1000).label],
                                                    "kinds": ["lm_like", "uniform"], "impls": []}, runs)
    written = report.save(doc, tmp_path)
    assert [path.suffix for path in written] == [".json", ".md", ".png"]
    assert "kernel exploded" in written[1].read_text()


def test_harness_with_a_frozen_head_asks_for_de_alone(cpu_harness: None, tmp_path: Path) -> None:
    """--frozen-head: memory over dE's bytes, no dC error, and the report says so."""
    settings = Settings(input_sets=1, frozen_head=True)
    runs = harness.run_benchmark([Shape("tiny", 64, 48, 1000)], ["lm_like"], [IMPLS["cce_exact"]], settings)
    (run,) = runs
    assert run.grad_mib == 64 * 48 * 2 / 2**20
    (result,) = run.impls
    assert result.status == "ok", result.reason
    assert result.rel_err_de < 3e-2 and result.rel_err_dc is None
    doc = report.build_document("frozen", settings, {"shapes": [], "kinds": ["lm_like"], "impls": []}, runs)
    table = report.save(doc, tmp_path)[1].read_text()
    (row,) = [line for line in table.splitlines() if "cce_compile exact" in line]
    assert "dE alone" in table and row.endswith("|  |")  # an empty dC error cell


def _synthetic_document() -> dict:
    def result(impl: str, status: str = "ok", **numbers: float) -> dict:
        base = dict.fromkeys(("rel_err_loss", "rel_err_de", "rel_err_dc", "peak_mib", "memory_x_grads", "fwd_bwd_ms",
                              "fwd_bwd_x_gemm", "fwd_ms", "fwd_x_gemm"))
        return {"impl": impl, "label": impl, "status": status, "note": "", "reason": None, **base, **numbers}

    stats = {"rows": 256, "mean_loss": 3.0, "median_loss": 2.3, "frac_above_eps": 2e-4,
             "entries_above_eps_per_row": 51.0, "tile_frac_above_eps": 0.7, "tile_frac_above_eps_sorted": 0.1}
    shape = {"name": "gemma2-2b", "n": 8192, "d": 2304, "v": 256000}
    fast = result("cce_exact", fwd_ms=15.0, fwd_x_gemm=1.05, fwd_bwd_ms=58.0, fwd_bwd_x_gemm=4.06, peak_mib=1200.0,
                  memory_x_grads=1.03, rel_err_loss=1e-6, rel_err_de=3e-3, rel_err_dc=2e-3)
    slow = result("torch_eager", fwd_ms=30.0, fwd_x_gemm=2.1, fwd_bwd_ms=67.4, fwd_bwd_x_gemm=4.72, peak_mib=24000.0,
                  memory_x_grads=20.7, rel_err_loss=1e-5, rel_err_de=3.7e-3, rel_err_dc=4.1e-3)
    failed = result("liger", status="failed") | {"reason": "OutOfMemoryError: CUDA out of memory"}
    return {
        "name": "synthetic",
        "environment": {"date": "2026-11-30T00:00:00+00:00", "gpu": "NVIDIA H200", "python": "3.12.0",
                        "torch": "2.11.0", "cuda": "13.0", "triton": "3.6.0", "git_commit": None,
                        "packages": {"cce-compile": "0.1.0", "cut-cross-entropy": None, "liger-kernel": "0.8.5"}},
        "settings": {"warmup_ms": 25.0, "rep_ms": 100.0, "min_reps": 5, "input_sets": 2},
        "targets": {"fwd_bwd_x_gemm": report.TARGET_FWD_BWD_X_GEMM, "memory_x_grads": report.TARGET_MEMORY_X_GRADS},
        "plan": {"shapes": ["8192 x 2304 x 256000 (gemma2-2b)"], "kinds": ["lm_like", "uniform"], "impls": []},
        "runs": [{"shape": shape, "kind": "lm_like", "input_sets": 2, "gemm_ms": 14.3, "grad_mib": 1161.0,
                  "reference_loss": 3.0, "input_stats": stats, "impls": [fast, slow, failed]}],
    }


def test_render_writes_markdown_and_png_from_json(tmp_path: Path) -> None:
    json_path = tmp_path / "synthetic.json"
    json_path.write_text(json.dumps(_synthetic_document()))
    written = report.render(json_path)
    assert written == [tmp_path / "synthetic.md", tmp_path / "synthetic.png"]
    table = written[0].read_text()
    assert "| 8192 x 2304 x 256000 (gemma2-2b) | lm_like | 14.30 | cce_exact | 15.00 | 1.05 | 58.00 | **4.06** |" in table
    assert "| **1.03** |" in table and "| 20.70 |" in table  # bold only within the targets
    assert "liger: **failed**: OutOfMemoryError" in table
    assert "uniform: not run (time budget)" in table
    assert written[1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
