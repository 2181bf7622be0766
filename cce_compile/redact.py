"""URLs fit to print: a password or token a user put in a URL must not reach a terminal, a CI
log or a bug report through an error message or a log line that names the URL.

Standard library only: the op's service client logs with it (no web or database stack
loaded), the `cce` command's errors and the database layer too.
"""

from __future__ import annotations

import logging
import re
from urllib.parse import unquote

HIDDEN = "***"
"""What a secret is shown as (SQLAlchemy's `hide_password` shows a password alike)."""

_USERINFO_PASSWORD = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]{0,31}://)(?P<user>[^/?#\s:@]*):[^/?#\s]*@")
"""`scheme://user:password@`: the password is whatever lies between the first ':' and the
last '@' of the authority, which ends at the first '/', '?' or '#' (an unescaped '@' in a
password stays inside it; one in the query, `?next=a@b`, is not a password's end). The
scheme's length is bounded (a longer run matches as its last 32 characters), or each
character of a long word would start a scan to its end: quadratic in a client's request line."""
_SECRET_WORD = (r"(?i:[a-z0-9]*(?:token|secret|passw(?:or)?d)|pwd"
                r"|(?:api|access|account|auth|client|encryption|master|private|secret|session|shared|signing)?key"
                r"|auth|authorization|signature|sig|credentials?)")
"""A word of a parameter's name that says its value is a secret; token, secret and password
also end one (accesstoken, authtoken), where no harmless word ends so; key ends harmless
words (monkey, turkey), so only a secret's own compounds (apikey, secretkey, privatekey)."""
_SECRET_NAME = re.compile(
    rf"(?:^|(?<=[?\-_.\[])|(?<=[a-z0-9])(?=[A-Z])){_SECRET_WORD}(?:(?=[\-_.\[\]]|$)|(?<=[a-z])(?=[A-Z]))"
)
"""A secret word in a parameter's name, words split at '_', '-', '.', brackets (token[]=,
user[password]=, as web frameworks nest them) or where camelCase starts one (token,
access_token, api_key, apiKey, X-Amz-Signature; not a substring: tokens, monkey, author,
design are shown), or at a '?' in it (each '?' starts a name: ?a?token=)."""
_NAME_RUN = re.compile(r"(?<![^=&#;\s])(?P<run>[^=&#;\s]+)=")
"""What stands before a '=' back to the last '&', '#', ';', '=' or space: a parameter's name
after the '&', '#' or ';' before it or after the first '?' in it. A run starts only where
the one before it ends, so no character is scanned twice: linear in the text, which may be a
client's request line (the service's access log)."""
_RUN_FROM = re.compile(r"(?P<run>[^=&#;\s]+)=")
"""The rest of a run from where a secret's value ended inside it, up to its '='."""
_LONGEST_NAME = 128
"""Names longer than this are hidden unread: _SECRET_NAME tries a secret word from each of a
name's word boundaries, which is quadratic in the name (16 KiB of 'aA' took ~4 s)."""
_VALUE = re.compile(r"(?:[^&#;\s'\"()<>,:]|:(?!\s|$))*")
"""A parameter's value: up to the next separator, a space, a quote, a bracket, or a colon that
ends the URL in a message ('URL: reason')."""


def _names_a_secret(text: str, run_start: int, run: str) -> bool:
    """Whether the name in `run` (text[run_start:] up to a '=') says its value is a secret."""
    if run_start > 0 and text[run_start - 1] in "&#;":
        name = run
    elif "?" in run:
        name = run[run.index("?") + 1:]
    else:
        return False  # no '?', '&', '#' or ';' starts a name in it
    # a server decodes a name before reading it, so ?%74oken= is a token's
    return len(name) > _LONGEST_NAME or _SECRET_NAME.search(unquote(name)) is not None


def _hide_secret_values(text: str) -> str:
    """`text` with the value of each parameter whose name says it is a secret's (or is too long
    to read) shown as ***. Another parameter's value is searched on: a URL in it may have its own."""
    pieces, shown = [], 0
    parameter = _NAME_RUN.search(text)
    while parameter is not None:
        at = parameter.end()
        if _names_a_secret(text, parameter.start(), parameter["run"]):
            pieces += [text[shown:at], HIDDEN]
            shown = at = _VALUE.match(text, at).end()
            # A value may end inside a run (at a quote, a bracket, a comma), whose '?' starts a name.
            parameter = _RUN_FROM.match(text, at) or _NAME_RUN.search(text, at)
        else:
            parameter = _NAME_RUN.search(text, at)
    return "".join(pieces) + text[shown:]


def redact_urls(text: str) -> str:
    """`text` with the password of every URL in it, and the value of every query parameter
    that names a secret, shown as ***; the rest (scheme, user, host, path) kept, which says
    which URL it was. For any message: a URL, or an error that may quote one."""
    text = _USERINFO_PASSWORD.sub(lambda match: f"{match['scheme']}{match['user']}:{HIDDEN}@", text)
    return _hide_secret_values(text)


class _HiddenInRecords(logging.Filter):
    """A record's arguments other than numbers shown as redact_urls shows them: httpx logs each
    request's URL (an httpx.URL, not text) at INFO, its password and query with it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(arg if arg is None or isinstance(arg, (int, float)) else redact_urls(str(arg))
                                for arg in record.args)
        return True


_HIDDEN_IN_RECORDS = _HiddenInRecords()


def hide_secrets_in_http_client_logs() -> None:
    """Called where a client of the service loads httpx: a program that logs at INFO (a training
    script's logging.basicConfig) otherwise writes 'HTTP Request: GET http://user:password@...'.
    The one filter is added once however often this is called."""
    logging.getLogger("httpx").addFilter(_HIDDEN_IN_RECORDS)
