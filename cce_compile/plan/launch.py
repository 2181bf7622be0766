"""Which kernels an op call launches: `plan_launch`, one pure function of explicit inputs.

Read `plan_launch` to name the kernels of any call. The op reads a `Problem` off its tensors
(ops/problem.py), resolves a `KernelConfig` (cce_compile.resolve) and takes the active
`Policy`; the tuner and the benchmarks call plan_launch the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..config.kernel_config import KernelConfig, TileConfig
from .backward import BackwardPlan, plan_backward
from .policy import Policy

SMALL_POOL_BYTES = 1 << 20
"""The CUDA caching allocator's small pool: blocks of at most this many bytes (ops/graphs.py)."""
STAGED_ROW_BUFFERS = 7
"""fp32 vectors per token that a graphed slab loop's staged copies hold beside the originals (ops/backward_dense.STAGED:
targets as two, lse, three coefficients, the entropy's), in a block of more than SMALL_POOL_BYTES."""

ForwardKernel = Literal["gluon", "tma", "split", "cpu"]
"""lse_forward_ws_kernel (Gluon, warp-specialized), lse_forward_tma_kernel (persistent, tensor
descriptors), lse_forward_kernel (pointers, vocab splits), or the plain-PyTorch path."""

RecomputeKernel = Literal["gluon", "tma", "pointer", "cpu"]
"""The dense backward's recompute: grad_logits_ws_kernel, grad_logits_tma_kernel,
grad_logits_kernel, or the plain-PyTorch path."""

GradientGemms = Literal["cublas", "triton", "cpu"]
"""The dense backward's dE and dC GEMMs: torch.mm (cuBLAS), matmul_kernel, or the CPU path."""

FusedKernel = Literal["gluon", "tma", "pointer", "cpu"]
"""The fused forward (gradients in the forward): fused_forward_ws_kernel (Gluon),
fused_forward_tma_kernel, fused_forward_kernel, or the plain-PyTorch path."""

Memory = Literal["workspace", "low"]
"""What a call may hold: a workspace of token chunk x V for a forward that computes the
gradients too (three GEMMs of work in all, at most ~2x the gradients), or "low": the forward
keeps only the log-sum-exps and the backward recomputes the logits (four GEMMs, ~1.1x)."""


@dataclass(frozen=True)
class Problem:
    """What the tensors of a call say about where and how it can run."""

    n: int  # tokens (a SymInt while torch.compile traces a dynamic N)
    v: int
    d: int
    dtype: str  # "float32" | "float16" | "bfloat16"
    on_cuda: bool
    hopper: bool  # sm_90: the Gluon kernels' wgmma
    descriptors_fit: bool  # e and c suit tensor descriptors (16-bit, aligned rows, real tensors)
    capturing: bool  # the current stream is capturing a CUDA graph (someone else's)

    @property
    def element_bytes(self) -> int:
        return 4 if self.dtype == "float32" else 2


@dataclass(frozen=True)
class Options:
    """The loss options that change which kernels can run, or what they are compiled with."""

    has_bias: bool = False
    has_weight: bool = False
    has_softcap: bool = False
    has_smoothing: bool = False
    filtered: bool = False
    has_entropy: bool = False  # linear_log_probs' entropy: its sums about the row max, and its term in d-logits
    entropy_backward: bool = False  # and the entropy's backward will run: the forward gives lse less the mean logit
    logit_scale: float = 1.0  # 1 / temperature: multiplies the logits (before the soft-cap)

    @property
    def plain_logits(self) -> bool:
        """The logits and terms the Gluon forward and recompute compute: no bias, class weights,
        soft-cap or smoothing (entropy they do: the forward where the policy lets it)."""
        return not (self.has_bias or self.has_weight or self.has_softcap or self.has_smoothing)

    @property
    def plain(self) -> bool:
        """The loss the Gluon fused forward computes: plain logits and no entropy."""
        return self.plain_logits and not self.has_entropy


