"""The Adult example's scripts, piece by piece: train.py's argument checks,
its data schedule (local_batches), resume position and SIGTERM stop (one in-process run
stopped and resumed), and quickstart.py's pure helpers."""

from __future__ import annotations

import functools
import json
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from examples.adult_income import features, quickstart, train
from examples.adult_income.hparams import AdultHParams

# ------------------------------------------------------------------------------------------
# train.py: refusals said before any training


def _main_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """train.main's argparse error (exit status 2) for ``argv``: the message of its last
    line, after ``PROG: error: ``."""
    with pytest.raises(SystemExit) as exit_info:
        train.main(argv)
    assert exit_info.value.code == 2
    prog, sep, message = capsys.readouterr().err.strip().splitlines()[-1].partition(": error: ")
    assert sep, prog
    return message


def test_eval_only_needs_resume_from(capsys: pytest.CaptureFixture[str]) -> None:
    err = _main_error(capsys, ["--eval-only", "--device", "cpu"])
    assert err == "--eval-only needs --resume-from (there is nothing trained to evaluate)"


def test_checkpoint_on_stop_needs_checkpoint_dir(capsys: pytest.CaptureFixture[str]) -> None:
    err = _main_error(capsys, ["--checkpoint-on-stop", "--device", "cpu"])
    assert err == "--checkpoint-on-stop needs --checkpoint-dir (where to write it)"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # A traceback from range() after the data was read:
        (["--batch-size", "0"], "argument --batch-size: expected an integer > 0, got 0"),
        # Trained nothing and still wrote a checkpoint saying its 3 epochs were done:
        (["--batch-size", "-5"], "argument --batch-size: expected an integer > 0, got -5"),
        (["--epochs", "-1"], "argument --epochs: expected an integer >= 0, got -1"),
        (["--seed", "-1"], "argument --seed: expected an integer >= 0, got -1"),
        (
            ["--embedding-staleness", "0"],
            "argument --embedding-staleness: expected an integer > 0, got 0",
        ),
    ],
)
def test_sizes_counts_and_seed_are_checked_before_training(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert _main_error(capsys, [*argv, "--device", "cpu"]) == message


def test_clip_grad_norm_is_checked_and_reaches_train_ctx(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    err = _main_error(capsys, ["--clip-grad-norm", "0", "--device", "cpu"])
    assert err == "argument --clip-grad-norm: expected a number > 0, got '0'"

    class BuiltError(Exception):
        """Raised in TrainCtx's place: what main passed is all this test needs."""

    given: list[object] = []

    def train_ctx(*args: object, **kwargs: object) -> None:
        given.append(kwargs["dense_grad_clip_norm"])
        raise BuiltError

    monkeypatch.setattr(train, "TrainCtx", train_ctx)
    monkeypatch.setattr(train.features, "read_encoded", lambda path: None)  # no data needed
    threads = torch.get_num_threads()  # main() sets 1
    try:
        for argv in (["--clip-grad-norm", "0.5"], []):
            with pytest.raises(BuiltError):
                train.main([*argv, "--device", "cpu"])
    finally:
        torch.set_num_threads(threads)
    assert given == [0.5, None]


def test_cuda_refused_where_there_is_none(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = _main_error(capsys, ["--device", "cuda"])
    assert err == "--device cuda: CUDA is not available on this machine"


@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_a_process_without_a_gpu_of_its_own_is_refused(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    """The third of three processes on a two-GPU node (torchrun's LOCAL_RANK 2)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "2")
    err = _main_error(capsys, ["--device", device])
    assert err == (
        f"--device {device}: this process (LOCAL_RANK 2) has no GPU of its own: this machine "
        "has 2; start at most that many processes per node (--nproc-per-node), or pass "
        "--device cpu"
    )


def test_checkpoint_dir_checked_before_training(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A checkpoint that could not be saved is refused at once, not after the run."""
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    err = _main_error(capsys, ["--device", "cpu", "--checkpoint-dir", str(occupied)])
    assert err == (
        f"--checkpoint-dir: checkpoint directory {occupied} already exists; refusing to "
        "overwrite it (--overwrite, or overwrite=True, replaces it)"
    )
    # Not a checkpoint: even --overwrite does not replace it.
    err = _main_error(capsys, ["--device", "cpu", "--checkpoint-dir", str(occupied), "--overwrite"])
    assert err == (
        f"--checkpoint-dir: {occupied} exists and is not a recserve checkpoint (no DONE marker): "
        "refusing to replace it; choose another directory"
    )
    assert (occupied / "notes.txt").read_text() == "mine"
    # The nearest existing parent is a file: nothing can be staged there.
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    target = blocker / "run" / "checkpoint"
    err = _main_error(capsys, ["--device", "cpu", "--checkpoint-dir", str(target)])
    assert err == f"--checkpoint-dir {target}: cannot write in {blocker} (Not a directory)"


# ------------------------------------------------------------------------------------------
# train.py: data schedule and resume position


def _numbered_rows(count: int) -> features.EncodedRows:
    """``count`` rows whose numeric features and IDs all equal the row's index."""
    index = np.arange(count)
    return features.EncodedRows(
        ids={slot: index.astype(np.uint64) for slot in features.SLOT_NAMES},
        numeric=np.repeat(index[:, None], features.NUM_NON_ID_FEATURES, axis=1).astype(np.float32),
        labels=(index % 2).astype(np.float32).reshape(-1, 1),
    )


def _rows_of(batches: list) -> list[list[int]]:
    return [[int(v) for v in b.id_feature("workclass").values] for b in batches]


def test_local_batches_split_one_shuffled_epoch_between_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Batch b of the epoch's permutation goes to rank b % world; every rank runs the same
    number of steps (the leftover batches are dropped), and the order is drawn from
    seed * 1000 + epoch."""
    hp = AdultHParams(batch_size=3, seed=2)
    rows = _numbered_rows(10)  # batches start at 0, 3, 6, 9: 4 batches
    order = np.random.default_rng(2 * 1000 + 1).permutation(10).tolist()
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    alone = list(train.local_batches(hp, rows, epoch=1))
    assert _rows_of(alone) == [order[0:3], order[3:6], order[6:9], order[9:10]]
    assert all(b.requires_grad for b in alone)

    monkeypatch.setenv("WORLD_SIZE", "3")  # 4 batches, 3 ranks: 1 step each
    per_rank = []
    for rank in range(3):
        monkeypatch.setenv("RANK", str(rank))
        per_rank.append(_rows_of(list(train.local_batches(hp, rows, epoch=1))))
    assert per_rank == [[order[0:3]], [order[3:6]], [order[6:9]]]

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert _rows_of(list(train.local_batches(hp, rows, epoch=1))) == [order[3:6], order[9:10]]
    another_epoch = np.random.default_rng(2 * 1000 + 2).permutation(10).tolist()
    assert _rows_of(list(train.local_batches(hp, rows, epoch=2)))[0] == another_epoch[3:6]


def test_local_batches_skip_the_batches_a_stopped_run_trained(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``skip`` (a resumed run's batches_done) leaves out the epoch's first batches and deals
    the rest out as the uninterrupted run did; after a change of rank count, evenly."""
    hp = AdultHParams(batch_size=2, seed=1)
    rows = _numbered_rows(14)  # 7 batches
    order = np.random.default_rng(1 * 1000 + 0).permutation(14).tolist()
    batches = [order[i : i + 2] for i in range(0, 14, 2)]
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in (0, 1):  # 2 ranks: 6 usable batches; 2 done, so 4 left, 2 each
        monkeypatch.setenv("RANK", str(rank))
        rest = _rows_of(list(train.local_batches(hp, rows, epoch=0, skip=2)))
        assert rest == [batches[2 + rank], batches[4 + rank]]
        assert _rows_of(list(train.local_batches(hp, rows, epoch=0)))[1:] == rest
    monkeypatch.setenv("WORLD_SIZE", "3")  # after 2 batches, 5 left: 1 each, 2 dropped
    per_rank = []
    for rank in range(3):
        monkeypatch.setenv("RANK", str(rank))
        per_rank.append(_rows_of(list(train.local_batches(hp, rows, epoch=0, skip=2))))
    assert per_rank == [[batches[2]], [batches[3]], [batches[4]]]
    monkeypatch.setenv("RANK", "0")  # an epoch done to its end: nothing left
    assert list(train.local_batches(hp, rows, epoch=0, skip=7)) == []
    assert list(train.local_batches(hp, rows, epoch=0, skip=9)) == []


def test_resume_position(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RANK", raising=False)
    schedule = {"seed": 0, "batch_size": 512, "world_size": 1, "streaming": False}
    same = {**schedule, "epochs_done": 2}
    assert train.resume_position(same, schedule, streaming=False) == (2, 0)
    # Stopped 6 batches into its third epoch (SIGTERM): it goes on from there.
    assert train.resume_position({**same, "batches_done": 6}, schedule, False) == (2, 6)
    assert capsys.readouterr().err == ""
    # Streamed runs (now or then): the data loaders decide, the epoch count starts over.
    assert train.resume_position(same, schedule, streaming=True) == (0, 0)
    assert train.resume_position({**same, "streaming": True}, schedule, False) == (0, 0)
    # No (or no usable) epochs_done / batches_done: another script's checkpoint.
    assert train.resume_position({}, schedule, streaming=False) == (0, 0)
    for bad in (0, -1, "2", 2.0, None, True):
        assert train.resume_position({"epochs_done": bad}, schedule, False) == (0, 0)
        assert train.resume_position({**same, "batches_done": bad}, schedule, False) == (2, 0)
    assert capsys.readouterr().err == ""
    # A different schedule still resumes, with a note naming what changed.
    changed = {**same, "seed": 3, "batch_size": 256}
    assert train.resume_position(changed, schedule, streaming=False) == (2, 0)
    assert capsys.readouterr().err == (
        "note: resuming with another seed 3 -> 0, batch_size 256 -> 512: the data order "
        "differs from an uninterrupted run's\n"
    )
    # Another seed or batch size makes the epoch's batches other ones: a stopped epoch
    # starts over (skipping 6 of the new batches would skip rows never trained on).
    assert train.resume_position({**changed, "batches_done": 6}, schedule, False) == (2, 0)
    assert capsys.readouterr().err.endswith(
        "note: the checkpoint stopped 6 batch(es) into an epoch: with another seed or batch "
        "size that epoch starts over\n"
    )
    # Another number of ranks deals the same batches out differently: it goes on.
    ranks = {**same, "world_size": 2, "batches_done": 6}
    assert train.resume_position(ranks, schedule, streaming=False) == (2, 6)
    capsys.readouterr()
    monkeypatch.setenv("RANK", "1")  # only rank 0 says so
    assert train.resume_position(changed, schedule, streaming=False) == (2, 0)
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------------------------------------
# quickstart.py helpers


class _FakeProcess:
    """What wait_for_listening asks of a Popen: poll() (None while running)."""

    def __init__(self, returncode: int | None) -> None:
        self.returncode = returncode

    def poll(self) -> int | None:
        return self.returncode


def test_wait_for_listening_reads_both_addresses_from_the_log(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    log.write_text("starting\nHTTP listening on 127.0.0.1:8000, gRPC listening on 127.0.0.2:8001\n")
    addresses = quickstart.wait_for_listening(_FakeProcess(None), log, timeout=5)
    assert addresses == ("127.0.0.1:8000", "127.0.0.2:8001")


def test_wait_for_listening_stops_when_the_server_exits_or_never_listens(
    tmp_path: Path,
) -> None:
    log = tmp_path / "serve.log"
    log.write_text("error: no checkpoint\n")
    for returncode in (1, 0, -15):  # an exit with status 0 is early too
        with pytest.raises(SystemExit, match="recserve serve exited early:\nerror: no checkpoint"):
            quickstart.wait_for_listening(_FakeProcess(returncode), log, timeout=5)
    # Still running, never listening: a deadline already past ends the wait at once.
    with pytest.raises(SystemExit, match="recserve serve did not start within 0 s"):
        quickstart.wait_for_listening(_FakeProcess(None), log, timeout=0)


def test_abort_exits_with_the_shell_status_of_the_signal() -> None:
    with pytest.raises(SystemExit) as exit_info:
        quickstart._abort(signal.SIGTERM, None)
    assert exit_info.value.code == 128 + signal.SIGTERM


def test_sample_row_is_a_valid_instance() -> None:
    """The row the quickstart sends is accepted by the serving preprocessor."""
    from examples.adult_income.preprocess import instances_to_batch

    batch = instances_to_batch([quickstart.SAMPLE_ROW])
    assert batch.batch_size == 1 and batch.label_names == ()
    assert set(quickstart.SAMPLE_ROW) == {*features.CATEGORICAL_COLUMNS, *features.NUMERIC_COLUMNS}


def test_next_steps_work_in_a_fresh_shell(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The quickstart's "Try it yourself" lines: `python -c "import tritonclient..."` failed
    (tritonclient is not installed, and the quickstart's environment is not on PATH), and
    after --exit the curl lines reached no server without saying so."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.prefix", str(tmp_path / ".venv"))
    lines = quickstart.next_steps("127.0.0.1:8000", "127.0.0.1:8001", stopped=False).splitlines()
    assert lines[1] == "Try it yourself:"
    activate = lines.index("  source .venv/bin/activate   (recserve and this environment's python)")
    assert lines[activate + 1] == "  pip install 'tritonclient[grpc]'"
    assert lines[activate + 2].startswith('  python -c "import tritonclient.grpc as g; ')
    assert "InferenceServerClient('127.0.0.1:8001')" in lines[activate + 2]
    assert not any(line.startswith("  open ") for line in lines)  # macOS only
    stopped = quickstart.next_steps("127.0.0.1:8000", "127.0.0.1:8001", stopped=True)
    assert stopped.splitlines()[1] == "Try it yourself" + quickstart.STOPPED_NOTE


# ------------------------------------------------------------------------------------------
# train.py: SIGTERM (in-process runs, 8 steps an epoch)


def _checkpoint_contents(directory: Path) -> dict[str, object]:
    """What a resume reads from a checkpoint, by file and tensor: dense weights, dense
    optimizer state, embedding ids, rows, optimizer state and LRU recency."""
    from safetensors.numpy import load_file

    contents: dict[str, object] = {
        name: (directory / name).read_bytes() for name in ("dense.pt", "opt.pt")
    }
    for path in sorted((directory / "embeddings").rglob("*.safetensors")):
        for key, array in load_file(path).items():
            contents[f"{path.relative_to(directory)}:{key}"] = array.tolist()
    return contents


def _ignore_sigterm(signum: int, frame: object) -> None:  # the SIGTERM, if main handled none
    pass


@pytest.fixture
def stoppable_runs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Set-up for several reproducible train.main runs in one process, some stopped by a
    SIGTERM: no torchrun variables, the data sets encoded once for all the runs (half of a
    run's time otherwise), SIGTERM ignored where main handles none, and torch's thread count
    (main sets 1) and the SIGTERM handler restored after. Yields the runs' common arguments."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(train.features, "read_encoded", functools.cache(features.read_encoded))
    threads = torch.get_num_threads()
    previous = signal.signal(signal.SIGTERM, _ignore_sigterm)
    try:
        yield ["--reproducible", "--epochs", "2", "--batch-size", "4096", "--device", "cpu"]
    finally:
        signal.signal(signal.SIGTERM, previous)
        torch.set_num_threads(threads)


def _sigterm_in_step_11(patch: pytest.MonkeyPatch) -> None:
    """SIGTERM raised in the 11th step (the 3rd batch of 8 in epoch 1), after its backward."""
    backward = train.TrainCtx.backward

    def signalled_backward(ctx: train.TrainCtx, loss: torch.Tensor) -> torch.Tensor:
        scaled = backward(ctx, loss)
        if ctx.step == 11:
            signal.raise_signal(signal.SIGTERM)
        return scaled

    patch.setattr(train.TrainCtx, "backward", signalled_backward)


def test_sigterm_checkpoints_after_the_step_and_a_resume_equals_the_uninterrupted_run(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    stoppable_runs: list[str],
) -> None:
    """SIGTERM in the 11th step (the 3rd batch of 8 in epoch 1): the run ends after that
    step and exits 143; with --checkpoint-on-stop its checkpoint says where it stood, and a
    resume trains the other 5 batches to the same weights, optimizer states, rows and LRU
    order as one uninterrupted run (a SIGTERM used to kill the run with no checkpoint, and a
    resume could only restart an epoch). Without the flag nothing is written: deploy/ serves
    a --checkpoint-dir as soon as it is there."""
    common = stoppable_runs
    straight, stopped, resumed, unwritten = (
        tmp_path / name for name in ("straight", "stopped", "resumed", "unwritten")
    )
    assert train.main([*common, "--checkpoint-dir", str(straight)]) == 0
    with monkeypatch.context() as patch:
        _sigterm_in_step_11(patch)
        assert train.main([*common, "--checkpoint-dir", str(unwritten)]) == 143
        assert not unwritten.exists()
        assert capsys.readouterr().err.endswith(
            "stopped by SIGTERM after 11 step(s) on rank 0 (1 epoch(s) and 3 batch(es) "
            f"done): nothing written, {unwritten} is as it was (--checkpoint-on-stop "
            "writes the checkpoint first)\n"
        )
        on_stop = [*common, "--checkpoint-dir", str(stopped), "--checkpoint-on-stop"]
        assert train.main(on_stop) == 143
    # main's handler only while it runs:
    assert signal.getsignal(signal.SIGTERM) is _ignore_sigterm
    manifest = json.loads((stopped / "manifest.json").read_text())
    err = capsys.readouterr().err
    assert err.endswith(
        "stopped by SIGTERM after 11 step(s) on rank 0 (1 epoch(s) and 3 batch(es) done): "
        f"checkpoint {stopped} (version {manifest['version']}) holds them; --resume-from "
        f"{stopped} goes on from there (with --overwrite to write the finished run to "
        f"{stopped} too)\n"
    )
    assert manifest["step"] == 11
    assert manifest["train_state"]["epochs_done"] == 1
    assert manifest["train_state"]["batches_done"] == 3
    assert (
        train.main([*common, "--resume-from", str(stopped), "--checkpoint-dir", str(resumed)]) == 0
    )
    assert json.loads((resumed / "manifest.json").read_text())["step"] == 16
    assert _checkpoint_contents(resumed) == _checkpoint_contents(straight)


def test_a_stop_checkpoint_dir_takes_the_stop_and_the_same_command_resumes_from_it(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    stoppable_runs: list[str],
) -> None:
    """--stop-checkpoint-dir (deploy/k8s/train-job.yaml): a SIGTERM's checkpoint goes there,
    never to --checkpoint-dir (which deploy/ serves once it is there); the same command run
    again resumes from it, writes --checkpoint-dir as one uninterrupted run would, and
    removes the spent stop checkpoint, so a later run starts over."""
    common = stoppable_runs
    straight, served, stop = (tmp_path / name for name in ("straight", "served", "stop"))
    assert train.main([*common, "--checkpoint-dir", str(straight)]) == 0
    job = [*common, "--checkpoint-dir", str(served), "--overwrite", "--checkpoint-on-stop"]
    job += ["--stop-checkpoint-dir", str(stop)]
    with monkeypatch.context() as patch:
        _sigterm_in_step_11(patch)
        assert train.main(job) == 143
    assert not served.exists()
    manifest = json.loads((stop / "manifest.json").read_text())
    assert (manifest["step"], manifest["train_state"]["batches_done"]) == (11, 3)
    assert capsys.readouterr().err.endswith(
        "stopped by SIGTERM after 11 step(s) on rank 0 (1 epoch(s) and 3 batch(es) done): "
        f"checkpoint {stop} (version {manifest['version']}) holds them; this command, run "
        "again, goes on from there\n"
    )
    # Run again: resumed from the stop, finished, the stop checkpoint removed.
    assert train.main(job) == 0
    assert json.loads((served / "manifest.json").read_text())["step"] == 16
    assert _checkpoint_contents(served) == _checkpoint_contents(straight)
    assert not stop.exists()
    assert capsys.readouterr().err.endswith(f"removed {stop}: the run it stopped has finished\n")


def test_a_sigterm_once_the_run_finished_is_no_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGTERM after the final checkpoint was written and the AUC printed (a pod deleted as
    the run ends), while the process winds down (TrainCtx's exit, the process group, the
    interpreter's teardown: ~0.3 s), is no stop: the rank used to die of it (the default
    handler was back), so `recserve train` said "stopped by SIGTERM" and exited 143 for a
    complete run. The handler in place before main stands in for the default one here."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(train.features, "read_encoded", functools.cache(features.read_encoded))
    shutdown = train.distributed.shutdown_distributed

    def signalled_shutdown() -> None:
        signal.raise_signal(signal.SIGTERM)
        shutdown()

    monkeypatch.setattr(train.distributed, "shutdown_distributed", signalled_shutdown)
    got: list[int] = []

    def default(signum: int, frame: object) -> None:
        got.append(signum)

    threads = torch.get_num_threads()
    previous = signal.signal(signal.SIGTERM, default)
    try:
        argv = ["--epochs", "1", "--batch-size", "4096", "--device", "cpu"]
        assert train.main([*argv, "--checkpoint-dir", str(tmp_path / "a")]) == 0
        assert got == []
        assert signal.getsignal(signal.SIGTERM) is default  # restored for an in-process caller
        # Run as the script: ignored through the interpreter's teardown too (which puts the
        # default back in place of a Python handler).
        argv += ["--checkpoint-dir", str(tmp_path / "b")]
        assert train.main(argv, keep_finished_sigterm=True) == 0
        assert got == []
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--stop-checkpoint-dir", "s"],
            "--stop-checkpoint-dir needs --checkpoint-on-stop (what writes there)",
        ),
        (
            ["--checkpoint-on-stop", "--checkpoint-dir", "c", "--stop-checkpoint-dir", "c"],
            "--stop-checkpoint-dir must differ from --checkpoint-dir",
        ),
    ],
)
def test_stop_checkpoint_dir_refusals(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], message: str
) -> None:
    argv = [str(tmp_path / a) if a in ("s", "c") else a for a in argv]
    assert _main_error(capsys, [*argv, "--device", "cpu"]) == message


def test_a_stop_checkpoint_and_resume_from_are_one_too_many(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    stop = tmp_path / "stop"
    stop.mkdir()
    (stop / "DONE").write_text("")
    argv = ["--checkpoint-on-stop", "--checkpoint-dir", str(tmp_path / "c")]
    argv += ["--stop-checkpoint-dir", str(stop), "--resume-from", str(tmp_path / "r")]
    err = _main_error(capsys, [*argv, "--device", "cpu"])
    assert err == (
        f"--resume-from {tmp_path / 'r'}: --stop-checkpoint-dir {stop} holds a stopped run's "
        "checkpoint, which this run would resume from; pass one"
    )
    # Something there that is not a checkpoint is never replaced.
    (stop / "DONE").unlink()
    (stop / "notes.txt").write_text("mine")
    err = _main_error(capsys, [*argv[:-2], "--device", "cpu"])
    assert err == (
        f"--stop-checkpoint-dir: {stop} exists and is not a recserve checkpoint (no DONE "
        "marker): refusing to replace it; choose another directory"
    )
