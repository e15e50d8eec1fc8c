"""Checkpoint guards that mutation testing found untested: manifest entries a writer never
writes, a write or publish that fails part way or meets a target that changed, and the
sweep of killed dumps on hosts whose names hold dashes. Small checkpoints built from fixed
rows (no training), so every expected value is exact."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from embedding_store import (
    checkpoint_dump,
    checkpoint_load,
    checkpoint_manifest,
    checkpoint_publish,
)
from embedding_store.config import embedding_config_from_mapping
from embedding_store.errors import AlreadyExistsError, CheckpointError
from embedding_store.optimizers import Adagrad
from embedding_store.shard import EmbeddingShard, RowBlock

CONFIG = embedding_config_from_mapping({"slots_config": {"a": {"dim": 8}, "c": {"dim": 3}}})
#: The rows each of the two shards holds: IDs of dim 8 and of dim 3.
ROWS = {0: {8: range(1, 11), 3: range(101, 106)}, 1: {8: range(11, 31), 3: range(106, 109)}}


def _block(ids: range, dim: int) -> RowBlock:
    array = np.array(ids, dtype=np.uint64)
    weights = (array[:, None] * 10 + np.arange(dim)).astype(np.float32)
    return RowBlock(array, weights, np.full((len(array), dim), 0.5, np.float32))


def _shards() -> list[EmbeddingShard]:
    shards = []
    for index, by_dim in ROWS.items():
        shard = EmbeddingShard(1000, optimizer=Adagrad(lr=0.1), replica_index=index, replica_size=2)
        shard.replace_rows([_block(ids, dim) for dim, ids in by_dim.items()])
        shards.append(shard)
    return shards


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One two-shard checkpoint (four files) written once; tests copy it before editing."""
    root = tmp_path_factory.mktemp("guards") / "ckpt"
    checkpoint_dump.dump_embeddings(_shards(), root, CONFIG)
    return root


@pytest.fixture
def checkpoint(written: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "ckpt"
    shutil.copytree(written, copy)
    return copy


def _edit_manifest(root: Path, edit) -> None:
    path = root / checkpoint_manifest.MANIFEST_NAME
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


# --------------------------------------------------------------------------- manifest
def test_rows_per_shard_adds_the_files_of_every_dim(written: Path) -> None:
    manifest = checkpoint_manifest.read_manifest(written)
    assert [(e.shard, e.dim, e.rows) for e in manifest.files] == [
        (0, 3, 5),
        (0, 8, 10),
        (1, 3, 3),
        (1, 8, 20),
    ]
    assert manifest.rows_per_shard() == [15, 23]
    assert manifest.total_rows == 38


def _first_file(raw: dict) -> dict:
    return raw["files"][0]  # shard_00000/dim_3.safetensors


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda m: _first_file(m).update(rows=-1),
            "file entry 'shard_00000/dim_3.safetensors': rows must be an integer >= 0, got -1",
        ),
        (
            lambda m: _first_file(m).update(bytes=-5),
            "file entry 'shard_00000/dim_3.safetensors': bytes must be an integer >= 0, got -5",
        ),
        (
            lambda m: _first_file(m).update(sha256=_first_file(m)["sha256"].upper()),
            "file entry 'shard_00000/dim_3.safetensors': sha256 must be 64 hex digits, got '",
        ),
        (
            lambda m: _first_file(m).update(sha256=_first_file(m)["sha256"] + "0"),
            "file entry 'shard_00000/dim_3.safetensors': sha256 must be 64 hex digits, got '",
        ),
        (
            lambda m: _first_file(m).update(sha256="ab"),
            "file entry 'shard_00000/dim_3.safetensors': sha256 must be 64 hex digits, got 'ab'",
        ),
        (
            lambda m: _first_file(m).update(path=""),
            "file entry path must be a non-empty string, got ''",
        ),
        (
            lambda m: m.update(format="recserve-checkpoint"),
            "embedding_manifest.json is not a recserve-embedding-checkpoint manifest",
        ),
        (
            # Shard 1's files under a manifest of one shard: no replica would read them.
            lambda m: m.update(num_shards=1),
            "embedding_manifest.json: file shard_00001/dim_3.safetensors names shard 1 of 1",
        ),
        (
            # Its rows would load twice: counted twice against the capacity, and written
            # twice into one file by `recserve checkpoint reshard`, which then no load takes.
            lambda m: m["files"].append(dict(_first_file(m))),
            "embedding_manifest.json: file shard_00000/dim_3.safetensors is listed twice",
        ),
        (
            lambda m: m["files"].append(
                {**_first_file(m), "path": "shard_00000/./dim_3.safetensors"}
            ),
            "embedding_manifest.json: file shard_00000/./dim_3.safetensors is listed twice",
        ),
        (
            lambda m: _first_file(m).update(path="../ckpt/shard_00000/dim_3.safetensors"),
            "embedding_manifest.json: file path '../ckpt/shard_00000/dim_3.safetensors' escapes it",
        ),
    ],
)
def test_a_manifest_entry_no_writer_writes_is_named(checkpoint: Path, edit, message) -> None:
    _edit_manifest(checkpoint, edit)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        checkpoint_manifest.read_manifest(checkpoint)


