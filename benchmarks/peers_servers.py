"""The servers benchmarks/peers.py compares besides recserve's own: TorchServe and the
reference servers of benchmarks/ceiling_server.py, each started here and ended by PID.

TorchServe 0.12 runs from its own venv (``--ts-venv``) with benchmarks/peers_handler.py,
``--ts-workers`` workers per model and TorchServe batching (``--ts-batch-size`` /
``--ts-max-batch-delay-ms``); ``handler_bundle`` is what that handler needs from a checkpoint's
manifests. ``CeilingServer`` runs benchmarks/ceiling_server.py under uvicorn with N processes:
the no-work ceiling, or with a checkpoint the model-only server.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from load_tests.stack import stop_process

HANDLER = Path(__file__).resolve().with_name("peers_handler.py")
CEILING_CHECKPOINT_ENV = "RECSERVE_CEILING_CHECKPOINT"  # benchmarks/ceiling_server.py reads it


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def http_json(url: str, body: bytes | None = None, timeout: float = 30.0) -> Any:
    request = urllib.request.Request(
        url, data=body, headers={"Content-Type": "application/json"} if body else {}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def process_tree(pid: int) -> list[Any]:
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def handler_bundle(checkpoint: Path, model_name: str, output_transform: str) -> dict[str, Any]:
    """What peers_handler.py needs from the checkpoint's manifests."""
    from embedding_store import checkpoint_manifest, model_checkpoint

    manifest = model_checkpoint.read_manifest(checkpoint)
    signature = manifest.signature
    if signature is None:
        raise SystemExit(
            f"{checkpoint}: the model manifest has no feature signature, which the TorchServe "
            "handler needs"
        )
    config = checkpoint_manifest.read_manifest(manifest.embeddings_directory).embedding_config
    slots = []
    for feature in signature.id_features:
        slot = config.slot(feature.name)
        if not slot.embedding_summation or slot.hash_stack_config.hash_stack_rounds:
            raise SystemExit(
                f"slot {feature.name}: the TorchServe handler supports summed slots without "
                "hash stacking only"
            )
        slots.append(
            {
                "name": feature.name,
                "single_id": feature.single_id,
                "dim": slot.dim,
                "prefix": config.index_prefix(feature.name),
                "mask": config.id_mask,
                "sqrt_scaling": slot.sqrt_scaling,
            }
        )
    return {
        "model_name": model_name,
        "output_transform": output_transform,
        "embeddings_dir": str(manifest.embeddings_directory.absolute()),
        "id_slots": slots,
        "dense_inputs": [
            {"name": f.name, "sample_shape": list(f.sample_shape)}
            for f in signature.non_id_features
        ],
    }


