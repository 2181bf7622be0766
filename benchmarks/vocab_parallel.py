"""The vocabulary-parallel loss's per-rank cost on one GPU: `--world` ranks share the GPU over
gloo (CUDA tensors; the two-GPU NCCL run is its own issue), each holding an uneven-able shard
of a (V, D) classifier. Per rank it times forward + backward of

  sharded:   linear_cross_entropy(e, c_shard, targets, vocab_parallel=...)
  local op:  linear_cross_entropy(e, c_shard, local targets, memory="low"), the unsharded op
             on the same shard (what the shard's compute costs without combining)

and checks the sharded loss and dE against the unsharded op on the whole classifier (every
rank computes it). The ranks run at once on one GPU, so their kernels contend: read the ratio
sharded / local op (the cost of the combination and the dE all-reduce, gloo copying CUDA
tensors through the host), not the absolute times. Run with

    python benchmarks/vocab_parallel.py --world 2 --n 8192 --d 4096 --v 128256 --out vp.json
    python benchmarks/vocab_parallel.py --device cpu      # a dry run at --n 256 --d 64 --v 1000

Diagnosis: each rank writes rank<r>.log in --log-dir (its stderr, C++ messages included, and
faulthandler's Python stacks of every thread on SIGSEGV/SIGABRT or after --hang-s). Before
timing, each rank issues the collectives the loss issues, one at a time, on the device, dtype
and sizes the loss gives them, each announced in its log: a crash names its collective.
`--stage-only` stops after them. If a rank dies, the parent prints each log's tail.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cce_compile  # noqa: E402
from cce_compile import VocabParallel  # noqa: E402
from cce_compile.parallel.vocab_parallel import all_shards  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SHAPES = {"cuda": (8192, 4096, 128256), "cpu": (256, 64, 1000)}  # (n, d, v) when not given


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def inputs(args: argparse.Namespace, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e, c, targets), the same on every rank (one seed)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    dtype = DTYPES[args.dtype]
    e = (torch.randn(args.n, args.d, generator=g) / args.d**0.25).to(device, dtype)
    c = (torch.randn(args.v, args.d, generator=g) / args.d**0.25).to(device, dtype)
    targets = torch.randint(0, args.v, (args.n,), generator=g).to(device)
    return e, c, targets


def stage_collectives(args: argparse.Namespace, device: torch.device, parallel: VocabParallel) -> list[str]:
    """The loss's collectives one at a time, supported ones first: the forward's all-gather
    of each shard's statistics (lse and target logit per token, plus the targets' checksum:
    fp32, 2N + 1 elements a rank) and the backward's all-reduce of dE ((N, D) in e's dtype),
    the first as the loss makes it (cce_compile/parallel/vocab_parallel.py: gloo's all-gather
    into one tensor has no CUDA path, so a gloo group stages it through host memory), the second
    through torch.distributed._functional_collectives on the group's name. Next to them,
    the c10d calls of the same sizes, which take other paths in the backend. Each result is
    checked."""
    rank, world, name = parallel.rank, parallel.world_size, parallel.group_name
    stats = torch.full((2 * args.n + 1,), float(rank), device=device)
    grad_e = torch.ones(args.n, args.d, device=device, dtype=DTYPES[args.dtype])
    expected_gather = torch.arange(world, device=device, dtype=torch.float32).repeat_interleave(stats.numel())

    def c10d_all_reduce():
        x = grad_e.clone()
        dist.all_reduce(x)
        return x, grad_e * world

    def c10d_all_gather_into_tensor():  # ProcessGroup._allgather_base
        out = stats.new_empty(world * stats.numel())
        dist.all_gather_into_tensor(out, stats)
        return out, expected_gather

    steps = {
        "c10d barrier": lambda: (dist.barrier(), None),
        f"c10d all_reduce {tuple(grad_e.shape)} {grad_e.dtype}": c10d_all_reduce,
        f"funcol all_reduce {tuple(grad_e.shape)} {grad_e.dtype} (the backward's dE sum)":
            lambda: (funcol.wait_tensor(funcol.all_reduce(grad_e, "sum", name)), grad_e * world),
        f"c10d all_gather_into_tensor {tuple(stats.shape)} fp32": c10d_all_gather_into_tensor,
        f"the loss's all-gather {tuple(stats.shape)} fp32 (the forward's statistics, through host memory on gloo)":
            lambda: (all_shards(stats, parallel).flatten(), expected_gather),
    }
    done = []
    for step, run in steps.items():
        log(f"stage: {step} on {device} ...")
        actual, expected = run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if expected is not None and not torch.equal(actual, expected):
            raise RuntimeError(f"stage {step!r} gave a wrong result")
        log(f"stage: {step} ok")
        done.append(step)
    return done


def timed_ms(step, iters: int, device: torch.device) -> float:
    """Median ms of forward + backward, the ranks lined up by a barrier before each."""
    times = []
    for i in range(iters + 2):  # two warm-ups: config resolution, compilation
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def fwd_bwd(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor, **kwargs):
    """A step of the loss: (loss, dE, dC)."""
    e, c = e.detach().requires_grad_(), c.detach().requires_grad_()
    loss = cce_compile.linear_cross_entropy(e, c, targets, **kwargs)
    loss.backward()
    return loss.detach(), e.grad, c.grad


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-12))


def worker(rank: int, args: argparse.Namespace, store: str, log_dir: str) -> None:
    log_file = open(Path(log_dir) / f"rank{rank}.log", "w", buffering=1)
    os.dup2(log_file.fileno(), 2)  # fd 2 too: gloo's, CUDA's and Triton's C++ messages
    faulthandler.enable(file=log_file, all_threads=True)
    faulthandler.dump_traceback_later(args.hang_s, file=log_file)
    try:
        _benchmark(rank, args, store)
    except BaseException:
        log(traceback.format_exc())
        raise


def _benchmark(rank: int, args: argparse.Namespace, store: str) -> None:
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world))
    log(f"rank {rank}/{args.world} pid {os.getpid()} torch {torch.__version__} on {device}")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=args.world,
                            timeout=timedelta(seconds=600))
    try:
        rows = -(-args.v // args.world)  # torch.chunk's layout, as a Shard(0) DTensor has it
        start, stop = min(rank * rows, args.v), min(rank * rows + rows, args.v)
        parallel = VocabParallel(None, start, stop)
        stages = stage_collectives(args, device, parallel)
        if args.stage_only:
            if rank == 0:
                print(json.dumps({"device": str(device), "torch": torch.__version__, "stages_ok": stages}, indent=2))
            return
        e, c, targets = inputs(args, device)
        shard = c[start:stop]
        local_targets = torch.where((targets >= start) & (targets < stop), targets - start, -100)
        log("timing the sharded loss")
        sharded = timed_ms(lambda: fwd_bwd(e, shard, targets, vocab_parallel=parallel), args.iters, device)
        log("timing the local op")
        local = timed_ms(lambda: fwd_bwd(e, shard, local_targets, memory="low"), args.iters, device)
        loss, grad_e, grad_c = fwd_bwd(e, shard, targets, vocab_parallel=parallel)
        whole_loss, whole_grad_e, whole_grad_c = fwd_bwd(e, c, targets, memory="low")
        result = {
            "rank": rank, "shard": [start, stop], "sharded_ms": sharded, "local_op_ms": local,
            "ratio": sharded / local, "loss_error": relative_error(loss, whole_loss),
            "grad_e_error": relative_error(grad_e, whole_grad_e),
            "grad_c_error": relative_error(grad_c, whole_grad_c[start:stop]),
        }
        log(f"result {result}")
        results: list[dict | None] = [None] * args.world
        dist.all_gather_object(results, result)
        if rank == 0:
            report = {"args": vars(args), "torch": torch.__version__,
                      "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                      "stages_ok": stages, "ranks": results}
            print(json.dumps(report, indent=2))
            if args.out:
                Path(args.out).write_text(json.dumps(report, indent=2))
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--n", type=int)
    parser.add_argument("--d", type=int)
    parser.add_argument("--v", type=int)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default="")
    parser.add_argument("--log-dir", default="", help="where rank<r>.log go (default: a new temporary folder)")
    parser.add_argument("--hang-s", type=float, default=600.0, help="dump every rank's stacks after this long")
    parser.add_argument("--stage-only", action="store_true", help="only the collectives, one at a time")
    args = parser.parse_args()
    for name, value in zip(("n", "d", "v"), SHAPES[args.device]):
        if getattr(args, name) is None:
            setattr(args, name, value)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="vp-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log(f"per-rank logs in {log_dir}")
    with tempfile.TemporaryDirectory() as tmp:
        try:  # spawn, not fork: each rank starts CUDA afresh
            mp.spawn(worker, args=(args, os.path.join(tmp, "store"), str(log_dir)), nprocs=args.world, join=True)
        except Exception as error:  # a signal (ProcessExitedException: SIGSEGV...) or a raise
            log(f"{type(error).__name__}: {error}")
            for path in sorted(log_dir.glob("rank*.log")):
                log(f"--- {path}, last 40 lines:\n" + "\n".join(path.read_text(errors="replace").splitlines()[-40:]))
            sys.exit(1)


if __name__ == "__main__":
    main()
