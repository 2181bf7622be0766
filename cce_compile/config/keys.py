"""What a tuned config is keyed on, shared by the op, the tuning database and the service.

Standard library only: the service and the database import this without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

KERNEL_NAME = "cce"
"""The `kernel` field of the tuning database for this op."""

MatchLevel = Literal["exact", "nearest_bucket", "stale_triton", "same_arch", "none"]
"""How closely a stored config matches a query (the tuning database's answer)."""
MATCH_LEVELS: tuple[MatchLevel, ...] = get_args(MatchLevel)
"""The match levels, best first."""


KEY_DTYPES = ("float32", "float16", "bfloat16")
KEY_MODES = ("exact", "filtered")


@dataclass(frozen=True)
class ProblemKey:
    """What a best config depends on; the key of every cache and of the tuning database."""

    device: str  # "cuda" / "cpu" / "interpreter"
    v: int
    d: int
    dtype: str  # one of KEY_DTYPES
    n_bucket: int
    mode: str  # one of KEY_MODES


def n_bucket(n) -> int:
    """Smallest power of two >= n (n may be a SymInt: each comparison is a range guard)."""
    bucket = 1
    while bucket < n:
        bucket *= 2
    return bucket


def normalize_gpu_name(name: str) -> str:
    """One spelling per GPU model: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return "-".join(name.lower().replace("_", " ").split())
