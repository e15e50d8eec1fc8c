"""The README's main-job command, as a user runs it (minus the venv set-up, done by CI)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quickstart_trains_serves_and_answers(tmp_path):
    """As the README runs it: it serves until stopped. SIGTERM (or a closed terminal) stops
    it as Ctrl-C does: the server it started drains and is gone, never left running."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    quickstart = subprocess.Popen(
        [
            sys.executable, "-m", "examples.adult_income.quickstart", "--epochs", "1",
            "--http-port", "0", "--grpc-port", "0", "--workdir", str(tmp_path),
        ],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    server_pid = None
    try:
        lines = []
        deadline = time.monotonic() + 300
        for line in quickstart.stdout:
            lines.append(line)
            if line.startswith("Serving until Ctrl-C."):
                break
            assert time.monotonic() < deadline, "".join(lines)
        children = Path(f"/proc/{quickstart.pid}/task/{quickstart.pid}/children").read_text()
        (server_pid,) = map(int, children.split())  # recserve serve
        quickstart.send_signal(signal.SIGTERM)
        lines.append(quickstart.stdout.read())
        assert quickstart.wait(timeout=60) == 0, "".join(lines)
        assert not Path(f"/proc/{server_pid}").exists()  # ended and reaped, not orphaned
    finally:
        if quickstart.poll() is None:
            quickstart.kill()
            quickstart.wait()
        if server_pid is not None and Path(f"/proc/{server_pid}").exists():
            os.kill(server_pid, signal.SIGKILL)  # the server this test's quickstart started
    out = "".join(lines)
    auc = float(re.search(r"test AUC: ([0-9.]+)", out).group(1))
    assert auc > 0.88  # one epoch; the full example reaches >= 0.91
    values = [float(v) for v in re.findall(r"(?:JSON|KServe v2):\s+([0-9.]+)", out)]
    assert len(values) == 3 and max(values) - min(values) < 1e-4  # HTTP x2 and gRPC agree
    assert 0.0 <= values[0] <= 1.0
    assert "curl -s -X POST http://127.0.0.1:" in out
    assert "  pip install 'tritonclient[grpc]'\n  python -c \"import tritonclient" in out
    assert (tmp_path / "checkpoint" / "DONE").exists()
