"""The tuning service as a config source: one GET per key, short timeouts, a breaker.

httpx loads only when the service is asked, so `import cce_compile` stays free of the web stack.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from ..config.keys import KERNEL_NAME, ProblemKey
from .platform import Platform
from .sources import Found, Settings, match_level_of

log = logging.getLogger("cce_compile.config")

SERVICE_TIMEOUT_S = 1.5


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
    level = match_level_of(body.get("match_level"))
    if level is None:
        log.warning("tuning service %s answered an unknown match level %r", url, body.get("match_level"))
        return None
    return Found(body.get("config"), level)