@dataclass
class TorchServe:
    """TorchServe from its own venv, serving every model with peers_handler.py."""

    venv: Path
    root: Path
    workers: int
    batch_size: int
    max_batch_delay_ms: int
    models: dict[str, tuple[Path, dict[str, Any]]] = field(default_factory=dict)
    process: subprocess.Popen | None = None
    inference: str = ""
    management: str = ""
    pids: set[int] = field(default_factory=set)

    def archive(self) -> None:
        store = self.root / "model_store"
        store.mkdir(parents=True, exist_ok=True)
        for name, (checkpoint, bundle) in self.models.items():
            staging = self.root / "build" / name
            staging.mkdir(parents=True, exist_ok=True)
            shutil.copy(checkpoint / "jit_dense.pt", staging / "jit_dense.pt")
            (staging / "recserve_bundle.json").write_text(json.dumps(bundle, indent=2))
            command = [
                str(self.venv / "bin" / "torch-model-archiver"),
                "--model-name",
                name,
                "--version",
                "1.0",
                "--serialized-file",
                str(staging / "jit_dense.pt"),
                "--handler",
                str(HANDLER),
                "--extra-files",
                str(staging / "recserve_bundle.json"),
                "--export-path",
                str(store),
                "--archive-format",
                "no-archive",
                "--force",
            ]
            subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)

    def start(self, timeout: float = 300.0) -> TorchServe:
        self.archive()
        ports = [free_port() for _ in range(3)]
        self.inference = f"http://127.0.0.1:{ports[0]}"
        self.management = f"http://127.0.0.1:{ports[1]}"
        models = {
            name: {
                "1.0": {
                    "defaultVersion": True,
                    "marName": name,
                    "minWorkers": self.workers,
                    "maxWorkers": self.workers,
                    "batchSize": self.batch_size,
                    "maxBatchDelay": self.max_batch_delay_ms,
                    "responseTimeout": 120,
                }
            }
            for name in self.models
        }
        config = self.root / "config.properties"
        config.write_text(
            "\n".join(
                [
                    f"inference_address={self.inference}",
                    f"management_address={self.management}",
                    f"metrics_address=http://127.0.0.1:{ports[2]}",
                    f"model_store={self.root / 'model_store'}",
                    f"load_models={','.join(self.models)}",
                    f"default_workers_per_model={self.workers}",
                    "disable_token_authorization=true",
                    "install_py_dep_per_model=false",
                    "disable_system_metrics=true",
                    "job_queue_size=1000",
                    f"models={json.dumps(models)}",
                    "",
                ]
            )
        )
        temporary = self.root / "tmp"  # TorchServe keeps its PID file in TMPDIR: ours alone
        temporary.mkdir(exist_ok=True)
        env = dict(os.environ)
        env.update(
            {
                "TMPDIR": str(temporary),
                "PATH": f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
                "OMP_NUM_THREADS": "1",
                "LOG_LOCATION": str(self.root / "logs"),
                "METRICS_LOCATION": str(self.root / "logs"),
            }
        )
        env.pop("PYTHONPATH", None)
        command = [
            str(self.venv / "bin" / "torchserve"),
            "--start",
            "--foreground",
            "--ncs",
            "--ts-config",
            str(config),
            "--model-store",
            str(self.root / "model_store"),
            "--disable-token-auth",
        ]
        with open(self.root / "torchserve.log", "wb") as log:
            self.process = subprocess.Popen(
                command, cwd=self.root, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._remember_pids()
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"torchserve exited with {self.process.returncode}:\n"
                    + (self.root / "torchserve.log").read_text(errors="replace")[-3000:]
                )
            if self.ready():
                return self
            time.sleep(1.0)
        raise RuntimeError(
            f"TorchServe models not ready after {timeout:.0f} s:\n"
            + (self.root / "torchserve.log").read_text(errors="replace")[-3000:]
        )

    def ready(self) -> bool:
        try:
            for name in self.models:
                status = http_json(f"{self.management}/models/{name}", timeout=5)
                workers = status[0].get("workers", [])
                if sum(w.get("status") == "READY" for w in workers) < self.workers:
                    return False
            return True
        except (OSError, urllib.error.URLError, ValueError, KeyError, IndexError):
            return False

    def _remember_pids(self) -> None:
        if self.process is not None:
            self.pids.update(p.pid for p in process_tree(self.process.pid))

    @property
    def pid(self) -> int:
        assert self.process is not None  # started
        return self.process.pid

    def stop(self) -> None:
        """SIGTERM the Java frontend (it stops its workers), then the launcher; SIGKILL what
        is left of the processes started here, by PID."""
        import psutil

        if self.process is None:
            return
        self._remember_pids()
        for process in process_tree(self.process.pid)[1:2]:  # the Java frontend
            with contextlib.suppress(psutil.Error):
                process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            stop_process(self.process, grace=10)
        for pid in sorted(self.pids):
            try:
                process = psutil.Process(pid)
                process.wait(timeout=5)
            except psutil.TimeoutExpired:
                process.kill()
            except psutil.Error:
                continue  # already gone (or not ours to wait for): nothing left to stop


@dataclass
class CeilingServer:
    """benchmarks/ceiling_server.py under uvicorn (``workers`` processes) on a free port; with
    a ``checkpoint``, the model-only server of that checkpoint."""

    workers: int
    log_path: Path
    checkpoint: Path | None = None
    process: subprocess.Popen | None = None
    http: str = ""

    def start(self, timeout: float = 60.0) -> CeilingServer:
        port = free_port()
        command = [
            sys.executable, "-m", "uvicorn", "ceiling_server:app", "--app-dir",
            str(Path(__file__).resolve().parent), "--host", "127.0.0.1", "--port", str(port),
            "--workers", str(self.workers), "--no-access-log", "--log-level", "warning",
        ]  # fmt: skip
        env = dict(os.environ)
        if self.checkpoint is not None:
            env[CEILING_CHECKPOINT_ENV] = str(self.checkpoint)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.http = f"http://127.0.0.1:{port}"
        try:  # the caller holds no handle yet: whatever ends the wait stops the server here
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"ceiling server exited: {self.log_path.read_text()[-2000:]}"
                    )
                try:
                    http_json(f"{self.http}/v2/live", None, timeout=2.0)
                    return self
                except OSError:
                    time.sleep(0.2)
            raise RuntimeError(f"ceiling server did not answer within {timeout:g} s")
        except BaseException:  # SIGTERM (SystemExit in peers.py) and Ctrl-C too
            self.stop()
            raise

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def stop(self) -> None:
        stop_process(self.process)
