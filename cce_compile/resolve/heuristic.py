"""The last rung of the ladder: a sound config with no measurement behind it."""

from __future__ import annotations

from ..config.kernel_config import KernelConfig, TileConfig
from ..config.keys import ProblemKey

HEURISTIC_EXACT_SLAB_V = 16384
"""Exact mode's slab cap where nothing was tuned: wide enough that plan/backward.py's traffic model
picks the plan within the scratch budget. Back to back at the H200's 700 W limit the plan with
the least dE-accumulator and dC traffic won or tied on every shape tried (ab_switch.py --plans;
docs/notes/unbundled-heads.md): Gemma-2 2 x 8192 against the 4096 cap's 2 x 4096 4.34
against 4.41 x GEMM, and at N = 16384 4 x 8192 against 4 x 4096 4.37 against 4.49; Llama-3 at
N = 16384 8 x 16384 against 4 x 4096 4.40 against 4.49 (and its tuned N = 8192 config took
16384); 4096 x 8192 x 128256 level; Qwen2.5's plan is the same under either cap."""


HEURISTIC_LOGITS_GROUP_M = 16
"""The logits kernels' grouping where nothing was tuned. A group of group_m row blocks reads C
once, so at large N a small group re-reads C from HBM many times. Alternated at N = 16384 (no
tuned config; docs/notes/group-m-at-power-limit.md), forward 8 -> 16 -> 32:
Llama-3 30.47 -> 28.66 -> 28.73 ms, Gemma-2 34.15 -> 32.42 -> 32.25 ms (1.22 -> 1.14-1.16 x
GEMM, as tuned N = 8192 runs); the tuned H200 configs took 16 as well."""


def heuristic_config(key: ProblemKey) -> KernelConfig:
    """A sound config with no measurement behind it: the last rung of the ladder."""
    if key.device != "cuda":
        # Interpreter and CPU: few, large programs are what is cheap there.
        tile = TileConfig(block_m=32, block_n=32, block_k=32, group_m=4, num_warps=4, num_stages=1)
        return KernelConfig(tile, tile, tile, tile, slab_v=1024, vocab_splits=4)
    # Measured on an H200 (bf16; docs/notes/tuning-h200.md): 128 x 256 logits tiles, 4 stages.
    wide = key.dtype != "float32"
    gemm = TileConfig(128, 128, 64 if wide else 32, 8, 8, 3)
    logits = TileConfig(128, 256, 64, HEURISTIC_LOGITS_GROUP_M, 8, 4) if wide else gemm
    grad_hidden = gemm
    if key.mode == "filtered" and wide:
        # The block-sparse dE GEMM reads each kept d-logits tile once per block_n columns of
        # dE: 256 wide where D is large (a tile sweep: 0.07-0.17 x GEMM of fwd+bwd), 128 wide
        # with 4 warps where it is small (Qwen2.5's D = 896 at filtered mode's 25% scratch: 2.48
        # against 2.62 x for 64 wide; docs/notes/version-log.md, the sweeps of filtered tiles).
        grad_hidden = TileConfig(128, 256, 64, 8, 8, 4) if key.d >= 2048 else TileConfig(128, 128, 64, 8, 4, 4)
    return KernelConfig(
        forward=logits,
        grad_logits=logits,
        grad_classifier=gemm,
        grad_hidden=grad_hidden,
        slab_v=HEURISTIC_EXACT_SLAB_V if key.mode == "exact" else 4096,
        vocab_splits=_vocab_splits(key.n_bucket, block_m=128),
    )


def _vocab_splits(n_bucket: int, block_m: int, programs_wanted: int = 4 * 132) -> int:
    """Enough vocab splits that the forward has a few waves of programs on an H100/H200."""
    row_blocks = max(1, n_bucket // block_m)
    splits = 1
    while splits * row_blocks < programs_wanted and splits < 64:
        splits *= 2
    return splits


