"""Reading verified embedding checkpoints and loading them into shards.

Loading verifies the done-marker, the manifest, every file's size and checksum, its tensors
(dtypes, shapes, distinct IDs, finite weights, no NaN optimizer state) and the config
(slot dims, ID prefixes and hash stacking) *before* touching the running store, and
re-shards rows by :func:`embedding_store.hashing.shard_of` when the shard count differs.
Saved optimizer state is kept only when it fits the receiving shard's optimizer.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import safetensors.numpy

from embedding_store import nonfinite
from embedding_store.checkpoint_manifest import (
    EmbeddingManifest,
    FileEntry,
    ProgressHook,
    read_manifest,
)
from embedding_store.config import EmbeddingConfig
from embedding_store.errors import CheckpointError, InvalidArgumentError
from embedding_store.hashing import shard_of
from embedding_store.optimizers import Optimizer, optimizer_from_dict
from embedding_store.shard import EmbeddingShard, RowBlock

log = logging.getLogger(__name__)


def _safetensors_metadata(payload: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file (its header: a little-endian u64 length,
    then JSON); empty when it has none."""
    size = int.from_bytes(payload[:8], "little")
    try:
        header = json.loads(payload[8 : 8 + size])
    except (ValueError, RecursionError):
        return {}
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    return metadata if isinstance(metadata, dict) else {}


def _read_verified(
    manifest: EmbeddingManifest, entry: FileEntry, *, check_values: bool = True
) -> dict[str, np.ndarray]:
    """Read one file once, check size and SHA-256, decode it, and check its tensors.

    ``check_values``: refuse NaN or Inf weights and NaN state (:func:`_check_finite`);
    only ``recserve checkpoint diff`` reads without, to show which rows went bad."""
    path = manifest.directory / entry.path
    try:
        payload = path.read_bytes()
    except OSError as error:
        raise CheckpointError(f"cannot read checkpoint file {path}: {error}") from error
    if len(payload) != entry.bytes:
        raise CheckpointError(
            f"checkpoint file {path} has {len(payload)} bytes; the manifest says {entry.bytes} "
            "(truncated or replaced)"
        )
    if hashlib.sha256(payload).hexdigest() != entry.sha256:
        raise CheckpointError(f"checkpoint file {path} is corrupt: SHA-256 mismatch")
    try:
        tensors = safetensors.numpy.load(payload)
    except Exception as error:  # safetensors raises its own error types
        raise CheckpointError(
            f"checkpoint file {path} is not valid safetensors: {error}"
        ) from error
    written_for = _safetensors_metadata(payload).get("shard")
    if written_for is not None and written_for != str(entry.shard):
        # Files swapped between shard directories (manifest entries to match) pass every
        # checksum; their rows would land on shards that never look them up.
        raise CheckpointError(
            f"checkpoint file {path} was written for shard {written_for}; the manifest lists "
            f"it for shard {entry.shard}"
        )
    ids, weights, state = (tensors.get(k) for k in ("ids", "weights", "state"))
    if (
        ids is None
        or weights is None
        or state is None
        or ids.dtype != np.uint64
        or weights.dtype != np.float32
        or state.dtype != np.float32
        or ids.shape != (entry.rows,)
        or weights.shape != (entry.rows, entry.dim)
        or state.shape != (entry.rows, entry.state_width)
    ):
        # Named here, with the file: a shard would refuse another dtype or an ids matrix
        # later, as a bad argument naming no file.
        raise CheckpointError(
            f"checkpoint file {path} does not hold ids (U64 [{entry.rows}]), weights (F32 "
            f"[{entry.rows}, {entry.dim}]) and state (F32 [{entry.rows}, {entry.state_width}]) "
            f"as its manifest says; it holds {_tensor_summary(tensors)}"
        )
    recency = tensors.get("recency")
    if recency is not None and (recency.dtype != np.int64 or recency.shape != (entry.rows,)):
        raise CheckpointError(
            f"checkpoint file {path} holds recency ({recency.dtype} {list(recency.shape)}); "
            f"it must be I64 [{entry.rows}], one per row"
        )
    if check_values:
        _check_finite(path, "weights", weights, ids, nan_only=False)
        # Optimizer state: NaN only. +Inf is an Adagrad accumulator past ~1.8e19, which its
        # kernel stores for a finite gradient (the row then stays as it is): check_state.
        _check_finite(path, "state", state, ids, nan_only=True)
    _check_unique_ids(path, ids)
    return tensors


