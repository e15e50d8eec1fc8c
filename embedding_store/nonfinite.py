"""Finding NaN / Inf in checkpoint tensors, in one pass and without a full-size temporary.

A checkpoint whose weights hold NaN or Inf loads and then answers NaN: loads refuse it,
naming the file, the tensor and the first bad value. Embedding tables are large (GBs), so
the check reads them in chunks of :data:`CHUNK` values: ``np.isfinite`` over a whole table
would allocate a bool array a quarter of its size. Chunked, it runs at ~14 GB/s on one core,
against ~1.2 GB/s for the SHA-256 that every load computes over the same bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    # Imported where a tensor is checked (its caller has torch loaded already): a parameter
    # server imports this module (checkpoint dumps and loads) and never uses torch, which
    # cost each one ~0.8 s of CPU at start.
    import torch

__all__ = [
    "CHUNK",
    "NOT_WRITTEN",
    "describe",
    "first_bad_index",
    "first_bad_index_torch",
    "position",
    "stored_values",
]

#: The end of a writer's error for values a load refuses: why nothing is written, and what
#: to do. Writers check what loads check, so no checkpoint is published that cannot be
#: loaded (it could replace the last good one at its path).
NOT_WRITTEN = (
    "Serving, resuming and `recserve checkpoint verify` refuse such a checkpoint, so none "
    "was written (one already at the path is kept): training diverged (a learning rate too "
    "high, unscaled inputs?); resume from an earlier checkpoint"
)

#: Values checked per step: 1 MiB of float32, and a 256 KiB bool temporary (stays in cache).
CHUNK = 1 << 18


def first_bad_index(array: np.ndarray, *, nan_only: bool = False) -> int | None:
    """The flat (row-major) index of the first NaN or +-Inf of ``array`` (any shape, a float
    dtype), or of the first NaN with ``nan_only``; None when there is none."""
    flat = array.reshape(-1)
    test = np.isnan if nan_only else np.isfinite
    for start in range(0, flat.shape[0], CHUNK):
        chunk = flat[start : start + CHUNK]
        if nan_only:
            bad = test(chunk)
            if bad.any():
                return start + int(np.argmax(bad))
        else:
            good = test(chunk)
            if not good.all():
                return start + int(np.argmin(good))
    return None


def first_bad_index_torch(tensor: torch.Tensor, *, nan_only: bool = False) -> int | None:
    """:func:`first_bad_index` of a torch tensor (any float dtype, bfloat16 included);
    None for a tensor that is not floating point (integers cannot hold NaN or Inf). Of a
    sparse tensor, the index among its stored values."""
    import torch  # lazily: see the import above

    if not tensor.is_floating_point():
        return None
    flat = stored_values(tensor).reshape(-1)
    for start in range(0, flat.shape[0], CHUNK):
        chunk = flat[start : start + CHUNK]
        bad = torch.isnan(chunk) if nan_only else ~torch.isfinite(chunk)
        if bool(bad.any()):
            return start + int(torch.argmax(bad.to(torch.uint8)))
    return None


def position(first: int, shape: tuple[int, ...]) -> list[int]:
    """The index ``[i, j, ...]`` in an array of ``shape`` of flat index ``first``."""
    return [int(i) for i in np.unravel_index(first, shape)] if shape else []


def stored_values(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (detached), or of a sparse tensor its stored values (1-d)."""
    import torch  # lazily: see the import above

    tensor = tensor.detach()
    if tensor.layout == torch.sparse_coo:
        return tensor.coalesce().values()
    if tensor.layout != torch.strided:
        return tensor.values()  # compressed layouts (CSR, CSC, ...)
    return tensor


def describe(values: np.ndarray, first: int, shape: tuple[int, ...], *, nan_only: bool) -> str:
    """``"2 non-finite value(s) (NaN or Inf), the first at [3, 1]: nan"``, for an error
    message: the error path only (it counts over the whole array). ``values``: the flat
    array, ``first``: the index :func:`first_bad_index` found, ``shape``: the tensor's."""
    count = int(np.count_nonzero(np.isnan(values) if nan_only else ~np.isfinite(values)))
    what = "NaN value(s)" if nan_only else "non-finite value(s) (NaN or Inf)"
    return f"{count} {what}, the first at {position(first, shape)}: {float(values[first])!r}"
