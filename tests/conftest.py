"""Fixtures shared by tests/e2e and tests/integration: the trained Adult checkpoints.

Training one takes seconds of CPU, so each is trained once per session (both concurrently,
each on one thread) and only read by the tests: copy one (``shutil.copytree``) before
changing anything in it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
TRAIN_SCRIPT = REPO_ROOT / "examples" / "adult_income" / "train.py"


def _subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


class _Training:
    """``examples/adult_income/train.py`` in a subprocess (embedded tier); ``result()`` waits
    for the checkpoint, ``metrics()`` reads what the run reported (``--metrics-out``)."""

    def __init__(self, directory: Path, *, seed: int, epochs: int = 1) -> None:
        self.directory = directory
        self.log = directory.with_name(directory.name + ".log")
        self.metrics_path = directory.with_name(directory.name + ".metrics.json")
        env = _subprocess_env()
        env.pop("RECSERVE_EMBEDDING_WORKERS", None)  # the embedded tier, whatever the caller's
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    str(TRAIN_SCRIPT),
                    "--checkpoint-dir",
                    str(directory),
                    "--epochs",
                    str(epochs),
                    "--seed",
                    str(seed),
                    "--metrics-out",
                    str(self.metrics_path),
                ],
                cwd=REPO_ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def result(self, timeout: float = 180.0) -> Path:
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        if code != 0 or not (self.directory / "DONE").exists():
            raise RuntimeError(
                f"training {self.directory} failed (exit {code}):\n{self.log.read_text()[-3000:]}"
            )
        return self.directory

    def metrics(self) -> dict[str, Any]:
        """The run's ``--metrics-out`` document (test_auc, checkpoint_version, ...)."""
        self.result()
        return json.loads(self.metrics_path.read_text())

    def kill(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()


@pytest.fixture(scope="session")
def _adult_trainings(tmp_path_factory) -> Iterator[dict[str, _Training]]:
    """Both checkpoints train concurrently (seed 0 and seed 1, one epoch each)."""
    root = tmp_path_factory.mktemp("adult-checkpoints")
    jobs = {
        "a": _Training(root / "seed0", seed=0),
        "b": _Training(root / "seed1", seed=1),
    }
    yield jobs
    for job in jobs.values():
        job.kill()


@pytest.fixture(scope="session")
def adult_checkpoint(_adult_trainings) -> Path:
    """A small Adult checkpoint (1 epoch, seed 0). Treat it as read-only."""
    return _adult_trainings["a"].result()


@pytest.fixture(scope="session")
def adult_checkpoint_metrics(_adult_trainings) -> dict[str, Any]:
    """What the training of ``adult_checkpoint`` reported: ``test_auc`` (float),
    ``checkpoint_version`` (str), ``steps`` (int), ... (train.py's ``--metrics-out``)."""
    return _adult_trainings["a"].metrics()


@pytest.fixture(scope="session")
def adult_checkpoint_b(_adult_trainings) -> Path:
    """A second Adult checkpoint (1 epoch, seed 1): same signature, another version."""
    return _adult_trainings["b"].result()
