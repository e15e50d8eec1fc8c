"""What machine a benchmark ran on: the facts docs/BENCHMARKS.md records next to each number.

Shared by the scripts in this folder (run as ``python benchmarks/NAME.py``, which puts this
folder first on ``sys.path``, or as ``python -m benchmarks.NAME``).
"""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:  # not Linux: fall back below
        pass
    return platform.processor() or platform.machine()


def describe_machine(*packages: str) -> dict[str, str | int | float]:
    """CPU model, core count, Python, the 1-minute load average (other work on the machine
    skews every number: report it) and the installed version of each named distribution
    (``"not installed"`` when absent).

    Returns a flat, JSON-ready mapping, e.g. ``{"cpu": "AMD EPYC ...", "nproc": 2, ...,
    "torch": "2.13.0+cpu"}``."""
    info: dict[str, str | int | float] = {
        "cpu": cpu_model(),
        "nproc": os.cpu_count() or 0,
        "python": platform.python_version(),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    for package in packages:
        try:
            info[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            info[package] = "not installed"
    return info
