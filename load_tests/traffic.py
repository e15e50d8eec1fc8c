"""Realistic request traffic for load tests, built from a served model's KServe v2 metadata.

What a request looks like (see serving/tensor_specs.py for the tensor naming):

* batch sizes drawn from a weighted mix (default 1 / 8 / 64 with weights 6 / 3 / 1);
* IDs Zipf-distributed over each slot's vocabulary: the IDs a checkpoint really holds (see
  :func:`vocab_from_checkpoint`) or, without one, ``0 .. default_vocab - 1``;
* a share of IDs that no checkpoint holds (``unknown_share``, answered with default vectors);
* jagged slots (``<slot>`` + ``<slot>.lengths``) with list lengths k in 0..``max_list_len``
  drawn with P(k) ~ exp(-k / ``mean_list_len``): truncated at 8, the defaults (scale 3) give a
  mean of 2.06, not 3 (``mean_list_len`` is the decay scale of the untruncated law);
* dense (FP32) inputs standard normal with the sample shape of the metadata.

:class:`TrafficGenerator` turns that into named numpy arrays, and the ``encode_*`` functions
into request bodies: KServe v2 JSON, the KServe v2 binary tensor extension, the friendly
``/v1/models/{name}:predict`` JSON (or raw rows from a file, see :func:`load_rows`, for a
server with a ``--preprocessor``), and gRPC ``ModelInferRequest`` messages. Generating a
request costs load-generator CPU, so :class:`PayloadPool` pre-builds a pool of distinct
requests per batch size once (about 8k rows per batch size by default) and the users cycle
through it.

Which IDs are hot (the Zipf rank -> ID permutation) depends on ``TrafficProfile.seed`` alone,
so every pool and process shares one popularity ranking. The draws themselves come from a
stream per pool (:func:`stream_key`: payload kind, load-generator process, and a random nonce
unless ``RECSERVE_LT_SEED`` is set): pools of different kinds and processes send different
requests and batch-size sequences, and a set seed makes a run reproducible.

No dependency on locust: the same code feeds benchmarks/peers.py and the tests.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
import os
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

LENGTHS_SUFFIX = ".lengths"
ID_DATATYPES = ("INT64", "UINT64")
OUTPUT_NAME = "prediction"
#: Unknown IDs are drawn from [2**50, 2**51): far above any vocabulary, below the 56-bit mask
#: of an 8-bit feature prefix, and valid INT64.
UNKNOWN_LOW = 1 << 50
#: Payload kinds of :class:`PayloadPool`; a kind's index keys its random stream.
PAYLOAD_KINDS = ("json", "binary", "friendly", "grpc")
#: Rows per batch size that a pool pre-builds by default (see :func:`pool_payloads`).
POOL_ROWS = 8192
_NUMPY_DTYPES = {"INT64": np.int64, "UINT64": np.uint64, "INT32": np.int32, "FP32": np.float32}

_Number = TypeVar("_Number", int, float)


def env_number(
    name: str,
    default: _Number,
    parse: Callable[[str], _Number],
    valid: Callable[[_Number], bool],
    rule: str,
    environ: Mapping[str, str] | None = None,
) -> _Number:
    """The number in variable ``name`` read by ``parse`` (``int`` or ``float``), or
    ``default`` when it is unset or empty; one that does not parse, is not finite or fails
    ``valid`` raises a ValueError naming the variable, its value and ``rule`` (what it must
    be), rather than a bare ``float()`` error from deep inside locust's start-up."""
    env = os.environ if environ is None else environ
    raw = env.get(name, "")
    if not raw.strip():
        return default
    try:
        value = parse(raw.strip())
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or not valid(value):
        raise ValueError(f"{name}={raw!r}: expected {rule}")
    return value


# --------------------------------------------------------------------------- model inputs
@dataclass(frozen=True)
class IdSlot:
    name: str
    datatype: str  # INT64 or UINT64
    jagged: bool
    lengths_datatype: str = "INT64"


@dataclass(frozen=True)
class DenseInput:
    name: str
    sample_shape: tuple[int, ...]


