"""Renewed TLS files taken without a restart (embedding_store.tls_reload): changes seen by a
stat at most every interval, and a bad renewal keeps the previous files, with one warning
per change."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import grpc
import pytest
from prometheus_client import generate_latest

from embedding_store.errors import ConfigError, InvalidArgumentError
from embedding_store.grpc_common import (
    TLS_RELOAD_VARIABLE,
    TLS_VARIABLES,
    reset_tier_tls_cache,
    tier_channel,
    tier_tls,
)
from embedding_store.ps_metrics import ParameterServerMetrics
from embedding_store.renewing_channel import HEALTH_CHECK_METHOD, RenewingTierChannel
from embedding_store.tls import check_key_pair, read_certificates, read_private_key
from embedding_store.tls_reload import ReloadingTls, dynamic_server_credentials, file_stamp
from tests.tls_files import TlsFiles, kubelet_files, kubelet_swap, write_tls_files

INTERVAL = 10.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> tuple[TlsFiles, TlsFiles]:
    """Two sets: A (CA 1) and B (CA 2)."""
    return (
        write_tls_files(tmp_path_factory.mktemp("a")),
        write_tls_files(tmp_path_factory.mktemp("b")),
    )


def secret(files: TlsFiles, key: Path | None = None) -> dict[str, bytes]:
    return {
        "tls.crt": files.cert.read_bytes(),
        "tls.key": (key or files.key).read_bytes(),
        "ca.crt": files.ca.read_bytes(),
    }


class Loads:
    """A load function that reads and checks the certificate and key (as the servers do)
    and counts its calls."""

    def __init__(self, paths: dict[str, Path]) -> None:
        self.paths = paths
        self.calls = 0

    def __call__(self) -> bytes:
        self.calls += 1
        cert = read_certificates("--tls-cert", self.paths["tls.crt"])
        key = read_private_key("--tls-key", self.paths["tls.key"])
        check_key_pair(cert, key)
        return cert.data


def reloading(tmp_path: Path, files: TlsFiles) -> tuple[ReloadingTls[bytes], Loads, Clock]:
    paths = kubelet_files(tmp_path / "secret", secret(files))
    load, clock = Loads(paths), Clock()
    reloader = ReloadingTls(
        [paths["tls.crt"], paths["tls.key"]], load, interval=INTERVAL, what="test", clock=clock
    )
    return reloader, load, clock


def counted(reloader: ReloadingTls[bytes]) -> list[str]:
    outcomes: list[str] = []
    reloader.add_listener(outcomes.append)
    return outcomes


def test_a_kubelet_swap_is_taken_after_the_interval_and_read_only_once(tmp_path, sets):
    a, b = sets
    reloader, load, clock = reloading(tmp_path, a)
    outcomes = counted(reloader)
    assert reloader.current == (0, a.cert.read_bytes())
    kubelet_swap(tmp_path / "secret", secret(b))
    clock.now += INTERVAL - 0.5
    assert reloader.check() == (0, a.cert.read_bytes())  # not looked at before the interval
    assert load.calls == 1
    clock.now += 0.5
    assert reloader.check() == (1, b.cert.read_bytes())
    for _ in range(3):  # unchanged since: stat only, no read
        clock.now += INTERVAL
        assert reloader.check() == (1, b.cert.read_bytes())
    assert load.calls == 2
    assert outcomes == ["ok"]


def test_a_bad_renewal_keeps_the_previous_files_and_warns_once(tmp_path, sets, caplog):
    a, b = sets
    reloader, load, clock = reloading(tmp_path, a)
    outcomes = counted(reloader)
    # B's certificate with a key of another certificate.
    kubelet_swap(tmp_path / "secret", secret(b, key=b.other_key))
    with caplog.at_level(logging.WARNING, logger="embedding_store.tls_reload"):
        for _ in range(3):
            clock.now += INTERVAL
            assert reloader.check() == (0, a.cert.read_bytes())
    assert load.calls == 2  # tried once for this change
    assert outcomes == ["failed"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "test: the changed TLS files were not loaded, the previous certificate stays in use: "
        f"--tls-key {tmp_path / 'secret' / 'tls.key'}: this private key does not match the "
        f"certificate in --tls-cert {tmp_path / 'secret' / 'tls.crt'} (tried again when the "
        "files change)"
    ]
    # The next change is tried again.
    kubelet_swap(tmp_path / "secret", secret(b))
    clock.now += INTERVAL
    assert reloader.check() == (1, b.cert.read_bytes())
    assert outcomes == ["failed", "ok"]


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        ("half", "not a valid PEM certificate file"),
        ("not PEM", "not a PEM certificate file (no '-----BEGIN CERTIFICATE-----' line)"),
        ("missing", "cannot read it: No such file or directory"),
    ],
)
def test_half_written_not_pem_or_missing_files_are_refused(tmp_path, sets, caplog, damage, problem):
    a, b = sets
    reloader, _load, clock = reloading(tmp_path, a)
    outcomes = counted(reloader)
    cert = b.cert.read_bytes()
    # Written in place (not as the kubelet does): what a half-done copy leaves.
    target = (tmp_path / "secret" / "tls.crt").resolve()
    if damage == "missing":
        target.unlink()
    else:
        target.write_bytes(cert[: len(cert) // 2] if damage == "half" else b"hello\n")
    clock.now += INTERVAL
    with caplog.at_level(logging.WARNING, logger="embedding_store.tls_reload"):
        assert reloader.check() == (0, a.cert.read_bytes())
    assert outcomes == ["failed"]
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"--tls-cert {tmp_path / 'secret' / 'tls.crt'}: {problem}" in warning


def test_files_changing_while_read_are_read_again_later_without_a_warning(tmp_path, sets, caplog):
    a, b = sets
    paths = kubelet_files(tmp_path / "secret", secret(a))
    clock = Clock()
    reads: list[bytes] = []

    def load() -> bytes:
        data = paths["tls.crt"].read_bytes()
        if len(reads) == 1:  # the first reload: the kubelet swaps the files meanwhile
            kubelet_swap(tmp_path / "secret", secret(a))
        reads.append(data)
        return data

    reloader = ReloadingTls([paths["tls.crt"]], load, interval=INTERVAL, what="t", clock=clock)
    outcomes = counted(reloader)
    kubelet_swap(tmp_path / "secret", secret(b))
    clock.now += INTERVAL
    with caplog.at_level(logging.WARNING, logger="embedding_store.tls_reload"):
        assert reloader.check()[0] == 0  # changed while read: not taken
        clock.now += INTERVAL
        assert reloader.check() == (1, a.cert.read_bytes())  # the newest files
    assert outcomes == ["ok"]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_the_stamp_follows_symlinks_and_zero_interval_never_reloads(tmp_path, sets):
    a, b = sets
    paths = kubelet_files(tmp_path / "secret", secret(a))
    before = file_stamp([paths["tls.crt"]])
    kubelet_swap(tmp_path / "secret", secret(a))  # same bytes, new files
    assert file_stamp([paths["tls.crt"]]) != before
    load = Loads(paths)
    reloader = ReloadingTls([paths["tls.crt"]], load, interval=0, what="t", clock=Clock())
    kubelet_swap(tmp_path / "secret", secret(b))
    assert reloader.check() == (0, a.cert.read_bytes())
    assert load.calls == 1


def test_bad_files_at_start_up_raise(tmp_path, sets):
    a, _ = sets
    paths = kubelet_files(tmp_path / "secret", secret(a, key=a.other_key))
    with pytest.raises(InvalidArgumentError, match="does not match the certificate"):
        ReloadingTls([paths["tls.crt"]], Loads(paths), what="t")


# --------------------------------------------------------------------------- the tier's files
def _use_tier_files(monkeypatch, paths: dict[str, Path] | None, seconds: str) -> None:
    for name, file in zip(TLS_VARIABLES, ("tls.crt", "tls.key", "ca.crt"), strict=True):
        if paths is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, str(paths[file]))
    monkeypatch.setenv(TLS_RELOAD_VARIABLE, seconds)
    reset_tier_tls_cache()


def test_new_tier_channels_use_renewed_files(tmp_path, sets, monkeypatch):
    """tier_tls() (what tier_channel builds new channels from) notices a renewal by itself,
    with no server in the process to look."""
    a, b = sets
    paths = kubelet_files(tmp_path / "secret", secret(a))
    _use_tier_files(monkeypatch, paths, "0.01")
    try:
        first = tier_tls()
        assert first is not None and first.cert.data == a.cert.read_bytes()
        kubelet_swap(tmp_path / "secret", secret(b))
        deadline = time.monotonic() + 5
        while (renewed := tier_tls()) is first:
            assert time.monotonic() < deadline, "tier_tls() kept the old files"
            time.sleep(0.01)
        assert renewed is not None
        assert (renewed.cert.data, renewed.key.data, renewed.ca.data) == tuple(secret(b).values())
    finally:
        reset_tier_tls_cache()


def test_the_tier_reload_interval_is_checked(monkeypatch, tmp_path, sets):
    a, _ = sets
    paths = kubelet_files(tmp_path / "secret", secret(a))
    for bad in ("soon", "-1", "nan", "inf"):
        _use_tier_files(monkeypatch, paths, bad)
        with pytest.raises(ConfigError) as refused:
            tier_tls()
        assert refused.value.message == (
            f"{TLS_RELOAD_VARIABLE}={bad}: must be a number of seconds >= 0 (0: read the TLS "
            "files at start only)"
        )
    _use_tier_files(monkeypatch, None, "soon")  # plaintext: not read at all
    assert tier_tls() is None
    assert b"tls_reloads" not in generate_latest(ParameterServerMetrics(0, 1).registry)


def test_only_tier_channels_that_can_see_a_renewal_follow_one(tmp_path, sets, monkeypatch):
    """Plaintext, and TLS read at start only, keep gRPC's own channel (nothing added per
    call); TLS with renewals looked for gets a channel that follows them."""
    a, _ = sets
    paths = kubelet_files(tmp_path / "secret", secret(a))
    try:
        _use_tier_files(monkeypatch, None, "10")
        with tier_channel("127.0.0.1:1") as plain:
            assert type(plain) is grpc._channel.Channel
        _use_tier_files(monkeypatch, paths, "0")
        with tier_channel("127.0.0.1:1") as fixed:
            assert type(fixed) is grpc._channel.Channel
        _use_tier_files(monkeypatch, paths, "10")
        with tier_channel("127.0.0.1:1", retry_safe={HEALTH_CHECK_METHOD}) as renewing:
            assert isinstance(renewing, RenewingTierChannel)
            assert renewing.retry_safe == {HEALTH_CHECK_METHOD}
            assert renewing.generation == 0
    finally:
        reset_tier_tls_cache()


# --------------------------------------------------------------------------- found by mutation
def test_a_check_while_another_reloads_answers_at_once_without_reading(tmp_path, sets):
    """A handshake does not queue behind a reload in another thread, nor read the files a
    second time: it answers what is loaded now."""
    a, b = sets
    paths = kubelet_files(tmp_path / "secret", secret(a))
    clock, reading, go_on, reads = Clock(), threading.Event(), threading.Event(), []

    def load() -> bytes:
        reads.append(threading.current_thread().name)
        if len(reads) == 2:  # the first reload: held until told
            reading.set()
            assert go_on.wait(5)
        return paths["tls.crt"].read_bytes()

    reloader = ReloadingTls([paths["tls.crt"]], load, interval=INTERVAL, what="t", clock=clock)
    kubelet_swap(tmp_path / "secret", secret(b))
    clock.now += INTERVAL
    answers: dict[str, tuple[int, bytes]] = {}
    first = threading.Thread(target=lambda: answers.update(first=reloader.check()), name="first")
    first.start()
    assert reading.wait(5)
    clock.now += INTERVAL  # due again: only the lock keeps this check out
    second = threading.Thread(target=lambda: answers.update(second=reloader.check()))
    second.start()
    try:
        second.join(5)
        assert answers == {"second": (0, a.cert.read_bytes())}  # not waited for
    finally:
        go_on.set()
        first.join(5)
    assert answers["first"] == (1, b.cert.read_bytes())
    assert reads == ["MainThread", "first"]


def test_a_change_right_after_a_look_waits_for_the_interval(tmp_path, sets):
    a, b = sets
    reloader, load, clock = reloading(tmp_path, a)
    kubelet_swap(tmp_path / "secret", secret(b))
    clock.now += INTERVAL
    assert reloader.check() == (1, b.cert.read_bytes())
    kubelet_swap(tmp_path / "secret", secret(a))
    clock.now += INTERVAL - 0.5
    assert reloader.check() == (1, b.cert.read_bytes())  # looked 9.5 s ago: not yet
    clock.now += 0.5
    assert reloader.check() == (2, a.cert.read_bytes())
    assert load.calls == 3


def test_a_load_that_fails_while_the_files_change_is_tried_again_without_a_warning(
    tmp_path, sets, caplog
):
    """A renewal read half-way through the kubelet's swap may fail to parse: that is no
    bad renewal, and the next check reads the files again."""
    a, b = sets
    paths = kubelet_files(tmp_path / "secret", secret(a))
    clock, calls = Clock(), []

    def load() -> bytes:
        calls.append(1)
        if len(calls) == 2:  # the first reload: fails, and the swap goes on meanwhile
            kubelet_swap(tmp_path / "secret", secret(b))
            raise InvalidArgumentError("--tls-cert: not a valid PEM certificate file")
        return paths["tls.crt"].read_bytes()

    reloader = ReloadingTls([paths["tls.crt"]], load, interval=INTERVAL, what="t", clock=clock)
    outcomes = counted(reloader)
    kubelet_swap(tmp_path / "secret", secret(a))
    clock.now += INTERVAL
    with caplog.at_level(logging.WARNING, logger="embedding_store.tls_reload"):
        assert reloader.check() == (0, a.cert.read_bytes())
        clock.now += INTERVAL
        assert reloader.check() == (1, b.cert.read_bytes())
    assert outcomes == ["ok"]
    assert reloader.counts == {"ok": 1, "failed": 0}
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_files_changed_during_the_start_up_read_are_read_again(tmp_path, sets):
    a, b = sets
    paths = kubelet_files(tmp_path / "secret", secret(a))
    clock, reads = Clock(), []

    def load() -> bytes:
        data = paths["tls.crt"].read_bytes()
        if not reads:  # renewed just after the start-up read
            kubelet_swap(tmp_path / "secret", secret(b))
        reads.append(data)
        return data

    reloader = ReloadingTls([paths["tls.crt"]], load, interval=INTERVAL, what="t", clock=clock)
    assert reloader.current == (0, a.cert.read_bytes())
    clock.now += INTERVAL
    assert reloader.check() == (1, b.cert.read_bytes())


def test_a_listener_that_fails_breaks_neither_the_reload_nor_the_others(tmp_path, sets, caplog):
    a, b = sets
    reloader, _load, clock = reloading(tmp_path, a)

    def broken(outcome: str) -> None:
        raise RuntimeError("metric down")

    reloader.add_listener(broken)
    outcomes = counted(reloader)
    kubelet_swap(tmp_path / "secret", secret(b))
    clock.now += INTERVAL
    with caplog.at_level(logging.ERROR, logger="embedding_store.tls_reload"):
        assert reloader.check() == (1, b.cert.read_bytes())
    assert outcomes == ["ok"]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [
        "TLS reload listener failed"
    ]


class _Files:
    """A ReloadingTls stand-in for the gRPC fetcher: ``check()`` takes ``due`` if set."""

    what = "t"

    def __init__(self) -> None:
        self.current: tuple[int, str] = (0, "A")
        self.due: tuple[int, str] | None = None

    def check(self) -> tuple[int, str]:
        if self.due is not None:
            self.current, self.due = self.due, None
        return self.current


def test_the_grpc_fetcher_answers_a_new_generation_once(monkeypatch, caplog):
    made: list[tuple[object, object, bool]] = []
    monkeypatch.setattr(
        grpc,
        "dynamic_ssl_server_credentials",
        lambda initial, fetch, require_client_authentication: made.append(
            (initial, fetch, require_client_authentication)
        ),
    )
    files = _Files()

    def configuration(value: str) -> str:
        if value == "broken":
            raise RuntimeError("no configuration")
        return f"config {value}"

    dynamic_server_credentials(files, configuration, require_client_auth=True)  # type: ignore[arg-type]
    ((initial, fetch, required),) = made
    assert (initial, required) == ("config A", True)
    assert fetch() is None  # unchanged: gRPC keeps what it has
    files.due = (1, "B")  # a check that is due finds B
    assert [fetch(), fetch()] == ["config B", None]
    files.due = (2, "broken")
    with caplog.at_level(logging.ERROR, logger="embedding_store.tls_reload"):
        assert fetch() is None  # a failure never reaches gRPC's core (a failed handshake)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [
        "t: fetching the TLS configuration failed"
    ]


def test_the_grpc_fetcher_never_goes_back_to_an_older_generation(monkeypatch):
    """Two handshakes fetching at once: the one whose check read generation 1 just before
    another reloaded generation 2 answers last; gRPC keeps 2 (new connections must not get
    the replaced files back)."""
    made: list[object] = []
    monkeypatch.setattr(
        grpc,
        "dynamic_ssl_server_credentials",
        lambda initial, fetch, require_client_authentication: made.append(fetch),
    )
    files = _Files()
    dynamic_server_credentials(files, lambda value: f"config {value}", require_client_auth=False)  # type: ignore[arg-type]
    (fetch,) = made
    files.due = (2, "C")
    assert fetch() == "config C"
    files.current = (1, "B")  # what the late check had read
    assert fetch() is None
    files.current = (2, "C")
    assert fetch() is None
