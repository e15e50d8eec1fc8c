"""What the offline checkpoint tools (``recserve checkpoint``) share: which kind a checkpoint
directory is, a *model checkpoint* (``manifest.json``, dense files, ``embeddings/``, ``DONE``;
:mod:`embedding_store.model_checkpoint`) or a bare *embedding checkpoint*
(``embedding_manifest.json``, per-shard safetensors, ``DONE``;
:mod:`embedding_store.checkpoint_manifest`),
where its embeddings lie, a verified read of one embedding file, the ID space of each row, and
the forward signature of a TorchScript module.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from embedding_store import checkpoint_load, checkpoint_manifest, model_checkpoint
from embedding_store.config import EmbeddingConfig
from embedding_store.errors import CheckpointError

__all__ = [
    "ALL_SPACES",
    "EMBEDDING",
    "MODEL",
    "checkpoint_kind",
    "embedding_dir_of",
    "forward_signature",
    "iso",
    "read_entry",
    "space_names",
]

MODEL = "model"
EMBEDDING = "embedding"
ALL_SPACES = "(all slots)"


def checkpoint_kind(directory: str | os.PathLike[str]) -> str:
    """``"model"`` or ``"embedding"``; CheckpointError when it is neither."""
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(
            f"checkpoint {root} does not exist or is not a directory"
            + checkpoint_manifest.interrupted_overwrite_hint(root)
        )
    if (root / model_checkpoint.MANIFEST_NAME).exists():
        return MODEL
    if (root / checkpoint_manifest.MANIFEST_NAME).exists():
        return EMBEDDING
    if any(root.glob("shard_*")):
        return EMBEDDING  # shard parts: the embedding reader says what they are
    if not (root / model_checkpoint.DONE_MARKER).exists():
        raise CheckpointError(
            checkpoint_manifest.no_done_marker_message(
                root, "checkpoint", " and no manifest (the write did not finish)"
            )
        )
    raise CheckpointError(
        f"{root} has neither {model_checkpoint.MANIFEST_NAME} (model checkpoint) nor "
        f"{checkpoint_manifest.MANIFEST_NAME} (embedding checkpoint)"
    )


def embedding_dir_of(directory: Path, kind: str) -> Path:
    return directory / model_checkpoint.EMBEDDINGS_DIR if kind == MODEL else directory


def iso(unix: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix))


def read_entry(
    manifest: checkpoint_manifest.EmbeddingManifest,
    entry: checkpoint_manifest.FileEntry,
    *,
    check_values: bool = True,
) -> dict[str, np.ndarray]:
    # embedding_store.checkpoint_load's own reader: size, SHA-256, safetensors and shapes
    # checked, and (check_values) no NaN or Inf weights, no NaN state.
    return checkpoint_load._read_verified(manifest, entry, check_values=check_values)


def space_names(config: EmbeddingConfig, ids: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """(ID-space index of each ID, the space names) from the config's ID prefixes."""
    bit = config.feature_index_prefix_bit
    if bit == 0:
        return np.zeros(len(ids), dtype=np.int64), [ALL_SPACES]
    prefix = (ids >> np.uint64(64 - bit)).astype(np.int64) - 1
    names = list(config.id_spaces)
    unknown = (prefix < 0) | (prefix >= len(names))
    if unknown.any():
        prefix = np.where(unknown, len(names), prefix)
        names.append("(unknown prefix)")
    return prefix, names


def forward_signature(module: Any) -> str | None:
    try:
        return str(module.forward.schema)
    except Exception:  # an unusual TorchScript module: the schema is informational only
        return None
