"""Launch parameters of the op's kernels, as validated data.

A config is plain data (integers under whitelisted keys), so it can travel through the
tuning database and over HTTP and be re-checked before every launch: a config can never
carry strings, code or hooks. This module imports nothing heavier than the standard
library, so the service and the database layer can validate configs cheaply.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping

KERNELS = ("forward", "grad_logits", "grad_classifier", "grad_hidden")
"""The op's kernels: forward (logits tile -> lse), grad_logits (recompute -> d logits slab),
grad_classifier (dC slab GEMM), grad_hidden (dE accumulation GEMM)."""

_BLOCK_RANGE = (16, 256)
_NUM_WARPS = (1, 2, 4, 8, 16)
_STAGE_RANGE = (1, 8)
_GROUP_RANGE = (1, 64)
_SLAB_RANGE = (128, 65536)
_SPLIT_RANGE = (1, 1024)
_WORKSPACE_ROWS_RANGE = (0, 1 << 20)


class ConfigError(ValueError):
    """A config that is malformed, out of range or unknown; the message names the key."""


def _is_pow2(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def _check_int(where: str, value: Any, lo: int, hi: int, pow2: bool) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where} must be an integer, got {type(value).__name__} {value!r}")
    if not lo <= value <= hi:
        raise ConfigError(f"{where} must be in [{lo}, {hi}], got {value}")
    if pow2 and not _is_pow2(value):
        raise ConfigError(f"{where} must be a power of two, got {value}")
    return value


def _validate_tile(values: Mapping[str, Any], where: str) -> None:
    for name in ("block_m", "block_n", "block_k"):
        _check_int(f"{where}.{name}", values[name], *_BLOCK_RANGE, pow2=True)
    _check_int(f"{where}.group_m", values["group_m"], *_GROUP_RANGE, pow2=True)
    # An integer first: 4.0 == 4 would pass the membership test and fail in Triton's launch.
    warps = values["num_warps"]
    if isinstance(warps, bool) or not isinstance(warps, int) or warps not in _NUM_WARPS:
        raise ConfigError(f"{where}.num_warps must be one of {_NUM_WARPS}, got {warps!r}")
    _check_int(f"{where}.num_stages", values["num_stages"], *_STAGE_RANGE, pow2=False)


@dataclass(frozen=True)
class TileConfig:
    """One kernel's tile shape and launch parameters.

    `block_m` x `block_n` is the output tile, `block_k` the reduction step, `group_m` the
    number of row blocks that share a column sweep (L2 reuse), `num_warps` and `num_stages`
    go to the Triton launch.
    """

    block_m: int = 64
    block_n: int = 64
    block_k: int = 32
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        self.validate("tile")

    def validate(self, where: str) -> None:
        _validate_tile(asdict(self), where)

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "TileConfig":
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where} must be an object, got {type(data).__name__}")
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise ConfigError(f"{where} has unknown keys {unknown}; allowed: {sorted(allowed)}")
        merged = {**asdict(cls()), **data}
        _validate_tile(merged, where)
        return cls(**merged)

    def shared_memory_bytes(self, element_bytes: int) -> int:
        """Shared memory the pipelined operand buffers need (what limits num_stages)."""
        return self.num_stages * (self.block_m + self.block_n) * self.block_k * element_bytes


@dataclass(frozen=True)
class KernelConfig:
    """Everything the op needs to launch, chosen before launch.

    `slab_v` is the vocabulary width of one backward slab: the backward materializes
    d logits for `slab_v` columns of a token chunk at a time, so it bounds the scratch
    memory. `vocab_splits` is how many programs share one row block's vocabulary in the
    forward (more splits fill the GPU when N is small). `workspace_rows` is the fused
    forward's token chunk (its workspace holds that many rows of V; 0: as many as the
    memory plan allows).
    """

    forward: TileConfig = field(default_factory=lambda: TileConfig(64, 64, 32, 8, 4, 2))
    grad_logits: TileConfig = field(default_factory=lambda: TileConfig(64, 64, 32, 8, 4, 2))
    grad_classifier: TileConfig = field(default_factory=lambda: TileConfig(64, 64, 32, 8, 4, 2))
    grad_hidden: TileConfig = field(default_factory=lambda: TileConfig(64, 64, 32, 8, 4, 2))
    slab_v: int = 4096
    vocab_splits: int = 16
    workspace_rows: int = 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for name in KERNELS:
            tile = getattr(self, name)
            if not isinstance(tile, TileConfig):
                raise ConfigError(f"{name} must be a TileConfig, got {type(tile).__name__}")
            tile.validate(name)
        _check_int("slab_v", self.slab_v, *_SLAB_RANGE, pow2=True)
        _check_int("vocab_splits", self.vocab_splits, *_SPLIT_RANGE, pow2=True)
        _check_int("workspace_rows", self.workspace_rows, *_WORKSPACE_ROWS_RANGE, pow2=False)
        if self.workspace_rows % 128:
            raise ConfigError(f"workspace_rows must be a multiple of 128 (0: the plan's), got {self.workspace_rows}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> "KernelConfig":
        """Build and validate a config from untrusted JSON-like data; raises ConfigError."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"config must be an object, got {type(data).__name__}")
        allowed = set(KERNELS) | {"slab_v", "vocab_splits", "workspace_rows"}
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise ConfigError(f"config has unknown keys {unknown}; allowed: {sorted(allowed)}")
        default = cls()
        kwargs: dict[str, Any] = {}
        for name in KERNELS:
            kwargs[name] = TileConfig.from_dict(data[name], name) if name in data else getattr(default, name)
        for name in ("slab_v", "vocab_splits", "workspace_rows"):
            kwargs[name] = data.get(name, getattr(default, name))
        return cls(**kwargs)

    def check_limits(self, shared_memory_bytes: int, element_bytes: int) -> None:
        """Reject a config whose pipelined buffers cannot fit the GPU's shared memory."""
        for name in KERNELS:
            need = getattr(self, name).shared_memory_bytes(element_bytes)
            if need > shared_memory_bytes:
                raise ConfigError(
                    f"{name} needs {need} bytes of shared memory for its stages; "
                    f"the GPU has {shared_memory_bytes}"
                )
