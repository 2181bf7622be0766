"""The op in a training loop on one CUDA GPU: a patched Llama built from a config (hidden 512,
4 layers, vocab 32000, batch 8 x 512 tokens), AdamW on one repeated batch so the loss falls.

    PYTHONPATH=$PWD python benchmarks/gpu_integration.py --out integration.json

Checks (a table on stdout; JSON to --out, rewritten after each check):
  compile       torch.compile'd training (bf16 weights, 5 steps) tracks eager HF's loss, and falls;
  kernels       Inductor's generated code (that same compile) calls the op as one extern kernel
                (torch.ops.cce.linear_cross_entropy_fused: its Triton kernels run inside it, unseen by Inductor);
  cudagraphs    mode="reduce-overhead" tracks eager, with no CUDA graph skipped;
  autocast      fp32 weights under torch.autocast(bf16), compiled, tracks eager HF under autocast;
  graphs        eager training replays the op's loop as a CUDA graph (ops/graphs.py: the fused forward's chunk
                loop on the default path, the backward's slab loop with memory="low") from about its
                third step, with the losses of eager training without graphs (within GRAPHS_RTOL: the
                model's attention makes eager steps not bit-reproducible run to run, graphs or not);
  dynamic       sequence lengths --seqs marked dynamic (N = batch x seq in one power-of-two bucket):
                the op adds no recompile among them and at most one at --next-bucket-seq (the next
                bucket), counted against the unpatched twin (HF's attention may guard on lengths);
  timing        step time (median of steps 2..) and peak memory of each run, HF's loss vs patched.
Losses "track" when each step is within LOSS_RTOL of the reference run's. `--checks` runs a
subset, each check making the runs it needs (a run's first step includes its compile). Without
CUDA the script runs on CPU (a dry run: the op on its PyTorch path, no CUDA graphs, no
memory figures).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch._dynamo.testing
from torch import Tensor, nn
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cce_compile.config.keys import n_bucket  # noqa: E402
from cce_compile.ops import graphs  # noqa: E402
from cce_compile.plan.policy import active_policy, override_policy  # noqa: E402
from cce_compile.integrations.transformers import patch  # noqa: E402
from tests.test_distributed import recording_op_inputs  # noqa: E402

CHECK_NAMES = ("compile", "kernels", "cudagraphs", "graphs", "autocast", "dynamic", "timing")
OP_CALLS = ("torch.ops.cce.linear_cross_entropy_fused",)
"""The patched loss (a mean on the default memory="workspace" path) as Inductor calls it: the op is
opaque to torch.compile (ops/library.py), so its kernels' names never appear in the generated code."""
GRAPHS_RTOL = 1e-3
"""Graphs against none, both eager: on the H200 two runs without graphs differed by up to 5e-5 in a
step's loss (one of two trajectories, either with graphs or without), from the model's attention
backward on its first calls, not the op (benchmarks/results/determinism-h200-v26.log); gradients
a step stale would move the next loss by ~1e-2."""
LOSS_RTOL = 1e-2
"""bf16 weights: a step's loss may differ by bf16 rounding of logits and activations (HF rounds
its logits to bf16, the op does not), not by more."""


def build(args: argparse.Namespace, *, patched: bool, dtype: torch.dtype) -> nn.Module:
    """The same random init every call (seeded, on CPU), moved to the device in `dtype`."""
    config = LlamaConfig(
        hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64, head_dim=64, intermediate_size=args.hidden * 11 // 4,
        vocab_size=args.vocab, max_position_embeddings=2048, use_cache=False, tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).train().to(args.device, dtype)
    return patch(model) if patched else model


