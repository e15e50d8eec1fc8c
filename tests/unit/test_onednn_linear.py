"""The dense model's linear layers as oneDNN kernels (serving.onednn_linear) and how a
:class:`serving.model.LoadedModel` uses them: only for merged batches of at least its row
threshold, only once they match the model as loaded, and never at the cost of an answer."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import List  # noqa: UP035  (TorchScript reads the forward signature)

import numpy as np
import pytest
import torch
from torch import nn

from embedding_store import model_checkpoint
from embedding_store.batch import Batch, IDTypeFeatureWithSingleID, NonIDTypeFeature
from embedding_store.config import embedding_config_from_mapping
from embedding_store.shard import RowBlock
from embedding_store.signature import FeatureSignature, IdFeatureSpec, NonIdFeatureSpec
from embedding_store.tier import InProcessEmbeddingTier
from embedding_store.worker import LookupResult
from serving import onednn_linear
from serving.model import load_model

DIM = 4
CONFIG = embedding_config_from_mapping(
    {"feature_index_prefix_bit": 8, "slots_config": {"user": {"dim": DIM}, "item": {"dim": DIM}}}
)
SIGNATURE = FeatureSignature(
    (IdFeatureSpec("user", True), IdFeatureSpec("item", True)),
    (NonIdFeatureSpec("dense", "float32", (3,)),),
)


class Mlp(nn.Module):
    """Every shape of linear layer the rewrite meets: followed by a ReLU (fused), at the end
    (not fused), without a bias, and one whose output is also read past its ReLU (a skip
    connection: the linear layer is rewritten, the ReLU is not fused into it)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(2 * DIM + 3, 32)
        self.second = nn.Linear(32, 32, bias=False)
        self.skip = nn.Linear(32, 32)
        self.last = nn.Linear(32, 1)

    def forward(
        self,
        non_id_tensors: List[torch.Tensor],  # noqa: UP006
        embedding_tensors: List[torch.Tensor],  # noqa: UP006
    ) -> torch.Tensor:
        x = torch.cat(embedding_tensors + non_id_tensors, dim=1)
        x = torch.relu(self.first(x))
        x = torch.relu(self.second(x))
        y = self.skip(x)
        return self.last(torch.relu(y) + y)


class NoLinear(nn.Module):
    def forward(
        self,
        non_id_tensors: List[torch.Tensor],  # noqa: UP006
        embedding_tensors: List[torch.Tensor],  # noqa: UP006
    ) -> torch.Tensor:
        return torch.cat(embedding_tensors + non_id_tensors, dim=1).sum(dim=1, keepdim=True)


