"""Embedding checkpoint format: safetensors per shard and dim, a JSON manifest, a done-marker.

Layout of an embedding checkpoint directory::

    embedding_manifest.json       format version, embedding config, shard count, optimizer,
                                  per-file row counts, byte sizes and SHA-256 checksums
    shard_00000/dim_16.safetensors   tensors ``ids`` (U64 [n]), ``weights`` (F32 [n, 16]),
                                     ``state`` (F32 [n, w]: the optimizer state of each row)
    shard_00001/...
    DONE                          written last: a directory without it is incomplete

Every file is written under a temporary name and renamed into place; a whole checkpoint made
in one process is assembled in a temporary directory and renamed as a unit, so a reader sees
either nothing or a complete checkpoint. Loading verifies the done-marker, the manifest, every
checksum and the config (slot dims and ID prefixes) *before* touching the running store, and
re-shards rows by :func:`embedding_store.hashing.shard_of` when the shard count differs.
No pickle anywhere: safetensors and JSON only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy

from embedding_store.config import (
    EmbeddingConfig,
    embedding_config_from_mapping,
    embedding_config_to_mapping,
)
from embedding_store.errors import (
    AlreadyExistsError,
    CheckpointError,
    InvalidArgumentError,
    RecserveError,
)
from embedding_store.hashing import shard_of
from embedding_store.optimizers import Optimizer, optimizer_from_dict
from embedding_store.shard import EmbeddingShard, RowBlock

log = logging.getLogger(__name__)

FORMAT_NAME = "recserve-embedding-checkpoint"
FORMAT_VERSION = 1
MANIFEST_NAME = "embedding_manifest.json"
DONE_MARKER = "DONE"
#: The most shards a checkpoint's manifest may name (far more than any tier runs).
MAX_SHARDS = 1 << 16

#: ``progress(rows_done, rows_total)``: called after each file of a dump or load (rows so far).
ProgressHook = Callable[[int, int], None]


@dataclass(frozen=True)
class FileEntry:
    """One safetensors file of a checkpoint: which shard and dim it holds, and its checksum."""

    shard: int
    dim: int
    path: str  # relative to the checkpoint directory
    rows: int
    state_width: int
    bytes: int
    sha256: str

    def __post_init__(self) -> None:
        """Types as a manifest must give them: a damaged manifest is named here, not by a
        TypeError further on."""
        for name in ("shard", "dim", "rows", "state_width", "bytes"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(
                    f"file entry {self.path!r}: {name} must be an integer >= 0, got {value!r}"
                )
        if type(self.path) is not str or not self.path:
            raise ValueError(f"file entry path must be a non-empty string, got {self.path!r}")
        if not is_sha256_hex(self.sha256):
            raise ValueError(
                f"file entry {self.path!r}: sha256 must be 64 hex digits, got {self.sha256!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def is_sha256_hex(value: object) -> bool:
    """Whether ``value`` is a SHA-256 digest as manifests write it: 64 lowercase hex digits."""
    return type(value) is str and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


@dataclass(frozen=True)
class EmbeddingManifest:
    """The parsed ``embedding_manifest.json`` of a checkpoint."""

    directory: Path
    format_version: int
    created_unix: float
    num_shards: int
    embedding_config: EmbeddingConfig
    optimizer: dict[str, Any] | None
    files: tuple[FileEntry, ...]
    #: Which checkpoint the rows are: a digest of its files (:func:`content_version`), kept
    #: by ``recserve checkpoint reshard``. Shards report the version they loaded.
    version: str = ""

    @property
    def total_rows(self) -> int:
        return sum(entry.rows for entry in self.files)

    def rows_per_shard(self) -> list[int]:
        counts = [0] * self.num_shards
        for entry in self.files:
            counts[entry.shard] += entry.rows
        return counts


#: Versions are short hex strings: what the manifest writes, shards report and logs name.
VERSION_CHARACTERS = 16


def content_version(entries: Sequence[FileEntry]) -> str:
    """A version for the checkpoint of ``entries``: a digest of its files' names and checksums.

    Two dumps of the same rows differ (safetensors writes its metadata in no fixed order), so
    it names a checkpoint, not row contents. Manifests written before versions existed get
    theirs the same way when read.
    """
    digest = hashlib.sha256()
    for entry in sorted(entries, key=lambda e: e.path):
        digest.update(f"{entry.path}\0{entry.sha256}\n".encode())
    return digest.hexdigest()[:VERSION_CHARACTERS]


def _is_version(value: object) -> bool:
    return (
        type(value) is str
        and 0 < len(value) <= 64
        and all(c in "0123456789abcdefghijklmnopqrstuvwxyz-_." for c in value)
    )


# --------------------------------------------------------------------------- writing
def _write_atomic(path: Path, payload: bytes) -> None:
    """Write ``payload`` to ``path`` via a temporary name, fsync, rename; CheckpointError
    naming ``path`` when it cannot be written (no temporary file is left behind)."""
    temporary = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
    try:
        with open(temporary, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except OSError as error:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise CheckpointError(f"cannot write {path}: {error.strerror or error}") from None


def shard_part_name(shard_index: int) -> str:
    """The directory that holds shard ``shard_index``'s files: ``shard_00003``."""
    return f"shard_{shard_index:05d}"


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
    for dim, block in blocks.items():
        payload = safetensors.numpy.save(
            {
                "ids": np.ascontiguousarray(block.ids, dtype=np.uint64),
                "weights": np.ascontiguousarray(block.weights, dtype=np.float32),
                "state": np.ascontiguousarray(block.state, dtype=np.float32),
            },
            metadata={"format": FORMAT_NAME, "shard": str(shard_index), "dim": str(dim)},
        )
        relative = f"{part.name}/dim_{dim}.safetensors"
        _write_atomic(root / relative, payload)
        entries.append(
            FileEntry(
                shard=shard_index,
                dim=dim,
                path=relative,
                rows=len(block.ids),
                state_width=int(block.state.shape[1]),
                bytes=len(payload),
                sha256=hashlib.sha256(payload).hexdigest(),
            )
        )
        rows_written += len(block.ids)
        if progress is not None:
            progress(rows_written, rows_total)
    return entries


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
    _write_atomic(root / MANIFEST_NAME, json.dumps(manifest, indent=2).encode())
    _write_atomic(root / DONE_MARKER, b"")


