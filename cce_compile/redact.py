"""URLs fit to print: a password or token a user put in a URL must not reach a terminal, a CI
log or a bug report through an error message or a log line that names the URL.

Standard library only: the op's service client logs with it (no web or database stack
loaded), the `cce` command's errors and the database layer too.
"""

from __future__ import annotations

import re

HIDDEN = "***"
"""What a secret is shown as (SQLAlchemy's `hide_password` shows a password alike)."""

_USERINFO_PASSWORD = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<user>[^/?#\s:@]*):[^/?#\s]*@")
"""`scheme://user:password@`: the password is whatever lies between the first ':' and the
last '@' of the authority, which ends at the first '/', '?' or '#' (an unescaped '@' in a
password stays inside it; one in the query, `?next=a@b`, is not a password's end)."""
_SECRET_WORD = (r"(?i:[a-z0-9]*(?:token|secret|passw(?:or)?d)|pwd|(?:api)?key|auth|authorization|signature|sig"
                r"|credentials?)")
"""A word of a parameter's name that says its value is a secret; token, secret and password
also end one (accesstoken, authtoken), where no harmless word ends so."""
_SECRET_PARAMETER = re.compile(
    rf"(?P<name>[?&#;](?:[^=&#;\s]*?(?:[\-_.]|(?<=[a-z0-9])(?=[A-Z])))?{_SECRET_WORD}"
    r"(?:(?=[=\-_.])|(?<=[a-z])(?=[A-Z]))[^=&#;\s]*=)"
    r"(?:[^&#;\s'\"()<>,:]|:(?!\s|$))*"
)
"""A query or fragment parameter with a secret word in its name, words split at '_', '-', '.'
or where camelCase starts one (token=, access_token=, api_key=, apiKey=, X-Amz-Signature=;
not a substring: tokens=, monkey=, author=, design= are shown): its value up to the next
separator, a space, a quote, a bracket, or a colon that ends the URL in a message ('URL: reason')."""


def redact_urls(text: str) -> str:
    """`text` with the password of every URL in it, and the value of every query parameter
    that names a secret, shown as ***; the rest (scheme, user, host, path) kept, which says
    which URL it was. For any message: a URL, or an error that may quote one."""
    text = _USERINFO_PASSWORD.sub(lambda match: f"{match['scheme']}{match['user']}:{HIDDEN}@", text)
    return _SECRET_PARAMETER.sub(lambda match: f"{match['name']}{HIDDEN}", text)
