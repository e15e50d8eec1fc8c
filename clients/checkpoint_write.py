"""``recserve checkpoint reshard|export-dense``: the checkpoint tools that write.

``reshard`` rewrites the embedding part with another number of shards (dense files copied,
same version); ``export-dense`` copies ``jit_dense.pt`` out. Both refuse an existing target
unless ``overwrite``, and write under a temporary name next to it that is renamed into place
only when complete, so no reader ever sees a partial checkpoint or file. Everything read is
checked against the manifests' sizes and SHA-256 checksums first.

``reshard`` reads embedding rows into memory one target shard at a time: plan memory for
tables of that size.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy

from clients import eval_report
from clients.checkpoint_common import EMBEDDING, embedding_dir_of, forward_signature, iso
from clients.checkpoint_inspect import require_verified
from embedding_store import (
    checkpoint_dump,
    checkpoint_load,
    checkpoint_manifest,
    checkpoint_publish,
    model_checkpoint,
)
from embedding_store.checkpoint_manifest import MAX_SHARDS
from embedding_store.errors import AlreadyExistsError, CheckpointError, InvalidArgumentError

__all__ = ["export_dense", "reshard"]


# --------------------------------------------------------------------------- reshard
def _write_resharded_embeddings(
    source: checkpoint_manifest.EmbeddingManifest, target: Path, shards: int
) -> checkpoint_manifest.EmbeddingManifest:
    """Write ``source``'s rows as ``shards`` shards into directory ``target`` (which exists)."""
    saved_optimizer = checkpoint_load.optimizer_of(source)  # its state is kept as saved
    entries = []
    for shard in range(shards):
        blocks = checkpoint_load.read_rows_for_replica(
            source, shard, shards, keep_state_of=saved_optimizer
        )
        part = target / f"shard_{shard:05d}"
        part.mkdir(parents=True, exist_ok=True)
        for block in blocks:
            n = len(block.ids)
            if n == 0:
                continue
            state = block.state if block.state is not None else np.zeros((n, 0), np.float32)
            payload = safetensors.numpy.save(
                checkpoint_dump.row_tensors(block.ids, block.weights, state, block.recency),
                metadata={
                    "format": checkpoint_manifest.FORMAT_NAME,
                    "shard": str(shard),
                    "dim": str(block.dim),
                },
            )
            relative = f"{part.name}/dim_{block.dim}.safetensors"
            checkpoint_publish.write_atomic(target / relative, payload)
            entries.append(
                checkpoint_manifest.FileEntry(
                    shard=shard,
                    dim=block.dim,
                    path=relative,
                    rows=n,
                    state_width=int(state.shape[1]),
                    bytes=len(payload),
                    sha256=hashlib.sha256(payload).hexdigest(),
                )
            )
    checkpoint_dump.finalize_checkpoint(
        target,
        source.embedding_config,
        shards,
        entries,
        source.optimizer,
        version=source.version,  # the same rows, sharded otherwise
    )
    return checkpoint_manifest.read_manifest(target)


