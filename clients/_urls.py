"""Server URLs as they are shown: in error messages, reprs, reports and log lines."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

__all__ = ["redact_url"]

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
