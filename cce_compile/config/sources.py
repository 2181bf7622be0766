"""Where a tuned config can come from before the heuristic: the local disk cache, the
tuning service and the configs bundled with the package.

Every source hands back raw, untrusted data (`Found`); resolve.py validates it against the
GPU before anything launches with it. Nothing here raises on a bad source: a corrupt file,
a dead service or a garbage answer is a miss, logged. httpx (and the tuning_db records)
load only when a source needs them, so `import cce_compile` stays free of the web stack.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Mapping, get_args

from .plan import n_bucket

if TYPE_CHECKING:  # resolve.py imports this module
    from .resolve import ProblemKey

log = logging.getLogger("cce_compile.config")

URL_ENV = "CCE_TUNING_URL"
TOKEN_ENV = "CCE_TUNING_TOKEN"
OFFLINE_ENV = "CCE_TUNING_OFFLINE"
CACHE_DIR_ENV = "CCE_CONFIG_CACHE_DIR"
CACHE_TTL_ENV = "CCE_CONFIG_CACHE_TTL_S"
DEFAULT_TTL_S = 7 * 24 * 3600.0
SERVICE_TIMEOUT_S = 1.5
KERNEL_NAME = "cce"
"""The `kernel` field of the tuning database for this op."""

BUNDLED_DIR = Path(__file__).parent / "bundled"
KERNELS_DIR = Path(__file__).parents[1] / "kernels"


@dataclass(frozen=True)
class Platform:
    """What a tuned config depends on besides the problem: the GPU and the code versions.

    `compute_capability`/`sm_count` let the service answer for a GPU it has not seen
    (same_arch); `shared_memory_bytes` is the per-block limit configs are checked against
    (None: not checked, e.g. on CPU or for a GPU named on the command line)."""

    gpu: str
    compute_capability: str | None
    sm_count: int | None
    shared_memory_bytes: int | None
    kernel_version: str
    triton_version: str


@dataclass(frozen=True)
class Found:
    """A source's answer before validation: the config as plain data and how well it matches."""

    config: Any
    match_level: str


@dataclass(frozen=True)
class Settings:
    """Where to look, from the environment (CCE_TUNING_*, CCE_CONFIG_CACHE_*)."""

    url: str | None
    token: str | None
    offline: bool
    cache_dir: Path
    ttl_s: float

    @classmethod
    def from_env(cls) -> "Settings":
        cache_dir = os.environ.get(CACHE_DIR_ENV)
        if not cache_dir:
            import platformdirs

            cache_dir = str(Path(platformdirs.user_cache_dir("cce_compile")) / "configs")
        return cls(
            url=os.environ.get(URL_ENV) or None,
            token=os.environ.get(TOKEN_ENV) or None,
            offline=os.environ.get(OFFLINE_ENV, "").strip().lower() in ("1", "true", "yes", "on"),
            cache_dir=Path(cache_dir),
            ttl_s=_ttl_from_env(),
        )

    def with_url(self, url: str | None) -> "Settings":
        return self if url is None else replace(self, url=url)


def _ttl_from_env() -> float:
    raw = os.environ.get(CACHE_TTL_ENV)
    if not raw:
        return DEFAULT_TTL_S
    try:
        return max(0.0, float(raw))
    except ValueError:
        log.warning("ignoring %s=%r (not a number of seconds); using %s", CACHE_TTL_ENV, raw, DEFAULT_TTL_S)
        return DEFAULT_TTL_S


# --- identity ---------------------------------------------------------------------------


MatchLevel = Literal["exact", "nearest_bucket", "stale_triton", "same_arch", "none"]
"""How closely a stored config matches a query (the tuning database's answer)."""
MATCH_LEVELS: tuple[MatchLevel, ...] = get_args(MatchLevel)
"""The match levels, best first."""


def normalize_gpu_name(name: str) -> str:
    """One spelling per GPU model: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'.

    Lives here, not with the database records, so the op's resolution path imports
    neither pydantic nor SQLAlchemy."""
    return "-".join(name.lower().replace("_", " ").split())


