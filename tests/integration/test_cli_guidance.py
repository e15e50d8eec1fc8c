"""The ``recserve`` CLI when a user gets something wrong: each mistake ends quickly, with one
line that names it and says what to do, and never with a traceback."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from embedding_store import checkpoint_manifest
from embedding_store.errors import CheckpointError
from tests.integration.conftest import REPO_ROOT, TRAIN_SCRIPT, _subprocess_env


def recserve(*args: object, timeout: float = 60) -> subprocess.CompletedProcess:
    env = _subprocess_env()
    env.pop("RECSERVE_EMBEDDING_WORKERS", None)
    return subprocess.run(
        [sys.executable, "-m", "embedding_store.cli", *map(str, args)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def recserve_all(*commands: tuple[object, ...]) -> list[subprocess.CompletedProcess]:
    """``recserve(*command)`` for each command, two at a time (each process spends its ~1.5 s
    mostly importing torch, on one core); results in the order given."""
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda command: recserve(*command), commands))


def start_training(entry: Path, *, stderr: int) -> subprocess.Popen:
    """`recserve train --entry ENTRY` in the background, its stdout piped (text)."""
    env = _subprocess_env()
    env.pop("RECSERVE_EMBEDDING_WORKERS", None)
    return subprocess.Popen(
        [sys.executable, "-m", "embedding_store.cli", "train", "--entry", str(entry)],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True,
    )  # fmt: skip


def assert_refused(result: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    assert result.returncode == code, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr


def _sigterm_once_the_rank_started(entry: Path) -> tuple[int, str]:
    """``recserve train`` of ``entry`` (which prints "rank started"), sent SIGTERM once its
    rank has started: the launcher's exit code and stderr."""
    import signal

    launcher = start_training(entry, stderr=subprocess.PIPE)
    try:
        assert launcher.stdout.readline().strip() == "rank started"
        launcher.send_signal(signal.SIGTERM)
        _out, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    return launcher.returncode, err


def test_a_rank_that_fails_is_one_line_not_a_torchrun_traceback():
    # The script's own error, then one line naming the rank (torchrun's ChildFailedError
    # traceback about its internals used to follow), and the rank's exit status.
    result = recserve("train", "--entry", TRAIN_SCRIPT, "--", "--eval-only")
    assert_refused(
        result,
        2,
        "--eval-only needs --resume-from",
        "recserve train: rank 0 exited with code 2 (its own error is above)",
    )


def test_a_stopped_training_run_is_one_line_not_a_torchrun_traceback(tmp_path):
    """SIGTERM to `recserve train` (Ctrl-C, a pod deleted): torchrun ends the rank; the
    launcher says so in one line and exits 128 + 15, with no SignalException traceback."""
    import signal

    entry = tmp_path / "sleeper.py"
    entry.write_text("import time\nprint('rank started', flush=True)\ntime.sleep(120)\n")
    returncode, err = _sigterm_once_the_rank_started(entry)
    assert returncode == 128 + signal.SIGTERM, err
    assert "recserve train: stopped by SIGTERM" in err
    assert "Traceback" not in err, err


def test_a_sigterm_after_the_run_finished_is_not_a_stop(tmp_path):
    """A SIGTERM that reaches the launcher once the ranks are done (a run that completed and
    published its final checkpoint, e.g. a pod deleted as it ended) is no stop: the launcher
    used to say "stopped by SIGTERM" and exit 143 anyway."""

    entry = tmp_path / "finishing.py"
    entry.write_text(
        "import signal, time\n"
        "got = []\n"
        "signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))\n"
        "print('rank started', flush=True)\n"
        "deadline = time.monotonic() + 30\n"
        "while not got and time.monotonic() < deadline:\n"
        "    time.sleep(0.02)\n"
        "# past its last step: it finishes (exit 0) instead of stopping\n"
    )
    returncode, err = _sigterm_once_the_rank_started(entry)
    assert returncode == 0, err
    assert (
        "recserve train: SIGTERM arrived after every rank had finished (exit 0): the run completed"
    ) in err
    assert "stopped by" not in err and "Traceback" not in err, err


def test_ranks_end_when_their_launcher_is_killed(tmp_path):
    """torchrun starts ranks in sessions of their own: a launcher killed outright (kill -9,
    the OOM killer) used to leave them training on, reparented, up to writing a checkpoint."""
    import os
    import signal

    entry = tmp_path / "rank.py"
    entry.write_text(
        "import os, time\n"
        "from training.distributed import exit_with_launcher\n"
        "exit_with_launcher()  # what TrainCtx does as it starts\n"
        "print(os.getpid(), flush=True)\n"
        "time.sleep(120)\n"
    )
    launcher = start_training(entry, stderr=subprocess.DEVNULL)
    rank_pid = None
    try:
        rank_pid = int(launcher.stdout.readline())
        launcher.kill()
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 15
        while Path(f"/proc/{rank_pid}").exists() and time.monotonic() < deadline:
            if Path(f"/proc/{rank_pid}/stat").read_text().split()[2] == "Z":
                break  # ended; its new parent has not reaped it yet
            time.sleep(0.1)
        stat = Path(f"/proc/{rank_pid}/stat")
        assert not stat.exists() or stat.read_text().split()[2] == "Z", "the rank runs on"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        if rank_pid is not None and Path(f"/proc/{rank_pid}").exists():
            os.kill(rank_pid, signal.SIGKILL)  # the rank this test's launcher started


