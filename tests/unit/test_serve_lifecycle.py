"""``recserve serve`` lifecycle without a model: how ``--workers`` supervises its processes,
and how long a stop may take."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from serving import server
from serving.options import ServeOptions
from serving.processes import serve_processes
from serving.server import PredictionServer

#: What every stand-in prints once its signal handlers are in place (see _when_ready).
READY = "print('ready', flush=True); "

#: A stand-in server process: exits 0 on SIGTERM, as a drained `recserve serve` does.
CHILD = (
    "import signal, sys, time; "
    f"signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); {READY}time.sleep(60)"
)


#: A stand-in that takes 1.5 s to drain after SIGTERM.
SLOW_CHILD = (
    "import signal, sys, time; "
    "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1.5), sys.exit(0))); "
    f"{READY}time.sleep(60)"
)


@pytest.fixture
def fake_children(monkeypatch):
    """serve_processes starts CHILD instead of `recserve serve`; yields (commands, processes)."""
    commands: list[list[str]] = []
    processes: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def popen(command, env=None):
        commands.append(command)
        processes.append(real_popen([sys.executable, "-c", child_code[0]], stdout=subprocess.PIPE))
        return processes[-1]

    child_code = [CHILD]

    monkeypatch.setattr(subprocess, "Popen", popen)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield commands, processes, child_code
    for signum, handler in handlers.items():
        signal.signal(signum, handler)
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


def _after(seconds: float, action) -> None:
    timer = threading.Timer(seconds, action)
    timer.daemon = True
    timer.start()


def _when_ready(processes: list[subprocess.Popen], action, count: int = 2) -> list[float]:
    """Run ``action`` (in a thread) once ``count`` stand-ins have started and installed their
    signal handlers (each prints READY's line; a fixed delay used to stand in for that).
    Returns a list that gets the monotonic time the action ran at. Bounded: after 30 s it
    acts anyway, and a stand-in that died gives EOF, not a wait."""
    acted: list[float] = []

    def wait_then_act() -> None:
        deadline = time.monotonic() + 30
        while len(processes) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        for process in processes[:count]:
            if process.stdout is not None:
                process.stdout.readline()  # its handlers are in place (or it is gone)
        acted.append(time.monotonic())
        action()

    threading.Thread(target=wait_then_act, daemon=True).start()
    return acted


def _options() -> ServeOptions:
    return ServeOptions(checkpoint="ckpt", http_port=0, grpc_port=0, workers=2)


def test_a_crashed_server_process_stops_the_others_and_the_server_fails(fake_children):
    """Left alone, a `--workers 2` server whose process died would serve on with half its
    cores and never be restarted: it must stop the other and exit non-zero."""
    _commands, processes, _code = fake_children
    _when_ready(processes, lambda: os.kill(processes[0].pid, signal.SIGKILL))
    started = time.monotonic()
    assert serve_processes(_options()) == 128 + signal.SIGKILL
    assert time.monotonic() - started < 10
    assert processes[1].returncode == 0  # asked to stop (SIGTERM), and it did


def test_a_stop_asked_for_is_forwarded_and_a_clean_drain_exits_0(fake_children):
    _commands, processes, _code = fake_children
    _when_ready(processes, lambda: os.kill(os.getpid(), signal.SIGTERM))
    assert serve_processes(_options()) == 0
    assert [p.returncode for p in processes] == [0, 0]


def test_the_supervisor_sleeps_while_its_processes_drain(fake_children):
    """Waiting for draining processes must not spin a core they need (it polled flat out
    once the stop flag was set)."""
    _commands, processes, child_code = fake_children
    child_code[0] = SLOW_CHILD
    _when_ready(processes, lambda: os.kill(os.getpid(), signal.SIGTERM))
    cpu = time.process_time()
    started = time.monotonic()
    assert serve_processes(_options()) == 0
    assert time.monotonic() - started >= 1.5  # they drained for 1.5 s
    assert time.process_time() - cpu < 0.5


def test_server_processes_log_at_the_level_given_to_recserve(fake_children):
    commands, processes, _code = fake_children
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.WARNING)
    try:
        _when_ready(processes, lambda: os.kill(os.getpid(), signal.SIGTERM))
        serve_processes(_options())
    finally:
        root.setLevel(level)
    assert len(commands) == 2
    assert commands[0][3:6] == ["--log-level", "WARNING", "serve"]


def test_a_stop_takes_one_grace_period_not_one_per_step(monkeypatch):
    """Drain, gRPC and HTTP shut down within one --grace-seconds (plus a bounded close): a
    drain that used the whole grace period leaves the HTTP server no second one, and a
    connection that never finishes its request is closed."""
    grace = 2.0
    stopping = PredictionServer(
        ServeOptions(checkpoint="ckpt", grace_seconds=grace)
    )  # start() is never called: its parts are fakes
    calls: list[str] = []

    class StuckService:
        def stop_accepting(self) -> None:
            calls.append("stop_accepting")

        def drain(self, seconds: float) -> bool:
            time.sleep(seconds)  # a request stuck in the model all along
            return False

        def close(self, wait: float) -> None:
            calls.append("close")
            assert 1.0 <= wait <= 1.5  # at least 1 s, however long the drain took

        def wait_for_reload(self, timeout: float) -> bool:
            calls.append("wait_for_reload")
            assert 0.5 <= timeout <= 1.0  # what is left of the grace, at least 0.5 s
            return True

    uvicorn = SimpleNamespace(should_exit=False, force_exit=False)

    def http_server() -> None:  # uvicorn waiting on a connection that never completes
        while not uvicorn.force_exit:
            time.sleep(0.01)

    stopping.service = StuckService()
    stopping._uvicorn = uvicorn
    stopping._http_thread = threading.Thread(target=http_server, daemon=True)
    stopping._http_thread.start()
    started = time.monotonic()
    assert stopping.stop() is False
    took = time.monotonic() - started
    assert grace <= took < grace + 1.5, took
    assert uvicorn.should_exit and uvicorn.force_exit
    assert calls == ["stop_accepting", "close", "wait_for_reload"]
    assert not stopping._http_thread.is_alive()


def test_ipv6_literals_get_an_ipv6_socket():
    import socket

    assert server._address_family("::1") == socket.AF_INET6
    assert server._address_family("::") == socket.AF_INET6
    assert server._address_family("127.0.0.1") == socket.AF_INET
    assert server._address_family("0.0.0.0") == socket.AF_INET


def test_the_stop_signal_handler_takes_no_lock():
    """The handler only flags the stop (a nested signal inside Event.set() deadlocked the
    main thread, once in ~25 stops under `timeout` and honcho); wait() then sets the Event
    other threads watch, from the main thread."""
    server = PredictionServer(ServeOptions(checkpoint="ckpt"))
    server.request_stop(signal.SIGTERM, None)
    server.request_stop(signal.SIGINT, None)  # a second signal: no effect, no wait
    assert not server._stop.is_set()
    started = time.monotonic()
    server.wait()
    assert server._stop.is_set() and time.monotonic() - started < 1


def test_the_checkpoint_watch_survives_a_manifest_it_cannot_read(monkeypatch):
    """Any error reading the watched manifest is logged and the watch goes on: the next
    version must still load (an OverflowError used to end the watcher thread silently)."""
    from embedding_store import model_checkpoint

    reads = iter([OverflowError("cannot convert float infinity to integer"), "v2"])

    def read_manifest(_path):
        result = next(reads, "v2")
        if isinstance(result, Exception):
            raise result
        return SimpleNamespace(version=result)

    monkeypatch.setattr(model_checkpoint, "read_manifest", read_manifest)
    reloaded = threading.Event()
    watching = PredictionServer(ServeOptions(checkpoint="ckpt", watch_seconds=0.02))
    watching.service = SimpleNamespace(
        model=SimpleNamespace(version="v1"),
        reload=lambda _checkpoint: reloaded.set() or {"version": "v2"},
    )
    watcher = threading.Thread(target=watching._watch, daemon=True)
    watcher.start()
    try:
        assert reloaded.wait(5)
    finally:
        watching._stop.set()
        watcher.join(5)


def test_the_checkpoint_watch_follows_the_version_its_reload_loaded(monkeypatch):
    """v3 is published while the watcher's reload of v2 loads, so v3 is what it loads; then
    v2 is published again (a rollback): the watcher must load it. It used to note the
    version it read before loading (v2) and serve v3 on, the path holding v2."""
    from embedding_store import model_checkpoint

    monkeypatch.setattr(
        model_checkpoint, "read_manifest", lambda _path: SimpleNamespace(version="v2")
    )
    loads = iter(["v3", "v2"])
    reloads: list[str] = []
    again = threading.Event()

    def reload(_checkpoint):
        reloads.append(next(loads, "v2"))
        if len(reloads) == 2:
            again.set()
        return {"version": reloads[-1]}

    watching = PredictionServer(ServeOptions(checkpoint="ckpt", watch_seconds=0.01))
    watching.service = SimpleNamespace(model=SimpleNamespace(version="v1"), reload=reload)
    watcher = threading.Thread(target=watching._watch, daemon=True)
    watcher.start()
    try:
        assert again.wait(5), reloads
        time.sleep(0.1)  # ten polls more: v2 is served now, nothing else to load
    finally:
        watching._stop.set()
        watcher.join(5)
    assert reloads == ["v3", "v2"]


#: A stand-in that ignores SIGTERM: a wedged server process.
WEDGED_CHILD = (
    f"import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); {READY}time.sleep(60)"
)


def _kill_all_after(seconds: float, processes: list[subprocess.Popen]) -> None:
    """A safety net: a supervisor that never ends its processes fails its test, not hangs."""
    _after(seconds, lambda: [p.kill() for p in processes if p.poll() is None])


def test_a_wedged_server_process_is_killed_after_the_grace_period(fake_children, monkeypatch):
    """A process that ignores the stop must not hold the server (and its ports) forever:
    grace + STOP_MARGIN_SECONDS after the stop, it is killed and the server exits 137."""
    _commands, processes, child_code = fake_children
    child_code[0] = WEDGED_CHILD
    monkeypatch.setattr("serving.processes.STOP_MARGIN_SECONDS", 1.0)
    stopped = _when_ready(processes, lambda: os.kill(os.getpid(), signal.SIGTERM))
    _kill_all_after(20, processes)
    options = ServeOptions(
        checkpoint="ckpt", http_port=0, grpc_port=0, workers=2, grace_seconds=0.5
    )
    assert serve_processes(options) == 128 + signal.SIGKILL
    assert 1.5 <= time.monotonic() - stopped[0] < 10  # grace 0.5 s + margin 1 s after the stop
    assert [p.returncode for p in processes] == [-signal.SIGKILL, -signal.SIGKILL]


def test_a_stop_while_the_processes_start_reaches_them(fake_children, monkeypatch):
    """SIGTERM as the first process starts: no further process is started, and the one
    that was gets the stop (before, the handler came after every start, so the signal
    killed the supervisor outright and left its processes running, orphaned)."""
    commands, processes, _code = fake_children
    popen = subprocess.Popen  # the fixture's stand-in

    def popen_then_stop(command, env=None):
        process = popen(command, env=env)
        os.kill(os.getpid(), signal.SIGTERM)
        return process

    monkeypatch.setattr(subprocess, "Popen", popen_then_stop)
    signal.signal(signal.SIGTERM, lambda *_: None)  # what an unguarded start would meet
    _kill_all_after(20, processes)
    assert serve_processes(_options()) == 0
    assert len(commands) == 1
    assert processes[0].returncode in (0, -signal.SIGTERM)  # stopped, by its handler or not


def test_a_crash_of_any_server_process_stops_the_others(fake_children):
    """Not only the first: the supervisor looked at the processes only up to the first one
    still running, so the second one's crash went unseen while the first served on."""
    _commands, processes, _code = fake_children
    _when_ready(processes, lambda: os.kill(processes[1].pid, signal.SIGKILL))
    _kill_all_after(20, processes)
    started = time.monotonic()
    assert serve_processes(_options()) == 128 + signal.SIGKILL
    assert time.monotonic() - started < 10
    assert processes[0].returncode == 0  # asked to stop (SIGTERM), and it did


#: A stand-in still starting when Ctrl-C comes: the CLI turns KeyboardInterrupt into 130.
INTERRUPTED_CHILD = (
    "import signal, sys, time; "
    f"signal.signal(signal.SIGINT, lambda *a: sys.exit(130)); {READY}time.sleep(60)"
)


def test_a_ctrl_c_that_interrupts_the_start_is_a_clean_stop(fake_children):
    _commands, processes, child_code = fake_children
    child_code[0] = INTERRUPTED_CHILD
    _when_ready(processes, lambda: os.kill(os.getpid(), signal.SIGINT))
    _kill_all_after(20, processes)
    assert serve_processes(_options()) == 0
    assert [p.returncode for p in processes] == [130, 130]


def test_a_server_process_that_exits_0_unasked_fails_the_server(fake_children):
    """Exiting 0 while nobody asked it to stop is still a crash: the server exits 1, or its
    supervisor would take the stop as a clean one and never restart it."""
    _commands, processes, _code = fake_children
    # It exits 0 on its own.
    _when_ready(processes, lambda: os.kill(processes[0].pid, signal.SIGTERM))
    assert serve_processes(_options()) == 1
    assert [p.returncode for p in processes] == [0, 0]


def test_the_checkpoint_watch_retries_a_failed_version_after_a_doubling_back_off(monkeypatch):
    """A version that failed to load is tried again, not on every poll but after the
    back-off, which doubles while it keeps failing; once it loads it is not loaded again."""
    from embedding_store import model_checkpoint
    from embedding_store.errors import CheckpointError

    monkeypatch.setattr(
        model_checkpoint, "read_manifest", lambda _path: SimpleNamespace(version="v2")
    )
    monkeypatch.setattr(server, "RELOAD_RETRY_SECONDS", 0.2)
    attempts: list[float] = []
    loaded = threading.Event()

    def reload(_checkpoint):
        attempts.append(time.monotonic())
        if len(attempts) < 3:
            raise CheckpointError("files still being copied in")
        loaded.set()
        return {"version": "v2"}

    watching = PredictionServer(ServeOptions(checkpoint="ckpt", watch_seconds=0.02))
    watching.service = SimpleNamespace(model=SimpleNamespace(version="v1"), reload=reload)
    watcher = threading.Thread(target=watching._watch, daemon=True)
    watcher.start()
    try:
        assert loaded.wait(5)
        time.sleep(0.2)  # polls after the load find the version loaded
    finally:
        watching._stop.set()
        watcher.join(5)
    assert len(attempts) == 3
    first_wait, second_wait = attempts[1] - attempts[0], attempts[2] - attempts[1]
    assert 0.2 <= first_wait < 0.35
    assert 0.4 <= second_wait < 0.6


def test_server_processes_are_single_servers_on_the_reserved_ports(fake_children, monkeypatch):
    """Each process is one plain server (``--workers 1``: it must not start processes of its
    own) bound with SO_REUSEPORT to the ports the supervisor reserved, watching the
    supervisor's pid; the admin token reaches it in its environment, and the metrics
    directory of the run exists while it runs and is removed afterwards."""
    from serving.metrics import MULTIPROCESS_VARIABLE

    commands, _processes, _code = fake_children
    popen = subprocess.Popen  # the fixture's stand-in
    environments: list[dict[str, str]] = []

    def popen_recording(command, env=None):
        environments.append(env)
        assert os.path.isdir(env[MULTIPROCESS_VARIABLE])
        process = popen(command, env=env)
        if len(environments) == 2:  # both started: stop (no timer racing the start-up)
            os.kill(os.getpid(), signal.SIGTERM)
        return process

    monkeypatch.setattr(subprocess, "Popen", popen_recording)
    options = ServeOptions(
        checkpoint="ckpt", http_port=0, grpc_port=0, workers=2, admin_token="s3cr3t"
    )
    assert serve_processes(options) == 0
    assert len(commands) == 2 and commands[0] == commands[1]
    argv = commands[0][6:]  # after: python -m embedding_store.cli --log-level LEVEL serve

    def value(flag: str) -> str:
        (found,) = [a.removeprefix(f"{flag}=") for a in argv if a.startswith(f"{flag}=")]
        return found

    assert value("--workers") == "1"
    assert "--reuse-port" in argv
    assert value("--supervisor-pid") == str(os.getpid())
    http_port, grpc_port = int(value("--http-port")), int(value("--grpc-port"))
    assert http_port > 0 and grpc_port > 0 and http_port != grpc_port
    assert "s3cr3t" not in commands[0]
    assert [env["RECSERVE_ADMIN_TOKEN"] for env in environments] == ["s3cr3t", "s3cr3t"]
    directories = {env[MULTIPROCESS_VARIABLE] for env in environments}
    assert len(directories) == 1
    assert not os.path.exists(directories.pop())


class _ExitedChild:
    """A server process that has already exited with ``returncode``."""

    def __init__(self, pid: int, returncode: int) -> None:
        self.pid, self.returncode = pid, returncode

    def poll(self) -> int:
        return self.returncode

    def send_signal(self, signum: int) -> None:
        raise AssertionError("no signal goes to a process that has exited")


def test_the_first_stop_signal_decides_which_exits_are_clean():
    """Ctrl-C (SIGINT) then a SIGTERM: processes that exited 130 (the CLI's code for an
    interrupted start) stopped as asked by the first signal; the second must not turn
    them into failures."""
    from serving.processes import _Supervisor

    supervisor = _Supervisor(kill_after=1.0)
    supervisor.children = [_ExitedChild(1, 130), _ExitedChild(2, -signal.SIGINT)]
    supervisor.forward(signal.SIGINT)
    supervisor.forward(signal.SIGTERM)
    assert supervisor.stop_signal == signal.SIGINT
    assert supervisor.run("unused") == 0


@pytest.mark.parametrize(
    ("stop_signal", "returncodes", "expected"),
    [
        (None, [3, 0], 3),  # nobody asked: the worst code
        (signal.SIGTERM, [0, -signal.SIGKILL], 128 + signal.SIGKILL),
        (signal.SIGTERM, [-signal.SIGTERM, 128 + signal.SIGTERM], 0),
        (signal.SIGTERM, [2, 1], 2),
    ],
)
def test_the_supervisor_exits_with_the_worst_code_of_its_processes(
    stop_signal, returncodes, expected
):
    from serving.processes import _Supervisor

    supervisor = _Supervisor(kill_after=1.0)
    supervisor.stop_signal = stop_signal
    supervisor.children = [_ExitedChild(i, code) for i, code in enumerate(returncodes)]
    assert supervisor.run("unused") == expected


class _FakeClock:
    """time.monotonic for the watcher, and its stop Event: each poll advances the clock by
    the poll interval, and the watch ends once the clock passes ``until``."""

    def __init__(self, until: float) -> None:
        self.now, self.until = 0.0, until

    def monotonic(self) -> float:
        return self.now

    def wait(self, seconds: float) -> bool:
        self.now += seconds
        return self.is_set()

    def is_set(self) -> bool:
        return self.now > self.until


def test_the_checkpoint_watch_back_off_starts_at_a_poll_and_is_capped(monkeypatch, caplog):
    """The first retry of a failed version waits at least one poll interval (5 s, or the
    interval when it is longer) and the back-off doubles up to RELOAD_RETRY_MAX_SECONDS
    (300 s): a checkpoint broken for days is still tried every 5 minutes."""
    from embedding_store import model_checkpoint
    from embedding_store.errors import CheckpointError

    monkeypatch.setattr(
        model_checkpoint, "read_manifest", lambda _path: SimpleNamespace(version="v2")
    )
    clock = _FakeClock(until=1000.0)
    monkeypatch.setattr(server, "time", clock)

    def reload(_checkpoint):
        raise CheckpointError("broken")

    def backoffs(watch_seconds: float) -> list[float]:
        clock.now = 0.0
        caplog.clear()
        watching = PredictionServer(ServeOptions(checkpoint="ckpt", watch_seconds=watch_seconds))
        watching.service = SimpleNamespace(model=SimpleNamespace(version="v1"), reload=reload)
        watching._stop = clock
        with caplog.at_level(logging.WARNING, logger="serving.server"):
            watching._watch()  # returns once the fake clock passes 1000 s
        return [r.args[1] for r in caplog.records if r.msg.startswith("will try version")]

    assert backoffs(6.0) == [6.0, 12.0, 24.0, 48.0, 96.0, 192.0, 300.0, 300.0, 300.0]
    # A poll shorter than 5 s: the first retry still waits 5 s.
    assert backoffs(2.0)[:4] == [5.0, 10.0, 20.0, 40.0]


def test_a_reload_refused_because_the_server_stops_ends_the_watch_quietly(monkeypatch, caplog):
    """The watcher's reload that ends after the stop closed the service (which refuses to
    serve what it loaded) is not "tried again later": the watch ends."""
    from embedding_store import model_checkpoint
    from embedding_store.errors import UnavailableError

    monkeypatch.setattr(
        model_checkpoint, "read_manifest", lambda _path: SimpleNamespace(version="v2")
    )
    watching = PredictionServer(ServeOptions(checkpoint="ckpt", watch_seconds=0.01))
    calls: list[str] = []

    def reload(_checkpoint):
        calls.append("reload")
        watching._stop.set()  # SIGTERM came while it loaded
        raise UnavailableError("the server is stopping: version v2 was loaded but is not served")

    watching.service = SimpleNamespace(model=SimpleNamespace(version="v1"), reload=reload)
    with caplog.at_level(logging.WARNING, logger="serving.server"):
        watching._watch()  # returns: the stop is set
    assert calls == ["reload"]
    assert [r.getMessage() for r in caplog.records] == []


def _reloading_server(tmp_path, **options) -> tuple[PredictionServer, list[str | None]]:
    """A server (never started) serving ``tmp_path/served``, whose service records the
    checkpoints it is asked to reload."""
    (tmp_path / "served").mkdir()
    reloading = PredictionServer(ServeOptions(checkpoint=tmp_path / "served", **options))
    reloads: list[str | None] = []
    reloading.service = SimpleNamespace(reload=lambda path: reloads.append(path) or {})
    return reloading, reloads


def test_admin_reloads_load_only_under_the_reload_root(tmp_path):
    """By default the root is the directory holding --checkpoint; a path is judged by where
    it leads once symlinks are resolved (a TorchScript model is code)."""
    from embedding_store.errors import PermissionDeniedError

    reloading, reloads = _reloading_server(tmp_path)
    assert reloading.reload_root == tmp_path.resolve()
    sibling = tmp_path / "v2"
    reloading._admin_reload(str(sibling))
    reloading._admin_reload(None)  # the served path again
    assert reloads == [str(sibling), None]
    outside = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    link = tmp_path / "link"
    link.symlink_to(outside)
    for path in (outside, link):
        with pytest.raises(PermissionDeniedError, match=f"checkpoint {path} is outside"):
            reloading._admin_reload(str(path))
    assert len(reloads) == 2


def test_admin_reloads_load_the_path_that_was_checked(tmp_path):
    """A symlink under the root is resolved once: the load gets its target, so a link swapped
    to point outside the root between the check and the load is not followed again."""
    reloading, reloads = _reloading_server(tmp_path)
    (tmp_path / "v3").mkdir()
    link = tmp_path / "latest"
    link.symlink_to(tmp_path / "v3")
    reloading._admin_reload(str(link))
    reloading._admin_reload(str(tmp_path / "v3" / ".." / "v4"))
    assert reloads == [str((tmp_path / "v3").resolve()), str((tmp_path / "v4").resolve())]


def test_an_explicit_reload_root_replaces_the_default(tmp_path):
    from embedding_store.errors import PermissionDeniedError

    (tmp_path / "root").mkdir()
    reloading, reloads = _reloading_server(tmp_path, reload_root=tmp_path / "root")
    assert reloading.reload_root == (tmp_path / "root").resolve()
    reloading._admin_reload(str(tmp_path / "root" / "v2"))
    with pytest.raises(PermissionDeniedError, match="outside --reload-root"):
        reloading._admin_reload(str(tmp_path / "v2"))  # under the default root, not this one
    assert reloads == [str(tmp_path / "root" / "v2")]


def test_a_reload_root_every_user_can_write_is_warned_about(tmp_path):
    """Any local user could plant a checkpoint (code) there, and loopback needs no token."""
    reloading, _ = _reloading_server(tmp_path)
    assert reloading.reload_root_warning() is None  # pytest's tmp_path: 0700
    tmp_path.chmod(0o777)
    assert reloading.reload_root_warning() == (
        f"--reload-root {tmp_path.resolve()} is writable by every user of this host: any of "
        "them could put a checkpoint (its TorchScript is code) there for POST /admin/reload "
        "to load, and loopback clients need no token; use a directory only your trainers can "
        "write"
    )
    (tmp_path / "w").mkdir(mode=0o777)
    (tmp_path / "w").chmod(0o777)  # past the umask
    workers, _ = _reloading_server(tmp_path / "w", reuse_port=True)  # reloads refused there
    assert workers.reload_root_warning() is None


def test_a_process_of_a_workers_server_refuses_admin_reloads(tmp_path):
    """A reload reaching one of several processes would leave two versions served."""
    from embedding_store.errors import FailedPreconditionError

    reloading, reloads = _reloading_server(tmp_path, reuse_port=True)
    for path in (None, str(tmp_path / "v2")):
        with pytest.raises(FailedPreconditionError, match="several processes"):
            reloading._admin_reload(path)
    assert reloads == []


@pytest.mark.parametrize("spec", ["json", "json:", ":loads", ""])
def test_a_preprocessor_must_be_module_colon_function(spec):
    from embedding_store.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="--preprocessor must be MODULE:FUNCTION"):
        server.load_preprocessor(spec)


