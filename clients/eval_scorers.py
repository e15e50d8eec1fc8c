"""Scorers of ``recserve eval``: one batch's predictions (:class:`Scores`), in-process
(:class:`InProcessScorer`) or from a running server (:class:`ServerScorer`, KServe v2 REST with
binary tensors, or the friendly JSON route), plus the batch slicing a server's batch limits need.

Import rule: ``clients`` talks to servers over the wire only and never imports ``training``.
The one exception is the in-process path, which imports :mod:`serving.infer_ctx` lazily inside
:class:`InProcessScorer` (``InferCtx`` *is* the in-process inference API: the same TorchScript
model and embedding lookups the server runs), so ``recserve eval --url`` never loads it.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from clients._http import DeadlineHTTPResponse, answer_within, answered_in_http2, http2_hint
from clients._tls import CLI_NAMES, client_tls, tls_hint
from clients._urls import redact_url, refuse_credentials
from clients.codec import rows_not_feature_keyed
from embedding_store.batch import (
    Batch,
    IDFeature,
    IDTypeFeature,
    IDTypeFeatureWithSingleID,
    NonIDTypeFeature,
)
from embedding_store.errors import (
    CapacityError,
    DeadlineExceededError,
    InvalidArgumentError,
    UnavailableError,
    error_for_http_status,
)
from embedding_store.signature import FeatureSignature, IdFeatureSpec, NonIdFeatureSpec

__all__ = [
    "InProcessScorer",
    "Scores",
    "ServerScorer",
    "check_server_options",
    "signature_from_metadata",
]

PROTOCOLS = ("v2", "friendly")
FRIENDLY_WITHOUT_PREPROCESSOR = (
    " (--protocol friendly sends the raw rows for the server's --preprocessor to encode; a "
    "server without one takes rows keyed by feature name: score these rows with --protocol "
    "v2, the default, which encodes them here)"
)
_HEADER_LENGTH = "Inference-Header-Content-Length"


@dataclass
class Scores:
    """One chunk's scores: ``predictions`` float32 [n] (after the output transform) and
    ``raw`` (the model output before it, when known)."""

    predictions: np.ndarray
    raw: np.ndarray | None = None
    model_version: str | None = None


class InProcessScorer:
    """The checkpoint's TorchScript model and embeddings in this process, via InferCtx
    (the one lazy import of ``serving`` in ``clients``; see the module docstring)."""

    kind = "in-process"

    def __init__(self, checkpoint: str | os.PathLike[str], output_transform: str) -> None:
        import torch

        from serving.infer_ctx import InferCtx

        self._torch = torch
        self.output_transform = output_transform
        self._ctx = InferCtx(checkpoint=checkpoint)  # identity: the raw output is kept too
        model = self._ctx.model
        assert model is not None  # InferCtx loads the model whenever given a checkpoint
        self.signature: FeatureSignature = model.signature
        self.version: str = model.version
        self._shards = list(getattr(model.tier, "shards", ()))
        self._start = self._counters()

    def _counters(self) -> tuple[int, int] | None:
        if not self._shards:
            return None
        stats = [shard.stats() for shard in self._shards]
        return sum(s.eval_ids_looked_up for s in stats), sum(s.misses for s in stats)

    def unknown_ids(self) -> dict[str, Any] | None:
        """IDs looked up and how many the checkpoint did not hold (default vectors)."""
        now = self._counters()
        if now is None or self._start is None:
            return None
        ids, misses = now[0] - self._start[0], now[1] - self._start[1]
        return {"ids": ids, "unknown": misses, "ratio": misses / ids if ids else None}

    def score(self, batch: Batch, rows: Sequence[Mapping[str, Any]]) -> Scores:
        self.signature.check(batch)
        raw = np.asarray(self._ctx.forward(batch), dtype=np.float32).reshape(batch.batch_size, 1)
        if self.output_transform == "sigmoid":
            # As serving.model.LoadedModel.forward does it: torch.sigmoid on float32 [n, 1].
            with self._torch.inference_mode():
                predictions = self._torch.sigmoid(self._torch.from_numpy(raw)).numpy()
        else:
            predictions = raw
        return Scores(predictions.reshape(-1).copy(), raw.reshape(-1).copy(), self.version)

    def close(self) -> None:
        self._ctx.close()


def _normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as error:  # "Invalid IPv6 URL"
        raise InvalidArgumentError(f"--url {redact_url(url)!r}: {error}") from None
    if parts.scheme not in ("http", "https"):
        raise InvalidArgumentError(f"--url must be http(s)://HOST:PORT, got {redact_url(url)!r}")
    # urllib would try to resolve "user:password@host" as the host name.
    refuse_credentials(parts.netloc, f"--url {redact_url(url)!r}", CLI_NAMES[1:], "https://")
    return url


def check_server_options(
    url: str,
    tls_ca: Path | None = None,
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
) -> tuple[str, ssl.SSLContext | None]:
    """``--url`` as requests use it and the SSL context of the ``--tls-*`` files (None for
    a plaintext URL), checked without a request: a malformed URL, or a TLS file that is
    missing, unreadable or not PEM, or a key that does not match its certificate, fails
    here (InvalidArgumentError naming the flag and the file). ``recserve eval`` checks them
    before anything expensive (a ``--compare`` run's checkpoint load)."""
    normalized = _normalize_url(url)
    tls = client_tls(
        normalized.startswith("https://"),
        redact_url(normalized),
        tls_ca,
        tls_cert,
        tls_key,
        names=CLI_NAMES,
    )
    return normalized, tls.ssl_context() if tls else None


class _HTTPConnection(http.client.HTTPConnection):
    response_class = DeadlineHTTPResponse


class _HTTPSConnection(http.client.HTTPSConnection):
    response_class = DeadlineHTTPResponse


class _HTTPHandler(urllib.request.HTTPHandler):
    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_HTTPConnection, req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, context: ssl.SSLContext | None) -> None:
        super().__init__(context=context)
        self._tls_context = context

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_HTTPSConnection, req, context=self._tls_context)