def publish_directory(
    staging: Path, target: Path, *, overwrite: bool, only_checkpoints: bool = True
) -> None:
    """Move a fully written ``staging`` directory to ``target`` by rename.

    An existing ``target`` is refused unless ``overwrite``; then it is renamed away first and
    removed only after the new one is in place. Only a checkpoint is ever replaced: a
    ``target`` that is not one (no ``DONE`` marker: any other directory, or a file) is
    refused, overwrite or not, since replacing it deletes it. ``only_checkpoints=False`` is
    for the one caller whose targets are parts of a checkpoint (``--dump-on-exit`` of one
    shard of several replaces its ``shard_XXXXX`` directory).

    When it cannot publish, ``staging`` is removed and ``target`` is as it was; a failed
    rename is a CheckpointError naming ``target`` and the system's reason.
    """
    try:
        if target.exists():
            check_target(target, overwrite=overwrite, only_checkpoints=only_checkpoints)
            if _exchange(staging, target):  # one atomic step: target is never missing
                shutil.rmtree(staging, ignore_errors=True)  # now the old checkpoint
            else:
                _replace_in_two_renames(staging, target)
        else:
            os.replace(staging, target)
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)  # never published: nothing to keep
        if isinstance(error, OSError):
            raise CheckpointError(
                f"cannot publish the checkpoint at {target}: {error.strerror or error}"
            ) from None
        raise
    _fsync_directory(target.parent)


def check_target(target: Path, *, overwrite: bool, only_checkpoints: bool = True) -> None:
    """AlreadyExistsError unless a checkpoint may be written to ``target``: it does not exist,
    is an empty directory, or (with ``overwrite``) is a checkpoint (a directory with
    ``DONE``). Replacing deletes the old directory, so nothing else is ever replaced. Writers
    call it before they start (not to lose a whole dump at the end), and
    :func:`publish_directory` again."""
    if not target.exists():
        return
    if target.is_dir() and not any(target.iterdir()):
        return  # e.g. made by `mkdir -p` first: nothing to lose
    is_checkpoint = target.is_dir() and (target / DONE_MARKER).is_file()
    if overwrite and only_checkpoints and not is_checkpoint:
        raise AlreadyExistsError(
            f"{target} exists and is not a recserve checkpoint (no {DONE_MARKER} marker): "
            "refusing to replace it; choose another directory"
        )
    if not overwrite:
        raise AlreadyExistsError(
            f"checkpoint directory {target} already exists; refusing to overwrite it "
            "(--overwrite, or overwrite=True, replaces it)"
        )


