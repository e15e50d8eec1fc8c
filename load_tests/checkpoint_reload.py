"""The soak's checkpoint reload: a new version of the served checkpoint, and its reload.

A new version is written into the served directory atomically (a staged copy with a fresh
manifest version, then rename) and loaded via ``POST /admin/reload``
(:meth:`load_tests.stack.ServeProcess.reload`). A server run with ``--workers N`` refuses that
POST (it would reach one process of N), so its soak reloads through the ``--watch-seconds``
watcher: it publishes the new version into the watched ``--checkpoint`` and polls ``/metrics``
(at most 120 s plus two ``--watch-seconds``) until ``recserve_model_info`` reads 1 for it and
not for the old version (every process moved).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from load_tests.stack import ServeProcess, watch_seconds_of


def publish_new_version(served: Path) -> str:
    """Write a new version of the checkpoint in ``served`` into ``served`` itself: a staged
    copy with a fresh manifest version, moved into place by rename. Returns the version."""
    from embedding_store.checkpoint_publish import publish_directory

    staging = served.with_name(f".{served.name}.staging-{uuid.uuid4().hex[:8]}")
    shutil.copytree(served, staging)
    manifest_path = staging / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["step"] = int(manifest.get("step", 0)) + 1
    manifest["version"] = f"{manifest['step']:08d}-{uuid.uuid4().hex[:8]}"
    manifest["created_unix"] = time.time()
    temporary = manifest_path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(manifest, indent=2))
    os.replace(temporary, manifest_path)
    publish_directory(staging, served, overwrite=True)
    return str(manifest["version"])


def checkpoint_version(served: Path) -> str:
    """The version in the manifest of the checkpoint directory ``served``."""
    return str(json.loads((served / "manifest.json").read_text())["version"])


def served_versions(http: str, model: str, timeout: float = 5.0) -> dict[str, float]:
    """``recserve_model_info`` of ``model`` in ``http``'s ``/metrics``, by version. A
    ``--workers`` server answers for all its processes: a version reads 1 while any process
    serves it and no series once none does."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{http}/metrics", timeout=timeout) as response:
        text = response.read().decode()
    return {
        sample.labels["version"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "recserve_model_info"
        for sample in family.samples
        if sample.labels.get("model") == model and "version" in sample.labels
    }


def reload_through_watcher(
    server: ServeProcess, served: Path, *, timeout: float = 120.0, poll: float = 0.5
) -> dict[str, Any]:
    """The soak's reload of a ``recserve serve --workers N --watch-seconds S`` server, which
    refuses ``POST /admin/reload`` (it would reach one process of N): publish a new version
    into ``served`` (the watched ``--checkpoint``), then poll ``/metrics`` until
    ``recserve_model_info`` reads 1 for the new version and not for the old one, i.e. every
    process serves the new one. RuntimeError when that takes more than ``timeout`` seconds
    or the server exits meanwhile."""
    previous = checkpoint_version(served)
    version = publish_new_version(served)
    deadline = time.monotonic() + timeout
    seen: dict[str, float] | str = "no answer yet"
    while True:
        try:
            seen = served_versions(server.http, server.model_name)
        except (OSError, ValueError) as error:  # URLError is an OSError
            seen = f"/metrics: {error!r}"
        if isinstance(seen, dict) and seen.get(version) == 1 and seen.get(previous, 0) == 0:
            return {"ok": True, "via": "watcher", "published": version, "version": version,
                    "previous_version": previous}  # fmt: skip
        if server.process is not None and server.process.poll() is not None:
            raise RuntimeError(
                f"recserve serve exited with {server.process.returncode} while reloading "
                f"version {version}"
            )
        if time.monotonic() >= deadline:
            raise RuntimeError(
                f"the --watch-seconds watcher did not serve version {version} in every "
                f"process within {timeout:.0f} s (recserve_model_info must read 1 for it and "
                f"0 for {previous}; /metrics read {seen}); see {server.log_path}"
            )
        time.sleep(poll)


def served_after_reload(
    http: str, model: str, version: str, infer_body: bytes, timeout: float = 10.0
) -> dict[str, Any]:
    """What the server serves once a reload said it is done: the versions its metadata lists
    and the ``model_version`` of an answer to ``infer_body`` (a KServe v2 JSON request).
    ``ok`` only when both are ``version``: the reload's own answer is the server's claim, an
    inference is what clients get (with ``--workers N`` one process answers it; the watcher
    reload already waited for every process through ``/metrics``)."""
    found: dict[str, Any] = {"ok": False, "metadata_versions": None, "answered_version": None}
    base = http.rstrip("/")
    try:
        with urllib.request.urlopen(f"{base}/v2/models/{model}", timeout=timeout) as response:
            found["metadata_versions"] = json.loads(response.read()).get("versions")
        request = urllib.request.Request(
            f"{base}/v2/models/{model}/infer",
            data=infer_body,
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=timeout) as response:
            found["answered_version"] = json.loads(response.read()).get("model_version")
    except (OSError, ValueError, AttributeError) as error:  # URLError and HTTPError: OSError
        found["error"] = repr(error)
        return found
    found["ok"] = found["metadata_versions"] == [version] and found["answered_version"] == version
    return found


def soak_reload(
    server: ServeProcess,
    served: Path,
    *,
    workers: int,
    watcher_timeout: float,
    infer_body: bytes,
) -> dict[str, Any]:
    """The reload half-way through a soak: publish a new version into ``served``, load it
    (``POST /admin/reload``, or through the watcher of a ``--workers`` server), then check
    what the server serves (:func:`served_after_reload`, under ``"serves"``). Never raises:
    ``ok`` is false when any step failed (``error`` then says why), which fails the soak
    (:func:`load_tests.memory.soak_problems`)."""
    started = time.time()
    try:
        if workers > 1:  # POST /admin/reload is refused: the watcher reloads
            result = reload_through_watcher(server, served, timeout=watcher_timeout)
        else:
            version = publish_new_version(served)
            answer = server.reload()
            result = {"ok": answer.get("version") == version, "published": version, **answer}
        result["seconds"] = round(time.time() - started, 3)
        result["serves"] = served_after_reload(
            server.http, server.model_name, str(result["published"]), infer_body
        )
    except Exception as error:  # reported in the summary; the verdict fails
        return {"ok": False, "error": repr(error)}
    result["ok"] = bool(result["ok"]) and bool(result["serves"]["ok"])
    return result


def watcher_reload_timeout(serve_args: list[str]) -> float:
    """Seconds the soak waits for a ``--workers`` server's watcher to serve a new version:
    120, plus two of its ``--watch-seconds`` looks (it looks only every that many seconds)."""
    return 120.0 + 2 * watch_seconds_of(serve_args)
