"""The quickstart: train the Adult example (embedded), serve it, answer predictions.

    python -m examples.adult_income.quickstart [--workdir runs/quickstart] [--exit]

Steps: train briefly in-process and dump a checkpoint; start ``recserve serve`` on loopback;
send one prediction over HTTP (friendly JSON and KServe v2) and one over gRPC (KServe v2);
print the commands a user can run next. The server keeps running until Ctrl-C (or stops at
once with ``--exit``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from clients import RecserveClient
from examples.adult_income import features

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SAMPLE_ROW = {
    "age": 52,
    "workclass": "Self-emp-inc",
    "fnlwgt": 287927,
    "education": "HS-grad",
    "educational-num": 9,
    "marital-status": "Married-civ-spouse",
    "occupation": "Exec-managerial",
    "relationship": "Wife",
    "race": "White",
    "gender": "Female",
    "capital-gain": 15024,
    "capital-loss": 0,
    "hours-per-week": 40,
    "native-country": "United-States",
}


def post_json(url: str, payload: dict) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def wait_for_listening(process: subprocess.Popen, log_path: Path, timeout: float) -> tuple:
    deadline = time.monotonic() + timeout
    pattern = re.compile(r"HTTP listening on (\S+):(\d+), gRPC listening on (\S+):(\d+)")
    while time.monotonic() < deadline:
        match = pattern.search(log_path.read_text(errors="replace"))
        if match:
            return f"{match.group(1)}:{match.group(2)}", f"{match.group(3)}:{match.group(4)}"
        if process.poll() is not None:
            raise SystemExit(f"recserve serve exited early:\n{log_path.read_text()}")
        time.sleep(0.1)
    raise SystemExit(f"recserve serve did not start within {timeout:.0f} s")


#: After --exit the lines below reach no server.
STOPPED_NOTE = " (the server is stopped: run the quickstart without --exit to keep it up):"


def next_steps(http_address: str, grpc_address: str, *, stopped: bool) -> str:
    """The commands printed for the user to try next (``stopped``: after ``--exit``)."""
    row = json.dumps({"instances": [SAMPLE_ROW]})
    environment = Path(sys.prefix)
    with contextlib.suppress(ValueError):  # as typed from the repository root: .venv
        environment = environment.relative_to(Path.cwd())
    lines = [
        "",
        "Try it yourself" + (STOPPED_NOTE if stopped else ":"),
        f"  curl -s http://{http_address}/v2/health/ready",
        f"  curl -s http://{http_address}/v2/models/adult",
        f"  curl -s -X POST http://{http_address}/v1/models/adult:predict -d '{row}'",
        f"  curl -s http://{http_address}/metrics | grep recserve_requests",
        f"  http://{http_address}/docs in a browser: the OpenAPI page",
        # `recserve` and the clients are in the environment the quickstart made, not on PATH;
        # tritonclient (KServe v2 interop) is not installed by the quickstart.
        f"  source {environment}/bin/activate   (recserve and this environment's python)",
        "  pip install 'tritonclient[grpc]'",
        '  python -c "import tritonclient.grpc as g; '
        f"print(g.InferenceServerClient('{grpc_address}').get_model_metadata('adult'))\"",
    ]
    return "\n".join(lines)


def _abort(signum: int, _frame: object) -> None:
    """SIGTERM/SIGHUP (a closed terminal) before serving: unwind, so that the training run or
    the starting server is ended with this script, never left behind."""
    raise SystemExit(128 + signum)


def main() -> int:
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _abort)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workdir",
        type=Path,
        default=ROOT / "runs" / "quickstart",
        help="where the checkpoint and the server's log go (default runs/quickstart)",
    )
    parser.add_argument(
        "--epochs", type=int, default=2, help="training epochs (default %(default)s)"
    )
    parser.add_argument(
        "--http-port", type=int, default=8000, help="the server's HTTP port (default %(default)s)"
    )
    parser.add_argument(
        "--grpc-port", type=int, default=8001, help="the server's gRPC port (default %(default)s)"
    )
    parser.add_argument("--exit", action="store_true", help="stop the server after the demo")
    args = parser.parse_args()
    checkpoint = args.workdir / "checkpoint"

    print(f"== 1/3 training the Adult example (embedded, {args.epochs} epochs)", flush=True)
    subprocess.run(
        [
            sys.executable,
            str(HERE / "train.py"),
            "--epochs",
            str(args.epochs),
            "--checkpoint-dir",
            str(checkpoint),
            "--overwrite",
        ],
        check=True,
    )

    print("== 2/3 starting recserve serve", flush=True)
    args.workdir.mkdir(parents=True, exist_ok=True)
    log_path = args.workdir / "serve.log"
    serve_command = [
        "recserve",
        "serve",
        "--checkpoint",
        str(checkpoint),
        "--model-name",
        "adult",
        "--http-port",
        str(args.http_port),
        "--grpc-port",
        str(args.grpc_port),
        "--output-transform",
        "sigmoid",
        "--preprocessor",
        "examples.adult_income.preprocess:instances_to_batch",
    ]
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "embedding_store.cli", *serve_command[1:]],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
    try:
        http_address, grpc_address = wait_for_listening(server, log_path, timeout=120)
        print(f"   {' '.join(serve_command)}")
        print(f"   HTTP on {http_address}, gRPC on {grpc_address} (log: {log_path})")

        print("== 3/3 predictions for one person (probability of income > 50K)", flush=True)
        friendly = post_json(
            f"http://{http_address}/v1/models/adult:predict", {"instances": [SAMPLE_ROW]}
        )
        print(
            f"   HTTP friendly JSON: {friendly['predictions'][0][0]:.4f} "
            f"(version {friendly['model_version']})"
        )
        batch = features.rows_to_batch([SAMPLE_ROW], with_labels=False)
        with RecserveClient(f"http://{http_address}", model_name="adult") as client:
            v2 = client.predict(batch)  # KServe v2 with binary tensors
        print(f"   HTTP KServe v2:     {v2.predictions[0, 0]:.4f}")
        with RecserveClient(f"grpc://{grpc_address}", model_name="adult") as client:
            answer = client.predict(batch)
        print(
            f"   gRPC KServe v2:     {answer.predictions[0, 0]:.4f} "
            f"(version {answer.model_version})"
        )

        print(next_steps(http_address, grpc_address, stopped=args.exit))
        if args.exit:
            return 0
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, lambda *_: server.terminate())  # it drains, then we exit
        print("\nServing until Ctrl-C.", flush=True)
        # Poll rather than block in waitpid: the kernel may hand the signal to another thread
        # (the gRPC client's), and a main thread blocked in waitpid would never run the
        # handler that stops the server.
        while server.poll() is None:
            time.sleep(0.2)
        return 0
    finally:
        if server.poll() is None:
            server.terminate()
            try:
                server.wait(timeout=15)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


if __name__ == "__main__":
    sys.exit(main())
