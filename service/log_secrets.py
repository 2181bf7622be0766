"""uvicorn's logs with secrets hidden: its access log writes each request line with its query
string, a refused one too, and its error log each WebSocket handshake's path with its query
string (where websockets or wsproto is installed: this app has no WebSocket route, so every
one is refused); a client may send a token there (its URL given as http://host/?token=...)
although every route takes tokens from the Authorization header only."""

from __future__ import annotations

import logging

from cce_compile.redact import redact_urls


class HiddenSecrets(logging.Filter):
    """Shows every text argument of a record as redact_urls does (token=***): the access log's
    (client, method, path, version, status), the error log's (client, path[, status])."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact_urls(arg) if isinstance(arg, str) else arg for arg in record.args)
        return True


_HIDDEN_SECRETS = HiddenSecrets()
_UVICORN_LOGGERS = ("uvicorn.access", "uvicorn.error")


def hide_secrets_in_uvicorn_logs() -> None:
    """Called by create_app, which each worker runs after uvicorn has set its logging up; the
    one filter is added once however many apps a process builds (the tests build many)."""
    for name in _UVICORN_LOGGERS:
        logging.getLogger(name).addFilter(_HIDDEN_SECRETS)
