"""Which KernelConfig the op launches with, decided before launch (at trace time under
torch.compile, on the first eager call for a key otherwise)."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Iterator

from .kernel_config import KernelConfig, TileConfig


@dataclass(frozen=True)
class ProblemKey:
    """What a best config depends on; the key of every cache and of the tuning database."""

    device: str  # "cuda" / "cpu" / "interpreter"
    v: int
    d: int
    dtype: str  # "float32" | "float16" | "bfloat16"
    n_bucket: int
    mode: str  # "exact" | "filtered"


_local = threading.local()


@contextlib.contextmanager
def override_config(config: KernelConfig) -> Iterator[None]:
    """Launch every op call in this block (on this thread) with `config`: what the tuner
    and the tests use to try a candidate."""
    config.validate()
    previous = getattr(_local, "override", None)
    _local.override = config
    try:
        yield
    finally:
        _local.override = previous


def heuristic_config(key: ProblemKey) -> KernelConfig:
    """A sound config with no measurement behind it: the last rung of the ladder."""
    if key.device != "cuda":
        # Interpreter and CPU: few, large programs are what is cheap there.
        tile = TileConfig(block_m=32, block_n=32, block_k=32, group_m=4, num_warps=4, num_stages=1)
        return KernelConfig(tile, tile, tile, tile, slab_v=1024, vocab_splits=4)
    wide = key.dtype != "float32"
    gemm = TileConfig(128, 128, 64 if wide else 32, 8, 8, 3)
    return KernelConfig(
        forward=TileConfig(128, 128, 64 if wide else 32, 8, 8, 3),
        grad_logits=TileConfig(128, 128, 64 if wide else 32, 8, 8, 3),
        grad_classifier=gemm,
        grad_hidden=gemm,
        slab_v=4096,
        vocab_splits=_vocab_splits(key.n_bucket, block_m=128),
    )


def _vocab_splits(n_bucket: int, block_m: int, programs_wanted: int = 4 * 132) -> int:
    """Enough vocab splits that the forward has a few waves of programs on an H100/H200."""
    row_blocks = max(1, n_bucket // block_m)
    splits = 1
    while splits * row_blocks < programs_wanted and splits < 64:
        splits *= 2
    return splits


def resolve_config(key: ProblemKey) -> KernelConfig:
    """The config for `key`: an active override, else the heuristic."""
    override = getattr(_local, "override", None)
    if override is not None:
        return override
    return heuristic_config(key)
