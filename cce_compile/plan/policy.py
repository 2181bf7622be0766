"""Every threshold that picks a kernel or sizes a plan, in one frozen Policy.

The op reads the active policy (`active_policy()`) when it runs eagerly, or where
torch.compile traces it, never module constants; tests and A/B scripts run a block under
another one with `override_policy(Policy(...))`. The reasons below
are the measurements behind each default (the investigations: docs/notes/).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Iterator, Literal, get_args

from ..config.kernel_config import TileConfig

if TYPE_CHECKING:
    from .backward import BackwardPlan

GemmBackend = Literal["cublas", "triton"]


@dataclass(frozen=True)
class Policy:
    """Kernel-choice thresholds and memory budgets (defaults measured on the H200)."""

    triton_on_cpu: bool = False
    """CPU tensors run the Triton kernels under the interpreter (TRITON_INTERPRET=1 at import), else the PyTorch path."""

    forward_gluon_max_k_steps: int = 16
    """The plain forward runs the Gluon kernel up to this many K steps (D <= 1024): it won at D = 896, lost from 1536 up."""

    forward_gluon_with_entropy: bool = False
    """linear_log_probs' entropy on the Gluon forward (its entropy statistic): as accurate as the tensor-descriptor
    forward against float64, but the Qwen2.5 no-grad pass read 1.14-1.21 against 1.15-1.24 x GEMM, level within the
    runs' spread (docs/notes/log_probs.md)."""

    recompute_gluon_max_k_steps: int = 64
    """The plain recompute runs the Gluon kernel up to this many K steps (D <= 4096): it won to 4096, lost at 5120 and 8192."""

    recompute_tma_min_k_steps: int = 32
    """Other recomputes run persistent on tensor descriptors from this many K steps: each tile restarts the K pipeline."""

    forward_chunk_rows: int = 2048
    """The persistent forwards launch per this many rows: one grid over large N lets its programs drift and thrash L2."""

    gluon_tile: TileConfig = field(default_factory=lambda: TileConfig(128, 128, 64, 16, 4, 3))
    """The Gluon kernels' tile: 128 x 128, group 16, 3 stages beat group 8 / 32 and one program per SM at D = 896."""

    gluon_programs_per_sm: int = 2
    """Two Gluon programs per SM, so one's MMAs overlap the other's softmax."""

    gemm_backend: GemmBackend = "cublas"
    """The exact backward's gradient GEMMs on CUDA: cuBLAS; fp16 takes Triton (its d-logits are scaled)."""

    cuda_graphs: bool = True
    """Calls that recur on the same tensors replay the backward's slab loop or the fused forward's chunk loop as one CUDA
    graph (CCE_CUDA_GRAPHS=0: off)."""

    filtered_read_back: bool = True
    """Filtered steps read back to the host (one sync), each launched at its size; off: as under a caller's
    CUDA graph capture, every step packing may make, its programs striding over any step."""

    filtered_strided_programs_per_sm: int = 2
    """Steps only the device knows: this many recompute and dC programs per SM stride over each step's slots and
    columns, so an empty step costs a launch of a few hundred programs, not one per slot (2048) or per column and
    column block (18000 on Gemma-2). Two dC programs fit an SM at 3 stages (the bundled Gemma-2 and Qwen2.5 tiles),
    one at 5, one recompute: the rest queue."""

    dense_fraction: float = 0.4
    """A filtered backward that keeps more than this share of tiles runs the dense path: block-sparse costs ~0.4 + 7 x share GEMMs."""

    scratch_fraction: float = 0.10
    """Exact mode's backward scratch, as a share of the gradients' bytes: the memory target."""

    other_buffers_fraction: float = 0.002
    """What the op holds beside the scratch at the backward's peak, kept out of scratch_fraction."""

    loss_row_buffers: int = 6
    """Exact mode's recompute holds this many fp32 vectors per token beside the backward's scratch (lse, the upstream
    gradients autograd hands it, three coefficients; a memory trace at 20000 x 896 x 151936 on the H200): at 20000
    tokens 0.16% of the gradients, which took that shape's peak to 1.1003 x within other_buffers_fraction alone."""

    entropy_row_buffers: int = 4
    """linear_log_probs with entropy holds this many more fp32 vectors per token than the loss beside the backward's
    scratch (the entropies, the rows' lse less mean logit the backward reads, upstream gradient and coefficient):
    0.3% of the gradients at 20000 x 896 x 151936, past other_buffers_fraction."""

    filtered_scratch_fraction: float = 0.25
    """Filtered mode's scratch: more slots make fewer, fuller steps (Qwen2.5 2.84 -> 2.45 x GEMM from 256 to 1024)."""

    max_slots: int = 2048
    """Filtered steps hold at most this many kept tiles: doubling further gained under 1.5%."""

    scratch_floor_bytes: int = 24 * 2**20
    """Scratch always allowed: 10% of a small head cuts the backward into ~100 launch-bound steps."""

    min_chunk_rows: int = 256
    """The fewest rows a token chunk of the backward takes."""

    max_dc_roundings: int = 16
    """Token chunks at most where the budget allows: dC sums over chunks in its own dtype, 4.2e-3 error at 16."""

    workspace_fraction: float = 0.96
    """The fused forward's workspace (token chunk x V) with its per-row buffers, as a share of the gradients it
    computes: a call peaks at about 1 + this share of the gradients (the rows come in 128s, so most shapes take
    less), under 2x with a margin for the allocator; only where one 128-row chunk alone exceeds it (D below ~130 at
    these vocabularies) does it peak higher. Fewer chunks mean fewer read-modify-write passes over dC and fewer
    bf16 roundings of it. From 0.9 (alternating A/B on the H200, fwd+bwd ms eager / compiled): Qwen2.5's shape
    takes 19 chunks, not 22 (dC 5.1e-3 -> 4.8e-3, 24.52 / 24.53 -> 24.54 / 24.63, peak 1.82 -> 1.95), Gemma-2's 4,
    not 5 (46.79 / 46.89 -> 46.49 / 46.91, peak 1.74 -> 1.91): accuracy gained, speed level."""

    fused_side_stream_grad_e: bool = True
    """The fused forward runs each chunk's dE GEMM on a second stream beside its dC GEMM: dE's output (chunk rows x D)
    is a few tiles split over K, dC streams V x D through memory, so one fills what the other leaves. Alternating
    A/B on the H200, fwd+bwd x GEMM off / on: Qwen2.5 3.56 / 3.47, Gemma-2 3.32 / 3.28, Llama-3.2 1B 3.27 / 3.20,
    Llama-3 3.14 / 3.15. Costs a second cuBLAS workspace (32 MiB per thread that runs the fused forward)."""

    fused_shift_stride: int = 16
    """The fused forward shifts each row by its mean logit over every n-th vocabulary row: a sample's mean logit is
    still at most the row's largest, which is all the shift needs (rows whose lse runs too far above it are redone).
    Averaging all of c read it whole once a call, on an H100 0.66 ms (0.06 x GEMM) at D = 8192, 0.43 ms at
    Mistral-Nemo's head (profile_kernels.py, docs/notes/fused-forward.md)."""

    fused_gluon_max_k_steps: int = 16
    """The fused forward runs the Gluon kernel for the plain loss up to this many K steps (D <= 1024), the persistent
    128 x 256 TMA kernel beyond. Alternating A/Bs, TMA against Gluon: on an H100, 9-10% faster at D = 2304, 2560 and
    3072, 3% at 2048; on the H200, Llama-3 (D = 4096) 3.17 against 3.26-3.33 x GEMM, D = 2048 0.7% faster, Gemma-2
    (D = 2304) 0.9% slower (docs/notes/fused-forward.md)."""

    compile_ahead: bool = True
    """The fused forward's first call of a kind compiles its kernels side by side on threads before its first launch,
    not one after another as it reaches them (ops/launch.py): the first fwd+bwd call in a fresh process on the H200,
    Gemma-2, Llama-3 and Qwen2.5 heads, two runs each, read 10.6 s one after another against 8.4 s ahead (mean; the
    launchers' builds still on the caller's thread then), the calls after it unchanged."""

    backward_plan: BackwardPlan | None = None
    """One backward plan for every call, for A/B runs and tests; None: plan_backward sizes each call's."""

    def __post_init__(self) -> None:
        """Each field checked by kind: a value of the wrong kind once failed far from here or not
        at all (min_chunk_rows=0 planned forever, cuda_graphs="no" read as true, gemm_backend
        "cuBLAS" ran Triton's GEMMs, a launch of 0 programs left its outputs unwritten), and
        ab_switch.py takes values as text."""
        for name in _FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Policy.{name}: expected True or False, got {getattr(self, name)!r}")
        for name, least in _COUNTS.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"Policy.{name}: expected an integer >= {least}, got {value!r}")
        for name in _FRACTIONS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < math.inf:
                raise ValueError(f"Policy.{name}: expected a finite number >= 0, got {value!r}")
        if self.scratch_fraction <= 0 or self.workspace_fraction <= 0 or self.filtered_scratch_fraction <= 0:
            raise ValueError("Policy: scratch_fraction, workspace_fraction and filtered_scratch_fraction must be > 0")
        if self.gemm_backend not in get_args(GemmBackend):
            raise ValueError(f"Policy.gemm_backend: expected one of {get_args(GemmBackend)}, got {self.gemm_backend!r}")


