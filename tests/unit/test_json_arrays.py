"""Large plain JSON infer bodies: simdjson's route (serving.json_arrays, ArrayJsonTensors).

The reference is the same as for the orjson route (tests/unit/test_fast_json_decode.py): the
eager decoder and the general path of ``tensors_to_batch``. Any body of at least
``LARGE_BODY_BYTES`` (the small test bodies are padded with trailing spaces, which JSON
allows) must give an equal Batch or exactly the same exception, whether simdjson takes it or
hands it back to orjson.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import orjson
import pytest

from embedding_store.batch import Batch
from serving import fast_batch, http_decode, json_arrays, lazy_tensors, tensors
from tests.unit.fast_path_signatures import MAX_BATCH, SINGLE
from tests.unit.test_fast_json_decode import (
    ERRORS,
    JAGGED,
    SIGNATURES,
    _assert_batches_equal,
    _assert_outcomes_equal,
    _assert_same_outcome,
    _body,
    _eager_batch,
    _outcome,
    _random_inputs,
    _request_options,
    _tensor,
)


def _large(body: bytes) -> bytes:
    """``body`` padded with spaces to the size that takes simdjson's route."""
    return body + b" " * max(0, json_arrays.LARGE_BODY_BYTES - len(body))


def _array_route_taken(signature, body: bytes) -> bool:
    """Whether simdjson parsed ``body`` and the fast batch builder took its arrays."""
    inputs = http_decode.decode_http_request(body).inputs
    if not isinstance(inputs, http_decode.ArrayJsonTensors):
        return False
    return fast_batch.batch_from_json(signature, inputs.raw_entries, MAX_BATCH) is not None


# --------------------------------------------------------------------------- the route
def test_large_bodies_take_simdjson_and_small_ones_orjson():
    body = _body(_random_inputs(SINGLE, 2, np.random.default_rng(1)))
    assert len(body) < json_arrays.LARGE_BODY_BYTES
    small = http_decode.decode_http_request(body).inputs
    assert type(small) is lazy_tensors.JsonTensors
    large = http_decode.decode_http_request(_large(body)).inputs
    assert type(large) is http_decode.ArrayJsonTensors
    entry = large.raw_entries["C1"]
    assert entry["data"].dtype == np.int64 and not entry["data"].flags.writeable
    assert large.raw_entries["dense"]["data"].dtype == np.float64


def test_parsed_arrays_hold_the_values_sent():
    body = _large(
        _body(
            [
                _tensor("ids", "UINT64", [3], [0, 7, 2**63 - 1]),
                _tensor("lengths", "INT32", [2], [1, 2]),
                _tensor("x", "FP32", [2, 2], [0.1, -2.5, 3, 1e-7]),
            ]
        )
    )
    entries = json_arrays.parse_number_arrays(body)
    assert entries is not None
    assert list(entries) == ["ids", "lengths", "x"]
    assert entries["ids"]["data"].tolist() == [0, 7, 2**63 - 1]
    assert entries["ids"]["shape"] == [3] and entries["ids"]["datatype"] == "UINT64"
    assert entries["lengths"]["data"].tolist() == [1, 2]
    # float64 as orjson reads them, so float32 after the same single rounding.
    assert entries["x"]["data"].tolist() == [0.1, -2.5, 3.0, 1e-7]
    assert entries["x"]["shape"] == [2, 2]


def test_request_options_equal_the_orjson_route():
    body = _large(_body(_random_inputs(SINGLE, 2, np.random.default_rng(2))))
    array = http_decode.decode_http_request(body)
    eager = http_decode.decode_http_request(body, str(len(body)))
    assert isinstance(array.inputs, http_decode.ArrayJsonTensors)
    assert _request_options(array) == _request_options(eager)


# --------------------------------------------------------------------------- equivalence
@pytest.mark.parametrize("name", sorted(SIGNATURES))
@pytest.mark.parametrize("batch", [1, 2, 64])
def test_random_valid_large_requests_take_the_array_route_and_equal_the_eager_batch(name, batch):
    signature = SIGNATURES[name]
    rng = np.random.default_rng([batch, len(name), 17])
    for _ in range(25):
        body = _large(_body(_random_inputs(signature, batch, rng)))
        assert _array_route_taken(signature, body)
        _assert_same_outcome(signature, body)


@pytest.mark.parametrize(
    ("name", "signature", "body", "error", "message"), ERRORS, ids=[e[0] for e in ERRORS]
)
def test_large_requests_with_errors_give_the_eager_outcome(name, signature, body, error, message):
    signature = SIGNATURES[signature]
    got = _assert_same_outcome(signature, _large(body))
    if error is not None:
        assert type(got) is error
        if message is not None:
            assert str(got) == message