class CrossRow(nn.Module):
    """Each row's answer depends on the other rows of its batch (centred on the batch mean), so
    chunks of a batch do not answer as the whole batch does."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2 * DIM + 3, 1)

    def forward(
        self,
        non_id_tensors: List[torch.Tensor],  # noqa: UP006
        embedding_tensors: List[torch.Tensor],  # noqa: UP006
    ) -> torch.Tensor:
        y = self.linear(torch.cat(embedding_tensors + non_id_tensors, dim=1))
        return y - y.mean(dim=0, keepdim=True)


def _inputs(rows: int, seed: int = 1) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return (
        [torch.randn(rows, 3, generator=generator)],
        [torch.randn(rows, DIM, generator=generator) for _ in range(2)],
    )


def _kinds(module: torch.jit.ScriptModule) -> list[str]:
    return [node.kind() for node in module.graph.nodes()]


def _pointwise_attrs(module: torch.jit.ScriptModule) -> list[str]:
    return [
        node.inputsAt(3).toIValue()
        for node in module.graph.nodes()
        if node.kind() == "mkldnn::_linear_pointwise"
    ]


# ------------------------------------------------------------------------ the rewrite itself
def test_every_linear_layer_is_rewritten_and_computes_as_before():
    torch.manual_seed(0)
    loaded = torch.jit.script(Mlp().eval())
    rewritten, layers = onednn_linear.rewrite_linear_layers(loaded)

    assert layers == 4
    assert "aten::linear" not in _kinds(rewritten)
    # first and second: ReLU fused; skip: its output is read twice, so not; last: none follows
    assert sorted(_pointwise_attrs(rewritten)) == ["none", "none", "relu", "relu"]
    assert _kinds(rewritten).count("aten::relu") == 1
    with torch.inference_mode():
        for rows in (1, 7, 64, 300):
            expected = loaded(*_inputs(rows))
            output = rewritten(*_inputs(rows))
            assert output.shape == (rows, 1)
            assert onednn_linear.outputs_match(output, expected)
            torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)


def test_the_loaded_module_is_left_as_it_is():
    loaded = torch.jit.script(Mlp().eval())
    before = loaded.code
    onednn_linear.rewrite_linear_layers(loaded)
    assert loaded.code == before
    assert "mkldnn" not in loaded.code


def test_a_model_without_linear_layers_is_not_rewritten():
    rewritten, layers = onednn_linear.rewrite_linear_layers(torch.jit.script(NoLinear()))
    assert layers == 0
    assert "mkldnn::_linear_pointwise" not in _kinds(rewritten)


def test_outputs_match_is_rounding_only():
    loaded = torch.tensor([[0.5], [-2.0], [100.0]])
    assert onednn_linear.outputs_match(loaded + 1e-6, loaded)
    assert not onednn_linear.outputs_match(loaded + 1e-2, loaded)
    assert not onednn_linear.outputs_match(loaded.reshape(1, 3), loaded)
    assert not onednn_linear.outputs_match(loaded.double(), loaded)
    nan = loaded.clone()
    nan[1] = float("nan")
    assert not onednn_linear.outputs_match(nan, loaded)


def test_chunk_sizes_are_few_and_step_from_the_threshold():
    assert onednn_linear.chunk_sizes(256) == (
        256, 320, 384, 448, 512, 576, 640, 704, 768, 832, 896, 960, 1024
    )  # fmt: skip
    # below 256 rows, steps of 16 from the threshold; from 256, the steps of 64 above
    assert onednn_linear.chunk_sizes(32) == (
        32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240,
        256, 320, 384, 448, 512, 576, 640, 704, 768, 832, 896, 960, 1024,
    )  # fmt: skip
    assert onednn_linear.chunk_sizes(100)[:4] == (100, 116, 132, 148)
    assert onednn_linear.chunk_sizes(100)[8:11] == (228, 244, 256)
    assert onednn_linear.chunk_sizes(300)[:3] == (300, 364, 428)
    assert onednn_linear.chunk_sizes(300)[-1] == 940 + 64  # 1004: the last step under 1024
    assert onednn_linear.chunk_sizes(2000) == (2000,)  # a threshold past the largest chunk
    assert len(onednn_linear.chunk_sizes(1)) == 29  # few kernels, however low the threshold


@pytest.mark.parametrize(
    ("min_rows", "rows", "expected"),
    [
        (256, 256, 256),
        (256, 319, 256),
        (256, 320, 320),
        (256, 700, 640),
        (256, 1024, 1024),
        (256, 5000, 1024),
        (300, 1000, 940),
        (300, 2000, 1004),
        (16, 40, 32),
        (16, 100, 96),
        (16, 300, 256),
        (16, 5000, 1024),
        (100, 130, 116),
        (2000, 2500, 2000),
    ],
)
def test_chunk_size_is_the_largest_allowed_size_that_fits(min_rows, rows, expected):
    assert onednn_linear.chunk_size(min_rows, rows) == expected
    assert expected in onednn_linear.chunk_sizes(min_rows)


# ------------------------------------------------------------------- a served model using it
def _checkpoint(directory: Path, module: nn.Module) -> Path:
    torch.manual_seed(0)
    tier = InProcessEmbeddingTier(CONFIG, capacity=1000)
    ids = np.concatenate(
        [
            CONFIG.prefix_ids("user", np.arange(50, dtype=np.uint64)),
            CONFIG.prefix_ids("item", np.arange(50, dtype=np.uint64)),
        ]
    )
    weights = np.random.default_rng(0).normal(size=(ids.size, DIM)).astype(np.float32)
    tier.shards[0].import_rows(RowBlock(ids, weights, None))
    model_checkpoint.write_checkpoint(directory, module, None, tier, step=1, signature=SIGNATURE)
    return directory


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return _checkpoint(tmp_path_factory.mktemp("mlp") / "checkpoint", Mlp())


def _random_batch(model, rows: int) -> tuple[Batch, LookupResult]:
    ids = np.arange(rows, dtype=np.uint64) % 50
    dense = np.random.default_rng(rows).normal(size=(rows, 3)).astype(np.float32)
    batch = Batch(
        [IDTypeFeatureWithSingleID("user", ids), IDTypeFeatureWithSingleID("item", ids[::-1])],
        [NonIDTypeFeature(dense, "dense")],
        requires_grad=False,
    )
    return batch, model.lookup(batch)[0]


class Constant(nn.Module):
    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def forward(
        self,
        non_id_tensors: List[torch.Tensor],  # noqa: UP006
        embedding_tensors: List[torch.Tensor],  # noqa: UP006
    ) -> torch.Tensor:
        return torch.full((non_id_tensors[0].shape[0], 1), self.value)


class Failing(nn.Module):
    def forward(
        self,
        non_id_tensors: List[torch.Tensor],  # noqa: UP006
        embedding_tensors: List[torch.Tensor],  # noqa: UP006
    ) -> torch.Tensor:
        raise RuntimeError("oneDNN kernel failed")


def test_batches_from_the_threshold_up_run_the_rewritten_model(checkpoint, caplog):
    with caplog.at_level(logging.INFO, logger="serving.model"):
        model = load_model(checkpoint, name="m", onednn_min_rows=16)
    try:
        assert model.large_batch_rows == 16
        assert model.large_batch_dense is not None
        assert "4 linear layers run as oneDNN kernels for batches of >= 16 rows" in caplog.text

        for rows in (15, 16, 40, 48):  # the real kernels: the loaded model's answers
            batch, lookup = _random_batch(model, rows)
            with_onednn = model.forward(batch, lookup)
            rewritten = model.large_batch_dense
            model.large_batch_dense = None
            loaded = model.forward(batch, lookup)
            model.large_batch_dense = rewritten
            np.testing.assert_allclose(with_onednn, loaded, rtol=1e-5, atol=1e-5)

        # which module ran on which rows: one answering 7.0 stands in for the rewritten model;
        # it takes the largest chunks that fit (16 + k * 16 rows below 256, 256 + k * 64 up to
        # 1024), in turn, the loaded model the rest, under 16 rows, in one call
        # (1050 = 1024 + 16 + 10; 700 = 640 + 48 + 12)
        model.large_batch_dense = torch.jit.script(Constant(7.0))
        cases = (
            (1, 0), (15, 0), (16, 16), (40, 32), (48, 48), (100, 96), (700, 688), (1050, 1040)
        )  # fmt: skip
        for rows, rewritten_rows in cases:
            batch, lookup = _random_batch(model, rows)
            output = model.forward(batch, lookup)
            assert output.shape == (rows, 1)
            np.testing.assert_array_equal(output[:rewritten_rows], 7.0)
            assert not np.any(output[rewritten_rows:] == 7.0), rows
    finally:
        model.close()


def test_a_failing_rewritten_model_falls_back_to_the_loaded_one(checkpoint, caplog):
    model = load_model(checkpoint, name="m", onednn_min_rows=16)
    try:
        batch, lookup = _random_batch(model, 20)
        model.large_batch_dense = None
        expected = model.forward(batch, lookup)

        model.large_batch_dense = torch.jit.script(Failing())
        with caplog.at_level(logging.ERROR, logger="serving.model"):
            output = model.forward(batch, lookup)
        np.testing.assert_array_equal(output, expected)
        assert model.large_batch_dense is None  # not tried again
        assert "the oneDNN dense model failed on 20 rows" in caplog.text
        np.testing.assert_array_equal(model.forward(batch, lookup), expected)
    finally:
        model.close()


class RefusesLargeValues(nn.Module):
    """Mlp's first layers, refusing a batch that holds a dense value over 100 (as a model
    refuses an input it cannot take), before and after its rewrite for oneDNN."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(2 * DIM + 3, 32)
        self.last = nn.Linear(32, 1)

    def forward(
        self,
        non_id_tensors: List[torch.Tensor],  # noqa: UP006
        embedding_tensors: List[torch.Tensor],  # noqa: UP006
    ) -> torch.Tensor:
        if bool((non_id_tensors[0] > 100.0).any()):
            raise ValueError("a dense value over 100")
        x = torch.cat(embedding_tensors + non_id_tensors, dim=1)
        return self.last(torch.relu(self.first(x)))