def _eval_import(spec: str) -> Callable[..., object]:
    from clients.eval_encoders import import_function

    return import_function(spec, "mapping.yaml")


@pytest.mark.parametrize("load", [server.load_preprocessor, _eval_import])
def test_a_preprocessor_from_the_current_folder_shadows_no_installed_module(
    load, tmp_path, monkeypatch
):
    """The current folder is searched after installed modules (serve --preprocessor, eval's
    mapping): its own modules load, but a planted module named like an installed one (not
    imported yet) is not imported."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "local_pre_h87.py").write_text("def f(rows):\n    return rows\n")
    (tmp_path / "tabnanny.py").write_text("def check(path):\n    return 'planted'\n")
    try:
        assert load("local_pre_h87:f")([1]) == [1]
        sys.modules.pop("tabnanny", None)
        check = load("tabnanny:check")
        assert Path(sys.modules["tabnanny"].__file__).parent != tmp_path
        assert check is sys.modules["tabnanny"].check
    finally:
        for name in ("local_pre_h87", "tabnanny"):
            sys.modules.pop(name, None)


def test_a_preprocessor_that_cannot_be_imported_is_named():
    import json

    from embedding_store.errors import InvalidArgumentError

    assert server.load_preprocessor("json:loads") is json.loads
    for spec in ("json:no_such_function", "no_such_module_h87:f"):
        with pytest.raises(InvalidArgumentError, match=f"cannot import preprocessor '{spec}'"):
            server.load_preprocessor(spec)


@pytest.mark.parametrize(
    ("load", "prefix"),
    [
        (server.load_preprocessor, "cannot import preprocessor '{spec}'"),
        (_eval_import, "mapping.yaml: preprocessor: cannot import '{spec}'"),
    ],
)
def test_a_preprocessor_whose_import_raises_is_named_with_where(
    load, prefix, tmp_path, monkeypatch
):
    """A module that raises on import (not an ImportError) stopped `recserve serve` (and
    `recserve eval --mapping`) with a bare traceback that named neither the flag (the
    mapping) nor its value."""
    from embedding_store.errors import InvalidArgumentError

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "raising_pre_h87.py").write_text("x = 1\nraise RuntimeError('no config')\n")
    (tmp_path / "broken_pre_h87.py").write_text("def f(:\n")
    where = Path.cwd() / "raising_pre_h87.py"
    expected = {
        "raising_pre_h87:f": f"importing 'raising_pre_h87' raised RuntimeError: no config "
        f"({where}, line 2)",
        "broken_pre_h87:f": "importing 'broken_pre_h87' raised SyntaxError: invalid syntax "
        "(broken_pre_h87.py, line 1)",
    }
    try:
        for spec, reason in expected.items():
            with pytest.raises(InvalidArgumentError) as raised:
                load(spec)
            assert raised.value.message == f"{prefix.format(spec=spec)}: {reason}"
    finally:
        for name in ("raising_pre_h87", "broken_pre_h87"):
            sys.modules.pop(name, None)


def test_a_workers_server_reports_a_bad_preprocessor_once_before_starting_processes(
    monkeypatch, capsys
):
    """recserve serve --workers 2 started its processes, and each failed importing the
    preprocessor with the same error: printed once per process. The supervisor imports it
    first, and refuses before it reserves ports or starts a process."""
    from embedding_store.cli import main
    from serving import processes

    started: list[ServeOptions] = []
    monkeypatch.setattr(processes, "serve_processes", lambda options: started.append(options))
    spec = "no_such_module_h87:f"
    code = main(["serve", "--checkpoint", "nowhere", "--workers", "2", "--preprocessor", spec])
    assert (code, started) == (1, [])
    assert capsys.readouterr().err == (
        f"recserve serve: error: cannot import preprocessor '{spec}': No module named "
        "'no_such_module_h87'\n"
    )


def test_a_stop_turns_readiness_off_before_draining():
    """Load balancers must see NOT_SERVING while in-flight requests drain, not after."""
    events: list[str] = []
    stopping = PredictionServer(ServeOptions(checkpoint="ckpt", grace_seconds=1.0))
    stopping.service = SimpleNamespace(
        stop_accepting=lambda: events.append("stop_accepting"),
        drain=lambda seconds: events.append(f"drain {seconds:g}") or True,
        close=lambda wait: events.append("close"),
        wait_for_reload=lambda timeout: events.append("wait_for_reload") or True,
    )
    stopping._health = SimpleNamespace(set_serving=lambda up: events.append(f"serving {up}"))
    assert stopping.stop() is True
    assert events == ["stop_accepting", "serving False", "drain 1", "close", "wait_for_reload"]


class _FakeServer:
    """Stands in for PredictionServer in serve(): ``start`` runs ``on_start``; ``stop``
    returns ``drained``."""

    on_start: Callable[[], None] = staticmethod(lambda: None)
    drained = True
    reloading = False  # a reload still loading once stop() returned
    instances: list[_FakeServer] = []

    def __init__(self, options: ServeOptions) -> None:
        self.calls: list[str] = []
        _FakeServer.instances.append(self)

    def start(self) -> _FakeServer:
        self.calls.append("start")
        type(self).on_start()
        return self

    def wait(self) -> None:
        self.calls.append("wait")

    def request_stop(self, signum: int = signal.SIGTERM, frame=None) -> None:
        self.calls.append("request_stop")

    def stop(self) -> bool:
        self.calls.append("stop")
        return type(self).drained


@pytest.fixture
def fake_server(monkeypatch):
    monkeypatch.setattr(server, "PredictionServer", _FakeServer)
    monkeypatch.setattr(_FakeServer, "instances", [])
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield _FakeServer
    for signum, handler in handlers.items():
        signal.signal(signum, handler)


def test_serve_exits_0_after_a_clean_drain_and_1_when_requests_were_cut(fake_server, monkeypatch):
    assert server.serve(ServeOptions(checkpoint="ckpt")) == 0
    monkeypatch.setattr(fake_server, "drained", False)
    assert server.serve(ServeOptions(checkpoint="ckpt")) == 1
    assert [s.calls for s in fake_server.instances] == [["start", "wait", "stop"]] * 2


def test_serve_leaves_without_interpreter_shutdown_while_a_reload_still_loads(
    fake_server, monkeypatch
):
    """SIGTERM while the watcher loads a checkpoint: interpreter shutdown would end that
    thread inside torch's native code and abort the process (SIGABRT, exit 134), so serve
    exits at once with the stop's own code instead."""
    exits: list[int] = []

    class Exited(BaseException):
        """Raised by the stand-in os._exit: the test goes on past it."""

    def exit_now(code: int) -> None:
        exits.append(code)
        raise Exited

    monkeypatch.setattr(server.os, "_exit", exit_now)
    monkeypatch.setattr(fake_server, "reloading", True)
    for drained, code in ((True, 0), (False, 1)):
        monkeypatch.setattr(fake_server, "drained", drained)
        with pytest.raises(Exited):
            server.serve(ServeOptions(checkpoint="ckpt"))
        assert exits.pop() == code
    monkeypatch.setattr(fake_server, "reloading", False)
    assert server.serve(ServeOptions(checkpoint="ckpt")) == 1 and exits == []  # returns


