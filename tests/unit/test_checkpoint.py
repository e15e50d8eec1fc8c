"""Embedding checkpoints: atomic dumps, verified loads, re-sharding, clear errors."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from embedding_store import (
    checkpoint_dump,
    checkpoint_load,
    checkpoint_manifest,
    checkpoint_publish,
)
from embedding_store.batch import Batch, IDTypeFeature
from embedding_store.config import embedding_config_from_mapping
from embedding_store.errors import AlreadyExistsError, CheckpointError
from embedding_store.hashing import shard_of
from embedding_store.optimizers import SGD, Adagrad
from embedding_store.shard import EmbeddingShard
from embedding_store.worker import EmbeddingWorker

CONFIG = embedding_config_from_mapping(
    {"slots_config": {"a": {"dim": 8}, "b": {"dim": 8}, "c": {"dim": 3}}}
)
CONFIG_3_8 = embedding_config_from_mapping({"slots_config": {"a": {"dim": 8}, "c": {"dim": 3}}})


def make_shards(n: int, optimizer=None) -> list[EmbeddingShard]:
    return [
        EmbeddingShard(
            100_000, optimizer=optimizer or Adagrad(lr=0.1), replica_index=i, replica_size=n
        )
        for i in range(n)
    ]


def random_batch(seed: int, batch_size: int = 64) -> Batch:
    rng = np.random.default_rng(seed)

    def lists():
        return [rng.integers(0, 5000, size=rng.integers(0, 5)).tolist() for _ in range(batch_size)]

    return Batch(
        [IDTypeFeature.from_lists(name, lists()) for name in ("a", "b", "c")],
        requires_grad=False,
    )


def trained_worker(
    num_shards: int, first_batch: int = 0
) -> tuple[EmbeddingWorker, list[EmbeddingShard]]:
    shards = make_shards(num_shards)
    worker = EmbeddingWorker(CONFIG, shards)
    generator = torch.Generator().manual_seed(1 + first_batch)
    for step in range(first_batch, first_batch + 5):
        result = worker.lookup(random_batch(step), train=True)
        grads = {s.name: torch.randn(s.embeddings.shape, generator=generator) for s in result.slots}
        worker.backward(result.ref, grads)
    return worker, shards


def all_rows(shards, dim):
    ids, weights, state = [], [], []
    for shard in shards:
        block = shard.export_rows(dim)
        ids.append(block.ids)
        weights.append(block.weights)
        state.append(block.state)
    ids = np.concatenate(ids)
    order = np.argsort(ids)
    return ids[order], np.concatenate(weights)[order], np.concatenate(state)[order]


def test_dump_from_two_load_into_three_is_bit_exact(tmp_path):
    worker, shards = trained_worker(2)
    manifest = checkpoint_dump.dump_embeddings(shards, tmp_path / "ckpt", CONFIG)
    assert manifest.num_shards == 2
    assert manifest.total_rows == sum(s.size() for s in shards)
    assert (tmp_path / "ckpt" / "DONE").exists()

    target = make_shards(3)
    checkpoint_load.load_embeddings(tmp_path / "ckpt", target, CONFIG)
    for dim in (8, 3):
        before, after = all_rows(shards, dim), all_rows(target, dim)
        for x, y in zip(before, after):
            assert np.array_equal(x, y)  # ids, weights and optimizer state, bit for bit
    # Each row sits on the shard that owns it under the new count.
    reloaded = EmbeddingWorker(CONFIG, target)
    for seed in range(8):
        batch = random_batch(100 + seed)
        expected = worker.lookup(batch, train=False)
        got = reloaded.lookup(batch, train=False)
        for e, g in zip(expected.slots, got.slots):
            assert torch.equal(e.embeddings, g.embeddings)


def test_optimizer_state_kept_so_training_continues_identically(tmp_path):
    _, shards = trained_worker(2)
    checkpoint_dump.dump_embeddings(shards, tmp_path / "ckpt", CONFIG)
    restored = make_shards(1)
    checkpoint_load.load_embeddings(tmp_path / "ckpt", restored, CONFIG)
    original = EmbeddingWorker(CONFIG, shards)
    resumed = EmbeddingWorker(CONFIG, restored)
    batch = random_batch(7)
    for worker in (original, resumed):
        result = worker.lookup(batch, train=True)
        worker.backward(result.ref, {s.name: torch.ones(s.embeddings.shape) for s in result.slots})
    a, b = original.lookup(batch, train=False), resumed.lookup(batch, train=False)
    for x, y in zip(a.slots, b.slots):
        assert torch.equal(x.embeddings, y.embeddings)


def test_refuses_to_overwrite_and_overwrites_when_asked(tmp_path):
    _, shards = trained_worker(1)
    checkpoint_dump.dump_embeddings(shards, tmp_path / "ckpt", CONFIG)
    with pytest.raises(AlreadyExistsError, match="already exists"):
        checkpoint_dump.dump_embeddings(shards, tmp_path / "ckpt", CONFIG)
    checkpoint_dump.dump_embeddings(shards, tmp_path / "ckpt", CONFIG, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary leftovers


def _loaded_store_is_unchanged(tmp_path, broken_dir, match):
    # A store of two shards holding other rows than the checkpoint (other batches): loading
    # any part of the checkpoint would show, in either shard.
    _, shards = trained_worker(2, first_batch=100)
    before = {dim: all_rows(shards, dim) for dim in (8, 3)}
    saved_ids = np.concatenate([_ids_of(p) for p in sorted(broken_dir.rglob("*.safetensors"))])
    held_ids = np.concatenate([before[8][0], before[3][0]])
    assert not np.array_equal(np.sort(saved_ids), np.sort(held_ids))
    with pytest.raises(CheckpointError, match=match):
        checkpoint_load.load_embeddings(broken_dir, shards, CONFIG)
    for dim in (8, 3):
        for x, y in zip(before[dim], all_rows(shards, dim)):
            assert np.array_equal(x, y)


def _ids_of(path) -> np.ndarray:
    import safetensors.numpy

    try:
        return safetensors.numpy.load_file(str(path))["ids"].reshape(-1)  # or a crafted matrix
    except Exception:  # the file this test corrupted or cut
        return np.zeros(0, dtype=np.uint64)


def test_incomplete_checkpoint_is_refused(tmp_path):
    _, shards = trained_worker(2)
    checkpoint_dump.dump_embeddings(shards, tmp_path / "ckpt", CONFIG)
    (tmp_path / "ckpt" / "DONE").unlink()
    _loaded_store_is_unchanged(tmp_path, tmp_path / "ckpt", "incomplete: no DONE marker")


def test_corrupt_file_is_refused(tmp_path):
    _, shards = trained_worker(2)
    manifest = checkpoint_dump.dump_embeddings(shards, tmp_path / "ckpt", CONFIG)
    victim = tmp_path / "ckpt" / manifest.files[-1].path
    payload = bytearray(victim.read_bytes())
    payload[-5] ^= 0xFF
    victim.write_bytes(bytes(payload))
    _loaded_store_is_unchanged(tmp_path, tmp_path / "ckpt", "corrupt: SHA-256 mismatch")
    with pytest.raises(CheckpointError, match="SHA-256"):
        checkpoint_load.verify(tmp_path / "ckpt")


def test_truncated_file_is_refused(tmp_path):
    _, shards = trained_worker(2)
    manifest = checkpoint_dump.dump_embeddings(shards, tmp_path / "ckpt", CONFIG)
    victim = tmp_path / "ckpt" / manifest.files[0].path
    victim.write_bytes(victim.read_bytes()[:100])
    _loaded_store_is_unchanged(tmp_path, tmp_path / "ckpt", "truncated or replaced")


def test_mismatched_dims_are_refused(tmp_path):
    _, shards = trained_worker(1)
    checkpoint_dump.dump_embeddings(shards, tmp_path / "ckpt", CONFIG)
    other = embedding_config_from_mapping(
        {"slots_config": {"a": {"dim": 16}, "b": {"dim": 8}, "c": {"dim": 3}}}
    )
    with pytest.raises(CheckpointError, match="slot 'a' has dim 8 in the checkpoint but 16"):
        checkpoint_load.load_embeddings(tmp_path / "ckpt", make_shards(1), other)


def test_manifest_problems_are_named(tmp_path):
    _, shards = trained_worker(1)
    checkpoint_dump.dump_embeddings(shards, tmp_path / "ckpt", CONFIG)
    manifest_path = tmp_path / "ckpt" / checkpoint_manifest.MANIFEST_NAME
    raw = json.loads(manifest_path.read_text())
    raw["format_version"] = 99
    manifest_path.write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="format version 99"):
        checkpoint_manifest.read_manifest(tmp_path / "ckpt")
    for num_shards in (10**13, 0, 1.5, "1", True):
        raw["format_version"] = checkpoint_manifest.FORMAT_VERSION
        raw["num_shards"] = num_shards
        manifest_path.write_text(json.dumps(raw))
        # 10**13 shards: `recserve checkpoint inspect` listed the rows of each, a MemoryError.
        with pytest.raises(CheckpointError, match=r"num_shards must be an integer in 1\.\.65536"):
            checkpoint_manifest.read_manifest(tmp_path / "ckpt")
    manifest_path.write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        checkpoint_manifest.read_manifest(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint_manifest.read_manifest(tmp_path / "missing")


def test_other_optimizer_drops_state_but_keeps_weights(tmp_path, caplog):
    _, shards = trained_worker(1)
    checkpoint_dump.dump_embeddings(shards, tmp_path / "ckpt", CONFIG)
    sgd_shards = make_shards(1, optimizer=SGD(lr=0.1))
    with caplog.at_level(logging.WARNING, logger="embedding_store.checkpoint_load"):
        checkpoint_load.load_embeddings(tmp_path / "ckpt", sgd_shards, CONFIG)
    ids, weights, _ = all_rows(shards, 8)
    ids2, weights2, state2 = all_rows(sgd_shards, 8)
    assert np.array_equal(ids, ids2) and np.array_equal(weights, weights2)
    assert state2.shape == (len(ids2), 0)
    # Said (by each shard that loads): every row's optimizer starts again.
    assert [r.getMessage() for r in caplog.records] == [
        f"embedding checkpoint {tmp_path / 'ckpt'} holds state of optimizer adagrad, which "
        "does not fit this shard's sgd: the rows load, their optimizer state starts fresh"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="embedding_store.checkpoint_load"):
        checkpoint_load.load_embeddings(tmp_path / "ckpt", make_shards(1), CONFIG)  # same kind
    assert caplog.records == []


def test_capacity_too_small_is_refused_before_loading(tmp_path):
    _, shards = trained_worker(1)
    checkpoint_dump.dump_embeddings(shards, tmp_path / "ckpt", CONFIG)
    small = [EmbeddingShard(10, optimizer=Adagrad(lr=0.1))]
    with pytest.raises(CheckpointError, match="more than its capacity 10"):
        checkpoint_load.load_embeddings(tmp_path / "ckpt", small, CONFIG)
    assert small[0].size() == 0


def test_manifest_that_is_not_an_object_is_named(tmp_path):
    _, shards = trained_worker(1)
    checkpoint_dump.dump_embeddings(shards, tmp_path / "ckpt", CONFIG)
    manifest_path = tmp_path / "ckpt" / checkpoint_manifest.MANIFEST_NAME
    for payload, kind in (("[]", "list"), ("null", "NoneType"), ("3", "int")):
        manifest_path.write_text(payload)
        with pytest.raises(CheckpointError, match=f"is malformed: a JSON {kind}, not an object"):
            checkpoint_manifest.read_manifest(tmp_path / "ckpt")


@pytest.mark.parametrize(
    ("optimizer", "problem"),
    [
        ("adagrad", "optimizer must be a mapping, got str"),
        (["adagrad"], "optimizer must be a mapping, got list"),
        (
            {"name": "rmsprop"},
            "optimizer.name must be one of ['adagrad', 'adam', 'sgd'], got 'rmsprop'",
        ),
        ({"name": "adagrad", "lr": "fast"}, "adagrad.lr must be a number, got 'fast'"),
    ],
)
def test_a_manifest_optimizer_no_writer_writes_is_named_before_any_shard_changes(
    tmp_path, optimizer, problem
):
    """Writers put None or an optimizer's to_dict() in the manifest. Anything else was an
    AttributeError of a load into a configured shard (a bare 500 / INTERNAL), or a
    ConfigError naming no file when a shard adopted it."""
    _, shards = trained_worker(1)
    checkpoint_dump.dump_embeddings(shards, tmp_path / "ckpt", CONFIG)
    manifest_path = tmp_path / "ckpt" / checkpoint_manifest.MANIFEST_NAME
    raw = json.loads(manifest_path.read_text())
    raw["optimizer"] = optimizer
    manifest_path.write_text(json.dumps(raw))
    expected = f"{manifest_path} is malformed: {problem}"
    with pytest.raises(CheckpointError) as raised:
        checkpoint_manifest.read_manifest(tmp_path / "ckpt")
    assert raised.value.message == expected
    configured = make_shards(1)
    with pytest.raises(CheckpointError) as raised:
        checkpoint_load.load_embeddings(tmp_path / "ckpt", configured, CONFIG)
    assert raised.value.message == expected
    bare = EmbeddingShard(100_000)
    with pytest.raises(CheckpointError) as raised:
        checkpoint_load.load_into_shard(
            tmp_path / "ckpt", bare, CONFIG, replica_index=0, replica_size=1, adopt_optimizer=True
        )
    assert raised.value.message == expected
    assert configured[0].size() == bare.size() == 0 and bare.optimizer is None


def test_same_optimizer_with_another_state_width_drops_state_but_keeps_weights(tmp_path):
    # Adagrad keeps dim columns of state per row; vectorwise_shared keeps one. The saved
    # state cannot be given to the other: it is dropped and the shard initializes it.
    _, shards = trained_worker(2)
    checkpoint_dump.dump_embeddings(shards, tmp_path / "ckpt", CONFIG)
    shared = make_shards(3, optimizer=Adagrad(lr=0.1, vectorwise_shared=True))
    checkpoint_load.load_embeddings(tmp_path / "ckpt", shared, CONFIG)
    ids, weights, _ = all_rows(shards, 8)
    ids2, weights2, state2 = all_rows(shared, 8)
    assert np.array_equal(ids, ids2) and np.array_equal(weights, weights2)
    fresh = Adagrad(lr=0.1, vectorwise_shared=True).initial_state(len(ids2), 8)
    assert state2.shape == (len(ids2), 1) and np.array_equal(state2, fresh)


def test_state_fits_needs_the_same_kind_and_width_not_the_same_learning_rate(tmp_path):
    _, shards = trained_worker(1)
    manifest = checkpoint_dump.dump_embeddings(shards, tmp_path / "ckpt", CONFIG)
    assert checkpoint_load.state_fits(manifest, Adagrad(lr=0.5))  # a resumed run may change lr
    assert not checkpoint_load.state_fits(manifest, Adagrad(lr=0.1, vectorwise_shared=True))
    assert not checkpoint_load.state_fits(manifest, SGD(lr=0.1))
    assert not checkpoint_load.state_fits(manifest, None)


def test_other_hash_stacking_is_refused(tmp_path):
    def stacked(embedding_size: int, rounds: int = 2):
        return embedding_config_from_mapping(
            {
                "slots_config": {
                    "a": {
                        "dim": 8,
                        "hash_stack_config": {
                            "hash_stack_rounds": rounds,
                            "embedding_size": embedding_size,
                        },
                    },
                    "b": {"dim": 8},
                    "c": {"dim": 3},
                }
            }
        )

    saved = stacked(50)
    shards = make_shards(1)
    worker = EmbeddingWorker(saved, shards)
    worker.lookup(random_batch(0), train=True)
    checkpoint_dump.dump_embeddings(shards, tmp_path / "ckpt", saved)
    target = make_shards(1)
    for other in (stacked(60), stacked(50, rounds=3), CONFIG):
        with pytest.raises(CheckpointError, match="slot 'a' has hash_stack_config"):
            checkpoint_load.load_embeddings(tmp_path / "ckpt", target, other)
        assert target[0].size() == 0
    checkpoint_load.load_embeddings(tmp_path / "ckpt", target, stacked(50))
    assert target[0].size() == shards[0].size()


@pytest.mark.parametrize("atomic_exchange", [True, False])
def test_overwrite_replaces_the_checkpoint_and_leaves_nothing_behind(
    tmp_path, monkeypatch, atomic_exchange
):
    if not atomic_exchange:  # a system without renameat2: two renames
        monkeypatch.setattr(checkpoint_publish, "_exchange", lambda first, second: False)
    _, first = trained_worker(1)
    checkpoint_dump.dump_embeddings(first, tmp_path / "ckpt", CONFIG)
    _, second = trained_worker(2)
    manifest = checkpoint_dump.dump_embeddings(second, tmp_path / "ckpt", CONFIG, overwrite=True)
    assert manifest.num_shards == 2
    assert checkpoint_load.verify(tmp_path / "ckpt").num_shards == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def _failing_rename(monkeypatch, destination: Path) -> None:
    """os.replace fails (EIO) the first time it renames something to ``destination``, as a
    broken filesystem would; every other rename happens."""
    real_replace = os.replace
    failed = []

    def replace(source, to):
        if Path(to) == destination and not failed:
            failed.append(source)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_replace(source, to)

    monkeypatch.setattr(checkpoint_publish.os, "replace", replace)


def test_a_failed_publish_is_named_and_leaves_no_staging_directory(tmp_path, monkeypatch):
    _, shards = trained_worker(1)
    _failing_rename(monkeypatch, tmp_path / "ckpt")
    with pytest.raises(
        CheckpointError,
        match=f"^cannot publish the checkpoint at {re.escape(str(tmp_path / 'ckpt'))}: "
        "Input/output error$",
    ):
        checkpoint_dump.dump_embeddings(shards, tmp_path / "ckpt", CONFIG)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_overwrite_in_two_renames_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    _, first = trained_worker(1)
    checkpoint_dump.dump_embeddings(first, tmp_path / "ckpt", CONFIG)
    monkeypatch.setattr(checkpoint_publish, "_exchange", lambda first, second: False)
    _failing_rename(monkeypatch, tmp_path / "ckpt")  # the new one's, not the put-back
    _, second = trained_worker(2)
    with pytest.raises(CheckpointError, match=r"cannot publish the checkpoint at .*ckpt"):
        checkpoint_dump.dump_embeddings(second, tmp_path / "ckpt", CONFIG, overwrite=True)
    assert checkpoint_load.verify(tmp_path / "ckpt").num_shards == 1  # the old one, put back
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_checkpoint_left_by_an_interrupted_overwrite_is_named(tmp_path):
    _, shards = trained_worker(1)
    checkpoint_dump.dump_embeddings(shards, tmp_path / "ckpt", CONFIG)
    # What a crash between the two renames of an overwrite leaves.
    (tmp_path / "ckpt").rename(tmp_path / ".ckpt.old-0123abcd")
    with pytest.raises(
        CheckpointError,
        match=r"does not exist .*interrupted overwrite left the previous checkpoint at "
        r".*\.ckpt\.old-0123abcd: rename it to ckpt",
    ):
        checkpoint_manifest.read_manifest(tmp_path / "ckpt")


def test_a_dump_that_never_finished_is_named_where_its_checkpoint_is_missing(tmp_path):
    """A first run killed while it wrote its checkpoint leaves only a hidden staging
    directory: reading the checkpoint said only that it does not exist."""
    from clients.checkpoint_common import checkpoint_kind
    from embedding_store import model_checkpoint

    staging = tmp_path / ".ckpt.tmp-trainer-41-7606764-0123abcd"
    (staging / "embeddings").mkdir(parents=True)
    (tmp_path / ".other.tmp-trainer-41-7606764-0123abcd").mkdir()  # another target's
    expected = (
        f"checkpoint {tmp_path / 'ckpt'} does not exist or is not a directory; a dump to it "
        f"has not finished (still running, or killed): {staging.name} in {tmp_path} holds no "
        "complete checkpoint (the next dump to ckpt removes it once its writer is gone)"
    )
    for read in (model_checkpoint.read_manifest, checkpoint_kind):
        with pytest.raises(CheckpointError) as error:
            read(tmp_path / "ckpt")
        assert error.value.message == expected
    with pytest.raises(CheckpointError) as error:
        model_checkpoint.read_manifest(tmp_path / "missing")
    assert error.value.message.endswith("missing does not exist or is not a directory")


def test_files_listed_for_another_shard_are_refused(tmp_path):
    # The manifest's shard numbers of shard 0's and shard 1's files swapped: every size and
    # checksum holds, but each shard would get rows it never looks up (all unknown IDs).
    _, shards = trained_worker(2)
    root = tmp_path / "ckpt"
    checkpoint_dump.dump_embeddings(shards, root, CONFIG)
    manifest = json.loads((root / checkpoint_manifest.MANIFEST_NAME).read_text())
    for entry in manifest["files"]:
        entry["shard"] = 1 - entry["shard"]
    (root / checkpoint_manifest.MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(
        CheckpointError, match=r"was written for shard \d; the manifest lists it for shard \d"
    ):
        checkpoint_load.verify(root)
    _loaded_store_is_unchanged(tmp_path, root, "was written for shard")


@pytest.mark.parametrize(
    "change",
    [
        lambda t: dict(t, weights=t["weights"].astype(np.float64)),
        lambda t: dict(t, weights=t["weights"].astype(np.float16)),
        lambda t: dict(t, state=t["state"].astype(np.float64)),
        lambda t: dict(t, ids=np.stack([t["ids"], t["ids"]], axis=1)),
    ],
)
def test_files_of_other_dtypes_or_shapes_are_refused_naming_the_file(tmp_path, change):
    # A crafted file, its manifest entry's size and checksum to match: every check held, and
    # the shard refused it later as a bad argument (naming no file), or an ids matrix.
    import safetensors.numpy

    _, shards = trained_worker(1)
    root = tmp_path / "ckpt"
    checkpoint_dump.dump_embeddings(shards, root, CONFIG)
    manifest = json.loads((root / checkpoint_manifest.MANIFEST_NAME).read_text())
    entry = manifest["files"][0]
    path = root / entry["path"]
    payload = safetensors.numpy.save(
        change(safetensors.numpy.load(path.read_bytes())),
        metadata={"shard": str(entry["shard"])},
    )
    path.write_bytes(payload)
    entry["bytes"], entry["sha256"] = len(payload), hashlib.sha256(payload).hexdigest()
    (root / checkpoint_manifest.MANIFEST_NAME).write_text(json.dumps(manifest))
    message = f"checkpoint file {path} does not hold ids (U64"
    with pytest.raises(CheckpointError, match=re.escape(message)):
        checkpoint_load.verify(root)
    _loaded_store_is_unchanged(tmp_path, root, re.escape(message))


def test_a_target_that_cannot_be_written_is_named(tmp_path):
    _, shards = trained_worker(1)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for target in (blocker / "ckpt", "/proc/recserve-ckpt"):
        with pytest.raises(CheckpointError, match=f"cannot write a checkpoint to {target}: "):
            checkpoint_dump.dump_embeddings(shards, target, CONFIG)


def test_version_names_the_rows_and_loaded_shards_report_it(tmp_path):
    _, shards = trained_worker(2)
    manifest = checkpoint_dump.dump_embeddings(shards, tmp_path / "ckpt", CONFIG)
    raw = json.loads((tmp_path / "ckpt" / checkpoint_manifest.MANIFEST_NAME).read_text())
    # A digest of the files' names and checksums: it names this checkpoint.
    expected = hashlib.sha256(
        "".join(
            f"{e.path}\0{e.sha256}\n" for e in sorted(manifest.files, key=lambda e: e.path)
        ).encode()
    ).hexdigest()[:16]
    assert raw["version"] == manifest.version == expected
    _, others = trained_worker(2, first_batch=5)
    assert checkpoint_dump.dump_embeddings(others, tmp_path / "other", CONFIG).version != expected
    # Loaded shards report it, whatever their count.
    target = make_shards(3)
    checkpoint_load.load_embeddings(tmp_path / "ckpt", target, CONFIG)
    assert [s.checkpoint_version for s in target] == [expected] * 3
    single = make_shards(1)[0]
    checkpoint_load.load_into_shard(
        tmp_path / "ckpt", single, CONFIG, replica_index=0, replica_size=1
    )
    assert single.checkpoint_version == expected
    # Manifests written before versions existed get the same one; a bad one is named.
    path = tmp_path / "ckpt" / checkpoint_manifest.MANIFEST_NAME
    del raw["version"]
    path.write_text(json.dumps(raw))
    assert checkpoint_manifest.read_manifest(tmp_path / "ckpt").version == expected
    for bad in ("", "UPPER", "a/b", 7, "x" * 65):
        path.write_text(json.dumps({**raw, "version": bad}))
        with pytest.raises(CheckpointError, match=f"version must be 1 to 64 .*got {bad!r}"):
            checkpoint_manifest.read_manifest(tmp_path / "ckpt")


def test_a_dump_removes_what_killed_dumps_of_this_host_left(tmp_path, caplog):
    import socket
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its PID is free now (reused only after the whole PID space wrapped)
    host = socket.gethostname()
    me = os.getpid()
    started = (Path(f"/proc/{me}/stat").read_text().rpartition(")")[2].split())[19]
    killed = tmp_path / f".ckpt.tmp-{host}-{gone.pid}-{started}-0123"
    running = tmp_path / f".ckpt.tmp-{host}-{me}-{started}-4567"  # a live writer
    # The same PID, started at another time: PID 1 of the previous container, say.
    reused = tmp_path / f".ckpt.tmp-{host}-{me}-{int(started) - 1}-aaaa"
    elsewhere = tmp_path / ".ckpt.tmp-other-host-1-5-89ab"
    older = tmp_path / ".ckpt.tmp-cdef"  # named before names said who wrote them
    for path in (killed, running, reused, elsewhere, older):
        (path / "shard_00000").mkdir(parents=True)
    _, shards = trained_worker(1)
    with caplog.at_level(logging.INFO, logger="embedding_store.checkpoint_publish"):
        checkpoint_dump.dump_embeddings(shards, tmp_path / "ckpt", CONFIG)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["ckpt", running.name, elsewhere.name, older.name]
    )
    messages = [r.getMessage() for r in caplog.records]
    assert f"removed {killed}, left by an interrupted dump (process {gone.pid} is gone)" in (
        messages
    )
    assert f"removed {reused}, left by an interrupted dump (process {me} is gone)" in messages
    assert (
        f"{tmp_path} has staging directories of other dumps: "
        f"{older.name}, {elsewhere.name}, {running.name} (still running elsewhere, or "
        "interrupted: remove them when no dump to ckpt runs)"
    ) in messages


def test_overwrite_replaces_only_a_checkpoint(tmp_path):
    # Replacing deletes the old directory: a directory that is no checkpoint (a mistyped
    # path, or a peer's Dump RPC aimed at someone's data) is never replaced.
    _, shards = trained_worker(1)
    victim = tmp_path / "data"
    (victim / "sub").mkdir(parents=True)
    (victim / "important.txt").write_text("keep me")
    with pytest.raises(AlreadyExistsError, match="is not a recserve checkpoint"):
        checkpoint_dump.dump_embeddings(shards, victim, CONFIG, overwrite=True)
    assert (victim / "important.txt").read_text() == "keep me" and (victim / "sub").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # no staging left
    # Refused before the dump is written (not lost at the end); an empty directory is fine.
    (tmp_path / "empty").mkdir()
    checkpoint_dump.dump_embeddings(shards, tmp_path / "empty", CONFIG, overwrite=True)
    checkpoint_manifest.read_manifest(tmp_path / "empty")
    (tmp_path / "empty2").mkdir()
    checkpoint_dump.dump_embeddings(shards, tmp_path / "empty2", CONFIG)
    checkpoint_dump.dump_embeddings(shards, tmp_path / "ckpt", CONFIG)
    (tmp_path / "ckpt" / "stale.txt").write_text("x")
    checkpoint_dump.dump_embeddings(shards, tmp_path / "ckpt", CONFIG, overwrite=True)
    assert not (tmp_path / "ckpt" / "stale.txt").exists()  # a checkpoint is replaced


class _TrainedBetweenDims(EmbeddingShard):
    """A shard on which training runs as soon as the rows of dim 3 have been exported: ten
    new rows of dim 8 evict the (least recently used) rows of dim 3."""

    def export_rows(self, dim: int):
        block = super().export_rows(dim)
        if dim == 3:
            self.lookup(np.arange(1000, 1010, dtype=np.uint64), 8, train=True)
        return block


def test_a_dump_is_the_shard_at_one_instant_while_training_goes_on(tmp_path):
    """Dims exported one at a time held, together, old rows of one dim and new rows of the
    other: more than the capacity, a checkpoint no shard could load back."""
    shard = _TrainedBetweenDims(12, optimizer=SGD(lr=0.1))
    shard.lookup(np.arange(10, dtype=np.uint64), 3, train=True)
    shard.lookup(np.arange(100, 102, dtype=np.uint64), 8, train=True)  # 12 rows: full
    rows = {dim: EmbeddingShard.export_rows(shard, dim).ids.tolist() for dim in (3, 8)}
    manifest = checkpoint_dump.dump_embeddings([shard], tmp_path / "ckpt", CONFIG_3_8)
    assert manifest.total_rows == 12
    loaded = EmbeddingShard(12, optimizer=SGD(lr=0.1))
    checkpoint_load.load_embeddings(tmp_path / "ckpt", [loaded], CONFIG_3_8)
    assert {dim: loaded.export_rows(dim).ids.tolist() for dim in (3, 8)} == rows


def test_every_file_and_the_directory_it_is_published_in_are_fsynced(tmp_path, monkeypatch):
    """Renames are atomic, not durable: after a power cut a renamed file whose data was never
    flushed can read back empty. Every file is fsynced (renames keep the inode), and so is
    the directory the checkpoint is renamed into."""
    _, shards = trained_worker(2)
    synced: set[tuple[int, int]] = set()
    real_fsync = os.fsync

    def recording_fsync(fd):
        status = os.fstat(fd)
        synced.add((status.st_dev, status.st_ino))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    checkpoint_dump.dump_embeddings(shards, tmp_path / "ckpt", CONFIG)
    files = [p for p in (tmp_path / "ckpt").rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {
        checkpoint_manifest.MANIFEST_NAME,
        checkpoint_manifest.DONE_MARKER,
    }
    for path in [*files, tmp_path]:
        status = path.stat()
        assert (status.st_dev, status.st_ino) in synced, f"{path} was not fsynced"


def test_the_done_marker_is_written_only_after_the_manifest(tmp_path, monkeypatch):
    real_write = checkpoint_dump.write_atomic

    def failing_manifest(path, payload):
        if path.name == checkpoint_manifest.MANIFEST_NAME:
            raise CheckpointError(f"cannot write {path}: disk full")
        real_write(path, payload)

    monkeypatch.setattr(checkpoint_dump, "write_atomic", failing_manifest)
    staging = tmp_path / "staging"
    staging.mkdir()
    with pytest.raises(CheckpointError, match="disk full"):
        checkpoint_dump.finalize_checkpoint(staging, CONFIG, 1, [], None)
    assert not (staging / checkpoint_manifest.DONE_MARKER).exists()


def test_the_version_is_a_digest_of_the_files_whatever_their_order(tmp_path):
    """Shard processes report their files in any order: the version names the set."""
    _, shards = trained_worker(2)
    manifest = checkpoint_dump.dump_embeddings(shards, tmp_path / "ckpt", CONFIG)
    files = list(manifest.files)
    assert len(files) == 4
    for order in (files, files[::-1], files[1:] + files[:1]):
        assert checkpoint_manifest.content_version(order) == manifest.version
    moved = [files[0], files[2], files[1], files[3]]
    checkpoint_dump.finalize_checkpoint(tmp_path / "ckpt", CONFIG, 2, moved, None)
    assert checkpoint_manifest.read_manifest(tmp_path / "ckpt").version == manifest.version


def test_a_shard_one_row_too_small_is_refused_before_any_shard_changes(tmp_path):
    _, shards = trained_worker(1)
    manifest = checkpoint_dump.dump_embeddings(shards, tmp_path / "ckpt", CONFIG)
    counts = checkpoint_load.count_rows_per_replica(manifest, 2)

    def two_shards(second_capacity: int) -> list[EmbeddingShard]:
        return [
            EmbeddingShard(100_000, optimizer=Adagrad(lr=0.1), replica_index=0, replica_size=2),
            EmbeddingShard(
                second_capacity, optimizer=Adagrad(lr=0.1), replica_index=1, replica_size=2
            ),
        ]

    short = two_shards(counts[1] - 1)
    with pytest.raises(CheckpointError, match=f"more than its capacity {counts[1] - 1}"):
        checkpoint_load.load_embeddings(tmp_path / "ckpt", short, CONFIG)
    assert [s.size() for s in short] == [0, 0]
    exact = two_shards(counts[1])
    checkpoint_load.load_embeddings(tmp_path / "ckpt", exact, CONFIG)
    assert [s.size() for s in exact] == counts


def _with_negative_state(root: Path, shard: int) -> Path:
    """Give the last file of ``shard`` a negative Adagrad accumulator (size and checksum to
    match); returns the file's path."""
    import safetensors.numpy

    manifest = json.loads((root / checkpoint_manifest.MANIFEST_NAME).read_text())
    entry = [e for e in manifest["files"] if e["shard"] == shard][-1]
    path = root / entry["path"]
    tensors = dict(safetensors.numpy.load(path.read_bytes()))
    tensors["state"] = tensors["state"].copy()
    tensors["state"][0, 0] = -1.0
    payload = safetensors.numpy.save(tensors, metadata={"shard": str(entry["shard"])})
    path.write_bytes(payload)
    entry["bytes"], entry["sha256"] = len(payload), hashlib.sha256(payload).hexdigest()
    (root / checkpoint_manifest.MANIFEST_NAME).write_text(json.dumps(manifest))
    return path


