"""Start a recserve serving stack on loopback, load it with locust, write a summary.

Embedded tier (one ``recserve serve`` process holding the embeddings)::

    python load_tests/run.py --checkpoint runs/adult --users 16 --seconds 60 --out lt-out

Remote tier (LocalCluster: 2 parameter servers in Infer mode loading the checkpoint's
embeddings read-only + 1 embedding worker; ``recserve serve --embedding-workers``)::

    python load_tests/run.py --synthetic --tier remote --users 16 --seconds 60 --out lt-out

Soak (bounded): ``--soak --minutes 10`` samples the RSS of every process of the stack (the
server, and in the remote tier each parameter server and the embedding worker), writes a new
checkpoint version into the served directory (atomically: staged copy, then rename) and
reloads it via ``POST /admin/reload`` half-way, and fails unless no request failed, every
process's memory is flat and the reload is served (the server's metadata lists the published
version and an inference answers with it; ``checkpoint_reload.soak_reload``). A server run
with ``--serve-args "--workers N ..."`` refuses that
POST (it would reach one process of N), so such a soak needs ``--watch-seconds S`` in
``--serve-args`` (refused up front without it) and reloads through the watcher: it publishes
the new version into the watched ``--checkpoint`` and polls ``/metrics`` (at most 120 s plus
two ``--watch-seconds``) until
``recserve_model_info`` reads 1 for it and not for the old version (every process moved). Its
RSS is sampled per process: ``server`` (the supervisor holding the ports) and each serving
process ``server.1`` .. ``server.N``. Each process is judged on its own by the rule that
``load_tests/memory.py`` describes: the warm-up and the reload's settling are left out, and
memory that grows in both halves of a segment or of the final window (the last 20% of the
run, at least 60 s), or stays higher once the reload settled, fails.

Before the load, ``--warmup-seconds S`` (default 3; 0: none) runs the same users and traffic
for S seconds in a locust run of its own, as benchmarks/peers.py warms its servers up: none
of its requests is in the summary's numbers (its own files: ``locust_warmup_*``); what it sent
is in the summary, and a failure in it fails the run as one in the load does.

Final numbers come from locust's own totals, written by the locustfile when locust quits
(``locust_final.json``): locust's ``--csv`` stats file is rewritten once a second and not at
shutdown. A locust that exits non-zero or writes no final stats fails the run, with the tail of
``locust.log``; outputs of an earlier run in ``--out`` are deleted before anything starts.

Output in ``--out``: ``summary.md``, ``summary.csv`` (requests, failures, rps, rows, rows/s,
p50, p95, p99 per request name, i.e. per protocol and batch size, and aggregated),
``summary.json``, ``latency.png`` (latency percentiles over a trailing
~10 s window and throughput over time, plus RSS in soak mode; it needs matplotlib, which the
``load`` extra does not bring: without it the summary says so and the verdict stands),
``rss.csv`` (soak), locust's ``locust_*`` files and the logs of every process. Exit status: 0
when every check passed, 1 when one failed (request failures, a locust failure, a process of
the stack that died, a locust still running 90 s after the end of its load (stopped), no
throughput, 5 s or more in which no request completed, memory growth, a failed reload), 2
when the stack could not start (bad arguments, a missing checkpoint, locust not installed),
130 on Ctrl-C and 143 on SIGTERM.

Every process is started here and ended by its PID, also on Ctrl-C and SIGTERM; loads are
bounded by ``--users`` and ``--seconds`` (``--minutes`` with ``--soak``).
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import secrets
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from load_tests import traffic  # noqa: E402
from load_tests.checkpoint_reload import soak_reload, watcher_reload_timeout  # noqa: E402
from load_tests.locust_run import (  # noqa: E402
    LOCUST_OUTPUTS,
    LocustRun,
    locust_installed,
    locust_outcome,
    rate_window_s,
    read_history,
    stall_problems,
    stats_problems,
)
from load_tests.memory import NO_RELOAD, RssSampler, judge_soak, verdict_text  # noqa: E402
from load_tests.report import REPORT_FILES, plot, write_atomically, write_summary  # noqa: E402
from load_tests.stack import (  # noqa: E402
    ServeProcess,
    dead_processes,
    preprocessor_of,
    run_cleanups,
    server_pids,
    sigterm_exits,
    start_remote_tier,
    stop_process,
    watch_seconds_of,
    workers_of,
)

USER_CLASSES = {
    "binary": "KServeBinaryUser",
    "json": "KServeJsonUser",
    "friendly": "FriendlyJsonUser",
    "grpc": "GrpcUser",
    "torchserve": "TorchServeJsonUser",
    "torchserve-binary": "TorchServeBinaryUser",
}
#: The Adult example's preprocessor (README): it reads raw Adult rows on the friendly route.
ADULT_PREPROCESSOR = "examples.adult_income.preprocess:instances_to_batch"
ADULT_ROWS = REPO_ROOT / "examples" / "adult_income" / "data" / "test.csv.gz"
#: Seconds past the end of its load that locust gets to end its users (``--stop-timeout 5``)
#: and write its stats; one still running then is stopped, and that fails the run.
LOCUST_OVERRUN_S = 90.0
#: Seconds of the unrecorded warm-up run before the load (``--warmup-seconds``).
WARMUP_S = 3
#: The ``--csv`` prefix (in ``--out``) of the warm-up run: its files are kept, apart.
WARMUP_PREFIX = "locust_warmup"


def finite_float(text: str) -> float:
    """argparse type: a finite number (NaN compares false with every bound, so a range check
    alone would let it through to fail after the stack started)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked before anything starts (argparse error: exit 2)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", type=Path, help="recserve checkpoint to serve")
    source.add_argument(
        "--synthetic", action="store_true", help="build and serve a synthetic Criteo-like model"
    )
    parser.add_argument(
        "--tier",
        choices=["embedded", "remote"],
        default="embedded",
        help="embedded: one server process; remote: 2 PS shards + 1 embedding worker + server "
        "(default embedded)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("load-test-out"),
        help="folder for summary.csv/.md, the latency plot, locust CSVs and server logs "
        "(default load-test-out)",
    )
    parser.add_argument(
        "--users",
        type=int,
        default=4,
        help="concurrent locust users (default 4; at least one per --user-classes class)",
    )
    parser.add_argument(
        "--spawn-rate", type=finite_float, default=None, help="users/s (default: all at once)"
    )
    parser.add_argument(
        "--seconds",
        type=finite_float,
        default=None,
        help="load duration (default 10; not with --soak)",
    )
    parser.add_argument(
        "--user-classes",
        default="binary,json,friendly,grpc",
        help=f"comma-separated, from {', '.join(USER_CLASSES)} (each runs once; default "
        "binary,json,friendly,grpc)",
    )
    parser.add_argument(
        "--batches",
        default="1:6,8:3,64:1",
        help="batch mix SIZE:WEIGHT,... (default 1:6,8:3,64:1)",
    )
    parser.add_argument(
        "--unknown-share",
        type=finite_float,
        default=0.02,
        help="share of IDs the model never saw (default 0.02)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="traffic seed (RECSERVE_LT_SEED), to repeat a run's requests; default: random, "
        "reported in the summary",
    )
    parser.add_argument("--model-name", default="model", help="served model name (default model)")
    parser.add_argument(
        "--serve-args", default="", help='extra `recserve serve` flags, e.g. "--max-batch-size 64"'
    )
    parser.add_argument(
        "--friendly-rows",
        type=Path,
        default=None,
        help="CSV or JSON-lines file of raw rows (.gz too) for the friendly user, for a server "
        f"with a --preprocessor (default with {ADULT_PREPROCESSOR}: {ADULT_ROWS.name})",
    )
    parser.add_argument(
        "--locust-processes",
        type=int,
        default=1,
        help="locust worker processes (--processes; default 1)",
    )
    parser.add_argument(
        "--warmup-seconds",
        type=int,
        default=WARMUP_S,
        help="an unrecorded locust run of the same users and traffic before the load, so the "
        "server's first code paths and caches are warm (0: none; its requests are not in the "
        f"summary; default {WARMUP_S})",
    )
    parser.add_argument("--soak", action="store_true", help="memory + reload soak")
    parser.add_argument(
        "--minutes", type=finite_float, default=None, help="soak duration (default 10; --soak only)"
    )
    parser.add_argument(
        "--rss-interval",
        type=finite_float,
        default=None,
        help="seconds between RSS samples of the stack's processes, in (0, 60] (default: 1; "
        "with --soak its length / 200, within 0.25..5)",
    )
    args = parser.parse_args(argv)
    if args.soak and args.seconds is not None:
        parser.error("--soak runs for --minutes; --seconds is the length of a load run")
    if not args.soak and args.minutes is not None:
        parser.error("--minutes is the length of a --soak; a load run takes --seconds")
    args.seconds = 10.0 if args.seconds is None else args.seconds
    args.minutes = 10.0 if args.minutes is None else args.minutes
    if args.users < 1 or args.seconds <= 0 or args.minutes <= 0:
        parser.error("--users, --seconds and --minutes must be positive")
    if args.users > 1000 or args.seconds > 3600 or args.minutes > 120:
        parser.error("bounded runs only: at most 1000 users, 3600 s, 120 minutes")
    if args.spawn_rate is not None and args.spawn_rate <= 0:
        parser.error(f"--spawn-rate must be > 0 users per second, got {args.spawn_rate}")
    if not 1 <= args.locust_processes <= 64:
        parser.error(f"--locust-processes must be in 1..64, got {args.locust_processes}")
    if not 0 <= args.warmup_seconds <= 120:
        parser.error(f"--warmup-seconds must be within 0..120, got {args.warmup_seconds}")
    if args.rss_interval is not None and not 0 < args.rss_interval <= 60:
        parser.error(f"--rss-interval must be in (0, 60] seconds, got {args.rss_interval}")
    if args.seed is not None and args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")
    if args.checkpoint is not None and not args.checkpoint.is_dir():
        parser.error(f"--checkpoint {args.checkpoint}: no such directory")
    if args.out.exists() and not args.out.is_dir():  # else a traceback once it is created
        parser.error(f"--out {args.out}: exists and is not a folder")
    try:
        traffic.parse_batch_mix(args.batches)
    except ValueError as error:  # int("x") too: checked before any process starts
        parser.error(f"--batches {args.batches!r}: {error}")
    if not 0.0 <= args.unknown_share < 1.0:
        parser.error(f"--unknown-share must be in [0, 1), got {args.unknown_share}")
    names = args.user_classes.split(",")
    unknown = set(names) - set(USER_CLASSES)
    if unknown:
        parser.error(f"unknown user classes {sorted(unknown)}")
    # A class named twice is one class (the users split over the classes, not the names):
    # locust is given it once.
    names = list(dict.fromkeys(names))
    args.user_classes = ",".join(names)
    if args.users < len(names):
        parser.error(
            f"--users {args.users} is fewer than the {len(names)} user classes "
            f"({args.user_classes}): locust starts whole users, so some class would send "
            "nothing"
        )
    try:
        serve_args = shlex.split(args.serve_args)
    except ValueError as error:
        parser.error(f"--serve-args {args.serve_args!r}: {error}")
    if args.soak and workers_of(serve_args) > 1 and watch_seconds_of(serve_args) <= 0:
        parser.error(
            f"--serve-args runs --workers {workers_of(serve_args)}: such a server refuses "
            "POST /admin/reload (it would reach one process of them), so the soak reloads "
            'through its watcher: add --watch-seconds S to --serve-args (e.g. "--workers '
            f'{workers_of(serve_args)} --watch-seconds 1")'
        )
    preprocessor = preprocessor_of(serve_args)
    if args.friendly_rows is None and preprocessor == ADULT_PREPROCESSOR:
        args.friendly_rows = ADULT_ROWS  # what that preprocessor reads: raw Adult rows
    if "friendly" in names and preprocessor and args.friendly_rows is None:
        parser.error(
            f"--serve-args has --preprocessor {preprocessor}: the friendly route then takes "
            "the preprocessor's raw rows, not slot IDs; pass --friendly-rows FILE (CSV or "
            "JSON lines of such rows) or leave friendly out of --user-classes"
        )
    if args.friendly_rows is not None and not args.friendly_rows.is_file():
        parser.error(f"--friendly-rows {args.friendly_rows}: no such file")
    return args


