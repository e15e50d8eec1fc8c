"""training.distributed and training.env: DDP options and the torchrun environment."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from embedding_store.errors import ConfigError
from training import distributed
from training.distributed import DDPOption


def test_ddp_option_backend_must_be_gloo_or_nccl():
    with pytest.raises(ConfigError) as refused:
        DDPOption(backend="mpi")
    assert str(refused.value) == "DDPOption.backend must be 'gloo' or 'nccl', got 'mpi'"
    assert DDPOption().backend == "gloo"


def test_ddp_option_nccl_needs_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError) as refused:
        DDPOption(backend="nccl")
    assert str(refused.value) == "DDPOption.backend 'nccl' needs CUDA; use 'gloo' on CPU"


def test_rank_world_size_and_local_rank_come_from_torchruns_environment(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert (distributed.rank(), distributed.local_rank(), distributed.world_size()) == (0, 0, 1)
    # Second node of two, four processes each: global rank 5 is local rank 1.
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert (distributed.rank(), distributed.local_rank(), distributed.world_size()) == (5, 1, 8)


@pytest.mark.parametrize(
    ("name", "value", "minimum"),
    [("WORLD_SIZE", "abc", 1), ("WORLD_SIZE", "0", 1), ("RANK", "-1", 0), ("LOCAL_RANK", "1.5", 0)],
)
def test_a_malformed_torchrun_variable_is_named_with_its_value(monkeypatch, name, value, minimum):
    for other in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(name, value)
    reader = {
        "WORLD_SIZE": distributed.world_size,
        "RANK": distributed.rank,
        "LOCAL_RANK": distributed.local_rank,
    }[name]
    with pytest.raises(ConfigError) as refused:
        reader()
    assert str(refused.value) == (
        f"environment variable {name}={value!r}: expected a whole number >= {minimum} "
        "(torchrun sets it; unset it for a single process)"
    )


def test_a_single_process_is_not_distributed_and_agrees_with_itself(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert distributed.init_distributed(DDPOption()) is False
    assert distributed.all_agree(True) is True
    assert distributed.all_agree(False) is False
    distributed.barrier()  # nothing to wait for


def _record_joining(monkeypatch) -> list[tuple]:
    """Run init_distributed as rank 1 of 2 without a group: set_device and
    init_process_group only record their calls, in order."""
    calls: list[tuple] = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set", device)))
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(
        distributed.dist,
        "init_process_group",
        lambda **kwargs: calls.append(("init", kwargs["backend"], kwargs["device_id"])),
    )
    return calls


def test_a_gpu_rank_makes_its_gpu_current_before_joining_and_binds_nccl_to_it(monkeypatch):
    """Without set_device every rank's current device is GPU 0, where NCCL runs the
    collectives that name no tensor (barrier, all_agree): "Duplicate GPU detected"."""
    calls = _record_joining(monkeypatch)
    gpu = torch.device("cuda", 1)
    assert distributed.init_distributed(DDPOption(backend="nccl"), gpu) is True
    assert calls == [("set", gpu), ("init", "nccl", gpu)]
    calls.clear()
    assert distributed.init_distributed(DDPOption(backend="gloo"), gpu) is True
    assert calls == [("set", gpu), ("init", "gloo", None)]  # device_id is NCCL's
    calls.clear()
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process on a GPU: current too, no group
    assert distributed.init_distributed(DDPOption(backend="nccl"), gpu) is False
    assert calls == [("set", gpu)]


def test_nccl_with_the_model_on_cpu_is_refused_before_the_rendezvous(monkeypatch):
    calls = _record_joining(monkeypatch)
    for device in (None, torch.device("cpu")):
        with pytest.raises(ConfigError) as refused:
            distributed.init_distributed(DDPOption(backend="nccl"), device)
        assert str(refused.value) == (
            "DDPOption.backend 'nccl' needs the dense model on this rank's GPU (device_id, "
            "usually LOCAL_RANK); a model on CPU trains with 'gloo'"
        )
    assert calls == []
    assert distributed.init_distributed(DDPOption(), torch.device("cpu")) is True
    assert calls == [("init", "gloo", None)]


def test_sigterm_from_a_gone_launcher_still_ends_the_rank_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """graceful_sigterm: the SIGTERM a rank sends itself when its torchrun launcher is gone
    (``exit_with_launcher``) ends it as before, with no checkpoint (another run may be
    starting); a SIGTERM while the launcher is there asks for the graceful stop."""
    killed: list[tuple[int, int]] = []
    monkeypatch.setattr(distributed.os, "kill", lambda pid, signum: killed.append((pid, signum)))
    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(distributed, "_watching", [os.getppid()])
    with distributed.graceful_sigterm() as request:
        handler = signal.getsignal(signal.SIGTERM)
        assert callable(handler)
        handler(signal.SIGTERM, None)  # the launcher is this process's parent
        assert request.requested and killed == []
    assert signal.getsignal(signal.SIGTERM) is before
    monkeypatch.setattr(distributed, "_watching", [os.getppid() + 1])  # not the parent now
    with distributed.graceful_sigterm() as request:
        handler = signal.getsignal(signal.SIGTERM)
        assert callable(handler)
        handler(signal.SIGTERM, None)
        assert not request.requested
        assert killed == [(os.getpid(), signal.SIGTERM)]
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # so the kill ends it
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_sigterm_once_the_run_finished_is_ignored_through_the_exit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """sigterm_ignored_once_finished: a SIGTERM while a finished script winds down (a pod
    deleted as the run ends) killed it with -15, and `recserve train` reported a complete
    run as stopped (exit 143). Before run.finish() the handler in place before runs (a
    Python one stands in for the default here); after it, a SIGTERM is ignored, and the
    script keeps ignoring it once the block ends (SIG_IGN, which the interpreter's teardown
    leaves in place); a SIGTERM from a gone launcher still ends the process."""
    got: list[int] = []

    def before(signum: int, frame: object) -> None:
        got.append(signum)

    killed: list[tuple[int, int]] = []
    monkeypatch.setattr(distributed.os, "kill", lambda pid, signum: killed.append((pid, signum)))
    monkeypatch.setattr(distributed, "_watching", [os.getppid()])  # the launcher is there
    outer = signal.signal(signal.SIGTERM, before)
    try:
        with distributed.sigterm_ignored_once_finished() as run:
            signal.raise_signal(signal.SIGTERM)
            assert got == [signal.SIGTERM]  # not finished: the handler before's
            with distributed.graceful_sigterm() as stop:
                run.finish()
            assert not stop.requested
            signal.raise_signal(signal.SIGTERM)
            assert got == [signal.SIGTERM] and killed == []
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        signal.signal(signal.SIGTERM, before)
        with distributed.sigterm_ignored_once_finished(keep=False) as run:
            run.finish()
        assert signal.getsignal(signal.SIGTERM) is before  # an in-process caller's own back
        with distributed.sigterm_ignored_once_finished():
            pass  # not finished: the handler before is put back
        assert signal.getsignal(signal.SIGTERM) is before
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with distributed.sigterm_ignored_once_finished(keep=False) as run:
            run.finish()
            monkeypatch.setattr(distributed, "_watching", [os.getppid() + 1])  # gone
            handler = signal.getsignal(signal.SIGTERM)
            assert callable(handler)
            handler(signal.SIGTERM, None)
            assert killed == [(os.getpid(), signal.SIGTERM)]
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # so the kill ends it
    finally:
        signal.signal(signal.SIGTERM, outer)


def test_stop_agreed_stops_every_rank_when_one_got_sigterm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Alone, the request itself; with ranks, the all-reduce of "nobody asked to stop"
    decides, so a rank that got no SIGTERM stops at the same step as the one that did."""
    request = distributed.StopRequest()
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert distributed.stop_agreed(request) is False
    request.requested = True
    assert distributed.stop_agreed(request) is True
    sent: list[bool] = []

    def all_agree(ok: bool) -> bool:
        sent.append(ok)
        return False  # another rank passed False: it got the SIGTERM

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(distributed, "all_agree", all_agree)
    assert distributed.stop_agreed(distributed.StopRequest()) is True
    assert sent == [True]  # this rank itself was not asked to stop


