"""A served model outside the fallback policy and the oneDNN path: which output transforms it
takes, what warm-up refuses, and how ``infer`` splits its time."""

from __future__ import annotations

import time
from pathlib import Path
from typing import List  # noqa: UP035  (TorchScript reads the forward signature)

import numpy as np
import pytest
import torch
from torch import nn

from embedding_store import model_checkpoint
from embedding_store.batch import Batch, IDTypeFeatureWithSingleID, NonIDTypeFeature
from embedding_store.errors import CheckpointError, InvalidArgumentError
from embedding_store.tier import InProcessEmbeddingTier
from serving.model import error_summary, load_model
from tests.unit.test_fallback_policy import _batch
from tests.unit.test_onednn_linear import CONFIG, SIGNATURE, Mlp, _checkpoint


class TwoColumns(nn.Module):
    """Returns [batch, 2]: the right number of rows, not one score per row."""

    def forward(
        self,
        non_id_tensors: List[torch.Tensor],  # noqa: UP006
        embedding_tensors: List[torch.Tensor],  # noqa: UP006
    ) -> torch.Tensor:
        return torch.cat(embedding_tensors + non_id_tensors, dim=1)[:, :2]


class SumsTheBatch(nn.Module):
    """Returns [1, 1] whatever the batch: right for a batch of one only."""

    def forward(
        self,
        non_id_tensors: List[torch.Tensor],  # noqa: UP006
        embedding_tensors: List[torch.Tensor],  # noqa: UP006
    ) -> torch.Tensor:
        return torch.cat(embedding_tensors + non_id_tensors, dim=1).sum().reshape(1, 1)


class _SlowTier:
    """A tier whose lookups take ``seconds`` longer."""

    def __init__(self, tier, seconds: float) -> None:
        self._tier, self._seconds = tier, seconds

    def lookup(self, batch, *, train):
        time.sleep(self._seconds)
        return self._tier.lookup(batch, train=train)

    def __getattr__(self, name):
        return getattr(self._tier, name)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return _checkpoint(tmp_path_factory.mktemp("loaded") / "checkpoint", Mlp())


def test_output_transform_sigmoid_and_unknown_ones_are_refused(checkpoint):
    with pytest.raises(InvalidArgumentError, match="output transform must be one of"):
        load_model(checkpoint, name="m", output_transform="softmax", onednn_min_rows=0)
    identity = load_model(checkpoint, name="m", onednn_min_rows=0)
    sigmoid = load_model(checkpoint, name="m", output_transform="sigmoid", onednn_min_rows=0)
    try:
        raw = identity.infer(_batch()).predictions
        squashed = sigmoid.infer(_batch()).predictions
        np.testing.assert_allclose(squashed, 1 / (1 + np.exp(-raw)), rtol=0, atol=1e-6)
    finally:
        identity.close()
        sigmoid.close()


def test_warm_up_refuses_a_dense_model_without_one_score_per_row(tmp_path):
    directory = _checkpoint(tmp_path / "two", TwoColumns())
    with pytest.raises(
        CheckpointError, match=r"returns shape \[1, 2\] for a batch of 1; expected \[1, 1\]"
    ):
        load_model(directory, name="m", onednn_min_rows=0)


def test_warm_up_runs_batches_of_more_than_one_row(tmp_path):
    directory = _checkpoint(tmp_path / "sum", SumsTheBatch())
    with pytest.raises(CheckpointError, match="cannot be served"):
        load_model(directory, name="m", onednn_min_rows=0)


