"""Checkpoints whose weights hold NaN or Inf are refused by every reader (serving, resuming,
`recserve checkpoint inspect|verify`, without loading code too), naming the file, the
tensor and the first bad value; the feature signature is checked against the embedding
config. Tiny checkpoints written once per module and copied, then edited with their
manifests' checksums kept right."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from pathlib import Path
from typing import List  # noqa: UP035  (TorchScript reads the forward signature)

import numpy as np
import pytest
import safetensors.numpy
import torch
from safetensors import safe_open
from torch import nn

from clients import checkpoint_inspect
from embedding_store import checkpoint_dump, checkpoint_load, model_checkpoint
from embedding_store.cli import main as cli_main
from embedding_store.config import embedding_config_from_mapping
from embedding_store.errors import CheckpointError
from embedding_store.optimizers import Adagrad
from embedding_store.shard import EmbeddingShard, RowBlock
from embedding_store.signature import FeatureSignature, IdFeatureSpec, NonIdFeatureSpec
from embedding_store.tier import InProcessEmbeddingTier
from serving.model import load_model

CONFIG = embedding_config_from_mapping({"slots_config": {"user": {"dim": 2}}})
SIGNATURE = FeatureSignature(
    (IdFeatureSpec("user", True),), (NonIdFeatureSpec("dense", "float32", (1,)),)
)
IDS = np.arange(1, 6, dtype=np.uint64)  # rows 0..4 hold IDs 1..5
EMB_FILE = "embeddings/shard_00000/dim_2.safetensors"


class Masked(nn.Module):
    """A linear layer and a -inf mask buffer (as an attention mask: a legitimate Inf)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 1)
        self.register_buffer("mask", torch.tensor([0.0, float("-inf")]))

    def forward(
        self,
        non_id_tensors: List[torch.Tensor],  # noqa: UP006
        embedding_tensors: List[torch.Tensor],  # noqa: UP006
    ) -> torch.Tensor:
        return self.linear(torch.cat(embedding_tensors + non_id_tensors, dim=1))


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    tier = InProcessEmbeddingTier(CONFIG, capacity=100)
    weights = np.arange(10, dtype=np.float32).reshape(5, 2) / 10
    tier.shards[0].import_rows(RowBlock(IDS, weights, None))
    root = tmp_path_factory.mktemp("integrity") / "ckpt"
    model_checkpoint.write_checkpoint(root, Masked(), None, tier, step=3, signature=SIGNATURE)
    return root


