#!/usr/bin/env python3
"""Health check of recserve processes, for container HEALTHCHECKs and start-up ordering.

    python deploy/scripts/healthcheck.py [TARGET ...] [--wait SECONDS]

A TARGET is ``grpc://HOST:PORT`` (standard gRPC health service, overall status ``""`` or
``--service NAME``: the
parameter servers and embedding workers; over the tier's mutual TLS when the
``RECSERVE_TIER_TLS_*`` variables are set), ``http://HOST:PORT/PATH`` or ``https://...``
(``recserve serve``: ``/v2/health/ready``; over https the certificate is not verified, as a
Kubernetes HTTPS probe does not: the check asks the process on this host, by address), or
``tcp://HOST:PORT`` (the port accepts connections: ``recserve serve --tls-client-ca``, whose
mutual TLS refuses a client without a certificate). Exit 0 when every target is healthy,
else 1 (the reason on stderr).

Without TARGETs: ``$RECSERVE_HEALTHCHECK`` (comma-separated targets), else the target is
derived from this container's main process (PID 1): ``recserve serve`` ->
``http://127.0.0.1:HTTP_PORT/v2/health/ready`` (``https://`` with ``--tls-cert``,
``tcp://127.0.0.1:HTTP_PORT`` with ``--tls-client-ca``), ``recserve embedding-parameter-server`` and
``embedding-worker`` -> ``grpc://127.0.0.1:PORT``; any other command (train, data-loader)
has nothing to check and is healthy. The container images have no curl nor grpc_health_probe:
this needs only the Python packages recserve already depends on.

``--wait SECONDS`` retries until every target is healthy or the time is up (Procfile
ordering: start ``recserve serve`` once the shards have loaded their checkpoint).
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import ssl
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc

SERVE_DEFAULT_HTTP_PORT = 8000
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")
# The embedding tier's mutual TLS (embedding_store/grpc_common.py reads the same variables).
TIER_TLS_VARIABLES = ("RECSERVE_TIER_TLS_CERT", "RECSERVE_TIER_TLS_KEY", "RECSERVE_TIER_TLS_CA")


def _flag(argv: list[str], name: str) -> str | None:
    """Value of ``--name V`` or ``--name=V`` in an argv list (last one wins)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def targets_from_argv(argv: list[str]) -> list[str]:
    """The health target of a ``recserve ...`` command line (empty: nothing to check)."""
    if "serve" in argv:
        command = "serve"
    elif "embedding-parameter-server" in argv:
        command = "ps"
    elif "embedding-worker" in argv:
        command = "worker"
    else:
        return []
    host = _flag(argv, "--host") or "127.0.0.1"
    if host in WILDCARD_HOSTS:
        host = "127.0.0.1"
    if command == "serve":
        port = _flag(argv, "--http-port") or str(SERVE_DEFAULT_HTTP_PORT)
        if _flag(argv, "--tls-client-ca"):
            return [f"tcp://{host}:{port}"]
        scheme = "https" if _flag(argv, "--tls-cert") else "http"
        return [f"{scheme}://{host}:{port}/v2/health/ready"]
    port = _flag(argv, "--port")
    return [f"grpc://{host}:{port}"] if port and port != "0" else []


def default_targets() -> list[str]:
    configured = os.environ.get("RECSERVE_HEALTHCHECK", "").strip()
    if configured:
        return [t.strip() for t in configured.split(",") if t.strip()]
    try:
        with open("/proc/1/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []
    return targets_from_argv(argv)


def _tier_channel(address: str) -> grpc.Channel:
    """A channel to a tier service: mutual TLS with the tier's files when the container has
    the RECSERVE_TIER_TLS_* variables (the services then refuse plaintext), else plaintext.
    The tier certificate must name the address dialled (127.0.0.1 for this check).
    OSError for a file that cannot be read, ValueError for a partial set."""
    import grpc

    paths = [os.environ.get(name, "").strip() for name in TIER_TLS_VARIABLES]
    if not any(paths):
        return grpc.insecure_channel(address)
    if not all(paths):
        raise ValueError(f"the tier's mutual TLS needs all of {', '.join(TIER_TLS_VARIABLES)}")
    cert, key, ca = (Path(path).read_bytes() for path in paths)
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(ca, key, cert))


def _unverified_tls() -> ssl.SSLContext:
    """TLS without verifying the server: its certificate names its service, not the
    127.0.0.1 this check dials, and the check asks only whether it is ready."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def check(target: str, timeout: float, service: str = "") -> str | None:
    """None when healthy, else why not."""
    if target.startswith(("http://", "https://")):
        context = _unverified_tls() if target.startswith("https://") else None
        try:
            with urllib.request.urlopen(target, timeout=timeout, context=context) as response:
                return None if response.status == 200 else f"HTTP {response.status}"
        except urllib.error.HTTPError as error:
            return f"HTTP {error.code}"
        except (OSError, ValueError) as error:
            return str(getattr(error, "reason", error))
    if target.startswith("grpc://"):
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        address = target[len("grpc://") :].rstrip("/")
        try:
            channel = _tier_channel(address)
        except (OSError, ValueError) as error:
            return str(error)
        with channel:
            try:
                answer = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=timeout
                )
            except grpc.RpcError as error:
                return f"{error.code().name}: {error.details()}"
        if answer.status == health_pb2.HealthCheckResponse.SERVING:
            return None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
    if target.startswith("tcp://"):
        host, _, port = target[len("tcp://") :].rstrip("/").rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
                return None
        except (OSError, ValueError) as error:
            return str(error)
    return (
        "unknown target scheme (expected grpc://HOST:PORT, http(s)://HOST:PORT/PATH or "
        "tcp://HOST:PORT)"
    )


def _seconds(minimum_exclusive: bool) -> Callable[[str], float]:
    """A finite number of seconds, >= 0 (> 0 with ``minimum_exclusive``). ``--wait nan``
    retried forever (no time is >= a NaN deadline); a NaN or negative ``--timeout`` failed
    every check with a message about the socket, not the flag."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0 or (minimum_exclusive and value == 0):
            bound = "> 0" if minimum_exclusive else ">= 0"
            raise argparse.ArgumentTypeError(
                f"expected a finite number of seconds {bound}, got {text!r}"
            )
        return value

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="*", metavar="TARGET")
    parser.add_argument(
        "--wait",
        type=_seconds(False),
        default=0.0,
        metavar="SECONDS",
        help="retry until every target is healthy or this time is up (default 0: check once)",
    )
    parser.add_argument("--timeout", type=_seconds(True), default=3.0, help="per check (s)")
    parser.add_argument(
        "--service",
        default="",
        help='gRPC health service to ask for grpc:// targets (default "", the overall one; '
        '"recserve.liveness" stays SERVING through a long load or a drain)',
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    targets = args.targets or default_targets()
    deadline = time.monotonic() + args.wait
    while True:
        problems = {
            t: p for t in targets if (p := check(t, args.timeout, args.service)) is not None
        }
        if not problems:
            return 0
        if time.monotonic() >= deadline:
            for target, problem in problems.items():
                print(f"unhealthy: {target}: {problem}", file=sys.stderr)
            return 1
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main())