@dataclass(frozen=True)
class LaunchPlan:
    """The kernels a call launches and how; `backward` is None on the plain-PyTorch path.

    Filtered mode's backward runs grad_logits_kernel over kept tiles and sparse_matmul_kernel,
    in steps packed from the kept tiles on the device. With `read_back_steps` the host reads
    them back (one sync), launches each at its size and, where more than `dense_fraction` of
    tiles are kept, runs the dense path instead; under someone else's CUDA graph capture
    (torch.compile's reduce-overhead) no sync may run, so it launches the most steps packing
    can make, their recompute and dC programs striding over any step's slots and columns (an
    empty one writes nothing)."""

    forward: ForwardKernel
    fused: FusedKernel
    logit_scale: float  # 1 / temperature: the logits kernels' compile-time LOGIT_SCALE (Options.logit_scale)
    recompute: RecomputeKernel
    gradient_gemms: GradientGemms
    filtered: bool
    read_back_steps: bool
    cuda_graphs: bool  # the dense slab loop and the fused chunk loop replay as a CUDA graph once a call recurs
    direct_launch: bool  # compiled kernels relaunched without Triton's per-launch binding (CUDA)
    compile_ahead: bool  # the fused forward's first call compiles its kernels on threads before launching (CUDA)
    forward_chunk_rows: int
    workspace_rows: int  # the fused forward's token chunk
    grad_e_side_stream: bool  # the fused forward's dE GEMMs on a second stream beside dC's (not in a caller's capture)
    shift_stride: int  # the fused forward's shift averages every shift_stride-th row of c
    gluon_tile: TileConfig
    gluon_programs_per_sm: int
    strided_programs_per_sm: int  # filtered steps only the device knows: programs striding over them
    dense_fraction: float
    backward: BackwardPlan | None


