"""torch.distributed set-up for NN workers: DDP over gloo (CPU) or nccl (GPU).

recserve never manages a cluster itself: ranks, world size and the rendezvous come from the
environment that ``torchrun`` (or a Kubernetes Job running torchrun) sets.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from embedding_store.errors import ConfigError
from embedding_store.stop_signal import StopRequest, stop_when_parent_exits

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DDPOption:
    """How dense parameters are synchronized across NN workers.

    ``backend``: "gloo" (CPU) or "nccl" (CUDA). ``init_method``: torch's rendezvous URL;
    the default "env://" reads MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE as torchrun sets them.
    """

    backend: str = "gloo"
    init_method: str = "env://"
    find_unused_parameters: bool = False
    timeout_seconds: float = 300.0

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl"):
            raise ConfigError(f"DDPOption.backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if self.backend == "nccl" and not torch.cuda.is_available():
            raise ConfigError("DDPOption.backend 'nccl' needs CUDA; use 'gloo' on CPU")


def _environment_count(name: str, default: int, minimum: int) -> int:
    """The integer torchrun puts in ``name`` (``default`` when unset); ConfigError naming the
    variable and its value when it is not a whole number of at least ``minimum``."""
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ConfigError(
            f"environment variable {name}={text!r}: expected a whole number >= {minimum} "
            "(torchrun sets it; unset it for a single process)"
        )
    return value


def world_size() -> int:
    """WORLD_SIZE from the environment (1 when not launched by torchrun)."""
    return _environment_count("WORLD_SIZE", 1, 1)


def rank() -> int:
    """This process's global rank (0 when not distributed)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return _environment_count("RANK", 0, 0)


def local_rank() -> int:
    """This process's rank on its node (0 when not distributed)."""
    return _environment_count("LOCAL_RANK", 0, 0)


_watching: list[int] = []  # the launcher's PID, once watched

#: How long the ranks wait for one another around a checkpoint (rank 0 writing or loading
#: it, every rank flushing its embedding updates first). The process group's collectives
#: give up after ``DDPOption.timeout_seconds`` (300 s by default), and a dump or load of a
#: large remote tier takes longer (the embedding worker allows it 600 s): the waiting ranks
#: failed in the middle of a checkpoint that was going well.
CHECKPOINT_WAIT_SECONDS = 3600.0
_checkpoint_group: list[Any] = []  # the gloo group with that timeout, once made