def test_negative_saved_state_is_refused_naming_the_file_before_any_shard_changes(tmp_path):
    # The shard refused it only in replace_rows: the first shard had taken its rows by then,
    # and the error was a bad argument naming no file.
    _, shards = trained_worker(2)
    root = tmp_path / "ckpt"
    checkpoint_dump.dump_embeddings(shards, root, CONFIG)
    path = _with_negative_state(root, shard=1)
    message = f"checkpoint file {path}: optimizer state: adagrad accumulators must be >= 0"
    _loaded_store_is_unchanged(tmp_path, root, re.escape(message))


def test_negative_saved_state_leaves_a_shard_without_the_optimizer_it_would_adopt(tmp_path):
    _, shards = trained_worker(1)
    root = tmp_path / "ckpt"
    checkpoint_dump.dump_embeddings(shards, root, CONFIG)
    _with_negative_state(root, shard=0)
    shard = EmbeddingShard(100_000)
    with pytest.raises(CheckpointError, match="adagrad accumulators must be >= 0"):
        checkpoint_load.load_into_shard(
            root, shard, CONFIG, replica_index=0, replica_size=1, adopt_optimizer=True
        )
    assert shard.optimizer is None  # "on any error it is unchanged"
    assert shard.size() == 0


def _with_duplicate_ids(root: Path, shard: int) -> tuple[Path, int]:
    """Rewrite the last file of ``shard`` as its writer would, but with IDs repeated: rows 5
    and 9 take row 1's ID, row 7 takes row 3's (size and checksum to match). Returns the
    file's path and the first repeated ID."""
    import safetensors.numpy
    from safetensors import safe_open

    manifest = json.loads((root / checkpoint_manifest.MANIFEST_NAME).read_text())
    entry = [e for e in manifest["files"] if e["shard"] == shard][-1]
    path = root / entry["path"]
    with safe_open(str(path), framework="numpy") as handle:
        metadata = handle.metadata()
    assert metadata["shard"] == str(shard)  # the writer's own metadata, kept below
    tensors = dict(safetensors.numpy.load(path.read_bytes()))
    ids = tensors["ids"].copy()
    assert len(ids) >= 10 and len(np.unique(ids)) == len(ids)
    ids[5] = ids[9] = ids[1]
    ids[7] = ids[3]
    tensors["ids"] = ids
    payload = safetensors.numpy.save(tensors, metadata=metadata)
    path.write_bytes(payload)
    entry["bytes"], entry["sha256"] = len(payload), hashlib.sha256(payload).hexdigest()
    (root / checkpoint_manifest.MANIFEST_NAME).write_text(json.dumps(manifest))
    return path, int(ids[1])


