"""Writing embedding checkpoints: shard parts, the manifest, and whole in-process dumps.

A shard writes its rows into a part directory (:func:`write_shard_part`: one safetensors
file per dim), then the manifest and the done-marker are written last
(:func:`finalize_checkpoint`). :func:`dump_embeddings` does both for in-process shards in a
staging directory and publishes it as a unit (:mod:`embedding_store.checkpoint_publish`).

Rows no load would take (NaN or Inf weights, NaN optimizer state: what
:mod:`embedding_store.checkpoint_load` refuses) are refused here, before their file is
written, by each shard for its own rows: a part that fails leaves nothing, so its dump is
never finalized and never replaces the checkpoint already at its target.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy

from embedding_store import nonfinite
from embedding_store.checkpoint_manifest import (
    DONE_MARKER,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    EmbeddingManifest,
    FileEntry,
    ProgressHook,
    content_version,
    read_manifest,
)
from embedding_store.checkpoint_publish import (
    check_embedding_target,
    publish_directory,
    staging_directory_for,
    write_atomic,
)
from embedding_store.config import EmbeddingConfig, embedding_config_to_mapping
from embedding_store.errors import AlreadyExistsError, CheckpointError
from embedding_store.shard import EmbeddingShard


def shard_part_name(shard_index: int) -> str:
    """The directory that holds shard ``shard_index``'s files: ``shard_00003``."""
    return f"shard_{shard_index:05d}"


def row_tensors(
    ids: np.ndarray, weights: np.ndarray, state: np.ndarray, recency: np.ndarray | None
) -> dict[str, np.ndarray]:
    """The tensors of one embedding file: ``ids`` uint64 [n], ``weights`` float32 [n, dim],
    ``state`` float32 [n, w] and, when known, ``recency`` int64 [n] (each row's place in its
    shard's least-recently-used order over all dims, which a load restores; readers that
    predate it ignore it)."""
    tensors: dict[str, np.ndarray] = {
        "ids": np.ascontiguousarray(ids, dtype=np.uint64),
        "weights": np.ascontiguousarray(weights, dtype=np.float32),
        "state": np.ascontiguousarray(state, dtype=np.float32),
    }
    if recency is not None:
        tensors["recency"] = np.ascontiguousarray(recency, dtype=np.int64)
    return tensors


def write_shard_part(
    shard: EmbeddingShard,
    directory: str | os.PathLike,
    shard_index: int,
    *,
    progress: ProgressHook | None = None,
) -> list[FileEntry]:
    """Write one shard's rows into ``directory/shard_{index:05d}/``; returns the file entries.

    Used by :func:`dump_embeddings`, and by each parameter-server process when a dump spans
    processes (the caller then writes the manifest with :func:`finalize_checkpoint`).
    ``progress(rows_written, rows_total)`` is called after each file (one per dim). The rows
    are copied at one instant (:meth:`EmbeddingShard.export_all`): training may go on
    meanwhile, and the part holds the shard as it was then.

    CheckpointError naming the shard, the dim, the first bad value and its row's ID when
    the rows hold NaN or Inf weights or NaN optimizer state (:data:`CHECKED_ROW_TENSORS`),
    which every load refuses: checked while each file is hashed
    (:func:`digest_and_check_rows`), before it is written; the part directory is then
    removed with what it held, and the caller publishes nothing.
    """
    root = Path(directory)
    part = root / shard_part_name(shard_index)
    # Only into a new directory (a dump's staging one): never over a published checkpoint,
    # whose files would change under its manifest (only a whole new checkpoint replaces one,
    # with overwrite), nor over another dump's part.
    if (root / DONE_MARKER).exists():
        raise AlreadyExistsError(
            f"{root} is a published checkpoint (it has {DONE_MARKER}): a shard writes its "
            "part only into a new directory"
        )
    part.mkdir(parents=True, exist_ok=True)
    if any(part.iterdir()):
        raise AlreadyExistsError(f"{part} already holds files: a shard writes only a new part")
    entries = []
    blocks = shard.export_all()  # one instant, so never more rows than the capacity
    rows_total, rows_written = sum(len(block.ids) for block in blocks.values()), 0
    try:
        for dim, block in blocks.items():
            assert block.state is not None  # export_all copies every row's state (width >= 0)
            tensors = row_tensors(block.ids, block.weights, block.state, block.recency)
            payload = safetensors.numpy.save(
                tensors,
                metadata={"format": FORMAT_NAME, "shard": str(shard_index), "dim": str(dim)},
            )
            digest, bad = digest_and_check_rows(payload)
            if bad is not None:
                raise _unloadable_rows_error(shard_index, dim, bad, tensors)
            relative = f"{part.name}/dim_{dim}.safetensors"
            write_atomic(root / relative, payload)
            entries.append(
                FileEntry(
                    shard=shard_index,
                    dim=dim,
                    path=relative,
                    rows=len(block.ids),
                    state_width=int(block.state.shape[1]),
                    bytes=len(payload),
                    sha256=digest,
                )
            )
            rows_written += len(block.ids)
            if progress is not None:
                progress(rows_written, rows_total)
    except BaseException:
        shutil.rmtree(part, ignore_errors=True)  # no part that looks written but is not
        raise
    return entries