def test_script_arguments_before_the_separator_are_pointed_out():
    result = recserve("train", "--entry", TRAIN_SCRIPT, "--epochs", "1")
    assert_refused(
        result,
        2,
        "unrecognized arguments: --epochs",
        "arguments for the --entry script go after --",
        "-- --epochs 1",
    )


def test_several_nn_workers_without_a_shared_tier_are_refused_before_torchrun():
    started = time.monotonic()
    result = recserve("train", "--entry", TRAIN_SCRIPT, "--nproc-per-node", "2", "--", "-h")
    assert_refused(result, 1, "needs one shared embedding tier", "--embedding-workers")
    assert "torch.distributed" not in result.stderr  # no rank was started
    assert time.monotonic() - started < 30


def test_the_example_refuses_what_would_waste_a_training_run(tmp_path):
    existing = tmp_path / "ckpt"
    existing.mkdir()
    (existing / "notes.txt").write_text("not a checkpoint")  # an empty directory is fine
    # `--eval-only` without `--resume-from` is refused the same way (exit 2, the one line, no
    # traceback): test_a_rank_that_fails_is_one_line_not_a_torchrun_traceback runs exactly
    # that through `recserve train`, so it is not run again here (a torch import, ~2 s).
    cases = [
        (
            ["--checkpoint-dir", existing],
            f"--checkpoint-dir: checkpoint directory {existing} already exists",
        ),
        (
            ["--checkpoint-dir", existing, "--overwrite"],
            f"--checkpoint-dir: {existing} exists and is not a recserve checkpoint",
        ),
        (["--checkpoint-dir", "/proc/ckpt"], "--checkpoint-dir /proc/ckpt: cannot write in"),
    ]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "--device cuda: CUDA is not available"))

    def run(args: list) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, TRAIN_SCRIPT, *map(str, args)],
            cwd=REPO_ROOT,
            env=_subprocess_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )

    # Two at a time: each process spends its ~2 s importing torch.
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run, [args for args, _ in cases]))
    for result, (_, needle) in zip(results, cases):
        assert_refused(result, 2, needle)


def test_a_reader_that_leaves_early_is_not_an_error(adult_checkpoint):
    # `recserve checkpoint inspect DIR | head -1`: the pipe closes before the output ends.
    process = subprocess.Popen(
        [sys.executable, "-m", "embedding_store.cli", "checkpoint", "inspect", adult_checkpoint],
        cwd=REPO_ROOT,
        env=_subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    process.stdout.close()  # every write now fails with EPIPE
    errors = process.stderr.read().decode()
    assert process.wait(timeout=60) == 0, errors
    assert "Traceback" not in errors and "BrokenPipeError" not in errors


def test_one_kind_of_checkpoint_given_for_the_other_is_named(adult_checkpoint, tmp_path):
    embeddings = adult_checkpoint / "embeddings"
    # Parts written by several shards' --dump-on-exit: no manifest, never loadable.
    parts = tmp_path / "parts"
    shutil.copytree(embeddings / "shard_00000", parts / "shard_00000")
    exported, verified = recserve_all(
        ("checkpoint", "export-dense", "--out", tmp_path / "d.pt", embeddings),
        ("checkpoint", "verify", parts),
    )
    assert_refused(
        exported,
        1,
        f"{embeddings} is an embedding checkpoint, part of the model checkpoint {adult_checkpoint}",
    )
    with pytest.raises(CheckpointError, match=f"its embeddings are in {embeddings}"):
        checkpoint_manifest.read_manifest(adult_checkpoint)
    assert_refused(verified, 1, "holds shard parts but no", "recserve embedding-tier dump")


def test_serving_from_an_unreachable_worker_says_it_waits_and_gives_up_in_time(
    adult_checkpoint,
):
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    result = recserve(
        "serve", "--checkpoint", adult_checkpoint, "--http-port", "0", "--grpc-port", "0",
        "--embedding-workers", f"127.0.0.1:{port}", "--startup-timeout", "1",
    )  # fmt: skip
    assert_refused(result, 1, f"waiting up to 1 s for embedding worker 127.0.0.1:{port}")
    assert f"127.0.0.1:{port} is not serving after 1 s" in result.stderr
    assert time.monotonic() - started < 40


def test_a_checkpoint_whose_parts_do_not_fit_is_refused_in_one_line(adult_checkpoint, tmp_path):
    # The manifest's signature loses two ID features: the dense model then gets narrower
    # inputs than it was trained on. `serve` used to die with a TorchScript traceback.
    broken = Path(shutil.copytree(adult_checkpoint, tmp_path / "broken"))
    manifest = json.loads((broken / "manifest.json").read_text())
    del manifest["signature"]["id_features"][:2]
    (broken / "manifest.json").write_text(json.dumps(manifest))
    result = recserve("serve", "--checkpoint", broken, "--http-port", "0", "--grpc-port", "0")
    assert_refused(
        result,
        1,
        f"checkpoint {broken} cannot be served: RuntimeError: ",
        "its dense model fails on a batch of the inputs its signature and embedding dims",
    )


def test_paths_that_cannot_be_written_are_one_line_errors(adult_checkpoint):
    cases = (
        (("checkpoint", "export-dense", "--out", "/proc/x.pt", adult_checkpoint), "/proc/.x.pt"),
        (
            (
                "checkpoint",
                "reshard",
                adult_checkpoint / "embeddings",
                "--out",
                "/proc/x",
                "--shards",
                "1",
            ),
            "cannot write a checkpoint to /proc/x",
        ),
    )
    results = recserve_all(*(args for args, _ in cases))
    for result, (_, needle) in zip(results, cases, strict=True):
        assert_refused(result, 1, needle)
