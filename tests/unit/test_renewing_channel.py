"""RenewingTierChannel's rules, on fake gRPC channels and a fake clock: one channel until a
renewal, the replaced one closed when its last call in flight ends (at once when idle, on a
thread of its own from a done-callback, once only), and after UNAVAILABLE on a replaced
channel a read sent again once within what is left of its deadline, never another call."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from embedding_store import renewing_channel
from embedding_store.renewing_channel import RenewingTierChannel

READ, WRITE = "/t.S/Lookup", "/t.S/Update"


class Clock:
    """Stands in for the module's ``time``: ``monotonic()`` moves only when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class Tls:
    """A TierTls of generation ``generation``: its credentials are the generation."""

    def __init__(self, generation: int) -> None:
        self.generation = generation

    def channel_credentials(self) -> int:
        return self.generation


class Files:
    """A ReloadingTls whose interval is never due: ``renew()`` is what a due check finds,
    ``renew_on_look()`` what only a look after a failure (``reload_now``) finds."""

    def __init__(self) -> None:
        self.current: tuple[int, Tls] = (0, Tls(0))
        self.pending = False
        self.looks = 0

    def renew(self) -> None:
        self.current = (self.current[0] + 1, Tls(self.current[0] + 1))

    def renew_on_look(self) -> None:
        self.pending = True

    def check(self) -> tuple[int, Tls]:
        return self.current

    def reload_now(self) -> bool:
        self.looks += 1
        if self.pending:
            self.pending = False
            self.renew()
            return True
        return False


