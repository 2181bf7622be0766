"""What the tuner may try: per kernel, the values each launch parameter can take, pruned to
what fits the GPU (shared memory for the pipelined buffers, accumulator registers), fitted to
the problem (a block wider than the padded dimension it covers is clipped to it), and
deduplicated by what the op actually launches (many slab_v or vocab_splits values end in the
same launches).

The search walks these axes one at a time from the current config (coordinate descent);
the whole grid is only counted, for the plan.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, fields, replace
from typing import Iterator

import torch

from cce_compile.config.kernel_config import KERNELS, ConfigError, KernelConfig, TileConfig
from cce_compile.config.keys import ProblemKey, n_bucket
from cce_compile.ops.problem import descriptor_rows_fit, runs_wgmma, stages_beside_output
from cce_compile.plan import launch
from cce_compile.plan.backward import next_pow2
from cce_compile.plan.policy import Policy, default_policy
from cce_compile.resolve.platform import local_platform

PLANNING_SHARED_MEMORY = 232448
"""Shared memory per block (opt-in) of an H100/H200, for planning on a machine without a GPU."""
MIN_BLOCK = 16
"""The narrowest block of a tile: Triton's dots need 16 rows, columns and steps of K."""
MAX_ACCUMULATOR_REGISTERS = 256
"""fp32 accumulator registers per thread (block_m * block_n / threads) above which a tile spills."""

PIPELINE_AXES: dict[str, tuple[int, ...]] = {"num_stages": (2, 3, 4, 5), "group_m": (4, 8, 16, 32)}
SHAPE_AXES: dict[str, tuple[int, ...]] = {
    "block_n": (64, 128, 256),
    "block_m": (64, 128, 256),
    "block_k": (32, 64, 128),
    "num_warps": (4, 8),
}
"""Tile values to try. A kernel's axes are searched in the order pipeline, config-wide,
shape: on the H200 stages and grouping moved the logits kernels most around the
128x256x64 tiles, and BK=128 and 128x128 tiles were slower."""
FORWARD_AXES: dict[str, tuple[int, ...]] = {"vocab_splits": (1, 2, 4, 8, 16, 32, 64)}
BACKWARD_AXES: dict[str, tuple[int, ...]] = {
    "slab_v": (1024, 2048, 4096, 8192, 16384, 32768), "workspace_rows": (512, 1024, 2048, 4096, 8192),
}
CONFIG_AXES = {"forward": FORWARD_AXES, "grad_logits": BACKWARD_AXES}
"""Config-wide values searched with the kernel they shape: vocab_splits splits the
forward's vocabulary sweep, slab_v sizes the recompute's launches and workspace_rows the fused
forward's (whose tile is grad_logits')."""
TILE_FIELDS = tuple(f.name for f in fields(TileConfig))


@dataclass(frozen=True)
class Problem:
    """One tuning problem: N tokens of hidden size D against a vocabulary of V."""

    n: int
    v: int
    d: int
    dtype: str  # "float32" | "float16" | "bfloat16"
    mode: str  # "exact" | "filtered"

    def key(self, device: str) -> ProblemKey:
        return ProblemKey(device, self.v, self.d, self.dtype, n_bucket(self.n), self.mode)

    @property
    def element_bytes(self) -> int:
        return getattr(torch, self.dtype).itemsize

    def launch_plan(self, device: str, config: KernelConfig, hopper: bool, policy: Policy) -> launch.LaunchPlan:
        """What the op launches for this problem with `config` (plan_launch), on the tuner's
        contiguous inputs with the plain loss."""
        problem = launch.Problem(
            n=self.n, v=self.v, d=self.d, dtype=self.dtype, on_cuda=device == "cuda", hopper=hopper,
            descriptors_fit=descriptor_rows_fit(self.element_bytes, self.d), capturing=False,
        )
        return launch.plan_launch(problem, launch.Options(filtered=self.mode == "filtered"), config, policy)

    def gemm_dims(self, kernel: str) -> tuple[int, int, int]:
        """(M, N, K) of the kernel's output tile and reduction (upper bounds)."""
        return {
            "forward": (self.n, self.v, self.d),
            "grad_logits": (self.n, self.v, self.d),
            "grad_classifier": (self.v, self.d, self.n),  # dC[slab] = d_logits.T @ e
            "grad_hidden": (self.n, self.d, self.v),  # dE += d_logits @ c[slab]
        }[kernel]


