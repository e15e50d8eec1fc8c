"""Embedding checkpoint format: the directory layout, the manifest model and its reading.

Layout of an embedding checkpoint directory::

    embedding_manifest.json       format version, embedding config, shard count, optimizer,
                                  per-file row counts, byte sizes and SHA-256 checksums
    shard_00000/dim_16.safetensors   tensors ``ids`` (U64 [n]), ``weights`` (F32 [n, 16]),
                                     ``state`` (F32 [n, w]: the optimizer state of each row)
    shard_00001/...
    DONE                          written last: a directory without it is incomplete

:func:`read_manifest` parses and sanity-checks the manifest of a complete checkpoint (the
done-marker first); checking the files' checksums and contents is
:mod:`embedding_store.checkpoint_load`'s, writing them :mod:`embedding_store.checkpoint_dump`'s.
No pickle anywhere: safetensors and JSON only.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from embedding_store.config import EmbeddingConfig, embedding_config_from_mapping
from embedding_store.errors import CheckpointError, ConfigError, RecserveError

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


#: Name prefix of a checkpoint renamed away while a new one replaces it.
RETIRED_PREFIX = ".{name}.old-"


#: Name prefix of a dump's staging directory (see embedding_store.checkpoint_publish).
STAGING_PREFIX = ".{name}.tmp-"


def interrupted_overwrite_hint(root: Path) -> str:
    """For a checkpoint directory that does not exist: where an interrupted overwrite left the
    previous checkpoint, or else the staging directory of a dump to it that has not
    finished (a first run killed while it wrote its checkpoint: the hidden directory is
    all there is), as a sentence to add to the error (or "")."""
    retired = RETIRED_PREFIX.format(name=root.name)
    staging = STAGING_PREFIX.format(name=root.name)
    try:
        names = sorted(p.name for p in root.parent.iterdir() if p.is_dir())
    except OSError:
        return ""
    left = [name for name in names if name.startswith(retired)]
    if left:
        return (
            f"; an interrupted overwrite left the previous checkpoint at "
            f"{root.parent / left[-1]}: rename it to {root.name} to use it"
        )
    unfinished = [name for name in names if name.startswith(staging)]
    if unfinished:
        return (
            f"; a dump to it has not finished (still running, or killed): "
            f"{', '.join(unfinished)} in {root.parent} holds no complete checkpoint (the "
            f"next dump to {root.name} removes it once its writer is gone)"
        )
    return ""


def checkpoints_inside(root: Path, *, limit: int = 1000) -> list[Path]:
    """The finished checkpoints (a ``DONE`` marker) directly inside ``root``, by name; hidden
    ones (staging, retired copies) left out. For the error of a path given one level too
    high (``--checkpoint runs`` for ``runs/adult``); the first ``limit`` entries are looked
    at, so a huge directory costs little."""
    found = []
    try:
        for index, entry in enumerate(root.iterdir()):
            if index >= limit:
                break
            if not entry.name.startswith(".") and (entry / DONE_MARKER).is_file():
                found.append(entry)
    except OSError:
        return []
    return sorted(found)


def no_done_marker_message(root: Path, what: str, why: str) -> str:
    """The error for a directory without a ``DONE`` marker: ``"{what} {root} is incomplete:
    no DONE marker {why}"``, or, when it holds checkpoints, that it is not one and which
    ones it holds."""
    # A checkpoint that lost its marker is incomplete, whatever it holds (a model
    # checkpoint's embeddings/ has a DONE of its own): model_checkpoint's file names.
    own_files = (MANIFEST_NAME, "manifest.json", "jit_dense.pt")
    if any((root / n).exists() for n in own_files):
        return f"{what} {root} is incomplete: no {DONE_MARKER} marker{why}"
    inside = checkpoints_inside(root)
    if inside:
        names = ", ".join(str(p) for p in inside[:5]) + (", ..." if len(inside) > 5 else "")
        return (
            f"{root} is not a checkpoint (no {DONE_MARKER} marker) but a directory of them: "
            f"{names}; give one of them"
        )
    # One level further (`--checkpoint .` in the directory whose runs/ holds them): only
    # the first few subdirectories are looked into, so a big tree costs little.
    deeper = [
        found
        for sub in sorted(p for p in _subdirectories(root) if not p.name.startswith("."))[:20]
        for found in checkpoints_inside(sub, limit=200)
    ]
    if deeper:
        names = ", ".join(str(p) for p in deeper[:5]) + (", ..." if len(deeper) > 5 else "")
        return (
            f"{root} is not a checkpoint (no {DONE_MARKER} marker, no manifest); checkpoints "
            f"below it: {names}; give one of them"
        )
    return f"{what} {root} is incomplete: no {DONE_MARKER} marker{why}"


def _subdirectories(root: Path, limit: int = 1000) -> list[Path]:
    """The first ``limit`` entries of ``root`` that are directories ([] when unreadable)."""
    found = []
    try:
        for index, entry in enumerate(root.iterdir()):
            if index >= limit:
                break
            if entry.is_dir():
                found.append(entry)
    except OSError:
        return []
    return found


def is_directory(path: Path) -> bool:
    """``path.is_dir()``, False for a path the system refuses to look at (too long)."""
    try:
        return path.is_dir()
    except OSError:
        return False


def read_manifest(directory: str | os.PathLike) -> EmbeddingManifest:
    """Parse and sanity-check a checkpoint's manifest (no checksums: see
    :func:`embedding_store.checkpoint_load.verify`)."""
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
            no_done_marker_message(root, "embedding checkpoint", " (the dump did not finish)")
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
        optimizer = raw.get("optimizer")
        if optimizer is not None:
            # Writers put None or an optimizer's to_dict() here: anything else would fail
            # later, in whoever reads it (an AttributeError of state_fits, a ConfigError of
            # a shard adopting it), naming no file. Imported here, not at the top: optimizers
            # brings numba's ~0.3 s import, which this format module otherwise does without.
            from embedding_store.optimizers import optimizer_from_dict

            try:
                optimizer_from_dict(optimizer)
            except ConfigError as error:
                raise CheckpointError(
                    f"{root / MANIFEST_NAME} is malformed: {error.message}"
                ) from None
        manifest = EmbeddingManifest(
            directory=root,
            format_version=version,
            created_unix=float(raw["created_unix"]),
            num_shards=num_shards,
            embedding_config=config,
            optimizer=optimizer,
            files=files,
            version=rows_version,
        )
    except RecserveError:
        raise
    except (KeyError, TypeError, ValueError, OverflowError) as error:  # int(Infinity)
        raise CheckpointError(f"{root / MANIFEST_NAME} is malformed: {error!r}") from error
    listed: set[Path] = set()
    for entry in files:
        path = Path(entry.path)  # "a/./b" and "a//b" are "a/b"
        if path in listed:
            # Its rows would load twice: counted twice against a shard's capacity, and
            # written twice into one file by a re-shard, which no load then takes.
            raise CheckpointError(f"{root / MANIFEST_NAME}: file {entry.path} is listed twice")
        listed.add(path)
        if not 0 <= entry.shard < num_shards:
            raise CheckpointError(
                f"{root / MANIFEST_NAME}: file {entry.path} names shard {entry.shard} "
                f"of {num_shards}"
            )
        if path.is_absolute() or ".." in path.parts:
            raise CheckpointError(f"{root / MANIFEST_NAME}: file path {entry.path!r} escapes it")
    return manifest