def load_seconds(args: argparse.Namespace) -> float:
    """The load's length as locust runs it: ``-t`` takes whole seconds, at least 1
    (:meth:`LocustRun.command`). The summary, the soak's reload half-way and its memory
    judgement use this, not the fraction asked for (``--seconds 2.5`` ran 2 s and the summary
    said 2.5)."""
    asked = args.minutes * 60.0 if args.soak else args.seconds
    return float(max(round(asked), 1))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not locust_installed():
        print(
            f"error: locust is not importable by {sys.executable} (pip install locust); "
            "nothing was started",
            file=sys.stderr,
        )
        return 2
    try:
        with sigterm_exits():
            return _run(args)
    except KeyboardInterrupt:
        print("interrupted: every process started was stopped", file=sys.stderr)
        return 130


def _wait_while_running(
    locust: subprocess.Popen, until: float, stack: dict[str, tuple[subprocess.Popen | None, Path]]
) -> bool:
    """Wait until ``locust`` exits or the monotonic clock passes ``until``; stop locust early
    (it still writes its final stats) when a process of the stack dies. True if one died."""
    while locust.poll() is None and time.monotonic() < until:
        if dead_processes(stack):
            stop_process(locust)
            return True
        time.sleep(0.2)
    return bool(dead_processes(stack))