class IndexesBeforeTheTable(nn.Module):
    """Indexes a table with each row's first embedding value floored, minus 10: a row below
    0 for any embedding of the checkpoint (drawn from N(0, 1)), which no table has."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(4, 1)

    def forward(
        self,
        non_id_tensors: List[torch.Tensor],  # noqa: UP006
        embedding_tensors: List[torch.Tensor],  # noqa: UP006
    ) -> torch.Tensor:
        return self.table(embedding_tensors[0][:, 0].floor().long() - 10)


def test_warm_up_refuses_a_dense_model_that_indexes_out_of_range_on_its_example_batch(tmp_path):
    """An index out of range on the example batch is the checkpoint's fault, not a
    request's: CheckpointError, not the 400 (ModelInputError) a request's inputs get."""
    directory = _checkpoint(tmp_path / "index", IndexesBeforeTheTable())
    with pytest.raises(CheckpointError) as refused:
        load_model(directory, name="m", onednn_min_rows=0)
    assert refused.value.message == (
        f"checkpoint {directory} cannot be served: RuntimeError: index out of range in self "
        "(its dense model fails on a batch of the inputs its signature and embedding dims "
        "describe)"
    )


def test_infer_counts_the_lookup_as_lookup_time_not_compute_time(checkpoint):
    model = load_model(checkpoint, name="m", onednn_min_rows=0)
    working = model.tier
    try:
        model.tier = _SlowTier(working, 0.2)
        output = model.infer(_batch())
        assert output.lookup_seconds >= 0.2
        assert 0 <= output.compute_seconds < output.lookup_seconds  # a tiny model, no sleep
    finally:
        model.tier = working
        model.close()


def _bare_checkpoint(directory: Path, **options) -> Path:
    """A checkpoint of Mlp with no embedding rows, written with ``options``."""
    tier = InProcessEmbeddingTier(CONFIG, capacity=10)
    model_checkpoint.write_checkpoint(directory, Mlp(), None, tier, step=1, **options)
    return directory


def test_checkpoints_that_cannot_be_served_are_refused_by_name(tmp_path):
    unsigned = _bare_checkpoint(tmp_path / "unsigned")
    with pytest.raises(CheckpointError, match="unsigned has no feature signature"):
        load_model(unsigned, name="m", onednn_min_rows=0)
    no_jit = _bare_checkpoint(tmp_path / "nojit", signature=SIGNATURE, with_jit_model=False)
    with pytest.raises(CheckpointError) as refused:
        load_model(no_jit, name="m", onednn_min_rows=0)
    # What to do, and that it needs a scriptable forward (the reason for the flag).
    assert refused.value.message == (
        f"checkpoint {no_jit} has no jit_dense.pt (dumped with with_jit_model=False): serving "
        "runs the TorchScript model; dump the checkpoint with with_jit_model=True (the "
        'default), which needs a scriptable forward (docs/own_model.md, "The model contract")'
    )


def test_one_embedding_tier_per_model(checkpoint):
    with pytest.raises(InvalidArgumentError, match="give embedding_workers or embedding_ps"):
        load_model(checkpoint, name="m", embedding_workers=["a:1"], embedding_ps=["b:1"])
    with pytest.raises(InvalidArgumentError, match="lists 2 addresses: a model talks to one"):
        load_model(checkpoint, name="m", embedding_workers=["a:1", "a:2"])


def test_an_unknown_fallback_policy_is_refused(checkpoint):
    with pytest.raises(InvalidArgumentError, match="fallback policy must be one of"):
        load_model(checkpoint, name="m", fallback_policy="zeros", onednn_min_rows=0)


def test_a_model_that_fails_its_warm_up_closes_its_tier(tmp_path, monkeypatch):
    closed: list[object] = []
    monkeypatch.setattr(InProcessEmbeddingTier, "close", lambda tier: closed.append(tier))
    directory = _checkpoint(tmp_path / "two", TwoColumns())
    with pytest.raises(CheckpointError):
        load_model(directory, name="m", onednn_min_rows=0)
    assert len(closed) == 1


def test_close_closes_the_tier_only_when_the_model_owns_it(checkpoint, monkeypatch):
    closed: list[object] = []
    monkeypatch.setattr(InProcessEmbeddingTier, "close", lambda tier: closed.append(tier))
    model = load_model(checkpoint, name="m", warm_up=False, onednn_min_rows=0)
    model.owns_tier = False
    model.close()
    assert closed == []
    model.owns_tier = True
    model.close()
    assert closed == [model.tier]


def test_infer_reports_the_ids_the_tier_does_not_hold(checkpoint):
    model = load_model(checkpoint, name="m", warm_up=False, onednn_min_rows=0)
    try:
        ids = np.array([1, 60, 70], dtype=np.uint64)  # the checkpoint holds IDs 0..49
        batch = Batch(
            [IDTypeFeatureWithSingleID("user", ids), IDTypeFeatureWithSingleID("item", ids)],
            [NonIDTypeFeature(np.zeros((3, 3), np.float32), "dense")],
            requires_grad=False,
        )
        output = model.infer(batch)
        assert (output.unknown_ids, output.fallback_ids) == (4, 0)
        assert output.predictions.shape == (3, 1)
    finally:
        model.close()


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (RuntimeError("The following operation failed\n  bad shape [2, 3]\n\n"), "bad shape"),
        (RuntimeError("trace\nRuntimeError: bad shape [2, 3]"), "bad shape"),
        (ValueError(""), ""),
    ],
)
def test_error_summary_is_the_type_and_the_last_line(error, expected):
    summary = error_summary(error)
    name = type(error).__name__
    assert summary == (f"{name}: {expected} [2, 3]" if expected else f"{name}: ")


def _fake_remote_workers(
    monkeypatch, *, serving: bool, reports=None, loading_for: int | None = 0
) -> list:
    """Stands in for RemoteEmbeddingWorker: each made is listed, its ``closed`` says whether
    it was closed; its wait_for_serving fails unless ``serving``; its status reports the
    embedding config ``reports`` (None: none, as a worker that predates the field) and
    shard 1 still loading its checkpoint for the first ``loading_for`` status calls (None:
    for good)."""
    from embedding_store import worker_client
    from embedding_store.errors import UnavailableError
    from embedding_store.tier import TierStatus

    made: list[_FakeWorker] = []

    class _FakeWorker:
        def __init__(self, address, config, *, timeout) -> None:
            self.closed = False
            self.statuses = 0
            made.append(self)

        def wait_for_serving(self, timeout: float) -> None:
            if not serving:
                raise UnavailableError("embedding worker a:1 is not serving after 0.1 s")

        def status(self, *, partial: bool = False) -> TierStatus:
            self.statuses += 1
            loading = loading_for is None or self.statuses <= loading_for
            return TierStatus(
                (1, 0),
                (10, 10),
                0,
                0,
                0,
                shard_tasks=("", "loading" if loading else ""),
                shard_serving=(True, not loading),
                shard_errors=("", ""),
                embedding_config=reports,
            )

        def close(self) -> None:
            self.closed = True

    monkeypatch.setattr(worker_client, "RemoteEmbeddingWorker", _FakeWorker)
    return made


def test_a_remote_worker_that_never_serves_has_its_channel_closed(checkpoint, monkeypatch):
    """A load that gives up on its embedding worker (a failed hot reload, retried by the
    checkpoint watch) must not leave the worker's gRPC channel open, one per try."""
    from embedding_store.errors import UnavailableError

    made = _fake_remote_workers(monkeypatch, serving=False)
    with pytest.raises(UnavailableError, match="not serving"):
        load_model(checkpoint, name="m", embedding_workers=["a:1"], startup_timeout=0.1)
    assert [worker.closed for worker in made] == [True]


