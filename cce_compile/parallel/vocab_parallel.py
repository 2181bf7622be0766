"""The loss with the classifier sharded by vocabulary over a process group (tensor parallel).

Each rank holds classifier rows [start, stop) (and the same rows of bias and class weights),
every rank the same e and targets. Forward: each rank's op (ops/vocab_parallel.py) gives its
shard's per-token log-sum-exp, target logit (0 where the target is in another shard), and for
label smoothing its weighted logit sum and target weight; ONE all-gather of those few
N-vectors (world x k x N floats, plus the shard's weight total) gives every rank all the
shards' statistics, from which each computes the same loss: lse = logsumexp over shards, the
target logit and the weighted sums summed. One all-gather costs less than the two all-reduces
(a max, then a sum of exponentials) that combining without it needs, at the world sizes
tensor parallelism uses.

Backward: autograd runs through that combination on each rank with the other ranks' rows as
constants, so the shard's op gets the upstream gradients of its own statistics, e.g.
d lse / d lse_shard = exp(lse_shard - lse); its backward recomputes the shard's logits from
lse_shard (memory="low"'s recompute: the fused memory="workspace" forward finishes the
d-logits before the global lse exists, so it cannot serve here) and gives the shard's dC and
dbias and its part of dE, which one all-reduce sums over the group (unless reduce_grad_e is
off, for callers that reduce it themselves).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from ..ops.loss_terms import loss_of_terms, reduce_with_z_loss
from ..ops.precision import without_autocast
from ..ops.problem import needs_grad, traced_settings
from ..ops.vocab_parallel import shard_row_stats


@dataclass(frozen=True)
class VocabParallel:
    """This rank's shard of the vocabulary: rows [start, stop) of the classifier, over `group`
    (None: the default group). Build it outside torch.compile'd code: without `vocab_size` it
    gathers every rank's range once, to check that the shards tile [0, V) and learn V.

    reduce_grad_e: sum dE over the group in the backward (off: each rank gets the part of dE
    from its own shard, for callers that reduce it, e.g. with sequence parallelism)."""

    group: dist.ProcessGroup | None
    start: int
    stop: int
    vocab_size: int | None = None
    reduce_grad_e: bool = True
    group_name: str = field(init=False)
    rank: int = field(init=False)
    world_size: int = field(init=False)
    gather_on_host: bool = field(init=False)
    """A gloo-only group: gloo's all-gather into one tensor has no CUDA path (it reads the
    device pointer from the host and crashes), so CUDA statistics travel through host memory."""

    def __post_init__(self) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("vocab_parallel needs an initialized torch.distributed process group")
        group = self.group if self.group is not None else dist.group.WORLD
        if _is_int(group) and group == dist.GroupMember.NON_GROUP_MEMBER:  # new_group's stand-in outside the group
            raise ValueError("VocabParallel.group: this rank is not a member of the group")
        if not isinstance(group, dist.ProcessGroup):  # a DeviceMesh, a group's name, a rank list
            hint = " (a DeviceMesh: pass mesh.get_group())" if type(group).__name__ == "DeviceMesh" else ""
            raise TypeError(f"VocabParallel.group must be a torch.distributed ProcessGroup or None, "
                            f"got {type(group).__name__}{hint}")
        if not isinstance(self.reduce_grad_e, bool):
            raise TypeError(f"VocabParallel.reduce_grad_e must be a bool, got {self.reduce_grad_e!r:.40}")
        object.__setattr__(self, "group_name", group.group_name)
        object.__setattr__(self, "rank", dist.get_rank(group))
        object.__setattr__(self, "world_size", dist.get_world_size(group))
        object.__setattr__(self, "gather_on_host", dist.get_backend(group) == "gloo")
        if self.vocab_size is None:  # every rank checks every range, so that all raise together
            vocab_size = _checked_vocab_size(self.start, self.stop, self.reduce_grad_e, group)
            object.__setattr__(self, "vocab_size", vocab_size)
            return
        _check_range(self.start, self.stop)
        if not _is_int(self.vocab_size):
            raise TypeError(f"VocabParallel.vocab_size must be an int or None, got {type(self.vocab_size).__name__}")
        if self.stop > self.vocab_size:
            raise ValueError(f"VocabParallel: stop ({self.stop}) is past vocab_size ({self.vocab_size})")

    def __deepcopy__(self, memo: dict) -> VocabParallel:
        """Itself: it names a process group, which cannot be copied (a deep copy of a model that
        holds the loss module, an EMA's or a reference model's, shares it)."""
        return self

    @property
    def shard_size(self) -> int:
        return self.stop - self.start


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_range(start: object, stop: object, rank: int | None = None) -> None:
    """[start, stop) a non-empty range of ints; `rank` names whose, when checked for another."""
    whose = "" if rank is None else f" (rank {rank})"
    for name, value in (("start", start), ("stop", stop)):
        if not _is_int(value):
            raise TypeError(f"VocabParallel.{name} must be an int{whose}, got {type(value).__name__}")
    if not 0 <= start < stop:  # type: ignore[operator]
        raise ValueError(f"VocabParallel needs 0 <= start < stop (a non-empty shard){whose}, got [{start}, {stop})")


def _checked_vocab_size(start: int, stop: int, reduce_grad_e: bool, group: dist.ProcessGroup) -> int:
    """V, from every rank's [start, stop), after checking that each is a range and that they
    tile [0, V); and that every rank's reduce_grad_e is the same (ranks that differ waited in
    the backward's dE all-reduce, which only some of them join)."""
    gathered: list[tuple[int, int, bool] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (start, stop, reduce_grad_e), group=group)
    ranges = [(first, last) for first, last, _ in gathered]  # type: ignore[misc]
    for rank, (first, last) in enumerate(ranges):
        _check_range(first, last, rank)
    reductions = [reduces for _, _, reduces in gathered]  # type: ignore[misc]
    if len(set(reductions)) > 1:
        raise ValueError(f"VocabParallel.reduce_grad_e must be the same on every rank, got {reductions} "
                         "(in group rank order)")
    position = 0
    for first, last in sorted(ranges):  # type: ignore[type-var]
        if first != position:
            raise ValueError(f"VocabParallel: the ranks' [start, stop) must tile [0, V) without gaps or overlaps, "
                             f"got {ranges}")
        position = last
    return position


