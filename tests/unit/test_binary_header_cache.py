"""Decoded binary-extension headers are kept by their bytes: a request that sends a header seen
before is not parsed again, yet gets its own tensors, and every error is the one an uncached
decode gives."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from embedding_store.errors import InvalidArgumentError
from serving import http_decode, lazy_tensors


@pytest.fixture(autouse=True)
def empty_cache():
    http_decode._binary_headers.clear()
    yield
    http_decode._binary_headers.clear()


def _body(ids: list[int], dense: list[float], **header_extra) -> tuple[bytes, str]:
    id_bytes = np.asarray(ids, dtype="<i8").tobytes()
    dense_bytes = np.asarray(dense, dtype="<f4").tobytes()
    header = {
        "inputs": [
            {"name": "user", "datatype": "INT64", "shape": [len(ids)],
             "parameters": {"binary_data_size": len(id_bytes)}},
            {"name": "dense", "datatype": "FP32", "shape": [len(ids), 1],
             "parameters": {"binary_data_size": len(dense_bytes)}},
        ],
        **header_extra,
    }  # fmt: skip
    head = orjson.dumps(header)
    return head + id_bytes + dense_bytes, str(len(head))


@pytest.fixture
def parse_calls(monkeypatch):
    calls = []
    parse = http_decode.parse_json

    def counting(body, what="request body"):
        calls.append(bytes(body))
        return parse(body, what)

    monkeypatch.setattr(http_decode, "parse_json", counting)
    return calls


def test_a_header_seen_before_is_not_parsed_again_but_each_request_gets_its_own_tensors(
    parse_calls,
):
    extra = {"id": "", "parameters": {"timeout": 2_000_000}}
    first_body, length = _body([1, 2], [0.5, 1.5], **extra)
    second_body, second_length = _body([7, 9], [2.5, -1.0], **extra)
    assert second_length == length and first_body[: int(length)] == second_body[: int(length)]
    first = http_decode.decode_http_request(first_body, length)
    second = http_decode.decode_http_request(second_body, length)
    assert len(parse_calls) == 1
    assert (
        isinstance(second.inputs, lazy_tensors.BinaryTensors) and second.inputs.body is second_body
    )
    assert second.inputs["user"].tolist() == [7, 9]
    assert second.inputs["dense"].tolist() == [[2.5], [-1.0]]
    assert first.inputs["user"].tolist() == [1, 2]
    assert first.inputs["dense"].tolist() == [[0.5], [1.5]]
    assert second.timeout == first.timeout == 2.0
    assert second.parameters == {"timeout": 2_000_000} and second.id == ""


def test_a_different_header_is_parsed(parse_calls):
    one, one_length = _body([1, 2], [0.5, 1.5])
    three, three_length = _body([1, 2, 3], [0.5, 1.5, 2.5])
    with_id, id_length = _body([1, 2], [0.5, 1.5], id="request-7")
    http_decode.decode_http_request(one, one_length)
    assert http_decode.decode_http_request(three, three_length).inputs["user"].tolist() == [1, 2, 3]
    assert http_decode.decode_http_request(with_id, id_length).id == "request-7"
    assert len(parse_calls) == 3
    http_decode.decode_http_request(with_id, id_length)
    assert len(parse_calls) == 3


def test_a_known_header_on_a_body_of_another_size_gets_the_uncached_error():
    body, length = _body([1, 2], [0.5, 1.5])
    http_decode.decode_http_request(body, length)
    with pytest.raises(InvalidArgumentError, match="4 bytes of binary tensor data are not claimed"):
        http_decode.decode_http_request(body + b"\0" * 4, length)
    with pytest.raises(InvalidArgumentError, match="runs past the end of the body"):
        http_decode.decode_http_request(body[:-4], length)


def test_headers_that_fail_are_not_kept_and_fail_every_time(parse_calls):
    body, length = _body([1, 2], [0.5, 1.5], outputs="prediction")
    for _ in range(2):
        with pytest.raises(InvalidArgumentError, match="'outputs' must be a list"):
            http_decode.decode_http_request(body, length)
    assert len(parse_calls) == 2 and not http_decode._binary_headers


def test_a_kept_header_with_a_malformed_tensor_fails_each_request_alike():
    body, length = _body([1, 2], [0.5, 1.5])
    bad = body.replace(b'"shape":[2,1]', b'"shape":[3,1]')
    for _ in range(2):
        inputs = http_decode.decode_http_request(bad, length).inputs
        with pytest.raises(InvalidArgumentError, match="input 'dense': shape \\[3, 1\\]"):
            inputs.materialize()


def test_the_cache_is_bounded_and_skips_large_headers(monkeypatch):
    monkeypatch.setattr(http_decode, "BINARY_HEADER_CACHE_SIZE", 4)
    for size in range(1, 11):
        http_decode.decode_http_request(*_body(list(range(size)), [0.0] * size))
        assert 1 <= len(http_decode._binary_headers) <= 4
    monkeypatch.setattr(http_decode, "BINARY_HEADER_CACHE_MAX_BYTES", 10)
    http_decode._binary_headers.clear()
    request = http_decode.decode_http_request(*_body([5], [1.0]))
    assert request.inputs["user"].tolist() == [5] and not http_decode._binary_headers
