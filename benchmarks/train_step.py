"""One training step of a small Hugging Face causal LM, HF's loss against patch(), eager,
torch.compile and torch.compile(mode="reduce-overhead"): median step, peak memory (all of it,
and a step's own: its peak above what stays allocated between steps, the weights and AdamW
state), first-step (compiling) time and loss agreement.

    PYTHONPATH=$PWD python benchmarks/train_step.py --out benchmarks/results/train-step-h200.json

The model (`--model`): `llama`, 2 decoder layers, hidden 2048, vocab 128256, untied head, batch
4 x 2048 tokens; `qwen2`, Qwen2.5 0.5B's head (hidden 896, vocab 151936, tied to the embedding),
2 layers, 4 x 4096 tokens; `llama_bias`, the llama model with a bias on its head (as Phi-2's and
GPT-J's heads have); `gemma2`, Gemma-2 2B's (hidden 2304, vocab 256000, tied, the logits
soft-capped at 30), 2 layers, 4 x 2048 tokens. bf16 weights, AdamW. Each run is its own
process with empty Inductor and Triton caches, so its first step pays the compile a user's
first run pays, and no run reuses another's kernels.
A first step varies by seconds from process to process (HF's compiled and reduce-overhead runs,
one each, read 13.7 and 10.9 s): `--repeats K` runs each K times, the runs' order reversed on
every other repeat, and the table gives the medians and the first step against HF's in the same
mode. The step's own peak is given against HF's in the same mode too, and in parentheses with
the parameters' gradients (which no loss can save) taken from both; under reduce-overhead the
CUDA graphs' pool keeps the activations allocated between steps, so the own peak there is
little more than the gradients. AdamW's temporaries (the same whatever the loss) set the patched
step's peak, so the table also gives the peak through forward and backward alone, where the
loss's memory would show. Without CUDA it runs a small model on CPU (a smoke run: `--small`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cce_compile.bench.fresh_process import alternating, run_fresh  # noqa: E402

RUNS = {
    "hf eager": (None, None),
    "patched eager": ({}, None),
    "hf compiled": (None, "default"),
    "patched compiled": ({}, "default"),
    "patched compiled low-memory": ({"memory": "low"}, "default"),
    "hf reduce-overhead": (None, "reduce-overhead"),
    "patched reduce-overhead": ({}, "reduce-overhead"),
}
"""Run name -> (patch()'s loss options, None for the unpatched model; torch.compile mode or None for eager)."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="JSON results (a .md table beside it)")
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--steps", type=int, default=12, help="steps per run; the median skips the first two")
    parser.add_argument("--repeats", type=int, default=1, help="processes per run, the order reversed every other time")
    parser.add_argument("--model", choices=list(MODELS), default="llama", help="the model family and its head's shape")
    parser.add_argument("--small", action="store_true", help="a tiny model (CPU smoke run)")
    parser.add_argument("--child", choices=list(RUNS), help=argparse.SUPPRESS)
    return parser.parse_args()


MODELS = {
    "llama": {"layers": 2, "hidden": 2048, "vocab": 128256, "batch": 4, "seq": 2048},
    "llama_bias": {"layers": 2, "hidden": 2048, "vocab": 128256, "batch": 4, "seq": 2048},
    "qwen2": {"layers": 2, "hidden": 896, "vocab": 151936, "batch": 4, "seq": 4096},
    "gemma2": {"layers": 2, "hidden": 2304, "vocab": 256000, "batch": 4, "seq": 2048},
}
"""Model family -> its shape: decoder layers, hidden size, vocabulary, batch x sequence."""


def model_shape(model: str, small: bool) -> dict[str, int]:
    if small:
        return {"layers": 1, "hidden": 128, "vocab": 4096, "batch": 2, "seq": 64}
    return MODELS[model]


def build_model(model: str, shape: dict[str, int]):
    """An untrained `model`-family causal LM of `shape`, as its HF class builds it."""
    import torch
    import transformers

    common = dict(
        hidden_size=shape["hidden"], num_hidden_layers=shape["layers"], num_attention_heads=max(1, shape["hidden"] // 64),
        num_key_value_heads=max(1, shape["hidden"] // 64), head_dim=64, intermediate_size=shape["hidden"] * 11 // 4,
        vocab_size=shape["vocab"], max_position_embeddings=shape["seq"], use_cache=False,
        attn_implementation="eager" if model == "gemma2" else "sdpa",  # HF's Gemma-2 takes no SDPA
    )
    if model in ("llama", "llama_bias"):
        llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, tie_word_embeddings=False))
        if model == "llama_bias":
            llama.lm_head = torch.nn.Linear(shape["hidden"], shape["vocab"], bias=True)
        return llama
    if model == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=True))
    return transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(**common, tie_word_embeddings=True, final_logit_softcapping=30.0, attn_logit_softcapping=None,
                                   sliding_window=shape["seq"])
    )


