"""The benchmark's problem shapes (torch-free, so the results' renderer names them without torch)."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    name: str
    n: int
    d: int
    v: int

    @property
    def label(self) -> str:
        return f"{self.n} x {self.d} x {self.v} ({self.name})"

    @property
    def spec(self) -> str:
        """NxDxV, as the results CSV writes it."""
        return f"{self.n}x{self.d}x{self.v}"


SHAPES = {
    shape.name: shape
    for shape in (
        Shape("gemma2-2b", 8192, 2304, 256000),
        Shape("llama3-8b", 8192, 4096, 128256),
        Shape("qwen2.5-0.5b", 16384, 896, 151936),
        Shape("large-d", 4096, 8192, 128256),
        Shape("llama3.2-1b", 8192, 2048, 128256),
        Shape("mistral-nemo", 8192, 5120, 131072),
    )
}
QUICK_SHAPES = {
    shape.name: shape
    for shape in (Shape("quick-aligned", 1024, 512, 32768), Shape("quick-odd", 1000, 300, 50257))
}
"""Smoke-test shapes: seconds on a GPU, one of them with no dimension a multiple of 16."""


def parse_shape(spec: str) -> Shape:
    """A known shape's name, or NxDxV (N tokens, hidden size D, vocabulary V); a known shape's
    NxDxV gets its name."""
    known = SHAPES | QUICK_SHAPES
    if spec in known:
        return known[spec]
    match = re.fullmatch(r"(\d+)x(\d+)x(\d+)", spec.strip().lower())
    if not match:
        raise ValueError(f"shape {spec!r} is neither one of {list(known)} nor NxDxV")
    n, d, v = (int(part) for part in match.groups())
    if min(n, d, v) < 1:
        raise ValueError(f"shape {spec!r}: N, D and V must each be at least 1")
    named = next((shape for shape in known.values() if (shape.n, shape.d, shape.v) == (n, d, v)), None)
    return named or Shape(spec, n, d, v)
