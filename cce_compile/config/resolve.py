"""Which KernelConfig the op launches with, decided before launch (at trace time under
torch.compile, on the first eager call for a key otherwise).

The ladder, first answer wins: an active `override_config`, this process's memo, the local
disk cache, the tuning service (CCE_TUNING_URL), the configs bundled with the package, the
heuristic. Every config that comes from outside the process is re-validated (and checked
against the GPU's shared memory) before it is used; a bad one is logged and skipped. Under
torch.distributed, rank 0 resolves and every rank launches its config, exchanged through
the process group's store (CCE_CONFIG_BROADCAST=0 turns that off).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Callable, Iterator

import torch

from . import sources
from .kernel_config import ConfigError, KernelConfig, TileConfig

log = logging.getLogger("cce_compile.config")

BROADCAST_ENV = "CCE_CONFIG_BROADCAST"
WAIT_ENV = "CCE_CONFIG_WAIT_S"
DEFAULT_WAIT_S = 600.0
"""How long a rank waits for rank 0's config for a key (rank 0 may be compiling)."""


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


def active_override() -> KernelConfig | None:
    """The override this thread runs under, if any. Autograd runs a CUDA backward on its own
    device thread, which does not see it: the op's autograd carries it over from the forward."""
    return getattr(_local, "override", None)


HEURISTIC_EXACT_SLAB_V = 16384
"""Exact mode's slab cap where nothing was tuned: wide enough that config.plan's traffic model
picks the plan within the scratch budget. Back to back at the H200's 700 W limit the plan with
the least dE-accumulator and dC traffic won or tied on every shape tried (ab_switch.py --plans,
benchmarks/results/ab-h200-plans-*.log): Gemma-2 2 x 8192 against the 4096 cap's 2 x 4096 4.34
against 4.41 x GEMM, and at N = 16384 4 x 8192 against 4 x 4096 4.37 against 4.49; Llama-3 at
N = 16384 8 x 16384 against 4 x 4096 4.40 against 4.49 (and its tuned N = 8192 config took
16384); 4096 x 8192 x 128256 level; Qwen2.5's plan is the same under either cap."""


HEURISTIC_LOGITS_GROUP_M = 16
"""The logits kernels' grouping where nothing was tuned. A group of group_m row blocks reads C
once, so at large N a small group re-reads C from HBM many times. Alternated at N = 16384 (no
tuned config; benchmarks/results/ab-h200-v20-heuristic-group-m.log), forward 8 -> 16 -> 32:
Llama-3 30.47 -> 28.66 -> 28.73 ms, Gemma-2 34.15 -> 32.42 -> 32.25 ms (1.22 -> 1.14-1.16 x
GEMM, as tuned N = 8192 runs); the tuned H200 configs took 16 as well."""


def heuristic_config(key: ProblemKey) -> KernelConfig:
    """A sound config with no measurement behind it: the last rung of the ladder."""
    if key.device != "cuda":
        # Interpreter and CPU: few, large programs are what is cheap there.
        tile = TileConfig(block_m=32, block_n=32, block_k=32, group_m=4, num_warps=4, num_stages=1)
        return KernelConfig(tile, tile, tile, tile, slab_v=1024, vocab_splits=4)
    # Measured on an H200 (bf16; docs/performance.md): 128 x 256 logits tiles, 4 stages.
    wide = key.dtype != "float32"
    gemm = TileConfig(128, 128, 64 if wide else 32, 8, 8, 3)
    logits = TileConfig(128, 256, 64, HEURISTIC_LOGITS_GROUP_M, 8, 4) if wide else gemm
    grad_hidden = gemm
    if key.mode == "filtered" and wide:
        # The block-sparse dE GEMM reads each kept d-logits tile once per block_n columns of
        # dE: 256 wide where D is large (benchmarks/results/sweep-h200-filtered-*.json:
        # 0.07-0.17 x GEMM of fwd+bwd), 128 wide with 4 warps where it is small (Qwen2.5's
        # D = 896 at v14's steps: 2.48 against 2.62 x for 64 wide, sweep-h200-v15-filtered-*).
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


@dataclass(frozen=True)
class Resolution:
    """A resolved config and where it came from, for logs and `cce lookup`.

    `source`: "override", "disk", "service", "bundled" or "heuristic"; `match_level`: the
    tuning database's ("exact", "nearest_bucket", "stale_triton", "same_arch"), "none" for
    the heuristic and overrides."""

    config: KernelConfig
    source: str
    match_level: str


_memo: dict[ProblemKey, Resolution] = {}
_override_uses: dict[ProblemKey, int] = {}
"""Per key, how many times an override was exchanged between ranks (names its store entry)."""
_memo_lock = threading.Lock()


def resolve_config(key: ProblemKey) -> KernelConfig:
    """The config for `key`: an active override, else the memoized ladder (rank 0's choice
    under torch.distributed, so every rank launches the same kernels)."""
    override = active_override()
    if override is None:
        return resolution_for(key).config
    if not _distributed():
        return override
    with _memo_lock:  # the n-th override use of a key on every rank names the same entry
        use = _override_uses[key] = _override_uses.get(key, 0) + 1
    return _from_rank0(key, lambda: Resolution(override, "override", "none"), f"override-{use}").config