@lru_cache(maxsize=1)
def kernel_version() -> str:
    """A short hash of the kernels' source: configs tuned for other kernels do not apply."""
    digest = hashlib.sha256()
    for path in sorted(KERNELS_DIR.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


@lru_cache(maxsize=1)
def triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return triton.__version__


def local_platform(device: str) -> Platform:
    """This process's platform for a ProblemKey.device ("cuda", "cpu", "interpreter")."""
    if device != "cuda":
        return Platform(device, None, None, None, kernel_version(), triton_version())
    import torch

    return _cuda_platform(torch.cuda.current_device())


@lru_cache(maxsize=None)
def _cuda_platform(index: int) -> Platform:
    import torch

    props = torch.cuda.get_device_properties(index)
    return Platform(
        gpu=normalize_gpu_name(torch.cuda.get_device_name(index)),
        compute_capability=f"{props.major}.{props.minor}",
        sm_count=props.multi_processor_count,
        shared_memory_bytes=props.shared_memory_per_block_optin,
        kernel_version=kernel_version(),
        triton_version=triton_version(),
    )


def _match_level(value: Any) -> str | None:
    """`value` if it is one of the database's match levels that carries a config."""
    return value if isinstance(value, str) and value in MATCH_LEVELS and value != "none" else None


# --- disk cache -------------------------------------------------------------------------


def cache_path(settings: Settings, platform: Platform, key: ProblemKey) -> Path:
    """One JSON file per platform and key, named readably (unsafe characters replaced)."""
    parts = (
        platform.gpu, key.v, key.d, key.dtype, key.n_bucket, key.mode,
        f"k{platform.kernel_version}", f"triton{platform.triton_version}",
    )
    name = re.sub(r"[^A-Za-z0-9.+-]", "_", "_".join(str(part) for part in parts))
    return settings.cache_dir / f"{name}.json"


def read_cache(settings: Settings, platform: Platform, key: ProblemKey) -> Found | None:
    """The cached service answer for `key`, unless missing, unreadable, corrupt or older
    than the TTL."""
    path = cache_path(settings, platform, key)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        log.warning("config cache %s unreadable (%s); ignoring it", path, error)
        return None
    stored_at = data.get("stored_at") if isinstance(data, dict) else None
    level = _match_level(data.get("match_level")) if isinstance(data, dict) else None
    if isinstance(stored_at, bool) or not isinstance(stored_at, (int, float)) or level is None:
        log.warning("config cache %s is malformed; ignoring it", path)
        return None
    if not 0 <= time.time() - stored_at <= settings.ttl_s:
        log.info("config cache %s expired (TTL %ss)", path, settings.ttl_s)
        return None
    return Found(data.get("config"), level)


def write_cache(settings: Settings, platform: Platform, key: ProblemKey, found: Found) -> None:
    """Store a validated service answer; atomic (a reader sees the old file or the new one),
    and a failure to write only costs the next process a service call."""
    path = cache_path(settings, platform, key)
    record = {"stored_at": time.time(), "match_level": found.match_level, "config": found.config}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}", suffix=".tmp")
    except OSError as error:
        log.warning("could not write config cache %s: %s", path, error)
        return
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            json.dump(record, file)
        os.replace(temporary, path)
    except OSError as error:
        log.warning("could not write config cache %s: %s", path, error)
        with contextlib.suppress(OSError):
            os.unlink(temporary)


# --- tuning service ---------------------------------------------------------------------

_breaker_lock = threading.Lock()
_service_down: str | None = None
"""Why the service was given up on in this process (None: not given up)."""


def reset_breaker() -> None:
    global _service_down
    with _breaker_lock:
        _service_down = None


def _trip(url: str, reason: str) -> None:
    global _service_down
    with _breaker_lock:
        _service_down = reason
    log.warning("tuning service %s unusable (%s); not asking it again in this process", url, reason)


