"""serving.service.PredictionService on a tiny checkpoint, in process: hot reload and its
failures, the request series of replaced versions, deadlines and cancellation, what each
request of a merged batch is told, and readiness."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError
from pathlib import Path
from types import SimpleNamespace
from typing import List  # noqa: UP035  (TorchScript reads the forward signature)

import numpy as np
import pytest
import torch

from embedding_store import model_checkpoint
from embedding_store.batch import Batch, IDTypeFeatureWithSingleID, NonIDTypeFeature
from embedding_store.config import embedding_config_from_mapping
from embedding_store.errors import (
    CheckpointError,
    DeadlineExceededError,
    InvalidArgumentError,
    ModelInputError,
    NotFoundError,
    UnavailableError,
    http_status_of,
)
from embedding_store.shard import RowBlock
from embedding_store.signature import FeatureSignature, IdFeatureSpec, NonIdFeatureSpec
from embedding_store.tier import InProcessEmbeddingTier
from serving import service as service_module
from serving.infer_ctx import InferCtx
from serving.model import LoadedModel, load_model
from serving.service import MAX_WAIT_SECONDS, PredictionService, _share
from serving.tensors import tensors_to_batch
from tests.unit.test_onednn_linear import SIGNATURE, Mlp, _checkpoint

NAME = "m"
WAIT = 30.0  # s: the bound of any wait for another thread (a slow CI machine)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """Two checkpoints of one signature: two versions of the model."""
    root = tmp_path_factory.mktemp("service")
    return _checkpoint(root / "a", Mlp()), _checkpoint(root / "b", Mlp())


def _load(path: Path) -> LoadedModel:
    return load_model(path, name=NAME, warm_up=False, onednn_min_rows=0)


def _inputs(rows: int = 2) -> dict[str, np.ndarray]:
    ids = np.arange(rows, dtype=np.uint64)
    dense = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3) / 10
    return {"user": ids, "item": ids[::-1].copy(), "dense": dense}


def _closing_recorded(model: LoadedModel, closed: list[str]) -> LoadedModel:
    close = model.close
    model.close = lambda: (closed.append(model.version), close())  # type: ignore[method-assign]
    return model


@pytest.fixture
def make_service() -> Iterator[Callable[..., PredictionService]]:
    made: list[PredictionService] = []

    def make(model: LoadedModel, **options) -> PredictionService:
        made.append(PredictionService(model, **options))
        return made[-1]

    yield make
    for service in made:
        service.close(wait=1.0)


def _requests(service: PredictionService, version: str, outcome: str, protocol: str = "http"):
    labels = {"protocol": protocol, "model": NAME, "version": version, "outcome": outcome}
    return service.metrics.registry.get_sample_value("recserve_requests_total", labels)


def _reloads(service: PredictionService, outcome: str) -> float | None:
    return service.metrics.registry.get_sample_value("recserve_reloads_total", {"outcome": outcome})


# --------------------------------------------------------------------------- apportioning
@pytest.mark.parametrize(
    ("total", "part", "whole", "expected"),
    [
        (10, 3, 3, 10),  # computed alone: exact
        (10, 1, 3, 3),
        (10, 2, 3, 7),  # rounded, not truncated
        (7, 0, 4, 0),
        (5, 0, 0, 5),  # no IDs at all
    ],
)
def test_unknown_ids_are_apportioned_by_share_of_ids(total, part, whole, expected) -> None:
    assert _share(total, part, whole) == expected


# --------------------------------------------------------------------------- reload
def test_reload_swaps_versions_closes_the_old_and_moves_the_series(
    checkpoints, make_service
) -> None:
    first, second = checkpoints
    closed: list[str] = []
    old = _closing_recorded(_load(first), closed)
    service = make_service(old, loader=lambda path: _closing_recorded(_load(Path(path)), closed))
    service.predict(NAME, None, _inputs(), protocol="http")
    assert _requests(service, old.version, "ok") == 1.0

    answer = service.reload(str(second))

    new = service.model
    assert answer == {"model": NAME, "version": new.version, "previous_version": old.version}
    assert new.version != old.version and closed == [old.version]
    # The replaced version's series are gone; the new one's exist at 0 before any request.
    assert _requests(service, old.version, "ok") is None
    for protocol in ("http", "grpc"):
        assert _requests(service, new.version, "DeadlineExceededError", protocol) == 0.0
        assert _requests(service, new.version, "ModelInputError", protocol) == 0.0
    assert _reloads(service, "ok") == 1.0 and service.last_reload_error is None
    info = service.metrics.registry.get_sample_value(
        "recserve_model_info", {"model": NAME, "version": new.version}
    )
    assert info == 1.0
    assert service.predict(NAME, None, _inputs(), protocol="http").model_version == new.version
    # A request counted for the replaced version afterwards does not bring its series back.
    service._record("http", NAME, old.version, "ok", time.perf_counter())
    assert _requests(service, old.version, "ok") is None


def test_a_reload_of_the_served_version_keeps_its_series(checkpoints, make_service) -> None:
    first, _second = checkpoints
    service = make_service(_load(first), loader=lambda path: _load(first))
    version = service.model.version
    service.predict(NAME, None, _inputs(), protocol="http")
    assert service.reload(None)["previous_version"] == version == service.model.version
    assert _requests(service, version, "ok") == 1.0


def test_forgetting_a_version_served_again_keeps_its_series(checkpoints, make_service) -> None:
    """A burst of reloads can serve a version again before the reload that replaced it
    forgets it: its series must stay."""
    first, _second = checkpoints
    service = make_service(_load(first))
    version = service.model.version
    service._forget_version(version)
    service.predict(NAME, None, _inputs(), protocol="http")
    assert _requests(service, version, "ok") == 1.0


class _Wide(torch.nn.Module):
    """The signature of Mlp's checkpoints over 8-dim embeddings instead of 4."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2 * 8 + 3, 1)

    def forward(self, non_id_tensors: List[torch.Tensor], embedding_tensors: List[torch.Tensor]):  # noqa: UP006
        return self.linear(torch.cat(embedding_tensors + non_id_tensors, dim=1))


def test_a_reload_to_other_embedding_dims_answers_wholly_from_the_new_checkpoint(
    checkpoints, make_service, tmp_path
):
    """Same inputs, other embedding dims (and so another dense model): the reload swaps the
    pair at once, and answers are the new checkpoint's own, bit for bit, named by its
    version."""
    config = embedding_config_from_mapping(
        {"feature_index_prefix_bit": 8, "slots_config": {"user": {"dim": 8}, "item": {"dim": 8}}}
    )
    tier = InProcessEmbeddingTier(config, capacity=1000)
    ids = np.concatenate(
        [config.prefix_ids(n, np.arange(50, dtype=np.uint64)) for n in ("user", "item")]
    )
    weights = np.random.default_rng(1).normal(size=(ids.size, 8)).astype(np.float32)
    tier.shards[0].import_rows(RowBlock(ids, weights, None))
    torch.manual_seed(1)
    wide = tmp_path / "wide"
    try:
        model_checkpoint.write_checkpoint(wide, _Wide(), None, tier, step=3, signature=SIGNATURE)
    finally:
        tier.close()
    service = make_service(_load(checkpoints[0]), loader=lambda path: _load(Path(path)))
    service.reload(str(wide))
    answer = service.predict(NAME, None, _inputs(3), protocol="http")
    with InferCtx(checkpoint=wide) as offline:
        expected = offline.forward(
            tensors_to_batch(offline.model.signature, _inputs(3), max_batch_size=8)
        )
        version = offline.model.version
    assert answer.model_version == version
    np.testing.assert_array_equal(answer.outputs["prediction"], expected)


def test_without_a_loader_reload_is_unavailable(checkpoints, make_service) -> None:
    service = make_service(_load(checkpoints[0]))
    with pytest.raises(UnavailableError, match="started without a checkpoint loader"):
        service.reload(None)


def test_a_reload_that_changes_the_signature_is_refused_and_the_old_version_serves(
    checkpoints, make_service
) -> None:
    first, second = checkpoints
    closed: list[str] = []

    def loader(path: str | None) -> LoadedModel:
        model = _closing_recorded(_load(second), closed)
        model.signature = FeatureSignature(
            (IdFeatureSpec("user", True),), (NonIdFeatureSpec("dense", "float32", (3,)),)
        )
        return model

    old = _closing_recorded(_load(first), closed)
    service = make_service(old, loader=loader)
    with pytest.raises(CheckpointError, match="feature signature differs from the served one"):
        service.reload(None)
    assert service.model is old
    assert len(closed) == 1 and closed[0] != old.version  # the refused model, not the old
    assert _reloads(service, "failed") == 1.0 and _reloads(service, "ok") == 0.0
    assert service.last_reload_error is not None
    assert "feature signature differs" in service.last_reload_error
    assert service.predict(NAME, None, _inputs(), protocol="http").model_version == old.version