def run_child(name: str, model_name: str, steps: int, small: bool) -> dict:
    """One run, in this process: build, compile (if asked), train `steps` steps."""
    import torch

    from cce_compile.integrations.transformers import patch

    patch_options, mode = RUNS[name]
    shape = model_shape(model_name, small)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = build_model(model_name, shape).train().to(device, torch.bfloat16)
    if patch_options is not None:
        patch(model, **patch_options)
    forward = model if mode is None else torch.compile(model, mode=mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), generator=generator).to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, seconds, step_peaks, loss_peaks, peak_total = [], [], [], [], 0
    for _ in range(steps):
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            resident = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        loss = forward(input_ids, labels=input_ids).loss
        loss.backward()
        if device.type == "cuda":
            loss_peaks.append(torch.cuda.max_memory_allocated(device) - resident)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # synchronizes
        seconds.append(time.perf_counter() - start)
        if device.type == "cuda":
            step_peak = torch.cuda.max_memory_allocated(device)
            step_peaks.append(step_peak - resident)
            peak_total = max(peak_total, step_peak)
    return {
        "losses": losses,
        "step_ms": 1e3 * statistics.median(seconds[2:] or seconds),
        "first_step_s": seconds[0],
        "peak_mib": peak_total / 2**20 if device.type == "cuda" else None,
        # what a step adds to what stays allocated between steps (weights, AdamW state): activations, the loss
        "step_peak_mib": max(step_peaks[2:] or step_peaks) / 2**20 if device.type == "cuda" else None,
        # the same through forward and backward only: where the loss's memory would show (AdamW's
        # temporaries, the same for every loss, set the patched step's peak)
        "fwdbwd_peak_mib": max(loss_peaks[2:] or loss_peaks) / 2**20 if device.type == "cuda" else None,
        # the part of both no loss can save: the parameters' gradients (set to None between steps)
        "gradients_mib": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }


def spawn(name: str, args: argparse.Namespace) -> dict:
    """`name` in a fresh process with empty compile caches; a failure is recorded, not raised."""
    return run_fresh(__file__, ["--child", name, "--model", args.model, "--steps", str(args.steps)] + ["--small"] * args.small)


def median_run(repeats: list[dict]) -> dict:
    """One run's repeats as one: the medians of its step time, peaks and first step, the
    first repeat's losses (every repeat trains the same steps), the first failure if all failed."""
    done = [run for run in repeats if "error" not in run]
    if not done:
        return repeats[0]
    merged = dict(done[0])
    for key in ("step_ms", "first_step_s", "peak_mib", "step_peak_mib", "fwdbwd_peak_mib"):
        if done[0].get(key) is not None:
            merged[key] = statistics.median(run[key] for run in done)
    merged["first_steps_s"] = [run["first_step_s"] for run in done]
    return merged


def peak_ratio(run: dict, twin: dict, key: str) -> str:
    """run's own peak `key` over HF's in the same mode, and in parentheses the same with the
    parameters' gradients taken from both."""
    if (run.get(key) or 0) < 1 or (twin.get(key) or 0) < 1:  # 0 MiB under reduce-overhead: the graphs' pool holds it
        return ""
    own, hf_own, grads = run[key], twin[key], run["gradients_mib"]
    if own <= grads or hf_own <= grads:  # under reduce-overhead the graphs' pool already holds them
        return f"{own / hf_own:.2f}"
    return f"{own / hf_own:.2f} ({(own - grads) / (hf_own - grads):.2f})"


def summary(results: dict[str, dict]) -> list[str]:
    """A markdown table: each run, and patched against HF's in the same mode: loss, the step's
    own peak and its forward+backward's (each also with the gradients taken from both), first step."""
    lines = ["| run | median step ms | peak MiB | step's own peak MiB | own peak x HF's (less the gradients) "
             "| fwd+bwd own peak MiB | fwd+bwd own peak x HF's (less the gradients) "
             "| first step s | first step x HF's | loss vs HF's (max rel. diff) |", "|" + "---|" * 10]
    for name, run in results.items():
        if "error" in run:
            lines.append(f"| {name} | failed: {run['error'].splitlines()[-1][:120]} |" + " |" * 8)
            continue
        mode = RUNS[name][1]
        twin = next((results[hf] for hf, (options, hf_mode) in RUNS.items()
                     if options is None and hf_mode == mode and hf in results), {})
        agreement = first_ratio = step_ratio = loss_ratio = ""
        if RUNS[name][0] is not None and "losses" in twin:
            agreement = f"{max(abs(a - b) / abs(b) for a, b in zip(run['losses'], twin['losses'])):.1e}"
            first_ratio = f"{run['first_step_s'] / twin['first_step_s']:.2f}"
            step_ratio, loss_ratio = (peak_ratio(run, twin, key) for key in ("step_peak_mib", "fwdbwd_peak_mib"))
        peak, own, fwdbwd = (f"{run[key]:.0f}" if run.get(key) is not None else "-"
                             for key in ("peak_mib", "step_peak_mib", "fwdbwd_peak_mib"))
        firsts = "/".join(f"{value:.1f}" for value in run.get("first_steps_s", [run["first_step_s"]]))
        lines.append(f"| {name} | {run['step_ms']:.1f} | {peak} | {own} | {step_ratio} | {fwdbwd} | {loss_ratio} "
                     f"| {firsts} | {first_ratio} | {agreement} |")
    return lines


def main() -> None:
    args = parse_args()
    if args.child:
        print(json.dumps(run_child(args.child, args.model, args.steps, args.small)))
        return
    repeats: dict[str, list[dict]] = {name: [] for name in args.runs}
    for name in alternating(args.runs, args.repeats):
        repeats[name].append(spawn(name, args))
        print(summary({name: repeats[name][-1]})[-1], flush=True)
    results = {name: median_run(runs) for name, runs in repeats.items()}
    table = summary(results)
    print("\n".join(table))
    if args.out:
        shape = model_shape(args.model, args.small)
        args.out.write_text(json.dumps({"model": args.model, "shape": shape, "steps": args.steps, "repeats": repeats}, indent=1) + "\n")
        args.out.with_suffix(".md").write_text("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