def _check_finite(
    path: Path, name: str, values: np.ndarray, ids: np.ndarray, *, nan_only: bool
) -> None:
    """CheckpointError naming the file, the tensor, the first bad row's ID and value unless
    ``values`` (float32 [rows, width], the file's ``name`` tensor) holds no NaN or Inf (no
    NaN with ``nan_only``). Such a row would load and be served: every prediction that
    looks it up comes out NaN, blamed on the request. One pass in chunks (see
    :mod:`embedding_store.nonfinite`), cheap beside the SHA-256 of the same bytes."""
    first = nonfinite.first_bad_index(values, nan_only=nan_only)
    if first is None:
        return
    row = first // max(values.shape[1], 1)
    raise CheckpointError(
        f"checkpoint file {path} is corrupt: its {name} tensor holds "
        f"{nonfinite.describe(values.reshape(-1), first, values.shape, nan_only=nan_only)} "
        f"(the row of ID {int(ids[row])})"
    )


def _check_unique_ids(path: Path, ids: np.ndarray) -> None:
    """CheckpointError naming the file, its first repeated ID (in file order) and how many
    IDs it repeats, unless every ID of ``ids`` (uint64 [rows]: one file's, in file order) is
    distinct. A writer exports each row once; a repeat is a damaged or crafted file, whose
    later row would silently win in the shard (whose ``replace_rows`` tolerates repeats of
    in-memory blocks)."""
    if len(ids) < 2:
        return
    ordered = np.sort(ids)
    repeats = ordered[1:] == ordered[:-1]
    if not repeats.any():
        return
    # The error path only: which ID repeats first, and where.
    order = np.argsort(ids, kind="stable")
    repeated_rows = order[1:][repeats]  # stable: every row but the first of its ID
    second = int(repeated_rows.min())  # the first row that repeats an earlier ID
    first_id = ids[second]
    first = int(np.flatnonzero(ids == first_id)[0])
    # Distinct repeated IDs: runs of equal neighbours in the sorted IDs.
    duplicated = int(np.count_nonzero(repeats[1:] & ~repeats[:-1]) + repeats[0])
    raise CheckpointError(
        f"checkpoint file {path} holds duplicate IDs: {duplicated} "
        f"{'ID appears' if duplicated == 1 else 'IDs appear'} more than once, the first "
        f"being {int(first_id)} (rows {first} and {second}); each ID may appear only once "
        "per file"
    )


def _tensor_summary(tensors: dict[str, np.ndarray]) -> str:
    return ", ".join(
        f"{name} ({tensor.dtype} {list(tensor.shape)})" for name, tensor in sorted(tensors.items())
    )


def verify(directory: str | os.PathLike) -> EmbeddingManifest:
    """Check completeness, every checksum and every file's tensors (shapes, distinct IDs,
    finite weights, no NaN state); raises CheckpointError naming the problem."""
    manifest = read_manifest(directory)
    for entry in manifest.files:
        _read_verified(manifest, entry)
    return manifest


def check_compatible(manifest: EmbeddingManifest, config: EmbeddingConfig) -> None:
    """Refuse a checkpoint whose slots would be read with other dims, other ID prefixes or
    other hash stacking."""
    saved = manifest.embedding_config
    # A slot new in the config starts empty.
    shared = [name for name in config.slot_names if name in saved.slots_config]
    problems = slot_mismatches(saved, config, shared)
    if problems:
        raise CheckpointError(
            f"embedding checkpoint {manifest.directory} does not match the embedding config: "
            + "; ".join(problems)
        )


