"""argparse value types shared by every ``recserve`` subcommand (clear messages, one place)."""

from __future__ import annotations

import argparse
import ipaddress
import math
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T", int, float)

#: The largest value the float types accept. Their flags are durations in seconds (a few are
#: milliseconds or tolerances) that end up in ``threading``/``select`` timeouts, which raise
#: OverflowError beyond ``threading.TIMEOUT_MAX`` (~9.2e9 s): 1e6 s (11.5 days) is far beyond
#: any sane deadline, drain time or poll interval, and far below that limit.
MAX_FLOAT_VALUE = 1e6


def _number(text: str, kind: type[T], what: str) -> T:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _at_most(value: float, text: str) -> float:
    if value > MAX_FLOAT_VALUE:
        raise argparse.ArgumentTypeError(
            f"expected a number <= {MAX_FLOAT_VALUE:.0f}, got {text!r}"
        )
    return value


def non_empty(text: str) -> str:
    """Any text with something besides spaces (an unset shell variable gives "")."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a non-empty value")
    return text


def non_empty_path(text: str) -> Path:
    """A path that is not empty nor only spaces. ``Path("")`` is ``.``: an unset shell
    variable (``--reload-root "$ROOT"``) silently named the working directory."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a path, got an empty value")
    return Path(text)


def path_text(text: str) -> str:
    """:func:`non_empty_path`, kept as text (config files: given "", a config flag failed
    with ": config file not found", or was skipped for its environment variable's file)."""
    non_empty_path(text)
    return text


def positive_int(text: str) -> int:
    """An integer > 0."""
    value = _number(text, int, "an integer")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected an integer > 0, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    value = _number(text, int, "an integer")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number in (0, MAX_FLOAT_VALUE]: NaN, inf, 0 and negatives are refused."""
    value = _number(text, float, "a number")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return _at_most(value, text)


def non_negative_float(text: str) -> float:
    """A finite number in [0, MAX_FLOAT_VALUE]: NaN, inf and negatives are refused."""
    value = _number(text, float, "a number")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return _at_most(value, text)


def int_in_range(low: int, high: int | None) -> Callable[[str], int]:
    """The type of an integer in ``[low, high]`` (``high`` None: no upper bound)."""

    def parse(text: str) -> int:
        value = _number(text, int, "an integer")
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in {low}..{high}"
            raise argparse.ArgumentTypeError(f"expected an integer {bound}, got {value}")
        return value

    return parse


def port_number(text: str) -> int:
    """A TCP port, 0..65535 (0: let the system pick a free one)."""
    value = _number(text, int, "an integer")
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535, got {value}")
    return value


#: Schemes of URLs (the prediction server's, the clients') that are no gRPC target.
_URL_SCHEMES = ("http", "https", "grpc", "grpcs")


def url_problem(address: str) -> str | None:
    """Why ``address`` (one of a gRPC peer list) is a URL rather than HOST:PORT, or None. The
    tier's gRPC addresses have no scheme; gRPC read ``http://127.0.0.1:7201`` as a host name
    and failed with "Misformatted domain name". gRPC's own target URIs (``dns:///...``,
    ``unix://...``) pass."""
    scheme, separator, rest = address.partition("://")
    if not separator or scheme.lower() not in _URL_SCHEMES:
        return None
    return f"{address!r} is a URL: give HOST:PORT, without {scheme}:// (e.g. {rest.rstrip('/')})"


def _is_ipv6(text: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(text), ipaddress.IPv6Address)
    except ValueError:
        return False


def host_port_problem(address: str) -> str | None:
    """Why ``address`` is not a HOST:PORT a peer can dial (port 1..65535, an IPv6 host in
    brackets), or None. gRPC reads ``::1:7000`` as the IPv6 host ``::1:7000`` on its
    default port 443, so a shard there was never reached: the caller timed out instead."""
    problem = url_problem(address)
    if problem:
        return problem
    host, _, port = address.rpartition(":")
    if not (host and port.isdigit() and port.isascii() and 0 < int(port) < 65536):
        return f"{address!r} is not HOST:PORT"
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        return f"{address!r} is not HOST:PORT: write an IPv6 host in brackets, e.g. [{host}]:{port}"
    if host.startswith("[") and not _is_ipv6(host[1:-1]):
        return f"{address!r} is not HOST:PORT: {host} holds no IPv6 address"
    if any(character.isspace() for character in host):
        return f"{address!r} is not HOST:PORT: the host has a space in it"
    return None


def grpc_address_problem(address: str) -> str | None:
    """Why ``address`` is no gRPC address to dial (a URL, or a bare IPv6 address: gRPC
    dials ``::1:7000`` on port 443), or None; gRPC's own target URIs pass."""
    problem = url_problem(address)
    if problem:
        return problem
    if _is_ipv6(address):
        return (
            f"{address!r} is an IPv6 address without a port: write the host in brackets, "
            "[ADDRESS]:PORT"
        )
    return None


def grpc_addresses(text: str) -> str:
    """Comma-separated gRPC addresses (HOST:PORT), at least one, none of them a URL nor a
    bare IPv6 address; the text unchanged. ("" from an unset shell variable: gRPC failed on
    the empty target with its own trace, or a trainer silently used its embedded tier.)"""
    addresses = [a.strip() for a in text.split(",") if a.strip()]
    for address in addresses:
        problem = grpc_address_problem(address)
        if problem:
            raise argparse.ArgumentTypeError(problem)
    if not addresses:
        raise argparse.ArgumentTypeError("give at least one HOST:PORT")
    return text


def grpc_address(text: str) -> str:
    """One gRPC address (:func:`grpc_addresses` with a single entry), stripped. A list was
    taken whole as one target: "errors resolving a:1,b:2 ... Misformatted domain name"."""
    grpc_addresses(text)
    addresses = [a.strip() for a in text.split(",") if a.strip()]
    if len(addresses) > 1:
        raise argparse.ArgumentTypeError(f"give one HOST:PORT, got {len(addresses)}: {text!r}")
    return addresses[0]


def host_port_addresses(text: str) -> str:
    """Comma-separated HOST:PORT addresses with a port in 1..65535, at least one, none a URL
    (what a process listens on and its peers dial: gRPC target URIs do not do for both);
    the text unchanged."""
    addresses = [a.strip() for a in text.split(",") if a.strip()]
    for index, address in enumerate(addresses):
        problem = host_port_problem(address)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        if address in addresses[:index]:
            # One process per entry (a shard in replica order, an NN worker in rank order):
            # one address twice is one process taking two places.
            raise argparse.ArgumentTypeError(f"{address!r} is given twice")
    if not addresses:
        raise argparse.ArgumentTypeError("give at least one HOST:PORT")
    return text