@dataclass(frozen=True)
class ModelInputs:
    """The inputs of a served model, grouped the way requests are built."""

    name: str
    id_slots: tuple[IdSlot, ...]
    dense: tuple[DenseInput, ...]

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> ModelInputs:
        """From ``GET /v2/models/{name}`` (KServe v2 model metadata JSON)."""
        inputs = {spec["name"]: spec for spec in metadata["inputs"]}
        id_slots: list[IdSlot] = []
        dense: list[DenseInput] = []
        for name, spec in inputs.items():
            if name.endswith(LENGTHS_SUFFIX) and name[: -len(LENGTHS_SUFFIX)] in inputs:
                continue
            datatype = spec["datatype"]
            if datatype in ID_DATATYPES:
                lengths = inputs.get(name + LENGTHS_SUFFIX)
                id_slots.append(
                    IdSlot(
                        name,
                        datatype,
                        jagged=lengths is not None,
                        lengths_datatype=lengths["datatype"] if lengths else "INT64",
                    )
                )
            elif datatype == "FP32":
                dense.append(DenseInput(name, tuple(int(d) for d in spec["shape"][1:])))
            else:
                raise ValueError(f"input {name!r}: unsupported datatype {datatype}")
        return cls(str(metadata.get("name", "model")), tuple(id_slots), tuple(dense))


def fetch_metadata(base_url: str, model: str, timeout: float = 10.0) -> dict[str, Any]:
    """``GET {base_url}/v2/models/{model}`` with the standard library (no locust needed)."""
    import urllib.request

    with urllib.request.urlopen(f"{base_url.rstrip('/')}/v2/models/{model}", timeout=timeout) as r:
        return json.loads(r.read())


# --------------------------------------------------------------------------- vocabularies
def vocab_from_checkpoint(checkpoint: str | os.PathLike) -> dict[str, np.ndarray]:
    """Known raw IDs of every slot of a recserve checkpoint: ``{slot: uint64 [n] sorted}``.

    Reads the embedding rows (``embeddings/shard_*/dim_*.safetensors``, tensor ``ids``) and
    strips each slot's feature prefix (slots of one feature group share their vocabulary).
    """
    import safetensors.numpy

    root = Path(checkpoint)
    embeddings = root / "embeddings" if (root / "embeddings").is_dir() else root
    manifest = json.loads((embeddings / "embedding_manifest.json").read_text())
    config = manifest["embedding_config"]
    bit = int(config.get("feature_index_prefix_bit", 8))
    slots = list(config["slots_config"])
    groups: dict[str, list[str]] = dict(config.get("feature_groups") or {})
    group_of = {member: group for group, members in groups.items() for member in members}
    spaces = [*groups, *(s for s in slots if s not in group_of)]
    ids = np.concatenate(
        [
            safetensors.numpy.load_file(str(embeddings / entry["path"]))["ids"]
            for entry in manifest["files"]
        ]
        or [np.zeros(0, np.uint64)]
    ).astype(np.uint64)
    if bit == 0:
        everything = np.unique(ids)
        return {slot: everything for slot in slots}
    shift = np.uint64(64 - bit)
    mask = np.uint64((1 << (64 - bit)) - 1)
    space_numbers = ids >> shift
    raw = ids & mask
    vocab: dict[str, np.ndarray] = {}
    for index, space in enumerate(spaces, start=1):
        known = np.unique(raw[space_numbers == np.uint64(index)])
        for slot in slots:
            if group_of.get(slot, slot) == space:
                vocab[slot] = known
    return vocab


def save_vocab(vocab: Mapping[str, np.ndarray], path: str | os.PathLike) -> None:
    arrays = {name: np.asarray(ids, dtype=np.uint64) for name, ids in vocab.items()}
    # numpy's stubs type every **kwds of savez as its allow_pickle: bool as well
    np.savez(path, **arrays)  # type: ignore[arg-type]


def load_vocab(path: str | os.PathLike) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {name: data[name] for name in data.files}


# --------------------------------------------------------------------------- the profile
def parse_batch_mix(text: str) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """``"1:6,8:3,64:1"`` -> ((1, 8, 64), (6, 3, 1)); ``"64"`` -> ((64,), (1,))."""
    sizes, weights = [], []
    for part in text.split(","):
        size, _, weight = part.strip().partition(":")
        sizes.append(int(size))
        weights.append(float(weight) if weight else 1.0)
    if not sizes or min(sizes) < 1 or min(weights) <= 0:
        raise ValueError(f"bad batch mix {text!r}: use SIZE[:WEIGHT],...")
    return tuple(sizes), tuple(weights)


