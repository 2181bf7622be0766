"""Which KernelConfig the op launches with, decided before launch (at trace time under
torch.compile, on the first eager call for a key otherwise).

The ladder, first answer wins: an active `override_config`, this process's memo (per GPU
model and key), the local disk cache, the tuning service (CCE_TUNING_URL), the configs bundled
with the package, the heuristic. Every config that comes from outside the process is re-validated (and checked
against the GPU's shared memory) before it is used; a bad one is logged and skipped, and one
that fails to launch anyway is dropped for the next rung (launch_failed). Under
torch.distributed, the first rank to meet a key on a GPU model resolves it and every rank on
that model launches its config, exchanged through the process group's store
(CCE_CONFIG_BROADCAST=0 turns that off).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Callable, Iterator

from ..config.kernel_config import ConfigError, KernelConfig
from ..config.keys import ProblemKey
from . import client, sources
from .heuristic import heuristic_config
from .platform import Platform, gpu_model, local_platform

log = logging.getLogger("cce_compile.config")

BROADCAST_ENV = "CCE_CONFIG_BROADCAST"
WAIT_ENV = "CCE_CONFIG_WAIT_S"
DEFAULT_WAIT_S = 30.0
"""How long a rank waits for the config of a key another rank is resolving: past the longest
lookup (the service's deadline and its retry), far inside NCCL's 10-minute timeout. The wait ends
early only where that rank died or hung mid-lookup; the waiting rank then resolves the key itself."""
ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


_local = threading.local()


@contextlib.contextmanager
def override_config(config: KernelConfig) -> Iterator[None]:
    """Launch every op call in this block (on this thread) with `config`: what the tuner
    and the tests use to try a candidate. A call that torch.compile traced earlier keeps the
    config it was traced with (ops/problem.traced_settings)."""
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


@dataclass(frozen=True)
class Resolution:
    """A resolved config and where it came from, for logs and `cce lookup`.

    `source`: "override", "disk", "service", "bundled" or "heuristic"; `match_level`: the
    tuning database's ("exact", "nearest_bucket", "stale_triton", "same_arch"), "none" for
    the heuristic and overrides."""

    config: KernelConfig
    source: str
    match_level: str


MemoKey = tuple[str, ProblemKey]
"""(GPU model, key): what a resolution is remembered by. A key's config depends on the GPU it
is resolved for (its tuned configs, its shared memory), and a host may hold several models."""

_memo: dict[MemoKey, Resolution] = {}
_failed_sources: dict[MemoKey, frozenset[str]] = {}
"""Per GPU model and key, the sources whose config failed to launch in this process: the ladder
skips them."""
_failed_configs: dict[MemoKey, frozenset[KernelConfig]] = {}
"""Per GPU model and key, the configs that failed to launch in this process: no source's copy of
one is taken again (the disk cache holds the service's answer: a cached config that failed was
served again)."""
_override_uses: dict[ProblemKey, int] = {}
"""Per key, how many times an override was exchanged between ranks (names its store entry)."""
_memo_lock = threading.Lock()


def _unlock_in_forked_child() -> None:
    """A forked child runs only the thread that forked: the lock another thread held for a whole
    lookup (the service's deadline, a rank's wait for another's) would stay held in it, and its
    first resolution would hang forever."""
    global _memo_lock
    _memo_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_unlock_in_forked_child)


def resolve_config(key: ProblemKey, gpu: int | None = None) -> KernelConfig:
    """The config for `key` on CUDA device `gpu` (the operands'; platform.local_platform): an
    active override, else the memoized ladder (under torch.distributed the choice of the first
    rank to meet the key, so every rank launches the same kernels)."""
    override = active_override()
    if override is None:
        return resolution_for(key, gpu).config
    if not _distributed():
        return override
    with _memo_lock:  # the n-th override use of a key on every rank names the same entry
        use = _override_uses[key] = _override_uses.get(key, 0) + 1
    return _from_first_rank(key, lambda: Resolution(override, "override", "none"), f"override-{use}").config


def resolution_for(key: ProblemKey, gpu: int | None = None) -> Resolution:
    """The ladder's answer for `key` (overrides aside), resolved on first use for the platform
    of CUDA device `gpu` (its GPU's tuned configs and shared memory) and then remembered for
    the process and that GPU model (platform.gpu_model): a GPU of another model resolves the
    key for itself. Logged once per model and key. Under torch.distributed, the answer of the
    first rank to meet the key on that model (see _from_first_rank)."""
    model = gpu_model(key.device, gpu)
    memo_key = (model, key)
    with _memo_lock:
        resolution = _memo.get(memo_key)
        if resolution is not None:
            return resolution
        skip = _failed_sources.get(memo_key, frozenset())
        refused = _failed_configs.get(memo_key, frozenset())
        if _distributed():
            # Every rank of a model fails the same config alike, so the ladder after a failure
            # is exchanged under a name of its own; ranks on another model resolve for theirs.
            purpose = f"{model}/ladder" + "".join(f"-without-{source}" for source in sorted(skip))
            resolution = _from_first_rank(
                key, lambda: look_up(key, local_platform(key.device, gpu), skip=skip, refused=refused), purpose)
        else:
            resolution = look_up(key, local_platform(key.device, gpu), skip=skip, refused=refused)
        _memo[memo_key] = resolution
    log.info("config for %s on %s: %s (match level %s)", key, model, resolution.source, resolution.match_level)
    return resolution


def launch_failed(key: ProblemKey, error: Exception, config: KernelConfig, gpu: int | None = None) -> bool:
    """`config`, resolved for `key`, failed to launch with `error` on CUDA device `gpu`: skip its
    source for `key` on that GPU model from now on in this process (that GPU's disk cache file
    is removed too), so the next resolution there takes the next rung. False when there is no
    rung left to take (an override, the heuristic).
    Where another thread already dropped `config` (the memo holds another config, or none yet),
    nothing more is dropped and the caller resolves again: the source now memoized never failed.
    A config no rung gave for `key` (an override the forward ran under, whose backward autograd
    runs on a device thread that does not see it) is no rung's either: False."""
    if active_override() is not None:
        return False
    memo_key = (gpu_model(key.device, gpu), key)
    with _memo_lock:
        current = _memo.get(memo_key)
        if current is None or current.config != config:
            return config in _failed_configs.get(memo_key, frozenset())
        failed = _memo.pop(memo_key)
        if failed.source == "heuristic":
            _memo[memo_key] = failed
            return False
        # The disk cache holds what the service answered: a served config that failed is skipped
        # there too (it once launched again from the copy look_up had just written).
        skipped = {failed.source, "disk"} if failed.source == "service" else {failed.source}
        _failed_sources[memo_key] = _failed_sources.get(memo_key, frozenset()) | skipped
        _failed_configs[memo_key] = _failed_configs.get(memo_key, frozenset()) | {config}
    log.warning("the %s config for %s failed to launch (%s: %s); trying the next source",
                failed.source, key, type(error).__name__, error)
    if "disk" in skipped:
        sources.remove_cache(sources.Settings.from_env(), local_platform(key.device, gpu), key)
    return True


def resolved() -> dict[MemoKey, Resolution]:
    """Every (GPU model, key) this process has resolved so far, with its resolution."""
    with _memo_lock:
        return dict(_memo)


def reset() -> None:
    """Forget every resolution and close the service breaker (tests; a new service)."""
    with _memo_lock:
        _memo.clear()
        _failed_sources.clear()
        _failed_configs.clear()
        _override_uses.clear()
    client.reset_breaker()


def look_up(
    key: ProblemKey, platform: Platform, settings: sources.Settings | None = None, skip: frozenset[str] = frozenset(),
    write_cache: bool = True, service_required: bool = False, refused: frozenset[KernelConfig] = frozenset(),
) -> Resolution:
    """The ladder below the memo, unmemoized: disk cache, service, bundled, heuristic, less
    the sources in `skip` and any source's answer that is one of the `refused` configs (they failed
    to launch). A served config is written to the disk cache unless `write_cache`
    is False (`cce lookup`: a look must not change what the op launches). With
    `service_required` (`cce lookup --url`: the user named the service), a service that
    cannot be asked raises client.ServiceUnusable instead of passing to the next source."""
    settings = settings or sources.Settings.from_env()
    if "disk" not in skip:
        cached = _accept("disk", sources.read_cache(settings, platform, key), platform, key, refused=refused)
        if cached is not None:
            return cached
    if "service" not in skip:
        ask = client.ask_service if service_required else client.fetch_from_service
        served = _accept("service", ask(settings, platform, key), platform, key, required=service_required,
                         refused=refused)
        if served is not None:
            if write_cache and "disk" not in skip:
                sources.write_cache(settings, platform, key, sources.Found(served.config.to_dict(), served.match_level))
            return served
    if "bundled" not in skip:
        bundled = _accept("bundled", sources.bundled_config(platform, key), platform, key, refused=refused)
        if bundled is not None:
            return bundled
    return Resolution(heuristic_config(key), "heuristic", "none")


def _accept(
    source: str, found: sources.Found | None, platform: Platform, key: ProblemKey, required: bool = False,
    refused: frozenset[KernelConfig] = frozenset(),
) -> Resolution | None:
    """`found` as a Resolution if it is a valid config that fits the GPU; None otherwise, or
    with `required` (the service `cce lookup --url` names) client.UnreadableAnswer: the
    heuristic's config is no answer of that service's."""
    if found is None:
        return None
    try:
        config = KernelConfig.from_dict(found.config)
        if platform.shared_memory_bytes is not None:
            config.check_limits(platform.shared_memory_bytes, ELEMENT_BYTES[key.dtype])
    except ConfigError as error:
        if required:
            raise client.UnreadableAnswer(f"answered a config ({found.match_level} match) this client refuses: {error}") from None
        log.warning("rejected the %s config for %s: %s", source, key, error)
        return None
    if config in refused:
        log.info("the %s config for %s failed to launch already in this process; skipping it", source, key)
        return None
    return Resolution(config, source, found.match_level)


def _distributed() -> bool:
    """Whether one rank decides for all: several ranks, unless CCE_CONFIG_BROADCAST=0 or the
    process group is torch's fake one (a process standing in for one rank of many, as a dry
    run of a sharded model has it), which has no other rank to agree with and whose FakeStore
    implements no exchange."""
    import torch.distributed as dist

    if os.environ.get(BROADCAST_ENV, "1").strip() == "0":
        return False
    return (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
            and dist.get_backend() != "fake")


MAX_WAIT_S = 24 * 3600.0
"""The longest wait CCE_CONFIG_WAIT_S sets: inf (or 1e300) once overflowed timedelta, which the
wait took for the resolving rank's timeout, so the rank resolved on its own at once."""
MIN_WAIT_S = 0.001
"""The shortest: the store's wait counts whole milliseconds, and 0 ms is c10d's "no timeout" (a
FileStore, under a file:// rendezvous, then waited forever where 0 or a negative wait was set)."""


def _wait_s() -> float:
    try:
        wait = float(os.environ.get(WAIT_ENV, DEFAULT_WAIT_S))
    except ValueError:
        wait = math.nan
    if math.isnan(wait):  # nan once waited 0 s
        log.warning("ignoring %s=%r (not a number of seconds)", WAIT_ENV, os.environ[WAIT_ENV])
        return DEFAULT_WAIT_S
    return min(max(MIN_WAIT_S, wait), MAX_WAIT_S)


def _from_first_rank(key: ProblemKey, resolve_here: Callable[[], Resolution], purpose: str) -> Resolution:
    """The resolution of the first rank to meet `key`, on every rank, exchanged through the
    process group's key-value store under a name derived from the key.

    Not a collective: ranks may meet keys in any order (token counts that fall in other
    buckets on other ranks, evaluation on one rank, a pipeline's last stage alone computing the
    loss) without waiting on each other's calls. The store's atomic counter elects the rank that
    resolves a key; it publishes its answer (or its failure). Another rank waits for it up to
    CCE_CONFIG_WAIT_S and, if it never comes (the resolving rank died or hung), resolves the key
    itself. A key only one rank meets costs no wait: that rank is elected."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    name = f"cce_compile/config/{purpose}/" + json.dumps(asdict(key), sort_keys=True)
    if store.add(name + "/claims", 1) == 1:
        try:
            mine = resolve_here()
        except Exception as exc:
            store.set(name, json.dumps({"rank": dist.get_rank(), "error": repr(exc)}))
            raise
        store.set(name, json.dumps(_message(key, mine)))
        return mine
    wait_s = _wait_s()
    try:
        store.wait([name], timedelta(seconds=wait_s))
    except Exception:  # the store's timeout: the elected rank has not resolved this key
        log.warning("the rank resolving %s gave no answer within %s s; resolving it on this rank", key, wait_s)
        return resolve_here()
    message = json.loads(store.get(name))
    if "error" in message:
        raise RuntimeError(f"rank {message['rank']} failed to resolve a kernel config for {key}: {message['error']}")
    return Resolution(KernelConfig.from_dict(message["config"]), message["source"], message["match_level"])


def _message(key: ProblemKey, resolution: Resolution) -> dict[str, object]:
    return {
        "key": asdict(key),
        "config": resolution.config.to_dict(),
        "source": resolution.source,
        "match_level": resolution.match_level,
    }
