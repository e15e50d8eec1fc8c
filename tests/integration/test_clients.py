"""clients/ against a real ``recserve serve`` (Adult checkpoint, sigmoid output, the Adult
preprocessor, model name ``adult``) on loopback: HTTP and gRPC clients, sync and async, agree
with each other and with friendly rows; ``recserve predict`` scores JSON-lines and CSV files."""

from __future__ import annotations

import asyncio
import csv
import gzip
import itertools
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from clients import AsyncRecserveClient, ModelInfo, RecserveClient, TensorInfo
from embedding_store.errors import InvalidArgumentError, NotFoundError
from examples.adult_income import features
from serving.infer_ctx import InferCtx
from tests.integration.conftest import ADULT_PREPROCESSOR, REPO_ROOT, ServeProcess

MODEL = "adult"
N_ROWS = 48
ATOL = 1e-6


def read_rows(count: int) -> tuple[list[str], list[list[str]]]:
    """Header and the first ``count`` raw rows of the Adult test split (label included)."""
    with gzip.open(features.TEST_PATH, "rt", encoding="utf-8", newline="") as f:
        reader = csv.reader(f)
        header = [name.strip() for name in next(reader)]
        return header, [[v.strip() for v in row] for row in itertools.islice(reader, count)]


def friendly(header: list[str], rows: list[list[str]]) -> list[dict[str, Any]]:
    """Rows as a JSON client sends them: numbers as numbers, no label."""
    out = []
    for row in rows:
        record: dict[str, Any] = dict(zip(header, row))
        record.pop(features.LABEL_COLUMN)
        for column in features.NUMERIC_COLUMNS:
            record[column] = int(record[column])
        out.append(record)
    return out


@pytest.fixture(scope="module")
def server(adult_checkpoint, serve_process) -> Iterator[ServeProcess]:
    process = serve_process(
        adult_checkpoint,
        "--output-transform",
        "sigmoid",
        "--preprocessor",
        ADULT_PREPROCESSOR,
        "--model-name",
        MODEL,
    )
    try:
        yield process
    finally:
        process.kill()


@pytest.fixture(scope="module")
def urls(server) -> dict[str, str]:
    return {"http": f"http://{server.http_url}", "grpc": f"grpc://{server.grpc_url}"}


@pytest.fixture(scope="module")
def rows() -> list[dict[str, Any]]:
    rows = friendly(*read_rows(N_ROWS))
    # Values the training data never had: their IDs are unknown to the embedding tier.
    rows[0]["native-country"] = "Atlantis"
    rows[3]["occupation"] = "Astronaut"
    rows[3]["workclass"] = "Guild"
    return rows


@pytest.fixture(scope="module")
def offline(adult_checkpoint, rows) -> tuple[np.ndarray, int]:
    """What the checkpoint itself answers for ``rows`` (InferCtx in this process, no server):
    predictions float32 [N_ROWS, 1] and the number of unknown IDs among them."""
    batch = features.rows_to_batch(rows, with_labels=False, requires_grad=False)
    with InferCtx(checkpoint=adult_checkpoint, output_transform="sigmoid") as ctx:
        return ctx.forward(batch), ctx.get_embedding_from_data(batch).unknown_ids


@pytest.fixture(scope="module")
def expected(urls, offline) -> np.ndarray:
    with RecserveClient(urls["http"], model_name=MODEL) as client:
        assert client.wait_until_ready(30)
    return offline[0]


def test_http_grpc_and_rows_agree(urls, rows, expected, offline, server):
    batch = features.rows_to_batch(rows, with_labels=False, requires_grad=False)
    unknown = offline[1]
    assert unknown >= 3  # the made-up values above, at least
    assert expected.shape == (N_ROWS, 1) and expected.dtype == np.float32
    for protocol, url in urls.items():
        with RecserveClient(url, model_name=MODEL, timeout=10) as client:
            # Friendly rows go to the HTTP route only (the server's preprocessor reads them).
            for data in (rows, batch) if protocol == "http" else (batch,):
                result = client.predict(data)
                np.testing.assert_allclose(
                    result.predictions, expected, rtol=0, atol=ATOL, err_msg=protocol
                )
                assert result.model_version == server.version
                assert result.model_name == MODEL
                assert result.fallback_ids == 0
                assert result.unknown_ids == unknown, protocol
                assert result.latency_seconds > 0
    # The unchanged rows as read from the file (a labelled batch; labels are not sent).
    file_batch = next(features.read_batches(features.TEST_PATH, N_ROWS, requires_grad=False))
    changed = [0, 3]
    kept = np.setdiff1d(np.arange(N_ROWS), changed)
    with RecserveClient(urls["grpc"], model_name=MODEL, timeout=10) as client:
        from_file = client.predict(file_batch).predictions
    np.testing.assert_allclose(from_file[kept], expected[kept], rtol=0, atol=ATOL)


