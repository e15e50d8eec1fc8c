"""Optimizer and initialization settings cross the wire (ConfigureRequest) unchanged, field by
field, and an optimizer the wire cannot carry is refused before any call."""

from __future__ import annotations

import pytest

from embedding_store.errors import InvalidArgumentError
from embedding_store.initializer import InitializationConfig
from embedding_store.optimizer_wire import (
    configure_request_to_settings,
    settings_to_configure_request,
)
from embedding_store.optimizers import SGD, Adagrad, Adam
from embedding_store.proto import embedding_tier_pb2 as pb

# Values exact in float32 and different from every default, so a dropped or swapped field shows.
OPTIMIZERS = [
    SGD(lr=0.5, weight_decay=0.25),
    Adagrad(
        lr=0.5,
        initial_accumulator_value=0.125,
        g_square_momentum=0.75,
        eps=0.0625,
        weight_decay=0.25,
        vectorwise_shared=True,
    ),
    Adam(lr=0.5, betas=(0.75, 0.875), eps=0.0625, weight_decay=0.25),
]


def _over_the_wire(request: pb.ConfigureRequest) -> pb.ConfigureRequest:
    return pb.ConfigureRequest.FromString(request.SerializeToString())


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: type(o).__name__)
def test_every_optimizer_field_round_trips(optimizer) -> None:
    request = _over_the_wire(settings_to_configure_request(optimizer, None))
    decoded, initialization = configure_request_to_settings(request)
    assert decoded == optimizer
    assert initialization is None  # left unchanged on the server


@pytest.mark.parametrize("weight_bound", [None, 0.5])
def test_every_initialization_field_round_trips(weight_bound) -> None:
    sent = InitializationConfig(
        low=-0.25, high=0.125, admit_probability=0.5, weight_bound=weight_bound, seed=42
    )
    request = _over_the_wire(settings_to_configure_request(None, sent))
    assert configure_request_to_settings(request) == (None, sent)


def test_an_empty_request_changes_nothing() -> None:
    assert configure_request_to_settings(settings_to_configure_request()) == (None, None)


def test_an_unsupported_optimizer_is_refused() -> None:
    with pytest.raises(InvalidArgumentError) as refused:
        settings_to_configure_request(object())  # type: ignore[arg-type]
    assert refused.value.message == "unsupported optimizer object"
