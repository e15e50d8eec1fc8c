"""Atomic publishing of checkpoints: files and whole directories appear complete or not at all.

Every file is written under a temporary name, fsynced and renamed into place
(:func:`write_atomic`); a whole checkpoint made in one process is assembled in a staging
directory next to its target (:func:`staging_directory_for`) and renamed as a unit
(:func:`publish_directory`), so a reader sees either nothing or a complete checkpoint. An
existing checkpoint is replaced only with overwrite, by one atomic exchange where the system
can, else by two renames. Staging directories left by killed dumps are swept on the next dump
to the same target.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import uuid
from pathlib import Path

from embedding_store.checkpoint_manifest import DONE_MARKER, RETIRED_PREFIX, STAGING_PREFIX
from embedding_store.errors import AlreadyExistsError, CheckpointError

log = logging.getLogger(__name__)


def write_atomic(path: Path, payload: bytes) -> None:
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


#: What only a model checkpoint (:mod:`embedding_store.model_checkpoint`) holds at its top
#: level: its manifest and dense files. Named here, not imported: model_checkpoint imports
#: this module.
MODEL_CHECKPOINT_FILES = ("manifest.json", "dense.pt", "jit_dense.pt", "opt.pt", "scaler.pt")


def check_embedding_target(target: Path, *, overwrite: bool) -> None:
    """:func:`check_target` for an embedding-only checkpoint, which also refuses a model
    checkpoint's directory, ``overwrite`` or not: replacing it would delete the dense model
    (an embedding dump belongs in a directory of its own)."""
    if target.is_dir():
        found = [name for name in MODEL_CHECKPOINT_FILES if (target / name).exists()]
        if found:
            raise AlreadyExistsError(
                f"{target} is a model checkpoint (it holds {', '.join(found)}): an embedding "
                "dump there would replace it and delete its dense model, --overwrite or not; "
                "dump to a different directory"
            )
    check_target(target, overwrite=overwrite)


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


# A dump's staging directory is named ``.{name}.tmp-{host}-{pid}-{start}-{random}``
# (STAGING_PREFIX, then these), ``start`` the writer's start time (clock ticks after boot,
# /proc/PID/stat): a PID alone is reused, by PID 1 of every container restart first of all.


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