def test_a_file_holding_an_id_twice_is_refused_naming_it_before_any_shard_changes(tmp_path):
    # It loaded silently: the later row won in the shard, the earlier one was lost.
    _, shards = trained_worker(2)
    root = tmp_path / "ckpt"
    checkpoint_dump.dump_embeddings(shards, root, CONFIG)
    path, first = _with_duplicate_ids(root, shard=1)
    message = (
        f"checkpoint file {path} holds duplicate IDs: 2 IDs appear more than once, the "
        f"first being {first} (rows 1 and 5); each ID may appear only once per file"
    )
    with pytest.raises(CheckpointError) as raised:
        checkpoint_load.verify(root)
    assert raised.value.message == message
    with pytest.raises(CheckpointError, match=re.escape(message)):
        checkpoint_load.count_rows_per_replica(checkpoint_manifest.read_manifest(root), 3)
    # Shard 1's file is read last: shard 0 would have taken its rows already.
    _loaded_store_is_unchanged(tmp_path, root, re.escape(message))
    shard = EmbeddingShard(100_000, optimizer=Adagrad(lr=0.1), replica_index=1, replica_size=2)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        checkpoint_load.load_into_shard(root, shard, CONFIG, replica_index=1, replica_size=2)
    assert shard.size() == 0


def test_a_file_holding_an_id_twice_is_reported_by_checkpoint_verify(tmp_path):
    from clients import checkpoint_inspect

    _, shards = trained_worker(1)
    root = tmp_path / "ckpt"
    checkpoint_dump.dump_embeddings(shards, root, CONFIG)
    path, first = _with_duplicate_ids(root, shard=0)
    problems, _summary = checkpoint_inspect.verify(root)
    assert problems == [
        f"checkpoint file {path} holds duplicate IDs: 2 IDs appear more than once, the "
        f"first being {first} (rows 1 and 5); each ID may appear only once per file"
    ]