@dataclass(frozen=True)
class Limits:
    """What a tile must fit on the target GPU; `hopper`: whether it runs the Gluon kernels."""

    shared_memory_bytes: int
    element_bytes: int
    hopper: bool = False

    def fits(self, tile: TileConfig) -> bool:
        registers = tile.block_m * tile.block_n // (32 * tile.num_warps)
        return (
            tile.shared_memory_bytes(self.element_bytes) <= self.shared_memory_bytes
            and registers <= MAX_ACCUMULATOR_REGISTERS
        )


def untuned_kernels(problem: Problem, device: str, policy: Policy | None = None) -> dict[str, str]:
    """Kernels the tuner leaves at the default, with why: the gradient GEMMs where the op runs
    them in cuBLAS."""
    plan = problem.launch_plan(device, KernelConfig(), hopper=False, policy=policy or default_policy())
    if plan.filtered or plan.gradient_gemms != "cublas":
        return {}
    why = "cuBLAS in bf16/fp32: not timed"
    return {"grad_classifier": why, "grad_hidden": why}


@dataclass(frozen=True)
class KernelSpace:
    """One kernel's axes: TileConfig fields of `kernel`, plus config-wide fields (slab_v,
    vocab_splits) searched with it. The objective is the kernel's stage time: the forward
    alone for `forward`, the backward (forward+backward minus forward) for the others."""

    kernel: str
    axes: dict[str, tuple[int, ...]]
    problem: Problem
    limits: Limits
    policy: Policy = field(default_factory=default_policy)

    def with_value(self, config: KernelConfig, axis: str, value: int) -> KernelConfig | None:
        """`config` with one value changed, or None if that config is invalid or does not fit
        (the GPU, or the memory plan: the fused forward's chunk never grows past its budget)."""
        if axis == "workspace_rows" and value > self.workspace_budget:
            return None
        try:
            if axis in TILE_FIELDS:
                tile = self.clipped(replace(getattr(config, self.kernel), **{axis: value}))
                return replace(config, **{self.kernel: tile}) if self.admits(tile) else None
            return replace(config, **{axis: value})
        except ConfigError:
            return None

    def clipped(self, tile: TileConfig) -> TileConfig:
        """`tile` with every block no wider than the dimension it covers, padded to a power of
        two and to MIN_BLOCK. Where a problem is smaller than the axes' values (V, D or N below
        32), the clipped tiles are its candidates: unclipped, none is admitted, and neither is a
        step from a start tile wider than the problem (the heuristic's), so the search had
        nothing to try."""
        m, n, k = (max(MIN_BLOCK, next_pow2(dim)) for dim in self.problem.gemm_dims(self.kernel))
        return replace(tile, block_m=min(tile.block_m, m), block_n=min(tile.block_n, n), block_k=min(tile.block_k, k))

    def admits(self, tile: TileConfig) -> bool:
        """Fits the GPU, and no block is wider than the padded dimension it covers."""
        return self.limits.fits(tile) and tile == self.clipped(tile)

    def along(self, config: KernelConfig, axis: str) -> Iterator[KernelConfig]:
        """The admitted configs that differ from `config` in `axis` alone (and in its tile's
        blocks clipped to the problem) and launch differently from it and from each other."""
        seen = {self.launches(config)}
        for value in self.axes[axis]:
            candidate = self.with_value(config, axis, value)
            if candidate is not None and self.launches(candidate) not in seen:
                seen.add(self.launches(candidate))
                yield candidate

    def launches(self, config: KernelConfig) -> tuple[object, ...]:
        """What this kernel's launches depend on, by the op's launch plan: its tile (with the
        stages it launches with; none where a Gluon kernel runs its own) and the effective
        vocab split (the pointer forward) or backward plan (grad_logits)."""
        tile = getattr(config, self.kernel)
        p = self.problem
        plan = p.launch_plan("cuda", config, self.limits.hopper, self.policy)
        if self.kernel == "forward":
            if plan.forward == "gluon":
                return (None,)
            if plan.forward == "tma":
                return (tile,)
            vocab_tiles = -(-p.v // tile.block_n)
            return (tile, -(-vocab_tiles // min(config.vocab_splits, vocab_tiles)))
        if self.kernel == "grad_logits" and self.fused:
            if plan.fused == "gluon":
                return (None, plan.workspace_rows)
            if plan.fused == "tma":  # its output tile is staged in shared memory, as the recompute's
                tile = replace(tile, num_stages=stages_beside_output(tile, p.element_bytes,
                                                                      self.limits.shared_memory_bytes))
            return (tile, plan.workspace_rows)
        if self.kernel == "grad_logits":
            steps = plan.backward
            if plan.recompute == "gluon" and not plan.filtered:  # the d-logits buffer keeps the config's rows
                return (steps, steps.chunk_rows(p.n, config.grad_logits.block_m))
            if plan.recompute == "tma" and not plan.filtered:
                tile = replace(tile, num_stages=stages_beside_output(tile, p.element_bytes,
                                                                      self.limits.shared_memory_bytes))
            return (tile, steps)
        return (tile,)

    @property
    def workspace_budget(self) -> int:
        """The fused forward's token chunk where the memory plan alone sizes it."""
        p = self.problem
        return launch.workspace_rows(p.n, p.v, p.d, p.element_bytes, KernelConfig(), self.policy)

    @property
    def fused(self) -> bool:
        """Whether the timed calls (a mean loss with gradients) take the fused forward."""
        options = launch.Options(filtered=self.problem.mode == "filtered")
        return launch.gradients_in_forward(options, self.problem.dtype, "mean", "workspace", has_z_loss=False)

    def size(self, start: KernelConfig) -> int:
        """How many distinct launches the whole space holds (for the plan): every axis
        with `start`'s own value added."""
        start_tile = getattr(start, self.kernel)
        tile_values = [{*self.axes.get(name, ()), getattr(start_tile, name)} for name in TILE_FIELDS]
        tiles = {self.clipped(TileConfig(**dict(zip(TILE_FIELDS, values)))) for values in itertools.product(*tile_values)}
        # The start's own tile is what the op launches (the heuristic's 128-row tile at N = 16): the
        # other axes are searched with it (along) whether or not a tile that wide is admitted.
        admitted = [tile for tile in {start_tile, *tiles} if tile == start_tile or self.admits(tile)]
        extra = [name for name in self.axes if name not in TILE_FIELDS]
        return len({
            self.launches(replace(start, **{self.kernel: tile}, **dict(zip(extra, values))))
            for tile in admitted
            for values in itertools.product(*({*self.axes[name], getattr(start, name)} for name in extra))
        })

    def first_pass(self, start: KernelConfig) -> int:
        """How many configs one sweep of every axis from `start` tries (at most)."""
        return sum(len(list(self.along(start, axis))) for axis in self.axes)


def kernel_spaces(problem: Problem, device: str, limits: Limits) -> list[KernelSpace]:
    """The search spaces of the kernels a call on `device` launches with Triton."""
    skipped = untuned_kernels(problem, device)
    return [
        KernelSpace(kernel, {**PIPELINE_AXES, **CONFIG_AXES.get(kernel, {}), **SHAPE_AXES}, problem, limits)
        for kernel in KERNELS
        if kernel not in skipped
    ]


def device_limits(problem: Problem) -> Limits:
    """This GPU's opt-in shared memory per block (the H100/H200 value off the GPU) and whether
    it is a Hopper."""
    if not torch.cuda.is_available():
        return Limits(PLANNING_SHARED_MEMORY, problem.element_bytes)
    shared = local_platform("cuda").shared_memory_bytes
    return Limits(shared, problem.element_bytes, hopper=runs_wgmma(torch.device("cuda", torch.cuda.current_device())))
