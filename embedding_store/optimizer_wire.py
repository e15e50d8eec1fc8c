"""Optimizer and initialization settings <-> ConfigureRequest messages (both services)."""

from __future__ import annotations

from embedding_store.errors import ConfigError, InvalidArgumentError
from embedding_store.initializer import InitializationConfig
from embedding_store.optimizers import SGD, Adagrad, Adam, Optimizer
from embedding_store.proto import embedding_tier_pb2 as pb


def settings_to_configure_request(
    optimizer: Optimizer | None = None, initialization: InitializationConfig | None = None
) -> pb.ConfigureRequest:
    """Build a ConfigureRequest; None leaves that setting unchanged on the server."""
    request = pb.ConfigureRequest()
    if isinstance(optimizer, SGD):
        request.sgd.CopyFrom(pb.Sgd(lr=optimizer.lr, weight_decay=optimizer.weight_decay))
    elif isinstance(optimizer, Adagrad):
        request.adagrad.CopyFrom(
            pb.Adagrad(
                lr=optimizer.lr,
                initial_accumulator_value=optimizer.initial_accumulator_value,
                g_square_momentum=optimizer.g_square_momentum,
                eps=optimizer.eps,
                weight_decay=optimizer.weight_decay,
                vectorwise_shared=optimizer.vectorwise_shared,
            )
        )
    elif isinstance(optimizer, Adam):
        request.adam.CopyFrom(
            pb.Adam(
                lr=optimizer.lr,
                beta1=optimizer.betas[0],
                beta2=optimizer.betas[1],
                eps=optimizer.eps,
                weight_decay=optimizer.weight_decay,
            )
        )
    elif optimizer is not None:
        raise InvalidArgumentError(f"unsupported optimizer {type(optimizer).__name__}")
    if initialization is not None:
        request.initialization.CopyFrom(
            pb.Initialization(
                low=initialization.low,
                high=initialization.high,
                admit_probability=initialization.admit_probability,
                has_weight_bound=initialization.weight_bound is not None,
                weight_bound=initialization.weight_bound or 0.0,
                seed=initialization.seed,
            )
        )
    return request


def configure_request_to_settings(
    request: pb.ConfigureRequest,
) -> tuple[Optimizer | None, InitializationConfig | None]:
    """Decode a ConfigureRequest; invalid values raise InvalidArgumentError naming the field."""
    try:
        kind = request.WhichOneof("optimizer")
        optimizer: Optimizer | None = None
        if kind == "sgd":
            optimizer = SGD(lr=request.sgd.lr, weight_decay=request.sgd.weight_decay)
        elif kind == "adagrad":
            a = request.adagrad
            optimizer = Adagrad(
                lr=a.lr,
                initial_accumulator_value=a.initial_accumulator_value,
                g_square_momentum=a.g_square_momentum,
                eps=a.eps,
                weight_decay=a.weight_decay,
                vectorwise_shared=a.vectorwise_shared,
            )
        elif kind == "adam":
            a = request.adam
            optimizer = Adam(
                lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps, weight_decay=a.weight_decay
            )
        initialization = None
        if request.HasField("initialization"):
            i = request.initialization
            initialization = InitializationConfig(
                low=i.low,
                high=i.high,
                admit_probability=i.admit_probability,
                weight_bound=i.weight_bound if i.has_weight_bound else None,
                seed=i.seed,
            )
    except ConfigError as error:
        raise InvalidArgumentError(f"ConfigureRequest: {error.message}") from None
    return optimizer, initialization