def test_a_load_refused_after_its_worker_answered_closes_the_channel(checkpoint, monkeypatch):
    """Refused for an option it does not know, once connected: the channel is closed too."""
    made = _fake_remote_workers(monkeypatch, serving=True)
    for option in ({"output_transform": "softmax"}, {"fallback_policy": "zeros"}):
        with pytest.raises(InvalidArgumentError, match="must be one of"):
            load_model(checkpoint, name="m", embedding_workers=["a:1"], **option)
    assert [worker.closed for worker in made] == [True, True]


def test_a_worker_with_another_embedding_config_is_refused_naming_what_differs(
    checkpoint, monkeypatch
):
    """A worker started with another embedding_config.yml than the checkpoint's answered
    every ID as unknown (zeros: another ID prefix) or pooled otherwise, and the server served
    those predictions; the load now refuses it, naming the worker and each slot."""
    from embedding_store.config import embedding_config_from_mapping
    from embedding_store.errors import FailedPreconditionError

    dim = CONFIG.slots_config["user"].dim
    others = {
        "another prefix width": (
            {"feature_index_prefix_bit": 10, "slots_config": {"user": {"dim": dim}}},
            "slot 'item' is not in the worker's config; slot 'user' has another ID prefix "
            "in the checkpoint (feature groups or feature_index_prefix_bit changed)",
        ),
        "other pooling": (
            {
                "feature_index_prefix_bit": 8,
                "slots_config": {"user": {"dim": dim}, "item": {"dim": dim, "sqrt_scaling": True}},
            },
            "slot 'item' is pooled otherwise at the worker (sqrt_scaling False in the "
            "checkpoint, True at the worker)",
        ),
    }
    for mapping, problems in others.values():
        made = _fake_remote_workers(
            monkeypatch, serving=True, reports=embedding_config_from_mapping(mapping)
        )
        with pytest.raises(FailedPreconditionError) as refused:
            load_model(checkpoint, name="m", embedding_workers=["a:1"])
        assert refused.value.message == (
            f"embedding worker a:1 serves another embedding config than checkpoint "
            f"{checkpoint}: {problems} (start the worker with the checkpoint's "
            "embedding_config.yml)"
        )
        assert [worker.closed for worker in made] == [True]
    # The checkpoint's own config passes the check: the load goes on (to the option it
    # refuses next).
    _fake_remote_workers(monkeypatch, serving=True, reports=CONFIG)
    with pytest.raises(InvalidArgumentError, match="must be one of"):
        load_model(checkpoint, name="m", embedding_workers=["a:1"], output_transform="softmax")


