"""Sizes the op derives from a config and a shape: the N bucket and the backward's chunking.

Everything here runs at trace time under torch.compile, where N may be symbolic: only
comparisons against N (which become range guards, one per bucket) and integer arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .kernel_config import KernelConfig

SCRATCH_FRACTION = 0.10
"""Backward scratch allowed, as a fraction of the gradients' own bytes (the memory target)."""

OTHER_BUFFERS_FRACTION = 0.002
"""What the op holds beside the scratch at the backward's peak (per-row vectors, the allocator's
rounding), kept out of SCRATCH_FRACTION so that the whole peak stays within the target: on the
H200 the most seen was Qwen2.5's 1.082 x the gradients against 0.080 of scratch."""

FILTERED_SCRATCH_FRACTION = 0.25
"""Filtered mode's backward scratch. Its steps store only the d-logits tiles the filter keeps,
one per slot, and each step's three launches get little work: the more slots, the fewer and
fuller the steps. On the H200 (benchmarks/results/profile-h200-v14-plans.json, GPU time x
GEMM) Qwen2.5 ran 2.84 with 256 slots in 8 token chunks, 2.62 with 512 in 4 and 2.45 with
1024 in 4; Gemma-2 1.78 / 1.69 / 1.64 with 512 / 1024 / 2048 in one. Filtered mode has no
memory target; this costs it up to ~0.17 x the gradients more than exact mode's budget."""

MAX_SLOTS = 2048
"""Filtered mode's slots per step at most: from 1024 to 2048 Gemma-2, Llama-3 and the large-D
shape gained 1.5-3%, for another 134 MB of 128 x 256 bf16 tiles; further doublings were not
worth their memory."""

SCRATCH_FLOOR_BYTES = 24 * 2**20
"""Scratch always allowed, however small the gradients. Under it, 10% of a small model's
gradients (3.7 MB for a 32k x 512 head) cuts the backward into ~100 slab steps: launch-bound
in eager, and each step is a kernel call site Inductor compiles separately (minutes of
compile). 24 MiB is below 10% of every benchmark shape's gradients, so their plans keep
the 1.10 x memory bound."""

MIN_CHUNK_ROWS = 256

MAX_DC_ROUNDINGS = 16
"""Token chunks a plan takes at most where one within the budget does. dC sums over the
chunks in its own 16-bit dtype (cuBLAS adds each chunk's product in fp32 and rounds), so each
chunk rounds dC's running sum once: on the H200 dC's error against fp32 was 2.3-2.6e-3 at 2-4
chunks, 3.2e-3 at 8 and 4.1-4.2e-3 at 16 (bench-h200-survey-32k.md, N = 32768), against the
5e-3 target; at 32 it would pass it. The traffic model alone chose 32 chunks from N = 65536
on Qwen2.5's head."""


def n_bucket(n) -> int:
    """Smallest power of two >= n (n may be a SymInt: each comparison is a range guard)."""
    bucket = 1
    while bucket < n:
        bucket *= 2
    return bucket


def planning_tokens(n) -> int:
    """The token count a backward plans for: N itself where it is known (eager calls, static
    compiles), its bucket where torch.compile traces N symbolically (the plan must then hold
    for every N of the bucket, and each comparison on N would be a guard). Planned for its
    bucket, an N between powers of two got chunks sized for the bucket: Qwen2.5's head at
    N = 20000 took 16 chunks of 1280 rows (608 steps, 5.34 x GEMM on the H200) where 8 of 2560
    fit (304 steps, 4.84 x; docs/performance.md v29c). An empty batch plans for one token."""
    return max(n, 1) if isinstance(n, int) else n_bucket(n)


def next_pow2(value: int) -> int:
    return 1 << max(0, (int(value) - 1).bit_length())