@pytest.mark.parametrize(
    ("clashing", "owner"),
    [
        (IdFeatureSpec("user.lengths", True), "ID feature 'user.lengths'"),
        (NonIdFeatureSpec("user.lengths", "float32", (1,)), "non-ID feature 'user.lengths'"),
    ],
)
def test_a_model_whose_inputs_share_a_name_is_not_served(checkpoints, clashing, owner) -> None:
    """A jagged ID feature "user" takes the inputs "user" and "user.lengths": a feature named
    "user.lengths" would share that one request tensor, its IDs (or values) always equal to
    the lengths (a request was decoded so, with a 200). Refused before serving starts."""
    model = _load(checkpoints[0])
    try:
        ids: tuple = (IdFeatureSpec("user", False), IdFeatureSpec("item", True))
        dense: tuple = (NonIdFeatureSpec("dense", "float32", (3,)),)
        if isinstance(clashing, IdFeatureSpec):
            ids += (clashing,)
        else:
            dense += (clashing,)
        model.signature = FeatureSignature(ids, dense)
        with pytest.raises(CheckpointError) as caught:
            PredictionService(model)
        assert caught.value.message == (
            "the model cannot be served over KServe v2: the lengths of jagged ID feature "
            f"'user' and {owner} would both be the input 'user.lengths', and one request "
            "tensor cannot hold both; a feature must not be named like a jagged ID feature's "
            "'.lengths' input (rename it in the training data and train again)"
        )
    finally:
        model.close()


def test_a_reload_whose_label_names_differ_swaps(checkpoints, make_service) -> None:
    """A model retrained with its label renamed takes the same inputs: not refused as a
    change of signature."""
    first, second = checkpoints

    def loader(path: str | None) -> LoadedModel:
        model = _load(second)
        model.signature = dataclasses.replace(model.signature, label_names=("clicked",))
        return model

    service = make_service(_load(first), loader=loader)
    previous = service.model.version
    swapped = service.reload(None)
    assert swapped["previous_version"] == previous != swapped["version"] == service.model.version
    answer = service.predict(NAME, None, _inputs(), protocol="http")
    assert answer.model_version == swapped["version"]


def test_a_loader_that_raises_anything_is_a_checkpoint_error(checkpoints, make_service) -> None:
    def loader(path: str | None) -> LoadedModel:
        if path is None:
            return _load(checkpoints[1])
        raise RuntimeError("The following operation failed\n  size mismatch at layer 2\n")

    service = make_service(_load(checkpoints[0]), loader=loader)
    message = "the new checkpoint cannot be served: RuntimeError: size mismatch at layer 2"
    with pytest.raises(CheckpointError) as raised:
        service.reload("elsewhere")
    assert raised.value.message == message
    assert service.last_reload_error == message
    assert _reloads(service, "failed") == 1.0
    service.reload(None)  # a reload that works clears the note
    assert service.last_reload_error is None
    assert (_reloads(service, "failed"), _reloads(service, "ok")) == (1.0, 1.0)


# --------------------------------------------------------------------------- names, labels
def test_only_the_served_name_and_version_are_found(checkpoints, make_service) -> None:
    service = make_service(_load(checkpoints[0]))
    version = service.model.version
    with pytest.raises(NotFoundError, match="unknown model 'other'; this server serves 'm'"):
        service.predict("other", None, _inputs(), protocol="http")
    with pytest.raises(NotFoundError, match="has no version 'v0'"):
        service.predict(NAME, "v0", _inputs(), protocol="http")
    for asked in (None, "", version):
        assert service.predict(NAME, asked, _inputs(), protocol="http").model_version == version
        assert service.model_ready(NAME, asked)
    with pytest.raises(NotFoundError, match="unknown model 'other'"):
        service.model_ready("other")
    with pytest.raises(NotFoundError, match="has no version 'v0'"):
        service.model_metadata(NAME, "v0")
    labels = {"protocol": "http", "model": "unknown", "version": version}
    sample = service.metrics.registry.get_sample_value
    assert sample("recserve_requests_total", {**labels, "outcome": "NotFoundError"}) == 1.0
    assert _requests(service, version, "NotFoundError") == 1.0
    assert _requests(service, version, "ok") == 3.0


def test_rejected_requests_are_counted_by_kind(checkpoints, make_service) -> None:
    service = make_service(_load(checkpoints[0]))
    version = service.model.version
    service.record_rejected("grpc", NAME, CancelledError())
    service.record_rejected("grpc", NAME, InvalidArgumentError("bad tensor"))
    service.record_rejected("grpc", NAME, ValueError("boom"))
    service.record_rejected("grpc", "made-up", ValueError("boom"))
    assert _requests(service, version, "cancelled", "grpc") == 1.0
    assert _requests(service, version, "InvalidArgumentError", "grpc") == 1.0
    assert _requests(service, version, "error", "grpc") == 1.0
    unknown = {"protocol": "grpc", "model": "unknown", "version": version, "outcome": "error"}
    assert service.metrics.registry.get_sample_value("recserve_requests_total", unknown) == 1.0


# --------------------------------------------------------------------------- deadlines
class _Blocked:
    """Wraps a model's infer: each call waits for ``release`` (bounded)."""

    def __init__(self, model: LoadedModel) -> None:
        self.infer = model.infer
        self.started = threading.Event()
        self.release = threading.Event()
        model.infer = self  # type: ignore[method-assign]

    def __call__(self, merged):
        self.started.set()
        assert self.release.wait(WAIT)
        return self.infer(merged)


def _wait_until(condition: Callable[[], bool], within: float = WAIT) -> None:
    """Polls ``condition`` until it holds; fails after ``within`` s (by default WAIT: a bound
    for a slow machine, not a requirement)."""
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "the condition did not hold within the wait"
        time.sleep(0.01)


def test_an_answer_not_ready_by_the_timeout_is_deadline_exceeded(checkpoints, make_service):
    model = _load(checkpoints[0])
    blocked = _Blocked(model)
    service = make_service(model)
    try:
        with pytest.raises(DeadlineExceededError, match=r"deadline of 0\.050 s"):
            service.predict(NAME, None, _inputs(), protocol="grpc", timeout=0.05)
    finally:
        blocked.release.set()
    assert _requests(service, model.version, "DeadlineExceededError", "grpc") == 1.0


def test_huge_timeouts_are_clamped_to_a_day(checkpoints, make_service) -> None:
    service = make_service(_load(checkpoints[0]))
    batch, wait = service._prepare(NAME, None, service._tensor_builder(_inputs()), 1e10)
    assert wait == MAX_WAIT_SECONDS == 86400.0
    assert batch.batch_size == 2
    answer = service.predict(NAME, None, _inputs(), protocol="grpc", timeout=1e10)
    assert answer.outputs["prediction"].shape == (2, 1)


def test_a_call_that_ends_before_its_answer_is_cancelled_or_past_its_deadline(
    checkpoints, make_service, monkeypatch
) -> None:
    """``on_cancel``: a call its front end reports gone is counted as cancelled, unless it
    went within the slack (5 ms) of its deadline (gRPC ends a call at its deadline a hair
    before the core's own wait), which is DeadlineExceededError."""
    model = _load(checkpoints[0])
    service = make_service(model)
    clock = [1000.0]
    fake_time = SimpleNamespace(
        monotonic=lambda: clock[0], perf_counter=time.perf_counter, sleep=time.sleep
    )
    monkeypatch.setattr(service_module, "time", fake_time)
    cases = (
        (1009.99, CancelledError),
        (1010.0 - service_module._DEADLINE_SLACK_SECONDS, DeadlineExceededError),
    )
    for gone_at, error in cases:
        clock[0] = 1000.0  # the request's deadline: 1000 + its 10 s timeout

        def already_over(callback: Callable[[], None], at: float = gone_at) -> bool:
            clock[0] = at  # the call ended now: the core runs the callback itself
            return False

        with pytest.raises(error):
            service.predict(
                NAME, None, _inputs(), protocol="grpc", timeout=10.0, on_cancel=already_over
            )
    assert _requests(service, model.version, "cancelled", "grpc") == 1.0
    assert _requests(service, model.version, "DeadlineExceededError", "grpc") == 1.0
    assert _requests(service, model.version, "ok", "grpc") == 0.0


# --------------------------------------------------------------------------- answers
def test_each_request_gets_its_own_fallback_count_and_non_finite_answers_are_refused(
    checkpoints, make_service
) -> None:
    model = _load(checkpoints[0])
    service = make_service(model)
    batch, _wait = service._prepare(NAME, None, service._tensor_builder(_inputs(3)), None)
    assert batch.num_ids == 6
    outcome = service_module.BatchOutcome(
        predictions=np.zeros((3, 1), np.float32),
        context=("v7", 20, 10, 20, True, None),  # merged: 20 IDs, all fell back, 10 unknown
        queue_seconds=0.0,
        merged_batch_size=10,
    )
    answer = service._answer(batch, outcome)
    assert (answer.model_version, answer.fallback_ids, answer.unknown_ids) == ("v7", 6, 3)
    none_fell_back = dataclasses.replace(outcome, context=("v7", 0, 10, 20, True, None))
    assert service._answer(batch, none_fell_back).fallback_ids == 0
    nan = dataclasses.replace(
        outcome,
        predictions=np.array([[0.0], [np.nan], [0.0]], np.float32),
        context=("v7", 0, 0, 20, False, None),
    )
    with pytest.raises(InvalidArgumentError, match="1 sample\\(s\\) of this request"):
        service._answer(batch, nan)