_FLAGS = ("triton_on_cpu", "forward_gluon_with_entropy", "cuda_graphs", "filtered_read_back",
          "fused_side_stream_grad_e", "compile_ahead")
_COUNTS = {
    "forward_gluon_max_k_steps": 0, "recompute_gluon_max_k_steps": 0, "recompute_tma_min_k_steps": 0,
    "fused_gluon_max_k_steps": 0, "fused_shift_stride": 1, "loss_row_buffers": 0, "entropy_row_buffers": 0, "scratch_floor_bytes": 0,
    "forward_chunk_rows": 1, "gluon_programs_per_sm": 1, "filtered_strided_programs_per_sm": 1, "max_slots": 1,
    "min_chunk_rows": 1, "max_dc_roundings": 1,
}
"""Integer fields and their least value (0 turns a kernel's range off; a count of rows or programs needs 1)."""
_FRACTIONS = ("dense_fraction", "scratch_fraction", "other_buffers_fraction", "filtered_scratch_fraction",
              "workspace_fraction")
"""Fractional fields: finite, not negative (the three budgets also > 0, checked above)."""


_local = threading.local()


def default_policy() -> Policy:
    """The defaults as the environment sets them: TRITON_INTERPRET=1 (read by Triton when the
    kernels are decorated) runs CPU calls on the kernels, CCE_CUDA_GRAPHS=0 turns the graphs off."""
    return _from_env(os.environ.get("TRITON_INTERPRET") == "1", os.environ.get("CCE_CUDA_GRAPHS", "1") != "0")


