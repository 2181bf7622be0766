"""Benchmark results as JSON (all numbers and the environment), a markdown table and a plot.

The JSON is the record; the markdown and the PNG are rendered from it alone, so results
taken on a GPU machine (which may lack matplotlib) can be re-rendered anywhere with
`render(json_path)`.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import math
import os
import platform
import subprocess
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from cce_compile.bench.harness import RunResult, Settings, Shape
from cce_compile.bench.peers import distribution_versions

TARGET_FWD_BWD_X_GEMM = 4.3
TARGET_MEMORY_X_GRADS = 1.10
Document = dict[str, Any]
_RATIO_FLOOR = 0.5  # log-scale bars start here, so a 1.03x memory bar still shows
_ERROR_RANGE = (1e-5, 1.0)  # one error scale for every panel


def _git_commit() -> str | None:
    """CCE_BENCH_COMMIT when set (a snapshot sent to a GPU machine has no history of its own)."""
    if os.environ.get("CCE_BENCH_COMMIT"):
        return os.environ["CCE_BENCH_COMMIT"]
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).parent)
    except OSError:
        return None
    return done.stdout.strip() or None


def environment() -> dict[str, Any]:
    """What the numbers depend on besides the code: GPU, software versions, date."""
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "packages": distribution_versions(),
        "git_commit": _git_commit(),
    }


def build_document(name: str, settings: Settings, plan: dict[str, list[str]], runs: list[RunResult]) -> Document:
    """The JSON record: `plan` names the shapes, kinds and impls asked for, so a reader
    sees what a time budget left out."""
    return {
        "name": name,
        "environment": environment(),
        "settings": asdict(settings),
        "targets": {"fwd_bwd_x_gemm": TARGET_FWD_BWD_X_GEMM, "memory_x_grads": TARGET_MEMORY_X_GRADS},
        "plan": plan,
        "runs": [asdict(run) for run in runs],
    }


def _grads_meant(settings: dict[str, Any]) -> str:
    """What "x grads" divides by: both gradients, or dE alone with a frozen head."""
    if settings.get("frozen_head"):
        return "the bf16 dE alone (c frozen, as in a LoRA run: no dC is asked for)"
    return "the bf16 dE + dC"


def _shape_label(shape: dict[str, Any]) -> str:
    return Shape(**shape).label


def _num(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def _ratio(value: float | None, target: float) -> str:
    """Ratios that meet the project's target are bold."""
    text = _num(value, ".2f")
    return f"**{text}**" if value is not None and value <= target else text


