"""The tuning service as a config source: one GET per key under one short deadline, a breaker.

httpx loads only when the service is asked, so `import cce_compile` stays free of the web stack.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from ..config.keys import KERNEL_NAME, ProblemKey
from ..redact import hide_secrets_in_http_client_logs, redact_urls
from .platform import Platform
from .sources import TOKEN_ENV, Found, Settings, match_level_of, parse_json, token_problem

log = logging.getLogger("cce_compile.config")

SERVICE_TIMEOUT_S = 1.5
"""The whole lookup's deadline, connect to last byte, retry included."""
JOIN_SLACK_S = 0.25
"""How long past the deadline the caller waits for the lookup's thread to hand its answer over."""
MAX_ANSWER_BYTES = 1 << 20
"""A config answer is about a kilobyte; anything near this is not one."""


_breaker_lock = threading.Lock()
_service_down: str | None = None
"""Why the service was given up on in this process (None: not given up)."""


def _unlock_in_forked_child() -> None:
    """The breaker's lock as ladder's: a fork while another thread held it left it held."""
    global _breaker_lock
    _breaker_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_unlock_in_forked_child)


def reset_breaker() -> None:
    global _service_down
    with _breaker_lock:
        _service_down = None


def _trip(url: str, reason: str) -> None:
    global _service_down
    with _breaker_lock:
        _service_down = reason
    log.warning("tuning service %s unusable (%s); not asking it again in this process",
                redact_urls(url), redact_urls(reason))


class ServiceUnusable(Exception):
    """The service could not be asked (unreachable, refused the token, answered an error)."""


class UnreadableAnswer(ServiceUnusable):
    """The service answered, but nothing this client reads as a config (not JSON, an unknown
    match level: another server at the URL, a newer service): a miss for the op, whose breaker
    stays closed so it asks again per key; an error for `cce lookup --url`."""


def fetch_from_service(settings: Settings, platform: Platform, key: ProblemKey) -> Found | None:
    """The service's best config for `key`, or None (no entry, offline, or unusable): the op's
    optional source. Any failure opens a process-wide breaker, so a dead service costs one
    deadline per process."""
    if settings.url is None or settings.offline or _service_down is not None:
        return None
    try:
        return ask_service(settings, platform, key)
    except UnreadableAnswer as error:
        log.warning("tuning service %s %s", redact_urls(settings.url), redact_urls(str(error)))
        return None
    except ServiceUnusable as error:
        _trip(settings.url, str(error))
        return None


def ask_service(settings: Settings, platform: Platform, key: ProblemKey) -> Found | None:
    """The service's best config for `key`, or None (no entry); raises ServiceUnusable, naming
    why, where the service could not be asked, UnreadableAnswer where its answer is unreadable.

    One retry for a dropped connection or a 5xx; a timeout is not retried. The whole
    lookup, retry included, has SERVICE_TIMEOUT_S (a server that dribbles its answer
    cannot stretch it) and reads at most MAX_ANSWER_BYTES."""
    assert settings.url is not None
    import asyncio

    # A thread of its own runs the event loop, so a caller already inside one (a notebook)
    # is served too. The loop's wait_for ends the request at the deadline, but asyncio.run then
    # waits for the resolver's thread (a DNS lookup that hangs took 8 s): so the caller waits
    # for the thread only a little past the deadline, and a daemon thread finishes on its own.
    answers: list[bytes | str | UnreadableAnswer] = []
    thread = threading.Thread(
        target=lambda: answers.append(asyncio.run(_fetch_within_deadline(settings, platform, key))),
        name="cce-config-lookup", daemon=True,
    )
    thread.start()
    thread.join(SERVICE_TIMEOUT_S + JOIN_SLACK_S)
    outcome = answers[0] if answers else f"no complete answer within {SERVICE_TIMEOUT_S}s (a hung name lookup?)"
    if isinstance(outcome, UnreadableAnswer):
        raise outcome
    if isinstance(outcome, str):
        raise ServiceUnusable(outcome)
    return _parse_answer(outcome)