@lru_cache(maxsize=4)
def _from_env(triton_on_cpu: bool, cuda_graphs: bool) -> Policy:
    return Policy(triton_on_cpu=triton_on_cpu, cuda_graphs=cuda_graphs)


def active_policy() -> Policy:
    """The policy this thread's op calls run under."""
    policy = getattr(_local, "policy", None)
    return default_policy() if policy is None else policy


@contextlib.contextmanager
def override_policy(policy: Policy) -> Iterator[None]:
    """Run every op call in this block (on this thread) under `policy`; the op's autograd
    carries it to the backward, which autograd may run on another thread. A call that
    torch.compile traced earlier keeps the policy it was traced under (ops/problem.traced_settings)."""
    previous = getattr(_local, "policy", None)
    _local.policy = policy
    try:
        yield
    finally:
        _local.policy = previous


@lru_cache(maxsize=64)
def policy_to_json(policy: Policy) -> str:
    """The policy as JSON, part of an op call's settings (ops/problem.encode_settings; cached:
    every call encodes one)."""
    return json.dumps(asdict(policy), sort_keys=True)


@lru_cache(maxsize=64)
def policy_from_json(text: str) -> Policy:
    from .backward import BackwardPlan

    values = json.loads(text)
    plan = values["backward_plan"]
    return Policy(**{**values, "gluon_tile": TileConfig(**values["gluon_tile"]),
                     "backward_plan": None if plan is None else BackwardPlan(**plan)})
