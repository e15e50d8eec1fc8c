"""A tier channel that follows renewed TLS files (:class:`RenewingTierChannel`).

A long-lived gRPC channel keeps the credentials it was built with: after cert-manager renews
the tier's certificate, a reconnect (a shard restarted) would present the old one, refused
once it expired or the CA changed. This channel builds a new gRPC channel with the renewed
files before its next call and retires the old one once its calls in flight ended.
:func:`embedding_store.grpc_common.tier_channel` makes one for every tier client under
mutual TLS with renewals looked for.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc

from embedding_store.tls_reload import ReloadingTls

if TYPE_CHECKING:
    from embedding_store.grpc_common import TierTls

log = logging.getLogger(__name__)


#: The health check's full method name: reads only, safe to send twice.
HEALTH_CHECK_METHOD = "/grpc.health.v1.Health/Check"

#: At most one look at the TLS files per this many seconds (and per channel) after a call
#: failed UNAVAILABLE: a peer down fails every call at once, and each would look.
_LOOK_AFTER_FAILURE_SECONDS = 1.0


class _Link:
    """One gRPC channel of a :class:`RenewingTierChannel`, made with TLS generation
    ``generation``, and its calls in flight (counted under the owner's lock)."""

    __slots__ = ("channel", "generation", "in_flight", "retired")

    def __init__(self, channel: grpc.Channel, generation: int) -> None:
        self.channel = channel
        self.generation = generation
        self.in_flight = 0
        self.retired = False  # replaced: closed once in_flight is back to 0


class RenewingTierChannel(grpc.Channel):
    """A tier channel under mutual TLS that follows renewed files (one for every tier
    client: parameter-server, worker and data-loader channels).

    Before each call it asks the files (:meth:`ReloadingTls.check`: a clock read, and every
    ``RECSERVE_TIER_TLS_RELOAD_SECONDS`` a stat); once they were reloaded into a generation
    newer than its channel's, it builds a channel with them and sends this call and later
    ones there. The replaced channel is closed once the calls in flight on it ended (each
    has a deadline), never under them: other threads may be using it. A unary call that
    fails UNAVAILABLE (a peer restarted with the renewed files refuses the old certificate)
    makes it look at the files at once (at most once a second): when they were renewed,
    the next call uses them, and a call named in ``retry_safe`` is sent again, once, on the
    new channel within what is left of its deadline. Other calls (a gradient update) are
    never sent twice: they fail as before, and the caller's own rules apply.

    Stubs take it as any channel: their multi-callables pick the current channel per call.
    Thread-safe."""

    def __init__(
        self,
        address: str,
        options: list[tuple[str, Any]],
        files: ReloadingTls[TierTls],
        wrap: Callable[[grpc.Channel], grpc.Channel] | None = None,
        retry_safe: frozenset[str] = frozenset(),
    ) -> None:
        self.address = address
        self.retry_safe = retry_safe
        self._options = options
        self._files = files
        self._wrap = wrap
        self._lock = threading.Lock()
        self._closed = False
        self._next_look = 0.0  # monotonic time of the next look after a failure
        generation, tls = files.check()
        self._link = self._connect(generation, tls)
        self._retired: list[_Link] = []  # replaced, with calls still in flight

    def _connect(self, generation: int, tls: TierTls) -> _Link:
        channel = grpc.secure_channel(
            self.address, tls.channel_credentials(), options=self._options
        )
        if self._wrap is not None:  # the tier token's interceptor
            channel = self._wrap(channel)
        return _Link(channel, generation)

    @property
    def generation(self) -> int:
        """The TLS generation (:attr:`ReloadingTls.current`) the current channel was made
        with."""
        return self._link.generation

    # ------------------------------------------------------------------ calls in flight
    def _begin(self) -> _Link:
        """The channel for a call about to start, renewed first if the files were; the
        call counts as in flight on it until :meth:`_end`."""
        generation, tls = self._files.check()
        replaced: _Link | None = None
        idle = False
        with self._lock:
            link = self._link
            if generation > link.generation and not self._closed:
                replaced, link = link, self._connect(generation, tls)
                self._link = link
                replaced.retired = True
                idle = not replaced.in_flight
                if not idle:  # closed by the _end of its last call
                    self._retired.append(replaced)
            link.in_flight += 1
        if replaced is not None:
            log.debug(
                "tier channel to %s: TLS files renewed (generation %d), new channel",
                self.address,
                generation,
            )
            if idle:
                replaced.channel.close()
        return link

    def _end(self, link: _Link, *, in_callback: bool = False) -> None:
        """A call on ``link`` ended: close ``link`` if it was replaced and this was its
        last call. ``in_callback``: gRPC runs the caller (a call's done-callback), which
        must not close a channel from under itself: a thread of its own does."""
        with self._lock:
            link.in_flight -= 1
            close = link.retired and not link.in_flight and link in self._retired
            if close:
                self._retired.remove(link)
        if close:
            if in_callback:
                threading.Thread(
                    target=link.channel.close, name="tier-channel-close", daemon=True
                ).start()
            else:
                link.channel.close()

    def _ended_on(self, call: Any, link: _Link) -> Any:
        """``call`` (a future or a response stream) counted in flight on ``link`` until it
        ends (at the latest at its deadline)."""
        call.add_done_callback(lambda _: self._end(link, in_callback=True))
        return call

    def _renewed_since(self, link: _Link, error: grpc.RpcError) -> bool:
        """True when ``error`` is UNAVAILABLE and the files, looked at now, were renewed
        since ``link`` was made."""
        code = error.code() if hasattr(error, "code") else None
        if code != grpc.StatusCode.UNAVAILABLE:
            return False
        if self._files.current[0] > link.generation:
            return True
        now = time.monotonic()
        if now < self._next_look:
            return False
        self._next_look = now + _LOOK_AFTER_FAILURE_SECONDS
        self._files.reload_now()
        return self._files.current[0] > link.generation

    def _blocking(
        self, multi: _Multi, how: str, request: Any, timeout: float | None, kwargs: Any
    ) -> Any:
        """A blocking call (``how``: ``"__call__"`` or ``"with_call"``), sent again once on
        a renewed channel if it is safe to and failed as :meth:`_renewed_since` says."""
        started = time.monotonic()
        link = self._begin()
        try:
            return getattr(multi.on(link), how)(request, timeout=timeout, **kwargs)
        except grpc.RpcError as error:
            if not self._renewed_since(link, error) or not multi.retry:
                raise
            left = None if timeout is None else timeout - (time.monotonic() - started)
            if left is not None and left <= 0:
                raise
            log.info(
                "%s to %s failed on a channel with the old TLS files (%s): sent again with "
                "the renewed ones",
                multi.method,
                self.address,
                error.details() if hasattr(error, "details") else error,
            )
        finally:
            self._end(link)
        link = self._begin()
        try:
            return getattr(multi.on(link), how)(request, timeout=left, **kwargs)
        finally:
            self._end(link)

    def _streamed(self, multi: _Multi, how: str, request: Any, kwargs: Any) -> Any:
        """A call that returns before it ends (a future, a response stream): never sent
        twice; in flight on its channel until its done-callback."""
        link = self._begin()
        try:
            call = getattr(multi.on(link), how)(request, **kwargs)
        except BaseException:
            self._end(link)
            raise
        return self._ended_on(call, link)

    # ------------------------------------------------------------------ grpc.Channel
    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _UnaryUnary(self, "unary_unary", method, args, kwargs)

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Streamed(self, "unary_stream", method, args, kwargs)

    def stream_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _StreamUnary(self, "stream_unary", method, args, kwargs)

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Streamed(self, "stream_stream", method, args, kwargs)

    def subscribe(self, callback: Callable[..., Any], try_to_connect: bool = False) -> None:
        """Connectivity of the current channel (a renewal does not carry it over)."""
        self._link.channel.subscribe(callback, try_to_connect=try_to_connect)

    def unsubscribe(self, callback: Callable[..., Any]) -> None:
        self._link.channel.unsubscribe(callback)

    def close(self) -> None:
        """Close every channel, cancelling the calls in flight (as a gRPC channel does)."""
        with self._lock:
            self._closed = True
            links = [self._link, *self._retired]
            self._retired.clear()
        for link in links:
            link.channel.close()

    def __enter__(self) -> RenewingTierChannel:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _Multi:
    """A multi-callable of a :class:`RenewingTierChannel`: made again on each channel the
    renewals bring (the last one kept), so stubs built once keep working."""

    def __init__(
        self,
        owner: RenewingTierChannel,
        kind: str,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        self.owner = owner
        self.method = method
        self.retry = method in owner.retry_safe
        self._kind = kind
        self._args = args
        self._kwargs = kwargs
        self._made: tuple[_Link | None, Any] = (None, None)  # one attribute: read atomically

    def on(self, link: _Link) -> Any:
        """This multi-callable on ``link``'s channel."""
        made_on, made = self._made
        if made_on is not link:
            made = getattr(link.channel, self._kind)(self.method, *self._args, **self._kwargs)
            self._made = (link, made)
        return made


class _UnaryUnary(_Multi):
    def __call__(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        return self._blocking("__call__", request, args, kwargs)

    def with_call(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        return self._blocking("with_call", request, args, kwargs)

    def _blocking(
        self, how: str, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        extra = _keywords(args, kwargs)
        timeout = extra.pop("timeout", None)
        return self.owner._blocking(self, how, request, timeout, extra)

    def future(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        return self.owner._streamed(self, "future", request, _keywords(args, kwargs))


class _StreamUnary(_Multi):
    """A request stream cannot be sent twice: never retried."""

    def __call__(self, requests: Any, *args: Any, **kwargs: Any) -> Any:
        link = self.owner._begin()
        try:
            return self.on(link)(requests, **_keywords(args, kwargs))
        except grpc.RpcError as error:
            self.owner._renewed_since(link, error)  # the next call takes renewed files
            raise
        finally:
            self.owner._end(link)

    def with_call(self, requests: Any, *args: Any, **kwargs: Any) -> Any:
        link = self.owner._begin()
        try:
            return self.on(link).with_call(requests, **_keywords(args, kwargs))
        except grpc.RpcError as error:
            self.owner._renewed_since(link, error)
            raise
        finally:
            self.owner._end(link)

    def future(self, requests: Any, *args: Any, **kwargs: Any) -> Any:
        return self.owner._streamed(self, "future", requests, _keywords(args, kwargs))


class _Streamed(_Multi):
    """Response streams: in flight until they end; never retried (their answers may have
    been read in part)."""

    def __call__(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        return self.owner._streamed(self, "__call__", request, _keywords(args, kwargs))


_CALL_KEYWORDS = ("timeout", "metadata", "credentials", "wait_for_ready", "compression")


def _keywords(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """A multi-callable's arguments after the request, as keywords (gRPC's order)."""
    return {**dict(zip(_CALL_KEYWORDS, args, strict=False)), **kwargs}