def from_dtensor(c) -> tuple[Tensor, VocabParallel]:
    """(the local rows, their VocabParallel) of a classifier DTensor sharded Shard(0) on a
    1-D mesh, as torch.distributed.tensor lays out uneven shards (torch.chunk: ceil(V / W) rows
    a rank, the last ones fewer)."""
    from torch.distributed.tensor import Shard

    mesh = c.device_mesh
    if mesh.ndim != 1 or tuple(c.placements) != (Shard(0),):
        raise ValueError(f"c: a DTensor classifier must be sharded Shard(0) on a 1-D mesh, got placements "
                         f"{tuple(c.placements)} on a {mesh.ndim}-D mesh")
    v, world = c.shape[0], mesh.size()
    rows = -(-v // world)
    if rows * (world - 1) >= v:  # known to every rank alike: all raise, none waits in a collective
        raise ValueError(f"c: a DTensor classifier of {v} rows over a mesh of {world} leaves a rank no rows "
                         f"(torch.chunk's layout, {rows} a rank); the vocabulary-parallel loss needs every rank "
                         f"to hold some")
    start = min(mesh.get_local_rank() * rows, v)
    stop = min(start + rows, v)
    return c.to_local(), VocabParallel(mesh.get_group(), start, stop, vocab_size=v)


def local_shard(name: str, tensor: Tensor | None, parallel: VocabParallel) -> Tensor | None:
    """A bias or weight given with a DTensor c: a DTensor sharded like c gives its local rows; a
    plain one must already be this rank's rows (one of all V rows, as a loss module's class
    weights are kept, raises saying so, not as a shape error about rows it never had)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(tensor, DTensor):
        if (isinstance(tensor, Tensor) and tensor.dim() == 1
                and tensor.shape[0] == parallel.vocab_size != parallel.shard_size):
            raise ValueError(f"{name}: with a DTensor c, pass it as a DTensor sharded Shard(0) like c, or this "
                             f"rank's rows [{parallel.start}, {parallel.stop}) of it; got a plain tensor of all "
                             f"{parallel.vocab_size} rows")
        return tensor
    if tuple(tensor.placements) != (Shard(0),):
        raise ValueError(f"{name}: a DTensor must be sharded Shard(0) like c, got {tuple(tensor.placements)}")
    return tensor.to_local()


def is_dtensor(tensor: object) -> bool:
    if not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


FILTER_EPS_REFUSAL = ("filter_eps: filtered mode does not combine over vocabulary shards (its kept tiles are "
                      "chosen against the global log-sum-exp, which no shard has in its forward); pass None")


def check_vocab_parallel(vocab_parallel: object, filter_eps: object = None) -> None:
    """vocab_parallel is a VocabParallel or None; with one, filter_eps must be None (a module's
    options are checked where it is built: a bad pair fails there, not at the first step)."""
    if vocab_parallel is not None and not isinstance(vocab_parallel, VocabParallel):
        raise TypeError(f"vocab_parallel must be a VocabParallel or None, got {type(vocab_parallel).__name__}")
    if vocab_parallel is not None and filter_eps is not None:
        raise ValueError(FILTER_EPS_REFUSAL)


def sharded_operands(
    c: Tensor, bias: Tensor | None, weight: Tensor | None, vocab_parallel: VocabParallel | None,
) -> tuple[Tensor, Tensor | None, Tensor | None, VocabParallel | None]:
    """(c, bias, weight, vocab_parallel) as the loss takes them: a DTensor classifier becomes
    its local rows and the VocabParallel its layout says; plain tensors pass through."""
    check_vocab_parallel(vocab_parallel)
    if not is_dtensor(c):
        return c, bias, weight, vocab_parallel
    if vocab_parallel is not None:
        raise ValueError("vocab_parallel: leave it None for a DTensor c, whose sharding says it")
    local_c, derived = from_dtensor(c)
    return local_c, local_shard("bias", bias, derived), local_shard("weight", weight, derived), derived


def all_shards(stats: Tensor, parallel: VocabParallel) -> Tensor:
    """(world, *stats.shape): every rank's `stats`, this rank's row being `stats` itself (so
    autograd reaches it) and the others constants, from one all-gather."""
    sent = stats.detach().contiguous()
    if parallel.gather_on_host and sent.is_cuda:
        sent = sent.cpu()
    gathered = funcol.wait_tensor(funcol.all_gather_tensor(sent, 0, parallel.group_name))
    gathered = gathered.to(stats.device).reshape(parallel.world_size, *stats.shape)
    rows = [stats if rank == parallel.rank else gathered[rank] for rank in range(parallel.world_size)]
    return torch.stack(rows)


def targets_checksum(targets: Tensor, options: tuple[float, ...] = ()) -> Tensor:
    """(1,) float32: sum_i i * target_i over positions 1..N, in int64 (exact, so equal targets
    give equal sums on every rank whatever the reduction order; a float32 sum of 200k tokens
    differed between ranks of other thread counts) and folded below 2^24, which float32 holds
    exactly. `options` (numbers) count too (options_code): a host integer, no copy to the device."""
    positions = torch.arange(1, targets.numel() + 1, dtype=torch.int64, device=targets.device)
    total = (targets.to(torch.int64) * positions).sum() + options_code(options)
    return (total % 2**24).to(torch.float32).reshape(1)


def options_code(options: tuple[float, ...]) -> int:
    """An integer below 2^24, the same on ranks that pass the same options, from each one's
    exact ratio (float.as_integer_ratio, which torch.compile traces; Python's hash of a string
    differs between processes) and its position."""
    code = 0
    for position, value in enumerate(options, start=1):
        numerator, denominator = float(value).as_integer_ratio()
        code += position * (numerator % _CODE_MODULUS + 2 * position * (denominator % _CODE_MODULUS))
    return code % _CODE_MODULUS


_CODE_MODULUS = 2**24 - 3


def vocab_parallel_loss(
    e: Tensor, c: Tensor, targets: Tensor, parallel: VocabParallel, *, bias: Tensor | None, weight: Tensor | None,
    ignore_index: int, reduction: str, label_smoothing: float, z_loss: float, softcap: float, filter_eps: float,
    logit_scale: float,
) -> tuple[Tensor, Tensor]:
    """(loss reduced as `reduction` says, lse (N,)) for e (N, D), this rank's rows c of the
    classifier (and of bias and weight), global targets (N,) int64; `logit_scale` (1 /
    temperature) multiplies the logits before the soft-cap, as in the unsharded op."""
    if filter_eps > 0.0:
        raise ValueError(FILTER_EPS_REFUSAL)
    if c.shape[0] != parallel.shard_size:
        raise ValueError(f"c has {c.shape[0]} rows but vocab_parallel's shard [{parallel.start}, {parallel.stop}) "
                         f"has {parallel.shard_size}")
    v = parallel.vocab_size
    valid = targets != ignore_index
    in_range = (targets >= 0) & (targets < v)
    local = targets - parallel.start
    mine = valid & (local >= 0) & (local < parallel.shard_size)
    local_targets = torch.where(mine, local, -1)
    smoothing = label_smoothing > 0.0
    with without_autocast(e.device.type):
        config_v = -(-v // parallel.world_size)
        lse_shard, target_logit, weighted_sum = shard_row_stats(
            e, c, local_targets, bias, weight if smoothing else None, float(softcap), smoothing,
            parallel.group_name if parallel.reduce_grad_e else "", config_v, logit_scale,
            traced_settings(e, c, False, config_v, config_in_backward=needs_grad(e, c, bias)),
        )
    terms = [lse_shard, target_logit]
    if smoothing:
        terms.append(weighted_sum)
    if weight is not None:  # the target's class weight, from the shard that holds it
        weight32 = weight.to(torch.float32)
        terms.append(torch.where(mine, weight32[local_targets.clamp(0, parallel.shard_size - 1)], 0.0))
    n = e.shape[0]
    stats = torch.stack(terms).reshape(-1)
    # Every rank must score the same tokens: a classifier sharded by FSDP looks like vocabulary
    # shards but comes with other ranks' tokens. A checksum of the targets rides along in the
    # same all-gather; a mismatch makes the loss NaN, without a host sync to raise. The options
    # count too: ranks that disagree on one that leaves the gather's size alone (a softcap, a
    # reduction) would combine shards of different losses into a finite wrong one. The scalars
    # lead, so that no index depends on N (under torch.compile one would pin N to a constant).
    checksum = targets_checksum(targets, (
        v, ignore_index, ("none", "sum", "mean").index(reduction), label_smoothing, z_loss, softcap, logit_scale,
        bias is not None, weight is not None, parallel.reduce_grad_e))
    scalars = [checksum]
    if smoothing and weight is not None:  # and the shard's weight total, for W
        scalars.append(weight32.sum().reshape(1))
    shards = all_shards(torch.cat([*scalars, stats]), parallel)
    per_shard = shards[:, len(scalars):].reshape(parallel.world_size, len(terms), n)
    lse = torch.logsumexp(per_shard[:, 0], dim=0)
    summed = per_shard[:, 1:].sum(dim=0)
    target_weight = summed[-1] if weight is not None else valid.to(torch.float32)
    total_weight = shards[:, 1].sum() if smoothing and weight is not None else float(v)
    loss = loss_of_terms(lse, summed[0], summed[1] if smoothing else None, valid, in_range, target_weight,
                         total_weight, v, label_smoothing)
    same_tokens = (shards[:, 0] == checksum).all()
    # NaN in the gradients too, for any grad scaler to see; the factor in the loss's dtype (not the default one)
    loss = loss * torch.where(same_tokens, loss.new_ones(()), float("nan"))
    return reduce_with_z_loss(loss, lse, z_loss, reduction, valid, target_weight if weight is not None else None), lse
