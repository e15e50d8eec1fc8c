"""load_tests/locustfile.py's TorchServe users, checked in a subprocess (locust monkey-patches
the standard library on import)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

_DESCRIBE = """
import json
from load_tests import locustfile as lf, traffic

payload = traffic.Payload(8, b"", header_length=123)
users = {"json": lf.TorchServeJsonUser, "binary": lf.TorchServeBinaryUser,
         "kserve-binary": lf.KServeBinaryUser}
print(json.dumps({
    name: {"path": user.path, "kind": user.kind, "label": user.label,
           "abstract": user.abstract, "headers": user.headers(user, payload)}
    for name, user in users.items()
} | {"short_names": {k: v.__name__ for k, v in lf.USER_CLASSES.items()}}))
"""


def test_torchserve_binary_user_mirrors_the_json_and_kserve_binary_users():
    env = {**os.environ, "RECSERVE_LT_MODEL": "model", "RECSERVE_LT_TS_MODEL": "synthetic"}
    result = subprocess.run(
        [sys.executable, "-c", _DESCRIBE],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    users = json.loads(result.stdout.strip().splitlines()[-1])
    binary, plain, kserve = users["binary"], users["json"], users["kserve-binary"]
    assert binary["path"] == plain["path"] == "/predictions/synthetic"
    assert binary["kind"] == "binary" and not binary["abstract"]
    assert binary["label"] == "torchserve-binary"
    assert (
        binary["headers"]
        == kserve["headers"]
        == {
            "Content-Type": "application/octet-stream",
            "Inference-Header-Content-Length": "123",
        }
    )
    assert plain["headers"] == {"Content-Type": "application/json"}
    assert users["short_names"]["torchserve-binary"] == "TorchServeBinaryUser"
    # load_tests/run.py names the same users (it does not import locust itself).
    from load_tests import run

    assert users["short_names"] == run.USER_CLASSES