def _unknown_inputs(users: list[int], items: list[int]) -> dict[str, np.ndarray]:
    """Inputs whose IDs 50 and above are unknown (the checkpoint holds 0..49)."""
    dense = np.zeros((len(users), 3), np.float32)
    return {"user": np.array(users, np.uint64), "item": np.array(items, np.uint64), "dense": dense}


# 4 unknown IDs (user 60 twice, item 60 and 70), and 1 (user 99): their shares of the
# merged batch's 10 IDs would be 3 and 2.
UNKNOWN_REQUESTS = {
    4: _unknown_inputs([60, 60, 1], [60, 2, 70]),
    1: _unknown_inputs([1, 99], [3, 4]),
}


def test_each_request_of_a_merged_batch_is_told_its_own_unknown_ids(
    checkpoints, make_service
) -> None:
    """Exactly what it is told alone, on the dispatcher thread and on an event loop; the
    server's counter counts every unknown occurrence once."""
    alone = make_service(_load(checkpoints[0]), max_queue_delay=0.0)
    for expected, inputs in UNKNOWN_REQUESTS.items():
        assert alone.predict(NAME, None, inputs, protocol="grpc").unknown_ids == expected
    model = _load(checkpoints[0])
    merged: list[int] = []
    infer = model.infer
    model.infer = lambda batch: (merged.append(batch.batch_size), infer(batch))[1]  # type: ignore[method-assign]
    # A merged batch runs once it is full (3 + 2 rows), not after the 30 s delay.
    service = make_service(model, max_queue_delay=30.0, max_batch_size=5)
    answers: dict[int, int] = {}

    def ask(expected: int) -> None:
        inputs = UNKNOWN_REQUESTS[expected]
        answers[expected] = service.predict(
            NAME, None, inputs, protocol="grpc", timeout=WAIT
        ).unknown_ids

    askers = [threading.Thread(target=ask, args=(n,)) for n in UNKNOWN_REQUESTS]
    for asker in askers:
        asker.start()
    for asker in askers:
        asker.join(WAIT)

    async def ask_on_a_loop() -> list[int]:
        answers = await asyncio.gather(
            *(
                service.predict_async(NAME, None, inputs, protocol="http", timeout=WAIT)
                for inputs in UNKNOWN_REQUESTS.values()
            )
        )
        return [answer.unknown_ids for answer in answers]

    on_a_loop = asyncio.run(ask_on_a_loop())
    assert merged == [5, 5]  # merged on the dispatcher thread, then on the loop
    assert answers == {4: 4, 1: 1}
    assert on_a_loop == [4, 1]
    unknown_total = service.metrics.registry.get_sample_value("recserve_unknown_ids_total")
    assert unknown_total == 2 * (4 + 1)


def test_a_merged_batch_is_answered_by_one_version_with_its_context(
    checkpoints, make_service
) -> None:
    model = _load(checkpoints[0])
    service = make_service(model)
    batch, _wait = service._prepare(NAME, None, service._tensor_builder(_inputs(4)), None)
    predictions, context = service._run(batch)
    assert predictions.shape == (4, 1)
    # 8 IDs, none fell back (a working tier), all of them known: the checkpoint holds 0..49.
    assert context[:5] == (model.version, 0, 0, 8, True)
    assert context[5].tolist() == [0, 0, 0, 0]  # unknown IDs per sample
    assert service.metrics.registry.get_sample_value("recserve_ids_looked_up_total") == 8.0


# --------------------------------------------------------------------------- event loop
def test_predict_async_answers_on_the_loop_and_counts(checkpoints, make_service) -> None:
    model = _load(checkpoints[0])
    service = make_service(model)
    expected = service.predict(NAME, None, _inputs(), protocol="http").outputs["prediction"]

    async def main():
        return await service.predict_async(NAME, None, _inputs(), protocol="http")

    answer = asyncio.run(main())
    np.testing.assert_array_equal(answer.outputs["prediction"], expected)
    assert answer.model_version == model.version
    assert _requests(service, model.version, "ok") == 2.0
    assert service.pending == 0


def test_stop_accepting_refuses_both_paths_and_drain_finishes(checkpoints, make_service):
    service = make_service(_load(checkpoints[0]))
    assert service.ready()
    assert service.drain(1.0) is True
    assert not service.ready()
    with pytest.raises(UnavailableError, match="not ready"):
        service.predict(NAME, None, _inputs(), protocol="http")
    with pytest.raises(UnavailableError, match="not ready"):
        asyncio.run(service.predict_async(NAME, None, _inputs(), protocol="http"))
    assert _requests(service, service.model.version, "UnavailableError") == 2.0


def test_a_request_is_counted_under_the_version_that_answered_it(checkpoints, make_service):
    """A reload that swaps the served model while a merged batch runs: its requests are
    answered and counted by the version that computed them, on both paths."""
    first, second = checkpoints
    answering, next_model = _load(first), _load(second)
    service = make_service(answering)
    infer = answering.infer

    def infer_then_swap(merged):
        service._model = next_model  # what reload's swap does while this batch runs
        return infer(merged)

    answering.infer = infer_then_swap  # type: ignore[method-assign]
    threaded = service.predict(NAME, None, _inputs(), protocol="http")
    service._model = answering
    on_loop = asyncio.run(service.predict_async(NAME, None, _inputs(), protocol="grpc"))
    service._model = answering  # the fixture closes it
    next_model.close()
    assert threaded.model_version == on_loop.model_version == answering.version
    assert _requests(service, answering.version, "ok", "http") == 1.0
    assert _requests(service, answering.version, "ok", "grpc") == 1.0


def test_a_request_for_a_version_replaced_while_it_waited_is_not_found(checkpoints, make_service):
    """A request naming version A that a reload replaced by B before its batch ran: B's
    answer is not what it asked for (404, on both paths); one naming no version takes B's."""
    first, second = checkpoints
    old, new = _load(first), _load(second)
    assert old.version != new.version
    service = make_service(old)
    with service._series_lock:
        service._create_series(new.version)  # as reload does before its swap
    build = service._tensor_builder

    def build_then_swap(inputs):
        def swapping(model):
            batch = build(inputs)(model)
            service._model = new  # what reload's swap does while the request waits
            return batch

        return swapping

    service._tensor_builder = build_then_swap  # type: ignore[method-assign]
    message = f"version '{old.version}' was replaced by version '{new.version}' while"
    with pytest.raises(NotFoundError, match=message):
        service.predict(NAME, old.version, _inputs(), protocol="http")
    service._model = old
    with pytest.raises(NotFoundError, match=message):
        asyncio.run(service.predict_async(NAME, old.version, _inputs(), protocol="grpc"))
    service._model = old
    unpinned = service.predict(NAME, None, _inputs(), protocol="http")
    assert unpinned.model_version == new.version
    assert _requests(service, new.version, "NotFoundError", "grpc") == 1.0
    service._model = old  # the fixture closes it
    new.close()


def test_a_request_that_timed_out_while_queued_is_not_computed(checkpoints, make_service):
    model = _load(checkpoints[0])
    blocked = _Blocked(model)
    sizes: list[int] = []
    infer = blocked.infer

    def recording_infer(merged):
        sizes.append(merged.batch_size)
        return infer(merged)

    blocked.infer = recording_infer
    service = make_service(model, max_batch_size=2)
    busy = threading.Thread(
        target=service.predict, args=(NAME, None, _inputs(2)), kwargs={"protocol": "http"}
    )
    busy.start()
    try:
        assert blocked.started.wait(WAIT)
        with pytest.raises(DeadlineExceededError):
            service.predict(NAME, None, _inputs(1), protocol="http", timeout=0.05)
    finally:
        blocked.release.set()
        busy.join(WAIT)
    # A later request runs after the one that timed out would have: it was skipped.
    service.predict(NAME, None, _inputs(3), protocol="http")
    assert sizes == [2, 3]


# --------------------------------------------------------------------------- friendly rows
def _rows(count: int) -> list[dict[str, object]]:
    return [{"user": i, "item": 10 + i, "dense": [0.1, 0.2, 0.3]} for i in range(count)]


def _rows_to_batch(rows) -> Batch:
    return Batch(
        [
            IDTypeFeatureWithSingleID.from_ids("user", [row["user"] for row in rows]),
            IDTypeFeatureWithSingleID.from_ids("item", [row["item"] for row in rows]),
        ],
        [NonIDTypeFeature(np.asarray([row["dense"] for row in rows], np.float32), "dense")],
        requires_grad=False,
    )


