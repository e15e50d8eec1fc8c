"""argparse value types shared by every ``recserve`` subcommand (clear messages, one place)."""

from __future__ import annotations

import argparse
import math
from typing import TypeVar

T = TypeVar("T", int, float)


def _number(text: str, kind: type[T], what: str) -> T:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_int(text: str) -> int:
    value = _number(text, int, "an integer")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected an integer > 0, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = _number(text, int, "an integer")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    value = _number(text, float, "a number")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    value = _number(text, float, "a number")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def port_number(text: str) -> int:
    """A TCP port, 0..65535 (0: let the system pick a free one)."""
    value = _number(text, int, "an integer")
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535, got {value}")
    return value
