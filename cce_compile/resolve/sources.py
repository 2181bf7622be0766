"""Where a tuned config can come from besides the service (client.py): the local disk cache
and the configs bundled with the package.

Every source hands back raw, untrusted data (`Found`); ladder.py validates it against the
GPU before anything launches with it. Nothing here raises on a bad source: a corrupt file
or a stale entry is a miss, logged.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import stat
import tempfile
import time
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

from ..config.keys import KEY_DTYPES, KEY_MODES, MATCH_LEVELS, ProblemKey, n_bucket, normalize_gpu_name
from .platform import Platform

log = logging.getLogger("cce_compile.config")

URL_ENV = "CCE_TUNING_URL"
TOKEN_ENV = "CCE_TUNING_TOKEN"
OFFLINE_ENV = "CCE_TUNING_OFFLINE"
CACHE_DIR_ENV = "CCE_CONFIG_CACHE_DIR"
CACHE_TTL_ENV = "CCE_CONFIG_CACHE_TTL_S"
DEFAULT_TTL_S = 7 * 24 * 3600.0
MAX_CACHE_FILE_BYTES = 1 << 20
"""A cache file holds one config (about a kilobyte); a larger one is not ours."""

BUNDLED_DIR = Path(__file__).parents[1] / "config" / "bundled"


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
            token=bearer_token(os.environ.get(TOKEN_ENV)),
            offline=os.environ.get(OFFLINE_ENV, "").strip().lower() in ("1", "true", "yes", "on"),
            cache_dir=Path(cache_dir).expanduser(),  # the README's default is written ~/.cache/...
            ttl_s=_ttl_from_env(),
        )

    def with_url(self, url: str | None) -> "Settings":
        """These settings with a service named explicitly (a command's --url): it is asked
        under CCE_TUNING_OFFLINE too, as the option outranks the environment."""
        return self if url is None else replace(self, url=url, offline=False)


def bearer_token(value: str | None) -> str | None:
    """A token as given (CCE_TUNING_TOKEN, --token), stripped as the service strips its own (a
    secret mounted from a file ends in a newline); None where nothing is left."""
    return (value or "").strip() or None


def token_problem(token: str) -> str | None:
    """Why `token` cannot be sent as a bearer token, or None. Never quotes the token: a line
    break or a control character in it once reached the log and the command's error inside the
    HTTP client's 'Illegal header value b'Bearer <token>''. Which tokens the service accepts is
    the service's to say (a 401 that quotes nothing)."""
    if not token.isascii():
        return "is not ASCII (a token is URL-safe characters, as `cce token` makes them)"
    if not token.isprintable() or " " in token:
        return "holds a space or a control character (a token is URL-safe characters, as `cce token` makes them)"
    return None


def service_url_problem(url: str) -> str | None:
    """Why `url` cannot be a tuning service's base URL, or None: a scheme other than http or
    https, no host, a port outside 1-65535. A command naming one (--url, --publish) says so up
    front, naming its option, instead of the HTTP client's error once it tries to connect."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
    except ValueError as error:  # an unbalanced [ of an IPv6 host
        return f"not a URL: {error}"
    if parts.scheme not in ("http", "https"):
        return "not an http:// or https:// URL"
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        return f"its port {parts.netloc.rpartition(':')[2]!r} is not a number from 1 to 65535"
    if not parts.hostname:
        return "it names no host"
    return None


def _ttl_from_env() -> float:
    """CCE_CONFIG_CACHE_TTL_S, or the default where it is unset or no finite, non-negative
    number (nan once made the TTL 0, silently turning the cache off; inf kept files forever)."""
    raw = os.environ.get(CACHE_TTL_ENV)
    if not raw:
        return DEFAULT_TTL_S
    try:
        ttl = float(raw)
    except ValueError:
        ttl = math.nan
    if not 0 <= ttl < math.inf:
        log.warning("ignoring %s=%r (not a finite, non-negative number of seconds); using %s",
                    CACHE_TTL_ENV, raw, DEFAULT_TTL_S)
        return DEFAULT_TTL_S
    return ttl


def parse_json(content: bytes) -> Any:
    """`content` as JSON, or None where it is not: malformed, not UTF-8, or nested deeper
    than the parser recurses (untrusted data must not raise RecursionError)."""
    try:
        return json.loads(content)
    except (ValueError, RecursionError):
        return None


def match_level_of(value: Any) -> str | None:
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
        # Non-blocking, and a regular file only: a FIFO at the path once held the op's first call forever.
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(descriptor, "rb") as file:
            if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                log.warning("config cache %s is not a regular file; ignoring it", path)
                return None
            content = file.read(MAX_CACHE_FILE_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as error:
        log.warning("config cache %s unreadable (%s); ignoring it", path, error)
        return None
    data = parse_json(content) if len(content) <= MAX_CACHE_FILE_BYTES else None
    stored_at = data.get("stored_at") if isinstance(data, dict) else None
    level = match_level_of(data.get("match_level")) if isinstance(data, dict) else None
    if isinstance(stored_at, bool) or not isinstance(stored_at, (int, float)) or level is None:
        log.warning("config cache %s is malformed; ignoring it", path)
        return None
    try:
        age = time.time() - stored_at
    except OverflowError:  # an integer no float holds (it raised out of the op's first call)
        age = math.nan
    if not 0 <= age <= settings.ttl_s:
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


def remove_cache(settings: Settings, platform: Platform, key: ProblemKey) -> None:
    """Forget the cached answer for `key` (its config failed to launch)."""
    path = cache_path(settings, platform, key)
    try:
        path.unlink(missing_ok=True)
    except OSError as error:
        log.warning("could not remove config cache %s: %s", path, error)


# --- bundled defaults -------------------------------------------------------------------


def bundled_config(platform: Platform, key: ProblemKey) -> Found | None:
    """The config shipped in the package for this GPU and key, if any (an exact match), and
    only if it was tuned for the kernels this process launches (its `kernel_version`)."""
    found = _bundled_index(BUNDLED_DIR).get((platform.gpu, key.v, key.d, key.dtype, key.n_bucket, key.mode))
    if found is None:
        return None
    version, config = found
    if version != platform.kernel_version:
        log.warning("bundled config for %s was tuned for kernel version %s, not %s; skipping it",
                    key, version, platform.kernel_version)
        return None
    return Found(config, "exact")


@lru_cache(maxsize=4)
def _bundled_index(directory: Path) -> dict[tuple[Any, ...], tuple[Any, Any]]:
    """Every bundled entry's (kernel_version, config) by (gpu, V, D, dtype, n_bucket, mode);
    bad files and entries are logged and skipped (read once per process)."""
    index: dict[tuple[Any, ...], tuple[Any, Any]] = {}
    for path in sorted(directory.glob("*.json")):
        try:
            entries = json.loads(path.read_text(encoding="utf-8"))["entries"]
            for number, entry in enumerate(entries):
                _add_bundled(index, entry, f"{path.name} entry {number}")
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as error:
            log.warning("bundled configs %s unreadable (%s: %s); skipping it", path, type(error).__name__, error)
    return index


BUNDLED_FIELDS = ("gpu", "V", "D", "dtype", "tokens", "mode", "kernel_version", "config")


def _add_bundled(index: dict[tuple[Any, ...], tuple[Any, Any]], entry: Any, where: str) -> None:
    fault = bundled_entry_fault(entry)
    if fault is not None:
        log.warning("bundled %s %s; skipping it", where, fault)
        return
    index[bundled_key(entry)] = (entry["kernel_version"], entry["config"])


def bundled_entry_fault(entry: Any) -> str | None:
    """Why the reader skips a bundled entry (`cce tune --bundle` refuses a file holding one);
    None for an entry it reads."""
    if not isinstance(entry, Mapping) or any(name not in entry for name in BUNDLED_FIELDS):
        return f"lacks one of {BUNDLED_FIELDS}"
    for name in ("V", "D", "tokens"):
        value = entry[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"has {name} {value!r}"
    # A key the op never asks for ("bf16", a V in quotes) matched nothing, unwarned, and the
    # file's sort by key (cce tune --bundle, after the whole run) raised on a V in quotes.
    if entry["dtype"] not in KEY_DTYPES:
        return f"has dtype {entry['dtype']!r}, not one of {KEY_DTYPES}"
    if entry["mode"] not in KEY_MODES:
        return f"has mode {entry['mode']!r}, not one of {KEY_MODES}"
    if not isinstance(entry["gpu"], str) or not isinstance(entry["kernel_version"], str):
        return "has a gpu or kernel_version that is not a string"
    return None


def bundled_key(entry: Mapping[str, Any]) -> tuple[Any, ...]:
    """A bundled entry's key: (normalized GPU name, V, D, dtype, token bucket, mode)."""
    gpu = normalize_gpu_name(str(entry["gpu"]))
    return (gpu, entry["V"], entry["D"], entry["dtype"], n_bucket(entry["tokens"]), entry["mode"])
