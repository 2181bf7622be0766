"""A benchmark run as rows of the results CSV (`results.COLUMNS`), with the machine and commit
they were taken on."""

from __future__ import annotations

import datetime
import os
import subprocess
from pathlib import Path

import torch

from cce_compile.bench import results
from cce_compile.bench.harness import RunResult


def _git_commit() -> str:
    """CCE_BENCH_COMMIT when set (a snapshot sent to a GPU machine has no history of its own)."""
    if os.environ.get("CCE_BENCH_COMMIT"):
        return os.environ["CCE_BENCH_COMMIT"]
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).parent)
    except OSError:
        return "unknown"
    return done.stdout.strip() or "unknown"


def environment() -> dict[str, str]:
    """What the numbers depend on besides the inputs: GPU, torch, triton, commit, date."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = ""
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton_version,
        "commit": _git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def rows(run: RunResult, env: dict[str, str], frozen_head: bool = False) -> list[dict[str, object]]:
    """One row per impl of `run` that measured anything (unavailable and skipped ones are only
    logged). With a frozen head the inputs read `<kind>+frozen_head`: peak_x_grads is then over
    dE's bytes alone and err_dC is empty."""
    inputs = f"{run.kind}+frozen_head" if frozen_head else run.kind
    out = []
    for result in run.impls:
        if result.rel_err_de is None and result.fwd_bwd_ms is None:
            continue
        out.append({
            **env, "shape": run.shape.spec, "inputs": inputs, "impl": result.impl, "compiled": result.compiled,
            "fwd_ms": result.fwd_ms, "fwdbwd_ms": result.fwd_bwd_ms, "gemm_ms": run.gemm_ms,
            "fwd_x_gemm": result.fwd_x_gemm, "fwdbwd_x_gemm": result.fwd_bwd_x_gemm, "peak_mib": result.peak_mib,
            "peak_x_grads": result.memory_x_grads, "err_dE": result.rel_err_de, "err_dC": result.rel_err_dc,
        })
    return out


def save(run: RunResult, env: dict[str, str], out_dir: Path, frozen_head: bool = False) -> list[Path]:
    """Appends `run`'s rows to <out_dir>/bench.csv and re-renders latest.md and latest.png."""
    csv_path = Path(out_dir) / results.CSV_NAME
    results.append_rows(csv_path, rows(run, env, frozen_head))
    return [csv_path, *results.render(csv_path)]
