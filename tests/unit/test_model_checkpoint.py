"""The model checkpoint format (embedding_store.model_checkpoint): manifest checks, checksums,
the atomic write and the all-or-nothing load, on a tiny dense model and an in-process tier."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch

from embedding_store import model_checkpoint
from embedding_store.config import embedding_config_from_mapping
from embedding_store.errors import CheckpointError, InvalidArgumentError
from embedding_store.model_checkpoint import (
    read_manifest,
    read_verified_file,
    verify,
    write_checkpoint,
)
from embedding_store.optimizers import SGD
from embedding_store.tier import InProcessEmbeddingTier

CONFIG = embedding_config_from_mapping({"slots_config": {"user": {"dim": 2}}})


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 1)

    def forward(self, non_id_tensors: list[torch.Tensor], embedding_tensors: list[torch.Tensor]):
        return self.linear(torch.cat(embedding_tensors + non_id_tensors, dim=1))


def _tier() -> InProcessEmbeddingTier:
    return InProcessEmbeddingTier(CONFIG, capacity=100, optimizer=SGD(lr=0.1))


def _write(target: Path, **kwargs) -> model_checkpoint.CheckpointManifest:
    torch.manual_seed(0)
    model = Tiny()
    return write_checkpoint(
        target, model, torch.optim.SGD(model.parameters(), lr=0.1), _tier(), **kwargs
    )


def _edit_manifest(directory: Path, edit) -> None:
    path = directory / "manifest.json"
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One checkpoint written once; tests copy it before damaging it."""
    target = tmp_path_factory.mktemp("model") / "ckpt"
    _write(target, step=12, with_jit_model=False, train_state={"epoch": 3})
    return target


@pytest.fixture
def checkpoint(written: Path, tmp_path: Path) -> Path:
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(written, copy)
    return copy


def test_manifest_records_step_version_files_and_train_state(checkpoint: Path) -> None:
    manifest = verify(checkpoint)
    assert manifest.step == 12 and manifest.train_state == {"epoch": 3}
    assert re.fullmatch(r"00000012-[0-9a-f]{8}", manifest.version)
    assert sorted(manifest.files) == ["dense.pt", "opt.pt"]
    assert not manifest.has_jit_model
    for name, entry in manifest.files.items():
        payload = (checkpoint / name).read_bytes()
        assert entry == {"bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    assert manifest.dense_optimizer_class == "torch.optim.sgd.SGD"
    assert manifest.model_class.endswith("test_model_checkpoint.Tiny")


def test_a_checkpoint_without_its_done_marker_is_incomplete(checkpoint: Path) -> None:
    (checkpoint / "DONE").unlink()
    with pytest.raises(CheckpointError, match=r"is incomplete: no DONE marker"):
        read_manifest(checkpoint)


def test_a_directory_of_checkpoints_is_named_so_with_the_ones_it_holds(tmp_path: Path) -> None:
    """`recserve serve --checkpoint runs` (or `checkpoint verify runs`) for runs/adult: each
    said "checkpoint runs is incomplete: no DONE marker (the write did not finish)"."""
    from clients.checkpoint_common import checkpoint_kind
    from embedding_store import checkpoint_manifest

    runs = tmp_path / "runs"
    for name in ("click", "adult", ".adult.old-1", "notes"):
        (runs / name).mkdir(parents=True)
    for name in ("click", "adult", ".adult.old-1"):  # a hidden retired copy is not offered
        (runs / name / "DONE").touch()
    expected = (
        f"{runs} is not a checkpoint (no DONE marker) but a directory of them: "
        f"{runs / 'adult'}, {runs / 'click'}; give one of them"
    )
    for read in (read_manifest, checkpoint_manifest.read_manifest, checkpoint_kind):
        with pytest.raises(CheckpointError) as raised:
            read(runs)
        assert raised.value.message == expected
    with pytest.raises(CheckpointError) as raised:  # nothing finished inside: incomplete
        read_manifest(runs / "notes")
    assert raised.value.message == f"checkpoint {runs / 'notes'} is incomplete: no DONE marker"
    # One level higher still (`--checkpoint .` where runs/ holds them): said "incomplete".
    expected = (
        f"{tmp_path} is not a checkpoint (no DONE marker, no manifest); checkpoints below it: "
        f"{runs / 'adult'}, {runs / 'click'}; give one of them"
    )
    for read in (read_manifest, checkpoint_manifest.read_manifest, checkpoint_kind):
        with pytest.raises(CheckpointError) as raised:
            read(tmp_path)
        assert raised.value.message == expected


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.update(format="other"), "is not a recserve-checkpoint manifest"),
        (lambda m: m.pop("format"), "is not a recserve-checkpoint manifest"),
        (
            lambda m: m.update(format_version=2),
            "has checkpoint format version 2; this build reads version 1",
        ),
        (lambda m: m["files"]["dense.pt"].update(bytes=True), r"\.bytes must be an integer >= 0"),
        (lambda m: m["files"]["dense.pt"].update(bytes=1.0), r"\.bytes must be an integer >= 0"),
        (lambda m: m["files"].update({"..": m["files"]["dense.pt"]}), "'..' is not a plain"),
        (lambda m: m["files"].update({"": m["files"]["dense.pt"]}), "'' is not a plain name"),
        (lambda m: m.update(train_state=[1]), "train_state must be a mapping"),
        # int() would take these as 1, 12 and 1: a manifest says its counts as integers.
        (lambda m: m.update(step=1.5), r"step must be an integer >= 0, got 1\.5$"),
        (lambda m: m.update(step="12"), "step must be an integer >= 0, got '12'$"),
        (lambda m: m.update(step=-1), "step must be an integer >= 0, got -1$"),
        (
            lambda m: m["embeddings"].update(rows=True),
            "embeddings.rows must be an integer >= 0, got True$",
        ),
        (
            lambda m: m["embeddings"].update(shards=2.0),
            r"embeddings.shards must be an integer >= 0, got 2\.0$",
        ),
    ],
)
def test_manifest_problems_are_named(checkpoint: Path, edit, message: str) -> None:
    _edit_manifest(checkpoint, edit)
    with pytest.raises(CheckpointError, match=message):
        read_manifest(checkpoint)


