"""HTTP backend: one attempt per call over a shared urllib3 connection pool.

Raises :class:`~clients.retry.RetryableError` for HTTP 503 and refused connections, recserve errors
for everything else. The clients add retries, latency and the sync/async surface.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

import numpy as np
import urllib3
from urllib3.exceptions import HTTPError, NewConnectionError
from urllib3.exceptions import TimeoutError as Urllib3Timeout

from clients import codec
from clients.retry import RetryableError
from clients.types import ModelInfo, PredictResult
from embedding_store.errors import DeadlineExceededError, RecserveError, UnavailableError


def _refused(error: BaseException) -> bool:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, ConnectionRefusedError):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return "Connection refused" in str(error)


class HttpBackend:
    """Calls of the KServe v2 REST protocol on ``base_url`` (``http://host:port[/prefix]``)."""

    def __init__(self, base_url: str, *, max_connections: int = 8) -> None:
        self.server = base_url.rstrip("/")
        self._pool = urllib3.PoolManager(num_pools=2, maxsize=max_connections, retries=False)

    # ------------------------------------------------------------------ plumbing
    def _request(
        self,
        method: str,
        path: str,
        *,
        timeout: float | None,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> urllib3.BaseHTTPResponse:
        try:
            return self._pool.request(
                method,
                self.server + path,
                body=body,
                headers=dict(headers or {}),
                timeout=urllib3.Timeout(connect=timeout, read=timeout),
                retries=False,
                redirect=False,
            )
        except NewConnectionError as error:
            if _refused(error):
                raise RetryableError(
                    UnavailableError(f"server {self.server} refused the connection")
                ) from None
            raise UnavailableError(f"cannot connect to server {self.server}: {error}") from None
        except Urllib3Timeout:
            raise DeadlineExceededError(
                f"server {self.server} did not answer {method} {path} within {timeout} s"
            ) from None
        except HTTPError as error:
            raise UnavailableError(
                f"server {self.server}: {method} {path} failed: {error}"
            ) from None

    def _error(self, response: urllib3.BaseHTTPResponse) -> RecserveError | RetryableError:
        error = codec.http_error(self.server, response.status, response.data)
        return RetryableError(error) if response.status == 503 else error

    def _ok(self, response: urllib3.BaseHTTPResponse) -> urllib3.BaseHTTPResponse:
        if response.status >= 300:
            raise self._error(response)
        return response

    def _flag(self, path: str, timeout: float | None) -> bool:
        response = self._request("GET", path, timeout=timeout)
        if response.status == 200:
            return True
        if response.status == 503:
            return False
        raise self._error(response)

    # ------------------------------------------------------------------ calls
    def live(self, timeout: float | None) -> bool:
        return self._flag("/v2/health/live", timeout)

    def ready(self, timeout: float | None) -> bool:
        return self._flag("/v2/health/ready", timeout)

    def model_ready(self, model: str, timeout: float | None) -> bool:
        return self._flag(f"/v2/models/{quote(model, safe='')}/ready", timeout)

    def metadata(self, model: str, timeout: float | None) -> ModelInfo:
        response = self._ok(
            self._request("GET", f"/v2/models/{quote(model, safe='')}", timeout=timeout)
        )
        return codec.model_info_from_json(codec.parse_json(response.data))

    def infer(
        self, model: str, tensors: Mapping[str, np.ndarray], timeout: float | None
    ) -> PredictResult:
        body, headers = codec.encode_http_infer(tensors, timeout=timeout)
        response = self._ok(
            self._request(
                "POST",
                f"/v2/models/{quote(model, safe='')}/infer",
                body=body,
                headers=headers,
                timeout=timeout,
            )
        )
        return codec.decode_http_infer(response.data, response.headers.get(codec.HEADER_LENGTH))

    def predict_rows(
        self, model: str, rows: Sequence[Mapping[str, Any]], timeout: float | None
    ) -> PredictResult:
        response = self._ok(
            self._request(
                "POST",
                f"/v1/models/{quote(model, safe='')}:predict",
                body=codec.encode_rows(rows),
                headers={"Content-Type": "application/json"},
                timeout=timeout,
            )
        )
        return codec.decode_rows_response(response.data)

    def close(self) -> None:
        self._pool.clear()