def test_rows_up_to_the_request_limit_are_preprocessed_and_answered(checkpoints, make_service):
    seen: list[int] = []

    def preprocessor(rows):
        seen.append(len(rows))
        return _rows_to_batch(rows)

    plain = make_service(_load(checkpoints[0]), max_request_batch_size=3)
    expected = plain.predict_instances(NAME, _rows(3), protocol="http").outputs["prediction"]
    service = make_service(
        _load(checkpoints[0]), max_request_batch_size=3, preprocessor=preprocessor
    )
    answer = service.predict_instances(NAME, _rows(3), protocol="http")
    np.testing.assert_allclose(answer.outputs["prediction"], expected, rtol=0, atol=1e-6)
    with pytest.raises(InvalidArgumentError, match="batch size 4 exceeds this server's max"):
        service.predict_instances(NAME, _rows(4), protocol="http")
    assert seen == [3]  # the 4 rows were refused before the preprocessor ran


def test_what_a_preprocessor_gets_wrong_is_the_request_s_fault(checkpoints, make_service, caplog):
    """A preprocessor's KeyError/TypeError/ValueError, a batch larger than the limit or one
    that does not match the model's signature: InvalidArgumentError (a 400), never a 500.
    The preprocessor's own traceback goes to the debug log (its operator may be at fault)."""
    caplog.set_level(logging.DEBUG, logger="serving.service")
    outputs = {
        "raises": lambda rows: _rows_to_batch([{**row, "dense": "x"} for row in rows]),
        "grows": lambda rows: _rows_to_batch(rows * 2),
        "wrong": lambda rows: Batch(
            [IDTypeFeatureWithSingleID.from_ids("user", [1, 2])], requires_grad=False
        ),
    }
    expected = {
        "raises": "instances could not be preprocessed: could not convert string to float",
        "grows": "batch size 4 exceeds this server's max batch size 3",
        "wrong": r"ID features \['user'\] do not match the model's \['user', 'item'\]",
    }
    for name, preprocessor in outputs.items():
        service = make_service(
            _load(checkpoints[0]), max_request_batch_size=3, preprocessor=preprocessor
        )
        with pytest.raises(InvalidArgumentError, match=expected[name]):
            service.predict_instances(NAME, _rows(2), protocol="http")
    logged = [r for r in caplog.records if r.name == "serving.service"]
    assert len(logged) == 1 and logged[0].exc_info[0] is ValueError
    frame = traceback.extract_tb(logged[0].exc_info[2])[-1]
    assert logged[0].levelno == logging.WARNING  # a bug in the operator's code shows by default
    assert logged[0].getMessage() == (
        "the preprocessor refused 2 instance(s): ValueError: could not convert string to "
        f"float: 'x' ({frame.filename}, line {frame.lineno}) (a client's bad rows or the "
        "preprocessor's bug; logged once per 300 s per origin, 0 more from this origin since)"
    )


def test_preprocessor_refusals_are_logged_once_per_interval_per_origin(
    checkpoints, make_service, caplog
):
    """A client looping on bad rows must not flood the log: one warning per origin (type,
    file, line) per interval, the next one says how many were left out."""
    now = [1000.0]
    service = make_service(
        _load(checkpoints[0]),
        preprocessor=lambda rows: _rows_to_batch([{**row, "dense": "x"} for row in rows]),
    )
    service._preprocessor_errors = service_module.OriginLogLimiter(60.0, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="serving.service")
    for step in (0.0, 30.0, 29.0, 1.0):  # at 1000, 1030, 1059 (left out), 1060 (logged)
        now[0] += step
        with pytest.raises(InvalidArgumentError):
            service.predict_instances(NAME, _rows(2), protocol="http")
    logged = [r.getMessage() for r in caplog.records if r.name == "serving.service"]
    assert [message.rsplit("; ", 1)[1] for message in logged] == [
        "logged once per 60 s per origin, 0 more from this origin since)",
        "logged once per 60 s per origin, 2 more from this origin since)",
    ]


def test_the_origin_log_limiter_keys_by_type_file_and_line_and_forgets_the_oldest():
    now = [0.0]
    limiter = service_module.OriginLogLimiter(10.0, max_origins=2, clock=lambda: now[0])

    def raised(kind: type[Exception], line: int) -> Exception:
        try:
            exec(compile("\n" * (line - 1) + "raise kind('x')", "user.py", "exec"))
        except Exception as error:
            return error
        raise AssertionError("nothing raised")

    assert limiter.origin(raised(TypeError, 3)) == ("TypeError", "user.py", 3)
    assert limiter.admit(raised(TypeError, 3)) == 0
    assert limiter.admit(raised(TypeError, 3)) is None  # same origin, within the interval
    assert limiter.admit(raised(ValueError, 3)) == 0  # another type
    now[0] = 1.0
    assert limiter.admit(raised(TypeError, 4)) == 0  # another line: TypeError@3 forgotten
    assert limiter.admit(raised(TypeError, 3)) == 0  # (its left-out count with it)


def test_a_preprocessor_that_drops_adds_or_returns_no_batch_is_its_own_bug(
    checkpoints, make_service
):
    """Answers are matched to instances by position: a preprocessor that drops or adds a
    sample (within the request limit) gave the later instances other rows' predictions with a
    200. It, or one that returns no Batch, is the server's bug: a 500 (not the client's 400),
    and the server goes on answering."""
    outputs = {
        "drops": (lambda rows: _rows_to_batch(rows[1:]), ValueError, "batch of 2 sample"),
        "adds": (lambda rows: _rows_to_batch(rows + rows[:1]), ValueError, "batch of 4 sample"),
        "dict": (lambda rows: {"user": [1]}, TypeError, "returned a dict, not a Batch"),
    }
    for preprocessor, kind, message in outputs.values():
        service = make_service(
            _load(checkpoints[0]), max_request_batch_size=8, preprocessor=preprocessor
        )
        with pytest.raises(kind, match=message) as raised:
            service.predict_instances(NAME, _rows(3), protocol="http")
        assert http_status_of(raised.value) == 500
        assert _requests(service, service.model.version, "error") == 1
        answer = service.predict(NAME, None, _inputs(), protocol="http")
        assert answer.outputs["prediction"].shape == (2, 1)


# --------------------------------------------------------------------------- drain, tier
def test_drain_waits_for_requests_batched_on_an_event_loop(checkpoints, make_service):
    service = make_service(_load(checkpoints[0]), max_queue_delay=0.2)

    async def main():
        asking = asyncio.ensure_future(
            service.predict_async(NAME, None, _inputs(), protocol="http")
        )
        await asyncio.sleep(0)  # validated and queued on this loop's batcher
        queued = service.pending
        drained = service.drain(0.0)  # the request waits for its flush on this loop
        return queued, drained, await asking

    queued, drained, answer = asyncio.run(main())
    assert (queued, drained) == (1, False)
    assert answer.outputs["prediction"].shape == (2, 1)
    assert service.pending == 0 and service.drain(0.0)


class _RemoteTier:
    """The model's tier as a remote one looks to the service: not in process."""

    address = "w:7100"

    def __init__(self, tier, versions: tuple[str, ...] = (), serving: tuple[bool, ...] = ()):
        self._tier = tier
        self.versions, self.serving = versions, serving
        self.config = None  # the embedding config the worker reports (None: none)
        self.tasks: tuple[str, ...] = ()  # what each shard reports it is busy with

    def status(self):
        return dataclasses.replace(
            self._tier.status(),
            shard_serving=self.serving,
            shard_checkpoint_versions=self.versions,
            embedding_config=self.config,
            shard_tasks=self.tasks or ("",) * len(self.serving),
            shard_addresses=tuple(f"s:{7000 + i}" for i in range(len(self.serving))),
        )

    def __getattr__(self, name: str):
        return getattr(self._tier, name)


def test_with_a_remote_tier_predict_async_runs_on_the_dispatcher_with_its_deadline(
    checkpoints, make_service
):
    model = _load(checkpoints[0])
    model.tier = _RemoteTier(model.tier)
    blocked = _Blocked(model)
    threads: list[int] = []
    infer = blocked.infer

    def recording_infer(merged):
        threads.append(threading.get_ident())
        return infer(merged)

    blocked.infer = recording_infer
    service = make_service(model)
    try:
        with pytest.raises(DeadlineExceededError, match=r"deadline of 0\.050 s"):
            asyncio.run(service.predict_async(NAME, None, _inputs(), protocol="http", timeout=0.05))
    finally:
        blocked.release.set()
    assert _requests(service, model.version, "DeadlineExceededError") == 1.0
    answer = asyncio.run(service.predict_async(NAME, None, _inputs(), protocol="http"))
    assert answer.outputs["prediction"].shape == (2, 1)
    assert threading.get_ident() not in threads