def reshard(
    directory: str | os.PathLike[str],
    shards: int,
    out: str | os.PathLike[str],
    *,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Rewrite the embedding part with ``shards`` shards into ``out`` (dense files copied,
    same version); the source is verified first and ``out`` appears complete or not at all."""
    if isinstance(shards, bool) or not isinstance(shards, int) or not 1 <= shards <= MAX_SHARDS:
        # Above MAX_SHARDS it wrote for hours a checkpoint whose manifest no reader takes.
        raise InvalidArgumentError(
            f"--shards must be an integer in 1..{MAX_SHARDS}, got {shards!r}"
        )
    root, target = Path(directory), Path(out).resolve()
    if target == root.resolve() or root.resolve() in target.parents:
        raise InvalidArgumentError(f"--out {out} must not be {directory} or inside it")
    checkpoint_publish.check_target(target, overwrite=overwrite)
    summary = require_verified(root)
    kind = summary["kind"]
    source = checkpoint_manifest.read_manifest(embedding_dir_of(root, kind))
    staging = checkpoint_publish.staging_directory_for(target)
    try:
        if kind == EMBEDDING:
            written = _write_resharded_embeddings(source, staging, shards)
        else:
            manifest = model_checkpoint.read_manifest(root)
            (staging / model_checkpoint.EMBEDDINGS_DIR).mkdir()
            written = _write_resharded_embeddings(
                source, staging / model_checkpoint.EMBEDDINGS_DIR, shards
            )
            for name in manifest.files:
                payload = model_checkpoint.read_verified_file(manifest, name)
                checkpoint_publish.write_atomic(staging / name, payload)
            raw = json.loads((root / model_checkpoint.MANIFEST_NAME).read_text())
            raw["embeddings"] = {
                **raw.get("embeddings", {}),
                "rows": written.total_rows,
                "shards": written.num_shards,
            }
            raw["resharded"] = {"from_shards": source.num_shards, "at": iso(time.time())}
            checkpoint_publish.write_atomic(
                staging / model_checkpoint.MANIFEST_NAME, json.dumps(raw, indent=2).encode()
            )
            checkpoint_publish.write_atomic(staging / model_checkpoint.DONE_MARKER, b"")
        if written.total_rows != source.total_rows:
            raise CheckpointError(
                f"resharding lost rows: {source.total_rows} in, {written.total_rows} out"
            )
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    checkpoint_publish.publish_directory(staging, target, overwrite=overwrite)
    return {
        "path": str(target),
        "kind": kind,
        "version": summary.get("version"),
        "rows": written.total_rows,
        "from_shards": source.num_shards,
        "shards": shards,
        "rows_per_shard": written.rows_per_shard(),
    }


# --------------------------------------------------------------------------- export-dense
def export_dense(
    directory: str | os.PathLike[str], out: str | os.PathLike[str], *, overwrite: bool = False
) -> dict[str, Any]:
    """Copy ``jit_dense.pt`` (verified against the manifest and loadable) to ``out``, which
    must not be inside the checkpoint (with ``overwrite``, ``DIR/dense.pt`` used to replace
    the checkpoint's own file, which then failed verification and no longer loaded)."""
    target = Path(out)
    if Path(directory).resolve() in target.resolve().parents:
        raise InvalidArgumentError(
            f"--out {out} must not be inside the checkpoint {directory}: write the copy elsewhere"
        )
    if target.exists() and not overwrite:
        raise AlreadyExistsError(f"{target} already exists; pass --overwrite to replace it")
    if target.is_dir():
        raise InvalidArgumentError(f"--out {target} is a directory; give a file name")
    manifest = model_checkpoint.read_manifest(Path(directory))
    if not manifest.has_jit_model:
        raise CheckpointError(
            f"checkpoint {manifest.directory} has no {model_checkpoint.JIT_FILE} "
            "(dumped with with_jit_model=False)"
        )
    payload = model_checkpoint.read_verified_file(manifest, model_checkpoint.JIT_FILE)
    module = model_checkpoint.load_jit_model(manifest)
    digest = hashlib.sha256(payload).hexdigest()
    with eval_report.atomic_file(target, overwrite=overwrite) as temporary:
        with open(temporary, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        written = temporary.read_bytes()
        if hashlib.sha256(written).hexdigest() != digest:
            raise CheckpointError(f"{target}: the written copy does not match its checksum")
        _check_loadable(written, target)
    return {
        "path": str(target),
        "bytes": len(payload),
        "sha256": digest,
        "version": manifest.version,
        "forward_signature": forward_signature(module),
    }


def _check_loadable(payload: bytes, target: Path) -> None:
    import torch

    try:
        model_checkpoint._quiet_jit(torch.jit.load, io.BytesIO(payload), map_location="cpu")
    except Exception as error:
        raise CheckpointError(f"{target}: the copy is not loadable TorchScript: {error}") from None