def test_stop_agreed_agrees_every_few_steps_under_ddp(monkeypatch: pytest.MonkeyPatch) -> None:
    """graceful_sigterm's request is agreed on every STOP_AGREE_EVERY-th step (the same calls
    on every rank): the all-reduce per step cost 10-40 % of a small model's step. Alone, a
    request stops after the step it came in."""
    sent: list[bool] = []

    def all_agree(ok: bool) -> bool:
        sent.append(ok)
        return ok

    monkeypatch.setattr(distributed, "all_agree", all_agree)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    alone = distributed.TrainingStop()
    alone.requested = True
    assert distributed.stop_agreed(alone) is True and sent == []
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert distributed.STOP_AGREE_EVERY == 8
    request = distributed.TrainingStop()
    decided = [distributed.stop_agreed(request) for _ in range(7)]
    request.requested = True  # SIGTERM after step 7: agreed on after step 8
    decided += [distributed.stop_agreed(request) for _ in range(9)]
    assert decided == [False] * 7 + [True] + [False] * 7 + [True]
    assert sent == [False, False]  # two all-reduces in 16 steps (after steps 8 and 16)
    other = distributed.TrainingStop()
    assert [distributed.stop_agreed(other, every=1) for _ in range(2)] == [False, False]
    assert sent == [False, False, True, True]
    with pytest.raises(ConfigError, match="every must be an integer >= 1, got 0"):
        distributed.stop_agreed(other, every=0)
