"""The KServe v2 tensors of a model's feature signature: the specs its metadata lists.

KServe v2 tensor naming:

* ID feature ``<slot>`` with a variable number of IDs per sample: input ``<slot>`` (INT64 or
  UINT64, shape [total_ids]) and ``<slot>.lengths`` (INT32 or INT64, shape [batch]);
* ID feature with one ID per sample: ``<slot>`` (INT64 or UINT64, shape [batch]), no lengths;
* non-ID feature ``<name>``: FP32 [batch, *sample_shape].
"""

from __future__ import annotations

import functools

from embedding_store.errors import CheckpointError
from embedding_store.signature import FeatureSignature
from serving.core import TensorSpec

LENGTHS_SUFFIX = ".lengths"
ID_DATATYPES = ("INT64", "UINT64")
LENGTH_DATATYPES = ("INT32", "INT64")
OUTPUT_NAME = "prediction"


@functools.lru_cache(maxsize=64)
def input_specs(signature: FeatureSignature) -> tuple[TensorSpec, ...]:
    """The model's inputs as KServe v2 tensor specs, in signature order (cached: every
    request is checked against them)."""
    specs: list[TensorSpec] = []
    for feature in signature.id_features:
        specs.append(TensorSpec(feature.name, "INT64", (-1,), ID_DATATYPES))
        if not feature.single_id:
            specs.append(
                TensorSpec(feature.name + LENGTHS_SUFFIX, "INT64", (-1,), LENGTH_DATATYPES)
            )
    for dense in signature.non_id_features:
        specs.append(TensorSpec(dense.name, "FP32", (-1, *dense.sample_shape), ("FP32",)))
    return tuple(specs)


def check_input_names(signature: FeatureSignature) -> None:
    """CheckpointError unless every input of ``signature`` has a name of its own. A feature
    named like another's lengths input (a jagged ID feature ``hist`` and a feature
    ``hist.lengths``) would share one request tensor with it: a request could only ever send
    the same numbers for both, the lengths read as that feature's IDs or values."""
    inputs: list[tuple[str, str]] = []  # (input name, what it holds), as input_specs orders them
    for feature in signature.id_features:
        inputs.append((feature.name, f"ID feature {feature.name!r}"))
        if not feature.single_id:
            lengths = f"the lengths of jagged ID feature {feature.name!r}"
            inputs.append((feature.name + LENGTHS_SUFFIX, lengths))
    inputs += [(f.name, f"non-ID feature {f.name!r}") for f in signature.non_id_features]
    owners: dict[str, str] = {}
    for name, owner in inputs:
        other = owners.setdefault(name, owner)
        if other != owner:
            raise CheckpointError(
                f"the model cannot be served over KServe v2: {other} and {owner} would both "
                f"be the input {name!r}, and one request tensor cannot hold both; a feature "
                f"must not be named like a jagged ID feature's {LENGTHS_SUFFIX!r} input "
                "(rename it in the training data and train again)"
            )


@functools.lru_cache(maxsize=64)
def input_names(signature: FeatureSignature) -> frozenset[str]:
    return frozenset(spec.name for spec in input_specs(signature))


def output_specs() -> tuple[TensorSpec, ...]:
    return (TensorSpec(OUTPUT_NAME, "FP32", (-1, 1), ("FP32",)),)