def slot_mismatches(
    saved: EmbeddingConfig,
    config: EmbeddingConfig,
    names: Sequence[str],
    *,
    saved_as: str = "in the checkpoint",
    config_as: str = "in the config",
) -> list[str]:
    """Why slots ``names`` (in both configs) would be read as other rows under ``config``
    than under ``saved``: another dim, ID prefix or hash stacking; [] when none would.
    ``saved_as`` / ``config_as`` say where each config comes from in the messages."""
    problems = []
    for name in names:
        if saved.slots_config[name].dim != config.slots_config[name].dim:
            problems.append(
                f"slot {name!r} has dim {saved.slots_config[name].dim} {saved_as} "
                f"but {config.slots_config[name].dim} {config_as}"
            )
        elif saved.index_prefix(name) != config.index_prefix(name):
            problems.append(
                f"slot {name!r} has another ID prefix {saved_as} (feature groups or "
                "feature_index_prefix_bit changed)"
            )
        else:
            before = saved.slots_config[name].hash_stack_config
            after = config.slots_config[name].hash_stack_config
            stacked = before.hash_stack_rounds > 0 or after.hash_stack_rounds > 0
            if stacked and (before.hash_stack_rounds, before.embedding_size) != (
                after.hash_stack_rounds,
                after.embedding_size,
            ):
                # Hash stacking maps IDs to rows: other settings would read other rows.
                problems.append(
                    f"slot {name!r} has hash_stack_config hash_stack_rounds="
                    f"{before.hash_stack_rounds}, embedding_size={before.embedding_size} "
                    f"{saved_as} but hash_stack_rounds={after.hash_stack_rounds}, "
                    f"embedding_size={after.embedding_size} {config_as}"
                )
    return problems


def count_rows_per_replica(
    manifest: EmbeddingManifest,
    replica_size: int,
    receivers: Sequence[Optimizer | None] | None = None,
) -> list[int]:
    """Rows each of ``replica_size`` replicas owns in this checkpoint: int [replica_size].

    Reads and verifies every file once, keeping only its IDs' owner counts, so at most one
    file is in memory: a re-shard can check every shard's capacity before it changes any.
    ``receivers`` (optional, one per replica: the optimizer whose state its load keeps, as
    ``keep_state_of`` of :func:`read_rows_for_replica`): the saved state each replica would
    keep is checked too, as its own load checks it, so that no shard refuses its part
    (negative accumulators, say) after others took theirs."""
    counts = np.zeros(replica_size, dtype=np.int64)
    keeping = [r if state_fits(manifest, r) else None for r in receivers or ()]
    same_layout = manifest.num_shards == replica_size
    for entry in manifest.files:
        tensors = _read_verified(manifest, entry)
        counts += np.bincount(shard_of(tensors["ids"], replica_size), minlength=replica_size)
        readers = keeping[entry.shard : entry.shard + 1] if same_layout else keeping
        # check_state depends on the optimizer's kind only (state_fits matched the widths)
        for kind in {type(r): r for r in readers if r is not None}.values():
            _check_saved_state(manifest, entry, tensors["state"], kind)
    return [int(c) for c in counts]