def test_the_tier_check_notes_shards_not_serving_and_foreign_versions(checkpoints, make_service):
    """Shards that answer but cannot serve make tier_serving false (not readiness); shards
    that name another embedding checkpoint are counted, those that name none ("") are not."""
    model = _load(checkpoints[0])
    expected = model.embedding_version
    assert expected
    tier = model.tier = _RemoteTier(
        model.tier, versions=("", expected, "other", ""), serving=(True, False, True, False)
    )
    tier.tasks = ("", "loading", "", "")
    service = make_service(model, tier_check_seconds=0.01)
    gauge = service.metrics.registry.get_sample_value

    _wait_until(lambda: not service.tier_serving)
    # Named as the worker's own log line names them (it used to be "embedding shard(s) [1, 3]
    # cannot serve yet": no worker, address or task).
    assert service.last_tier_error == (
        "embedding worker w:7100: shard 1 (s:7001) cannot serve yet (loading); "
        "shard 3 (s:7003) cannot serve yet"
    )
    assert service.foreign_embedding_versions == {2: "other"}
    assert gauge("recserve_embedding_tier_version_mismatch") == 1.0
    assert service.ready()
    tier.serving, tier.versions = (True,) * 4, ("", expected, expected, "")
    _wait_until(lambda: service.tier_serving)
    assert service.last_tier_error is None and service.foreign_embedding_versions == {}


def test_the_tier_check_notes_a_worker_with_another_config_and_each_new_reason(
    checkpoints, make_service, caplog
):
    """A worker restarted with another embedding config reads other rows for every ID (the
    load checked the one before): an error naming it, not the usual "requests fail" warning,
    and tier_serving false. A new reason while not serving is logged too (it used to say
    nothing once the tier was down)."""
    model = _load(checkpoints[0])
    tier = model.tier = _RemoteTier(model.tier, serving=(True,))
    other = dataclasses.replace(model.embedding_config, feature_index_prefix_bit=12)
    tier.config = other
    caplog.set_level(logging.INFO, logger="serving.service")
    service = make_service(model, tier_check_seconds=0.01)
    _wait_until(lambda: not service.tier_serving)
    expected = (
        f"embedding worker w:7100 serves another embedding config than checkpoint "
        f"{model.manifest.directory}: slot 'user' has another ID prefix in the checkpoint "
        "(feature groups or feature_index_prefix_bit changed); slot 'item' has another ID "
        "prefix in the checkpoint (feature groups or feature_index_prefix_bit changed) (start "
        "the worker with the checkpoint's embedding_config.yml)"
    )
    assert service.last_tier_error == expected
    tier.config, tier.serving = model.embedding_config, (False,)
    waiting = "embedding worker w:7100: shard 0 (s:7000) cannot serve yet"
    _wait_until(lambda: service.last_tier_error == waiting)
    tier.serving = (True,)
    _wait_until(lambda: service.tier_serving)
    logged = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert logged == [
        (
            "ERROR",
            "embedding tier not serving this model (its IDs read other rows, unknown ones as "
            "zeros, so its predictions are wrong until the worker runs the checkpoint's "
            f"config): {expected}",
        ),
        (
            "WARNING",
            "embedding tier not serving (requests that need it fail or get default vectors, "
            f"as --fallback-policy says): {waiting}",
        ),
        ("INFO", "embedding tier serving again"),
    ]


def test_with_shards_in_process_the_tier_check_runs_the_workers_shard_check(
    checkpoints, make_service, caplog
):
    """serve --embedding-ps runs the worker core (a RemoteShardTier) in process: its tier
    check runs the worker's check of the shards too (verify_shards: replica order and
    embedding config, which refuses lookups while a shard is keyed otherwise), as a worker
    does every 2 s, not only at start. Logged as not serving, and as serving again."""
    model = _load(checkpoints[0])
    tier = model.tier = _RemoteTier(model.tier, serving=(True, True))
    refusal = (
        "parameter server p:7001 (shard 1) keys its rows by another embedding config: slot "
        "'user' has another dim at the shard (give the shards and the workers one "
        "embedding_config.yml)"
    )
    problem: list[str | None] = [refusal]

    def verify_shards() -> None:
        if problem[0] is not None:
            raise InvalidArgumentError(problem[0])

    tier.verify_shards = verify_shards
    caplog.set_level(logging.INFO, logger="serving.service")
    service = make_service(model, tier_check_seconds=0.01)
    _wait_until(lambda: service.last_tier_error == refusal)
    assert not service.tier_serving
    problem[0] = None
    _wait_until(lambda: service.tier_serving)
    assert service.last_tier_error is None
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        (
            "WARNING",
            "embedding tier not serving (requests that need it fail or get default vectors, "
            f"as --fallback-policy says): {refusal}",
        ),
        ("INFO", "embedding tier serving again"),
    ]


def test_a_tier_check_that_raises_unexpectedly_marks_the_tier_down_and_goes_on(
    checkpoints, make_service, caplog
):
    """A surprise in a tier check (a bug, a peer's odd answer: not a RecserveError) ended
    the check thread for good, leaving recserve_embedding_tier_serving at 1 whatever the
    tier did next. It now counts as the tier not serving, logged with its traceback once,
    and the checks go on: the tier serving again shows."""
    model = _load(checkpoints[0])
    tier = model.tier = _RemoteTier(model.tier, serving=(True,))
    failing = [True]
    status = tier.status

    def odd_status():
        if failing[0]:
            raise KeyError("shard_serving")
        return status()

    tier.status = odd_status
    caplog.set_level(logging.INFO, logger="serving.service")
    service = make_service(model, tier_check_seconds=0.01)
    gauge = service.metrics.registry.get_sample_value
    _wait_until(lambda: not service.tier_serving)
    assert service.last_tier_error == (
        "checking the embedding tier failed: KeyError: 'shard_serving'"
    )
    assert gauge("recserve_embedding_tier_serving") == 0.0
    assert service.ready()  # the tier's state is a metric, not readiness
    time.sleep(0.1)  # several more checks fail alike: logged once
    failing[0] = False
    _wait_until(lambda: service.tier_serving)
    assert gauge("recserve_embedding_tier_serving") == 1.0
    assert service._tier_checker.is_alive()
    logged = [(r.levelname, r.getMessage(), r.exc_info is not None) for r in caplog.records]
    assert logged == [
        ("ERROR", "checking the embedding tier failed", True),
        (
            "WARNING",
            "embedding tier not serving (requests that need it fail or get default vectors, "
            "as --fallback-policy says): checking the embedding tier failed: KeyError: "
            "'shard_serving'",
            False,
        ),
        ("INFO", "embedding tier serving again", False),
    ]


def test_a_tier_check_cut_short_by_the_close_says_nothing_about_the_tier(
    checkpoints, make_service, caplog
):
    """A server stopping closes its model's channel under a tier check still waiting on a
    slow tier; the check's "cancelled the call" was logged as the tier not serving."""
    model = _load(checkpoints[0])
    tier = model.tier = _RemoteTier(model.tier, serving=(True,))
    asked, closed = threading.Event(), threading.Event()

    def status():
        asked.set()
        closed.wait(WAIT)
        raise UnavailableError("embedding worker w:7100 cancelled the call (shutting down?)")

    tier.status = status
    caplog.set_level(logging.INFO, logger="serving.service")
    service = make_service(model, tier_check_seconds=0.01)
    assert asked.wait(WAIT)
    closer = threading.Thread(target=service.close, kwargs={"wait": 1.0})
    closer.start()
    _wait_until(lambda: service._stop_checks.is_set())
    closed.set()  # the call ends as the closed channel ends it
    closer.join(WAIT)
    service._tier_checker.join(WAIT)
    assert not service._tier_checker.is_alive()
    assert service.tier_serving and service.last_tier_error is None
    assert [r.getMessage() for r in caplog.records if "tier" in r.getMessage()] == []


def test_metadata_names_the_served_version_and_the_request_limit(checkpoints, make_service):
    service = make_service(_load(checkpoints[0]), max_batch_size=8, max_request_batch_size=5)
    metadata = service.model_metadata(NAME)
    assert metadata.name == NAME
    assert metadata.versions == (service.model.version,)
    assert metadata.max_batch_size == 5
    assert metadata.platform == "recserve_torchscript"
    assert [spec.name for spec in metadata.inputs][:2] == ["user", "item"]


def test_each_merged_batch_size_is_observed(checkpoints, make_service):
    service = make_service(_load(checkpoints[0]))
    service.predict(NAME, None, _inputs(2), protocol="http")
    asyncio.run(service.predict_async(NAME, None, _inputs(3), protocol="http"))
    sample = service.metrics.registry.get_sample_value
    assert sample("recserve_batch_size_count") == 2.0
    assert sample("recserve_batch_size_sum") == 5.0


def test_a_prediction_that_is_not_finite_is_refused(checkpoints, make_service):
    model = _load(checkpoints[0])
    infer = model.infer

    def infer_nan(merged):
        output = infer(merged)
        predictions = output.predictions.copy()
        predictions[1, 0] = np.nan
        return dataclasses.replace(output, predictions=predictions)

    model.infer = infer_nan  # type: ignore[method-assign]
    service = make_service(model)
    with pytest.raises(
        InvalidArgumentError,
        match=r"not finite \(NaN or Inf\) for 1 sample\(s\) of this request, the first at sample 1",
    ):
        service.predict(NAME, None, _inputs(2), protocol="http")


