"""Runs a Python snippet in a fresh interpreter from the repository root (for code that must
not run in the test process: locust's monkey-patching, prometheus' multiprocess mode,
signal handlers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_python(
    script: str, *args: str, env: dict[str, str] | None = None, returncode: int = 0
) -> subprocess.CompletedProcess[str]:
    """``python -c script args...`` in REPO_ROOT (so its packages import); fails the test
    unless it exits with ``returncode``."""
    result = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == returncode, result.stderr
    return result


def last_json_line(result: subprocess.CompletedProcess[str]):
    """The JSON document the snippet printed last."""
    return json.loads(result.stdout.strip().splitlines()[-1])