def test_inputs_the_loaded_model_fails_on_too_keep_the_rewritten_model(tmp_path, caplog):
    """A large batch holding a request the model refuses fails on oneDNN and on the loaded
    model alike: that is the inputs' fault, answered with the loaded model's error, and
    later large batches still run on oneDNN."""
    checkpoint = _checkpoint(tmp_path / "refuses", RefusesLargeValues())
    model = load_model(checkpoint, name="m", onednn_min_rows=16, warm_up=False)
    try:
        rewritten = model.large_batch_dense
        assert rewritten is not None
        batch, lookup = _random_batch(model, 20)
        dense = batch.non_id_type_features[0].data.copy()
        dense[7, 1] = 1000.0
        bad = Batch(
            list(batch.id_type_features), [NonIDTypeFeature(dense, "dense")], requires_grad=False
        )
        with (
            caplog.at_level(logging.ERROR, logger="serving.model"),
            pytest.raises(torch.jit.Error, match="a dense value over 100"),
        ):
            model.forward(bad, lookup)
        assert model.large_batch_dense is rewritten
        assert "oneDNN" not in caplog.text
    finally:
        model.close()


def test_a_rewrite_that_changes_the_outputs_is_not_used(checkpoint, monkeypatch, caplog):
    off_by_one = torch.jit.script(Constant(1.0))
    monkeypatch.setattr(
        onednn_linear, "rewrite_linear_layers", lambda module, rows: (off_by_one, 4)
    )
    with caplog.at_level(logging.WARNING, logger="serving.model"):
        model = load_model(checkpoint, name="m", onednn_min_rows=16)
    try:
        assert model.large_batch_dense is None
        assert "outputs differ from the loaded model's on 16 rows; not used" in caplog.text
    finally:
        model.close()