def exit_with_launcher() -> None:
    """When torchrun started this process, end it (SIGTERM) once torchrun is gone.

    torchrun starts each rank in a session of its own, so a launcher killed outright (kill
    -9, the OOM killer) leaves its ranks running, reparented: they would go on updating the
    shared embedding tier and write a checkpoint while the user starts another run. A daemon
    thread notices the new parent within
    :data:`embedding_store.stop_signal.PARENT_CHECK_SECONDS`."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or _watching:
        return
    launcher = os.getppid()
    _watching.append(launcher)
    stop_when_parent_exits(launcher, "the launcher (torchrun)")


def launcher_gone() -> bool:
    """Whether the torchrun launcher this process watches (:func:`exit_with_launcher`) is no
    longer its parent: the SIGTERM that then arrives is the watch's, not a request to stop
    gracefully (a script that checkpoints on SIGTERM must not write while the user may be
    starting another run)."""
    return bool(_watching) and os.getppid() != _watching[0]


#: Steps between two agreements of :func:`stop_agreed` under DDP: its all-reduce of one flag
#: after every step cost +0.3-1.4 ms on a 1.3-2.6 ms step (2 gloo ranks on CPU, a small MLP,
#: runs of 300 steps on a busy 2-core machine: +25-55 %), once every 8 steps +0-0.4 ms,
#: within the runs' spread; a stop then comes at most 7 steps after the SIGTERM.
STOP_AGREE_EVERY = 8


class TrainingStop(StopRequest):
    """The stop request of :func:`graceful_sigterm`; counts the :func:`stop_agreed` calls
    (the same on every rank: each calls it after every step) to agree every few steps."""

    def __init__(self) -> None:
        super().__init__()
        self.checks = 0


@contextlib.contextmanager
def graceful_sigterm() -> Iterator[TrainingStop]:
    """A SIGTERM handler for a graceful stop, for the block (then the previous one again):
    the request it sets, which the training loop reads after each step with
    :func:`stop_agreed` and then stops (writing a checkpoint, or not) instead of being
    killed in the middle of a step or a checkpoint write. Installed from the main thread
    only (where Python runs handlers). A SIGTERM sent because the torchrun launcher is gone
    (:func:`exit_with_launcher`) still ends the process at once: no checkpoint while the
    user may be starting another run."""
    request = TrainingStop()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        if launcher_gone():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        request.handler(signum, frame)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield request
    finally:
        signal.signal(signal.SIGTERM, previous)


class FinishedRun:
    """What :func:`sigterm_ignored_once_finished` yields: :meth:`finish` says the run is
    complete (final checkpoint written, result printed), from which on a SIGTERM is no stop."""

    def __init__(self) -> None:
        self.finished = False

    def finish(self) -> None:
        """The run is complete: a SIGTERM from here on is ignored (see
        :func:`sigterm_ignored_once_finished`)."""
        self.finished = True


@contextlib.contextmanager
def sigterm_ignored_once_finished(*, keep: bool = True) -> Iterator[FinishedRun]:
    """A SIGTERM handler for a whole training script (around :func:`graceful_sigterm` and
    the TrainCtx): until ``run.finish()`` it does what the handler in place before did (the
    default: the process ends, status -15); after it, a SIGTERM is ignored. A pod deleted as
    the run ends, or torchrun passing a SIGTERM on, would otherwise kill a rank while it
    writes its last lines, leaves TrainCtx or shuts the interpreter down (~0.3 s), and
    ``recserve train`` report a complete run as "stopped by SIGTERM" (exit 143). Call
    ``run.finish()`` inside the :func:`graceful_sigterm` block once the final checkpoint is
    written (that block's handler until it ends, then this one). A SIGTERM sent because the
    torchrun launcher is gone (:func:`exit_with_launcher`) still ends the process.

    Leaving the block, a finished run with ``keep`` (the default, for a script that ends
    after it) keeps ignoring SIGTERM (SIG_IGN: the interpreter's teardown puts the default
    back in place of a Python handler, and a SIGTERM after the atexit calls still ended the
    process). A program the script starts after that inherits the ignored SIGTERM (exec
    keeps it): start such programs within the block. Otherwise (``keep=False``: a caller
    that goes on in the same process, a test; or a run not finished) the previous handler
    is put back. From another thread than the main one (where Python runs handlers) it
    installs nothing."""
    run = FinishedRun()
    if threading.current_thread() is not threading.main_thread():
        yield run
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is None:  # a handler not installed from Python: taken for the default
        previous = signal.SIG_DFL

    def handler(signum: int, frame: FrameType | None) -> None:
        if run.finished and not launcher_gone():
            return
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield run
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN if keep and run.finished else previous)


def stop_agreed(request: StopRequest, every: int = STOP_AGREE_EVERY) -> bool:
    """Whether to stop after this step (every rank calls it after every step): when any
    rank got SIGTERM, every rank stops at the same step (torchrun signals the ranks one by
    one, and a rank that stopped alone would leave the others waiting in their allreduce).

    Alone, after the step the request came in. Under DDP the ranks agree (one all-reduce of
    a flag) on every ``every``-th call for a :class:`TrainingStop` (the request of
    :func:`graceful_sigterm`), so a stop comes up to ``every - 1`` steps after the SIGTERM:
    pass ``every=1`` when steps are long (seconds) and the grace period short. Another
    StopRequest is agreed on at every call (it counts no calls)."""
    if every < 1:
        raise ConfigError(f"stop_agreed: every must be an integer >= 1, got {every}")
    if world_size() <= 1:
        return request.requested
    if isinstance(request, TrainingStop):
        request.checks += 1
        if request.checks % every:
            return False  # every rank skips the same calls: no rank waits in an all-reduce
    return not all_agree(not request.requested)


def init_distributed(option: DDPOption, device: torch.device | None = None) -> bool:
    """Join the process group when WORLD_SIZE > 1; returns whether it is distributed.
    A rank that torchrun started ends with it (:func:`exit_with_launcher`).

    ``device``: where this rank's dense model runs. A CUDA device becomes the current one
    (``torch.cuda.set_device``) before the group exists, even in a single process:
    :func:`all_agree` puts its flag on the current device, which is GPU 0 in every rank
    otherwise (NCCL then fails with "Duplicate GPU detected", or hangs), and so does
    anything else that allocates on "cuda" without an index. With nccl the device is also
    ``device_id``: the communicator forms at once, bound to this rank's GPU, and
    :func:`barrier` runs there instead of on a GPU torch guesses from the rank."""
    exit_with_launcher()
    on_gpu = device is not None and device.type == "cuda"
    if on_gpu:
        assert device is not None  # on_gpu says so (for mypy)
        torch.cuda.set_device(device)
    if world_size() <= 1:
        return False
    if option.backend == "nccl" and not on_gpu:
        # DDP would fail at its first allreduce with "No backend type associated with
        # device type cpu", after the rendezvous.
        raise ConfigError(
            "DDPOption.backend 'nccl' needs the dense model on this rank's GPU (device_id, "
            "usually LOCAL_RANK); a model on CPU trains with 'gloo'"
        )
    if not dist.is_initialized():
        dist.init_process_group(
            backend=option.backend,
            init_method=option.init_method,
            timeout=timedelta(seconds=option.timeout_seconds),
            device_id=device if option.backend == "nccl" else None,
        )
    if not _checkpoint_group and dist.is_initialized():
        # Every rank makes it here, in the same order (new_group is collective). gloo on
        # CPU whatever the backend: it carries one flag.
        wait = max(CHECKPOINT_WAIT_SECONDS, option.timeout_seconds)
        _checkpoint_group.append(dist.new_group(backend="gloo", timeout=timedelta(seconds=wait)))
    return True


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def all_agree(ok: bool) -> bool:
    """Whether every rank passed ``ok=True`` (an all-reduce MIN of one flag; every rank must
    call it). ``ok`` itself when not distributed. Ranks use it to stop together when one of
    them ran out of batches; around a checkpoint, :func:`checkpoint_agree`."""
    if not (dist.is_available() and dist.is_initialized()):
        return ok
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _long_group() -> Any:
    """The checkpoint group (:data:`CHECKPOINT_WAIT_SECONDS`), else the default group (a
    process group that :func:`init_distributed` did not set up)."""
    return _checkpoint_group[0] if _checkpoint_group else None


def checkpoint_barrier() -> None:
    """:func:`barrier` that waits up to :data:`CHECKPOINT_WAIT_SECONDS` (ranks flushing their
    embedding updates before a checkpoint)."""
    if dist.is_available() and dist.is_initialized():
        group = _long_group()
        if group is None:
            dist.barrier()
        else:
            # gloo's barrier is an all-reduce on CPU; a flag says the same and needs no
            # device (a nccl default group's barrier would want one).
            checkpoint_agree(True)


def checkpoint_agree(ok: bool) -> bool:
    """:func:`all_agree` that waits up to :data:`CHECKPOINT_WAIT_SECONDS`: the ranks fail
    together when rank 0 failed to write or load a checkpoint, and wait for it as long as a
    dump of a large tier takes when it did not."""
    group = _long_group()
    if group is None or not dist.is_initialized():
        return all_agree(ok)
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def all_gather_bytes(data: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``data`` (uint8 [n], n may differ by rank), by rank, on the CPU; every
    rank must call it. Over the checkpoint group (it runs around a checkpoint: see
    :func:`checkpoint_agree`); ``[data]`` when not distributed. Two all-gathers: the sizes,
    then the bytes padded to the longest."""
    if not (dist.is_available() and dist.is_initialized()):
        return [data]
    group = _long_group()
    on_gpu = group is None and dist.get_backend() == "nccl"  # nccl gathers GPU tensors only
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    ranks = dist.get_world_size(group)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(ranks)]
    dist.all_gather(sizes, size, group=group)
    counts = [int(count.item()) for count in sizes]
    padded = torch.zeros(max(counts), dtype=torch.uint8, device=device)
    padded[: data.numel()] = data.reshape(-1)
    gathered = [torch.empty_like(padded) for _ in range(ranks)]
    dist.all_gather(gathered, padded, group=group)
    return [part[:count].cpu() for part, count in zip(gathered, counts)]


def shutdown_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        _checkpoint_group.clear()
        dist.destroy_process_group()
