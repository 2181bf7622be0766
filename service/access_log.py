"""uvicorn's access log with secrets hidden: it logs each request line with its query string,
a refused one too, and a client may send a token there (its URL given as http://host/?token=...)
although every route takes tokens from the Authorization header only."""

from __future__ import annotations

import logging

from cce_compile.redact import redact_urls


class HiddenSecrets(logging.Filter):
    """Shows the path of uvicorn's access records, (client, method, path, version, status),
    as redact_urls does (token=***)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and len(record.args) == 5:
            client, method, path, version, status = record.args
            record.args = (client, method, redact_urls(str(path)), version, status)
        return True


_HIDDEN_SECRETS = HiddenSecrets()


def hide_secrets_in_access_log() -> None:
    """Called by create_app, which each worker runs after uvicorn has set its logging up; the
    one filter is added once however many apps a process builds (the tests build many)."""
    logging.getLogger("uvicorn.access").addFilter(_HIDDEN_SECRETS)
