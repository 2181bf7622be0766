"""How the backward walks the (tokens x vocab) plane: token chunks, vocab slabs, slots.

The ops plan as they run, for N itself: torch.compile sees them as opaque custom ops whose
implementations run per call on real tensors, so a compiled graph's backward plans each N it
serves. A caller that plans under tracing passes a SymInt N: planning_tokens buckets it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config.kernel_config import KernelConfig
from .policy import Policy
from .tokens import traced_n_bucket


def planning_tokens(n) -> int:
    """The token count a backward plans for: N itself where it is an int (every op call: the
    ops plan as they run, compiled graphs too), else the bucket tokens.traced_n_bucket gives
    a traced N, the one its config's key takes (each comparison on N would be a guard). A plan
    for it holds for every N of the graph where that bucket bounds them (a guarded bucket, a
    declared range), not for a data-dependent N, which has no bound: that is why the ops plan
    per call. Planning an N between powers of two
    for its bucket gives it chunks sized for twice its rows. An empty batch plans for one
    token."""
    return max(n, 1) if isinstance(n, int) else traced_n_bucket(n)


def next_pow2(value: int) -> int:
    return 1 << max(0, (int(value) - 1).bit_length())


MIN_SLAB_V = 8
"""The narrowest slab: rows of d-logits 16 bytes apart at 16-bit elements, the least row stride
a tensor descriptor takes (the tma and Gluon recomputes describe the slab's buffer, so a
vocabulary of 4 or fewer still gets slabs of 8 columns)."""


@dataclass(frozen=True)
class BackwardPlan:
    """`n_chunks` token chunks of at most `chunk_rows` rows (a multiple of the grad_logits
    row block); within a chunk, vocab slabs of `slab_v` columns. Scratch per chunk: the
    slab's d logits (chunk_rows x slab_v, input dtype) and, for 16-bit inputs, an fp32
    accumulator for dE (chunk_rows x D). Filtered mode's packed steps store `slots` kept
    tiles instead of a slab (0: as many as the slab holds)."""

    n_chunks: int
    slab_v: int
    fp32_accumulator: bool
    slots: int = 0

    def __post_init__(self) -> None:
        if self.n_chunks < 1 or self.slab_v < 1 or self.slots < 0:
            raise ValueError(f"BackwardPlan: expected n_chunks >= 1, slab_v >= 1 and slots >= 0, got {self}")

    def rows_per_chunk(self, n):
        """n tokens' share per chunk, rounded up (n may be symbolic under torch.compile)."""
        return (n + self.n_chunks - 1) // self.n_chunks

    def chunk_rows(self, n, block_m: int):
        return (self.rows_per_chunk(n) + block_m - 1) // block_m * block_m

    def step_slots(self, n, block_m: int, block_n: int) -> int:
        """The d-logits tiles a filtered step holds: `slots`, or (0) a slab's; never fewer than a
        tile column's, since packing never splits one."""
        tile_rows = self.chunk_rows(n, block_m) // block_m
        return max(self.slots or tile_rows * -(-self.slab_v // block_n), tile_rows)

    def accumulator_bytes(self, n: int, d: int, block_m: int) -> int:
        """The fp32 dE accumulator of one token chunk (none for fp32 inputs)."""
        return self.chunk_rows(n, block_m) * d * 4 if self.fp32_accumulator else 0

    def scratch_bytes(self, n: int, d: int, element_bytes: int, block_m: int) -> int:
        """The accumulator and the slab's d-logits, both of a chunk's rows padded to block_m
        rows, as the backward allocates them."""
        return self.accumulator_bytes(n, d, block_m) + self.chunk_rows(n, block_m) * self.slab_v * element_bytes


def plan_backward(
    n: int, v: int, d: int, element_bytes: int, config: KernelConfig, filtered: bool = False,
    policy: Policy = Policy(), row_buffers: int = 0, held_bytes: int = 0,
) -> BackwardPlan:
    """The plan for n tokens (planned for planning_tokens(n)) whose scratch fits the policy's
    share of the gradients (or its floor) with the least accumulator traffic among those of
    at most policy.max_dc_roundings token chunks (any number where none fits), less `row_buffers`
    fp32 vectors per token and `held_bytes` that the call holds beside the scratch; slabs within
    config.slab_v and V's next power of two (MIN_SLAB_V at least), halved while over budget down
    to 512 wide. Filtered mode plans within its own share, and its slots fill what the accumulator leaves (up to
    policy.max_slots; never fewer than a slab's tiles).

    The two gradient GEMMs sum over short K: dE over a slab's columns (each slab re-reads and
    re-writes the fp32 dE accumulator), dC over a chunk's rows (each chunk re-reads and
    re-writes dC). Per element of the N x V x D product that is 8 / slab_v + 2 * element_bytes /
    chunk_rows bytes, and a short K also spends a GEMM's epilogue on little work. Ties go to
    fewer token chunks; when nothing fits, the smallest plan tried."""
    n = planning_tokens(n)
    grad_bytes = (n * d + v * d + v) * element_bytes
    fraction = (policy.filtered_scratch_fraction if filtered
                else policy.scratch_fraction - policy.other_buffers_fraction)
    budget = max(fraction * grad_bytes - row_buffers * 4 * n - held_bytes, policy.scratch_floor_bytes)
    tile = config.grad_logits
    fp32_acc = element_bytes < 4
    widest = min(config.slab_v, max(next_pow2(v), MIN_SLAB_V))
    best: BackwardPlan | None = None
    best_preference = (False, -float("inf"))  # (within max_dc_roundings, -traffic): larger wins
    smallest: BackwardPlan  # the last plan tried; the loops run at least once
    n_chunks = 1
    # n_chunks <= n: with min_chunk_rows=1 the rows test alone never fails (a chunk of 1 row has >= 1)
    while n_chunks == 1 or (n_chunks <= n and -(-n // n_chunks) >= policy.min_chunk_rows):
        slab = widest
        while True:
            plan = BackwardPlan(n_chunks, slab, fp32_acc)
            smallest = plan
            if plan.scratch_bytes(n, d, element_bytes, tile.block_m) <= budget:
                traffic = 8 / slab + 2 * element_bytes / plan.rows_per_chunk(n)
                preference = (n_chunks <= policy.max_dc_roundings, -traffic)
                if preference > best_preference:
                    best, best_preference = plan, preference
                break
            if slab <= 512:
                break
            slab //= 2
        n_chunks *= 2
    plan = best if best is not None else smallest
    if not filtered:
        return plan
    room_slots = int(budget - plan.accumulator_bytes(n, d, tile.block_m)) // (tile.block_m * tile.block_n * element_bytes)
    slab_slots = plan.step_slots(n, tile.block_m, tile.block_n)
    return replace(plan, slots=max(slab_slots, min(policy.max_slots, room_slots)))