def test_serve_leaving_by_os_exit_flushes_the_log_first(fake_server, monkeypatch):
    """os._exit skips interpreter shutdown, and with it logging's: serve shuts logging
    down itself first, or the stop's last lines (a file handler's buffer) are lost."""
    steps: list[str] = []

    class Exited(BaseException):
        """Raised by the stand-in os._exit: the test goes on past it."""

    def exit_now(code: int) -> None:
        steps.append(f"exit {code}")
        raise Exited

    monkeypatch.setattr(server.os, "_exit", exit_now)
    monkeypatch.setattr(server.logging, "shutdown", lambda: steps.append("logging.shutdown"))
    monkeypatch.setattr(fake_server, "reloading", True)
    with pytest.raises(Exited):
        server.serve(ServeOptions(checkpoint="ckpt"))
    assert steps == ["logging.shutdown", "exit 0"]


def test_the_server_is_reloading_while_its_service_is():
    """What serve() reads to leave by os._exit: the service's reload lock, False before a
    service exists."""
    from types import SimpleNamespace

    prediction_server = server.PredictionServer(ServeOptions(checkpoint="ckpt"))
    assert prediction_server.reloading is False
    prediction_server.service = SimpleNamespace(reloading=True)  # type: ignore[assignment]
    assert prediction_server.reloading is True
    prediction_server.service = SimpleNamespace(reloading=False)  # type: ignore[assignment]
    assert prediction_server.reloading is False


