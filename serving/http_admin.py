"""Admin routes of the HTTP front end: their callbacks and who may call them."""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import Request


@dataclass(frozen=True)
class AdminHooks:
    """Admin callbacks. ``reload(checkpoint)`` gets the body's ``"checkpoint"`` (or None) and
    returns a JSON-able dict. Allowed with ``Authorization: Bearer <token>`` (when ``token`` is
    set), or from a loopback client that sends no Authorization and no Origin header; 403
    otherwise."""

    reload: Callable[[str | None], dict]
    token: str | None = None


def _is_loopback(host: str | None) -> bool:
    if not host:
        return False
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host == "localhost"
    mapped = getattr(address, "ipv4_mapped", None)
    return bool(address.is_loopback or (mapped is not None and mapped.is_loopback))


def admin_allowed(request: Request, token: str | None) -> bool:
    """Bearer token when one is sent (it must match), else only loopback clients that are
    not a browser's page: a web page open on the server's host may POST to 127.0.0.1
    (a form needs no CORS preflight), and its browser says so in an Origin header, which
    curl, kubectl exec and the recserve clients never send."""
    authorization = request.headers.get("authorization")
    if authorization is not None:
        scheme, _, credential = authorization.partition(" ")
        return (
            token is not None
            and scheme.lower() == "bearer"
            and hmac.compare_digest(credential.strip().encode(), token.encode())
        )
    if request.headers.get("origin") is not None:
        return False
    return _is_loopback(request.client.host if request.client else None)