def make_batch(args: argparse.Namespace, seq: int) -> tuple[Tensor, Tensor]:
    """Random tokens, labels = input_ids (the model shifts them)."""
    generator = torch.Generator().manual_seed(seq)
    input_ids = torch.randint(0, args.vocab, (args.batch, seq), generator=generator).to(args.device)
    return input_ids, input_ids.clone()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(args: argparse.Namespace, *, patched: bool, mode: str | None, autocast: bool = False,
          cuda_graphs: bool = True) -> dict:
    """`args.steps` AdamW steps on one batch: eager (mode None) or torch.compile(mode=mode).
    bf16 weights, or fp32 weights under autocast(bf16). `cuda_graphs`: the op's own graphs of
    its loops (the fused forward's chunks, the backward's slabs), whose replays the result counts."""
    torch._dynamo.reset()
    with override_policy(replace(active_policy(), cuda_graphs=cuda_graphs)):
        return _train_steps(args, patched=patched, mode=mode, autocast=autocast)


def _train_steps(args: argparse.Namespace, *, patched: bool, mode: str | None, autocast: bool) -> dict:
    replays = _graph_replays()
    model = build(args, patched=patched, dtype=torch.float32 if autocast else torch.bfloat16)
    forward = model if mode is None else torch.compile(model, mode=mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    input_ids, labels = make_batch(args, args.seq)
    gc.collect()  # the previous run's model, so that it does not count in this run's peak
    if args.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(args.device)
    losses, seconds = [], []
    for _ in range(args.steps):
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        sync(args.device)
        start = time.perf_counter()
        with torch.autocast(args.device.type, torch.bfloat16, enabled=autocast):
            loss = forward(input_ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        seconds.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(args.device) / 2**20 if args.device.type == "cuda" else None
    return {"losses": losses, "step_ms": 1e3 * statistics.median(seconds[1:]), "first_step_s": seconds[0],
            "peak_mib": peak, "graph_replays": _graph_replays() - replays}


def _graph_replays() -> int:
    """Replays of the op's CUDA graphs so far: the patched loss's default path (a mean, memory="workspace")
    replays the fused forward's chunk loop, memory="low" the backward's slab loop."""
    return graphs.CHUNK_LOOPS.replays + graphs.SLAB_LOOPS.replays


RUNS = {
    "hf eager": dict(patched=False, mode=None),
    "patched eager": dict(patched=True, mode=None),
    "patched eager, no graphs": dict(patched=True, mode=None, cuda_graphs=False),
    "patched compiled": dict(patched=True, mode="default"),
    "hf compiled": dict(patched=False, mode="default"),
    "patched reduce-overhead": dict(patched=True, mode="reduce-overhead"),
    "hf autocast eager": dict(patched=False, mode=None, autocast=True),
    "patched autocast compiled": dict(patched=True, mode="default", autocast=True),
}
"""The training runs by name, as train()'s keyword arguments."""


class Runs(dict):
    """The runs made so far, by name; `get_run` makes one on first use, so a check can run alone."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args

    def get_run(self, name: str) -> dict:
        if name not in self:
            self[name] = train(self.args, **RUNS[name])
        return self[name]


def tracks(run: dict, reference: dict) -> float:
    """The worst relative difference of a step's loss from the reference run's."""
    return max(abs(a - b) / abs(b) for a, b in zip(run["losses"], reference["losses"]))


def check_compile(runs: Runs) -> tuple[dict, dict]:
    """compile and kernels: one compiled run, its generated code captured (caches off, so
    Inductor writes the code here and now)."""
    with torch._inductor.config.patch(force_disable_caches=True):
        runs["patched compiled"], code = run_and_get_code(train, runs.args, **RUNS["patched compiled"])
    reference, compiled = runs.get_run("hf eager"), runs["patched compiled"]
    worst = max(tracks(compiled, reference), tracks(runs.get_run("patched eager"), reference))
    runs.get_run("hf compiled")  # for the timing table
    falls = compiled["losses"][-1] < compiled["losses"][0]
    found = {name: any(name in chunk for chunk in code) for name in OP_CALLS}
    return (
        {"status": worst <= LOSS_RTOL and falls, "worst_rel_diff_vs_hf_eager": worst, "loss_falls": falls},
        {"status": all(found.values()), "found": found, "code_chunks": len(code)},
    )


def check_cudagraphs(runs: Runs) -> dict:
    eager = runs.get_run("patched eager")
    counters.clear()
    worst = tracks(runs.get_run("patched reduce-overhead"), eager)
    skips = counters["inductor"]["cudagraph_skips"]
    on_cuda = runs.args.device.type == "cuda"
    return {"status": worst <= LOSS_RTOL and (skips == 0 or not on_cuda), "worst_rel_diff_vs_patched_eager": worst,
            "cudagraph_skips": skips, "cuda_graphs_possible": on_cuda}


def check_graphs(runs: Runs) -> dict:
    with_graphs, without = runs.get_run("patched eager"), runs.get_run("patched eager, no graphs")
    replayed = with_graphs["graph_replays"] > 0 or runs.args.device.type != "cuda"
    worst = tracks(with_graphs, without)
    return {"status": worst <= GRAPHS_RTOL and replayed, "graph_replays": with_graphs["graph_replays"],
            "worst_rel_diff_vs_no_graphs": worst, "losses_equal": with_graphs["losses"] == without["losses"]}


def check_autocast(runs: Runs) -> dict:
    """Also which dtype the op computes in: under autocast the API casts the hidden states
    and the fp32 head to autocast's dtype, so the op receives bf16."""
    worst = tracks(runs.get_run("patched autocast compiled"), runs.get_run("hf autocast eager"))
    args = runs.args
    model = build(args, patched=True, dtype=torch.float32)
    input_ids, labels = make_batch(args, args.seq)
    with recording_op_inputs() as seen, torch.autocast(args.device.type, torch.bfloat16):
        model(input_ids, labels=labels)
    return {"status": worst <= LOSS_RTOL, "worst_rel_diff_vs_hf_autocast_eager": worst,
            "op_dtypes": [str(e.dtype) for e, _ in seen]}


def compiled_frames(args: argparse.Namespace, patched: bool) -> dict[int, int]:
    """Frames compiled so far after a training step at each length (lengths marked dynamic)."""
    torch._dynamo.reset()
    model = build(args, patched=patched, dtype=torch.bfloat16)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter)
    frames = {}
    for seq in [*args.seqs, args.next_bucket_seq]:
        input_ids, labels = make_batch(args, seq)
        torch._dynamo.mark_dynamic(input_ids, 1)
        torch._dynamo.mark_dynamic(labels, 1)
        compiled(input_ids, labels=labels).loss.backward()
        frames[seq] = counter.frame_count
    return frames


def check_dynamic(args: argparse.Namespace) -> dict:
    """The op adds no recompile within an N bucket and at most one past it: the patched
    model's frames against the unpatched twin's (whose attention may guard on lengths of
    its own; run with TORCH_LOGS=recompiles to see every guard that failed)."""
    frames = {"patched": compiled_frames(args, patched=True), "hf": compiled_frames(args, patched=False)}
    first, last, past = args.seqs[0], args.seqs[-1], args.next_bucket_seq
    within = {name: f[last] - f[first] for name, f in frames.items()}
    beyond = {name: f[past] - f[last] for name, f in frames.items()}
    status = within["patched"] <= within["hf"] and beyond["patched"] <= beyond["hf"] + 1
    return {"status": status, "frames_after_seq": frames, "recompiles_within_bucket": within,
            "recompiles_past_bucket": beyond, "n_buckets": {seq: n_bucket(args.batch * seq) for seq in frames["patched"]}}


def check_timing(runs: dict) -> dict:
    """Not a pass/fail check: the runs' figures, for the table."""
    return {"status": None, **{name: {k: v for k, v in run.items() if k != "losses"} for name, run in runs.items()}}


def guarded(check: Callable[[], dict | tuple[dict, ...]], names: tuple[str, ...]) -> dict[str, dict]:
    """A check's results by name; an exception fails it with its traceback, the others still run."""
    try:
        results = check()
    except Exception:  # noqa: BLE001 (reported in the table and the JSON)
        error = traceback.format_exc()
        print(error, file=sys.stderr, flush=True)
        return {name: {"status": False, "error": error.strip().splitlines()[-1], "traceback": error} for name in names}
    return dict(zip(names, results if isinstance(results, tuple) else (results,)))


def status_word(status: bool | None) -> str:
    return {True: "PASS", False: "FAIL", None: "info"}[status]


def print_table(results: dict[str, dict], runs: dict[str, dict]) -> None:
    print(f"\n{'check':<12} {'status':<6} detail")
    for name, result in results.items():
        if name == "timing":
            continue
        detail = {k: v for k, v in result.items() if k not in ("status", "traceback")}
        print(f"{name:<12} {status_word(result['status']):<6} {json.dumps(detail, default=str)}")
    print(f"\n{'run':<28} {'step ms':>9} {'1st step s':>10} {'peak MiB':>9}  losses")
    for name, run in runs.items():
        peak = f"{run['peak_mib']:9.0f}" if run["peak_mib"] is not None else f"{'-':>9}"
        losses = " ".join(f"{loss:.4f}" for loss in run["losses"])
        print(f"{name:<28} {run['step_ms']:9.1f} {run['first_step_s']:10.1f} {peak}  {losses}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--hidden", type=int, default=512, help="a multiple of 64 (head_dim 64)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seqs", type=lambda s: [int(x) for x in s.split(",")], default=[300, 400, 500])
    parser.add_argument("--next-bucket-seq", type=int, default=600)
    parser.add_argument("--checks", type=lambda s: set(s.split(",")), default=set(CHECK_NAMES),
                        help=f"a comma-separated subset of {','.join(CHECK_NAMES)} (timing: of the runs made)")
    args = parser.parse_args()
    if args.checks - set(CHECK_NAMES):
        parser.error(f"unknown checks {sorted(args.checks - set(CHECK_NAMES))}")
    buckets = {n_bucket(args.batch * seq) for seq in args.seqs}
    if len(buckets) != 1 or n_bucket(args.batch * args.next_bucket_seq) <= max(buckets):
        parser.error("--seqs must share one power-of-two bucket of batch x seq, --next-bucket-seq be in a higher one")
    args.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return args


def main() -> None:
    args = parse_args()
    if args.device.type == "cpu":
        # the whole process on the PyTorch path: the Triton interpreter would take minutes
        override_policy(replace(active_policy(), triton_on_cpu=False)).__enter__()
    device_name = torch.cuda.get_device_name() if args.device.type == "cuda" else "cpu"
    environment = {"torch": torch.__version__, "device": device_name,
                   "args": {k: v for k, v in vars(args).items() if k != "out"}}
    runs = Runs(args)
    results: dict[str, dict] = {}
    checks = [
        (lambda: check_compile(runs), ("compile", "kernels")),
        (lambda: check_cudagraphs(runs), ("cudagraphs",)),
        (lambda: check_graphs(runs), ("graphs",)),
        (lambda: check_autocast(runs), ("autocast",)),
        (lambda: check_dynamic(args), ("dynamic",)),
        (lambda: check_timing(runs), ("timing",)),
    ]
    started = time.perf_counter()
    for check, names in checks:
        if not args.checks.intersection(names):
            continue
        results.update(guarded(check, names))
        for name in names:
            elapsed = time.perf_counter() - started
            print(f"[{elapsed:6.0f} s] {name}: {status_word(results[name]['status'])}", flush=True)
        report = {"environment": environment, "checks": results, "runs": runs}
        args.out.write_text(json.dumps(report, indent=2, default=str))
    print_table(results, runs)
    failed = [name for name, result in results.items() if result["status"] is False]
    print(f"\n{'FAILED: ' + ', '.join(failed) if failed else 'all checks PASS'}; wrote {args.out}")


if __name__ == "__main__":
    main()