def test_the_embedding_directory_is_named_when_read_as_a_model_checkpoint(checkpoint: Path) -> None:
    with pytest.raises(
        CheckpointError,
        match=re.escape(
            f"has no manifest.json: {checkpoint / 'embeddings'} is an embedding checkpoint, "
            f"part of the model checkpoint {checkpoint}"
        ),
    ):
        read_manifest(checkpoint / "embeddings")


def test_read_verified_file_checks_presence_size_and_digest(checkpoint: Path) -> None:
    manifest = read_manifest(checkpoint)
    assert read_verified_file(manifest, "opt.pt") == (checkpoint / "opt.pt").read_bytes()
    with pytest.raises(CheckpointError, match=r"has no jit_dense\.pt"):
        read_verified_file(manifest, "jit_dense.pt")
    original = (checkpoint / "opt.pt").read_bytes()
    (checkpoint / "opt.pt").write_bytes(original + b"x")
    with pytest.raises(
        CheckpointError, match=rf"has {len(original) + 1} bytes; the manifest says {len(original)}"
    ):
        read_verified_file(manifest, "opt.pt")
    flipped = bytes([original[0] ^ 1]) + original[1:]
    (checkpoint / "opt.pt").write_bytes(flipped)
    with pytest.raises(CheckpointError, match=r"opt\.pt is corrupt: SHA-256 mismatch"):
        read_verified_file(manifest, "opt.pt")


