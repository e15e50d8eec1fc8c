"""The parity check of ``recserve eval --compare``: in-process vs server predictions, chunk by
chunk, within a tolerance; the summary for the report, and the text printed (with a hint when
one side is the sigmoid of the other: an ``--output-transform`` mismatch)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["Parity"]

SHOWN_DIFFERENCES = 10


class Parity:
    """In-process vs server predictions, chunk by chunk."""

    def __init__(self, tolerance: float) -> None:
        self.tolerance = tolerance
        self.rows = 0
        self.differing = 0
        self.max_diff = 0.0
        self.examples: list[dict[str, Any]] = []
        # Rows where one side is the sigmoid of the other: an --output-transform mismatch.
        self.server_is_sigmoid = 0
        self.local_is_sigmoid = 0

    def add(self, where: Sequence[str], local: np.ndarray, server: np.ndarray) -> np.ndarray:
        local64, server64 = local.astype(np.float64), server.astype(np.float64)
        diff = np.abs(local64 - server64)
        bad = ~(diff <= self.tolerance)  # NaN differs
        self.rows += len(diff)
        self.differing += int(bad.sum())
        with np.errstate(over="ignore"):
            sigmoid_local = 1.0 / (1.0 + np.exp(-local64))
            sigmoid_server = 1.0 / (1.0 + np.exp(-server64))
        self.server_is_sigmoid += int((np.abs(sigmoid_local - server64) <= self.tolerance).sum())
        self.local_is_sigmoid += int((np.abs(sigmoid_server - local64) <= self.tolerance).sum())
        if diff.size:
            finite = diff[np.isfinite(diff)]
            worst = float(finite.max()) if finite.size else 0.0
            if finite.size < diff.size:
                worst = math.inf
            self.max_diff = max(self.max_diff, worst)
        for i in np.flatnonzero(bad)[: max(0, SHOWN_DIFFERENCES - len(self.examples))]:
            self.examples.append(
                {
                    "where": where[i],
                    "in_process": float(local[i]),
                    "server": float(server[i]),
                    "abs_diff": float(diff[i]),
                }
            )
        return diff

    def summary(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "tolerance": self.tolerance,
            "differing_rows": self.differing,
            "max_abs_diff": self.max_diff,
            "identical": self.differing == 0,
            "first_differences": self.examples,
        }

    def text(self) -> str:
        if self.differing == 0:
            return (
                f"parity OK: {self.rows} rows, in-process and server predictions agree within "
                f"{self.tolerance:g} (max abs diff {self.max_diff:.3g})"
            )
        lines = [
            f"parity FAILED: {self.differing} of {self.rows} rows differ by more than "
            f"{self.tolerance:g} (max abs diff {self.max_diff:.6g}); first rows:"
        ]
        for e in self.examples:
            lines.append(
                f"  {e['where']}: in-process {e['in_process']:.9g}  server {e['server']:.9g}  "
                f"diff {e['abs_diff']:.3g}"
            )
        if self.differing == self.rows == self.server_is_sigmoid:
            lines.append(
                "  every server prediction is the sigmoid of the in-process one: the server "
                "runs --output-transform sigmoid; pass it to recserve eval too"
            )
        elif self.differing == self.rows == self.local_is_sigmoid:
            lines.append(
                "  every in-process prediction is the sigmoid of the server's: the server "
                "answers logits; drop --output-transform sigmoid here"
            )
        return "\n".join(lines)