def _replace_in_two_renames(staging: Path, target: Path) -> None:
    """Where paths cannot be swapped atomically: ``target`` renamed away, ``staging`` renamed
    to it. A crash between the two leaves the old checkpoint at ``retired``, which
    read_manifest's error then names; a failed second rename puts it back."""
    retired = target.with_name(f"{RETIRED_PREFIX.format(name=target.name)}{uuid.uuid4().hex}")
    os.replace(target, retired)
    try:
        os.replace(staging, target)
    except BaseException:
        os.replace(retired, target)
        raise
    shutil.rmtree(retired, ignore_errors=True)


#: Name prefix of a checkpoint renamed away while a new one replaces it.
RETIRED_PREFIX = ".{name}.old-"
_RENAME_EXCHANGE = 2  # linux/fs.h


def _exchange(first: Path, second: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where the system
    or filesystem cannot, and nothing changed."""
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    result = renameat2(
        at_fdcwd, os.fsencode(first), at_fdcwd, os.fsencode(second), _RENAME_EXCHANGE
    )
    return result == 0


def _fsync_directory(directory: Path) -> None:
    """Make renames in ``directory`` durable (best effort where directories cannot be opened)."""
    try:
        handle = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        # Some filesystems (network mounts) refuse fsync on a directory: the rename stands,
        # only its durability across a power cut is then theirs to give.
        with contextlib.suppress(OSError):
            os.fsync(handle)
    finally:
        os.close(handle)


def interrupted_overwrite_hint(root: Path) -> str:
    """For a checkpoint directory that does not exist: where an interrupted overwrite left the
    previous checkpoint, as a sentence to add to the error (or "")."""
    prefix = RETIRED_PREFIX.format(name=root.name)
    try:
        left = sorted(p.name for p in root.parent.iterdir() if p.name.startswith(prefix))
    except OSError:
        return ""
    if not left:
        return ""
    return (
        f"; an interrupted overwrite left the previous checkpoint at {root.parent / left[-1]}: "
        f"rename it to {root.name} to use it"
    )


#: Name prefix of a dump's staging directory: ``.{name}.tmp-{host}-{pid}-{start}-{random}``,
#: ``start`` the writer's start time (clock ticks after boot, /proc/PID/stat): a PID alone
#: is reused, by PID 1 of every container restart first of all.
STAGING_PREFIX = ".{name}.tmp-"


def staging_directory_for(target: Path) -> Path:
    """A fresh temporary directory next to ``target`` (same filesystem, so rename is atomic).
    CheckpointError naming the target when it cannot be made there.

    Staging directories of earlier dumps to ``target`` that were killed are removed first
    when their writer ran on this host and is gone (their names say which process); others
    (another host's, or from before names said so) are named in a warning."""
    _sweep_interrupted_dumps(target)
    pid = os.getpid()
    staging = target.with_name(
        f"{STAGING_PREFIX.format(name=target.name)}"
        f"{socket.gethostname()}-{pid}-{_start_time(pid)}-{uuid.uuid4().hex}"
    )
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
    except OSError as error:
        raise CheckpointError(
            f"cannot write a checkpoint to {target}: {error.strerror or error}"
        ) from None
    return staging


def _sweep_interrupted_dumps(target: Path) -> None:
    prefix = STAGING_PREFIX.format(name=target.name)
    try:
        leftovers = [p for p in target.parent.iterdir() if p.name.startswith(prefix)]
    except OSError:
        return  # no parent yet, or unreadable: the mkdir that follows names the problem
    host = socket.gethostname()
    kept = []
    for path in leftovers:
        parts = path.name[len(prefix) :].rsplit("-", 3)  # host, pid, start, random
        if (
            len(parts) == 4
            and parts[0] == host
            and parts[1].isdigit()
            and _start_time(int(parts[1])) != parts[2]  # that process is gone
        ):
            shutil.rmtree(path, ignore_errors=True)
            log.info("removed %s, left by an interrupted dump (process %s is gone)", path, parts[1])
        else:
            kept.append(path.name)
    if kept:
        log.warning(
            "%s has staging directories of other dumps: %s (still running elsewhere, or "
            "interrupted: remove them when no dump to %s runs)",
            target.parent,
            ", ".join(sorted(kept)),
            target.name,
        )


def _start_time(pid: int) -> str:
    """When process ``pid`` started (clock ticks after boot), or "" when there is none (or
    no /proc to ask: then nothing is ever removed)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "" if Path("/proc/self/stat").exists() else "unknown"
    # The command name, in parentheses, may hold spaces: fields count after its ")".
    return stat.rpartition(")")[2].split()[19]


def dump_embeddings(
    shards: Sequence[EmbeddingShard],
    directory: str | os.PathLike,
    embedding_config: EmbeddingConfig,
    *,
    overwrite: bool = False,
) -> EmbeddingManifest:
    """Dump in-process shards (``shards[i]`` is replica i) as one checkpoint, atomically."""
    target = Path(directory)
    check_target(target, overwrite=overwrite)
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


# --------------------------------------------------------------------------- reading
def is_directory(path: Path) -> bool:
    """``path.is_dir()``, False for a path the system refuses to look at (too long)."""
    try:
        return path.is_dir()
    except OSError:
        return False


def read_manifest(directory: str | os.PathLike) -> EmbeddingManifest:
    """Parse and sanity-check a checkpoint's manifest (no checksums: see :func:`verify`)."""
    root = Path(directory)
    if not is_directory(root):
        raise CheckpointError(
            f"embedding checkpoint {root} does not exist or is not a directory"
            + interrupted_overwrite_hint(root)
        )
    if not (root / DONE_MARKER).exists():
        if not (root / MANIFEST_NAME).exists() and any(root.glob("shard_*")):
            raise CheckpointError(
                f"embedding checkpoint {root} holds shard parts but no {MANIFEST_NAME}: "
                "parts written by several parameter servers' --dump-on-exit are not a "
                "checkpoint; take one with `recserve embedding-tier dump`"
            )
        raise CheckpointError(
            f"embedding checkpoint {root} is incomplete: no {DONE_MARKER} marker "
            "(the dump did not finish)"
        )
    try:
        raw = json.loads((root / MANIFEST_NAME).read_text())
    except FileNotFoundError as error:
        hint = ""
        if (root / "embeddings" / MANIFEST_NAME).exists():
            hint = f": {root} is a model checkpoint; its embeddings are in {root / 'embeddings'}"
        raise CheckpointError(
            f"embedding checkpoint {root} has no {MANIFEST_NAME}{hint}"
        ) from error
    except (OSError, ValueError, RecursionError) as error:  # Recursion: nested too deep
        raise CheckpointError(f"{root / MANIFEST_NAME} is not valid JSON: {error}") from error
    if not isinstance(raw, dict):
        raise CheckpointError(
            f"{root / MANIFEST_NAME} is malformed: a JSON {type(raw).__name__}, not an object"
        )
    try:
        if raw.get("format") != FORMAT_NAME:
            raise CheckpointError(f"{root / MANIFEST_NAME} is not a {FORMAT_NAME} manifest")
        version = raw["format_version"]
        if version != FORMAT_VERSION:
            raise CheckpointError(
                f"{root} has checkpoint format version {version}; "
                f"this build reads version {FORMAT_VERSION}"
            )
        num_shards = raw["num_shards"]
        if type(num_shards) is not int or not 1 <= num_shards <= MAX_SHARDS:
            # Tools list the rows of every shard: 10**13 of them was a MemoryError.
            raise CheckpointError(
                f"{root / MANIFEST_NAME} is malformed: num_shards must be an integer in "
                f"1..{MAX_SHARDS}, got {num_shards!r}"
            )
        files = tuple(FileEntry(**entry) for entry in raw["files"])
        rows_version = raw.get("version", None)
        if rows_version is None:  # written before manifests held a version
            rows_version = content_version(files)
        elif not _is_version(rows_version):
            raise CheckpointError(
                f"{root / MANIFEST_NAME} is malformed: version must be 1 to 64 characters "
                f"of a-z, 0-9, '-', '_' and '.', got {rows_version!r}"
            )
        config = embedding_config_from_mapping(
            raw["embedding_config"], source=str(root / MANIFEST_NAME)
        )
        manifest = EmbeddingManifest(
            directory=root,
            format_version=version,
            created_unix=float(raw["created_unix"]),
            num_shards=num_shards,
            embedding_config=config,
            optimizer=raw.get("optimizer"),
            files=files,
            version=rows_version,
        )
    except RecserveError:
        raise
    except (KeyError, TypeError, ValueError, OverflowError) as error:  # int(Infinity)
        raise CheckpointError(f"{root / MANIFEST_NAME} is malformed: {error!r}") from error
    for entry in files:
        if not 0 <= entry.shard < num_shards:
            raise CheckpointError(
                f"{root / MANIFEST_NAME}: file {entry.path} names shard {entry.shard} "
                f"of {num_shards}"
            )
        if Path(entry.path).is_absolute() or ".." in Path(entry.path).parts:
            raise CheckpointError(f"{root / MANIFEST_NAME}: file path {entry.path!r} escapes it")
    return manifest


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


def _read_verified(manifest: EmbeddingManifest, entry: FileEntry) -> dict[str, np.ndarray]:
    """Read one file once, check size and SHA-256, decode it, and check its tensors."""
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
    _check_unique_ids(path, ids)
    return tensors


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
    """Check completeness and every checksum; raises CheckpointError naming the problem."""
    manifest = read_manifest(directory)
    for entry in manifest.files:
        _read_verified(manifest, entry)
    return manifest


def check_compatible(manifest: EmbeddingManifest, config: EmbeddingConfig) -> None:
    """Refuse a checkpoint whose slots would be read with other dims, other ID prefixes or
    other hash stacking."""
    saved = manifest.embedding_config
    problems = []
    for name in config.slot_names:
        if name not in saved.slots_config:
            continue  # a new slot starts empty
        if saved.slots_config[name].dim != config.slots_config[name].dim:
            problems.append(
                f"slot {name!r} has dim {saved.slots_config[name].dim} in the checkpoint "
                f"but {config.slots_config[name].dim} in the config"
            )
        elif saved.index_prefix(name) != config.index_prefix(name):
            problems.append(
                f"slot {name!r} has another ID prefix in the checkpoint (feature groups or "
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
                    f"{before.hash_stack_rounds}, embedding_size={before.embedding_size} in "
                    f"the checkpoint but hash_stack_rounds={after.hash_stack_rounds}, "
                    f"embedding_size={after.embedding_size} in the config"
                )
    if problems:
        raise CheckpointError(
            f"embedding checkpoint {manifest.directory} does not match the embedding config: "
            + "; ".join(problems)
        )


def count_rows_per_replica(manifest: EmbeddingManifest, replica_size: int) -> list[int]:
    """Rows each of ``replica_size`` replicas owns in this checkpoint: int [replica_size].

    Reads and verifies every file once, keeping only its IDs' owner counts, so at most one
    file is in memory: a re-shard can check every shard's capacity before it changes any."""
    counts = np.zeros(replica_size, dtype=np.int64)
    for entry in manifest.files:
        ids = _read_verified(manifest, entry)["ids"]
        counts += np.bincount(shard_of(ids, replica_size), minlength=replica_size)
    return [int(c) for c in counts]


def read_rows_for_replica(
    manifest: EmbeddingManifest,
    replica_index: int,
    replica_size: int,
    *,
    keep_state_of: Optimizer | None,
    progress: ProgressHook | None = None,
) -> list[RowBlock]:
    """Verified rows that replica ``replica_index`` of ``replica_size`` owns, per dim.

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
            _optimizer_summary(manifest.optimizer),
            _optimizer_summary(keep_state_of.to_dict()),
        )
    same_layout = manifest.num_shards == replica_size
    entries = [e for e in manifest.files if not same_layout or e.shard == replica_index]
    rows_total, rows_read = sum(e.rows for e in entries), 0
    by_dim: dict[int, list[RowBlock]] = {}
    for entry in entries:
        tensors = _read_verified(manifest, entry)
        ids = tensors["ids"]
        if same_layout:
            picked = slice(None)  # only this replica's own files were picked above
        else:
            picked = np.flatnonzero(shard_of(ids, replica_size) == replica_index)
        if keep_state:
            _check_saved_state(manifest, entry, tensors["state"], keep_state_of)
        state = tensors["state"][picked] if keep_state else None
        by_dim.setdefault(entry.dim, []).append(
            RowBlock(ids=ids[picked], weights=tensors["weights"][picked], state=state)
        )
        rows_read += entry.rows
        if progress is not None:
            progress(rows_read, rows_total)
    blocks = []
    for _dim, parts in sorted(by_dim.items()):
        states = [p.state for p in parts]
        blocks.append(
            RowBlock(
                ids=np.concatenate([p.ids for p in parts]),
                weights=np.concatenate([p.weights for p in parts]),
                state=None if any(s is None for s in states) else np.concatenate(states),
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


def _optimizer_summary(settings: dict[str, Any]) -> str:
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
        progress=progress,
    )
    _check_capacity(manifest, shard, blocks)
    if adopted is not None:
        shard.configure(optimizer=adopted)
    shard.replace_rows(blocks, checkpoint_version=manifest.version)
    return manifest


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
        blocks = read_rows_for_replica(manifest, index, len(shards), keep_state_of=shard.optimizer)
        _check_capacity(manifest, shard, blocks)
        staged.append(blocks)
    for shard, blocks in zip(shards, staged):
        shard.replace_rows(blocks, checkpoint_version=manifest.version)
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