def test_a_rewrite_that_fails_on_the_check_is_not_used(checkpoint, monkeypatch, caplog):
    failing = torch.jit.script(Failing())
    monkeypatch.setattr(onednn_linear, "rewrite_linear_layers", lambda module, rows: (failing, 4))
    with caplog.at_level(logging.WARNING, logger="serving.model"):
        model = load_model(checkpoint, name="m", onednn_min_rows=16)
    try:
        assert model.large_batch_dense is None
        assert "the oneDNN dense model fails on 16 rows; not used: " in caplog.text
        assert "oneDNN kernel failed" in caplog.text
    finally:
        model.close()


def test_zero_rows_turns_it_off_and_a_model_without_linear_layers_keeps_its_own(
    checkpoint, tmp_path
):
    model = load_model(checkpoint, name="m", onednn_min_rows=0)
    try:
        assert model.large_batch_dense is None
    finally:
        model.close()
    plain = load_model(_checkpoint(tmp_path / "plain", NoLinear()), name="m", onednn_min_rows=1)
    try:
        assert plain.large_batch_dense is None
    finally:
        plain.close()


def test_a_model_whose_rows_depend_on_each_other_is_not_chunked(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="serving.model"):
        model = load_model(_checkpoint(tmp_path / "cross", CrossRow()), name="m", onednn_min_rows=8)
    try:
        assert model.large_batch_dense is None
        assert "outputs differ from the loaded model's on 53 rows; not used" in caplog.text
        # Dynamic batching makes each answer depend on the other requests: said at load.
        assert "answers a row differently alone than in a batch of 8" in caplog.text
    finally:
        model.close()


def test_a_model_whose_rows_are_independent_loads_without_that_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="serving.model"):
        model = load_model(_checkpoint(tmp_path / "mlp", Mlp()), name="m", onednn_min_rows=0)
    model.close()
    assert "differently alone" not in caplog.text


def test_without_onednn_every_batch_runs_the_loaded_model(checkpoint, monkeypatch, caplog):
    # The project's pinned torch (2.13.0, CPU) has oneDNN, so every other test here runs the
    # real kernels and fails, not skips, if it ever lacks them; this one covers other builds.
    monkeypatch.setattr(onednn_linear, "onednn_available", lambda: False)
    with caplog.at_level(logging.INFO, logger="serving.model"):
        model = load_model(checkpoint, name="m", onednn_min_rows=16)
    try:
        assert model.large_batch_dense is None
        assert "this torch build has no oneDNN linear kernels" in caplog.text
        batch, lookup = _random_batch(model, 40)
        assert model.forward(batch, lookup).shape == (40, 1)
    finally:
        model.close()


class Recording:
    """Calls a module and notes how many rows each call had."""

    def __init__(self, module) -> None:
        self.module = module
        self.rows: list[int] = []

    def __call__(self, non_ids, embeddings):
        self.rows.append(int(non_ids[0].shape[0]))
        return self.module(non_ids, embeddings)


