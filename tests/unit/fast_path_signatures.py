"""Signatures shared by the fast-path decode tests (JSON and binary bodies)."""

from __future__ import annotations

from embedding_store.signature import FeatureSignature, IdFeatureSpec, NonIdFeatureSpec

MAX_BATCH = 128

#: Single-ID features and dense ones (one of sample shape (1,), which may come as [B]).
SINGLE = FeatureSignature(
    id_features=tuple(IdFeatureSpec(f"C{i}", True) for i in range(1, 6)),
    non_id_features=(
        NonIdFeatureSpec("dense", "float32", (6,)),
        NonIdFeatureSpec("age", "float32", (1,)),
    ),
)