#: The tensors of an embedding file that a load checks, and whether only NaN is refused
#: (optimizer state: an Adagrad accumulator may be +Inf, which its kernel stores) or NaN and
#: +-Inf (weights), as :func:`embedding_store.checkpoint_load._read_verified` does.
CHECKED_ROW_TENSORS = {"weights": False, "state": True}


def digest_and_check_rows(payload: bytes) -> tuple[str, str | None]:
    """The SHA-256 (hex) of ``payload`` (a safetensors file of :func:`row_tensors`) and the
    name of the first of its :data:`CHECKED_ROW_TENSORS` (in that order) that holds a value a
    load refuses, or None.

    One pass: the bytes are hashed in chunks of :data:`nonfinite.CHUNK` float32 values, and
    each chunk of a checked tensor is checked (:func:`nonfinite.first_bad_index`) as it is
    hashed, while it is in cache. The table has been read by the copy and the serialization
    already; a pass of its own over it would read it from memory once more."""
    header_size = int.from_bytes(payload[:8], "little")
    header = json.loads(payload[8 : 8 + header_size])
    base = 8 + header_size  # data_offsets count from the end of the header
    regions = []
    for name, nan_only in CHECKED_ROW_TENSORS.items():
        if name in header:
            start, end = header[name]["data_offsets"]
            assert header[name]["dtype"] == "F32"  # row_tensors writes float32 only
            regions.append((base + start, base + end, name, nan_only))
    step = nonfinite.CHUNK * 4  # bytes; a multiple of 4, so chunks split no float32
    digest = hashlib.sha256()
    view = memoryview(payload)
    bad: set[str] = set()
    for start in range(0, len(payload), step):
        end = min(start + step, len(payload))
        digest.update(view[start:end])
        for first, last, name, nan_only in regions:
            # Offsets of float32 data and chunk bounds are multiples of 4: whole values.
            low, high = max(first, start), min(last, end)
            if low < high and name not in bad:
                values = np.frombuffer(payload, np.float32, (high - low) // 4, low)
                if nonfinite.first_bad_index(values, nan_only=nan_only) is not None:
                    bad.add(name)
    # The weights first when both are bad, as a load names them.
    return digest.hexdigest(), next((n for n in CHECKED_ROW_TENSORS if n in bad), None)


def _unloadable_rows_error(
    shard_index: int, dim: int, name: str, tensors: dict[str, np.ndarray]
) -> CheckpointError:
    """The error for rows of shard ``shard_index`` (``tensors``: the file of ``dim``) whose
    tensor ``name`` holds values a load refuses. The error path only: it searches the
    tensor again for the first bad value and its row."""
    values, nan_only = tensors[name], CHECKED_ROW_TENSORS[name]
    first = nonfinite.first_bad_index(values, nan_only=nan_only)
    assert first is not None  # digest_and_check_rows found one
    row = first // max(values.shape[1], 1)
    what = "weights" if name == "weights" else "optimizer state"
    return CheckpointError(
        f"embedding shard {shard_index} cannot be dumped: the {what} of its rows of dim {dim} "
        f"hold {nonfinite.describe(values.reshape(-1), first, values.shape, nan_only=nan_only)} "
        f"(the row of ID {int(tensors['ids'][row])}). {nonfinite.NOT_WRITTEN}"
    )


def finalize_checkpoint(
    directory: str | os.PathLike,
    embedding_config: EmbeddingConfig,
    num_shards: int,
    entries: Sequence[FileEntry],
    optimizer: dict[str, Any] | None,
    *,
    version: str | None = None,
) -> None:
    """Write the manifest, then the done-marker (last, so its presence means complete).

    ``version``: the rows' version (:attr:`EmbeddingManifest.version`); by default
    :func:`content_version` of ``entries``. A re-sharded copy passes its source's.
    """
    root = Path(directory)
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "version": version or content_version(entries),
        "created_unix": time.time(),
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "num_shards": num_shards,
        "embedding_config": embedding_config_to_mapping(embedding_config),
        "optimizer": optimizer,
        "files": [entry.to_dict() for entry in sorted(entries, key=lambda e: (e.shard, e.dim))],
    }
    write_atomic(root / MANIFEST_NAME, json.dumps(manifest, indent=2).encode())
    write_atomic(root / DONE_MARKER, b"")


def dump_embeddings(
    shards: Sequence[EmbeddingShard],
    directory: str | os.PathLike,
    embedding_config: EmbeddingConfig,
    *,
    overwrite: bool = False,
) -> EmbeddingManifest:
    """Dump in-process shards (``shards[i]`` is replica i) as one checkpoint, atomically."""
    target = Path(directory)
    check_embedding_target(target, overwrite=overwrite)
    staging = staging_directory_for(target)
    try:
        entries: list[FileEntry] = []
        for index, shard in enumerate(shards):
            entries.extend(write_shard_part(shard, staging, index))
        optimizer = shards[0].optimizer.to_dict() if shards[0].optimizer else None
        finalize_checkpoint(staging, embedding_config, len(shards), entries, optimizer)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    publish_directory(staging, target, overwrite=overwrite)
    return read_manifest(target)
