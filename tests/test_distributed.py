"""DDP and FSDP2 with the op: two gloo processes on CPU give the loss and gradients of one
process on the whole batch. The checks are plain functions of (device, dtype) so that
benchmarks/gpu_distributed.py runs the same ones on CUDA with NCCL.

Reduction: each rank's loss is the sum over its own tokens divided by the GLOBAL number of
valid tokens (all-reduced; HF's `num_items_in_batch`), times the world size because DDP and
FSDP2 average gradients over ranks. The averaged gradient is then that of the mean over all
valid tokens, however they are split; a per-rank mean would weight the ranks equally, which is
another loss when their counts differ (as in `split_batch`).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from cce_compile import ops as cce_ops
from cce_compile.integrations.transformers import patch
from cce_compile.plan.policy import Policy, override_policy

from .op_cases import relative_error
from .test_transformers import batch, tiny_model

WORLD = 2


def passed(errors: dict) -> bool:
    """fp32: one process's numbers up to summation order. bf16: bf16 rounding alone moves the
    gradients of this model by percents, so they must be no farther from the fp32 run than
    twice as far as one bf16 process is."""
    if "grad_vs_fp32" not in errors:
        return errors["loss"] < 1e-5 and errors["grad"] < 1e-4
    return errors["loss"] < 1e-2 and errors["grad_vs_fp32"] <= 2 * errors["one_process_vs_fp32"]


def split_batch(device: torch.device) -> tuple[Tensor, Tensor, slice]:
    """The whole batch (2 rows a rank, 24 tokens) and this rank's rows; the last rank has
    fewer valid labels."""
    input_ids, labels = batch(seed=0, shape=(2 * dist.get_world_size(), 24))
    labels[-1, :12] = -100
    mine = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
    return input_ids.to(device), labels.to(device), mine


def rank_loss(model: nn.Module, input_ids: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """(this rank's loss to backpropagate, the global mean loss for logging): see the module docstring."""
    count = (labels[..., 1:] != -100).sum()
    dist.all_reduce(count)
    loss = model(input_ids, labels=labels, num_items_in_batch=count).loss
    logged = loss.detach().clone()
    dist.all_reduce(logged)
    return loss * dist.get_world_size(), logged


def single_process(model: nn.Module, input_ids: Tensor, labels: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """The reference: loss and gradients of the patched model on the whole batch."""
    loss = model(input_ids, labels=labels).loss
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


Results = dict[torch.dtype, tuple[Tensor, dict[str, Tensor]]]


def compare(loss: Tensor, grads: dict[str, Tensor], references: Results, dtype: torch.dtype) -> dict:
    """Relative errors against one process in `dtype`, worst over the parameters; for bf16 also
    against the fp32 process, next to how far one bf16 process is from it."""
    ref_loss, ref_grads = references[dtype]
    errors = {
        "loss": relative_error(loss, ref_loss),
        "grad": max(relative_error(grads[n], g) for n, g in ref_grads.items()),
    }
    if dtype != torch.float32:
        fp32_grads = references[torch.float32][1]
        errors["grad_vs_fp32"] = max(relative_error(grads[n], g) for n, g in fp32_grads.items())
        errors["one_process_vs_fp32"] = max(relative_error(ref_grads[n], g) for n, g in fp32_grads.items())
    return errors


@contextlib.contextmanager
def recording_op_inputs() -> Iterator[list[tuple[Tensor, Tensor]]]:
    """The (e, c) that each eager call of the op (either forward) receives, after the API's
    autocast casts."""
    seen: list[tuple[Tensor, Tensor]] = []

    def spy(real):
        def recorded(e: Tensor, c: Tensor, *args, **kwargs):
            seen.append((e, c))
            return real(e, c, *args, **kwargs)
        return recorded

    with (mock.patch.object(cce_ops, "linear_cross_entropy_forward", spy(cce_ops.linear_cross_entropy_forward)),
          mock.patch.object(cce_ops, "linear_cross_entropy_fused", spy(cce_ops.linear_cross_entropy_fused))):
        yield seen


def references(device: torch.device, dtype: torch.dtype) -> tuple[Results, nn.Module]:
    """One process on the whole batch in fp32 and in `dtype`, and a patched fp32 copy of the
    same init to distribute."""
    model = tiny_model("llama").to(device)
    input_ids, labels, _ = split_batch(device)
    results = {
        d: single_process(patch(copy.deepcopy(model)).to(d), input_ids, labels)
        for d in dict.fromkeys((torch.float32, dtype))
    }
    return results, patch(model)


def ddp_errors(device: torch.device, dtype: torch.dtype) -> dict:
    """DDP over a bf16 or fp32 copy of the model, each rank on its rows."""
    refs, model = references(device, dtype)
    ddp = DistributedDataParallel(model.to(dtype), device_ids=[device.index] if device.type == "cuda" else None)
    input_ids, labels, mine = split_batch(device)
    loss, logged = rank_loss(ddp, input_ids[mine], labels[mine])
    loss.backward()
    grads = {name: p.grad for name, p in ddp.module.named_parameters()}
    return compare(logged, grads, refs, dtype)


def fully_shard_llama(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The usual FSDP2 recipe: each decoder layer, then the root (which holds lm_head); bf16
    through MixedPrecisionPolicy on fp32 parameters, gradients reduced in fp32."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def fsdp2_errors(device: torch.device, dtype: torch.dtype) -> dict:
    """FSDP2: lm_head.weight is a sharded DTensor outside forward; inside the root's forward,
    where the patched forward reads it, FSDP2 has unsharded it to a plain tensor."""
    refs, model = references(device, dtype)
    model = fully_shard_llama(model, device, dtype)
    input_ids, labels, mine = split_batch(device)
    with recording_op_inputs() as seen:
        loss, logged = rank_loss(model, input_ids[mine], labels[mine])
    loss.backward()
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    return {
        **compare(logged, grads, refs, dtype),
        "weight_outside_forward": type(model.lm_head.weight).__name__,
        "weight_seen_by_op": [type(c).__name__ for _, c in seen],
    }


CHECKS = {"ddp": ddp_errors, "fsdp2": fsdp2_errors}


def _separately_sharded_head_is_refused(device: torch.device) -> None:
    """fully_shard(lm_head) on its own: its forward never runs (the patched forward reads the
    weight), so FSDP2 never unshards it and the op meets a Shard(0) DTensor it takes for
    vocabulary shards; the ranks' tokens differ, so the loss is NaN, never a wrong number."""
    model = patch(tiny_model("llama"))
    fully_shard(model.lm_head)
    fully_shard_llama(model, device, torch.float32)
    input_ids, labels, mine = split_batch(device)
    loss = model(input_ids[mine], labels=labels[mine]).loss
    assert torch.isnan(loss), f"ranks with different tokens combined into a loss: {loss}"


def _worker(rank: int, check: str, store: str) -> None:
    """One gloo rank on CPU: the op's plain-PyTorch path (fast), one thread per process."""
    with override_policy(Policy(triton_on_cpu=False)):
        _worker_body(rank, check, store)


def _worker_body(rank: int, check: str, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    try:
        errors = CHECKS[check](torch.device("cpu"), torch.float32)
        assert passed(errors), errors
        if check == "fsdp2":
            assert errors["weight_outside_forward"] == "DTensor", errors
            assert errors["weight_seen_by_op"] == ["Parameter"], errors
            _separately_sharded_head_is_refused(torch.device("cpu"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_two_ranks_match_one_process(check: str, tmp_path: Path) -> None:
    """A FileStore in tmp_path: no port to pick. The children inherit TRITON_INTERPRET from
    the environment conftest set, so kernels are decorated as in this process."""
    mp.spawn(_worker, args=(check, str(tmp_path / "store")), nprocs=WORLD, join=True)