def resolution_for(key: ProblemKey) -> Resolution:
    """The ladder's answer for `key` (overrides aside), resolved on first use and then
    remembered for the process; logged once per key. Under torch.distributed, rank 0's
    answer (see _from_rank0)."""
    with _memo_lock:
        resolution = _memo.get(key)
        if resolution is not None:
            return resolution
        if _distributed():
            resolution = _from_rank0(key, lambda: look_up(key, sources.local_platform(key.device)), "ladder")
        else:
            resolution = look_up(key, sources.local_platform(key.device))
        _memo[key] = resolution
    log.info("config for %s: %s (match level %s)", key, resolution.source, resolution.match_level)
    return resolution


def resolved() -> dict[ProblemKey, Resolution]:
    """Every key this process has resolved so far, with its resolution."""
    with _memo_lock:
        return dict(_memo)


def reset() -> None:
    """Forget every resolution and close the service breaker (tests; a new service)."""
    with _memo_lock:
        _memo.clear()
        _override_uses.clear()
    sources.reset_breaker()


def look_up(
    key: ProblemKey, platform: sources.Platform, settings: sources.Settings | None = None
) -> Resolution:
    """The ladder below the memo, unmemoized: disk cache, service, bundled, heuristic."""
    settings = settings or sources.Settings.from_env()
    cached = _accept("disk", sources.read_cache(settings, platform, key), platform, key)
    if cached is not None:
        return cached
    served = _accept("service", sources.fetch_from_service(settings, platform, key), platform, key)
    if served is not None:
        sources.write_cache(settings, platform, key, sources.Found(served.config.to_dict(), served.match_level))
        return served
    bundled = _accept("bundled", sources.bundled_config(platform, key), platform, key)
    if bundled is not None:
        return bundled
    return Resolution(heuristic_config(key), "heuristic", "none")


def _accept(source: str, found: sources.Found | None, platform: sources.Platform, key: ProblemKey) -> Resolution | None:
    """`found` as a Resolution if it is a valid config that fits the GPU; None otherwise."""
    if found is None:
        return None
    try:
        config = KernelConfig.from_dict(found.config)
        if platform.shared_memory_bytes is not None:
            config.check_limits(platform.shared_memory_bytes, getattr(torch, key.dtype).itemsize)
    except ConfigError as error:
        log.warning("rejected the %s config for %s: %s", source, key, error)
        return None
    return Resolution(config, source, found.match_level)


def _distributed() -> bool:
    """Whether rank 0 decides: several ranks, unless CCE_CONFIG_BROADCAST=0."""
    import torch.distributed as dist

    if os.environ.get(BROADCAST_ENV, "1").strip() == "0":
        return False
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _wait_s() -> float:
    try:
        return max(0.0, float(os.environ.get(WAIT_ENV, DEFAULT_WAIT_S)))
    except ValueError:
        log.warning("ignoring %s=%r (not a number of seconds)", WAIT_ENV, os.environ[WAIT_ENV])
        return DEFAULT_WAIT_S


def _from_rank0(key: ProblemKey, resolve_here: Callable[[], Resolution], purpose: str) -> Resolution:
    """Rank 0's resolution on every rank, exchanged through the process group's key-value
    store under a name derived from the key.

    Not a collective: ranks may resolve keys in any order (token counts that fall in other
    buckets on other ranks, evaluation on rank 0 only) without waiting on each other's
    calls. Rank 0 publishes each key it resolves (or its failure); another rank waits up to
    CCE_CONFIG_WAIT_S for the key and, if rank 0 never resolves it (it does not run that
    shape), resolves it itself."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    name = f"cce_compile/config/{purpose}/" + json.dumps(asdict(key), sort_keys=True)
    if dist.get_rank() == 0:
        try:
            mine = resolve_here()
        except Exception as exc:
            store.set(name, json.dumps({"error": repr(exc)}))
            raise
        store.set(name, json.dumps(_message(key, mine)))
        return mine
    wait_s = _wait_s()
    try:
        store.wait([name], timedelta(seconds=wait_s))
    except Exception:  # the store's timeout: rank 0 has not resolved this key
        log.warning("rank 0 did not resolve %s within %s s; resolving it on this rank", key, wait_s)
        return resolve_here()
    message = json.loads(store.get(name))
    if "error" in message:
        raise RuntimeError(f"rank 0 failed to resolve a kernel config for {key}: {message['error']}")
    return Resolution(KernelConfig.from_dict(message["config"]), message["source"], message["match_level"])


def _message(key: ProblemKey, resolution: Resolution) -> dict[str, object]:
    return {
        "key": asdict(key),
        "config": resolution.config.to_dict(),
        "source": resolution.source,
        "match_level": resolution.match_level,
    }