def test_a_remote_tier_refusing_a_valid_request_is_the_servers_fault(checkpoint):
    """The request passed the model's signature; a worker restarted without one of the
    model's slots refused it as INVALID_ARGUMENT, and the client got 400 for the server's
    misconfiguration. It is a 500 naming the tier's complaint; an in-process tier's
    refusal is left as it is."""
    from embedding_store.errors import RecserveError, http_status_of

    model = load_model(checkpoint, name="m", onednn_min_rows=0)

    class Refusing:
        def __init__(self, tier) -> None:
            self._tier = tier

        def lookup(self, batch, *, train):
            raise InvalidArgumentError(
                "embedding worker w:1: ID feature 'item' is not a slot of the embedding config"
            )

        def __getattr__(self, name):
            return getattr(self._tier, name)

    try:
        model.tier = Refusing(model.tier)
        with pytest.raises(RecserveError) as refused:
            model.infer(_batch())
        assert type(refused.value) is RecserveError and http_status_of(refused.value) == 500
        assert refused.value.message == (
            f"the embedding tier refused a lookup that model m version {model.version} "
            "allows: embedding worker w:1: ID feature 'item' is not a slot of the embedding "
            "config"
        )
    finally:
        model.tier = model.tier._tier
        model.close()


def test_a_remote_workers_shards_still_loading_are_waited_for(checkpoint, monkeypatch):
    """A worker is ready once it reaches its shards, loaded or not: a server started while an
    inference shard loaded its checkpoint failed its warm-up on that shard. It now waits for
    them, up to the start-up timeout, then names them."""
    from embedding_store.errors import UnavailableError

    made = _fake_remote_workers(monkeypatch, serving=True, reports=CONFIG, loading_for=2)
    with pytest.raises(InvalidArgumentError, match="must be one of"):  # got past the wait
        load_model(checkpoint, name="m", embedding_workers=["a:1"], output_transform="softmax")
    assert made[0].statuses == 3
    _fake_remote_workers(monkeypatch, serving=True, reports=CONFIG, loading_for=None)
    with pytest.raises(UnavailableError) as waited:
        load_model(checkpoint, name="m", embedding_workers=["a:1"], startup_timeout=0.2)
    assert waited.value.message == (
        "embedding worker a:1: its shards are not serving after 0.2 s (shard 1: not serving "
        "yet (loading))"
    )
    # With default vectors for a shard that is away, a server starts (or reloads) without it.
    made = _fake_remote_workers(monkeypatch, serving=True, reports=CONFIG, loading_for=None)
    with pytest.raises(InvalidArgumentError, match="must be one of"):
        load_model(
            checkpoint,
            name="m",
            embedding_workers=["a:1"],
            fallback_policy="default",
            output_transform="softmax",
        )
    assert made[0].statuses == 1


