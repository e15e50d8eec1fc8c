"""The README's main-job command, as a user runs it (minus the venv set-up, done by CI)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quickstart_trains_serves_and_answers(tmp_path):
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "examples.adult_income.quickstart",
            "--exit",
            "--epochs",
            "1",
            "--http-port",
            "0",
            "--grpc-port",
            "0",
            "--workdir",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    auc = float(re.search(r"test AUC: ([0-9.]+)", out).group(1))
    assert auc > 0.88  # one epoch; the full example reaches >= 0.91
    values = [float(v) for v in re.findall(r"(?:JSON|KServe v2):\s+([0-9.]+)", out)]
    assert len(values) == 3 and max(values) - min(values) < 1e-4  # HTTP x2 and gRPC agree
    assert 0.0 <= values[0] <= 1.0
    assert "curl -s -X POST http://127.0.0.1:" in out
    assert (tmp_path / "checkpoint" / "DONE").exists()