@dataclass(frozen=True)
class BackwardPlan:
    """How the backward walks the (tokens x vocab) plane.

    `n_chunks` token chunks of at most `chunk_rows` rows (a multiple of the grad_logits
    row block); within a chunk, vocab slabs of `slab_v` columns. Scratch per chunk: the
    slab's d logits (chunk_rows x slab_v, input dtype) and, for 16-bit inputs, an fp32
    accumulator for dE (chunk_rows x D). Filtered mode's eager steps store `slots` kept
    tiles instead of a slab (0: as many as the slab holds).
    """

    n_chunks: int
    slab_v: int
    fp32_accumulator: bool
    slots: int = 0

    def rows_per_chunk(self, n):
        """n tokens' share per chunk, rounded up (n may be symbolic under torch.compile)."""
        return (n + self.n_chunks - 1) // self.n_chunks

    def chunk_rows(self, n, block_m: int):
        return (self.rows_per_chunk(n) + block_m - 1) // block_m * block_m

    def accumulator_bytes(self, n: int, d: int, block_m: int) -> int:
        """The fp32 dE accumulator of one token chunk (none for fp32 inputs)."""
        return self.chunk_rows(n, block_m) * d * 4 if self.fp32_accumulator else 0

    def scratch_bytes(self, n: int, d: int, element_bytes: int, block_m: int) -> int:
        """The accumulator and the slab's d-logits, both of a chunk's rows padded to block_m
        rows, as the backward allocates them."""
        return self.accumulator_bytes(n, d, block_m) + self.chunk_rows(n, block_m) * self.slab_v * element_bytes


def plan_backward(
    n: int, v: int, d: int, element_bytes: int, config: KernelConfig, filtered: bool = False
) -> BackwardPlan:
    """The plan for n tokens (made for planning_tokens(n): n itself, or its bucket where n is
    symbolic) whose scratch fits SCRATCH_FRACTION of the gradients less OTHER_BUFFERS_FRACTION
    (or SCRATCH_FLOOR_BYTES) with the least accumulator traffic among those of at most
    MAX_DC_ROUNDINGS token chunks (any number where none fits); slabs within config.slab_v and
    at least 512 wide.
    Filtered mode plans within FILTERED_SCRATCH_FRACTION, and its slots fill what the
    accumulator leaves (up to MAX_SLOTS; never fewer than the slab's tiles).

    The two gradient GEMMs sum over short K: dE over a slab's columns (each slab re-reads and
    re-writes the fp32 dE accumulator), dC over a chunk's rows (each chunk re-reads and
    re-writes dC). Per element of the N x V x D product that is 8 / slab_v + 2 * element_bytes /
    chunk_rows bytes; a short K also spends a GEMM's epilogue on little work (measured on the
    H200: dE over 2048-column slabs cost 1.21 x GEMM against 0.92 x for dC over 8192 rows).
    Ties go to fewer token chunks; when nothing fits, the smallest plan tried."""
    n = planning_tokens(n)
    grad_bytes = (n * d + v * d + v) * element_bytes
    fraction = FILTERED_SCRATCH_FRACTION if filtered else SCRATCH_FRACTION - OTHER_BUFFERS_FRACTION
    budget = max(fraction * grad_bytes, SCRATCH_FLOOR_BYTES)
    tile = config.grad_logits
    fp32_acc = element_bytes < 4
    widest = min(config.slab_v, next_pow2(v))
    best: BackwardPlan | None = None
    best_preference = (False, -float("inf"))  # (within MAX_DC_ROUNDINGS, -traffic): larger wins
    smallest: BackwardPlan  # the last plan tried; the loops run at least once
    n_chunks = 1
    while n_chunks == 1 or -(-n // n_chunks) >= MIN_CHUNK_ROWS:
        slab = widest
        while True:
            plan = BackwardPlan(n_chunks, slab, fp32_acc)
            smallest = plan
            if plan.scratch_bytes(n, d, element_bytes, tile.block_m) <= budget:
                traffic = 8 / slab + 2 * element_bytes / plan.rows_per_chunk(n)
                preference = (n_chunks <= MAX_DC_ROUNDINGS, -traffic)
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
    slab_slots = plan.chunk_rows(n, tile.block_m) // tile.block_m * -(-plan.slab_v // tile.block_n)
    return replace(plan, slots=max(slab_slots, min(MAX_SLOTS, room_slots)))