@pytest.mark.parametrize(
    ("train_state", "message"),
    [
        ({1: 2}, "train_state: 1 must name a number"),
        ({"seed": [1]}, r"'seed' must name a number, string, boolean or None, got \[1\]"),
        ({"loss": float("nan")}, "'loss' must be finite, got nan"),
        ("epoch=3", "train_state must be a mapping"),
    ],
)
def test_an_invalid_train_state_is_refused_before_anything_is_written(
    tmp_path: Path, train_state: object, message: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        _write(tmp_path / "ckpt", train_state=train_state, with_jit_model=False)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_leaves_neither_the_checkpoint_nor_its_staging_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoint appears by one rename of a complete staging directory; a failure part
    way removes the staging directory and publishes nothing."""
    calls = []
    real = model_checkpoint.checkpoint_publish.write_atomic

    def fail_on_the_manifest(path: Path, payload: bytes) -> None:
        calls.append(path.name)
        if path.name == "manifest.json":
            raise OSError("disk full")
        real(path, payload)

    monkeypatch.setattr(model_checkpoint.checkpoint_publish, "write_atomic", fail_on_the_manifest)
    with pytest.raises(OSError, match="disk full"):
        _write(tmp_path / "ckpt", with_jit_model=False)
    assert calls[-3:] == ["dense.pt", "opt.pt", "manifest.json"]  # after the embeddings
    assert list(tmp_path.iterdir()) == []


def test_writing_the_jit_model_keeps_the_models_training_mode(tmp_path: Path) -> None:
    """The TorchScript file is scripted in eval mode; the trainer's model stays as it was."""
    torch.manual_seed(0)
    model = Tiny()
    model.train()
    manifest = write_checkpoint(tmp_path / "ckpt", model, None, _tier())
    assert model.training
    assert manifest.has_jit_model and "opt.pt" not in manifest.files
    assert manifest.dense_optimizer_class == ""
    scripted = model_checkpoint.load_jit_model(manifest)
    assert not scripted.training


def _adam_with_state(model: torch.nn.Module, lr: float, steps: int) -> torch.optim.Adam:
    adam = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        adam.zero_grad()
        model.linear(torch.ones(1, 2)).sum().backward()
        adam.step()
    return adam


def test_a_load_that_fails_late_puts_back_weights_optimizer_and_scaler_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All or nothing: when the tier refuses the embeddings (after the dense weights, the
    optimizer's state and the loss scaler's state were loaded), all three are as before."""
    torch.manual_seed(0)
    saved_model = Tiny()
    saved_scaler = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=7)
    write_checkpoint(
        tmp_path / "ckpt",
        saved_model,
        _adam_with_state(saved_model, 0.1, 3),
        _tier(),
        with_jit_model=False,
        grad_scaler=saved_scaler,
    )
    torch.manual_seed(1)
    model = Tiny()
    adam = _adam_with_state(model, 0.01, 1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=3)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {k: v.clone() for k, v in adam.state_dict()["state"][0].items()}
    tier = _tier()

    def refuse(directory: Path) -> None:
        raise CheckpointError("refused by the tier")

    monkeypatch.setattr(tier, "load", refuse)
    with pytest.raises(CheckpointError, match="refused by the tier"):
        model_checkpoint.load_checkpoint(tmp_path / "ckpt", model, adam, tier, grad_scaler=scaler)
    for name, value in model.state_dict().items():
        assert torch.equal(value, weights[name]), name
    after = adam.state_dict()
    assert after["param_groups"][0]["lr"] == 0.01
    assert after["state"][0].keys() == moments.keys()
    for key, value in moments.items():
        assert torch.equal(torch.as_tensor(after["state"][0][key]), torch.as_tensor(value)), key
    assert scaler.state_dict()["scale"] == 8.0 and scaler.state_dict()["growth_interval"] == 3


def test_embeddings_swapped_after_the_dump_are_refused(checkpoint: Path) -> None:
    """The manifest records the version of the embedding snapshot written with the dense
    files; another snapshot in its place is refused instead of being served as this one."""
    from embedding_store import checkpoint_manifest

    manifest = read_manifest(checkpoint)
    actual = checkpoint_manifest.read_manifest(checkpoint / "embeddings").version
    assert manifest.embedding_version == actual != ""
    _edit_manifest(checkpoint, lambda m: m["embeddings"].update(version="another-snapshot"))
    with pytest.raises(
        CheckpointError,
        match=rf"holds embedding checkpoint {actual}, but .* was written with another-snapshot",
    ):
        verify(checkpoint)


class Wrapper(torch.nn.Module):
    """What DistributedDataParallel looks like from here: the model under ``.module``."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.module = inner


def test_a_wrapped_model_is_saved_and_loaded_as_the_model_inside(tmp_path: Path) -> None:
    torch.manual_seed(0)
    inner = Tiny()
    manifest = write_checkpoint(
        tmp_path / "ckpt", Wrapper(inner), None, _tier(), with_jit_model=False
    )
    assert manifest.model_class.endswith(".Tiny")
    state = model_checkpoint.load_state(manifest, "dense.pt")
    assert sorted(state) == ["linear.bias", "linear.weight"]
    torch.manual_seed(1)
    other = Wrapper(Tiny())
    model_checkpoint.load_checkpoint(tmp_path / "ckpt", other, None, _tier())
    assert torch.equal(other.module.linear.weight, inner.linear.weight)
    assert torch.equal(other.module.linear.bias, inner.linear.bias)


def test_a_checkpoint_without_optimizer_state_leaves_the_optimizer_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No opt.pt: the weights load and the run's optimizer keeps its state; with
    load_embeddings=False the tier is not touched at all."""
    torch.manual_seed(0)
    saved = Tiny()
    write_checkpoint(tmp_path / "ckpt", saved, None, _tier(), with_jit_model=False)
    torch.manual_seed(1)
    model = Tiny()
    adam = _adam_with_state(model, 0.01, 2)
    before = {k: v.clone() for k, v in adam.state_dict()["state"][0].items()}
    tier = _tier()

    def refuse(directory: Path) -> None:
        raise AssertionError("the tier must not load")

    monkeypatch.setattr(tier, "load", refuse)
    model_checkpoint.load_checkpoint(tmp_path / "ckpt", model, adam, tier, load_embeddings=False)
    assert torch.equal(model.linear.weight, saved.linear.weight)
    after = adam.state_dict()["state"][0]
    for key, value in before.items():
        assert torch.equal(torch.as_tensor(after[key]), torch.as_tensor(value)), key


class Spliced(Tiny):
    """A forward TorchScript refuses (`*` splices a list of unknown length)."""

    def forward(self, non_id_tensors: list[torch.Tensor], embedding_tensors: list[torch.Tensor]):
        return self.linear(torch.cat([*embedding_tensors, *non_id_tensors], dim=1))


def test_a_model_torchscript_refuses_is_told_what_the_way_out_costs(tmp_path):
    """The error names the contract and says what with_jit_model=False gives up: serving (the
    server's own error then sends the user back to with_jit_model=True)."""
    with pytest.raises(InvalidArgumentError) as refused:
        write_checkpoint(tmp_path / "ckpt", Spliced(), None, _tier())
    message = refused.value.message
    assert message.startswith("cannot TorchScript Spliced: ")
    assert message.endswith(
        "The dense model's forward must be `forward(self, non_id_tensors: List[Tensor], "
        'embedding_tensors: List[Tensor])` and scriptable (docs/own_model.md, "The model '
        'contract"). with_jit_model=False writes the checkpoint without jit_dense.pt: training '
        "resumes from it, but recserve serve and InferCtx, which run the TorchScript model, "
        "cannot load it"
    )
    assert not (tmp_path / "ckpt").exists()