def markdown(doc: Document) -> str:
    env, settings, targets = doc["environment"], doc["settings"], doc["targets"]
    packages = ", ".join(f"{name} {version}" for name, version in env["packages"].items() if version)
    lines = [
        f"# cce bench: {doc['name']}",
        "",
        f"{env['gpu']}, torch {env['torch']} (CUDA {env['cuda']}), triton {env['triton']}, {packages}; "
        f"commit {env['git_commit'] or 'unknown'}, {env['date']}.",
        "",
        f"bf16 inputs, one process; medians of `triton.testing.do_bench` (warmup {settings['warmup_ms']:g} ms, "
        f"rep {settings['rep_ms']:g} ms, at least {settings['min_reps']} reps, L2 cleared), cycling over "
        f"{settings['input_sets']} input sets. \"x GEMM\": time over one bf16 `e @ c.T` of the same shape timed "
        "in the same run. \"MiB\": peak allocated above the inputs during forward+backward; \"x grads\": that "
        f"over {_grads_meant(settings)} themselves. Relative errors ||x - ref|| / ||ref|| against a float32 reference "
        f"(TF32 off). Bold: within the targets (fwd+bwd <= {targets['fwd_bwd_x_gemm']:.2f}x GEMM, memory <= "
        f"{targets['memory_x_grads']:.2f}x grads).",
        "",
        "| shape N x D x V | inputs | GEMM ms | impl | fwd ms | x GEMM | fwd+bwd ms | x GEMM | MiB | x grads "
        "| rel.err loss | rel.err dE | rel.err dC |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    remarks = []
    for run in doc["runs"]:
        lead = [_shape_label(run["shape"]), run["kind"], _num(run["gemm_ms"], ".2f")]
        for result in run["impls"]:
            where = f"{_shape_label(run['shape'])} {run['kind']}, {result['label']}"
            if result["note"]:
                remarks.append(f"- {where}: {result['note']}")
            if result["status"] != "ok":
                remarks.append(f"- {where}: **{result['status']}**: {result['reason']}")
            cells = [
                result["label"] if result["status"] == "ok" else f"{result['label']} ({result['status']})", _num(result["fwd_ms"], ".2f"), _num(result["fwd_x_gemm"], ".2f"),
                _num(result["fwd_bwd_ms"], ".2f"), _ratio(result["fwd_bwd_x_gemm"], targets["fwd_bwd_x_gemm"]),
                _num(result["peak_mib"], ".0f"), _ratio(result["memory_x_grads"], targets["memory_x_grads"]),
                _num(result["rel_err_loss"], ".1e"), _num(result["rel_err_de"], ".1e"), _num(result["rel_err_dc"], ".1e"),
            ]
            lines.append("| " + " | ".join(lead + cells) + " |")
            lead = ["", "", ""]
    lines += [
        "",
        "Inputs, on the first rows of the first input set (mean loss in nats; entries and 128 x 128 tiles "
        "with a softmax value above 2^-12, tiles also after sorting the vocabulary by mean logit):",
        "",
        "| shape N x D x V | inputs | rows | mean loss | median loss | % entries > 2^-12 | per row | % tiles | "
        "% tiles, sorted |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in doc["runs"]:
        stats = run["input_stats"]
        lines.append(
            f"| {_shape_label(run['shape'])} | {run['kind']} | {stats['rows']} | {stats['mean_loss']:.2f} | "
            f"{stats['median_loss']:.2f} | {100 * stats['frac_above_eps']:.3f} | "
            f"{stats['entries_above_eps_per_row']:.0f} | {100 * stats['tile_frac_above_eps']:.1f} | "
            f"{100 * stats['tile_frac_above_eps_sorted']:.1f} |"
        )
    done = {(_shape_label(run["shape"]), run["kind"]) for run in doc["runs"]}
    planned = [(shape, kind) for kind in doc["plan"]["kinds"] for shape in doc["plan"]["shapes"]]
    remarks += [f"- {shape} {kind}: not run (time budget)" for shape, kind in planned if (shape, kind) not in done]
    if remarks:
        lines += ["", "Notes:", "", *remarks]
    return "\n".join(lines) + "\n"


def plot(doc: Document, png_path: Path) -> None:
    """Per (shape, inputs): bars of fwd+bwd x GEMM and memory x grads for each impl (log
    scale, targets as dashed lines) and, on the right axis, the larger of the dE and dC
    relative errors as a marker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, targets = doc["runs"], doc["targets"]
    cols = min(4, max(1, len(runs)))
    rows = max(1, math.ceil(len(runs) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.6 * rows + 0.8), squeeze=False)
    for ax in axes.flat[len(runs):]:
        ax.set_visible(False)
    width = 0.38
    for ax, run in zip(axes.flat, runs):
        results = run["impls"]
        xs = range(len(results))
        time_ratios = [r["fwd_bwd_x_gemm"] or 0 for r in results]
        memory_ratios = [r["memory_x_grads"] or 0 for r in results]
        ax.bar([x - width / 2 for x in xs], time_ratios, width, color="C0", label="fwd+bwd / GEMM")
        ax.bar([x + width / 2 for x in xs], memory_ratios, width, color="C1", label="peak memory / grads")
        ax.axhline(targets["fwd_bwd_x_gemm"], color="C0", linestyle="--", linewidth=1)
        ax.axhline(targets["memory_x_grads"], color="C1", linestyle="--", linewidth=1)
        ax.set_yscale("log")
        ax.set_ylim(_RATIO_FLOOR, 1.6 * max([targets["fwd_bwd_x_gemm"], *time_ratios, *memory_ratios]))
        ax.set_xlim(-0.6, max(len(results), 3) - 0.4)
        ax.set_ylabel("ratio (log)")
        for x, result in zip(xs, results):
            if result["status"] != "ok":
                ax.text(x, 1.0, result["status"], rotation=90, ha="center", va="bottom", fontsize=8, color="gray")
        errors = ax.twinx()
        errors.set_yscale("log")
        errors.set_ylim(*_ERROR_RANGE)
        errors.set_ylabel("max rel.err of dE, dC (log)", color="C3")
        grad_errors = [[err for err in (r["rel_err_de"], r["rel_err_dc"]) if err is not None] for r in results]
        measured = [(x, max(errs)) for x, errs in zip(xs, grad_errors) if errs]
        if measured:
            errors.plot(*zip(*measured), linestyle="none", marker="D", color="C3")
        ax.set_xticks(list(xs), [r["label"] for r in results], rotation=40, ha="right", fontsize=8)
        ax.set_title(f"{_shape_label(run['shape'])}\n{run['kind']}, GEMM {run['gemm_ms']:.2f} ms", fontsize=9)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles + [plt.Line2D([], [], linestyle="none", marker="D", color="C3")],
               labels + ["max rel.err of dE, dC (right axis)"], loc="upper center", ncol=3, frameon=False,
               bbox_to_anchor=(0.5, 1 - 0.45 / fig.get_figheight()))
    frozen = "; c frozen: dE alone" if doc["settings"].get("frozen_head") else ""
    fig.suptitle(f"cce bench: {doc['name']} ({doc['environment']['gpu']}{frozen}); dashed lines: targets "
                 f"{targets['fwd_bwd_x_gemm']:.2f}x GEMM, {targets['memory_x_grads']:.2f}x grads", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.8 / fig.get_figheight()))
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def write_rendered(doc: Document, json_path: Path) -> list[Path]:
    """The markdown, and the PNG where matplotlib is installed, beside `json_path`."""
    md_path = json_path.with_suffix(".md")
    md_path.write_text(markdown(doc))
    written = [md_path]
    if doc["runs"] and importlib.util.find_spec("matplotlib") is not None:
        png_path = json_path.with_suffix(".png")
        plot(doc, png_path)
        written.append(png_path)
    return written


def save(doc: Document, out_dir: Path) -> list[Path]:
    """<out_dir>/<name>.json plus its renderings; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{doc['name']}.json"
    json_path.write_text(json.dumps(doc, indent=1) + "\n")
    return [json_path, *write_rendered(doc, json_path)]


def render(json_path: Path | str) -> list[Path]:
    """Re-renders markdown and PNG from a saved JSON (e.g. on CPU, after a GPU run)."""
    json_path = Path(json_path)
    return write_rendered(json.loads(json_path.read_text()), json_path)