@pytest.fixture
def checkpoint(written: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "ckpt"
    shutil.copytree(written, copy)
    return copy


def _tier() -> InProcessEmbeddingTier:
    return InProcessEmbeddingTier(CONFIG, capacity=100)


def _rehash(manifest_path: Path, key: str, payload: bytes) -> None:
    """Record ``payload`` as the file ``key`` of the manifest at ``manifest_path``."""
    raw = json.loads(manifest_path.read_text())
    files = raw["files"]
    entry = files[key] if isinstance(files, dict) else next(e for e in files if e["path"] == key)
    entry["bytes"], entry["sha256"] = len(payload), hashlib.sha256(payload).hexdigest()
    manifest_path.write_text(json.dumps(raw))


def _poison_embeddings(root: Path, tensor: str, row: int, column: int, value: float) -> Path:
    path = root / EMB_FILE
    with safe_open(str(path), framework="numpy") as handle:
        metadata = handle.metadata()
    tensors = {k: v.copy() for k, v in safetensors.numpy.load(path.read_bytes()).items()}
    tensors[tensor][row, column] = value
    payload = safetensors.numpy.save(tensors, metadata=metadata)
    path.write_bytes(payload)
    _rehash(
        root / "embeddings" / "embedding_manifest.json", "shard_00000/dim_2.safetensors", payload
    )
    return path


def _poison_dense(root: Path, name: str, index: tuple[int, ...], value: float) -> None:
    """Set ``name`` at ``index`` in dense.pt and, for the same weight, in jit_dense.pt."""
    state = torch.load(root / "dense.pt", weights_only=True)
    state[name][index] = value
    buffer = io.BytesIO()
    torch.save(state, buffer)
    (root / "dense.pt").write_bytes(buffer.getvalue())
    _rehash(root / "manifest.json", "dense.pt", buffer.getvalue())
    module = torch.jit.load(str(root / "jit_dense.pt"))  # written here: no foreign code
    with torch.no_grad():
        dict(module.named_parameters(), **dict(module.named_buffers()))[name][index] = value
    buffer = io.BytesIO()
    torch.jit.save(module, buffer)
    (root / "jit_dense.pt").write_bytes(buffer.getvalue())
    _rehash(root / "manifest.json", "jit_dense.pt", buffer.getvalue())


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_embedding_rows_with_nan_or_inf_are_refused_by_every_reader(
    checkpoint: Path, value: float, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _poison_embeddings(checkpoint, "weights", 3, 1, value)
    message = (
        f"checkpoint file {path} is corrupt: its weights tensor holds 1 non-finite value(s) "
        f"(NaN or Inf), the first at [3, 1]: {value!r} (the row of ID 4)"
    )
    with pytest.raises(CheckpointError) as raised:  # what serving loads
        load_model(checkpoint, name="m", warm_up=False, onednn_min_rows=0)
    assert raised.value.message == message
    tier = InProcessEmbeddingTier(CONFIG, capacity=100)  # what resuming training loads into
    with pytest.raises(CheckpointError) as raised:
        model_checkpoint.load_checkpoint(checkpoint, Masked(), None, tier)
    assert raised.value.message == message
    assert tier.shards[0].size() == 0
    assert checkpoint_inspect.verify(checkpoint)[0] == [message]
    capsys.readouterr()
    assert cli_main(["checkpoint", "inspect", "--verify", str(checkpoint)]) == 1
    assert f"  PROBLEM: {message}" in capsys.readouterr().out.splitlines()


def test_optimizer_state_is_refused_with_nan_but_not_with_inf(tmp_path: Path) -> None:
    """Adagrad's kernel stores +Inf accumulators for huge gradients (the row stays finite):
    those load; a NaN accumulator would make its row NaN at the next update."""
    shard = EmbeddingShard(100, optimizer=Adagrad(lr=0.1))
    shard.replace_rows([RowBlock(IDS, np.ones((5, 2), np.float32), np.ones((5, 2), np.float32))])
    root = tmp_path / "emb"
    checkpoint_dump.dump_embeddings([shard], root, CONFIG)
    path = root / "shard_00000" / "dim_2.safetensors"
    tensors = {k: v.copy() for k, v in safetensors.numpy.load(path.read_bytes()).items()}
    for value, refused in ((float("inf"), False), (float("nan"), True)):
        tensors["state"][2, 0] = value
        payload = safetensors.numpy.save(tensors, metadata={"shard": "0"})
        path.write_bytes(payload)
        _rehash(root / "embedding_manifest.json", "shard_00000/dim_2.safetensors", payload)
        if not refused:
            checkpoint_load.verify(root)
            continue
        with pytest.raises(CheckpointError) as raised:
            checkpoint_load.verify(root)
        assert raised.value.message == (
            f"checkpoint file {path} is corrupt: its state tensor holds 1 NaN value(s), the "
            "first at [2, 0]: nan (the row of ID 3)"
        )


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_dense_weights_with_nan_or_inf_are_refused_by_serving_resuming_and_the_tools(
    checkpoint: Path, value: float, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without loading code too: `verify` and `inspect` refused NaN in dense.pt but took
    +-Inf in a weight (a state dict does not tell weights from buffers, which may hold
    Inf); the manifest lists the parameters now."""
    _poison_dense(checkpoint, "linear.weight", (0, 2), value)
    bad = (
        f"tensor 'linear.weight' holds 1 non-finite value(s) (NaN or Inf), the first at "
        f"[0, 2]: {value!r}"
    )
    dense = f"{checkpoint / 'dense.pt'} is corrupt: {bad}"
    with pytest.raises(CheckpointError) as raised:
        load_model(checkpoint, name="m", warm_up=False, onednn_min_rows=0)
    assert raised.value.message == f"{checkpoint / 'jit_dense.pt'} is corrupt: {bad}"
    model = Masked()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as raised:
        model_checkpoint.load_checkpoint(
            checkpoint, model, None, InProcessEmbeddingTier(CONFIG, capacity=100)
        )
    assert raised.value.message == dense
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert checkpoint_inspect.verify(checkpoint)[0] == [dense]
    with pytest.raises(CheckpointError) as raised:  # the training side's verify
        model_checkpoint.verify(checkpoint)
    assert raised.value.message == dense
    capsys.readouterr()
    assert cli_main(["checkpoint", "verify", str(checkpoint)]) == 1
    assert capsys.readouterr().err.splitlines()[1:] == [f"  - {dense}"]
    assert cli_main(["checkpoint", "inspect", str(checkpoint)]) == 1  # no --verify needed
    assert capsys.readouterr().out.splitlines()[-1] == f"  PROBLEM: {dense}"
    assert cli_main(["checkpoint", "inspect", "--verify", str(checkpoint)]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == f"  PROBLEM: {dense}"


def test_a_checkpoint_that_lists_no_dense_parameters_is_checked_for_nan_as_before(
    checkpoint: Path,
) -> None:
    """Checkpoints written before the manifest listed the parameters still verify; without
    the model at hand only NaN tells in their dense.pt (a resume checks Inf against the
    model's parameters)."""
    raw = json.loads((checkpoint / "manifest.json").read_text())
    assert raw.pop("dense_parameters") == ["linear.weight", "linear.bias"]
    (checkpoint / "manifest.json").write_text(json.dumps(raw))
    assert checkpoint_inspect.verify(checkpoint)[0] == []
    _poison_dense(checkpoint, "linear.bias", (0,), float("inf"))
    assert checkpoint_inspect.verify(checkpoint)[0] == []
    with pytest.raises(CheckpointError) as raised:
        model_checkpoint.load_checkpoint(checkpoint, Masked(), None, _tier())
    assert raised.value.message == (
        f"{checkpoint / 'dense.pt'} is corrupt: tensor 'linear.bias' holds 1 non-finite "
        "value(s) (NaN or Inf), the first at [0]: inf"
    )
    _poison_dense(checkpoint, "linear.bias", (0,), float("nan"))
    assert checkpoint_inspect.verify(checkpoint)[0] == [
        f"{checkpoint / 'dense.pt'} is corrupt: tensor 'linear.bias' holds 1 NaN value(s), "
        "the first at [0]: nan"
    ]


def test_inf_is_refused_in_a_dense_parameter_but_kept_in_a_buffer(checkpoint: Path) -> None:
    """The written model's -inf mask buffer loads everywhere (above, unchanged); an Inf in a
    parameter is refused by every reader (test above); here: resuming, serving and
    `verify`, which takes the mask too."""
    assert checkpoint_inspect.verify(checkpoint)[0] == []
    model = Masked()
    model_checkpoint.load_checkpoint(checkpoint, model, None, _tier())
    assert model.mask.tolist() == [0.0, float("-inf")]
    load_model(checkpoint, name="m", warm_up=False, onednn_min_rows=0).close()
    _poison_dense(checkpoint, "linear.bias", (0,), float("inf"))
    with pytest.raises(CheckpointError) as raised:
        model_checkpoint.load_checkpoint(checkpoint, Masked(), None, _tier())
    assert raised.value.message == (
        f"{checkpoint / 'dense.pt'} is corrupt: tensor 'linear.bias' holds 1 non-finite "
        "value(s) (NaN or Inf), the first at [0]: inf"
    )
    with pytest.raises(CheckpointError) as raised:
        load_model(checkpoint, name="m", warm_up=False, onednn_min_rows=0)
    assert raised.value.message.startswith(
        f"{checkpoint / 'jit_dense.pt'} is corrupt: tensor 'linear.bias' holds 1 non-finite"
    )
    assert checkpoint_inspect.verify(checkpoint)[0] == [
        f"{checkpoint / 'dense.pt'} is corrupt: tensor 'linear.bias' holds 1 non-finite "
        "value(s) (NaN or Inf), the first at [0]: inf"
    ]


def test_verify_names_an_id_feature_the_embedding_config_has_no_slot_for(
    checkpoint: Path,
) -> None:
    raw = json.loads((checkpoint / "manifest.json").read_text())
    raw["signature"]["id_features"].append({"name": "item", "single_id": True})
    (checkpoint / "manifest.json").write_text(json.dumps(raw))
    assert checkpoint_inspect.verify(checkpoint)[0] == [
        f"{checkpoint / 'manifest.json'}: the feature signature's ID feature(s) ['item'] have "
        f"no slot in the embedding config of {checkpoint / 'embeddings'} (its slots: ['user'])"
    ]


def test_the_training_side_verify_checks_dense_values(checkpoint: Path) -> None:
    model_checkpoint.verify(checkpoint)
    _poison_dense(checkpoint, "linear.weight", (0, 0), float("nan"))
    with pytest.raises(CheckpointError) as raised:
        model_checkpoint.verify(checkpoint)
    assert raised.value.message == (
        f"{checkpoint / 'dense.pt'} is corrupt: tensor 'linear.weight' holds 1 non-finite "
        "value(s) (NaN or Inf), the first at [0, 0]: nan"
    )


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch: sparse invariant checks are off
def test_nan_is_found_in_nested_and_sparse_tensors() -> None:
    """An optimizer's state nests its tensors; a sparse tensor is checked by its values."""
    nested = {"state": {0: {"exp_avg": torch.tensor([[0.0, float("nan")]])}}, "lr": 0.1}
    with pytest.raises(CheckpointError) as raised:
        model_checkpoint.check_no_nan(nested, Path("ckpt/opt.pt"))
    assert raised.value.message == (
        "ckpt/opt.pt is corrupt: tensor 'state.0.exp_avg' holds 1 NaN value(s), the first at "
        "[0, 1]: nan"
    )
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 2], [1, 0]]), torch.tensor([1.0, 2.0]))
    model_checkpoint.check_no_nan({"table": sparse}, Path("ckpt/dense.pt"))
    sparse = torch.sparse_coo_tensor(
        torch.tensor([[0, 2], [1, 0]]), torch.tensor([1.0, float("nan")])
    )
    with pytest.raises(CheckpointError) as raised:
        model_checkpoint.check_no_nan({"table": sparse}, Path("ckpt/dense.pt"))
    assert raised.value.message == (
        "ckpt/dense.pt is corrupt: tensor 'table' holds 1 NaN value(s), the first at [1]: nan "
        "(among its stored values)"
    )