def test_ids_repeated_only_across_files_and_large_ids_are_not_duplicates(tmp_path):
    # Each file is checked on its own; IDs with the top bit set compare as unsigned.
    path = tmp_path / "f.safetensors"
    checkpoint_load._check_unique_ids(path, np.array([2**64 - 1, 2**63, 0, 1], dtype=np.uint64))
    checkpoint_load._check_unique_ids(path, np.zeros(1, dtype=np.uint64))
    checkpoint_load._check_unique_ids(path, np.zeros(0, dtype=np.uint64))
    with pytest.raises(
        CheckpointError,
        match=re.escape(
            f"checkpoint file {path} holds duplicate IDs: 1 ID appears more than once, the "
            f"first being {2**64 - 1} (rows 1 and 3)"
        ),
    ):
        checkpoint_load._check_unique_ids(path, np.array([5, 2**64 - 1, 6, 2**64 - 1], np.uint64))


def _lru_order(shard: EmbeddingShard) -> list[int]:
    """The shard's IDs over all dims, least recently used first."""
    blocks = list(shard.export_all().values())
    ids = np.concatenate([b.ids for b in blocks])
    return ids[np.argsort(np.concatenate([b.recency for b in blocks]))].tolist()


def test_a_reshard_keeps_each_rows_lru_rank_whichever_way(tmp_path):
    """1 -> 3 shards: each new shard holds its rows in the source's LRU order. 3 -> 1: the
    old shards' orders interleave by rank (no row of rank k after one of rank k + 1), each
    old shard's order kept."""
    source = EmbeddingShard(100, optimizer=Adagrad(lr=0.1))
    rng = np.random.default_rng(3)
    order = rng.permutation(40).astype(np.uint64)  # IDs < 20 at dim 8, the others at dim 3
    for i in order:
        source.lookup(np.array([i], np.uint64), 8 if i < 20 else 3, train=True)
    assert _lru_order(source) == order.tolist()
    checkpoint_dump.dump_embeddings([source], tmp_path / "one", CONFIG)
    three = make_shards(3)
    checkpoint_load.load_embeddings(tmp_path / "one", three, CONFIG)
    owners = shard_of(order, 3)
    for index, shard in enumerate(three):
        assert _lru_order(shard) == order[owners == index].tolist()

    checkpoint_dump.dump_embeddings(three, tmp_path / "three", CONFIG)
    one = make_shards(1)
    checkpoint_load.load_embeddings(tmp_path / "three", one, CONFIG)
    merged = _lru_order(one[0])
    rank = {i: r for shard in three for r, i in enumerate(_lru_order(shard))}
    assert sorted(merged) == sorted(order.tolist())
    assert [rank[i] for i in merged] == sorted(rank[i] for i in merged)
    for index, shard in enumerate(three):
        assert [i for i in merged if owners[order.tolist().index(i)] == index] == _lru_order(shard)