def _single_with(tensor: dict[str, Any], batch: int = 2) -> list[dict[str, Any]]:
    inputs = _random_inputs(SINGLE, batch, np.random.default_rng(9))
    position = next(i for i, t in enumerate(inputs) if t["name"] == tensor["name"])
    inputs[position] = tensor
    return inputs


def _raw(inputs: list[dict[str, Any]]) -> bytes:
    return _large(_body(inputs))


#: Bodies simdjson's route hands back to orjson (parse_number_arrays returns None).
HANDED_BACK: list[tuple[str, bytes]] = [
    ("nested ID data", _raw(_single_with(_tensor("C2", "INT64", [2], [[4], [5]])))),
    ("ragged nested ID data", _raw(_single_with(_tensor("C2", "INT64", [2], [4, [5]])))),
    ("nested dense data", _raw(_single_with(_tensor("age", "FP32", [2, 1], [[1.0], [2.0]])))),
    ("bools among IDs", _raw(_single_with(_tensor("C2", "INT64", [2], [4, True])))),
    ("float among IDs", _raw(_single_with(_tensor("C2", "INT64", [2], [4, 2.5])))),
    ("string among IDs", _raw(_single_with(_tensor("C2", "INT64", [2], [4, "5"])))),
    ("null among IDs", _raw(_single_with(_tensor("C2", "INT64", [2], [4, None])))),
    ("UINT64 IDs from 2**63", _raw(_single_with(_tensor("C2", "UINT64", [2], [2**63, 1])))),
    ("FP32 ints beyond 2**53", _raw(_single_with(_tensor("age", "FP32", [2], [2**53 + 1, 0])))),
    ("FP32 bools", _raw(_single_with(_tensor("age", "FP32", [2], [True, False])))),
    ("FP64 dense", _raw(_single_with(_tensor("age", "FP64", [2], [1.0, 2.0])))),
    ("BYTES input", _raw(_single_with(_tensor("age", "BYTES", [2], ["a", "b"])))),
    ("data not an array", _raw(_single_with(_tensor("C2", "INT64", [2], "12")))),
    (
        "a bracket in a name",
        _raw(
            [*_single_with(_tensor("C2", "INT64", [2], [4, 5])), _tensor("x[0]", "INT64", [1], [1])]
        ),
    ),
    ("datatype not a string", _raw(_single_with(_tensor("C2", 64, [2], [4, 5])))),
    (
        "name not a string",
        _raw([*_random_inputs(SINGLE, 2, np.random.default_rng(9)), _tensor(7, "INT64", [1], [1])]),
    ),
    (
        "a name given twice",
        _raw(
            [
                *_random_inputs(SINGLE, 2, np.random.default_rng(9)),
                _tensor("C1", "INT64", [2], [1, 2]),
            ]
        ),
    ),
    (
        "an input with parameters",
        _raw(_single_with({**_tensor("C2", "INT64", [2], [4, 5]), "parameters": {}})),
    ),
    (
        "an input without data",
        _raw(_single_with({"name": "C2", "shape": [2], "datatype": "INT64", "id": [4]})),
    ),
    ("request id", _large(_body(_random_inputs(SINGLE, 2, np.random.default_rng(9)), id="r1"))),
    (
        "requested outputs",
        _large(_body(_random_inputs(SINGLE, 2, np.random.default_rng(9)), outputs=[{"name": "p"}])),
    ),
    ("no inputs", _large(orjson.dumps({"inputs": []}))),
    ("inputs not a list", _large(orjson.dumps({"inputs": {"C1": [1]}}))),
    ("a list, not an object", _large(orjson.dumps([{"inputs": []}]))),
    (
        "byte order mark",
        b"\xef\xbb\xbf" + _raw(_random_inputs(SINGLE, 2, np.random.default_rng(9))),
    ),
    ("not JSON", _large(b'{"inputs": [')),
    ("trailing garbage", _large(_body(_random_inputs(SINGLE, 2, np.random.default_rng(9)))) + b"x"),
    (
        "invalid UTF-8",
        _large(b'{"inputs":[{"name":"\xff","datatype":"INT64","shape":[1],"data":[1]}]}'),
    ),
]


def _duplicate_key_body() -> bytes:
    """An input whose ``data`` key is given twice (four keys in all, ``shape`` missing)."""
    inputs = _random_inputs(SINGLE, 2, np.random.default_rng(9))
    text = _body(inputs).replace(
        b'"shape":[2],"datatype":"INT64","data":[', b'"data":[9,9],"datatype":"INT64","data":[', 1
    )
    assert text.count(b'"data"') == len(inputs) + 1
    return _large(text)