def _stop_overrun(locust: subprocess.Popen, seconds: float) -> list[str]:
    """Stop ``locust`` if it still runs once its deadline passed (SIGTERM: it still writes its
    stats); the problem that fails the run when it did. A locust that hangs past its end
    (a user stuck in a call, a worker that never reports) must not pass on the numbers it
    wrote before it hung."""
    if locust.poll() is not None:
        return []
    code = stop_process(locust)
    return [
        f"locust was still running {LOCUST_OVERRUN_S:.0f} s after the end of its "
        f"{seconds:g} s load and was stopped (exit code {code}): its numbers may be incomplete"
    ]


def _warm_up(
    run: LocustRun, stack: dict[str, tuple[subprocess.Popen | None, Path]]
) -> dict[str, Any]:
    """The unrecorded warm-up: ``run`` (the load's users and traffic for ``run.seconds``, its
    own files at its own prefix), as benchmarks/peers.py warms its servers up: a locust run of
    its own, so none of its requests is in the load's stats (nor locust's req/s clock, nor the
    history). What it sent (``requests``, ``failures``) and its ``problems``: a failed request,
    a locust failure or overrun, a process of the stack that died; they fail the run."""
    started_unix = time.time()
    locust = run.start()
    _wait_while_running(locust, time.monotonic() + run.seconds + LOCUST_OVERRUN_S, stack)
    problems = _stop_overrun(locust, run.seconds)
    final, outcome = locust_outcome(run, locust.returncode, started_unix)
    problems += outcome
    total: dict[str, Any] = {}
    if final is not None:
        total = next((row for row in final["stats"] if row["name"] == "Aggregated"), {})
        if total.get("failures"):
            problems.append(f"{total['failures']} failed requests")
    return {
        "seconds": float(max(round(run.seconds), 1)),
        "requests": total.get("requests", 0),
        "failures": total.get("failures", 0),
        "locust_exit_code": locust.returncode,
        "problems": problems,
    }