@dataclass(frozen=True)
class TrafficProfile:
    batch_sizes: tuple[int, ...] = (1, 8, 64)
    batch_weights: tuple[float, ...] = (6.0, 3.0, 1.0)
    zipf_exponent: float = 1.1
    unknown_share: float = 0.02
    max_list_len: int = 8
    mean_list_len: float = 3.0  # decay scale of P(k); truncated at max_list_len: mean 2.06
    default_vocab: int = 10_000
    seed: int = 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TrafficProfile:
        """Settings from ``RECSERVE_LT_*`` variables (what load_tests/run.py exports)."""
        env = os.environ if environ is None else environ
        mix = env.get("RECSERVE_LT_BATCHES", "").strip() or "1:6,8:3,64:1"
        try:
            sizes, weights = parse_batch_mix(mix)
        except ValueError as error:  # int("x") too: name the variable
            raise ValueError(f"RECSERVE_LT_BATCHES={mix!r}: {error}") from None
        return cls(
            batch_sizes=sizes,
            batch_weights=weights,
            zipf_exponent=env_number(
                "RECSERVE_LT_ZIPF", 1.1, float, lambda s: s >= 0, "a number >= 0", env
            ),
            unknown_share=env_number(
                "RECSERVE_LT_UNKNOWN", 0.02, float, lambda p: 0 <= p < 1, "a number in [0, 1)", env
            ),
            # empty: unset, as stream_key reads it
            seed=env_number("RECSERVE_LT_SEED", 0, int, lambda n: n >= 0, "an integer >= 0", env),
        )


def stream_key(
    kind: str, process_index: int = 0, environ: Mapping[str, str] | None = None
) -> tuple[int, ...]:
    """The random stream of one payload pool: its kind and load-generator process, plus a
    random nonce unless ``RECSERVE_LT_SEED`` is set (set, the same run sends the same
    requests; unset, every run and process draws its own)."""
    env = os.environ if environ is None else environ
    key = (PAYLOAD_KINDS.index(kind), max(int(process_index), 0))
    return key if env.get("RECSERVE_LT_SEED") else (*key, secrets.randbits(63))