HANDED_BACK.append(("a key given twice", _duplicate_key_body()))


@pytest.mark.parametrize(("name", "body"), HANDED_BACK, ids=[h[0] for h in HANDED_BACK])
def test_unusual_large_bodies_are_handed_back_to_orjson(name, body):
    assert len(body) >= json_arrays.LARGE_BODY_BYTES
    assert json_arrays.parse_number_arrays(body) is None
    # decode_http_request then takes orjson's route: the outcome of the code before.
    _assert_eager_outcome(body)
    if not isinstance(_outcome(lambda: http_decode.decode_http_request(body)), Exception):
        assert not isinstance(
            http_decode.decode_http_request(body).inputs, http_decode.ArrayJsonTensors
        )


def _assert_eager_outcome(body: bytes) -> None:
    """decode + tensors_to_batch give what the eager decoder and the general path give."""
    expected = _outcome(lambda: _eager_batch(SINGLE, body, MAX_BATCH))
    got = _outcome(
        lambda: tensors.tensors_to_batch(
            SINGLE, http_decode.decode_http_request(body).inputs, max_batch_size=MAX_BATCH
        )
    )
    _assert_outcomes_equal(got, expected)


def test_the_parser_works_after_a_body_it_refused():
    good = _raw(_random_inputs(SINGLE, 2, np.random.default_rng(4)))
    for bad in (_large(b'{"inputs": ['), _raw(_single_with(_tensor("C2", "INT64", [2], [4, 2.5])))):
        assert json_arrays.parse_number_arrays(bad) is None
        assert json_arrays.parse_number_arrays(good) is not None


def test_each_thread_parses_with_its_own_parser():
    rng = np.random.default_rng(6)
    bodies = [_raw(_random_inputs(JAGGED, 64, rng)) for _ in range(4)]
    expected = [_eager_batch(JAGGED, body, MAX_BATCH) for body in bodies]
    failures: list[BaseException] = []

    def work(offset: int) -> None:
        try:
            for round_ in range(40):
                index = (offset + round_) % len(bodies)
                inputs = http_decode.decode_http_request(bodies[index]).inputs
                assert isinstance(inputs, http_decode.ArrayJsonTensors)
                got = tensors.tensors_to_batch(JAGGED, inputs, max_batch_size=MAX_BATCH)
                _assert_batches_equal(got, expected[index])
        except BaseException as error:  # reported below, with the thread's own traceback
            failures.append(error)

    threads = [threading.Thread(target=work, args=(offset,)) for offset in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    assert failures == []


# --------------------------------------------------------------------------- the mapping
def test_array_json_tensors_convert_as_the_eager_decoder_does():
    body = _raw(_random_inputs(JAGGED, 3, np.random.default_rng(8)))
    lazy = http_decode.decode_http_request(body).inputs
    assert isinstance(lazy, http_decode.ArrayJsonTensors)
    eager = http_decode.decode_http_request(body, str(len(body))).inputs
    assert list(lazy) == list(eager)
    for name, array in eager.items():
        assert lazy[name].dtype == array.dtype and np.array_equal(lazy[name], array)


def test_a_tensor_the_builder_refuses_raises_the_eager_error_on_first_touch():
    # Negative IDs parse (int64) but the builder refuses them: the general path names them.
    body = _raw(_single_with(_tensor("C2", "INT64", [2], [4, -3])))
    inputs = http_decode.decode_http_request(body).inputs
    assert isinstance(inputs, http_decode.ArrayJsonTensors)
    got = _assert_same_outcome(SINGLE, body)
    assert isinstance(got, Exception)
    assert str(got) == "input 'C2': IDs must be non-negative, got -3 at position 1"
    with pytest.raises(type(got)):
        tensors.tensors_to_batch(SINGLE, inputs, max_batch_size=MAX_BATCH)


def test_a_large_valid_batch_holds_the_request_values():
    inputs = _random_inputs(SINGLE, 64, np.random.default_rng(10))
    body = _large(_body(inputs))
    assert _array_route_taken(SINGLE, body)
    got = tensors.tensors_to_batch(
        SINGLE, http_decode.decode_http_request(body).inputs, max_batch_size=MAX_BATCH
    )
    assert isinstance(got, Batch)
    for tensor in inputs:
        if tensor["datatype"] in ("INT64", "UINT64"):
            assert got.id_feature(tensor["name"]).values.tolist() == tensor["data"]
        else:
            values = got.non_id_feature(tensor["name"]).data.reshape(-1)
            assert values.tolist() == np.asarray(tensor["data"], dtype=np.float32).tolist()
