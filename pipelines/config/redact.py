"""Credentials kept out of messages: :func:`redact_uri` (passwords in URIs, secret query parameters) and
:func:`shown` (a value as a message prints it: cut short, redacted).  Standard library only, so that both the URI
checks (:mod:`pipelines.config.uris`) and the error translator (:mod:`pipelines.config.errors`) use it."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote

__all__ = ["redact_uri", "redact_credentials", "secret_query_name", "shown"]

_USERINFO_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^/@\s:]*):[^/@\s]*@")
#: A query parameter (``?name=value``, ``&name=value``, ``;name=value``); :func:`secret_query_name` judges the name.
_QUERY_PARAM_RE = re.compile(r"([?&;])([A-Za-z0-9_.-]+)(=)([^&;#\s'\"]+)")
#: Parts of a parameter name that mark its value as a secret wherever they occur (``access_token``, ``X-Amz-Signature``,
#: ``client_secret``, ``passwd``).
_SECRET_PARTS = ("token", "secret", "password", "passwd", "passphrase", "signature", "credential")
#: Words of a parameter name that mark a secret only as a whole word (``sig`` but not ``design``, ``auth`` but not
#: ``author``).
_SECRET_WORDS = frozenset(
    {"auth", "authorization", "pass", "pwd", "sig", "jwt", "apikey", "accesskey", "privatekey", "sharedkey", "sas"}
)
#: A ``key`` is a secret when it stands alone (``?key=``) or after one of these words (``api_key``, ``AccessKeyId``,
#: ``x-api-key``); any other key names something (``viewStateShareKey``, ``sortKey``), it does not unlock anything.
_KEY_QUALIFIERS = frozenset(
    {"api", "access", "secret", "private", "auth", "client", "account", "subscription", "session", "signing", "shared"}
    | {"master", "encryption", "license", "app", "consumer", "storage", "service", "sas"}
)


def _name_words(name: str) -> list[str]:
    """``X-Amz-Security-Token`` → x, amz, security, token; ``AWSAccessKeyId`` → aws, access, key, id."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", name)
    spaced = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1 \2", spaced)
    return [w.lower() for w in re.split(r"[\s_.-]+", spaced) if w]


def secret_query_name(name: str) -> bool:
    """Whether a query parameter called ``name`` carries a secret: a token, signature, password, credential or an
    API/access key (``?token=``, ``X-Amz-Signature``, ``api_key``, ``?key=``) — not a parameter that only has a
    ``key`` in its name (``viewStateShareKey``)."""
    lower = name.lower()
    if any(part in lower for part in _SECRET_PARTS):
        return True
    words = _name_words(name)
    if any(w in _SECRET_WORDS for w in words):
        return True
    for i, w in enumerate(words):
        if w in ("key", "keys") and (len(words) == 1 or (i > 0 and words[i - 1] in _KEY_QUALIFIERS)):
            return True
    return False


def _redact_query(m: re.Match) -> str:
    return m.group(1) + m.group(2) + m.group(3) + ("***" if secret_query_name(m.group(2)) else m.group(4))


def redact_uri(text: str) -> str:
    """Replace the password of every ``scheme://user:password@host`` and the value of every query parameter that
    carries a secret (:func:`secret_query_name`: ``?token=...``, ``?api_key=...``) in ``text`` by ``***``."""
    if not isinstance(text, str):
        return text
    return _QUERY_PARAM_RE.sub(_redact_query, _USERINFO_RE.sub(r"\1:***@", text))


#: The user and password of a ``scheme://user:password@host`` (what stands before the last ``@`` of the authority).
_AUTHORITY_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://([^/?#]*)@")


def redact_credentials(text: str, uri: str) -> str:
    """``text`` (a library's error message about ``uri``) with every occurrence of ``uri``'s own user and password
    replaced by ``***`` — as written and percent-decoded —, then :func:`redact_uri`.  A library that parses the URI
    its own way (botocore reads ``s3://KEY:SECRET@bucket`` as a bucket named ``KEY:SECRET@bucket``) quotes them where
    no ``scheme://user:password@`` pattern is left to find."""
    m = _AUTHORITY_RE.match(uri) if isinstance(uri, str) else None
    if m and isinstance(text, str):
        user, _, password = m.group(1).partition(":")
        parts = {m.group(1), user, password, unquote(m.group(1)), unquote(user), unquote(password)} - {""}
        for secret in sorted(parts, key=len, reverse=True):  # user:password before its parts
            text = text.replace(secret, "***")
    return redact_uri(text)


def shown(v: Any, n: int = 60) -> str:
    """``repr(v)`` cut to ``n`` characters, credentials removed (messages never echo a password)."""
    r = redact_uri(repr(v))
    return r if len(r) <= n else r[: n - 3] + "..."
