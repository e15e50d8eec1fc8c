"""The prediction cross-check of benchmarks/peers.py: the same KServe v2 request, in JSON or
the binary tensor extension, answered by recserve and by TorchServe; ``ok`` when the
predictions agree to ``CROSS_CHECK_TOLERANCE``.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import numpy as np

from load_tests import traffic

HEADER_LENGTH = "Inference-Header-Content-Length"
#: Largest |recserve - TorchServe| prediction difference the cross-check accepts.
CROSS_CHECK_TOLERANCE = 1e-5


def infer(url: str, arrays: dict[str, np.ndarray], encoding: str) -> tuple[dict, np.ndarray]:
    """POST one KServe v2 request of ``arrays`` in ``encoding``: (the answer's JSON part, its
    ``prediction`` values)."""
    if encoding == "binary":
        body, length = traffic.encode_kserve_binary(arrays)
        headers = {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(length)}
    else:
        body, headers = traffic.encode_kserve_json(arrays), {"Content-Type": "application/json"}
    request = urllib.request.Request(url, data=body, headers=headers)
    with urllib.request.urlopen(request, timeout=30.0) as response:
        answer, header_length = response.read(), response.headers.get(HEADER_LENGTH)
    if encoding == "binary" and header_length is None:
        raise ValueError(f"a binary request was answered without {HEADER_LENGTH}")
    return decode_answer(answer, header_length)


def decode_answer(body: bytes, header_length: str | None) -> tuple[dict, np.ndarray]:
    """A KServe v2 infer answer, JSON or binary extension (``header_length`` given): (its JSON
    part, the ``prediction`` output as float64); raises ValueError if binary sizes are off."""
    if header_length is None:
        document = json.loads(body)
        output = next(o for o in document["outputs"] if o["name"] == "prediction")
        return document, np.asarray(output["data"], dtype=np.float64)
    size = int(header_length)
    document = json.loads(body[:size])
    offset, values = size, None
    for output in document["outputs"]:
        nbytes = (output.get("parameters") or {}).get("binary_data_size")
        if nbytes is None:
            array = np.asarray(output["data"], dtype=np.float64)
        else:
            if output["datatype"] != "FP32" or nbytes != 4 * int(np.prod(output["shape"])):
                raise ValueError(f"output {output['name']!r}: {nbytes} bytes for {output}")
            array = np.frombuffer(body, "<f4", count=nbytes // 4, offset=offset)
            offset += nbytes
        if output["name"] == "prediction":
            values = array.astype(np.float64)
    if offset != len(body) or values is None:
        raise ValueError(f"binary answer of {len(body)} bytes: {offset} claimed, {document}")
    return document, values


def cross_check(
    recserve_url: str,
    torchserve_url: str,
    model: str,
    arrays: dict[str, np.ndarray],
    encoding: str = "json",
) -> dict[str, Any]:
    """The same KServe v2 request (``encoding``) to both servers: predictions must agree."""
    try:
        ours, a = infer(f"{recserve_url}/v2/models/model/infer", arrays, encoding)
        _, b = infer(f"{torchserve_url}/predictions/{model}", arrays, encoding)
        difference = float(np.max(np.abs(a - b))) if len(a) == len(b) else None
        return {
            "samples": len(a),
            "max_abs_diff": difference,
            "unknown_ids": ours.get("parameters", {}).get("unknown_ids"),
            "ok": difference is not None and difference <= CROSS_CHECK_TOLERANCE,
        }
    except Exception as error:
        return {"error": repr(error), "ok": False}