class Error(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._code.name


class Call:
    """A call that returns before it ends (future, response stream)."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[Any], None]] = []

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        self.callbacks.append(callback)

    def finish(self) -> None:
        for callback in self.callbacks:
            callback(self)


class Net:
    """The fake gRPC: channels made (``made``), calls sent (generation, method, request,
    timeout), and ``answer(generation, method)`` deciding each blocking call's outcome."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.made: list[Channel] = []
        self.sent: list[tuple[int, str, Any, float | None]] = []
        self.answer: Callable[[int, str], Any] = lambda generation, method: f"ok {generation}"

    def secure_channel(self, address: str, credentials: int, options: Any = None) -> Channel:
        channel = Channel(self, credentials)
        self.made.append(channel)
        return channel


class Channel:
    def __init__(self, net: Net, generation: int) -> None:
        self.net = net
        self.generation = generation
        self.closes: list[str] = []  # the name of the thread that closed it, per close

    def close(self) -> None:
        self.closes.append(threading.current_thread().name)

    def _multi(self, method: str, *args: Any, **kwargs: Any) -> Multi:
        return Multi(self, method)

    unary_unary = unary_stream = stream_unary = stream_stream = _multi


class Multi:
    def __init__(self, channel: Channel, method: str) -> None:
        self.channel = channel
        self.method = method

    def _send(self, request: Any, timeout: float | None) -> Any:
        if self.channel.closes:
            raise ValueError("Cannot invoke RPC on closed channel!")
        net = self.channel.net
        net.sent.append((self.channel.generation, self.method, request, timeout))
        outcome = net.answer(self.channel.generation, self.method)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def __call__(self, request: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        if self.method.endswith("Stream"):
            self._send(request, timeout)
            return Call()
        return self._send(request, timeout)

    def with_call(self, request: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        return self._send(request, timeout)

    def future(self, request: Any, timeout: float | None = None, **kwargs: Any) -> Call:
        self._send(request, timeout)
        return Call()


@pytest.fixture
def net(monkeypatch) -> Net:
    clock = Clock()
    net = Net(clock)
    monkeypatch.setattr(renewing_channel, "time", clock)
    monkeypatch.setattr(renewing_channel.grpc, "secure_channel", net.secure_channel)
    return net


def channel(files: Files) -> RenewingTierChannel:
    return RenewingTierChannel("shard:1", [], files, retry_safe=frozenset({READ}))


def test_one_channel_until_a_renewal_then_the_idle_one_closes_at_once(net):
    files = Files()
    tier = channel(files)
    read = tier.unary_unary(READ)
    assert [read(b"1", timeout=5), read(b"2", timeout=5)] == ["ok 0", "ok 0"]
    assert len(net.made) == 1
    files.renew()
    assert read(b"3", timeout=5) == "ok 1"  # the stub built before follows
    assert [(c.generation, c.closes) for c in net.made] == [
        (0, [threading.current_thread().name]),
        (1, []),
    ]
    assert tier._retired == []
    assert tier.generation == 1
    tier.close()
    files.renew()  # after close: nothing new is made, the call fails as on a closed channel
    with pytest.raises(ValueError, match="closed channel"):
        read(b"4", timeout=5)
    assert [(c.generation, len(c.closes)) for c in net.made] == [(0, 1), (1, 1)]
    assert [s[:3] for s in net.sent] == [(0, READ, b"1"), (0, READ, b"2"), (1, READ, b"3")]


def test_a_replaced_channel_closes_after_its_last_call_on_a_thread_of_its_own(net):
    files = Files()
    tier = channel(files)
    future = tier.unary_unary(READ).future(b"f", 5.0)  # timeout given by position
    stream = tier.unary_stream("/t.S/ExportStream")(b"s", timeout=7.0)
    files.renew()
    assert tier.unary_unary(READ)(b"r", timeout=5) == "ok 1"
    old = net.made[0]
    assert old.closes == []  # two calls in flight on it
    future.finish()
    assert old.closes == []  # one still in flight
    stream.finish()
    deadline = time.monotonic() + 5
    while not old.closes:
        assert time.monotonic() < deadline, "the replaced channel was not closed"
        time.sleep(0.01)
    assert old.closes == ["tier-channel-close"]  # never from gRPC's callback thread
    assert tier._retired == []
    assert [s[1:] for s in net.sent] == [
        (READ, b"f", 5.0),
        ("/t.S/ExportStream", b"s", 7.0),
        (READ, b"r", 5),
    ]
    tier.close()
    assert [len(c.closes) for c in net.made] == [1, 1]


def test_close_closes_replaced_channels_with_calls_in_flight_once(net):
    files = Files()
    tier = channel(files)
    future = tier.unary_unary(READ).future(b"f", timeout=5)
    files.renew()
    tier.unary_unary(READ)(b"r", timeout=5)
    tier.close()
    assert [len(c.closes) for c in net.made] == [1, 1]
    future.finish()  # its call ended (cancelled by the close): nothing more to close
    time.sleep(0.05)  # a close thread, were one started, has run
    assert [len(c.closes) for c in net.made] == [1, 1]


def test_a_call_that_cannot_start_is_not_left_in_flight(net):
    files = Files()
    tier = channel(files)
    net.answer = lambda generation, method: RuntimeError("cannot start")
    with pytest.raises(RuntimeError):
        tier.unary_stream("/t.S/ExportStream")(b"s", timeout=5)
    net.answer = lambda generation, method: f"ok {generation}"
    files.renew()
    tier.unary_unary(READ)(b"r", timeout=5)
    assert [len(c.closes) for c in net.made] == [1, 0]  # idle: closed at once


def unavailable_on(generation: int, spends: float, net: Net) -> Callable[[int, str], Any]:
    """Calls on channels of ``generation`` take ``spends`` seconds, then fail UNAVAILABLE."""

    def answer(on: int, method: str) -> Any:
        if on == generation:
            net.clock.now += spends
            return Error(grpc.StatusCode.UNAVAILABLE)
        return f"ok {on}"

    return answer


def test_a_read_failing_unavailable_is_sent_again_on_renewed_files_within_its_deadline(net):
    files = Files()
    tier = channel(files)
    net.answer = unavailable_on(0, 2.0, net)
    files.renew_on_look()
    assert tier.unary_unary(READ).with_call(b"r", timeout=5.0) == "ok 1"
    assert net.sent == [(0, READ, b"r", 5.0), (1, READ, b"r", 3.0)]
    assert files.looks == 1
    files.renew()  # the retry's call ended: its channel is idle, closed at once
    tier.unary_unary(READ)(b"n", timeout=5)
    assert [len(c.closes) for c in net.made] == [1, 1, 0]


def test_a_read_whose_deadline_is_spent_is_not_sent_again(net):
    files = Files()
    tier = channel(files)
    net.answer = unavailable_on(0, 5.0, net)
    files.renew_on_look()
    with pytest.raises(grpc.RpcError) as failed:
        tier.unary_unary(READ)(b"r", timeout=5.0)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert net.sent == [(0, READ, b"r", 5.0)]
    assert tier.unary_unary(READ)(b"n", timeout=5) == "ok 1"  # the next call: renewed


@pytest.mark.parametrize("kind", ["unary_unary", "stream_unary"])
def test_other_calls_are_sent_once_and_the_next_call_takes_the_renewed_files(net, kind):
    files = Files()
    tier = channel(files)
    net.answer = unavailable_on(0, 1.0, net)
    files.renew_on_look()
    with pytest.raises(grpc.RpcError) as failed:
        getattr(tier, kind)(WRITE)(b"w", timeout=5.0)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert net.sent == [(0, WRITE, b"w", 5.0)]  # a gradient is never sent twice
    assert files.looks == 1
    assert tier.unary_unary(WRITE)(b"w2", timeout=5.0) == "ok 1"


def test_only_unavailable_after_a_renewal_is_retried_and_looks_are_at_most_once_a_second(net):
    files = Files()
    tier = channel(files)
    read = tier.unary_unary(READ)
    net.answer = lambda generation, method: Error(grpc.StatusCode.PERMISSION_DENIED)
    files.renew_on_look()
    with pytest.raises(grpc.RpcError):
        read(b"1", timeout=5)
    assert files.looks == 0  # not a peer that may have renewed
    files.pending = False
    net.answer = unavailable_on(0, 0.0, net)
    with pytest.raises(grpc.RpcError):  # UNAVAILABLE, files unchanged: not sent again
        read(b"2", timeout=5)
    assert files.looks == 1
    net.clock.now += 0.999
    with pytest.raises(grpc.RpcError):
        read(b"3", timeout=5)
    assert files.looks == 1  # a peer down fails every call: one look per second
    net.clock.now += 0.001
    with pytest.raises(grpc.RpcError):
        read(b"4", timeout=5)
    assert files.looks == 2
    assert [s[2] for s in net.sent] == [b"1", b"2", b"3", b"4"]