def read_rows_for_replica(
    manifest: EmbeddingManifest,
    replica_index: int,
    replica_size: int,
    *,
    keep_state_of: Optimizer | None,
    keep_recency: bool = True,
    progress: ProgressHook | None = None,
) -> list[RowBlock]:
    """Verified rows that replica ``replica_index`` of ``replica_size`` owns, per dim.

    ``keep_recency``: keep the rows' saved LRU ``recency`` (when the files have it); a
    read-only shard never evicts, and leaves it out (8 bytes per row while loading).

    ``keep_state_of``: the optimizer of the receiving shard. The saved optimizer state is kept
    only when it fits that optimizer (see :func:`state_fits`), else it is dropped (None rows
    state) and the shard initializes it. ``progress(rows_read, rows_total)`` is
    called after each file read, counting the rows of the files this replica reads: its own
    files when the shard count is the same, every file when the rows are re-sharded.
    """
    keep_state = state_fits(manifest, keep_state_of)
    if not keep_state and keep_state_of is not None and manifest.optimizer:
        # Every row then starts its optimizer again (Adam's step counts from 0): a resumed
        # run trains differently. Allowed (a deliberate switch), but never silent.
        log.warning(
            "embedding checkpoint %s holds state of optimizer %s, which does not fit this "
            "shard's %s: the rows load, their optimizer state starts fresh",
            manifest.directory,
            optimizer_summary(manifest.optimizer),
            optimizer_summary(keep_state_of.to_dict()),
        )
    same_layout = manifest.num_shards == replica_size
    entries = [e for e in manifest.files if not same_layout or e.shard == replica_index]
    rows_total, rows_read = sum(e.rows for e in entries), 0
    by_dim: dict[int, list[RowBlock]] = {}
    for entry in entries:
        tensors = _read_verified(manifest, entry)
        ids = tensors["ids"]
        picked: slice | np.ndarray
        if same_layout:
            picked = slice(None)  # only this replica's own files were picked above
        else:
            picked = np.flatnonzero(shard_of(ids, replica_size) == replica_index)
        if keep_state:
            assert keep_state_of is not None  # state_fits is False without a receiver
            _check_saved_state(manifest, entry, tensors["state"], keep_state_of)
        state = tensors["state"][picked] if keep_state else None
        recency = tensors.get("recency") if keep_recency else None
        by_dim.setdefault(entry.dim, []).append(
            RowBlock(
                ids=ids[picked],
                weights=tensors["weights"][picked],
                state=state,
                recency=None if recency is None else recency[picked],
            )
        )
        rows_read += entry.rows
        if progress is not None:
            progress(rows_read, rows_total)
    blocks = []
    for _dim, parts in sorted(by_dim.items()):
        states = [p.state for p in parts]
        recencies = [p.recency for p in parts]
        blocks.append(
            RowBlock(
                ids=np.concatenate([p.ids for p in parts]),
                weights=np.concatenate([p.weights for p in parts]),
                state=None
                if any(s is None for s in states)
                else np.concatenate(cast("list[np.ndarray]", states)),  # no None: checked
                # Re-sharded, the old shards' orders interleave by rank (ties: shard order).
                recency=None
                if any(r is None for r in recencies)
                else np.concatenate(cast("list[np.ndarray]", recencies)),
            )
        )
    return blocks


def _check_saved_state(
    manifest: EmbeddingManifest, entry: FileEntry, state: np.ndarray, receiver: Optimizer
) -> None:
    """CheckpointError naming the file unless ``state`` (its optimizer state, kept for
    ``receiver``) is state ``receiver`` can update (no negative accumulator or second
    moment). Checked while reading, as every other property of the files: the shard would
    refuse it only in ``replace_rows``, after other shards had taken their rows or a shard
    had adopted the checkpoint's optimizer, and as a bad argument naming no file."""
    try:
        receiver.check_state(state, entry.dim)
    except InvalidArgumentError as error:
        path = manifest.directory / entry.path
        raise CheckpointError(f"checkpoint file {path}: {error.message}") from None


def optimizer_summary(settings: dict[str, Any]) -> str:
    """``adagrad (vectorwise_shared)`` or ``adam``: what makes two optimizers' state differ."""
    shared = " (vectorwise_shared)" if settings.get("vectorwise_shared") else ""
    return f"{settings.get('name', '?')}{shared}"


def state_fits(manifest: EmbeddingManifest, receiver: Optimizer | None) -> bool:
    """Whether the checkpoint's optimizer state can be given to ``receiver``: it was written
    by an optimizer of the same kind, and every file's state has the width ``receiver`` keeps
    for its dim (Adagrad with and without ``vectorwise_shared`` differ). Hyperparameters such
    as the learning rate may differ: a resumed run may change them and keep its state."""
    if receiver is None or not manifest.optimizer:
        return False
    if manifest.optimizer.get("name") != receiver.name:
        return False
    return all(entry.state_width == receiver.state_width(entry.dim) for entry in manifest.files)