def _run(args: argparse.Namespace) -> int:
    out = args.out.absolute()
    out.mkdir(parents=True, exist_ok=True)
    # A failed run must not leave an earlier run's verdict or numbers behind.
    for name in [
        *REPORT_FILES,
        *(f"{prefix}{suffix}" for prefix in ("locust", WARMUP_PREFIX) for suffix in LOCUST_OUTPUTS),
    ]:
        (out / name).unlink(missing_ok=True)
    seconds = load_seconds(args)
    seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    serve_args = shlex.split(args.serve_args)
    cluster = None
    server: ServeProcess | None = None
    run: LocustRun | None = None
    warmup_run: LocustRun | None = None
    sampler: RssSampler | None = None
    try:
        try:
            if args.synthetic:
                from load_tests.synthetic_model import build_synthetic_checkpoint

                checkpoint = out / "synthetic-checkpoint"
                if not (checkpoint / "DONE").exists():
                    build_synthetic_checkpoint(checkpoint, overwrite=True)
            else:
                checkpoint = args.checkpoint.absolute()
            served = checkpoint
            if args.soak:  # reload writes new versions here: serve a copy, never the original
                served = out / "served-checkpoint"
                shutil.rmtree(served, ignore_errors=True)
                shutil.copytree(checkpoint, served)
            vocab_path = out / "vocab.npz"
            traffic.save_vocab(traffic.vocab_from_checkpoint(served), vocab_path)
            if args.tier == "remote":
                cluster = start_remote_tier(served, out)
            # Held before start(): an interruption while it waits still finds the process.
            server = ServeProcess(
                served,
                out / "serve.log",
                model_name=args.model_name,
                embedding_workers=",".join(cluster.worker_addresses) if cluster else "",
                extra_args=serve_args,
            )
            server.start()
            metadata = traffic.fetch_metadata(server.http, args.model_name)
            inputs = traffic.ModelInputs.from_metadata(metadata)
            # The soak's check that the reloaded version answers: one row of the traffic.
            infer_body = (
                traffic.encode_kserve_json(
                    traffic.TrafficGenerator(inputs, vocab=traffic.load_vocab(vocab_path)).arrays(1)
                )
                if args.soak
                else b""
            )
        except Exception as error:
            print(f"error: the stack did not start: {error}", file=sys.stderr)
            return 2
        classes = [USER_CLASSES[name] for name in args.user_classes.split(",")]
        env = {
            "RECSERVE_LT_MODEL": args.model_name,
            "RECSERVE_LT_GRPC": server.grpc,
            "RECSERVE_LT_VOCAB": str(vocab_path),
            "RECSERVE_LT_BATCHES": args.batches,
            "RECSERVE_LT_UNKNOWN": str(args.unknown_share),
            "RECSERVE_LT_SEED": str(seed),
        }
        if args.friendly_rows is not None:
            env["RECSERVE_LT_ROWS"] = str(args.friendly_rows.absolute())
        run = LocustRun(
            users=args.users,
            spawn_rate=args.spawn_rate or args.users,
            seconds=seconds,
            classes=classes,
            host=server.http,
            csv_prefix=out / "locust",
            log_path=out / "locust.log",
            env=env,
            processes=args.locust_processes,
        )
        # One RSS column per process: with --workers N, the supervisor and each serving
        # process (server.1 .. server.N), each judged on its own.
        workers = workers_of(serve_args)
        pids = server_pids(server.pid, workers)
        stack: dict[str, tuple[subprocess.Popen | None, Path]] = {
            "recserve serve": (server.process, server.log_path)
        }
        if cluster is not None:
            for process in [*cluster.shards, *cluster.workers]:
                # start_remote_tier returns the cluster started: each process has its Popen
                assert process.process is not None
                pids[process.name.replace(" ", "_")] = process.process.pid
                stack[process.name] = (process.process, process.log_path)
        warmup: dict[str, Any] | None = None
        if args.warmup_seconds > 0:
            warmup_run = replace(
                run,
                seconds=float(args.warmup_seconds),
                csv_prefix=out / WARMUP_PREFIX,
                log_path=out / f"{WARMUP_PREFIX}.log",
            )
            warmup = _warm_up(warmup_run, stack)
        interval = args.rss_interval or (max(0.25, min(seconds / 200.0, 5.0)) if args.soak else 1)
        sampler = RssSampler(pids, interval)
        sampler.start()
        started = time.monotonic()
        started_unix = time.time()
        locust = run.start()
        deadline = started + seconds + LOCUST_OVERRUN_S
        soak: dict[str, Any] | None = None
        marks: list[tuple[float, str]] = []
        reload_s: float | None = None
        died = False
        if args.soak:
            died = _wait_while_running(locust, started + seconds / 2.0, stack)
            if not died and locust.poll() is None:
                reload_unix = time.time()
                reload_s = time.monotonic() - sampler.started_at
                reload_result = soak_reload(
                    server,
                    served,
                    workers=workers,
                    watcher_timeout=watcher_reload_timeout(serve_args),
                    infer_body=infer_body,
                )
                marks.append((reload_unix, "reload"))
                soak = {"reload_at_s": reload_unix - started_unix, "reload": reload_result}
            else:
                soak = {"reload_at_s": -1.0, "reload": {"ok": False, "error": NO_RELOAD}}
        if not died:
            died = _wait_while_running(locust, deadline, stack)
        overrun = _stop_overrun(locust, seconds)
        sampler.stop()
        final, problems = locust_outcome(run, locust.returncode, started_unix)
        problems[:0] = [*dead_processes(stack), *overrun]  # the causes before their symptoms
        if warmup is not None:  # its requests are not counted, but a failure is a failure
            problems[:0] = [f"warm-up: {problem}" for problem in warmup["problems"]]
        stats = list(final["stats"]) if final is not None else []
        # With --processes the master's counts grow only when a worker reports (every 3 s):
        # req/s over windows that long, not spikes of ~3x the rate and then 0.
        rate_window = rate_window_s(args.locust_processes)
        history = read_history(run.csv_prefix, rate_window)
        if final is not None:
            problems.extend(stats_problems(stats, classes, run.csv_prefix))
            problems.extend(stall_problems(history))
        if soak is not None:
            samples = sampler.samples
            if samples:
                series = io.StringIO(newline="")
                writer = csv.DictWriter(series, fieldnames=list(samples[0]))
                writer.writeheader()
                writer.writerows(samples)
                write_atomically(out / "rss.csv", series.getvalue())
            verdicts, failed = judge_soak(
                samples, seconds=seconds, reload_s=reload_s, reload=soak["reload"]
            )
            soak["pids"] = dict(pids)
            soak["memory"] = {name: asdict(verdict) for name, verdict in verdicts.items()}
            problems.extend(failed)
        no_plot = plot(
            out / "latency.png",
            history,
            title=f"recserve {args.tier}, {args.users} users ({args.user_classes})",
            rss=sampler.samples if args.soak else None,
            marks=marks,
            rate_window_s=rate_window,
        )
        if no_plot:  # the verdict and the numbers do not need the picture
            print(f"warning: {no_plot}", file=sys.stderr)
        result = {
            "model": args.model_name,
            "inputs": traffic.describe(inputs),
            "checkpoint": str(checkpoint),
            "tier": args.tier,
            "users": args.users,
            "spawn_rate": args.spawn_rate or args.users,
            "classes": classes,
            "seconds": seconds,
            "batches": args.batches,
            "seed": seed,
            "warmup": warmup,
            "friendly_rows": str(args.friendly_rows) if args.friendly_rows else None,
            "serve_args": serve_args,
            "locust_command": " ".join(run.command()),
            "locust_exit_code": locust.returncode,
            "stats": stats,
            # how finely locust's histogram, whence every percentile, kept the response times
            "latency_resolution": final.get("latency_resolution") if final is not None else None,
            "soak": soak,
            "passed": not problems,
            "verdict": verdict_text(problems, soak=soak is not None),
            "plot": no_plot,
        }
        write_summary(out, result)
        print((out / "summary.md").read_text())
        return 0 if not problems else 1
    finally:  # each step on its own, so one failure (or a second Ctrl-C) leaves none behind
        run_cleanups(
            [
                sampler.stop if sampler is not None else None,
                warmup_run.stop if warmup_run is not None else None,
                run.stop if run is not None else None,
                server.stop if server is not None else None,
                cluster.stop if cluster is not None else None,
            ]
        )


if __name__ == "__main__":
    sys.exit(main())
