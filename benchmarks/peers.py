"""recserve against TorchServe on the same models, the same payloads and the same locust profile.

Both servers get the trained Adult model and the synthetic Criteo-like model
(load_tests/synthetic_model.py). recserve runs ``recserve serve`` (one process per model, flags
per ``--variant``); TorchServe 0.12 runs from its own venv (``--ts-venv``) with
benchmarks/peers_handler.py, ``--ts-workers`` workers per model and TorchServe batching
(``--ts-batch-size`` / ``--ts-max-batch-delay-ms``). Every measurement is a headless locust run
(load_tests/locustfile.py: ``KServeJsonUser`` against recserve's ``/v2/models/model/infer``,
``TorchServeJsonUser`` against TorchServe's ``/predictions/<model>``) with ``--users`` users,
closed loop, for ``--seconds`` seconds, one batch size at a time; both users send
byte-identical KServe v2 JSON bodies (same pool, same seed). recserve and TorchServe runs
alternate for every (model, batch size, encoding), so a noisy neighbour hits both alike.

Before a model's first cell every server gets an unrecorded run per encoding
(``--warmup-seconds``): TorchServe's JVM is much slower cold. ``--rounds N`` measures every
server of a cell N times, in order on odd rounds and reversed on even ones; the report gives
the medians and each round's ratio. SIGTERM stops every process started here.

``--mix SIZE:WEIGHT,...`` (repeatable) adds cells whose requests draw their batch size from
that mix, as load_tests/ does (``--mix 1:6,8:3,64:1`` is the load tests' default profile);
their samples/s add up each size's own req/s times that size.

``--encodings json,binary`` adds the KServe v2 binary tensor extension (default: ``json``
only): ``KServeBinaryUser`` against recserve and ``TorchServeBinaryUser`` against TorchServe
send the same binary bodies (``Inference-Header-Content-Length`` header, binary outputs asked
for), and peers_handler.py answers them in binary too. Every row of the report names its
encoding, and each ratio pairs recserve and TorchServe of the same model, batch and encoding.

    /work/venv/bin/python benchmarks/peers.py --out /tmp/peers

Reports ``peers.md`` / ``peers.csv`` / ``peers.json`` in ``--out``: req/s, samples/s, p50/p99
and the ratios recserve / TorchServe, the CPU each process group used (server, TorchServe,
locust; in cores), recserve's merged batch size and per-batch lookup/compute times from its
``/metrics``, and a prediction cross-check per encoding (the same request answered by both;
``ok`` when they agree to ``CROSS_CHECK_TOLERANCE``).

With ``--ceiling-workers N`` (default 2; 0 skips it) every cell also measures
benchmarks/ceiling_server.py: uvicorn with N processes answering the same requests with a fixed
response and no work at all, under the same locust user. Its req/s bounds what any Python
server on uvicorn can reach here, reported as a ratio to TorchServe next to recserve's. It is
measured for every encoding (it drops binary bodies as it drops JSON ones and always answers
its fixed JSON response).

With ``--model-only-workers N`` (default 0: skip it) every cell also measures the same server
paying for the model's dense model as if requests were merged into calls of 1024 rows, and for
nothing else (``model-only``, see benchmarks/ceiling_server.py): at most what a Python server
on uvicorn that runs this model can reach here. Its latencies mean nothing.

The load generator shares the machine with the servers; its own CPU use is in the report.
Every process is started here and ended by PID; every run is bounded by ``--seconds``.

This script holds the command line and the run's order; the rest is in benchmarks/:
peers_servers.py (TorchServe, its handler bundle and the reference servers), peers_measure.py
(one locust run against one server), peers_crosscheck.py (the prediction cross-check) and
peers_report.py (``peers.md`` / ``peers.csv`` / ``peers.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from machine_info import describe_machine
from peers_crosscheck import cross_check
from peers_measure import Measurement, measure, round_order
from peers_report import report
from peers_servers import CeilingServer, TorchServe, handler_bundle

from load_tests import traffic
from load_tests.stack import ServeProcess, subprocess_env, workers_of

TS_VERSION = "import ts; print(ts.__version__)"
ADULT_TRAIN = REPO_ROOT / "examples" / "adult_income" / "train.py"
#: Wire encodings (``--encodings``) -> locust user class against recserve / TorchServe.
RECSERVE_USERS = {"json": "KServeJsonUser", "binary": "KServeBinaryUser"}
TORCHSERVE_USERS = {"json": "TorchServeJsonUser", "binary": "TorchServeBinaryUser"}
ENCODINGS = tuple(RECSERVE_USERS)
#: The models ``--models`` may name.
MODELS = ("adult", "synthetic")


# --------------------------------------------------------------------------- helpers
def machine_description() -> dict:
    """The machine and this venv's packages. TorchServe runs from its own venv
    (``--ts-venv``): its version is the report's ``torchserve.version``, not listed here,
    where it would read "not installed"."""
    return describe_machine("torch", "numpy", "locust")


# --------------------------------------------------------------------------- checkpoints
def adult_checkpoint(out: Path, given: Path | None) -> Path:
    if given is not None:
        return given.absolute()
    target = out / "checkpoints" / "adult"
    if not (target / "DONE").exists():
        subprocess.run(
            [sys.executable, str(ADULT_TRAIN), "--checkpoint-dir", str(target), "--overwrite"],
            cwd=REPO_ROOT,
            env=subprocess_env(),
            check=True,
            timeout=600,
        )
    return target


def synthetic_checkpoint(out: Path, given: Path | None) -> Path:
    if given is not None:
        return given.absolute()
    from load_tests.synthetic_model import build_synthetic_checkpoint

    target = out / "checkpoints" / "synthetic"
    if not (target / "DONE").exists():
        build_synthetic_checkpoint(target, overwrite=True)
    return target


def multi_process(flags: str) -> bool:
    """Whether ``recserve serve`` flags run more than one serving process (``--workers N``
    or ``--workers=N``, the last one given, as the server reads them)."""
    return workers_of(shlex.split(flags)) > 1


# --------------------------------------------------------------------------- main
def batches_argument(text: str) -> list[int]:
    """``--batches``: a comma list of batch sizes >= 1, in order, without repeats."""
    try:
        sizes = list(dict.fromkeys(int(part) for part in text.split(",") if part.strip()))
    except ValueError:
        sizes = [0]
    if any(size < 1 for size in sizes):
        raise argparse.ArgumentTypeError(
            f"bad batch sizes {text!r}: use a comma list of integers >= 1"
        )
    return sizes


def mix_argument(text: str) -> str:
    """``--mix``: a batch mix SIZE:WEIGHT,... as load_tests/ reads it, normalized."""
    try:
        sizes, weights = traffic.parse_batch_mix(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"bad batch mix {text!r}: use SIZE:WEIGHT,... with sizes >= 1 and weights > 0"
        ) from None
    return ",".join(f"{size}:{weight:g}" for size, weight in zip(sizes, weights))


def encodings_argument(text: str) -> list[str]:
    """``--encodings``: a comma list of ENCODINGS, in order, without repeats."""
    names = list(dict.fromkeys(e.strip() for e in text.split(",") if e.strip()))
    unknown = [e for e in names if e not in ENCODINGS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown encoding(s) {', '.join(unknown) or repr(text)}: use a comma list of "
            f"{', '.join(ENCODINGS)}"
        )
    return names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("peers-out"),
        help="folder for peers.md/.csv/.json, logs and the checkpoints built here "
        "(default peers-out)",
    )
    parser.add_argument(
        "--models", default="adult,synthetic", help=f"a comma list of {', '.join(MODELS)}"
    )
    parser.add_argument(
        "--adult-checkpoint",
        type=Path,
        default=None,
        help="the Adult checkpoint to serve (default: train one into OUT/checkpoints/adult "
        "unless it is there)",
    )
    parser.add_argument(
        "--synthetic-checkpoint",
        type=Path,
        default=None,
        help="the synthetic checkpoint to serve (default: build one into "
        "OUT/checkpoints/synthetic unless it is there)",
    )
    parser.add_argument(
        "--batches",
        type=batches_argument,
        default="1,64",
        help="batch sizes, one cell each: a comma list of sizes (may be empty with --mix); "
        "default: 1,64",
    )
    parser.add_argument(
        "--mix",
        action="append",
        type=mix_argument,
        default=[],
        help="a cell whose requests draw their batch size from SIZE:WEIGHT,... (repeatable); "
        "1:6,8:3,64:1 is the load tests' default profile",
    )
    parser.add_argument(
        "--users", type=int, default=32, help="concurrent locust users, 1..512 (default 32)"
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=25.0,
        help="length of each measured run, at most 600 (default 25)",
    )
    parser.add_argument(
        "--warmup-seconds",
        type=float,
        default=10.0,
        help="an unrecorded locust run per server and encoding before a model's first cell "
        "(0: none; default 10)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every server of every cell this many times, alternating their order; "
        "the tables give medians and each round's ratio (default 1)",
    )
    parser.add_argument(
        "--encodings",
        type=encodings_argument,
        default="json",
        help="wire encodings to measure, a comma list of json (KServe v2 JSON) and binary "
        "(KServe v2 binary tensor extension); default: json",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=None,
        help='recserve flag set NAME="FLAGS" (repeatable); default: default=""',
    )
    parser.add_argument(
        "--ts-venv",
        type=Path,
        default=Path("/work/ts-venv"),
        help="virtual environment with TorchServe 0.12 (bin/torchserve; default /work/ts-venv)",
    )
    parser.add_argument(
        "--ts-workers", type=int, default=2, help="TorchServe workers per model (default 2)"
    )
    parser.add_argument(
        "--ts-batch-size", type=int, default=16, help="TorchServe's batch size (default 16)"
    )
    parser.add_argument(
        "--ts-max-batch-delay-ms",
        type=int,
        default=5,
        help="TorchServe's max batch delay in ms (default 5)",
    )
    parser.add_argument(
        "--skip-torchserve",
        action="store_true",
        help="measure recserve (and the reference servers) only",
    )
    parser.add_argument(
        "--ceiling-workers",
        type=int,
        default=2,
        help="uvicorn processes of the no-work ceiling server (0: skip it)",
    )
    parser.add_argument(
        "--model-only-workers",
        type=int,
        default=0,
        help="uvicorn processes of the model-only server, which pays for the dense model on "
        "merged batches and for nothing else (0, the default: skip it)",
    )
    args = parser.parse_args(argv)
    if not 1 <= args.users <= 512 or not 0 < args.seconds <= 600 or not 1 <= args.rounds <= 10:
        parser.error("bounded runs only: 1..512 users, at most 600 s per run, 1..10 rounds")
    for flag, workers in (("--ceiling-workers", args.ceiling_workers),
                          ("--model-only-workers", args.model_only_workers)):  # fmt: skip
        if not 0 <= workers <= 8:
            parser.error(f"{flag} must be within 0..8, got {workers}")
    if not 0 <= args.warmup_seconds <= 120:
        parser.error(f"--warmup-seconds must be within 0..120, got {args.warmup_seconds:g}")
    if not args.batches and not args.mix:
        parser.error("nothing to measure: give --batches or --mix")
    # Checked here, not when its turn comes: the models before it were trained by then.
    args.models = list(dict.fromkeys(m.strip() for m in args.models.split(",") if m.strip()))
    unknown = [m for m in args.models if m not in MODELS]
    if unknown or not args.models:
        parser.error(
            f"--models: unknown model(s) {', '.join(unknown) or '(none given)'}: use a comma "
            f"list of {', '.join(MODELS)}"
        )
    for flag, value, low, high in (
        ("--ts-workers", args.ts_workers, 1, 64),
        ("--ts-batch-size", args.ts_batch_size, 1, 4096),
        ("--ts-max-batch-delay-ms", args.ts_max_batch_delay_ms, 0, 10_000),
    ):
        if not low <= value <= high:  # TorchServe would refuse the model after its start-up
            parser.error(f"{flag} must be within {low}..{high}, got {value}")
    return args


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(f"stopped by signal {signum}")  # unwinds: every server started is stopped


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.skip_torchserve and not (args.ts_venv / "bin" / "torchserve").exists():
        # A comparison without its peer would only print nan ratios.
        print(
            f"peers.py: error: --ts-venv {args.ts_venv} has no bin/torchserve: make that venv "
            "(docs/BENCHMARKS.md, 'TorchServe') or give --skip-torchserve",
            file=sys.stderr,
        )
        return 2
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    out = args.out.absolute()
    (out / "locust").mkdir(parents=True, exist_ok=True)
    variants = dict(v.partition("=")[::2] for v in (args.variant or ["default="]))
    batches = [str(size) for size in args.batches] + args.mix
    checkpoints = {}
    for name in args.models:  # parse_args refused any other name
        if name == "adult":
            checkpoints[name] = adult_checkpoint(out, args.adult_checkpoint)
        else:
            checkpoints[name] = synthetic_checkpoint(out, args.synthetic_checkpoint)
    info: dict[str, Any] = {
        "machine": machine_description(),
        "users": args.users,
        "seconds_per_run": args.seconds,
        "rounds": args.rounds,
        "warmup_seconds_per_server_and_encoding": args.warmup_seconds,
        "batches": batches,
        "encodings": args.encodings,
        "variants": variants,
        "torchserve": {
            "venv": str(args.ts_venv),
            "workers": args.ts_workers,
            "batch_size": args.ts_batch_size,
            "max_batch_delay_ms": args.ts_max_batch_delay_ms,
        },
        "ceiling_workers": args.ceiling_workers,
        "model_only_workers": args.model_only_workers,
        "checkpoints": {k: str(v) for k, v in checkpoints.items()},
    }
    torchserve: TorchServe | None = None
    measurements: list[Measurement] = []
    try:
        if not args.skip_torchserve:
            torchserve = TorchServe(
                args.ts_venv,
                out / "torchserve",
                args.ts_workers,
                args.ts_batch_size,
                args.ts_max_batch_delay_ms,
                {
                    name: (path, handler_bundle(path, name, "sigmoid"))
                    for name, path in checkpoints.items()
                },
            )
            (out / "torchserve").mkdir(parents=True, exist_ok=True)
            try:
                version = subprocess.run(
                    [str(args.ts_venv / "bin" / "python"), "-c", TS_VERSION],
                    capture_output=True,
                    text=True,
                    timeout=60,
                ).stdout.strip()
                info["torchserve"]["version"] = version
                started = time.monotonic()
                torchserve.start()
                info["torchserve"]["startup_s"] = round(time.monotonic() - started, 1)
            except Exception as error:
                info["torchserve"]["error"] = f"{type(error).__name__}: {error}"
                print(f"TorchServe could not start: {error}", file=sys.stderr)
                torchserve.stop()
                torchserve = None
        for name, checkpoint in checkpoints.items():
            servers: dict[str, ServeProcess] = {}
            ceilings: dict[str, CeilingServer] = {}
            try:
                if args.ceiling_workers > 0:
                    ceilings["ceiling"] = CeilingServer(
                        args.ceiling_workers, out / f"ceiling-{name}.log"
                    ).start()
                if args.model_only_workers > 0:
                    ceilings["model-only"] = CeilingServer(
                        args.model_only_workers, out / f"model-only-{name}.log", checkpoint
                    ).start()
                for variant, flags in variants.items():
                    servers[variant] = ServeProcess(
                        checkpoint,
                        out / f"serve-{name}-{variant}.log",
                        extra_args=["--output-transform", "sigmoid", *shlex.split(flags)],
                    ).start()
                first = next(iter(servers.values()))
                metadata = traffic.fetch_metadata(first.http, "model")
                metadata_file = out / f"{name}-metadata.json"
                metadata_file.write_text(json.dumps(metadata))
                vocab = out / f"{name}-vocab.npz"
                traffic.save_vocab(traffic.vocab_from_checkpoint(checkpoint), vocab)
                env = {
                    "RECSERVE_LT_MODEL": "model",
                    "RECSERVE_LT_TS_MODEL": name,
                    "RECSERVE_LT_METADATA_FILE": str(metadata_file),
                    "RECSERVE_LT_VOCAB": str(vocab),
                    "RECSERVE_LT_SEED": "7",
                }
                if torchserve is not None:
                    inputs = traffic.ModelInputs.from_metadata(metadata)
                    generator = traffic.TrafficGenerator(
                        inputs, traffic.TrafficProfile(seed=3), traffic.load_vocab(vocab)
                    )
                    arrays = generator.arrays(64)
                    for encoding in args.encodings:
                        check = cross_check(
                            first.http, torchserve.inference, name, arrays, encoding
                        )
                        info.setdefault("cross_check", {}).setdefault(name, {})[encoding] = check
                        print(f"{name}: cross-check {encoding} {check}", flush=True)

                def server_runs(encoding: str) -> list[dict[str, Any]]:
                    """measure() arguments of every server of a cell in ``encoding``."""
                    runs = [
                        dict(
                            label=f"recserve:{variant}",
                            host=server.http,
                            user_class=RECSERVE_USERS[encoding],
                            server_pid=server.pid,
                            # /metrics of one process only: skip with --workers > 1
                            metrics_url=(None if multi_process(variants[variant]) else server.http),
                        )
                        for variant, server in servers.items()
                    ]
                    runs += [
                        dict(
                            label=label,
                            host=ceiling.http,
                            user_class=RECSERVE_USERS[encoding],
                            server_pid=ceiling.pid,
                            # one fixed prediction to every request, by design
                            check_answers=False,
                        )
                        for label, ceiling in ceilings.items()
                    ]
                    if torchserve is not None:
                        runs.append(
                            dict(
                                label="torchserve",
                                host=torchserve.inference,
                                user_class=TORCHSERVE_USERS[encoding],
                                server_pid=torchserve.pid,
                            )
                        )
                    return runs

                common = dict(model=name, env=env, args=args, out=out)
                if args.warmup_seconds > 0:
                    # TorchServe's JVM and every server's first code paths warm up under load:
                    # measured cold, TorchServe's first cell ran at ~55% of its later speed.
                    for encoding in args.encodings:
                        for run in server_runs(encoding):
                            measure(
                                **run,
                                **common,
                                batch=batches[0],
                                encoding=encoding,
                                round_number=0,
                                seconds=args.warmup_seconds,
                            )
                for batch in batches:
                    for encoding in args.encodings:
                        # Every server of this cell: the same model, batch size, encoding, load
                        # and output.
                        runs = server_runs(encoding)
                        for round_number in range(1, args.rounds + 1):
                            for run in round_order(runs, round_number):
                                measurements.append(
                                    measure(
                                        **run,
                                        **common,
                                        batch=batch,
                                        encoding=encoding,
                                        round_number=round_number,
                                    )
                                )
            finally:
                for server in servers.values():
                    server.stop()
                for ceiling in ceilings.values():
                    ceiling.stop()
    finally:
        if torchserve is not None:
            torchserve.stop()
    info["loadavg_at_end"] = " ".join(f"{v:.2f}" for v in os.getloadavg())
    summary = report(out, measurements, variants, info)
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
