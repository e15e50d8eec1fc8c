"""Serving hook: raw Adult rows (friendly JSON instances) -> an inference Batch.

    recserve serve --checkpoint runs/adult \
        --preprocessor examples.adult_income.preprocess:instances_to_batch
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from embedding_store.batch import Batch
from examples.adult_income.features import rows_to_batch


def instances_to_batch(instances: Sequence[Mapping[str, Any]]) -> Batch:
    """``{"age": 39, "workclass": "State-gov", ...}`` rows (no label) -> Batch."""
    return rows_to_batch(instances, with_labels=False, requires_grad=False)