def test_every_chunk_size_is_checked_and_built_at_load_and_only_those_run(checkpoint, monkeypatch):
    # oneDNN builds a kernel per input shape it meets (milliseconds each): load meets every
    # size it will ever be called on, checked against the loaded model, so serving builds none.
    made: list[Recording] = []
    rewrite = onednn_linear.rewrite_linear_layers

    def recording_rewrite(module, rows):
        rewritten, layers = rewrite(module, rows)
        made.append(Recording(rewritten))
        return made[-1], layers

    monkeypatch.setattr(onednn_linear, "rewrite_linear_layers", recording_rewrite)
    model = load_model(checkpoint, name="m", onednn_min_rows=256)
    try:
        (recording,) = made
        assert model.large_batch_dense is recording
        allowed = onednn_linear.chunk_sizes(256)
        assert set(recording.rows) == set(allowed)
        recording.rows.clear()
        for rows in (255, 256, 300, 1024, 1500, 2100, 3000):
            batch, lookup = _random_batch(model, rows)
            with_onednn = model.forward(batch, lookup)
            model.large_batch_dense = None
            loaded = model.forward(batch, lookup)
            model.large_batch_dense = recording
            np.testing.assert_allclose(with_onednn, loaded, rtol=1e-5, atol=1e-5)
        # 300 -> 256 (+44 loaded); 1500 -> 1024 + 448 (+28); 2100 -> 1024 + 1024 (+52);
        # 3000 -> 1024 + 1024 + 896 (+56)
        assert recording.rows == [256, 256, 1024, 1024, 448, 1024, 1024, 1024, 1024, 896]
    finally:
        model.close()


@pytest.mark.parametrize(
    ("min_rows", "rows", "calls"),
    [
        (1, 63, [49]),  # was 63 one-row calls: ~100x the loaded model's time
        (1, 15, [1]),  # under 16 rows left after a chunk: the loaded model's
        (1, 1087, [1024, 49]),  # was 961, 65 and 61 one-row calls
        (16, 1087, [1024, 48]),  # was 976, 80 and 16
        (32, 1100, [1024, 64]),
        (64, 1100, [1024, 64]),
        (256, 3000, [1024, 1024, 896]),
        (1000, 2500, [1000, 1000]),
        (5000, 12000, [5000, 5000]),
    ],
)
def test_a_low_threshold_never_runs_its_smallest_chunk_over_and_over(
    checkpoint, min_rows, rows, calls
):
    model = load_model(checkpoint, name="m", onednn_min_rows=min_rows, warm_up=False)
    try:
        recording = Recording(model.large_batch_dense)
        model.large_batch_dense = recording
        batch, lookup = _random_batch(model, rows)
        with_onednn = model.forward(batch, lookup)
        assert recording.rows == calls
        model.large_batch_dense = None
        np.testing.assert_allclose(with_onednn, model.forward(batch, lookup), rtol=1e-5, atol=1e-5)
    finally:
        model.close()


def test_a_batch_of_whole_chunks_never_calls_the_loaded_model_on_no_rows(checkpoint):
    """The loaded model runs only on rows left after the chunks: none for a batch that is
    exactly a chunk size (a call on 0 rows would fail some models, and disable oneDNN)."""
    model = load_model(checkpoint, name="m", onednn_min_rows=16, warm_up=False)
    try:
        large, loaded = Recording(model.large_batch_dense), Recording(model.dense)
        model.large_batch_dense, model.dense = large, loaded
        for rows in (16, 80, 20):
            batch, lookup = _random_batch(model, rows)
            assert model.forward(batch, lookup).shape == (rows, 1)
        assert large.rows == [16, 80, 16]
        assert loaded.rows == [4]
    finally:
        model.close()


