"""The vocabulary-parallel loss's per-rank cost on one GPU: `--world` ranks share the GPU over
gloo (CUDA tensors; the two-GPU NCCL run is its own issue), each holding an uneven-able shard
of a (V, D) classifier. Per rank it times forward + backward of

  sharded:   linear_cross_entropy(e, c_shard, targets, vocab_parallel=...)
  local op:  linear_cross_entropy(e, c_shard, local targets, memory="low"), the unsharded op
             on the same shard (what the shard's compute costs without combining)

and checks the sharded loss and dE against the unsharded op on the whole classifier (rank 0
computes it once). The ranks run at once on one GPU, so their kernels contend: read the
ratio sharded / local op (the cost of the combination and the dE all-reduce, gloo copying
CUDA tensors through the host), not the absolute times. Run with

    python benchmarks/vocab_parallel.py --world 2 --n 8192 --d 4096 --v 128256 --out vp.json

Without CUDA it runs on CPU (a dry run at small shapes: --n 256 --d 64 --v 1000).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cce_compile  # noqa: E402
from cce_compile import VocabParallel  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def inputs(args: argparse.Namespace, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e, c, targets), the same on every rank (one seed)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    dtype = DTYPES[args.dtype]
    e = (torch.randn(args.n, args.d, generator=g) / args.d**0.25).to(device, dtype)
    c = (torch.randn(args.v, args.d, generator=g) / args.d**0.25).to(device, dtype)
    targets = torch.randint(0, args.v, (args.n,), generator=g).to(device)
    return e, c, targets


def timed_ms(step, iters: int, device: torch.device) -> float:
    """Median ms of forward + backward, the ranks lined up by a barrier before each."""
    times = []
    for i in range(iters + 2):  # two warm-ups: config resolution, compilation
        dist.barrier()
        start = torch.cuda.Event(enable_timing=True) if device.type == "cuda" else None
        end = torch.cuda.Event(enable_timing=True) if device.type == "cuda" else None
        if start is not None:
            torch.cuda.synchronize()
            start.record()
        else:
            import time
            t0 = time.perf_counter()
        step()
        if end is not None:
            end.record()
            torch.cuda.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            elapsed = (time.perf_counter() - t0) * 1e3
        if i >= 2:
            times.append(elapsed)
    return sorted(times)[len(times) // 2]


def fwd_bwd(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor, **kwargs):
    """A step of the loss: (loss, dE, dC)."""
    e, c = e.detach().requires_grad_(), c.detach().requires_grad_()
    loss = cce_compile.linear_cross_entropy(e, c, targets, **kwargs)
    loss.backward()
    return loss.detach(), e.grad, c.grad


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-12))


def worker(rank: int, args: argparse.Namespace, store: str) -> None:
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=args.world,
                            timeout=timedelta(seconds=600))
    try:
        e, c, targets = inputs(args, device)
        rows = -(-args.v // args.world)  # torch.chunk's layout, as a Shard(0) DTensor has it
        start, stop = min(rank * rows, args.v), min(rank * rows + rows, args.v)
        parallel = VocabParallel(None, start, stop)
        shard = c[start:stop]
        local_targets = torch.where((targets >= start) & (targets < stop), targets - start, -100)
        sharded = timed_ms(lambda: fwd_bwd(e, shard, targets, vocab_parallel=parallel), args.iters, device)
        local = timed_ms(lambda: fwd_bwd(e, shard, local_targets, memory="low"), args.iters, device)
        loss, grad_e, grad_c = fwd_bwd(e, shard, targets, vocab_parallel=parallel)
        whole_loss, whole_grad_e, whole_grad_c = fwd_bwd(e, c, targets, memory="low")
        result = {
            "rank": rank, "shard": [start, stop], "sharded_ms": sharded, "local_op_ms": local,
            "ratio": sharded / local, "loss_error": relative_error(loss, whole_loss),
            "grad_e_error": relative_error(grad_e, whole_grad_e),
            "grad_c_error": relative_error(grad_c, whole_grad_c[start:stop]),
        }
        results: list[dict | None] = [None] * args.world
        dist.all_gather_object(results, result)
        if rank == 0:
            report = {"args": vars(args), "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                      "ranks": results}
            print(json.dumps(report, indent=2))
            if args.out:
                Path(args.out).write_text(json.dumps(report, indent=2))
    finally:
        dist.destroy_process_group()


def main() -> None:
    # The local-op baseline meets each rank's own shard size, a key rank 0 never resolves: wait briefly.
    os.environ.setdefault("CCE_CONFIG_WAIT_S", "5")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--d", type=int, default=4096)
    parser.add_argument("--v", type=int, default=128256)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(args, os.path.join(tmp, "store")), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
