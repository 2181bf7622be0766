"""The benchmark scripts in benchmarks/ run end to end on CPU (the GPU ones in their smoke modes), so a
change to the op or its options cannot break one unnoticed until a device call, where a
failed script costs the session's GPU minutes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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


def test_first_call_times_both_settings_in_fresh_processes(tmp_path: Path) -> None:
    """A first call (imports, kernels or not) takes longer than a warm one, with the kernels
    compiled ahead or not."""
    out = tmp_path / "first-call.json"
    run_script("benchmarks/first_call.py", "--shapes", "quick-aligned", "--rounds", "1", "--out", str(out),
               interpreter=False)
    runs = json.loads(out.read_text())["runs"]
    assert sorted(run["ahead"] for run in runs) == [False, True]
    assert all(run["first_s"] > run["warm_s"] > 0 for run in runs), runs


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


def test_fresh_process_runs_alternate_and_record_failures() -> None:
    """Every other round runs in reverse, and a child that fails comes back as an error
    carrying its stderr, not as an exception that would lose the other runs."""
    from cce_compile.bench.fresh_process import alternating, run_fresh

    assert list(alternating(["a", "b", "c"], 3)) == [(0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a"),
                                                     (2, "a"), (2, "b"), (2, "c")]
    assert "cache" in run_fresh("-c", ["import json, os; print(json.dumps({'cache': os.environ['TRITON_CACHE_DIR']}))"])
    failed = run_fresh("-c", ["raise SystemExit('no such run')"])
    assert "no such run" in failed["error"]