def test_close_refuses_new_requests_and_fails_those_still_queued(checkpoints, make_service):
    model = _load(checkpoints[0])
    blocked = _Blocked(model)
    service = make_service(model, max_batch_size=2)
    answers: dict[str, object] = {}

    def ask(key: str, rows: int) -> None:
        try:
            answers[key] = service.predict(NAME, None, _inputs(rows), protocol="http")
        except Exception as error:
            answers[key] = error

    running = threading.Thread(target=ask, args=("running", 2))
    running.start()
    assert blocked.started.wait(WAIT)
    queued = threading.Thread(target=ask, args=("queued", 2))
    queued.start()
    _wait_until(lambda: service.pending == 2)  # the second request is queued
    try:
        service.close(wait=0.05)  # the running batch outlives the wait
        assert not service.ready()
        with pytest.raises(UnavailableError, match="not ready"):
            service.predict(NAME, None, _inputs(), protocol="http")
    finally:
        blocked.release.set()
        running.join(WAIT)
        queued.join(WAIT)
    assert answers["running"].outputs["prediction"].shape == (2, 1)
    assert isinstance(answers["queued"], UnavailableError)
    assert "stopped before this request's batch ran" in answers["queued"].message


def test_a_request_cancelled_on_the_loop_is_counted_and_not_computed(checkpoints, make_service):
    """What a reset HTTP connection does to its request: its task is cancelled while it
    waits for its flush; the merged batch runs without it and it counts as cancelled."""
    model = _load(checkpoints[0])
    sizes: list[int] = []
    infer = model.infer

    def recording_infer(merged):
        sizes.append(merged.batch_size)
        return infer(merged)

    model.infer = recording_infer  # type: ignore[method-assign]
    # The delay only has to outlast the few loop iterations up to the cancel (0.05 s could
    # run out on a loaded machine: the flush would take the request before its cancel).
    service = make_service(model, max_queue_delay=0.5)

    async def main():
        gone = asyncio.ensure_future(service.predict_async(NAME, None, _inputs(2), protocol="http"))
        await asyncio.sleep(0)  # queued on this loop's batcher
        staying = asyncio.ensure_future(
            service.predict_async(NAME, None, _inputs(3), protocol="http")
        )
        await asyncio.sleep(0)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        return await asyncio.wait_for(staying, 5)

    answer = asyncio.run(main())
    assert answer.outputs["prediction"].shape == (3, 1)
    assert sizes == [3]
    assert _requests(service, model.version, "cancelled") == 1.0
    assert _requests(service, model.version, "ok") == 1.0


def test_a_reload_closes_the_old_model_only_after_the_batch_running_on_it(
    checkpoints, make_service
):
    """In-flight requests finish on the version they started with: the replaced model is
    closed once the merged batch running at the swap is done, not under it."""
    first, second = checkpoints
    closed: list[str] = []
    old = _closing_recorded(_load(first), closed)
    blocked = _Blocked(old)
    service = make_service(old, loader=lambda path: _load(second))
    answers: list[object] = []
    asking = threading.Thread(
        target=lambda: answers.append(service.predict(NAME, None, _inputs(), protocol="http"))
    )
    reloading = threading.Thread(target=service.reload, args=(None,))
    try:
        asking.start()
        assert blocked.started.wait(WAIT)
        reloading.start()
        _wait_until(lambda: service.model is not old)  # the new version is swapped in
        reloading.join(0.2)
        assert reloading.is_alive() and closed == []  # waiting for the running batch
    finally:
        blocked.release.set()
        asking.join(WAIT)
        reloading.join(WAIT)
    assert closed == [old.version]
    assert answers[0].model_version == old.version


def test_fail_queued_answers_the_requests_still_queued_on_every_path_at_once(
    checkpoints, make_service
):
    """A stop whose drain ran out of grace: requests still waiting for their merged batch,
    on the dispatcher thread and on an event loop, are answered UnavailableError (503 /
    UNAVAILABLE) at once, not when the batching delay ends."""
    service = make_service(_load(checkpoints[0]), max_queue_delay=30.0, max_batch_size=1000)
    answers: dict[str, object] = {}

    def on_the_dispatcher() -> None:
        try:
            answers["thread"] = service.predict(NAME, None, _inputs(), protocol="grpc", timeout=60)
        except Exception as error:
            answers["thread"] = error

    def on_a_loop() -> None:
        async def ask():
            return await service.predict_async(NAME, None, _inputs(3), protocol="http", timeout=60)

        try:
            answers["loop"] = asyncio.run(ask())
        except Exception as error:
            answers["loop"] = error

    askers = [threading.Thread(target=on_the_dispatcher), threading.Thread(target=on_a_loop)]
    for asker in askers:
        asker.start()
    try:
        _wait_until(lambda: service.pending == 2)
        assert service.drain(0.05) is False
        started = time.monotonic()
        service.fail_queued()
        for asker in askers:
            asker.join(WAIT)
        assert time.monotonic() - started < 10.0  # not after the 30 s delay
    finally:
        service.close(wait=1.0)
        for asker in askers:
            asker.join(WAIT)
    assert sorted(answers) == ["loop", "thread"]
    for answer in answers.values():
        assert isinstance(answer, UnavailableError), answer
        assert answer.message == "the server stopped before this request's batch ran"
    assert not service.ready()
    assert _requests(service, service.model.version, "UnavailableError", "grpc") == 1.0
    assert _requests(service, service.model.version, "UnavailableError", "http") == 1.0


def test_a_stop_out_of_grace_answers_every_request_left_before_its_front_ends_close(
    checkpoints, monkeypatch
):
    """SIGTERM's stop when requests cannot finish within --grace-seconds: each still gets an
    answer, 503 / UNAVAILABLE naming why, over HTTP (a small body batched on the event loop,
    a large one on the dispatcher thread) and gRPC. Queued ones (held by a 30 s batching
    delay) are refused at once; one whose batch is stuck in the model (a stalled embedding
    tier) gets its model's error once the model is closed. They used to get a cut
    connection, a 500, and gRPC's "Cancelling all calls"."""
    import http.client
    import json

    from clients import RecserveClient
    from serving import server as server_module
    from serving.options import ServeOptions
    from serving.server import PredictionServer

    # Not in the test process: a frozen heap and spaced-out collections for every later test.
    monkeypatch.setattr(server_module, "freeze_long_lived_objects", lambda: None)
    monkeypatch.setattr(server_module, "space_out_young_collections", lambda: None)
    options = ServeOptions(
        checkpoint=checkpoints[0],
        model_name=NAME,
        http_port=0,
        grpc_port=0,
        grace_seconds=0.5,
        max_queue_delay_ms=30_000.0,
        max_batch_size=4,  # a request of 4 rows runs at once; those of 2 wait for the delay
        request_timeout=60.0,
        threads=torch.get_num_threads(),
    )
    serving = PredictionServer(options).start()
    service = serving.service
    assert service is not None
    model = service.model
    started, closed = threading.Event(), threading.Event()
    close = model.close

    def stalled_infer(merged):  # what a lookup on a stalled remote tier does
        started.set()
        assert closed.wait(WAIT)
        raise UnavailableError("embedding tier closed while looking up")

    model.infer = stalled_infer  # type: ignore[method-assign]
    model.close = lambda: (closed.set(), close())  # type: ignore[method-assign]
    body = json.dumps(
        {
            "inputs": [
                {"name": "user", "shape": [2], "datatype": "UINT64", "data": [0, 1]},
                {"name": "item", "shape": [2], "datatype": "UINT64", "data": [1, 0]},
                {"name": "dense", "shape": [2, 3], "datatype": "FP32", "data": [0.5] * 6},
            ]
        }
    ).encode()
    answers: dict[str, object] = {}

    def over_http(key: str, payload: bytes) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", serving.http_port, timeout=WAIT)
        try:
            connection.request("POST", f"/v2/models/{NAME}/infer", body=payload)
            response = connection.getresponse()
            answers[key] = (response.status, json.loads(response.read()))
        except Exception as error:
            answers[key] = error
        finally:
            connection.close()

    def over_grpc(key: str, rows: int) -> None:
        url = f"grpc://127.0.0.1:{serving.grpc_port}"
        with RecserveClient(url, model_name=NAME, retries=0, timeout=WAIT) as client:
            try:
                answers[key] = client.infer(_inputs(rows))
            except Exception as error:
                answers[key] = error

    running = threading.Thread(target=over_grpc, args=("running", 4))
    askers = [
        running,
        threading.Thread(target=over_grpc, args=("grpc", 2)),
        threading.Thread(target=over_http, args=("small", body)),
        # Past 64 KiB (trailing JSON whitespace): decoded and batched on the dispatcher.
        threading.Thread(target=over_http, args=("large", body + b" " * 70_000)),
    ]
    try:
        running.start()
        assert started.wait(WAIT)
        for asker in askers[1:]:
            asker.start()
        _wait_until(lambda: service.pending == 4)
        began = time.monotonic()
        assert serving.stop() is False  # not drained: the grace period ended first
        assert time.monotonic() - began < 5.0
    finally:
        closed.set()
        if not serving._stop.is_set():
            serving.stop()
        for asker in askers:
            asker.join(WAIT)
    refusal = "the server stopped before this request's batch ran"
    assert answers["small"] == (503, {"error": refusal})
    assert answers["large"] == (503, {"error": refusal})
    for key, message in (("grpc", refusal), ("running", "embedding tier closed while looking up")):
        assert isinstance(answers[key], UnavailableError), answers[key]
        assert answers[key].message.endswith(f"answered gRPC UNAVAILABLE: {message}")