def fetch_from_service(settings: Settings, platform: Platform, key: ProblemKey) -> Found | None:
    """The service's best config for `key`, or None (no entry, offline, or unusable).

    One retry for a dropped connection or a 5xx; a timeout is not retried. Any failure
    opens a process-wide breaker, so a dead service costs one timeout per process."""
    if settings.url is None or settings.offline or _service_down is not None:
        return None
    import httpx

    url = settings.url.rstrip("/") + "/v1/configs/best"
    params = _query(platform, key)
    headers = {"Authorization": f"Bearer {settings.token}"} if settings.token else {}
    failure = "no attempt"
    with httpx.Client(timeout=httpx.Timeout(SERVICE_TIMEOUT_S), headers=headers) as client:
        for _attempt in range(2):
            try:
                response = client.get(url, params=params)
            except httpx.TimeoutException as error:
                failure = f"no answer within {SERVICE_TIMEOUT_S}s ({type(error).__name__})"
                break
            except (httpx.TransportError, httpx.InvalidURL) as error:
                failure = f"{type(error).__name__}: {error}"
                continue
            if response.status_code == 200:
                return _parse_answer(settings.url, response)
            failure = f"HTTP {response.status_code}: {response.text[:200]}"
            if response.status_code < 500:
                break
    _trip(settings.url, failure)
    return None


def _query(platform: Platform, key: ProblemKey) -> dict[str, Any]:
    params: dict[str, Any] = {
        "gpu": platform.gpu,
        "kernel": KERNEL_NAME,
        "kernel_version": platform.kernel_version,
        "triton_version": platform.triton_version,
        "V": key.v,
        "D": key.d,
        "dtype": key.dtype,
        "tokens": key.n_bucket,
        "mode": key.mode,
    }
    if platform.compute_capability is not None and platform.sm_count is not None:
        params.update(compute_capability=platform.compute_capability, sm_count=platform.sm_count)
    return params


def _parse_answer(url: str, response: Any) -> Found | None:
    """A GET /v1/configs/best body as a Found; None for 'no entry' and for garbage."""
    try:
        body = response.json()
    except ValueError:
        log.warning("tuning service %s answered non-JSON: %r", url, response.text[:200])
        return None
    if not isinstance(body, dict):
        log.warning("tuning service %s answered %s, not an object", url, type(body).__name__)
        return None
    if body.get("match_level") == "none":
        return None
    level = _match_level(body.get("match_level"))
    if level is None:
        log.warning("tuning service %s answered an unknown match level %r", url, body.get("match_level"))
        return None
    return Found(body.get("config"), level)


# --- bundled defaults -------------------------------------------------------------------


def bundled_config(platform: Platform, key: ProblemKey) -> Found | None:
    """The config shipped in the package for this GPU and key, if any (an exact match)."""
    index = _bundled_index(BUNDLED_DIR)
    config = index.get((platform.gpu, key.v, key.d, key.dtype, key.n_bucket, key.mode))
    return None if config is None else Found(config, "exact")


@lru_cache(maxsize=4)
def _bundled_index(directory: Path) -> dict[tuple[Any, ...], Any]:
    """Every bundled entry by (gpu, V, D, dtype, n_bucket, mode); bad files and entries are
    logged and skipped (read once per process)."""
    index: dict[tuple[Any, ...], Any] = {}
    for path in sorted(directory.glob("*.json")):
        try:
            entries = json.loads(path.read_text(encoding="utf-8"))["entries"]
            for number, entry in enumerate(entries):
                _add_bundled(index, entry, f"{path.name} entry {number}")
        except (OSError, ValueError, KeyError, TypeError) as error:
            log.warning("bundled configs %s unreadable (%s: %s); skipping it", path, type(error).__name__, error)
    return index


def _add_bundled(index: dict[tuple[Any, ...], Any], entry: Mapping[str, Any], where: str) -> None:
    fields = ("gpu", "V", "D", "dtype", "tokens", "mode", "config")
    if not isinstance(entry, Mapping) or any(name not in entry for name in fields):
        log.warning("bundled %s lacks one of %s; skipping it", where, fields)
        return
    tokens = entry["tokens"]
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        log.warning("bundled %s has tokens %r; skipping it", where, tokens)
        return
    index[bundled_key(entry)] = entry["config"]


def bundled_key(entry: Mapping[str, Any]) -> tuple[Any, ...]:
    """A bundled entry's key: (normalized GPU name, V, D, dtype, token bucket, mode)."""
    gpu = normalize_gpu_name(str(entry["gpu"]))
    return (gpu, entry["V"], entry["D"], entry["dtype"], n_bucket(entry["tokens"]), entry["mode"])
