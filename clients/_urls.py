"""Server URLs as they are shown: in error messages, reprs, reports and log lines."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from embedding_store.errors import InvalidArgumentError

__all__ = ["redact_url", "refuse_credentials"]

#: ``//user:password@`` (or ``user:password@`` at the start: a gRPC target), for what
#: urlsplit cannot parse (an invalid IPv6 host, say): the password is up to the last "@"
#: before the path, as urlsplit reads it.
_USERINFO = re.compile(r"(^|//)([^/?#@:]*):[^/?#]*@")


def redact_url(url: str) -> str:
    """``url`` with the password of its ``user:password@`` part replaced by ``***``
    (``http://ann:***@host:8000``); any other text unchanged. For ``http(s)://`` and
    ``grpc(s)://`` URLs and bare ``[user:password@]host:port`` targets."""
    try:
        netloc = urlsplit(url if "://" in url else "//" + url).netloc
    except ValueError:
        return _USERINFO.sub(r"\1\2:***@", url, count=1)
    userinfo, at, host = netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.split(":", 1)[0]
    return url.replace(netloc, f"{user}:***@{host}", 1)


def redact_userinfo(text: str, url: str) -> str:
    """``text`` (a library's error message) with the ``user:password@`` part of ``url``, where
    it appears, shown as ``user:***@`` (gRPC names its target, password and all, in the
    details of a failed call)."""
    try:
        netloc = urlsplit(url if "://" in url else "//" + url).netloc
    except ValueError:
        return _USERINFO.sub(r"\1\2:***@", text)
    userinfo, at, _ = netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return text
    return text.replace(userinfo + "@", userinfo.split(":", 1)[0] + ":***@")


def refuse_credentials(
    netloc: str,
    what: str,
    cert_key: tuple[str, str],
    tls_urls: str = "https:// or grpcs://",
    *,
    reason: str | None = None,
) -> None:
    """InvalidArgumentError when ``netloc`` (a URL's ``urlsplit(...).netloc``) has a
    ``user[:password]@`` part: no client sends it (urllib3 drops it, gRPC takes it as part of
    the host name, urllib tries to resolve it), and the server takes no credentials in the URL,
    so such a URL would silently never authenticate. ``what`` names the URL (``server URL
    'http://ann:***@h:8000'``: already redacted); ``cert_key`` the options of a client
    certificate (mutual TLS: how a client authenticates), for a URL of ``tls_urls``.
    ``reason``, when given, replaces what follows "has credentials (user:password@): " for
    a caller whose client does send them or has no certificate options (the load tests)."""
    if "@" not in netloc:
        return
    cert, key = cert_key
    if reason is None:
        reason = (
            "they are never sent, and the server takes no credentials in the URL; remove "
            f"them (to authenticate a client, use mutual TLS: an {tls_urls} URL with {cert} "
            f"and {key})"
        )
    raise InvalidArgumentError(f"{what} has credentials (user:password@): {reason}")