def _opener(context: ssl.SSLContext | None) -> urllib.request.OpenerDirector:
    """urllib's opener, whose answers are read within the deadline of
    :func:`clients._http.answer_within` (status line and headers too: urlopen's timeout
    bounds each socket read alone)."""
    return urllib.request.build_opener(_HTTPHandler(), _HTTPSHandler(context))


def signature_from_metadata(metadata: Mapping[str, Any]) -> FeatureSignature:
    """The feature signature a server reports as KServe v2 model metadata inputs."""
    try:
        inputs = list(metadata["inputs"])
        names = {entry["name"] for entry in inputs}
        ids, dense = [], []
        for entry in inputs:
            name, datatype, shape = entry["name"], entry["datatype"], list(entry["shape"])
            if name.endswith(".lengths") and name[: -len(".lengths")] in names:
                continue
            if datatype in ("INT64", "UINT64") and len(shape) == 1:
                ids.append(IdFeatureSpec(name, f"{name}.lengths" not in names))
            else:
                dense.append(NonIdFeatureSpec(name, "float32", tuple(int(d) for d in shape[1:])))
    except (KeyError, TypeError, ValueError) as error:
        raise InvalidArgumentError(f"the server's model metadata is malformed: {error!r}") from None
    return FeatureSignature(tuple(ids), tuple(dense))


