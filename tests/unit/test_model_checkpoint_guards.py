"""Model checkpoint guards that mutation testing found untested: no pickle from disk, verify
checks the dense files, writing the TorchScript file leaves the model's modes alone, the
ranks' protocol around rank 0's write, and tools that refuse a checkpoint failing
verification. A tiny dense model with an empty in-process tier (fast)."""

from __future__ import annotations

import hashlib
import io
import json
import re
from pathlib import Path

import pytest
import torch

from embedding_store import model_checkpoint
from embedding_store.config import embedding_config_from_mapping
from embedding_store.errors import AlreadyExistsError, CheckpointError
from embedding_store.tier import InProcessEmbeddingTier

CONFIG = embedding_config_from_mapping({"slots_config": {"user": {"dim": 2}}})


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 1)
        self.dropout = torch.nn.Dropout(0.5)

    def forward(self, non_id_tensors: list[torch.Tensor], embedding_tensors: list[torch.Tensor]):
        return self.dropout(self.linear(torch.cat(embedding_tensors + non_id_tensors, dim=1)))


def _tier() -> InProcessEmbeddingTier:
    return InProcessEmbeddingTier(CONFIG, capacity=100)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("model-guards") / "ckpt"
    torch.manual_seed(0)
    model = Tiny()
    model_checkpoint.write_checkpoint(
        target, model, torch.optim.SGD(model.parameters(), lr=0.1), _tier(), with_jit_model=False
    )
    return target


@pytest.fixture
def checkpoint(written: Path, tmp_path: Path) -> Path:
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(written, copy)
    return copy


def _replace_file(root: Path, name: str, payload: bytes) -> None:
    """Put ``payload`` in ``root/name`` with the manifest's size and checksum to match."""
    (root / name).write_bytes(payload)
    path = root / "manifest.json"
    raw = json.loads(path.read_text())
    raw["files"][name] = {"bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    path.write_text(json.dumps(raw))


def _plant(path: str) -> str:
    Path(path).write_text("ran")
    return path


class _RunsOnLoad:
    """Pickles as a call of :func:`_plant`: unpickling it runs code."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (_plant, (self.path,))


def test_a_dense_file_that_runs_code_when_unpickled_is_refused(checkpoint: Path) -> None:
    marker = checkpoint.parent / "code-ran"
    buffer = io.BytesIO()
    torch.save({"linear.weight": _RunsOnLoad(str(marker))}, buffer)
    _replace_file(checkpoint, "dense.pt", buffer.getvalue())
    model = Tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        CheckpointError, match=re.escape(f"{checkpoint / 'dense.pt'} cannot be loaded: ")
    ):
        model_checkpoint.load_checkpoint(checkpoint, model, None, _tier())
    assert not marker.exists()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("name", ["dense.pt", "opt.pt"])
def test_verify_checks_every_dense_file(checkpoint: Path, name: str) -> None:
    payload = (checkpoint / name).read_bytes()
    (checkpoint / name).write_bytes(bytes([payload[0] ^ 1]) + payload[1:])
    with pytest.raises(CheckpointError) as raised:
        model_checkpoint.verify(checkpoint)
    assert raised.value.message == f"{checkpoint / name} is corrupt: SHA-256 mismatch"


def test_writing_the_jit_model_leaves_every_submodules_mode_as_it_was(tmp_path: Path) -> None:
    """A model that trains with a frozen part in eval mode (say, a pretrained layer): the
    dump used to put the whole model back with ``train(True)``, its frozen part included."""
    torch.manual_seed(0)
    model = Tiny()
    model.train()
    model.dropout.eval()
    manifest = model_checkpoint.write_checkpoint(tmp_path / "ckpt", model, None, _tier())
    assert model.training and model.linear.training and not model.dropout.training
    scripted = model_checkpoint.load_jit_model(manifest)
    assert not scripted.training and not scripted.dropout.training
    model.eval()
    model_checkpoint.write_checkpoint(tmp_path / "again", model, None, _tier())
    assert not any(module.training for module in model.modules())


# --------------------------------------------------------------------------- ranks
@pytest.mark.parametrize(
    ("rank", "fails", "others_agree", "expected"),
    [
        (0, False, True, ["barrier", "write", ("all_agree", True)]),
        (0, True, False, ["barrier", "write", ("all_agree", False)]),
        (1, False, True, ["barrier", ("all_agree", True)]),
        (1, False, False, ["barrier", ("all_agree", True)]),
    ],
)
def test_rank_0_writes_after_every_rank_and_its_failure_fails_every_rank(
    tmp_path, monkeypatch, rank: int, fails: bool, others_agree: bool, expected: list
) -> None:
    from training import checkpoint as training_checkpoint

    events: list = []
    monkeypatch.setattr(training_checkpoint.distributed, "rank", lambda: rank)
    # The checkpoint's own barrier and agreement (on the long-timeout group).
    monkeypatch.setattr(
        training_checkpoint.distributed, "checkpoint_barrier", lambda: events.append("barrier")
    )

    def all_agree(ok: bool) -> bool:
        events.append(("all_agree", ok))
        return ok and others_agree

    monkeypatch.setattr(training_checkpoint.distributed, "checkpoint_agree", all_agree)

    def write_checkpoint(directory, *args, **kwargs):
        events.append("write")
        if fails:
            raise AlreadyExistsError(f"checkpoint directory {directory} already exists")
        return "manifest"

    monkeypatch.setattr(training_checkpoint, "write_checkpoint", write_checkpoint)
    target = tmp_path / "ckpt"
    model = Tiny()
    if fails:
        with pytest.raises(AlreadyExistsError):
            training_checkpoint.dump_checkpoint(target, model, None, _tier())
    elif not others_agree:
        with pytest.raises(CheckpointError) as raised:
            training_checkpoint.dump_checkpoint(target, model, None, _tier())
        assert raised.value.message == (
            f"rank 0 failed to write checkpoint {target}; its log has the error"
        )
    else:
        result = training_checkpoint.dump_checkpoint(target, model, None, _tier())
        assert result == ("manifest" if rank == 0 else None)
    assert events == expected


# --------------------------------------------------------------------------- tools
def test_tools_refuse_a_checkpoint_that_fails_verification(checkpoint, tmp_path) -> None:
    """Every embedding file is intact, but the manifest miscounts the embedding rows: only
    verification sees it, and reshard and diff run it first."""
    from clients import checkpoint_diff, checkpoint_write

    path = checkpoint / "manifest.json"
    raw = json.loads(path.read_text())
    raw["embeddings"]["rows"] = 5
    path.write_text(json.dumps(raw))
    message = (
        f"checkpoint {checkpoint} failed verification:\n  - {path} says 5 embedding rows in 1 "
        f"shards, but {checkpoint / 'embeddings'} holds 0 rows in 1 shards"
    )
    out = tmp_path / "resharded"
    with pytest.raises(CheckpointError) as raised:
        checkpoint_write.reshard(checkpoint, 2, out)
    assert raised.value.message == message
    assert not out.exists()
    with pytest.raises(CheckpointError) as raised:
        checkpoint_diff.diff(checkpoint, checkpoint)
    assert raised.value.message == message