def test_remote_shards_get_the_startup_timeout_to_serve(checkpoint, monkeypatch):
    """serve --embedding-ps started before its shards (or while they load) waits for them as
    long as for an embedding worker; it used to fail at once."""
    from embedding_store.errors import UnavailableError
    from embedding_store.remote_tier import RemoteShardTier

    waits: list[tuple[float, bool]] = []

    def wait_for_serving(self, timeout: float, *, serving: bool = True) -> None:
        waits.append((timeout, serving))
        raise UnavailableError("embedding shards not serving after 7 s (...)")

    monkeypatch.setattr(RemoteShardTier, "wait_for_serving", wait_for_serving)
    for policy in ("fail", "default"):
        with pytest.raises(UnavailableError, match="not serving after 7 s"):
            load_model(
                checkpoint,
                name="m",
                embedding_ps=["127.0.0.1:1"],
                startup_timeout=7,
                fallback_policy=policy,
            )
    # Under --fallback-policy default a shard that answers is enough: default vectors stand
    # in for one still loading.
    assert waits == [(7, True), (7, False)]


def test_a_checkpoint_replaced_while_its_embeddings_load_is_refused(tmp_path, monkeypatch):
    """A new version renamed into the watched path between the embedding manifest's check
    and the load of its rows: the load reads the path again, and used to serve the new
    version's embeddings under the old version's name (predictions of neither)."""
    from embedding_store.shard import RowBlock
    from tests.unit.test_onednn_linear import DIM

    served = _checkpoint(tmp_path / "served", Mlp())
    other = tmp_path / "other"
    tier = InProcessEmbeddingTier(CONFIG, capacity=1000)
    ids = np.concatenate(
        [CONFIG.prefix_ids(name, np.arange(50, dtype=np.uint64)) for name in ("user", "item")]
    )
    weights = np.full((ids.size, DIM), 0.5, np.float32)  # other rows than _checkpoint's
    tier.shards[0].import_rows(RowBlock(ids, weights, None))
    model_checkpoint.write_checkpoint(other, Mlp(), None, tier, step=2, signature=SIGNATURE)
    load = InProcessEmbeddingTier.load

    def load_after_a_publish(self, directory, **kwargs):
        if other.exists():  # the trainer publishes: staged next to it, then renamed
            served.rename(tmp_path / "previous")
            other.rename(served)
        return load(self, directory, **kwargs)

    closed: list[InProcessEmbeddingTier] = []
    close = InProcessEmbeddingTier.close

    def close_recorded(self):
        closed.append(self)
        return close(self)

    monkeypatch.setattr(InProcessEmbeddingTier, "load", load_after_a_publish)
    monkeypatch.setattr(InProcessEmbeddingTier, "close", close_recorded)
    with pytest.raises(CheckpointError, match="changed while it was loaded"):
        load_model(served, name="m", warm_up=False, onednn_min_rows=0)
    assert len(closed) == 1 and closed[0] is not tier  # the refused load's tier is closed
    model = load_model(served, name="m", warm_up=False, onednn_min_rows=0)  # tried again
    try:
        assert model.version == model_checkpoint.read_manifest(served).version
        assert model.embedding_version == model.tier.status().shard_checkpoint_versions[0]
    finally:
        model.close()
