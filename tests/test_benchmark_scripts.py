"""The benchmark scripts in benchmarks/ run end to end on CPU (the GPU ones in their smoke modes), so a
change to the op or its options cannot break one unnoticed until a device call, where a
failed script costs the session's GPU minutes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_script(*args: str, interpreter: bool = True) -> str:
    """`interpreter` False: without the suite's TRITON_INTERPRET=1, as a user runs the script (the
    interpreted kernels would make a warm call slower than the first one's imports)."""
    env = {name: value for name, value in os.environ.items() if interpreter or name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_train_step_repeats_each_run_and_compares_with_hf(tmp_path: Path) -> None:
    """Each run in two fresh processes; the patched model trains the same losses as HF's (a
    tiny Llama on CPU) and the table sets its first step against HF's."""
    out = tmp_path / "train-step.json"
    run_script("benchmarks/train_step.py", "--small", "--steps", "3", "--repeats", "2",
               "--runs", "hf eager", "patched eager", "--out", str(out), interpreter=False)
    repeats = json.loads(out.read_text())["repeats"]
    assert {name: len(runs) for name, runs in repeats.items()} == {"hf eager": 2, "patched eager": 2}
    assert not [run["error"] for runs in repeats.values() for run in runs if "error" in run]
    for hf, patched in zip(repeats["hf eager"], repeats["patched eager"]):
        assert all(abs(a - b) <= 1e-3 * abs(b) for a, b in zip(patched["losses"], hf["losses"]))
    table = out.with_suffix(".md").read_text().splitlines()
    patched_row = next(line for line in table if line.startswith("| patched eager |")).split("|")
    assert float(patched_row[9]) > 0  # first step x HF's


@pytest.mark.parametrize("model", ["gemma2", "llama_bias"])
def test_train_step_trains_the_other_families(tmp_path: Path, model: str) -> None:
    """`--model gemma2` (a tied, soft-capped head; the step is judged on other models than the
    Llama) and `llama_bias` (a head with a bias): each builds, and the patched model trains HF's
    losses. (At a tiny untrained model's logits the soft-cap is nearly the identity:
    tests/test_transformers.py checks its routing.)"""
    out = tmp_path / "train-step.json"
    run_script("benchmarks/train_step.py", "--model", model, "--small", "--steps", "2",
               "--runs", "hf eager", "patched eager", "--out", str(out), interpreter=False)
    results = json.loads(out.read_text())
    assert results["model"] == model
    (hf,), (patched,) = results["repeats"]["hf eager"], results["repeats"]["patched eager"]
    assert "error" not in hf and "error" not in patched, (hf, patched)
    assert all(abs(a - b) <= 1e-3 * abs(b) for a, b in zip(patched["losses"], hf["losses"]))


def test_first_call_times_both_settings_in_fresh_processes(tmp_path: Path) -> None:
    """A smoke run of the script (on CPU the op runs no kernels, so `ahead` changes nothing
    here): both settings run in fresh processes, and a first call (its imports) takes longer
    than a warm one."""
    out = tmp_path / "first-call.json"
    run_script("benchmarks/first_call.py", "--shapes", "quick-aligned", "--rounds", "1", "--out", str(out),
               interpreter=False)
    runs = json.loads(out.read_text())["runs"]
    assert sorted(run["ahead"] for run in runs) == [False, True]
    assert all(run["first_s"] > run["warm_s"] > 0 for run in runs), runs


def test_kernel_profile_runs_the_loss_compiled(tmp_path: Path) -> None:
    """benchmarks/profile_kernels.py's dry run on CPU with `--compile default`: the pass it
    profiles went through torch.compile (its compiled regions are among the profiled ops), so
    a compiled profile on the GPU measures what the benchmark's compiled rows time; the
    materialized mode (the torch.compile rows exact mode is set against) runs no op of ours."""
    out = tmp_path / "profile.json"
    run_script("benchmarks/profile_kernels.py", "--shape", "64x32x257", "--modes", "filtered,materialized",
               "--compile", "default", "--iters", "1", "--out", str(out))
    report = json.loads(out.read_text())
    assert report["compile"] == "default"
    for mode, ours in (("filtered", True), ("materialized", False)):
        kernels = report["modes"][mode]["kernels"]
        assert any("CompiledFunctionBackward" in name for name in kernels), mode
        assert any(name.startswith("cce::") for name in kernels) == ours, (mode, list(kernels))


def test_filtered_log_probs_probe_prints_its_table() -> None:
    """The CPU probe of filtered log-probs' accuracy (benchmarks/probe_filtered_log_probs.py)
    on a small head: one row per entropy weight, each error finite, above 0 (the filter
    skipped tiles) and small."""
    out = run_script("benchmarks/probe_filtered_log_probs.py", "--shapes", "64x8192", "--entropy-weights", "0", "1",
                     "--filter-eps", "0.015625", "--tile", "32x32", "--forward-block-n", "32")  # tiles small enough to skip
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| 64 x 8192 |")]
    assert [row[2].strip() for row in rows] == ["0", "1"]
    for row in rows:
        assert all(0.0 < float(cell) < 0.1 for cell in row[3:5]), row


def test_temperature_script_measures_against_fp32_and_the_rounding_it_replaced(tmp_path: Path) -> None:
    """benchmarks/temperature.py's CPU run: peaked bf16 rows, the op within 1e-4 nat of fp32 and
    hidden / T rounded to bf16 far outside it."""
    out = tmp_path / "temperature.json"
    run_script("benchmarks/temperature.py", "--small", "--out", str(out), interpreter=False)
    (row,) = [value for name, value in json.loads(out.read_text()).items() if "x" in name]
    accuracy = row["accuracy"]
    assert accuracy["mean entropy"] < 0.5 and accuracy["log-prob max error"] < 1e-4
    assert accuracy["hidden / T rounded: log-prob max error"] > 20 * accuracy["log-prob max error"]
    assert accuracy["dE relative error"] < 5e-3 and accuracy["dC relative error"] < 5e-3


def test_fresh_process_runs_alternate_and_record_failures() -> None:
    """Every other round runs in reverse; each child gets caches of its own, empty; and a child
    that fails, or prints no result, comes back as an error, not as an exception that would
    lose the other runs."""
    from cce_compile.bench.fresh_process import REPO_ROOT, alternating, run_fresh

    assert list(alternating(["a", "b", "c"], 3)) == list("abccbaabc")
    show_env = ("import json, os; print(json.dumps({name: os.environ[name] for name in "
                "('TRITON_CACHE_DIR', 'TORCHINDUCTOR_CACHE_DIR', 'PYTHONPATH')}))")
    first, second = run_fresh("-c", [show_env]), run_fresh("-c", [show_env])
    for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        assert first[name] != second[name] and not Path(first[name]).exists()
    assert str(REPO_ROOT) in first["PYTHONPATH"].split(os.pathsep)
    assert "no such run" in run_fresh("-c", ["raise SystemExit('no such run')"])["error"]
    assert "no JSON result" in run_fresh("-c", ["print('done')"])["error"]


def test_train_step_table_sets_each_patched_run_against_hf_in_its_mode() -> None:
    """The table's ratios from made-up runs: own peaks against HF's in the same mode, with and
    without the gradients; no ratio where a peak reads 0 (the CUDA graphs' pool holds it all)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import train_step
    finally:
        sys.path.remove(str(REPO / "benchmarks"))

    def run(step_ms: float, step_peak: float, fwdbwd_peak: float, first_s: float, losses: list[float]) -> dict:
        return {"step_ms": step_ms, "peak_mib": 9000.0, "step_peak_mib": step_peak, "fwdbwd_peak_mib": fwdbwd_peak,
                "gradients_mib": 1000.0, "first_step_s": first_s, "losses": losses}

    table = train_step.summary({
        "hf compiled": run(40.0, 7000.0, 6000.0, 10.0, [2.0, 1.0]),
        "patched compiled": run(39.0, 2000.0, 2500.0, 12.0, [2.002, 1.0]),
        "hf reduce-overhead": run(41.0, 2000.0, 2000.0, 10.0, [2.0, 1.0]),
        "patched reduce-overhead": run(38.0, 1500.0, 0.0, 11.0, [2.0, 1.0]),
    })
    assert table[1] == "|" + "---|" * 10
    rows = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]] for line in table[2:]}
    assert rows["patched compiled"][3:] == ["0.29 (0.17)", "2500", "0.42 (0.30)", "12.0", "1.20", "1.0e-03"]
    assert rows["patched reduce-overhead"][3:6] == ["0.75 (0.50)", "0", ""]
    assert rows["hf compiled"][3] == ""


def test_h200_checks_runs_its_steps_in_order_and_refuses_unknown_ones(tmp_path: Path) -> None:
    """benchmarks/h200_checks.sh on CPU: a step runs under its limit with its log under $OUT
    (here the GPU tests' selection, which CPU skips), an unknown step is named and fails the
    script without stopping the next, and the bench step refuses to start unlabeled."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("on a GPU the filtered-tests step would run the GPU tests themselves")
    env = {**os.environ, "OUT": str(tmp_path)}
    env.pop("CCE_BENCH_COMMIT", None)
    done = subprocess.run(["bash", "benchmarks/h200_checks.sh", "nope", "filtered-tests"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 2
    assert "unknown step: nope" in done.stderr
    assert "== filtered-tests: exit 0 after" in done.stdout, done.stdout
    assert "skipped" in (tmp_path / "filtered-tests.log").read_text()
    done = subprocess.run(["bash", "benchmarks/h200_checks.sh", "filtered-tests", "bench"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "CCE_BENCH_COMMIT" in done.stderr
    assert "== filtered-tests" not in done.stdout  # refused before any step ran