def test_a_stop_during_start_up_is_a_clean_exit(fake_server, monkeypatch):
    """SIGTERM while loading the checkpoint stops there (exit 0), without waiting for the
    start-up to end; afterwards a signal only asks the server to stop."""
    monkeypatch.setattr(fake_server, "on_start", lambda: os.kill(os.getpid(), signal.SIGTERM))
    monkeypatch.setattr(fake_server, "drained", False)  # exit 0 all the same
    assert server.serve(ServeOptions(checkpoint="ckpt")) == 0
    (stopped,) = fake_server.instances
    assert stopped.calls == ["start", "request_stop", "stop"]
    assert signal.getsignal(signal.SIGTERM) == stopped.request_stop


def test_a_failed_start_up_stops_what_started_and_raises(fake_server, monkeypatch):
    from embedding_store.errors import UnavailableError

    def fail() -> None:
        raise UnavailableError("port taken")

    monkeypatch.setattr(fake_server, "on_start", fail)
    with pytest.raises(UnavailableError, match="port taken"):
        server.serve(ServeOptions(checkpoint="ckpt"))
    assert fake_server.instances[0].calls == ["start", "stop"]


def test_a_signal_while_the_start_up_handlers_are_replaced_is_a_clean_stop(
    fake_server, monkeypatch
):
    """Ctrl-C arriving after start() returned, while serve() puts back its signal handlers
    (SIGTERM's replaced, SIGINT's not yet), still stops cleanly with exit 0: the start-up
    handler's exception used to escape serve() from its ``finally`` as a traceback."""
    real_signal = signal.signal

    def signal_then_ctrl_c(signum, handler):
        previous = real_signal(signum, handler)
        if signum == signal.SIGTERM and getattr(handler, "__name__", "") == "request_stop":
            signal.getsignal(signal.SIGINT)(signal.SIGINT, None)  # as the signal would
        return previous

    monkeypatch.setattr(server.signal, "signal", signal_then_ctrl_c)
    assert server.serve(ServeOptions(checkpoint="ckpt")) == 0
    (stopped,) = fake_server.instances
    assert stopped.calls == ["start", "request_stop", "stop"]