def test_metadata_and_health(urls, server):
    infos = []
    for url in urls.values():
        with RecserveClient(url, model_name=MODEL) as client:
            assert client.live() and client.ready() and client.model_ready()
            infos.append(client.metadata())
    http_info, grpc_info = infos
    assert http_info == grpc_info
    assert isinstance(http_info, ModelInfo)
    assert http_info.name == MODEL and http_info.versions == (server.version,)
    assert http_info.input("numeric") == TensorInfo("numeric", "FP32", (-1, 6))
    assert {spec.name for spec in http_info.inputs} == {*features.SLOT_NAMES, "numeric"}
    assert http_info.outputs == (TensorInfo("prediction", "FP32", (-1, 1)),)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_one_client_shared_by_more_threads_than_connections(urls, rows, expected, protocol):
    # The clients say they are thread-safe. Over HTTP, the pool (4 connections) is full
    # whenever 16 threads answer at once: a connection handed back then is closed, and a
    # read must not touch its socket afterwards (it did: "Bad file descriptor", ~2%).
    from concurrent.futures import ThreadPoolExecutor

    batch = features.rows_to_batch(rows, with_labels=False, requires_grad=False)
    with (
        RecserveClient(urls[protocol], model_name=MODEL, retries=0, max_connections=4) as client,
        ThreadPoolExecutor(16) as pool,
    ):
        answers = list(pool.map(lambda _: client.predict(batch).predictions, range(400)))
    for predictions in answers:
        np.testing.assert_allclose(predictions, expected, rtol=0, atol=ATOL)


def test_errors(urls, rows):
    for url in urls.values():
        with (
            RecserveClient(url, model_name="nope", retries=0) as client,
            pytest.raises(NotFoundError, match="unknown model 'nope'"),
        ):
            client.metadata()
        with RecserveClient(url, model_name=MODEL, retries=0) as client:
            with pytest.raises(InvalidArgumentError, match="missing input") as caught:
                client.infer({"numeric": np.zeros((1, 6), dtype=np.float32)})
            assert url in caught.value.message
    with (
        RecserveClient(urls["grpc"], model_name=MODEL) as client,
        pytest.raises(InvalidArgumentError, match="need an HTTP server URL"),
    ):
        client.predict(rows)


def test_async_clients(urls, rows, expected):
    batch = features.rows_to_batch(rows, with_labels=False, requires_grad=False)

    async def main():
        async with (
            AsyncRecserveClient(urls["http"], model_name=MODEL) as http,
            AsyncRecserveClient(urls["grpc"], model_name=MODEL) as grpc_client,
        ):
            assert await http.ready() and await grpc_client.ready()
            assert (await http.metadata()) == (await grpc_client.metadata())
            return await asyncio.gather(
                http.predict(batch), grpc_client.predict(batch), http.predict(rows)
            )

    for result in asyncio.run(main()):
        np.testing.assert_allclose(result.predictions, expected, atol=ATOL)


# --------------------------------------------------------------------------- recserve predict
def _run_predict(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "embedding_store.cli", "predict", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_predict_command_jsonl_and_csv(tmp_path: Path, urls, rows, expected, server):
    header, raw = read_rows(N_ROWS)
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    table = tmp_path / "rows.csv"
    with open(table, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(raw)
    out = tmp_path / "out.jsonl"

    printed = _run_predict(
        "--url", urls["http"], "--model", MODEL, "--input", str(jsonl), "--batch-size", "20"
    )
    assert printed.returncode == 0, printed.stderr
    written = _run_predict(
        "--url", urls["http"], "--model", MODEL, "--input", str(table), "--output", str(out)
    )
    assert written.returncode == 0, written.stderr
    # The JSON lines carry the rows with made-up values (rows 0 and 3), the CSV the originals.
    kept = np.setdiff1d(np.arange(N_ROWS), [0, 3])
    for text, compared in ((printed.stdout, np.arange(N_ROWS)), (out.read_text(), kept)):
        lines = [orjson.loads(line) for line in text.splitlines()]
        assert len(lines) == N_ROWS
        assert {line["model_version"] for line in lines} == {server.version}
        predictions = np.array([[line["prediction"]] for line in lines], dtype=np.float32)
        np.testing.assert_allclose(predictions[compared], expected[compared], rtol=0, atol=ATOL)


def test_predict_command_reports_bad_lines(tmp_path: Path, urls, rows):
    path = tmp_path / "bad.jsonl"
    lines = [orjson.dumps(row).decode() for row in rows[:4]]
    lines[2] = lines[2][:-5]  # truncated JSON on line 3
    path.write_text("\n".join(lines) + "\n")
    result = _run_predict("--url", urls["http"], "--model", MODEL, "--input", str(path))
    assert result.returncode == 1
    assert result.stdout == ""
    assert "recserve predict: error:" in result.stderr
    assert "line 3: not valid JSON" in result.stderr


def test_a_failed_predict_run_leaves_the_previous_output_as_it_was(tmp_path: Path, urls, rows):
    good = tmp_path / "good.jsonl"
    good.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows[:5]))
    out = tmp_path / "out.jsonl"
    first = _run_predict(
        "--url", urls["http"], "--model", MODEL, "--input", str(good), "--output", str(out)
    )
    assert first.returncode == 0, first.stderr
    before = out.read_bytes()
    assert len(before.splitlines()) == 5
    bad_rows = [dict(row) for row in rows[:6]]
    bad_rows[5]["hours-per-week"] = "many"  # the server refuses the third batch of two
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in bad_rows))
    failed = _run_predict(
        "--url",
        urls["http"],
        "--model",
        MODEL,
        "--input",
        str(bad),
        "--output",
        str(out),
        "--batch-size",
        "2",
    )
    assert failed.returncode == 1
    assert "line" in failed.stderr
    assert out.read_bytes() == before  # not truncated, not half-written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "good.jsonl", "out.jsonl"]