def k_steps(d: int, block_k: int) -> int:
    return -(-d // block_k)


def runs_triton(problem: Problem, policy: Policy) -> bool:
    """Triton on CUDA; CPU tensors under the interpreter where the policy says so."""
    return problem.on_cuda or policy.triton_on_cpu


def forward_kernel(problem: Problem, options: Options, policy: Policy) -> ForwardKernel:
    if not runs_triton(problem, policy):
        return "cpu"
    # The Gluon forward's entropy has no lse less the mean logit, which the entropy's backward reads.
    supported = options.plain or (options.plain_logits and policy.forward_gluon_with_entropy
                                  and not options.entropy_backward)
    if not options.filtered and gluon_fits(problem, supported, policy, policy.forward_gluon_max_k_steps):
        return "gluon"
    return "tma" if problem.descriptors_fit else "split"


def gradients_in_forward(options: Options, dtype: str, reduction: str, memory: Memory, has_z_loss: bool,
                         in_transform: bool = False) -> bool:
    """Whether a call that needs gradients takes the fused forward: a scalar loss (its
    upstream gradient is one number, so the forward can finish the gradients and the
    backward scale them), exact mode, and a workspace the dtype can hold. fp16's range cannot
    hold the workspace's exponentials (exp(logit - mean logit) passes 65504 at a gap of 11),
    soft-capping's derivative does not factor out of label smoothing's term, and a class-
    weighted mean with z-loss divides its two terms by different totals (the weights', the
    tokens' count) where the fused forward scales a token's whole loss by one. Inside a
    torch.func transform (vmap) a batched operand reports requires_grad False while autograd
    still wants its gradient, and the fused forward computes only the gradients the flags ask
    for: the recompute, which takes them from autograd in the backward, runs there."""
    return (memory == "workspace" and reduction != "none" and not options.filtered and dtype != "float16"
            and not in_transform
            and not (options.has_softcap and options.has_smoothing)
            and not (reduction == "mean" and options.has_weight and has_z_loss))


def gluon_fits(problem: Problem, supported: bool, policy: Policy, max_k_steps: int) -> bool:
    """Whether a warp-specialized Gluon kernel runs: options it `supported`, a Hopper GPU,
    operands on tensor descriptors, and at most `max_k_steps` K steps of the Gluon tile."""
    return (supported and problem.on_cuda and problem.hopper and problem.descriptors_fit
            and k_steps(problem.d, policy.gluon_tile.block_k) <= max_k_steps)


def fused_kernel(problem: Problem, options: Options, policy: Policy) -> FusedKernel:
    if not runs_triton(problem, policy):
        return "cpu"
    if gluon_fits(problem, options.plain, policy, policy.fused_gluon_max_k_steps):
        return "gluon"
    return "tma" if problem.descriptors_fit else "pointer"


def workspace_rows(n: int, v: int, d: int, element_bytes: int, config: KernelConfig, policy: Policy) -> int:
    """The fused forward's token chunk: config.workspace_rows where tuned, else as many rows
    (in 128s) as fit policy.workspace_fraction of the gradients beside their per-row buffers
    (a chunk's fp32 dE, its scaled e rows and the statistics), then evened out over the chunks
    that takes (N = 8192 in 3 chunks of 2816 rows, not 3200 + 3200 + 1792)."""
    n = max(n, 1)
    if config.workspace_rows:
        return min(config.workspace_rows, -(-n // 128) * 128)
    grad_bytes = (n * d + v * d + v) * element_bytes
    per_row = v * element_bytes + d * (4 + element_bytes) + 3 * 4 * -(-v // 128)
    rows = max(128, int(policy.workspace_fraction * grad_bytes) // per_row // 128 * 128)
    chunks = -(-n // rows)
    rows_per_chunk = -(-n // chunks)
    return -(-rows_per_chunk // 128) * 128


def recompute_kernel(problem: Problem, options: Options, config: KernelConfig, policy: Policy) -> RecomputeKernel:
    if not runs_triton(problem, policy):
        return "cpu"
    if gluon_fits(problem, options.plain_logits, policy, policy.recompute_gluon_max_k_steps):
        return "gluon"
    long_k = k_steps(problem.d, config.grad_logits.block_k) >= policy.recompute_tma_min_k_steps
    return "tma" if long_k and problem.descriptors_fit else "pointer"


def gradient_gemms(problem: Problem, policy: Policy) -> GradientGemms:
    """cuBLAS on CUDA for bf16 and fp32; fp16's d-logits are scaled, which only the Triton
    GEMMs undo."""
    if not runs_triton(problem, policy):
        return "cpu"
    cublas = problem.on_cuda and problem.dtype != "float16" and policy.gemm_backend == "cublas"
    return "cublas" if cublas else "triton"


def plan_launch(problem: Problem, options: Options, config: KernelConfig, policy: Policy) -> LaunchPlan:
    """The launch of one call (forward and backward alike: both ops plan the same)."""
    triton = runs_triton(problem, policy)
    cuda_graphs = policy.cuda_graphs and problem.on_cuda and not problem.capturing
    return LaunchPlan(
        forward=forward_kernel(problem, options, policy),
        fused=fused_kernel(problem, options, policy),
        logit_scale=options.logit_scale,
        recompute=recompute_kernel(problem, options, config, policy),
        gradient_gemms=gradient_gemms(problem, policy),
        filtered=options.filtered,
        read_back_steps=options.filtered and policy.filtered_read_back and not problem.capturing,
        cuda_graphs=cuda_graphs,
        direct_launch=problem.on_cuda,
        compile_ahead=policy.compile_ahead and problem.on_cuda,
        forward_chunk_rows=policy.forward_chunk_rows,
        workspace_rows=workspace_rows(problem.n, problem.v, problem.d, problem.element_bytes, config, policy),
        grad_e_side_stream=policy.fused_side_stream_grad_e and problem.on_cuda and not problem.capturing,
        shift_stride=policy.fused_shift_stride,
        gluon_tile=policy.gluon_tile,
        gluon_programs_per_sm=policy.gluon_programs_per_sm,
        strided_programs_per_sm=policy.filtered_strided_programs_per_sm,
        dense_fraction=policy.dense_fraction,
        backward=(policy.backward_plan or plan_backward(
            problem.n, problem.v, problem.d, problem.element_bytes, config, options.filtered, policy,
            row_buffers=(0 if options.filtered else policy.loss_row_buffers)
            + (policy.entropy_row_buffers if options.has_entropy else 0) + (STAGED_ROW_BUFFERS if cuda_graphs else 0),
            # staged copies of the small tensors (a bias's among them), and dbias's fp32 sum
            held_bytes=((2 if options.has_bias else 1) * SMALL_POOL_BYTES if cuda_graphs else 0)
            + (4 * problem.v if options.has_bias else 0),
        )) if triton else None,
    )