class ServerScorer:
    """A running ``recserve serve`` over HTTP.

    ``protocol="v2"``: the batch encoded here is sent as KServe v2 binary tensors to
    ``/v2/models/{model}/infer`` and the float32 predictions come back as binary (exact).
    ``protocol="friendly"``: the raw rows (label column dropped) go to
    ``/v1/models/{model}:predict`` and the server's own ``--preprocessor`` encodes them, so the
    parity check covers the server's preprocessing as well.
    A batch over the server's ``--max-request-batch-size`` (a 400 whose message is "batch size
    N exceeds this server's max batch size M", as ``serving`` words it) is sent again in chunks
    of M rows, and M is kept for the batches that follow; a 413 (a body over the server's byte
    limit) is answered by halving the batch, down to one row. 503 and connection errors are
    retried a few times; a timeout is not (DeadlineExceededError).
    """

    kind = "server"
    #: TLS settings for an https:// server (None: the system's, or plaintext).
    _ssl_context: ssl.SSLContext | None = None

    def __init__(
        self,
        url: str,
        model: str,
        *,
        protocol: str = "v2",
        timeout: float = 60.0,
        label_column: str | None = None,
        retries: int = 3,
        tls_ca: Path | None = None,
        tls_cert: Path | None = None,
        tls_key: Path | None = None,
    ) -> None:
        if protocol not in PROTOCOLS:
            raise InvalidArgumentError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
        # self.url: requests go here.
        self.url, self._ssl_context = check_server_options(url, tls_ca, tls_cert, tls_key)
        self.model = model
        self.protocol = protocol
        self.timeout = timeout
        self.label_column = label_column
        self.retries = retries
        #: The server's max request batch size, once an over-size batch taught it.
        self.max_batch_size: int | None = None
        quoted = urllib.parse.quote(model, safe="")
        metadata_path = f"/v2/models/{quoted}"
        answer, _ = self._call("GET", metadata_path)
        with self._malformed(metadata_path):
            metadata = _json_object(answer)
            self.signature = signature_from_metadata(metadata)
            versions = metadata.get("versions") or []
            self.version: str | None = str(versions[0]) if versions else None
        self._infer_path = f"/v2/models/{quoted}/infer"
        self._predict_path = f"/v1/models/{quoted}:predict"

    # ------------------------------------------------------------------ transport
    def _call(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[bytes, Mapping[str, str]]:
        request = urllib.request.Request(
            self.url + path, data=body, method=method, headers=dict(headers or {})
        )
        opener = _opener(self._ssl_context)
        delay = 0.2
        for attempt in range(self.retries + 1):
            try:
                # --timeout bounds the whole attempt: a server that sends its answer a byte at
                # a time cannot stretch it (urlopen's timeout bounds each read alone).
                with (
                    answer_within(self.timeout),
                    opener.open(request, timeout=self.timeout) as response,
                ):
                    return response.read(), response.headers
            except urllib.error.HTTPError as error:
                payload = error.read()
                try:
                    message = orjson.loads(payload).get("error") or payload.decode()
                except (orjson.JSONDecodeError, AttributeError, UnicodeDecodeError):
                    message = payload[:200].decode("utf-8", "replace")
                failure = error_for_http_status(error.code, f"server {self.shown}{path}: {message}")
                limit = _batch_limit(message) if error.code == 400 else None
                if limit is not None:
                    raise _BatchTooLargeError(failure.message, limit) from None
                if error.code != 503 or attempt == self.retries:
                    raise failure from None
            except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
                reason = getattr(error, "reason", error)
                if isinstance(reason, ssl.SSLError):  # a retry would fail the same way
                    raise UnavailableError(
                        f"TLS with server {self.shown} failed: {reason}{tls_hint(str(reason))}"
                    ) from None
                if isinstance(reason, TimeoutError):
                    # Not retried (as RecserveClient): the server may still be working on it.
                    raise DeadlineExceededError(
                        f"server {self.shown}{path} did not answer within {self.timeout} s"
                    ) from None
                if attempt == self.retries:
                    raise UnavailableError(f"cannot reach {self.shown}: {reason}") from None
            except http.client.HTTPException as error:
                # Not an HTTP/1.1 answer (urllib raises these bare, not as URLError).
                if answered_in_http2(error):  # the gRPC port: a retry gets the same frames
                    raise UnavailableError(http2_hint(self.shown)) from None
                if attempt == self.retries:
                    raise UnavailableError(
                        f"server {self.shown}{path}: not a valid HTTP answer: {error!r}"
                    ) from None
            time.sleep(delay)
            delay *= 2
        raise UnavailableError(f"cannot reach {self.shown}")  # not reached

    # ------------------------------------------------------------------ scoring
    def score(self, batch: Batch, rows: Sequence[Mapping[str, Any]]) -> Scores:
        size = batch.batch_size
        if self.max_batch_size is not None and size > self.max_batch_size:
            return self._score_in_chunks(batch, rows, self.max_batch_size)
        try:
            if self.protocol == "friendly":
                return self._friendly(rows)
            return self._v2(batch)
        except _BatchTooLargeError as error:
            # Chunks strictly smaller than this batch: the recursion ends (each level's
            # chunks are smaller than the last, down to the server's limit or one row).
            if 1 <= error.limit < size:
                self.max_batch_size = error.limit
                return self._score_in_chunks(batch, rows, error.limit)
            if size < 2:
                raise
        except CapacityError:
            if size < 2:
                raise
        return self._score_in_chunks(batch, rows, (size + 1) // 2)

    def _score_in_chunks(
        self, batch: Batch, rows: Sequence[Mapping[str, Any]], chunk: int
    ) -> Scores:
        size = batch.batch_size
        parts = [
            self.score(
                _slice_batch(batch, start, min(start + chunk, size)), rows[start : start + chunk]
            )
            for start in range(0, size, chunk)
        ]
        return Scores(
            np.concatenate([part.predictions for part in parts]),
            None,
            parts[-1].model_version,
        )

    def _v2(self, batch: Batch) -> Scores:
        inputs, blobs = [], []

        def add(name: str, datatype: str, array: np.ndarray) -> None:
            payload = array.tobytes()
            inputs.append(
                {
                    "name": name,
                    "datatype": datatype,
                    "shape": list(array.shape),
                    "parameters": {"binary_data_size": len(payload)},
                }
            )
            blobs.append(payload)

        for feature in batch.id_type_features:
            add(feature.name, "UINT64", np.ascontiguousarray(feature.values, dtype="<u8"))
            if not isinstance(feature, IDTypeFeatureWithSingleID):
                lengths = np.ascontiguousarray(feature.lengths, dtype="<i8")
                add(feature.name + ".lengths", "INT64", lengths)
        for dense in batch.non_id_type_features:
            # A Batch names every non-ID feature (positional default), so the name is set.
            assert dense.name is not None
            add(dense.name, "FP32", np.ascontiguousarray(dense.data, dtype="<f4"))
        header = orjson.dumps(
            {
                "inputs": inputs,
                "outputs": [{"name": "prediction", "parameters": {"binary_data": True}}],
            }
        )
        body, headers = self._call(
            "POST",
            self._infer_path,
            b"".join([header, *blobs]),
            {"Content-Type": "application/octet-stream", _HEADER_LENGTH: str(len(header))},
        )
        with self._malformed(self._infer_path):
            json_size = headers.get(_HEADER_LENGTH)
            document = _json_object(body[: int(json_size)] if json_size else body)
            output = next((o for o in document["outputs"] if o["name"] == "prediction"), None)
            if output is None:
                raise InvalidArgumentError(f"server {self.shown} answered without a 'prediction'")
            size = (output.get("parameters") or {}).get("binary_data_size")
            if size is not None:
                if not json_size:
                    raise InvalidArgumentError(
                        f"server {self.shown} answered binary data without {_HEADER_LENGTH}"
                    )
                start = int(json_size)
                predictions = np.frombuffer(body[start : start + int(size)], dtype="<f4")
            else:
                predictions = np.asarray(output["data"], dtype=np.float32)
            return self._checked(predictions, batch.batch_size, document.get("model_version"))

    def _friendly(self, rows: Sequence[Mapping[str, Any]]) -> Scores:
        instances = [{k: v for k, v in row.items() if k != self.label_column} for row in rows]
        try:
            body, _ = self._call(
                "POST",
                self._predict_path,
                orjson.dumps({"instances": instances}),
                {"Content-Type": "application/json"},
            )
        except InvalidArgumentError as error:
            # Raw rows reached a server without a --preprocessor, which takes rows keyed by
            # feature name: the rows' own layout is --protocol v2's business.
            if type(error) is InvalidArgumentError and rows_not_feature_keyed(error.message):
                raise InvalidArgumentError(error.message + FRIENDLY_WITHOUT_PREPROCESSOR) from None
            raise
        with self._malformed(self._predict_path):
            document = _json_object(body)
            predictions = np.asarray(document["predictions"], dtype=np.float32)
            return self._checked(predictions, len(rows), document.get("model_version"))

    @contextlib.contextmanager
    def _malformed(self, path: str) -> Iterator[None]:
        """An answer that is not what a recserve server sends (not JSON, a field missing or
        of another type: a proxy's page, another service on the port) as an
        InvalidArgumentError naming the server, not a raw Python error with a traceback."""
        try:
            yield
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as error:
            detail = f"{type(error).__name__}: {error}"
            raise InvalidArgumentError(
                f"server {self.shown}{path} answered something other than a recserve (KServe v2) "
                f"answer ({detail}); is --url a recserve server?"
            ) from None

    def _checked(self, predictions: np.ndarray, n: int, version: str | None) -> Scores:
        predictions = predictions.reshape(-1).astype(np.float32, copy=True)
        if predictions.shape[0] != n:
            raise InvalidArgumentError(
                f"server {self.shown} returned {predictions.shape[0]} predictions for {n} rows"
            )
        if version:
            self.version = str(version)
        return Scores(predictions, None, version)

    def unknown_ids(self) -> None:
        return None

    @property
    def shown(self) -> str:
        """:attr:`url` as messages and the report show it: a password as ``***``."""
        return redact_url(self.url)

    def close(self) -> None:
        """Nothing to release: each request opens and closes its own connection (urllib)."""


class _BatchTooLargeError(InvalidArgumentError):
    """The server's 400 for a batch over its ``--max-request-batch-size`` (``limit``)."""

    def __init__(self, message: str, limit: int) -> None:
        super().__init__(message)
        self.limit = limit


#: How ``serving`` (tensors.tensors_to_batch, service.predict_instances) words that 400.
_BATCH_LIMIT = re.compile(r"batch size (\d+) exceeds this server's max batch size (\d+)")


def _batch_limit(message: object) -> int | None:
    """M of the server's "batch size N exceeds this server's max batch size M", or None."""
    match = _BATCH_LIMIT.match(message) if isinstance(message, str) else None
    return int(match.group(2)) if match else None


def _json_object(body: bytes) -> dict[str, Any]:
    """``body`` as a JSON object; ValueError otherwise."""
    document = orjson.loads(body)  # orjson.JSONDecodeError is a ValueError
    if not isinstance(document, dict):
        raise ValueError(f"expected a JSON object, got {type(document).__name__}")
    return document


def _slice_batch(batch: Batch, start: int, stop: int) -> Batch:
    id_features: list[IDFeature] = []
    for feature in batch.id_type_features:
        if isinstance(feature, IDTypeFeatureWithSingleID):
            id_features.append(IDTypeFeatureWithSingleID(feature.name, feature.values[start:stop]))
        else:
            offsets = feature.offsets
            values = feature.values[offsets[start] : offsets[stop]]
            id_features.append(IDTypeFeature(feature.name, values, feature.lengths[start:stop]))
    non_ids = [NonIDTypeFeature(f.data[start:stop], f.name) for f in batch.non_id_type_features]
    return Batch(id_features, non_ids, requires_grad=False)