def load_into_shard(
    directory: str | os.PathLike,
    shard: EmbeddingShard,
    embedding_config: EmbeddingConfig,
    *,
    replica_index: int,
    replica_size: int,
    adopt_optimizer: bool = False,
    progress: ProgressHook | None = None,
) -> EmbeddingManifest:
    """Replace ``shard``'s rows with its part of a checkpoint; on any error it is unchanged.

    ``adopt_optimizer``: a shard without an optimizer takes the checkpoint's (when it names
    one) together with the saved optimizer state, as a restarted training shard resumes; it
    is configured only once every file is read and verified. ``progress``: see
    :func:`read_rows_for_replica`.
    """
    manifest = read_manifest(directory)
    check_compatible(manifest, embedding_config)
    adopted = optimizer_of(manifest) if adopt_optimizer and shard.optimizer is None else None
    receiver = adopted or shard.optimizer
    blocks = read_rows_for_replica(
        manifest,
        replica_index,
        replica_size,
        keep_state_of=receiver,
        keep_recency=not shard.read_only,
        progress=progress,
    )
    _check_capacity(manifest, shard, blocks)
    # The optimizer is adopted (and the saved state checked against the shard's) at the
    # swap, under the shard's lock: a Configure that arrived while the files were read (a
    # trainer starting while a restarted shard loads) is kept, never replaced by the
    # checkpoint's optimizer.
    shard.replace_rows(
        blocks,
        checkpoint_version=manifest.version,
        state_of=receiver,
        adopt=adopted is not None,
    )
    _note_configured_meanwhile(manifest, shard, receiver)
    return manifest


def _note_configured_meanwhile(
    manifest: EmbeddingManifest, shard: EmbeddingShard, receiver: Optimizer | None
) -> None:
    """Log when the shard was configured with another optimizer while ``manifest``'s rows
    were read for ``receiver``: it keeps that one, and the saved state only where it fits."""
    current = shard.optimizer
    if receiver is None or current is None or current == receiver:
        return
    log.warning(
        "embedding shard configured with %s while checkpoint %s loaded (read for %s): it "
        "keeps that optimizer; rows whose saved state does not fit it start it fresh",
        json.dumps(current.to_dict(), sort_keys=True),
        manifest.directory,
        json.dumps(receiver.to_dict(), sort_keys=True),
    )


def load_embeddings(
    directory: str | os.PathLike,
    shards: Sequence[EmbeddingShard],
    embedding_config: EmbeddingConfig,
) -> EmbeddingManifest:
    """Load a checkpoint into in-process shards (``shards[i]`` is replica i of len(shards)).

    Every shard's rows are read and verified before any shard changes.
    """
    manifest = read_manifest(directory)
    check_compatible(manifest, embedding_config)
    staged = []
    for index, shard in enumerate(shards):
        blocks = read_rows_for_replica(
            manifest,
            index,
            len(shards),
            keep_state_of=shard.optimizer,
            keep_recency=not shard.read_only,
        )
        _check_capacity(manifest, shard, blocks)
        staged.append((blocks, shard.optimizer))
    for shard, (blocks, receiver) in zip(shards, staged):
        shard.replace_rows(blocks, checkpoint_version=manifest.version, state_of=receiver)
    return manifest


def _check_capacity(
    manifest: EmbeddingManifest, shard: EmbeddingShard, blocks: list[RowBlock]
) -> None:
    rows = sum(len(b.ids) for b in blocks)
    if rows > shard.capacity:
        raise CheckpointError(
            f"embedding checkpoint {manifest.directory} gives this shard {rows} rows, "
            f"more than its capacity {shard.capacity}; raise capacity or add shards"
        )


def optimizer_of(manifest: EmbeddingManifest) -> Optimizer | None:
    """The optimizer the checkpoint was trained with, or None."""
    return optimizer_from_dict(manifest.optimizer) if manifest.optimizer else None