def test_serve_hands_several_workers_to_the_supervisor_and_a_process_watches_it(
    fake_server, monkeypatch
):
    supervised: list[ServeOptions] = []
    watched: list[int] = []
    monkeypatch.setattr(server, "serve_processes", lambda o: supervised.append(o) or 7)
    monkeypatch.setattr(server, "stop_when_parent_exits", lambda pid, what: watched.append(pid))
    several = ServeOptions(checkpoint="ckpt", workers=2)
    assert server.serve(several) == 7
    assert supervised == [several] and fake_server.instances == []
    assert server.serve(ServeOptions(checkpoint="ckpt", supervisor_pid=4321)) == 0
    assert watched == [4321]
    assert [s.calls for s in fake_server.instances] == [["start", "wait", "stop"]]


def asgi_get_while_the_thread_pool_is_full(app, path: str) -> tuple[int, bytes]:
    """``GET path`` of ASGI ``app``, on a loop whose thread pool (anyio's default limiter,
    cut to one token) is held by a call that waits: what prediction requests waiting for
    their answers (a slow embedding tier) do to it. TimeoutError if the answer waits too."""
    import anyio.to_thread

    async def main() -> tuple[int, bytes]:
        anyio.to_thread.current_default_thread_limiter().total_tokens = 1
        release = threading.Event()
        holder = asyncio.ensure_future(anyio.to_thread.run_sync(release.wait, 10))
        await asyncio.sleep(0.05)  # the one token is taken
        sent: list[dict] = []

        async def receive() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {
            "type": "http", "http_version": "1.1", "method": "GET", "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [], "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000),
        }  # fmt: skip
        try:
            await asyncio.wait_for(app(scope, receive, send), 2.0)
        finally:
            release.set()
            await holder
        return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])

    return asyncio.run(main())


def test_metrics_are_scraped_while_the_thread_pool_is_full():
    """A scrape ran in the thread pool, behind requests waiting there for their answers
    (friendly ones, large bodies): 8.5 s with 45 waiting on a hung shard, past a scrape's
    timeout just when the metrics matter. It answers from the event loop."""
    from fastapi import FastAPI

    from serving.metrics import ServingMetrics

    metrics = ServingMetrics()
    metrics.reloads.labels("failed").inc()
    serving = PredictionServer(ServeOptions(checkpoint="ckpt"))
    serving.service = SimpleNamespace(metrics=metrics)  # type: ignore[assignment]
    app = FastAPI()
    serving._mount_metrics(app)
    status, body = asgi_get_while_the_thread_pool_is_full(app, "/metrics")
    assert status == 200
    assert b'recserve_reloads_total{outcome="failed"} 1.0\n' in body