# ------------------------------------------------------------------ --onednn-min-rows auto
class FakeClock:
    """A clock that only the fake models below move: each call costs what its table says."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def model(self, cost_per_rows: dict[int, float], slow_calls: int = 0):
        calls = {"n": 0}

        def run(rows: int) -> None:
            calls["n"] += 1
            # The first calls may be slow (a kernel being built, the machine busy): the
            # fastest timed call is what counts.
            self.now += cost_per_rows[rows] * (50 if calls["n"] <= slow_calls else 1)

        return run


@pytest.mark.parametrize(
    ("rewritten_costs", "expected"),
    [
        ({32: 0.7, 64: 0.6, 128: 0.5}, 32),  # clearly faster everywhere (Zen 5 EPYC)
        ({32: 0.9, 64: 0.6, 128: 0.5}, 64),  # not clearly at 32 (0.9 * 1.25 > 1)
        ({32: 0.7, 64: 0.9, 128: 0.5}, 128),  # a larger probe not clearly faster: from above it
        ({32: 0.7, 64: 0.6, 128: 0.81}, 256),  # not clearly at the largest probe: the default
        ({32: 1.1, 64: 1.05, 128: 0.95}, 256),  # about even or slower (Zen 4 EPYC at 64 rows)
        ({32: 0.85, 64: 0.79, 128: 0.79}, 64),  # 1 / AUTO_MIN_SPEEDUP is 0.8
    ],
)
def test_auto_picks_the_smallest_probe_from_which_onednn_is_clearly_faster(
    rewritten_costs, expected
):
    clock = FakeClock()
    loaded = clock.model({32: 1.0, 64: 1.0, 128: 1.0}, slow_calls=3)
    rewritten = clock.model(rewritten_costs, slow_calls=2)
    chosen, ratios = onednn_linear.choose_min_rows(loaded, rewritten, (32, 64, 128), clock)
    assert chosen == expected
    assert ratios == pytest.approx(rewritten_costs)


def test_auto_at_load_uses_the_measured_threshold_and_says_so(checkpoint, monkeypatch, caplog):
    measured: list[tuple[int, ...]] = []

    def choose(loaded, rewritten, probes, clock=None):
        for rows in probes:  # both models really run on inputs of those sizes
            assert loaded(rows).shape == rewritten(rows).shape == (rows, 1)
        measured.append(tuple(probes))
        return 64, {32: 0.9, 64: 0.6, 128: 0.5}

    monkeypatch.setattr(onednn_linear, "choose_min_rows", choose)
    with caplog.at_level(logging.INFO, logger="serving.model"):
        model = load_model(checkpoint, name="m", warm_up=False)  # the default: auto
    try:
        assert measured == [onednn_linear.AUTO_PROBE_ROWS]
        assert model.large_batch_rows == 64
        assert (
            "model m: 4 linear layers run as oneDNN kernels for batches of >= 64 rows "
            "(measured at load: oneDNN / loaded time 0.90 at 32 rows, 0.60 at 64 rows, 0.50 at "
            "128 rows)"
        ) in caplog.text
        recording = Recording(model.large_batch_dense)
        model.large_batch_dense = recording
        for rows in (63, 64, 150):
            batch, lookup = _random_batch(model, rows)
            model.forward(batch, lookup)
        assert recording.rows == [64, 144]  # 150 = 144 + 6 on the loaded model
    finally:
        model.close()


def test_auto_falls_back_to_the_default_threshold_when_timing_fails(
    checkpoint, monkeypatch, caplog
):
    def failing(*args, **kwargs):
        raise RuntimeError("no clock")

    monkeypatch.setattr(onednn_linear, "choose_min_rows", failing)
    with caplog.at_level(logging.INFO, logger="serving.model"):
        model = load_model(checkpoint, name="m", warm_up=False)
    try:
        assert model.large_batch_rows == onednn_linear.DEFAULT_MIN_ROWS == 256
        assert "batches of >= 256 rows (measured at load: oneDNN / loaded time not measured)" in (
            caplog.text
        )
    finally:
        model.close()


def test_auto_on_this_machine_picks_a_probe_or_the_default_and_answers_as_loaded(
    checkpoint, caplog
):
    with caplog.at_level(logging.INFO, logger="serving.model"):
        model = load_model(checkpoint, name="m", warm_up=False)
    try:
        assert model.large_batch_rows in (*onednn_linear.AUTO_PROBE_ROWS, 256)
        assert "(measured at load: oneDNN / loaded time " in caplog.text
        for rows in (31, 32, 100, 300):
            batch, lookup = _random_batch(model, rows)
            with_onednn = model.forward(batch, lookup)
            rewritten, model.large_batch_dense = model.large_batch_dense, None
            np.testing.assert_allclose(
                with_onednn, model.forward(batch, lookup), rtol=1e-5, atol=1e-5
            )
            model.large_batch_dense = rewritten
    finally:
        model.close()