async def _fetch_within_deadline(settings: Settings, platform: Platform, key: ProblemKey
                                 ) -> bytes | str | UnreadableAnswer:
    """The answer's body, or why the service is unusable."""
    import asyncio

    try:
        return await asyncio.wait_for(_fetch(settings, platform, key), SERVICE_TIMEOUT_S)
    except asyncio.TimeoutError:
        return f"no complete answer within {SERVICE_TIMEOUT_S}s"
    except Exception as error:  # an optional source: whatever fails (a body that is not the gzip it says, a port
        # out of range) is a miss and a tripped breaker, never the training step's exception
        while len(getattr(error, "exceptions", ())) == 1:  # a task group's one failure (the port out of
            error = error.exceptions[0]  # range): its group's text names no cause
        return f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"


async def _fetch(settings: Settings, platform: Platform, key: ProblemKey) -> bytes | str | UnreadableAnswer:
    import httpx

    hide_secrets_in_http_client_logs()
    assert settings.url is not None
    problem = token_problem(settings.token) if settings.token else None
    if problem is not None:
        return f"{TOKEN_ENV} {problem}"
    url = settings.url.rstrip("/") + "/v1/configs/best"
    headers = {"Authorization": f"Bearer {settings.token}"} if settings.token else {}
    failures: list[str] = []
    for _attempt in range(2):
        # A client (a connection) per attempt: uvicorn closes the connection it answered a 500 on, and
        # a retry on that one once failed at once (ReadError), never reaching the service, and named
        # the ReadError, not the 500, as the reason.
        async with httpx.AsyncClient(timeout=httpx.Timeout(SERVICE_TIMEOUT_S), headers=headers) as http:
            try:
                async with http.stream("GET", url, params=_query(platform, key)) as response:
                    body = await _read_capped(response)
                    status = response.status_code
            except httpx.TimeoutException as error:
                return "; then ".join([*failures, f"no answer within {SERVICE_TIMEOUT_S}s ({type(error).__name__})"])
            except (httpx.TransportError, httpx.InvalidURL) as error:
                failures.append(f"{type(error).__name__}: {error}")
                continue
        if body is None:
            return f"an answer over {MAX_ANSWER_BYTES} bytes"
        if status == 200:
            return body
        failure = f"HTTP {status}: {body[:200].decode('utf-8', 'replace')}"
        if status == 422 and _refuses_key_values(body):  # a miss for this key alone (2^63 tokens): the
            return UnreadableAnswer(f"refused the query ({failure})")  # breaker stays closed for the others
        failures.append(failure)
        if status < 500:
            break
    # Both attempts' reasons where they differ (a 500, then a dropped connection).
    return "; then ".join(dict.fromkeys(failures)) or "no attempt"


async def _read_capped(response: Any) -> bytes | None:
    """The body, or None once it passes MAX_ANSWER_BYTES (the rest is never read)."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


KEY_PARAMETERS = ("V", "D", "dtype", "tokens", "mode")
"""The query's parameters that differ from key to key; the rest are this process's platform."""


def _refuses_key_values(body: bytes) -> bool:
    """Whether a 422 names only the key's own values (a token bucket past the service's rules):
    a miss for that key alone. One naming the platform (a GPU name the service refuses), an
    unknown parameter (an older service) or not the service's validation body (another app at
    the URL) says the service is unusable for every key."""
    try:
        issues = parse_json(body)["detail"]
        return bool(issues) and all(
            issue["loc"][0] == "query" and issue["loc"][-1] in KEY_PARAMETERS for issue in issues)
    except (TypeError, KeyError, IndexError):
        return False


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


def _parse_answer(body: bytes) -> Found | None:
    """A GET /v1/configs/best body as a Found; None for 'no entry'; UnreadableAnswer for
    anything else (not JSON, nested past the parser's depth, not an object, an unknown level)."""
    data = parse_json(body)
    if not isinstance(data, dict):
        raise UnreadableAnswer(f"answered no JSON object: {body[:200]!r}")
    if data.get("match_level") == "none":
        return None
    level = match_level_of(data.get("match_level"))
    if level is None:
        raise UnreadableAnswer(f"answered an unknown match level {data.get('match_level')!r}")
    return Found(data.get("config"), level)