def test_an_absolute_file_path_is_refused_though_it_names_a_good_file(checkpoint: Path) -> None:
    # The file outside is intact (size and checksum hold): only the path check stops a
    # manifest from making a load read whatever file it names.
    outside = checkpoint.parent / "elsewhere.safetensors"
    shutil.copy(checkpoint / "shard_00000" / "dim_3.safetensors", outside)
    _edit_manifest(checkpoint, lambda m: _first_file(m).update(path=str(outside)))
    with pytest.raises(CheckpointError, match=re.escape(f"file path {str(outside)!r} escapes it")):
        checkpoint_load.verify(checkpoint)


# --------------------------------------------------------------------------- publish
def test_a_failed_write_keeps_the_file_it_would_replace(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "embedding_manifest.json"
    checkpoint_publish.write_atomic(path, b"old")

    def failing_fsync(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(checkpoint_publish.os, "fsync", failing_fsync)
    with pytest.raises(
        CheckpointError, match=f"^cannot write {re.escape(str(path))}: Input/output error$"
    ):
        checkpoint_publish.write_atomic(path, b"new")
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left behind


def _staged(tmp_path: Path) -> Path:
    staging = tmp_path / ".ckpt.tmp-staged"
    staging.mkdir()
    (staging / "DONE").write_bytes(b"")
    (staging / "new.txt").write_text("new")
    return staging


def test_publish_checks_the_target_again(tmp_path: Path) -> None:
    """Writers check the target before they start; a target that became another directory
    (or a checkpoint) while the dump ran is refused at the rename too, not replaced."""
    target = tmp_path / "ckpt"
    (target / "sub").mkdir(parents=True)
    (target / "notes.txt").write_text("keep me")
    with pytest.raises(AlreadyExistsError, match="is not a recserve checkpoint"):
        checkpoint_publish.publish_directory(_staged(tmp_path), target, overwrite=True)
    assert (target / "notes.txt").read_text() == "keep me" and (target / "sub").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # staging removed
    shutil.rmtree(target)
    target.mkdir()
    (target / "DONE").write_bytes(b"")
    with pytest.raises(AlreadyExistsError, match="already exists; refusing to overwrite"):
        checkpoint_publish.publish_directory(_staged(tmp_path), target, overwrite=False)
    assert sorted(p.name for p in target.iterdir()) == ["DONE"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def _exchange_supported(tmp_path: Path) -> bool:
    """Whether renameat2(RENAME_EXCHANGE) swaps two directories here (Linux, most local
    filesystems), asked of libc directly, not of the code under test."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    first, second = tmp_path / "probe-a", tmp_path / "probe-b"
    first.mkdir()
    second.mkdir()
    swapped = renameat2(-100, os.fsencode(first), -100, os.fsencode(second), 2) == 0
    first.rmdir()
    second.rmdir()
    return swapped


def test_an_overwrite_is_one_atomic_exchange_where_the_system_can(tmp_path, monkeypatch) -> None:
    """Two renames leave a moment with no checkpoint at the target (a reader then fails):
    where paths can be swapped, the old checkpoint is replaced in one step."""
    if not _exchange_supported(tmp_path):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not available here")

    def two_renames(staging: Path, target: Path) -> None:
        raise AssertionError("replaced in two renames")

    monkeypatch.setattr(checkpoint_publish, "_replace_in_two_renames", two_renames)
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "DONE").write_bytes(b"")
    (target / "old.txt").write_text("old")
    checkpoint_publish.publish_directory(_staged(tmp_path), target, overwrite=True)
    assert sorted(p.name for p in target.iterdir()) == ["DONE", "new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_killed_dumps_are_swept_on_a_host_whose_name_has_dashes(tmp_path, monkeypatch) -> None:
    # Pod names (recserve-trainer-0) hold dashes: the name is split from the right.
    monkeypatch.setattr(checkpoint_publish.socket, "gethostname", lambda: "trainer-pod-7")
    me = os.getpid()
    started = checkpoint_publish._start_time(me)
    killed = tmp_path / f".ckpt.tmp-trainer-pod-7-{me}-{int(started) - 1}-aaaa"  # PID reused
    running = tmp_path / f".ckpt.tmp-trainer-pod-7-{me}-{started}-bbbb"
    elsewhere = tmp_path / f".ckpt.tmp-trainer-pod-8-{me}-{int(started) - 1}-cccc"
    for path in (killed, running, elsewhere):
        path.mkdir()
    staging = checkpoint_publish.staging_directory_for(tmp_path / "ckpt")
    assert staging.name.startswith(f".ckpt.tmp-trainer-pod-7-{me}-{started}-")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [running.name, elsewhere.name, staging.name]
    )


def test_a_shard_part_is_never_written_into_a_published_checkpoint(checkpoint: Path) -> None:
    before = sorted(str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*"))
    with pytest.raises(AlreadyExistsError, match=r"is a published checkpoint \(it has DONE\)"):
        checkpoint_dump.write_shard_part(_shards()[0], checkpoint, 2)
    assert sorted(str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*")) == before
    checkpoint_load.verify(checkpoint)


def test_a_dump_to_a_taken_target_is_refused_before_any_row_is_written(
    checkpoint: Path, monkeypatch
) -> None:
    def write_shard_part(*args, **kwargs):
        raise AssertionError("rows written before the target was checked")

    monkeypatch.setattr(checkpoint_dump, "write_shard_part", write_shard_part)
    with pytest.raises(AlreadyExistsError, match="already exists; refusing to overwrite"):
        checkpoint_dump.dump_embeddings(_shards(), checkpoint, CONFIG)
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == ["ckpt"]


def test_a_dump_that_fails_part_way_leaves_no_staging_directory(tmp_path, monkeypatch) -> None:
    real = checkpoint_dump.write_shard_part
    written: list[int] = []

    def second_shard_fails(shard, directory, shard_index, **kwargs):
        if shard_index == 1:
            raise CheckpointError(f"cannot write {directory}: No space left on device")
        written.append(shard_index)
        return real(shard, directory, shard_index, **kwargs)

    monkeypatch.setattr(checkpoint_dump, "write_shard_part", second_shard_fails)
    with pytest.raises(CheckpointError, match="No space left on device"):
        checkpoint_dump.dump_embeddings(_shards(), tmp_path / "ckpt", CONFIG)
    assert written == [0]
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- load
def _rewrite(root: Path, change, path: Path | None = None) -> Path:
    """Rewrite shard 0's dim-8 file (or ``path``) with ``change(tensors)``, its metadata kept
    and its manifest entry's size and checksum to match (every other check holds); returns
    it."""
    import hashlib

    import safetensors.numpy
    from safetensors import safe_open

    path = path or root / "shard_00000" / "dim_8.safetensors"
    relative = path.relative_to(root).as_posix()
    with safe_open(str(path), framework="numpy") as handle:
        metadata = handle.metadata()
    payload = safetensors.numpy.save(
        change(dict(safetensors.numpy.load(path.read_bytes()))), metadata=metadata
    )
    path.write_bytes(payload)

    def entry(raw: dict) -> None:
        (item,) = [e for e in raw["files"] if e["path"] == relative]
        item["bytes"], item["sha256"] = len(payload), hashlib.sha256(payload).hexdigest()

    _edit_manifest(root, entry)
    return path


@pytest.mark.parametrize(
    ("change", "held"),
    [
        (
            lambda t: dict(t, ids=t["ids"].astype(np.int64)),
            "ids (int64 [10]), recency (int64 [10]), "
            "state (float32 [10, 8]), weights (float32 [10, 8])",
        ),
        (
            lambda t: dict(t, weights=t["weights"][:, :4].copy()),
            "ids (uint64 [10]), recency (int64 [10]), "
            "state (float32 [10, 8]), weights (float32 [10, 4])",
        ),
        (
            lambda t: dict(t, state=t["state"][:, :1].copy()),
            "ids (uint64 [10]), recency (int64 [10]), "
            "state (float32 [10, 1]), weights (float32 [10, 8])",
        ),
        (
            lambda t: dict(t, state=t["state"][:9].copy()),
            "ids (uint64 [10]), recency (int64 [10]), "
            "state (float32 [9, 8]), weights (float32 [10, 8])",
        ),
    ],
)
def test_a_file_whose_tensors_differ_from_its_entry_is_named(checkpoint: Path, change, held):
    path = _rewrite(checkpoint, change)
    message = (
        f"checkpoint file {path} does not hold ids (U64 [10]), weights (F32 [10, 8]) and state "
        f"(F32 [10, 8]) as its manifest says; it holds {held}"
    )
    with pytest.raises(CheckpointError) as raised:
        checkpoint_load.verify(checkpoint)
    assert raised.value.message == message
    shards = [EmbeddingShard(1000, optimizer=Adagrad(lr=0.1))]
    with pytest.raises(CheckpointError) as raised:
        checkpoint_load.load_embeddings(checkpoint, shards, CONFIG)
    assert raised.value.message == message
    assert shards[0].size() == 0


@pytest.mark.parametrize(
    ("recency", "held"),
    [(np.arange(10, dtype=np.float32), "float32 [10]"), (np.arange(9), "int64 [9]")],
)
def test_a_file_with_a_malformed_recency_is_named(checkpoint: Path, recency, held) -> None:
    path = _rewrite(checkpoint, lambda t: dict(t, recency=recency))
    message = f"checkpoint file {path} holds recency ({held}); it must be I64 [10], one per row"
    with pytest.raises(CheckpointError) as raised:
        checkpoint_load.verify(checkpoint)
    assert raised.value.message == message


def test_recency_is_read_for_training_shards_only(written: Path) -> None:
    """Shard 1's rows (dim 8: 11-30, then dim 3: 106-108) were put in one block after the
    other, so their LRU ranks follow that order; a read-only shard never evicts and reads
    none."""
    manifest = checkpoint_manifest.read_manifest(written)
    read = checkpoint_load.read_rows_for_replica(manifest, 1, 2, keep_state_of=None)
    assert [(b.dim, b.recency.tolist()) for b in read] == [
        (3, [20, 21, 22]),
        (8, list(range(20))),
    ]
    skipped = checkpoint_load.read_rows_for_replica(
        manifest, 1, 2, keep_state_of=None, keep_recency=False
    )
    assert [b.recency for b in skipped] == [None, None]


def test_files_without_recency_load_as_before(checkpoint: Path) -> None:
    """Checkpoints written before files held each row's LRU recency still load, whole."""
    for shard in ("shard_00000", "shard_00001"):
        for dim in (8, 3):
            path = checkpoint / shard / f"dim_{dim}.safetensors"
            _rewrite(checkpoint, lambda t: {k: v for k, v in t.items() if k != "recency"}, path)
    shards = [
        EmbeddingShard(1000, optimizer=Adagrad(lr=0.1), replica_index=i, replica_size=2)
        for i in range(2)
    ]
    checkpoint_load.load_embeddings(checkpoint, shards, CONFIG)
    for index, by_dim in ROWS.items():
        for dim, ids in by_dim.items():
            block = shards[index].export_rows(dim)
            expected = _block(ids, dim)
            assert block.ids.tolist() == expected.ids.tolist()
            assert np.array_equal(block.weights, expected.weights)


def test_a_file_of_two_rows_with_one_id_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "dim_8.safetensors"
    with pytest.raises(CheckpointError) as raised:
        checkpoint_load._check_unique_ids(path, np.array([7, 7], dtype=np.uint64))
    assert raised.value.message == (
        f"checkpoint file {path} holds duplicate IDs: 1 ID appears more than once, the first "
        "being 7 (rows 0 and 1); each ID may appear only once per file"
    )
    checkpoint_load._check_unique_ids(path, np.array([7, 8], dtype=np.uint64))


def test_slots_under_another_id_prefix_are_refused(written: Path) -> None:
    # The rows' IDs carry the prefix of their slot's ID space: read under other prefixes
    # they are other rows (every lookup would miss), so the load is refused.
    unprefixed = embedding_config_from_mapping(
        {"feature_index_prefix_bit": 0, "slots_config": {"a": {"dim": 8}, "c": {"dim": 3}}}
    )
    assert CONFIG.feature_index_prefix_bit == 8  # the default: the checkpoint's
    shards = [EmbeddingShard(1000, optimizer=Adagrad(lr=0.1))]
    with pytest.raises(CheckpointError) as raised:
        checkpoint_load.load_embeddings(written, shards, unprefixed)
    assert raised.value.message == (
        f"embedding checkpoint {written} does not match the embedding config: slot 'a' has "
        "another ID prefix in the checkpoint (feature groups or feature_index_prefix_bit "
        "changed); slot 'c' has another ID prefix in the checkpoint (feature groups or "
        "feature_index_prefix_bit changed)"
    )
    assert shards[0].size() == 0


def test_a_replica_reads_only_its_own_files_unless_the_rows_are_resharded(written: Path):
    """Progress counts the rows of the files a replica reads: its own two files (shard 1:
    3 rows of dim 3, then 20 of dim 8) when the shard count is the same, all four when it
    re-shards."""
    calls: list[tuple[int, int]] = []
    shard = EmbeddingShard(1000, optimizer=Adagrad(lr=0.1), replica_index=1, replica_size=2)
    checkpoint_load.load_into_shard(
        written,
        shard,
        CONFIG,
        replica_index=1,
        replica_size=2,
        progress=lambda done, total: calls.append((done, total)),
    )
    assert calls == [(3, 23), (23, 23)]
    assert sorted(shard.export_rows(8).ids.tolist()) == list(ROWS[1][8])
    assert sorted(shard.export_rows(3).ids.tolist()) == list(ROWS[1][3])
    calls.clear()
    three = EmbeddingShard(1000, optimizer=Adagrad(lr=0.1), replica_index=0, replica_size=3)
    checkpoint_load.load_into_shard(
        written,
        three,
        CONFIG,
        replica_index=0,
        replica_size=3,
        progress=lambda done, total: calls.append((done, total)),
    )
    assert calls == [(5, 38), (15, 38), (18, 38), (38, 38)]


def test_state_of_another_kind_of_optimizer_never_fits_even_at_the_same_width(written: Path):
    # No two optimizers here keep state of one width, so a manifest naming another kind
    # with Adagrad's widths is a damaged one: its state is not given to Adagrad.
    import dataclasses

    manifest = checkpoint_manifest.read_manifest(written)
    assert checkpoint_load.state_fits(manifest, Adagrad(lr=0.1))
    renamed = dataclasses.replace(manifest, optimizer={**manifest.optimizer, "name": "adam"})
    assert not checkpoint_load.state_fits(renamed, Adagrad(lr=0.1))


def test_a_shard_too_small_is_refused_before_it_adopts_the_optimizer(written: Path) -> None:
    shard = EmbeddingShard(22, replica_index=1, replica_size=2)  # shard 1 holds 23 rows
    with pytest.raises(CheckpointError) as raised:
        checkpoint_load.load_into_shard(
            written, shard, CONFIG, replica_index=1, replica_size=2, adopt_optimizer=True
        )
    assert raised.value.message == (
        f"embedding checkpoint {written} gives this shard 23 rows, more than its capacity 22; "
        "raise capacity or add shards"
    )
    assert shard.optimizer is None and shard.size() == 0
    fits = EmbeddingShard(23, replica_index=1, replica_size=2)
    checkpoint_load.load_into_shard(
        written, fits, CONFIG, replica_index=1, replica_size=2, adopt_optimizer=True
    )
    assert fits.size() == 23 and fits.optimizer is not None and fits.optimizer.name == "adagrad"


def test_rows_dumped_without_an_optimizer_load_into_a_training_shard(tmp_path, caplog) -> None:
    """A checkpoint of shards without an optimizer (optimizer null) has no state to keep:
    a training shard takes its rows and starts every row's state fresh, with no warning."""
    import logging

    plain = EmbeddingShard(1000)
    plain.replace_rows([RowBlock(b.ids, b.weights, None) for b in (_block(range(1, 5), 8),)])
    manifest = checkpoint_dump.dump_embeddings([plain], tmp_path / "ckpt", CONFIG)
    assert manifest.optimizer is None
    training = EmbeddingShard(1000, optimizer=Adagrad(lr=0.1, initial_accumulator_value=0.25))
    with caplog.at_level(logging.WARNING, logger="embedding_store.checkpoint_load"):
        checkpoint_load.load_embeddings(tmp_path / "ckpt", [training], CONFIG)
    assert caplog.records == []
    block = training.export_rows(8)
    assert block.ids.tolist() == [1, 2, 3, 4]
    assert np.array_equal(block.weights, _block(range(1, 5), 8).weights)
    assert np.array_equal(block.state, np.full((4, 8), 0.25, np.float32))


# --------------------------------------------------------------------------- tools
def test_inspect_counts_ids_without_a_known_prefix_apart(written: Path) -> None:
    # The fixture's IDs carry no prefix (top byte 0) though the config has 8 prefix bits.
    from clients import checkpoint_inspect

    info = checkpoint_inspect.inspect(written)
    assert info["embeddings"]["rows_per_id_space"] == {"(unknown prefix)": 38}
    assert info["embeddings"]["rows_per_shard"] == [15, 23]


def test_reshard_keeps_every_row_and_its_optimizer_state(written: Path, tmp_path: Path) -> None:
    from clients import checkpoint_write

    result = checkpoint_write.reshard(written, 3, tmp_path / "three")
    assert result["rows"] == 38 and sum(result["rows_per_shard"]) == 38
    manifest = checkpoint_manifest.read_manifest(tmp_path / "three")
    assert manifest.optimizer == checkpoint_manifest.read_manifest(written).optimizer
    assert {(e.dim, e.state_width) for e in manifest.files} == {(8, 8), (3, 3)}
    shard = EmbeddingShard(1000, optimizer=Adagrad(lr=0.1))
    checkpoint_load.load_embeddings(tmp_path / "three", [shard], CONFIG)
    for dim in (8, 3):
        block = shard.export_rows(dim)
        order = np.argsort(block.ids)
        ids = [i for rows in ROWS.values() for i in rows[dim]]
        expected = _block(range(min(ids), max(ids) + 1), dim)
        assert block.ids[order].tolist() == ids
        assert np.array_equal(block.weights[order], expected.weights)
        assert np.array_equal(block.state[order], expected.state)  # 0.5, not fresh


def test_reshard_to_a_taken_target_is_refused_before_reading(written, tmp_path, monkeypatch):
    from clients import checkpoint_write

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "DONE").write_bytes(b"")

    def require_verified(directory):
        raise AssertionError("the source was read before the target was checked")

    monkeypatch.setattr(checkpoint_write, "require_verified", require_verified)
    with pytest.raises(AlreadyExistsError, match="already exists; refusing to overwrite"):
        checkpoint_write.reshard(written, 3, taken)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def _model_checkpoint_files(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()
    }


def test_an_embedding_dump_never_replaces_a_model_checkpoint(tmp_path: Path) -> None:
    """A model checkpoint holds a DONE marker too: --overwrite used to replace it by an
    embedding-only one, deleting its dense model. Refused, in process and from a remote tier
    (``recserve embedding-tier dump``), naming the directory, and left as it was."""
    from embedding_store import model_checkpoint
    from embedding_store.remote_tier import RemoteShardTier
    from tests.unit.test_eval_tiny_checkpoint import make_checkpoint

    model = make_checkpoint(tmp_path / "model")
    before = _model_checkpoint_files(model)
    assert {"manifest.json", "dense.pt", "jit_dense.pt"} <= set(before)
    message = (
        rf"^{re.escape(str(model))} is a model checkpoint \(it holds manifest.json, dense.pt, "
        r"jit_dense.pt\): .* dump to a different directory$"
    )
    with pytest.raises(AlreadyExistsError, match=message):
        checkpoint_dump.dump_embeddings(_shards(), model, CONFIG, overwrite=True)
    # The remote tier's dump checks before it asks any shard: no client is needed to see it.
    remote = RemoteShardTier.__new__(RemoteShardTier)
    remote._wait_for_gradients = lambda what: None  # type: ignore[method-assign]
    with pytest.raises(AlreadyExistsError, match=message):
        remote._dump(model, overwrite=True, progress=lambda *a: None, caller_gone=lambda: False)
    assert _model_checkpoint_files(model) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no staging left
    model_checkpoint.read_manifest(model)


def test_the_model_checkpoint_files_named_for_the_guard_are_model_checkpoints() -> None:
    from embedding_store import model_checkpoint as mc

    assert checkpoint_publish.MODEL_CHECKPOINT_FILES == (
        mc.MANIFEST_NAME,
        mc.DENSE_FILE,
        mc.JIT_FILE,
        mc.OPTIMIZER_FILE,
        mc.SCALER_FILE,
    )