def test_a_reload_that_ends_after_close_is_not_served_and_each_model_closes_once(
    checkpoints, make_service
):
    """SIGTERM while a reload loads: close() closes the served model; the reload then
    refuses to swap in what it loaded (UnavailableError), closes it, and the server may
    exit once wait_for_reload says it ended."""
    first, second = checkpoints
    closed: list[str] = []
    loading, release = threading.Event(), threading.Event()

    def loader(_path):
        loading.set()
        assert release.wait(WAIT)
        return _closing_recorded(_load(second), closed)

    old = _closing_recorded(_load(first), closed)
    service = make_service(old, loader=loader)
    errors: list[BaseException] = []

    def reload() -> None:
        try:
            service.reload(None)
        except Exception as error:
            errors.append(error)

    reloading = threading.Thread(target=reload)
    reloading.start()
    try:
        assert loading.wait(WAIT)
        service.close(wait=1.0)
        assert closed == [old.version]
        assert service.reloading and not service.wait_for_reload(0.05)
    finally:
        release.set()
        reloading.join(WAIT)
    assert service.wait_for_reload(0.0) and not service.reloading
    (error,) = errors
    assert isinstance(error, UnavailableError)
    assert "the server is stopping" in error.message and "is not served" in error.message
    assert len(closed) == 2 and closed[0] == old.version and closed[1] != old.version
    assert service.model is old


def test_a_reload_asked_for_after_close_loads_nothing(checkpoints, make_service):
    """The watcher's poll under way when the stop came reloads after close() (and after
    the stop's wait_for_reload): it is refused before loading, so no model loads (in
    torch) while the process exits."""
    first, _second = checkpoints
    loads: list[str | None] = []
    service = make_service(_load(first), loader=lambda path: loads.append(path) or _load(first))
    service.close(wait=1.0)
    with pytest.raises(UnavailableError, match="the server is stopping: it loads no new version"):
        service.reload(None)
    assert loads == [] and not service.reloading


def test_requests_given_up_or_past_their_deadline_free_their_place_and_are_never_computed(
    checkpoints, monkeypatch
):
    """A real server, queues of one request, a model held on purpose: a request whose
    client left (a reset HTTP connection, small or large body) or whose deadline passed (a
    gRPC deadline, an HTTP timeout parameter) frees its place when that happens, not when its
    batch would have run, so the next live request is taken instead of refused 503 /
    UNAVAILABLE; it is never computed; an HTTP request of a 50 ms timeout behind the held
    batch is answered 504 at its deadline, not after the batch. /metrics counts each."""
    import http.client
    import json
    import socket
    import struct

    from clients import RecserveClient
    from serving import server as server_module
    from serving.options import ServeOptions
    from serving.server import PredictionServer

    monkeypatch.setattr(server_module, "freeze_long_lived_objects", lambda: None)
    monkeypatch.setattr(server_module, "space_out_young_collections", lambda: None)
    options = ServeOptions(
        checkpoint=checkpoints[0],
        model_name=NAME,
        http_port=0,
        grpc_port=0,
        grace_seconds=0.5,
        max_queue_delay_ms=30_000.0,  # only 4 rows run at once: 2 wait for the delay
        max_batch_size=4,
        max_queue_size=1,
        request_timeout=10.0,
        onednn_min_rows=0,
        threads=torch.get_num_threads(),
    )
    serving = PredictionServer(options).start()
    service = serving.service
    assert service is not None
    model = service.model
    infer = model.infer
    sizes: list[int] = []
    held, started = threading.Event(), threading.Event()

    def recorded_infer(merged):
        sizes.append(merged.batch_size)
        if not held.is_set():  # the first batch is held until the test lets it go
            started.set()
            assert held.wait(WAIT)
        return infer(merged)

    model.infer = recorded_infer  # type: ignore[method-assign]

    def body(rows: int, **parameters) -> bytes:
        inputs = [
            {"name": name, "shape": list(array.shape), "datatype": datatype}
            | {"data": array.ravel().tolist()}
            for (name, array), datatype in zip(
                _inputs(rows).items(), ("UINT64", "UINT64", "FP32"), strict=True
            )
        ]
        return json.dumps({"inputs": inputs, "parameters": parameters}).encode()

    def post(payload: bytes) -> tuple[int, dict]:
        connection = http.client.HTTPConnection("127.0.0.1", serving.http_port, timeout=WAIT)
        try:
            connection.request("POST", f"/v2/models/{NAME}/infer", body=payload)
            response = connection.getresponse()
            return response.status, json.loads(response.read())
        finally:
            connection.close()

    def post_then_reset(payload: bytes, queued: Callable[[], bool]) -> None:
        """Send a request, wait until it is queued, then reset the connection (a FIN alone
        is a half-close, which still gets its answer)."""
        sock = socket.create_connection(("127.0.0.1", serving.http_port), timeout=WAIT)
        head = f"POST /v2/models/{NAME}/infer HTTP/1.1\r\nHost: x\r\n"
        sock.sendall(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        _wait_until(queued)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()

    grpc_url = f"grpc://127.0.0.1:{serving.grpc_port}"
    answers: dict[str, object] = {}
    prompt = 3.0  # s: "at once" on a loaded machine; the held batch and the delay last longer

    def over_grpc(key: str, rows: int, timeout: float = WAIT) -> None:
        with RecserveClient(grpc_url, model_name=NAME, retries=0, timeout=timeout) as client:
            try:
                answers[key] = client.infer(_inputs(rows)).predictions.shape
            except Exception as error:
                answers[key] = error

    thread_queue = service._batcher
    holding = threading.Thread(target=over_grpc, args=("held", 4))
    live = threading.Thread(target=over_grpc, args=("live", 4))
    try:
        holding.start()
        assert started.wait(WAIT)  # the dispatcher runs it, holding the model
        # HTTP, on the event loop, 50 ms: answered at its deadline, not after the batch.
        began = time.monotonic()
        status, answer = post(body(4, timeout=50_000))
        took = time.monotonic() - began
        assert (status, answer) == (
            504,
            {"error": "the request's deadline passed while it was queued"},
        )
        assert took < 1.0  # the held batch lasts until the test ends it
        # gRPC behind the held batch, a 0.2 s deadline: its place is free once it passes.
        over_grpc("late", 2, timeout=0.2)
        assert isinstance(answers["late"], DeadlineExceededError)
        _wait_until(lambda: thread_queue.pending == 1, within=prompt)  # was: after the batch
        # A large body (over 64 KiB: the dispatcher's queue) whose client resets.
        large = body(2) + b" " * 70_000
        post_then_reset(large, lambda: thread_queue.pending == 2)
        # At once (a bound for a slow machine), not at its 10 s deadline nor after the batch.
        _wait_until(lambda: thread_queue.pending == 1, within=prompt)
        live.start()
        _wait_until(lambda: thread_queue.pending == 2)  # taken: was UNAVAILABLE, queue full
        held.set()
        live.join(WAIT)
        holding.join(WAIT)
        assert answers["held"] == answers["live"] == (4, 1)
        # A small body on the event loop (held by the 30 s delay) whose client resets.
        post_then_reset(body(2), lambda: service.pending == 1)
        _wait_until(lambda: service.pending == 0, within=prompt)  # was: until the 30 s delay
        assert post(body(4))[0] == 200  # 4 rows run at once; was 503, queue full
    finally:
        held.set()
        serving.stop()
        for thread in (holding, live):
            thread.join(WAIT)
    assert sizes == [4, 4, 4]  # the held batch, then the live gRPC and HTTP ones
    metrics = service.metrics.registry
    dropped = {
        reason: metrics.get_sample_value("recserve_dropped_requests_total", {"reason": reason})
        for reason in ("cancelled", "deadline")
    }
    assert dropped == {"cancelled": 2.0, "deadline": 2.0}
    version = model.version
    assert _requests(service, version, "cancelled", "http") == 2.0
    assert _requests(service, version, "DeadlineExceededError", "http") == 1.0
    assert _requests(service, version, "DeadlineExceededError", "grpc") == 1.0
    assert _requests(service, version, "ok", "grpc") == 2.0
    assert _requests(service, version, "ok", "http") == 1.0
    assert _requests(service, version, "UnavailableError", "grpc") == 0.0


# --------------------------------------------------------------------------- bad inputs
@pytest.fixture(scope="module")
def hour_checkpoint(tmp_path_factory) -> Path:
    """A model that indexes ``nn.Embedding(24)`` with its int64 feature "hour": a request
    holding an hour past 23 makes it raise (torch's "index out of range in self")."""
    from tests.unit.test_dense_dtypes import CONFIG as USER_CONFIG
    from tests.unit.test_dense_dtypes import HourIndex

    torch.manual_seed(0)
    batch = Batch(
        [IDTypeFeatureWithSingleID("user", np.arange(2, dtype=np.uint64))],
        [NonIDTypeFeature(np.array([[1], [2]], np.int64), "hour")],
        requires_grad=False,
    )
    directory = tmp_path_factory.mktemp("hours") / "checkpoint"
    tier = InProcessEmbeddingTier(USER_CONFIG, capacity=100)
    signature = FeatureSignature.from_batch(batch)
    model_checkpoint.write_checkpoint(directory, HourIndex(), None, tier, signature=signature)
    return directory


def _concurrently(call: Callable[[int], object], count: int) -> list[object]:
    """``call(0) .. call(count - 1)`` on threads of their own, at once: each one's answer,
    or the exception it raised."""
    answers: list[object] = [None] * count

    def run(index: int) -> None:
        try:
            answers[index] = call(index)
        except Exception as error:
            answers[index] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT)
    return answers