def pool_payloads(batch_size: int, rows: int = POOL_ROWS) -> int:
    """Payloads a pool holds for ``batch_size``: about ``rows`` rows, 64 to 512 payloads
    (single-row requests would otherwise need thousands of bodies)."""
    return max(64, min(512, rows // batch_size))


class _Zipf:
    """Bounded Zipf sampler over ranks 0..n-1 (probability ~ 1 / (rank + 1) ** s)."""

    def __init__(self, n: int, exponent: float) -> None:
        weights = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** exponent
        self.cdf = np.cumsum(weights / weights.sum())

    def sample(self, rng: np.random.Generator, count: int) -> np.ndarray:
        return np.minimum(np.searchsorted(self.cdf, rng.random(count)), len(self.cdf) - 1)


@dataclass
class TrafficGenerator:
    """Named request tensors for ``inputs``, following ``profile``.

    ``vocab`` maps a slot to the raw IDs it knows; a slot without one uses
    ``0 .. profile.default_vocab - 1``. Rank r of the Zipf draw is the r-th ID of a random
    permutation of the vocabulary fixed by ``profile.seed`` (so hot IDs are spread over the ID
    range, and generators with the same seed agree on them). ``stream`` (see
    :func:`stream_key`) gives the draws their own random stream; without it they continue the
    permutation's generator, so ``profile.seed`` alone reproduces everything.
    """

    inputs: ModelInputs
    profile: TrafficProfile = field(default_factory=TrafficProfile)
    vocab: Mapping[str, np.ndarray] | None = None
    stream: Sequence[int] = ()

    def __post_init__(self) -> None:
        ranking = np.random.default_rng(self.profile.seed)
        self._ids: dict[str, np.ndarray] = {}
        self._zipf: dict[int, _Zipf] = {}
        for slot in self.inputs.id_slots:
            known = None if self.vocab is None else self.vocab.get(slot.name)
            if known is None or len(known) == 0:
                known = np.arange(self.profile.default_vocab, dtype=np.uint64)
            self._ids[slot.name] = ranking.permutation(np.asarray(known, dtype=np.uint64))
        self.rng = (
            np.random.default_rng(
                np.random.SeedSequence(abs(self.profile.seed), spawn_key=tuple(self.stream))
            )
            if self.stream
            else ranking
        )
        weights = np.asarray(self.profile.batch_weights, dtype=np.float64)
        self._batch_p = weights / weights.sum()
        lengths = np.arange(self.profile.max_list_len + 1)
        decay = np.exp(-lengths / max(self.profile.mean_list_len, 1e-3))
        self._length_p = decay / decay.sum()

    def batch_size(self) -> int:
        return int(self.rng.choice(self.profile.batch_sizes, p=self._batch_p))

    def _draw_ids(self, slot: IdSlot, count: int) -> np.ndarray:
        known = self._ids[slot.name]
        zipf = self._zipf.get(len(known))
        if zipf is None:
            zipf = self._zipf[len(known)] = _Zipf(len(known), self.profile.zipf_exponent)
        ids = known[zipf.sample(self.rng, count)]
        unknown = self.rng.random(count) < self.profile.unknown_share
        if unknown.any():
            ids = ids.copy()
            ids[unknown] = UNKNOWN_LOW + self.rng.integers(0, UNKNOWN_LOW, int(unknown.sum()))
        return ids

    def arrays(self, batch_size: int | None = None) -> dict[str, np.ndarray]:
        """One request: ``{input name: array}`` in metadata order (IDs in their datatype)."""
        size = batch_size or self.batch_size()
        out: dict[str, np.ndarray] = {}
        for slot in self.inputs.id_slots:
            dtype = _NUMPY_DTYPES[slot.datatype]
            if slot.jagged:
                lengths = self.rng.choice(len(self._length_p), size=size, p=self._length_p)
                out[slot.name] = self._draw_ids(slot, int(lengths.sum())).astype(dtype)
                out[slot.name + LENGTHS_SUFFIX] = lengths.astype(
                    _NUMPY_DTYPES[slot.lengths_datatype]
                )
            else:
                out[slot.name] = self._draw_ids(slot, size).astype(dtype)
        for dense in self.inputs.dense:
            out[dense.name] = self.rng.standard_normal((size, *dense.sample_shape)).astype(
                np.float32
            )
        return out

    def many(self, batch_size: int, count: int) -> list[dict[str, np.ndarray]]:
        """``count`` requests of ``batch_size`` rows, drawn as one batch and then sliced (one
        vectorized draw instead of ``count`` small ones: ~7x faster for the synthetic model)."""
        whole = self.arrays(batch_size * count)
        bounds = np.arange(count + 1) * batch_size
        offsets = {
            slot.name: np.concatenate([[0], np.cumsum(whole[slot.name + LENGTHS_SUFFIX])])[bounds]
            for slot in self.inputs.id_slots
            if slot.jagged
        }
        requests = []
        for k in range(count):  # slicing views only: the draws happened above
            request = {}
            for name, array in whole.items():
                if name in offsets:
                    request[name] = array[offsets[name][k] : offsets[name][k + 1]]
                else:
                    request[name] = array[bounds[k] : bounds[k + 1]]
            requests.append(request)
        return requests


# --------------------------------------------------------------------------- encodings
def _datatype(array: np.ndarray) -> str:
    """The KServe v2 datatype of ``array``, whatever its byte order (the encoders write
    little-endian bytes)."""
    return {
        np.dtype(np.int64): "INT64",
        np.dtype(np.uint64): "UINT64",
        np.dtype(np.int32): "INT32",
        np.dtype(np.float32): "FP32",
    }[array.dtype.newbyteorder("=")]


def encode_kserve_json(arrays: Mapping[str, np.ndarray]) -> bytes:
    """KServe v2 JSON infer request (flat ``data``), as bytes."""
    document = {
        "inputs": [
            {
                "name": name,
                "shape": list(array.shape),
                "datatype": _datatype(array),
                "data": array.reshape(-1).tolist(),
            }
            for name, array in arrays.items()
        ]
    }
    return json.dumps(document, separators=(",", ":")).encode()


def encode_kserve_binary(arrays: Mapping[str, np.ndarray]) -> tuple[bytes, int]:
    """KServe v2 binary tensor extension: ``(body, json_header_length)``; outputs binary too."""
    header = {
        "inputs": [
            {
                "name": name,
                "shape": list(array.shape),
                "datatype": _datatype(array),
                "parameters": {"binary_data_size": int(array.nbytes)},
            }
            for name, array in arrays.items()
        ],
        "outputs": [{"name": OUTPUT_NAME, "parameters": {"binary_data": True}}],
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    little = [np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")) for a in arrays.values()]
    return head + b"".join(a.tobytes() for a in little), len(head)


def encode_friendly_json(inputs: ModelInputs, arrays: Mapping[str, np.ndarray]) -> bytes:
    """``{"instances": [{feature: value or list}, ...]}`` for ``/v1/models/{name}:predict``."""
    size = _batch_size(inputs, arrays)
    columns: dict[str, list[Any]] = {}
    for slot in inputs.id_slots:
        ids = arrays[slot.name].tolist()
        if slot.jagged:
            ends = np.cumsum(arrays[slot.name + LENGTHS_SUFFIX]).tolist()
            starts = [0, *ends[:-1]]
            columns[slot.name] = [ids[s:e] for s, e in zip(starts, ends)]
        else:
            columns[slot.name] = ids
    for dense in inputs.dense:
        # Each row nested as the sample shape: the route takes a [2, 3] sample as two lists
        # of 3, not one of 6; a shape () sample is a number.
        columns[dense.name] = arrays[dense.name].reshape(size, *dense.sample_shape).tolist()
    instances = [{name: column[i] for name, column in columns.items()} for i in range(size)]
    return json.dumps({"instances": instances}, separators=(",", ":")).encode()


def load_rows(path: str | os.PathLike, limit: int = 20_000) -> list[dict[str, Any]]:
    """Raw rows for a server whose ``--preprocessor`` reads raw columns on the friendly route
    (e.g. ``examples.adult_income.preprocess:instances_to_batch``): a CSV with a header row
    (values stay strings: which columns are numbers is the preprocessor's business) or JSON
    lines (values keep their JSON types); ``.gz`` or plain; at most ``limit`` rows."""
    text = str(path)
    compressed = text.endswith(".gz")
    stem = text[: -len(".gz")] if compressed else text
    opener = gzip.open if compressed else open
    with opener(path, "rb") as raw, io.TextIOWrapper(raw, encoding="utf-8", newline="") as handle:
        if stem.endswith((".jsonl", ".ndjson")):
            rows = []
            for line in handle:  # bounded by ``limit``; a file read once per process
                if line.strip():
                    rows.append(json.loads(line))
                if len(rows) >= limit:
                    break
        else:
            reader = csv.DictReader(handle)
            rows = [dict(row) for _, row in zip(range(limit), reader)]
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def encode_rows(rows: Sequence[Mapping[str, Any]]) -> bytes:
    """``{"instances": rows}`` for ``/v1/models/{name}:predict``."""
    return json.dumps({"instances": list(rows)}, separators=(",", ":")).encode()


def _batch_size(inputs: ModelInputs, arrays: Mapping[str, np.ndarray]) -> int:
    for slot in inputs.id_slots:
        key = slot.name + LENGTHS_SUFFIX if slot.jagged else slot.name
        return len(arrays[key])
    return len(arrays[inputs.dense[0].name])


# --------------------------------------------------------------------------- answers
def answer_problem(predictions: np.ndarray, batch_size: int) -> str | None:
    """Why ``predictions`` (an answer's, decoded: float32 [rows, k]) do not answer a request
    of ``batch_size`` rows, or None when they do: one row of finite predictions per row sent.
    The load-test users count a 200 whose answer is short, empty or NaN as a failed request,
    not as a fast one."""
    rows = int(predictions.shape[0]) if predictions.ndim else 0
    if rows != batch_size or predictions.size < batch_size:
        return (
            f"{rows} prediction rows (shape {list(predictions.shape)}) for a request of "
            f"{batch_size} rows"
        )
    bad = int(predictions.size - np.count_nonzero(np.isfinite(predictions)))
    if bad:
        return f"{bad} of {predictions.size} predictions are not finite"
    return None


#: The answer parameter that counts the ID occurrences the server did not hold (docs/own_model.md).
UNKNOWN_IDS = "unknown_ids"


def unknown_ids_problem(
    parameters: Mapping[str, Any], ids_sent: int | None, promised: bool
) -> str | None:
    """Why an answer's ``unknown_ids`` (in its ``parameters``: the KServe v2 response
    parameters, or the friendly route's fields) cannot be a count of the ``ids_sent`` ID
    occurrences of its request (None: not known, e.g. raw rows for a preprocessor: only the
    lower bound is checked), or None when it can: an integer within [0, ``ids_sent``]. An
    answer without one is a problem only when its protocol ``promised`` it (recserve's v2 and
    friendly answers do; a TorchServe handler's need not): the load tests count unknown IDs
    through it, and a server that stopped counting would pass unseen."""
    value = parameters.get(UNKNOWN_IDS)
    if value is None:
        return f"the answer has no {UNKNOWN_IDS}" if promised else None
    if type(value) is not int:  # bool is an int subclass, and no count
        return f"{UNKNOWN_IDS} {value!r} is not an integer"
    if value < 0 or (ids_sent is not None and value > ids_sent):
        bound = "?" if ids_sent is None else ids_sent
        return f"{UNKNOWN_IDS} {value} is outside [0, {bound}] (the IDs sent)"
    return None


# --------------------------------------------------------------------------- payload pools
@dataclass(frozen=True)
class Payload:
    batch_size: int
    body: bytes
    header_length: int | None = None  # binary extension only
    arrays: Mapping[str, np.ndarray] | None = None  # gRPC only: the KServe v2 tensors
    #: ID occurrences sent (every ID slot's IDs); None for raw rows (a preprocessor's IDs)
    ids: int | None = None


class PayloadPool:
    """Distinct pre-encoded requests for each batch size of the profile: ``per_size`` each,
    or by default :func:`pool_payloads` (about :data:`POOL_ROWS` rows per batch size).

    ``kind``: ``"json"`` (KServe v2 JSON), ``"binary"`` (binary extension), ``"friendly"``
    (``/v1`` instances: the generator's slot IDs, or ``rows`` drawn from raw rows, see
    :func:`load_rows`) or ``"grpc"`` (the named tensors in ``arrays``, which the gRPC client
    encodes per call). ``pick()`` draws a batch size from the profile's mix, then a payload of
    that size, from a generator spawned off the pool generator's stream (pools with different
    streams pick different sequences).
    """

    def __init__(
        self,
        generator: TrafficGenerator,
        kind: str,
        *,
        per_size: int | None = None,
        model: str = "model",
        rows: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        if kind not in PAYLOAD_KINDS:
            raise ValueError(f"unknown payload kind {kind!r}")
        if rows is not None and (kind != "friendly" or not rows):
            raise ValueError("raw rows need the friendly payload kind and at least one row")
        self.generator = generator
        self.kind = kind
        self.rows = rows
        self.by_size: dict[int, list[Payload]] = {}
        for size in generator.profile.batch_sizes:
            count = per_size or pool_payloads(size)
            if rows is not None:
                picks = generator.rng.integers(len(rows), size=(count, size)).tolist()
                self.by_size[size] = [
                    Payload(size, encode_rows([rows[i] for i in pick])) for pick in picks
                ]
            else:
                self.by_size[size] = [
                    self._encode(size, arrays, model) for arrays in generator.many(size, count)
                ]
        self._rng = generator.rng.spawn(1)[0]
        self._sizes = np.asarray(generator.profile.batch_sizes)
        weights = np.asarray(generator.profile.batch_weights, dtype=np.float64)
        self._cdf = np.cumsum(weights / weights.sum())

    def _encode(self, size: int, arrays: dict[str, np.ndarray], model: str) -> Payload:
        ids = sum(int(arrays[slot.name].size) for slot in self.generator.inputs.id_slots)
        if self.kind == "json":
            return Payload(size, encode_kserve_json(arrays), ids=ids)
        if self.kind == "binary":
            body, length = encode_kserve_binary(arrays)
            return Payload(size, body, header_length=length, ids=ids)
        if self.kind == "friendly":
            return Payload(size, encode_friendly_json(self.generator.inputs, arrays), ids=ids)
        return Payload(size, b"", arrays=arrays, ids=ids)

    def pick(self) -> Payload:
        index = min(int(np.searchsorted(self._cdf, self._rng.random())), len(self._sizes) - 1)
        payloads = self.by_size[int(self._sizes[index])]
        return payloads[int(self._rng.integers(len(payloads)))]


def describe(inputs: ModelInputs) -> str:
    """One line about a model's inputs, for logs and reports."""
    jagged = sum(s.jagged for s in inputs.id_slots)
    dense: Sequence[str] = [f"{d.name}{list(d.sample_shape)}" for d in inputs.dense]
    return f"{len(inputs.id_slots)} ID slots ({jagged} jagged), dense inputs {', '.join(dense)}"
