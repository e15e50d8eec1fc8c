"""benchmarks/peers_handler.py without TorchServe: KServe v2 JSON and binary-extension requests
give the same predictions, binary answers are well formed, malformed binary requests raise a
ValueError naming the problem; and benchmarks/peers.py's ``--encodings`` argument."""

from __future__ import annotations

import json
import shutil
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from load_tests import traffic

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import peers  # noqa: E402
import peers_handler  # noqa: E402
import peers_servers  # noqa: E402

HEADER = peers_handler.HEADER_LENGTH
#: The served inputs of the tiny checkpoint: C2 is turned into a jagged, sqrt-scaled slot (the
#: dense model only sees pooled embeddings), and the ID datatypes differ, so the binary
#: decoding is exercised with INT64, UINT64, INT32 and FP32 tensors.
METADATA = {
    "name": "model",
    "inputs": [
        {"name": "C1", "datatype": "INT64", "shape": [-1]},
        {"name": "C2", "datatype": "UINT64", "shape": [-1]},
        {"name": "C2.lengths", "datatype": "INT32", "shape": [-1]},
        {"name": "C3", "datatype": "INT64", "shape": [-1]},
        {"name": "dense", "datatype": "FP32", "shape": [-1, 13]},
    ],
}


class FakeContext:
    """The part of TorchServe's ``ts.context.Context`` the handler uses."""

    def __init__(self, model_dir: Path, headers: list[dict[str, str]] | None = None) -> None:
        self.system_properties = {"model_dir": str(model_dir)}
        self.manifest = {"model": {"serializedFile": "jit_dense.pt"}}
        self.request_headers = headers or []
        self.response_headers: dict[int, dict[str, str]] = defaultdict(dict)

    def get_request_header(self, idx: int, key: str) -> str | None:
        return self.request_headers[idx].get(key)

    def set_response_header(self, idx: int, key: str, value: str) -> None:
        self.response_headers[idx][key] = value


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(handler, model directory, request generator) for a tiny synthetic checkpoint."""
    from load_tests.synthetic_model import build_synthetic_checkpoint

    root = tmp_path_factory.mktemp("peers-handler")
    checkpoint = build_synthetic_checkpoint(
        root / "checkpoint", vocab=50, num_slots=3, dim=4, batch_size=32, extra_steps=1
    )
    bundle = peers_servers.handler_bundle(checkpoint, "synthetic", "sigmoid")
    bundle["id_slots"][1].update(single_id=False, sqrt_scaling=True)
    model_dir = root / "model"
    model_dir.mkdir()
    shutil.copy(checkpoint / "jit_dense.pt", model_dir / "jit_dense.pt")
    (model_dir / peers_handler.BUNDLE_FILE).write_text(json.dumps(bundle))
    handler = peers_handler.RecserveEquivalentHandler()
    handler.initialize(FakeContext(model_dir))
    generator = traffic.TrafficGenerator(
        traffic.ModelInputs.from_metadata(METADATA),
        traffic.TrafficProfile(unknown_share=0.2, seed=5),
        traffic.vocab_from_checkpoint(checkpoint),
    )
    return handler, model_dir, generator


def _json_row(arrays) -> tuple[dict, dict[str, str]]:
    # TorchServe hands an application/json body over already parsed
    return {"body": json.loads(traffic.encode_kserve_json(arrays))}, {}


def _binary_row(arrays, header_name: str = HEADER) -> tuple[dict, dict[str, str]]:
    body, length = traffic.encode_kserve_binary(arrays)
    return {"body": bytearray(body)}, {header_name: str(length)}


def _handle(model, rows):
    handler, model_dir, _ = model
    context = FakeContext(model_dir, [headers for _, headers in rows])
    return handler.handle([row for row, _ in rows], context), context


def _json_predictions(answer: str) -> np.ndarray:
    output = json.loads(answer)["outputs"][0]
    return np.asarray(output["data"], dtype=np.float32).reshape(output["shape"])


def _binary_predictions(answer: bytes, headers: dict[str, str]) -> np.ndarray:
    length = int(headers[HEADER])
    header = json.loads(answer[:length])
    (output,) = header["outputs"]
    assert output["name"] == "prediction" and output["datatype"] == "FP32"
    size = output["parameters"]["binary_data_size"]
    assert size == 4 * int(np.prod(output["shape"])) == len(answer) - length
    return np.frombuffer(answer[length:], "<f4").reshape(output["shape"])


@pytest.mark.parametrize("batch", [1, 17])
def test_json_and_binary_requests_give_identical_predictions(model, batch):
    arrays = model[2].arrays(batch)
    (json_answer,), json_context = _handle(model, [_json_row(arrays)])
    (binary_answer,), binary_context = _handle(model, [_binary_row(arrays)])
    assert isinstance(json_answer, str) and not json_context.response_headers
    assert isinstance(binary_answer, bytes)
    expected = _json_predictions(json_answer)
    assert expected.shape == (batch, 1) and np.all((expected > 0) & (expected < 1))
    np.testing.assert_array_equal(
        _binary_predictions(binary_answer, binary_context.response_headers[0]), expected
    )


def test_a_mixed_batch_answers_each_request_in_its_format(model):
    generator = model[2]
    first, second, third = generator.arrays(3), generator.arrays(5), generator.arrays(1)
    answers, context = _handle(
        model,
        [
            _binary_row(first, HEADER.lower()),  # header names may arrive lower-cased
            _json_row(second),
            _binary_row(third),
        ],
    )
    assert [type(a) for a in answers] == [bytes, str, bytes]
    assert set(context.response_headers) == {0, 2}
    for index in (0, 2):
        headers = context.response_headers[index]
        assert headers["content-type"] == "application/octet-stream"
        header = json.loads(answers[index][: int(headers[HEADER])])
        assert header["model_name"] == "synthetic"
    merged = [
        _binary_predictions(answers[0], context.response_headers[0]),
        _json_predictions(answers[1]),
        _binary_predictions(answers[2], context.response_headers[2]),
    ]
    assert [len(p) for p in merged] == [3, 5, 1]
    for arrays, predictions in zip((first, second, third), merged):
        (alone,), _ = _handle(model, [_json_row(arrays)])
        np.testing.assert_allclose(predictions, _json_predictions(alone), rtol=1e-6, atol=1e-7)


def test_the_answer_format_follows_what_the_request_asks_for():
    wants = peers_handler.wants_binary_output
    assert not wants({"inputs": []})
    assert wants({"inputs": [], "parameters": {"binary_data_output": True}})
    assert wants({"outputs": [{"name": "prediction", "parameters": {"binary_data": True}}]})
    # an output's own binary_data wins over the request-wide parameter
    assert not wants(
        {
            "parameters": {"binary_data_output": True},
            "outputs": [{"name": "prediction", "parameters": {"binary_data": False}}],
        }
    )


def _malformed(arrays) -> dict[str, tuple[bytes, str, str]]:
    body, length = traffic.encode_kserve_binary(arrays)
    header = json.loads(body[:length])
    header["inputs"][0]["parameters"]["binary_data_size"] += 8  # a size the shape denies
    wrong = json.dumps(header).encode()
    return {
        "header longer than the body": (body, str(len(body) + 1), f"{HEADER} is {len(body) + 1}"),
        "header not a number": (body, "twelve", f"{HEADER} must be an integer"),
        "size not matching the shape": (
            wrong + body[length:],
            str(len(wrong)),
            "input 'C1': binary_data_size is",
        ),
        "truncated binary data": (body[:-4], str(length), "input 'dense': binary_data_size"),
        "unclaimed binary data": (body + b"\0" * 8, str(length), "8 bytes of binary tensor"),
        "binary input without the header": (body[:length], None, f"no {HEADER} header"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "header longer than the body",
        "header not a number",
        "size not matching the shape",
        "truncated binary data",
        "unclaimed binary data",
        "binary input without the header",
    ],
)
def test_malformed_binary_requests_raise_naming_the_problem(model, case):
    body, length, message = _malformed(model[2].arrays(4))[case]
    with pytest.raises(ValueError, match=message):
        peers_handler.decode_request(body, length)
    headers = {} if length is None else {HEADER: length}
    with pytest.raises(ValueError, match=message):  # through TorchServe's entry point too
        _handle(model, [({"body": bytearray(body)}, headers)])


def test_a_request_without_a_body_raises_naming_it(model):
    """A row with neither ``body`` nor ``data`` used to reach json.loads(None): a TypeError."""
    with pytest.raises(ValueError, match="request 0 has no body"):
        _handle(model, [({"body": None}, {})])


def test_a_checkpoint_without_a_signature_is_refused_naming_it(monkeypatch, tmp_path):
    """A model manifest may have no feature signature: handler_bundle used to fail with an
    AttributeError on None."""
    from types import SimpleNamespace

    from embedding_store import model_checkpoint

    manifest = SimpleNamespace(signature=None, embeddings_directory=tmp_path)
    monkeypatch.setattr(model_checkpoint, "read_manifest", lambda path: manifest)
    with pytest.raises(SystemExit, match="no feature signature"):
        peers_servers.handler_bundle(tmp_path, "model", "sigmoid")


def test_encodings_argument():
    assert peers.parse_args([]).encodings == ["json"]
    assert peers.parse_args(["--encodings", "json,binary"]).encodings == ["json", "binary"]
    assert peers.parse_args(["--encodings", " binary , json,binary"]).encodings == [
        "binary",
        "json",
    ]


@pytest.mark.parametrize("value", ["xml", "json,xml", ","])
def test_encodings_argument_rejects_unknown_encodings(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        peers.parse_args(["--encodings", value])
    assert exit_info.value.code == 2
    assert "unknown encoding" in capsys.readouterr().err


def test_the_handler_answers_what_recserve_answers(tmp_path):
    """Equivalence, the point of the handler: for the checkpoint's own inputs it answers what
    recserve's InferCtx answers for the same arrays, unknown IDs included."""
    from embedding_store.batch import Batch, IDTypeFeatureWithSingleID, NonIDTypeFeature
    from load_tests.synthetic_model import build_synthetic_checkpoint
    from serving.infer_ctx import InferCtx

    checkpoint = build_synthetic_checkpoint(
        tmp_path / "checkpoint", vocab=50, num_slots=3, dim=4, batch_size=32, extra_steps=1
    )
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    shutil.copy(checkpoint / "jit_dense.pt", model_dir / "jit_dense.pt")
    bundle = peers_servers.handler_bundle(checkpoint, "synthetic", "sigmoid")
    (model_dir / peers_handler.BUNDLE_FILE).write_text(json.dumps(bundle))
    handler = peers_handler.RecserveEquivalentHandler()
    handler.initialize(FakeContext(model_dir))
    metadata = {
        "name": "model",
        "inputs": [
            *({"name": f"C{i}", "datatype": "INT64", "shape": [-1]} for i in (1, 2, 3)),
            {"name": "dense", "datatype": "FP32", "shape": [-1, 13]},
        ],
    }
    generator = traffic.TrafficGenerator(
        traffic.ModelInputs.from_metadata(metadata),
        traffic.TrafficProfile(unknown_share=0.2, seed=7),
        traffic.vocab_from_checkpoint(checkpoint),
    )
    arrays = generator.arrays(40)
    (answer,), _ = _handle((handler, model_dir, generator), [_json_row(arrays)])
    batch = Batch(
        [IDTypeFeatureWithSingleID(f"C{i}", arrays[f"C{i}"].astype(np.uint64)) for i in (1, 2, 3)],
        [NonIDTypeFeature(arrays["dense"].astype(np.float32), "dense")],
        requires_grad=False,
    )
    with InferCtx(checkpoint=checkpoint, output_transform="sigmoid") as ctx:
        assert ctx.get_embedding_from_data(batch).unknown_ids > 0  # both paths meet some
        expected = ctx.forward(batch)
    np.testing.assert_allclose(_json_predictions(answer), expected, rtol=0, atol=1e-6)