def _hour(hour: float) -> dict[str, np.ndarray]:
    return {"user": np.array([1], np.uint64), "hour": np.array([[hour]], np.float32)}


@pytest.mark.parametrize("path", ["event loop", "dispatcher thread"])
def test_a_request_whose_inputs_break_the_model_fails_alone_and_those_merged_with_it_are_answered(
    hour_checkpoint, make_service, caplog, path
):
    """Three requests merged into one batch, one of them with hour 30: it alone is answered
    ModelInputError (400) naming its hour, the model's error and traceback go to the log,
    and the other two get what each gets served alone; the split is counted."""
    model = _load(hour_checkpoint)
    signature = model.signature
    alone = {
        hour: model.infer(tensors_to_batch(signature, _hour(hour), max_batch_size=1)).predictions
        for hour in (3, 5)
    }
    # 3 samples fill a merged batch at once; one or two wait up to 30 s for the others.
    service = make_service(model, max_batch_size=3, max_queue_delay=30.0)
    hours = (3, 30, 5)
    if path == "event loop":

        async def main():
            calls = [service.predict_async(NAME, None, _hour(h), protocol="http") for h in hours]
            return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), WAIT)

        answers = asyncio.run(main())
    else:
        answers = _concurrently(
            lambda index: service.predict(NAME, None, _hour(hours[index]), protocol="grpc"), 3
        )
    three, thirty, five = answers
    np.testing.assert_array_equal(three.outputs["prediction"], alone[3])
    np.testing.assert_array_equal(five.outputs["prediction"], alone[5])
    assert isinstance(thirty, ModelInputError) and http_status_of(thirty) == 400
    assert thirty.message == (
        "the model failed on this request's inputs: an index is out of range (RuntimeError: "
        "index out of range in self); is an integer input beyond what the model takes? "
        "'hour' holds 30"
    )
    registry = service.metrics.registry
    assert registry.get_sample_value("recserve_split_batches_total") == 1.0
    protocol = "http" if path == "event loop" else "grpc"
    assert _requests(service, model.version, "ModelInputError", protocol) == 1.0
    assert _requests(service, model.version, "ok", protocol) == 2.0
    logged = [r for r in caplog.records if r.name == "serving.service"]
    assert [r.getMessage() for r in logged] == [
        f"model {NAME}: answered 400 to a request whose inputs made the dense model fail: "
        + thirty.message
    ]
    assert logged[0].exc_info is not None and logged[0].exc_info[1] is thirty
    assert isinstance(thirty.__cause__, RuntimeError)
    # The split's line names the model's error, not the merged batch's values.
    split = [r.getMessage() for r in caplog.records if r.name == "serving.batcher"]
    assert split == [
        "a merged batch of 3 requests failed (RuntimeError: index out of range in self): ran "
        "them one by one, so that one request's bad inputs fail that request only: 1 failed "
        "alone, 2 answered, 0 not answered (gone, past their deadline, the server stopping or "
        "failing)"
    ]


def test_on_a_real_server_only_the_request_that_breaks_the_model_fails(
    hour_checkpoint, monkeypatch
):
    """The same over HTTP (batched on the event loop) and gRPC (the dispatcher thread) of a
    server on loopback: of three requests merged into one batch, the one with hour 30 is
    answered 400 / INVALID_ARGUMENT naming its hour, the other two what each gets alone;
    /metrics counts both splits."""
    import urllib.request

    from clients import RecserveClient
    from serving import server as server_module
    from serving.options import ServeOptions
    from serving.server import PredictionServer

    # Not in the test process: a frozen heap and spaced-out collections for every later test.
    monkeypatch.setattr(server_module, "freeze_long_lived_objects", lambda: None)
    monkeypatch.setattr(server_module, "space_out_young_collections", lambda: None)
    options = ServeOptions(
        checkpoint=hour_checkpoint,
        model_name=NAME,
        http_port=0,
        grpc_port=0,
        max_queue_delay_ms=30_000.0,  # 3 samples run at once; fewer wait for the others
        max_batch_size=3,
        onednn_min_rows=0,
        threads=torch.get_num_threads(),
    )
    serving = PredictionServer(options).start()
    try:
        assert serving.service is not None
        model = serving.service.model
        alone = {
            hour: model.infer(
                tensors_to_batch(model.signature, _hour(hour), max_batch_size=1)
            ).predictions
            for hour in (3, 5)
        }
        hours = (3, 30, 5)
        for url in (
            f"http://127.0.0.1:{serving.http_port}",
            f"grpc://127.0.0.1:{serving.grpc_port}",
        ):

            def ask(index: int, url: str = url) -> object:
                with RecserveClient(url, model_name=NAME, retries=0, timeout=WAIT) as client:
                    return client.infer(_hour(hours[index])).predictions

            answers = _concurrently(ask, 3)
            three, thirty, five = answers
            np.testing.assert_array_equal(three, alone[3])
            np.testing.assert_array_equal(five, alone[5])
            assert isinstance(thirty, InvalidArgumentError), (url, thirty)
            assert thirty.message.endswith(
                "the model failed on this request's inputs: an index is out of range "
                "(RuntimeError: index out of range in self); is an integer input beyond what "
                "the model takes? 'hour' holds 30"
            )
        metrics_url = f"http://127.0.0.1:{serving.http_port}/metrics"
        with urllib.request.urlopen(metrics_url, timeout=WAIT) as response:
            scraped = response.read().decode()
        assert "\nrecserve_split_batches_total 2.0\n" in scraped
    finally:
        serving.stop()


def test_a_preprocessor_s_index_or_overflow_error_is_the_rows_fault_as_in_eval(
    checkpoints, make_service
):
    """An IndexError or OverflowError that the preprocessor raised on the request's rows was
    a 500 from recserve serve, while recserve eval counted the same rows as bad rows: both
    now take them for the rows' fault (a 400; bad rows), as a KeyError or ValueError."""
    from clients.eval_encoders import PreprocessorEncoder

    def short_list(rows):
        return _rows_to_batch([{**row, "user": [7][row["user"] + 1]} for row in rows])

    def overflow(rows):
        return _rows_to_batch([{**row, "user": int(float("inf"))} for row in rows])

    reasons = {
        short_list: ("IndexError", "list index out of range"),
        overflow: ("OverflowError", "cannot convert float infinity to integer"),
    }
    for preprocessor, (kind, reason) in reasons.items():
        service = make_service(_load(checkpoints[0]), preprocessor=preprocessor)
        with pytest.raises(InvalidArgumentError) as raised:
            service.predict_instances(NAME, _rows(2), protocol="http")
        assert raised.value.message == f"instances could not be preprocessed: {reason}"
        bad_row = f"the preprocessor raised {kind}: {reason}"
        assert PreprocessorEncoder(preprocessor).encode(_rows(2)) == (
            None,
            [(0, bad_row), (1, bad_row)],
        )


def test_a_preprocessor_s_key_error_names_the_missing_key(checkpoints, make_service):
    """A KeyError's message is the bare key: the client read "instances could not be
    preprocessed: 'user'", which said nothing of a missing field. An error without a
    message is named by its type (the client read nothing after the colon)."""

    def no_message(rows):
        raise ValueError

    expected = {
        lambda rows: _rows_to_batch([{"item": 1}]): "instances could not be preprocessed: "
        "missing key 'user' (the preprocessor raised KeyError)",
        no_message: "instances could not be preprocessed: the preprocessor raised ValueError",
    }
    for preprocessor, message in expected.items():
        service = make_service(_load(checkpoints[0]), preprocessor=preprocessor)
        with pytest.raises(InvalidArgumentError) as raised:
            service.predict_instances(NAME, _rows(2), protocol="http")
        assert raised.value.message == message
