"""Exact ROC AUC (rank-based Mann-Whitney U with tie handling), numpy only."""

from __future__ import annotations

import numpy as np

__all__ = ["roc_auc"]


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """The probability that a random positive scores above a random negative (ties count 1/2).

    ``labels`` are 0/1 (anything > 0.5 is positive), ``scores`` any real numbers; both are
    flattened. Raises ``ValueError`` unless both classes are present.
    """
    y = np.asarray(labels, dtype=np.float64).reshape(-1) > 0.5
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    if y.shape != s.shape:
        raise ValueError(f"labels ({y.size}) and scores ({s.size}) differ in length")
    if np.isnan(s).any():
        raise ValueError("scores contain NaN")
    n_pos = int(y.sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError("AUC needs both positive and negative labels")
    # Midranks (1-based): tied scores share the mean of the ranks they span.
    order = np.argsort(s, kind="mergesort")
    sorted_s = s[order]
    starts = np.flatnonzero(np.r_[True, sorted_s[1:] != sorted_s[:-1]])
    ends = np.r_[starts[1:], s.size]  # exclusive
    midrank = (starts + ends + 1) / 2.0  # mean of ranks starts+1 .. ends
    ranks = np.empty(s.size, dtype=np.float64)
    ranks[order] = np.repeat(midrank, ends - starts)
    u = ranks[y].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))
