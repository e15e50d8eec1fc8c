"""PERSIA-style contexts: EmbeddingCtx (lookups only), TrainCtx (hybrid training), eval_ctx.

A batch's ID features go to the embedding tier; the dense model gets
``forward(non_id_tensors: List[Tensor], embedding_tensors: List[Tensor])``. In TrainCtx the
dense parameters are updated synchronously every step (DDP allreduce when WORLD_SIZE > 1) while
the embedding gradients go back to the embedding tier asynchronously: at most
``embedding_staleness`` batches may have been looked up without their gradients applied.
``embedding_staleness=1`` is fully synchronous (and with ``reproducible`` data, exactly
repeatable in one process; DDP ranks sharing a tier interleave their updates in no fixed
order).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import threading
from collections.abc import Iterator, Sequence
from enum import Enum
from pathlib import Path
from typing import Any, cast, overload

import numpy as np
import torch

from embedding_store.batch import Batch
from embedding_store.cli_types import grpc_address_problem
from embedding_store.config import (
    GLOBAL_CONFIG_ENV,
    EmbeddingConfig,
    GlobalConfig,
    JobType,
    load_embedding_config,
    load_global_config,
)
from embedding_store.errors import (
    CheckpointError,
    ConfigError,
    FailedPreconditionError,
    InvalidArgumentError,
)
from embedding_store.initializer import InitializationConfig
from embedding_store.model_checkpoint import CheckpointManifest
from embedding_store.optimizers import SGD, Adagrad, Adam, Optimizer
from embedding_store.signature import FeatureSignature, model_dtype
from embedding_store.tier import EmbeddingTier, InProcessEmbeddingTier
from training import distributed
from training.distributed import DDPOption
from training.env import EMBEDDING_WORKERS_ENV

log = logging.getLogger(__name__)

#: How long training's calls to a remote embedding worker are retried while it (or one of its
#: parameter-server shards) cannot be reached, before the run fails naming it: long enough
#: for a restarted shard or worker to come back, short against a run.
TIER_RETRY_SECONDS = 30.0
#: How long a TrainCtx left on an exception waits for an embedding update under way.
_STOP_JOIN_SECONDS = 2.0


class PreprocessMode(Enum):
    """What lookups are for: TRAIN inserts and keeps gradients, EVAL/INFERENCE never insert."""

    TRAIN = "train"
    EVAL = "eval"
    INFERENCE = "inference"


def _tensor(array: np.ndarray, device: torch.device, dtype: np.dtype | None = None) -> torch.Tensor:
    """A numpy array (possibly read-only) as a tensor on ``device``, in ``dtype`` (given:
    the signature's, see :meth:`EmbeddingCtx.non_id_dtypes`), else float64 becomes float32
    and other dtypes stay (:func:`model_dtype`, the rule serving follows too)."""
    dtype = model_dtype(array.dtype) if dtype is None else dtype
    tensor = torch.from_numpy(np.array(array, dtype=dtype, copy=True))
    return tensor.to(device, non_blocking=True)


def _device(device_id: int | None) -> torch.device:
    """The dense model's device: ``cuda:<device_id>``, or CPU for None. A GPU that does not
    exist is refused here, with the count: torch would only fail at the first tensor moved
    there ("invalid device ordinal"), and a torchrun job with more ranks per node than GPUs
    (device_id = LOCAL_RANK) would fail that way in some of its ranks only."""
    if device_id is None:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise InvalidArgumentError(f"device_id={device_id} given but CUDA is not available")
    count = torch.cuda.device_count()
    if not 0 <= device_id < count:
        raise InvalidArgumentError(
            f"device_id={device_id} but this machine has {count} CUDA device(s) "
            f"(0..{count - 1}, as CUDA_VISIBLE_DEVICES shows them): one GPU per NN worker, so "
            f"run at most {count} worker(s) per node (recserve train --nproc-per-node)"
        )
    return torch.device("cuda", device_id)


def _worker_addresses(embedding_workers: Sequence[str] | None) -> tuple[Sequence[str], str]:
    """The embedding workers' addresses (``embedding_workers``, else those in
    :data:`EMBEDDING_WORKERS_ENV`; none: the in-process tier) and where they came from."""
    if embedding_workers is not None:
        return embedding_workers, "embedding_workers"
    from_env = os.environ.get(EMBEDDING_WORKERS_ENV, "")
    return [a for a in from_env.split(",") if a.strip()], EMBEDDING_WORKERS_ENV


def _ranks_per_worker(addresses: Sequence[str], world_size: int) -> dict[str, int]:
    """How many ranks of ``world_size`` share each embedding worker, by address, when rank r
    talks to ``addresses[r % len(addresses)]`` (:func:`make_embedding_tier`; an address
    listed twice is one worker). In rank order of their first rank."""
    counts: dict[str, int] = {}
    for rank in range(world_size):
        address = addresses[rank % len(addresses)].strip()
        counts[address] = counts.get(address, 0) + 1
    return counts


def _forward_buffer_problem(
    staleness: int, sharing: int, address: str, buffered: int, where: str
) -> str | None:
    """Why an embedding worker keeping ``buffered`` forward contexts (``where`` says whose
    number that is) for ``sharing`` ranks (at ``address``) cannot hold ``staleness`` lookups
    per rank waiting for their gradients; None when it can."""
    if staleness * sharing <= buffered:
        return None
    if sharing == 1:
        return (
            f"embedding_staleness {staleness} is above the embedding worker's "
            f"forward_buffer_size {buffered} ({where}): lookups would expire before "
            "their gradients come back; lower embedding_staleness or raise "
            "forward_buffer_size"
        )
    return (
        f"embedding_staleness {staleness} x {sharing} ranks sharing embedding worker "
        f"{address} = {staleness * sharing} lookups waiting for their gradients, above "
        f"its forward_buffer_size {buffered} ({where}), one buffer for all its ranks: "
        "lookups would expire before their gradients come back; lower "
        "embedding_staleness, raise forward_buffer_size or give more embedding workers"
    )


def make_embedding_tier(
    embedding_config: EmbeddingConfig,
    global_config: GlobalConfig,
    embedding_workers: Sequence[str] | None,
    *,
    read_only: bool = False,
) -> EmbeddingTier:
    """The embedding tier: remote when worker addresses are given (or in the environment),
    else in-process (the embedded default)."""
    embedding_workers, source = _worker_addresses(embedding_workers)
    for address in embedding_workers:
        # As `recserve train --embedding-workers` checks it: gRPC would take the scheme for
        # a host name and fail only after wait_for_serving's two minutes.
        problem = grpc_address_problem(address.strip())
        if problem:
            raise InvalidArgumentError(f"{source}: {problem}")
    if embedding_workers:
        from embedding_store.worker_client import RemoteEmbeddingWorker

        # Each NN worker talks to one embedding worker, spread by rank.
        address = embedding_workers[distributed.rank() % len(embedding_workers)]
        client = RemoteEmbeddingWorker(
            address.strip(), embedding_config, retry_seconds=TIER_RETRY_SECONDS
        )
        client.wait_for_serving(timeout=120)
        # Built with a config, so its embedding_config is not None as EmbeddingTier wants (the
        # class also takes None, for admin clients that need no config).
        return cast(EmbeddingTier, client)
    if distributed.world_size() > 1:
        raise FailedPreconditionError(
            "WORLD_SIZE > 1 needs one shared embedding tier: pass embedding_workers or set "
            f"{EMBEDDING_WORKERS_ENV} (the embedded tier is per process)"
        )
    ps = global_config.embedding_parameter_server_config
    return InProcessEmbeddingTier(
        embedding_config,
        capacity=ps.capacity,
        read_only=read_only,
        forward_buffer_size=global_config.embedding_worker_config.forward_buffer_size,
    )


class EmbeddingCtx:
    """Looks embeddings up for batches and runs the dense model on them.

    ``model`` takes ``(non_id_tensors: List[Tensor], embedding_tensors: List[Tensor])``.
    With no ``embedding_tier`` and no worker addresses, the tier runs in-process.
    """

    def __init__(
        self,
        preprocess_mode: PreprocessMode = PreprocessMode.EVAL,
        model: torch.nn.Module | None = None,
        *,
        embedding_config: EmbeddingConfig | str | os.PathLike | None = None,
        global_config: GlobalConfig | str | os.PathLike | None = None,
        embedding_workers: Sequence[str] | None = None,
        embedding_tier: EmbeddingTier | None = None,
        device_id: int | None = None,
    ) -> None:
        self.preprocess_mode = preprocess_mode
        self.model = model
        self.embedding_config = (
            embedding_config
            if isinstance(embedding_config, EmbeddingConfig)
            else load_embedding_config(embedding_config)
        )
        self.global_config = (
            global_config
            if isinstance(global_config, GlobalConfig)
            else load_global_config(global_config)
        )
        self._embedding_workers = embedding_workers
        self._tier = embedding_tier
        self._owns_tier = embedding_tier is None
        self.device = _device(device_id)

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> EmbeddingCtx:
        if self._tier is None:
            self._tier = make_embedding_tier(
                self.embedding_config,
                self.global_config,
                self._embedding_workers,
                read_only=self.preprocess_mode is PreprocessMode.INFERENCE,
            )
        return self

    def __exit__(self, *exc: object) -> None:
        if self._owns_tier and self._tier is not None:
            self._tier.close()
            self._tier = None

    @property
    def embedding_tier(self) -> EmbeddingTier:
        if self._tier is None:
            raise FailedPreconditionError(
                f"{type(self).__name__} is not entered; use it as a context manager"
            )
        return self._tier

    # ------------------------------------------------------------------ features
    def prepare_features(
        self, batch: Batch
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """(non-ID tensors, embedding tensors, label tensors) of ``batch`` on this device.

        Embedding tensors are float32 [batch, dim] (summation slots) or [batch,
        sample_fixed_size, dim] (raw slots), in the batch's ID-feature order.
        """
        train = self.preprocess_mode is PreprocessMode.TRAIN
        result = self.embedding_tier.lookup(batch, train=train)
        self._last_lookup = result
        embeddings = [slot.embeddings.to(self.device) for slot in result.slots]
        dtypes = self.non_id_dtypes(batch)
        non_ids = [
            _tensor(f.data, self.device, dtype)
            for f, dtype in zip(batch.non_id_type_features, dtypes, strict=True)
        ]
        labels = [_tensor(label.data, self.device) for label in batch.labels]
        return non_ids, embeddings, labels

    def non_id_dtypes(self, batch: Batch) -> Sequence[np.dtype | None]:
        """The dtype each non-ID feature of ``batch`` reaches the dense model in (None: its
        own, by :func:`model_dtype`). :class:`TrainCtx` gives its recorded signature's, so a
        later batch that sends an integer feature as whole floats (a pandas column with a
        missing value becomes float64) trains on the integers its first batches had."""
        return [None] * len(batch.non_id_type_features)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Model output for ``batch`` (the dense model's shape, e.g. float32 [batch, 1]) and
        its label tensors ([batch, ...] each, in their own dtype; float64 becomes float32); no
        gradients outside TrainCtx.

        Outside TrainCtx (whose forward trains) the model runs in eval mode, as the checkpoint's
        TorchScript model is saved and served: dropout off, batch norm on its running
        statistics. Each module's own mode is put back afterwards. (A TrainCtx leaves its
        model in training mode, and an ``eval_ctx`` sharing it would otherwise score with
        dropout: other numbers than the server gives for the same rows, and different ones
        on every call.)"""
        if self.model is None:
            raise FailedPreconditionError(f"{type(self).__name__} was created without a model")
        non_ids, embeddings, labels = self.prepare_features(batch)
        with torch.no_grad(), _eval_mode(self.model):
            output = self.model(non_ids, embeddings)
        return output, labels


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """``model`` in eval mode for the block; then each module's own mode as it was (not the
    root's with ``train(mode)``, which would also switch a part kept in eval mode, such as a
    frozen layer, to training)."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


class _SharedEvalCtx(EmbeddingCtx):
    """What :func:`eval_ctx` returns: an EVAL context that holds batches to the feature
    signature ``source`` records (a TrainCtx's, once its first batch went through), as
    training and serving do: the same features in the same order, and each non-ID feature
    in the dtype the model was trained on (a later batch's integer feature sent as whole
    floats, e.g. a pandas column with a missing value, reached the model as float32, which
    an ``nn.Embedding`` refuses and anything else takes for other numbers)."""

    def __init__(self, source: EmbeddingCtx, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._source = source
        self._synced_step: int | None = None  # the source's step its updates were waited at

    def _wait_for_training(self) -> None:
        """Let every embedding update a TrainCtx ``source`` queued land before a lookup: an
        evaluation during training sees all that the loop trained, not the rows of up to
        ``embedding_staleness`` batches ago. Waited once per training step (a remote tier's
        flush is a call), so scoring many batches between two steps waits once."""
        wait = getattr(self._source, "wait_for_embedding_updates", None)
        step = getattr(self._source, "step", None)
        if callable(wait) and (step is None or step != self._synced_step):
            wait()
            self._synced_step = step

    def _signature(self) -> FeatureSignature | None:
        signature = getattr(self._source, "signature", None)
        return signature if isinstance(signature, FeatureSignature) else None

    def prepare_features(
        self, batch: Batch
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        signature = self._signature()
        if signature is not None:
            signature.check(batch)  # also its dtypes: 3.5 for an integer feature is refused
        self._wait_for_training()
        return super().prepare_features(batch)

    def non_id_dtypes(self, batch: Batch) -> Sequence[np.dtype | None]:
        signature = self._signature()
        return super().non_id_dtypes(batch) if signature is None else signature.model_dtypes


def eval_ctx(ctx: EmbeddingCtx, model: torch.nn.Module | None = None) -> EmbeddingCtx:
    """An EVAL context sharing ``ctx``'s embedding tier and model.

    It never re-configures the tier: entering evaluation in the middle of training keeps the
    embedding optimizer and its hyperparameters (a PERSIA bug reset them). Batches are held
    to the feature signature of a TrainCtx ``ctx`` as its training batches are (names,
    order, and integer features converted to their trained dtype).

    With a TrainCtx ``ctx`` it waits for the embedding updates its training queued
    (:meth:`TrainCtx.wait_for_embedding_updates`) before its first lookup and again before
    the first one after each later training step: it scores with every update this process
    made, whatever ``embedding_staleness`` is. (Under DDP each rank waits for its own updates;
    the other ranks' land within their own staleness bound.)
    """
    shared = _SharedEvalCtx(
        ctx,
        PreprocessMode.EVAL,
        model if model is not None else _unwrap(ctx.model),
        embedding_config=ctx.embedding_config,
        global_config=ctx.global_config,
        embedding_tier=ctx.embedding_tier,
    )
    shared.device = ctx.device
    return shared


def _global_config_source(given: GlobalConfig | str | os.PathLike | None) -> str:
    """What an error about the global config names: its file, or how it was given."""
    if isinstance(given, GlobalConfig):
        return "global_config (a GlobalConfig object)"
    path = given if given is not None else os.environ.get(GLOBAL_CONFIG_ENV)
    return str(path) if path else "the default global config"


@overload
def _unwrap(model: torch.nn.Module) -> torch.nn.Module: ...
@overload
def _unwrap(model: None) -> None: ...
def _unwrap(model: torch.nn.Module | None) -> torch.nn.Module | None:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _grads_finite(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every gradient of ``optimizer``'s parameters is finite (None counts as
    finite)."""
    flags = [
        torch.isfinite(p.grad.coalesce().values() if p.grad.is_sparse else p.grad).all()
        for group in optimizer.param_groups
        for p in group["params"]
        if p.grad is not None
    ]
    return not flags or bool(torch.stack(flags).all())


def _embedding_gradients(
    names: Sequence[str], leaves: Sequence[torch.Tensor], scale: float
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The embedding gradients for the tier, by slot name: float32 on CPU, in each leaf's
    shape, divided by the loss ``scale`` (1.0 without mixed precision); and all of them
    flattened into one float32 tensor (for one finiteness check). A slot the loss does not
    use has no gradient and no entry (its rows stay put).

    They come off the GPU in one copy: ``.cpu()`` per slot would wait for the GPU once per
    slot."""
    used = [(name, leaf.grad) for name, leaf in zip(names, leaves) if leaf.grad is not None]
    if not used:
        return {}, torch.zeros(0)
    flat = torch.cat([(grad.float() / scale).reshape(-1) for _, grad in used]).cpu()
    parts = flat.split([grad.numel() for _, grad in used])
    return {name: part.view(grad.shape) for (name, grad), part in zip(used, parts)}, flat


#: The TrainCtx counters of skipped non-finite steps: run totals, kept in a checkpoint's
#: ``train_state`` under these names and continued from by ``load_checkpoint``.
NONFINITE_COUNTERS = ("nonfinite_embedding_steps", "nonfinite_dense_steps")


def _warn_skipped(what: str, count: int, step: int) -> None:
    """Log a skipped non-finite step: the 1st, 2nd, 4th, 8th, ... (a broken data set makes
    every step non-finite, and one line per step would bury the rest of the log)."""
    if count & (count - 1) == 0:
        log.warning(
            "step %d: non-finite gradients (NaN or Inf: check the batch's labels and "
            "features), its %s was skipped (%d skipped so far)",
            step,
            what,
            count,
        )


def _qualified(value: object) -> str:
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"


def _check_optimizers(embedding_optimizer: object, dense_optimizer: object) -> None:
    """TrainCtx's two optimizers, each of its own kind: both libraries name one ``Adam``, so
    a swap or a torch optimizer for the embeddings is easy to write and, unchecked, fails
    late (at the tier's configure, or at the first step) with a message naming neither."""
    if not isinstance(embedding_optimizer, (SGD, Adagrad, Adam)):
        hint = (
            " (a torch optimizer is the dense one, TrainCtx's second argument)"
            if isinstance(embedding_optimizer, torch.optim.Optimizer)
            else ""
        )
        raise InvalidArgumentError(
            "TrainCtx's first argument, the embedding optimizer, must be SGD, Adagrad or Adam "
            f"from embedding_store.optimizers, got {_qualified(embedding_optimizer)}{hint}"
        )
    if not isinstance(dense_optimizer, torch.optim.Optimizer):
        hint = (
            " (embedding_store.optimizers' optimizers are for the embeddings, TrainCtx's "
            "first argument)"
            if isinstance(dense_optimizer, (SGD, Adagrad, Adam))
            else ""
        )
        raise InvalidArgumentError(
            "TrainCtx's second argument, the dense optimizer, must be a torch.optim.Optimizer "
            f"over the model's parameters, got {_qualified(dense_optimizer)}{hint}"
        )


def _check_dense_optimizer_is_the_models(
    dense_optimizer: torch.optim.Optimizer, model: torch.nn.Module
) -> None:
    """InvalidArgumentError when the dense optimizer holds none of ``model``'s parameters
    (made over another instance of the model, say): every step then stepped parameters
    without gradients, and the dense model never trained, without a word. (It may hold
    parameters of its own besides the model's, a learned loss weight for one.)"""
    own = {id(p) for p in model.parameters()}
    held = [p for group in dense_optimizer.param_groups for p in group["params"]]
    if own and not any(id(p) in own for p in held):
        raise InvalidArgumentError(
            "TrainCtx's dense optimizer holds none of the model's parameters (made over "
            "another model instance?): the dense model would never train; make it over "
            "model.parameters()"
        )


def _check_clip_norm(value: object, model: torch.nn.Module) -> float | None:
    """TrainCtx's ``dense_grad_clip_norm`` as a float (None: no clipping), or
    InvalidArgumentError naming it: a positive finite number. Also refused with a model
    whose own embedding layers make sparse gradients (``sparse=True``), which torch's
    ``clip_grad_norm_`` cannot take: it failed at the first step, deep in torch."""
    if value is None:
        return None
    number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    if number is None or not (math.isfinite(number) and number > 0):
        raise InvalidArgumentError(
            "dense_grad_clip_norm must be a positive finite number (the largest L2 norm of "
            f"the dense gradients) or None for no clipping, got {value!r}"
        )
    sparse = [
        name
        for name, module in model.named_modules()
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse
    ]
    if sparse:
        raise InvalidArgumentError(
            f"dense_grad_clip_norm: the model's {sparse[0]!r} makes sparse gradients "
            "(sparse=True), which torch's clip_grad_norm_ cannot clip; drop sparse=True or "
            "the clipping"
        )
    return float(number)


class TrainCtx(EmbeddingCtx):
    """Hybrid training: synchronous dense updates, asynchronous embedding updates.

    ``embedding_optimizer`` (SGD/Adagrad/Adam from ``embedding_store.optimizers``) is applied
    on the parameter servers; ``dense_optimizer`` is a torch optimizer over ``model``'s
    parameters. ``mixed_precision`` uses torch.amp (fp16 autocast) with a GradScaler on
    CUDA and is ignored on CPU, which trains in fp32. ``device_id``: the GPU of the dense
    model (LOCAL_RANK under torchrun, one GPU per rank), made the current CUDA device on
    enter; None trains on CPU. With a GPU the default DDP backend is nccl, else gloo.

    A step whose gradients are not finite (a NaN label or feature, an overflowing loss) moves
    nothing it would corrupt for good: its embedding update is skipped (counted in
    ``nonfinite_embedding_steps``) and, without mixed precision, so is its dense step when
    the dense gradients are not finite (``nonfinite_dense_steps``). Both are checked every
    ``finite_check_every`` steps; the dense gradients are the allreduced ones, so every DDP
    rank skips the same steps. With mixed precision the GradScaler checks the dense
    gradients every step and a step it skips sends no embedding gradients either; embedding
    gradients that are not finite on a checked step skip the whole step on every rank and
    back the loss scale off (see :meth:`_amp_step`).

    ``dense_grad_clip_norm``: clip the dense gradients to this joint L2 norm before each
    dense step (``torch.nn.utils.clip_grad_norm_`` over the dense optimizer's parameters;
    None, the default, clips nothing). It applies to the gradients the step would use: after
    the non-finite check, unscaled first with mixed precision (torch's GradScaler recipe),
    and under DDP after the allreduce, so every rank clips the same averaged gradients
    alike. The embedding gradients are not clipped, as in PERSIA: each batch's go to the
    embedding tier's own optimizer, row by row and asynchronously, and a norm over one
    batch's rows would scale a row's update by whatever else that batch held. It may be
    changed between steps (``ctx.dense_grad_clip_norm = 0.5``, or None), checked as here.
    ``last_dense_grad_norm`` (read-only, to log): the joint L2 norm of the dense gradients
    before clipping at the last step that clipped them, a float (inf or NaN for a mixed
    precision step the GradScaler then skipped); None before the first such step.
    """

    model: torch.nn.Module  # required here (EmbeddingCtx's is optional)

    @property
    def dense_grad_clip_norm(self) -> float | None:
        """The joint L2 norm the dense gradients are clipped to (None: no clipping)."""
        return self._dense_grad_clip_norm

    @dense_grad_clip_norm.setter
    def dense_grad_clip_norm(self, value: float | None) -> None:
        # Checked as the constructor checks it: set later, a value went to clip_grad_norm_
        # unchecked (a NaN limit made every dense gradient NaN, a negative one reversed
        # them: the step climbed the loss).
        self._dense_grad_clip_norm = _check_clip_norm(value, self.model)

    @property
    def last_dense_grad_norm(self) -> float | None:
        """The joint L2 norm of the dense gradients before clipping, at the last step that
        clipped them (what ``clip_grad_norm_`` returned); None before the first. A mixed
        precision step whose gradients overflowed reads inf or NaN (the GradScaler skipped
        it). Read on demand: kept as a tensor, so steps wait on no device-to-host copy."""
        norm = self._last_dense_grad_norm
        return None if norm is None else float(norm)

    def __init__(
        self,
        embedding_optimizer: Optimizer,
        dense_optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        *,
        device_id: int | None = None,
        mixed_precision: bool = True,
        embedding_staleness: int = 10,
        backward_buffer_size: int = 10,
        backward_workers_size: int = 1,
        distributed_option: DDPOption | None = None,
        embedding_workers: Sequence[str] | None = None,
        embedding_tier: EmbeddingTier | None = None,
        embedding_config: EmbeddingConfig | str | os.PathLike | None = None,
        global_config: GlobalConfig | str | os.PathLike | None = None,
        initialization: InitializationConfig | None = None,
        finite_check_every: int = 1,
        dense_grad_clip_norm: float | None = None,
    ) -> None:
        _check_optimizers(embedding_optimizer, dense_optimizer)
        _check_dense_optimizer_is_the_models(dense_optimizer, model)
        clip_norm = _check_clip_norm(dense_grad_clip_norm, model)
        super().__init__(
            PreprocessMode.TRAIN,
            model,
            embedding_config=embedding_config,
            global_config=global_config,
            embedding_workers=embedding_workers,
            embedding_tier=embedding_tier,
            device_id=device_id,
        )
        if self.global_config.common_config.job_type is not JobType.TRAIN:
            # An Infer config (read-only lookups) would train and publish a checkpoint anyway.
            raise ConfigError(
                f"{_global_config_source(global_config)}: common_config.job_type: TrainCtx "
                f"trains, got {self.global_config.common_config.job_type.value!r} (read-only "
                "lookups, for serving): use 'Train'"
            )
        if embedding_staleness < 1:
            raise InvalidArgumentError(
                f"embedding_staleness must be >= 1, got {embedding_staleness}"
            )
        self._check_forward_buffer(
            embedding_staleness, embedding_tier, embedding_workers, global_config
        )
        if backward_buffer_size < 1 or backward_workers_size < 1:
            raise InvalidArgumentError(
                "backward_buffer_size and backward_workers_size must be >= 1"
            )
        self.embedding_optimizer = embedding_optimizer
        self.dense_optimizer = dense_optimizer
        self.initialization = initialization
        self.embedding_staleness = embedding_staleness
        self.distributed_option = distributed_option or DDPOption(
            backend="nccl" if device_id is not None else "gloo"
        )
        self.mixed_precision = mixed_precision and self.device.type == "cuda"
        self.finite_check_every = max(1, finite_check_every)
        self._dense_grad_clip_norm = clip_norm  # checked above, before any connection
        self._last_dense_grad_norm: torch.Tensor | None = None
        self.grad_scaler = torch.amp.GradScaler("cuda", enabled=self.mixed_precision)
        self._in_flight = threading.BoundedSemaphore(embedding_staleness)
        self._backward_queue: queue.Queue = queue.Queue(maxsize=backward_buffer_size)
        self._backward_workers: list[threading.Thread] = []
        self._backward_workers_size = backward_workers_size
        self._backward_error: BaseException | None = None
        self._stopping = False  # leaving on an exception: queued updates are dropped
        self._pending: tuple[int, list[str], list[torch.Tensor]] | None = None
        # The embedding leaves of the last forward() left without backward(): a loss that
        # reaches them (gradient accumulation over several forwards) is refused.
        self._abandoned: list[torch.Tensor] = []
        # The checkpoint a load_checkpoint() read while the last forward() waited for its
        # backward(): that backward is refused (see _forget_forward_before_load).
        self._loaded_since_forward: str | None = None
        self.step = 0
        self.signature: FeatureSignature | None = None  # recorded from the first batch
        self.nonfinite_embedding_steps = 0
        self.nonfinite_dense_steps = 0
        self.distributed = False

    def _check_forward_buffer(
        self,
        staleness: int,
        tier: EmbeddingTier | None,
        embedding_workers: Sequence[str] | None,
        global_config: GlobalConfig | str | os.PathLike | None,
    ) -> None:
        """InvalidArgumentError unless the embedding worker keeps the forward contexts of
        every lookup still waiting for its gradients: up to ``staleness`` per rank, times
        the ranks that share the worker. Its buffer is one FIFO of ``forward_buffer_size``
        contexts for all its callers, and the backward of one that expired failed the run,
        depending on timing. The ranks sharing one are counted as :func:`make_embedding_tier`
        spreads them (rank % number of addresses); a tier given here is checked for this
        rank alone (who else holds it cannot be told), an in-process one is this rank's.

        Checked here against the global config's ``embedding_worker_config`` (every rank
        alike, before any connection), and on enter against the number a remote worker
        reports (:meth:`_check_reported_forward_buffer`), which is the one that counts."""
        self._ranks_sharing: dict[str, int] = {}
        if isinstance(tier, InProcessEmbeddingTier):
            buffered, where = tier.worker.forward_buffer_size, "the given tier"
        else:
            buffered = self.global_config.embedding_worker_config.forward_buffer_size
            where = f"embedding_worker_config in {_global_config_source(global_config)}"
            addresses = _worker_addresses(embedding_workers)[0] if tier is None else ()
            if addresses:
                self._ranks_sharing = _ranks_per_worker(addresses, distributed.world_size())
        sharing, address = 1, ""
        if self._ranks_sharing:  # the busiest worker (the first of them)
            address = max(self._ranks_sharing, key=self._ranks_sharing.__getitem__)
            sharing = self._ranks_sharing[address]
        problem = _forward_buffer_problem(staleness, sharing, address, buffered, where)
        if problem is not None:
            raise InvalidArgumentError(problem)

    def _check_reported_forward_buffer(self) -> None:
        """:meth:`_check_forward_buffer` against the forward_buffer_size this rank's
        embedding worker reports (its own config, which the trainer's global config need
        not match), for the ranks that share it; nothing for a worker that predates the
        report (0), the global config's number was checked."""
        tier = cast(Any, self.embedding_tier)  # a RemoteEmbeddingWorker: status(partial=)
        address = str(tier.address)
        # partial: a shard away at the start fails this run's lookups that need it, not this.
        reported = tier.status(partial=True).forward_buffer_size
        if not reported:
            return
        sharing = self._ranks_sharing.get(address.strip(), 1)
        where = f"as embedding worker {address} reports it"
        problem = _forward_buffer_problem(
            self.embedding_staleness, sharing, address, reported, where
        )
        if problem is not None:
            raise InvalidArgumentError(problem)

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> TrainCtx:
        self.distributed = distributed.init_distributed(self.distributed_option, self.device)
        self.model.to(self.device)
        if self.distributed:
            self.model = torch.nn.parallel.DistributedDataParallel(
                self.model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                find_unused_parameters=self.distributed_option.find_unused_parameters,
            )
        super().__enter__()
        if self._ranks_sharing:  # a worker this ctx connected to from its address
            try:
                self._check_reported_forward_buffer()
            except BaseException:
                EmbeddingCtx.__exit__(self)  # closes the tier it made
                raise
        self.embedding_tier.configure(
            optimizer=self.embedding_optimizer, initialization=self.initialization
        )
        self._warn_if_tier_holds_rows()
        self._stopping = False
        for index in range(self._backward_workers_size):
            thread = threading.Thread(
                target=self._backward_loop, name=f"embedding-backward-{index}", daemon=True
            )
            thread.start()
            self._backward_workers.append(thread)
        return self

    def _warn_if_tier_holds_rows(self) -> None:
        """A long-lived remote tier keeps the rows (and optimizer state) of earlier runs: a
        run that means to start fresh would silently continue from them."""
        if isinstance(self.embedding_tier, InProcessEmbeddingTier) or distributed.rank() != 0:
            return
        rows = sum(self.embedding_tier.status().rows_per_shard)
        if rows:
            # The command as it is typed: the worker's address is a required flag of it.
            address = getattr(self.embedding_tier, "address", None)
            worker = f" --worker {address}" if isinstance(address, str) else ""
            log.warning(
                "the embedding tier already holds %d rows (an earlier run's?): training "
                "continues from them and their optimizer state unless a checkpoint is loaded; "
                "for a fresh start run `recserve embedding-tier clear%s` first",
                rows,
                worker,
            )

    def __exit__(self, *exc: object) -> None:
        exc_type = exc[0] if exc else None
        if isinstance(exc_type, type):
            self._stop_after_failure(exc_type)
            return
        try:
            self.wait_for_embedding_updates()
        finally:
            for _ in self._backward_workers:
                self._backward_queue.put(None)
            for thread in self._backward_workers:
                thread.join(timeout=30)
            self._backward_workers.clear()
            super().__exit__(*exc)

    def _stop_after_failure(self, exc_type: type) -> None:
        """Leave on an exception (a failed tier call, a loader gone, Ctrl-C) without applying
        the embedding updates still queued: each is a tier call with its own deadline and
        retries (30 s for a worker that cannot be reached), so waiting for them held a failed
        run up for minutes, and their own error then replaced the one that stopped it."""
        self._stopping = True
        dropped = 0
        while True:
            try:
                item = self._backward_queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                dropped += 1
                self._in_flight.release()
            self._backward_queue.task_done()
        if dropped:
            log.warning(
                "training stopped (%s): %d queued embedding update(s) not applied",
                exc_type.__name__,
                dropped,
            )
        for _ in self._backward_workers:
            try:
                self._backward_queue.put_nowait(None)
            except queue.Full:  # workers busy in a tier call: daemon threads, left behind
                break
        workers, self._backward_workers = self._backward_workers, []
        # Closing the tier ends a call under way (a closed channel fails it at once).
        super().__exit__(exc_type)
        for thread in workers:
            thread.join(timeout=_STOP_JOIN_SECONDS)

    @property
    def dense_model(self) -> torch.nn.Module:
        """The model without its DDP wrapper."""
        return _unwrap(self.model)

    # ------------------------------------------------------------------ training step
    def prepare_features(
        self, batch: Batch
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """(non-ID tensors, embedding leaves, label tensors) of a training batch: as
        :meth:`EmbeddingCtx.prepare_features`, the embeddings (float32 [batch, dim] or
        [batch, sample_fixed_size, dim]) detached leaves whose gradients :meth:`backward`
        sends to the embedding tier. Waits while ``embedding_staleness`` batches are
        unapplied."""
        if not batch.requires_grad:
            raise InvalidArgumentError(
                "TrainCtx needs batches with labels and requires_grad=True; "
                "use eval_ctx(ctx) to score unlabeled batches"
            )
        self._raise_backward_error()
        self._loaded_since_forward = None
        if self.signature is not None:
            # Also its dtypes: a float for an integer feature only as a whole number in
            # range, converted to the recorded dtype (non_id_dtypes), never cut (3.7 -> 3).
            self.signature.check(batch)
        if self._pending is not None:
            # A forward without backward: give its slot back before waiting for one (with
            # embedding_staleness=1 its slot is the only one, and the wait never ended).
            self._abandoned = self._pending[2]
            for leaf in self._abandoned:  # so that a gradient found there is the next loss's
                leaf.grad = None
            # ... and its context on the worker, which otherwise waited there until it
            # expired (counted in expired_forward_contexts, and taking a buffer place other
            # ranks sharing the worker need): at once in process, with the next lookup over
            # the wire (no call of its own). Tiers without the method keep it until then.
            drop = getattr(self.embedding_tier, "drop_forward_contexts", None)
            if drop is not None:
                drop([self._pending[0]])
            self._pending = None
            self._in_flight.release()
        self._in_flight.acquire()  # bounded staleness: wait for old embedding updates
        try:
            non_ids, embeddings, labels = super().prepare_features(batch)
        except BaseException:
            self._in_flight.release()
            raise
        if self.signature is None:  # the first batch the tier took: one it refused (a slot
            self.signature = FeatureSignature.from_batch(batch)  # name typo) sets nothing
        leaves = [e.detach().requires_grad_(True) for e in embeddings]
        names = [slot.name for slot in self._last_lookup.slots]
        ref = self._last_lookup.ref
        assert ref is not None  # a train lookup always keeps its context (LookupResult.ref)
        self._pending = (ref, names, leaves)
        return non_ids, leaves, labels

    def non_id_dtypes(self, batch: Batch) -> Sequence[np.dtype | None]:
        """The recorded signature's dtypes (checked by :meth:`prepare_features`), or each
        feature's own before the first batch set the signature."""
        if self.signature is None:
            return super().non_id_dtypes(batch)
        return self.signature.model_dtypes

    def forward(self, batch: Batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Model output (with autograd; the dense model's shape, e.g. float32 [batch, 1]) and
        the label tensors (one per label, [batch, ...], in the label's own dtype: float64
        becomes float32, integer class labels stay integers) of one training batch."""
        if not self.dense_model.training:  # under DDP, eval() may be the wrapped model's
            # Only a model switched to eval as a whole (for an evaluation) is switched back: a
            # part its trainer keeps in eval mode (a frozen batch norm, a frozen dropout)
            # stays so, as the checkpoint's TorchScript model keeps it.
            self.model.train()
        non_ids, embeddings, labels = self.prepare_features(batch)
        with torch.autocast(
            device_type=self.device.type, dtype=torch.float16, enabled=self.mixed_precision
        ):
            output = self.model(non_ids, embeddings)
        return output, labels

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Backpropagate ``loss``: step the dense optimizer (grads allreduced by DDP, then
        clipped to ``dense_grad_clip_norm`` when set) and queue the embedding gradients for
        the embedding tier. Returns the (scaled) loss.

        One backward per forward: ``loss`` comes from the last :meth:`forward`'s output (a
        forward left without backward is dropped at the next one; a loss that still uses its
        output raises FailedPreconditionError, with nothing applied)."""
        if not self._backward_workers:
            # Outside the context nothing applies the queued gradients: the wait for them
            # (at once with embedding_staleness=1) never ended.
            raise FailedPreconditionError("TrainCtx is not entered; use it as a context manager")
        if self._pending is None:
            loaded, self._loaded_since_forward = self._loaded_since_forward, None
            if loaded is not None:
                raise FailedPreconditionError(
                    f"backward(): the last forward() was taken before load_checkpoint({loaded}) "
                    "replaced the dense weights and embedding rows it used: its gradients "
                    "belong to the old ones; nothing was applied (call forward() on the "
                    "batch again)"
                )
            raise FailedPreconditionError("backward() called without a forward() before it")
        ref, names, leaves = self._pending
        self._pending = None
        abandoned, self._abandoned = self._abandoned, []
        scaled = self.grad_scaler.scale(loss)
        try:
            scaled.backward()
            if any(leaf.grad is not None for leaf in abandoned):
                # Its embedding gradients have no batch to go to (its slot and context were
                # given up at the next forward): they were dropped without a word.
                self.dense_optimizer.zero_grad(set_to_none=True)
                raise FailedPreconditionError(
                    "backward(): the loss depends on the output of an earlier forward() than "
                    "the last one; one backward() per forward() (accumulating a loss over "
                    "several forwards would drop all but the last batch's embedding "
                    "gradients): nothing was applied"
                )
            scale = self.grad_scaler.get_scale() if self.mixed_precision else 1.0
            check = self.step % self.finite_check_every == 0
            grads, flat = _embedding_gradients(names, leaves, scale)
            finite = not check or bool(torch.isfinite(flat).all())
            if self.mixed_precision:
                finite = self._amp_step(finite, check, scale)
            elif not check or _grads_finite(self.dense_optimizer):
                self._clip_dense_gradients()
                self.grad_scaler.step(self.dense_optimizer)  # disabled: a plain step()
            else:
                # fp32 has no GradScaler to skip it: one NaN step would make every dense
                # weight NaN, and every later step's loss and embedding gradients with it.
                self.nonfinite_dense_steps += 1
                _warn_skipped("dense step", self.nonfinite_dense_steps, self.step)
            self.dense_optimizer.zero_grad(set_to_none=True)
        except BaseException:
            self._in_flight.release()
            raise
        self.step += 1
        if not finite:
            # Skip this batch's embedding update: no gradients just drop the lookup's context
            # (no row moves). The GradScaler already backed off its scale.
            self.nonfinite_embedding_steps += 1
            if not self.mixed_precision:  # fp16 overflows while the loss scale backs off
                _warn_skipped("embedding update", self.nonfinite_embedding_steps, self.step - 1)
            self._backward_queue.put((ref, {}))
        else:
            self._backward_queue.put((ref, grads))
        if self.embedding_staleness == 1:
            self.wait_for_embedding_updates()
        return scaled

    def _amp_step(self, finite: bool, check: bool, scale: float) -> bool:
        """The mixed-precision dense step and loss-scale update; whether this step's
        embedding gradients may go to the tier.

        ``finite``: whether this rank's embedding gradients were finite (True when not
        checked). The GradScaler sees only the dense gradients: when it finds Inf/NaN there
        (fp16 overflow, the usual first steps while the scale comes down from 65536) it
        skips the dense step, and the embedding gradients of that backward are not sent
        either, checked or not (they overflowed with it, or are scaled by a scale that was
        too large). When only the embedding gradients overflow, the whole step is skipped
        and the scale backed off as the GradScaler would: on every DDP rank alike (an
        all-reduce of the flag), or the ranks would go on with different scales and their
        averaged dense gradients be unscaled wrongly."""
        if check:
            finite = distributed.all_agree(finite)
        if not finite:  # no dense step; the scale as update() leaves it after an overflow:
            state = self.grad_scaler.state_dict()  # backed off, the growth count back to 0
            state.update(scale=scale * state["backoff_factor"], _growth_tracker=0)
            self.grad_scaler.load_state_dict(state)
            return False
        if self.dense_grad_clip_norm is not None:
            # torch's recipe: clip the true gradients, not the scaled ones. step() then skips
            # the step when unscale_ found Inf/NaN, as it would have found it itself.
            self.grad_scaler.unscale_(self.dense_optimizer)
            self._clip_dense_gradients()
        self.grad_scaler.step(self.dense_optimizer)
        self.grad_scaler.update()
        # update() backs the scale off exactly when step() found Inf/NaN and skipped.
        return self.grad_scaler.get_scale() >= scale

    def _clip_dense_gradients(self) -> None:
        """Scale the dense optimizer's gradients (unscaled, and under DDP already averaged
        over the ranks: every rank clips alike) down so that their joint L2 norm is at most
        ``dense_grad_clip_norm``; nothing without it. Their norm before clipping is kept
        for :attr:`last_dense_grad_norm`. The embedding gradients are not clipped (see the
        class docstring)."""
        limit = self._dense_grad_clip_norm
        if limit is None:
            return
        params = [
            p
            for group in self.dense_optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        self._last_dense_grad_norm = torch.nn.utils.clip_grad_norm_(params, limit).detach()

    def _backward_loop(self) -> None:
        while True:
            item = self._backward_queue.get()
            try:
                if item is None:
                    return
                ref, grads = item
                self.embedding_tier.backward(ref, grads)
                # A remote tier only queues the gradients in backward(): the batch's slot is
                # given back once they are applied, or the bound would not hold. (In-process
                # tiers apply them in backward(); their flush() does nothing.)
                self.embedding_tier.flush()
            except BaseException as error:
                self._backward_error = error
                if not self._stopping:  # else a call cut short by the closed tier
                    log.error("embedding update failed: %s", error)
            finally:
                if item is not None:
                    self._in_flight.release()
                self._backward_queue.task_done()

    def _raise_backward_error(self) -> None:
        if self._backward_error is not None:
            error, self._backward_error = self._backward_error, None
            raise error

    def wait_for_embedding_updates(self) -> None:
        """Block until every queued embedding gradient has been applied on the tier."""
        self._backward_queue.join()
        if self._tier is not None:
            self._tier.flush()
        self._raise_backward_error()

    # ------------------------------------------------------------------ checkpoints
    def dump_checkpoint(
        self,
        directory: str | os.PathLike,
        *,
        with_jit_model: bool = True,
        overwrite: bool = False,
        train_state: dict[str, Any] | None = None,
    ) -> CheckpointManifest | None:
        """Write embeddings, dense.pt, jit_dense.pt, opt.pt (and scaler.pt with mixed
        precision) and a manifest (see :mod:`training.checkpoint`). Every rank must call it;
        rank 0 writes.

        ``train_state``: where the training loop is, for its own resume (e.g. ``{"epochs_done":
        3, "seed": 0}``): JSON numbers, strings, booleans or None by name, kept in the manifest
        and returned by :meth:`load_checkpoint`. The step count is kept without it, and so are
        the run's skipped non-finite steps, as ``train_state`` entries
        :data:`NONFINITE_COUNTERS` (this context's counts replace any given under those names),
        which :meth:`load_checkpoint` continues from: like ``step``, they count the whole run.

        Each rank's torch random number generators (the CPU one, and its GPU's when it
        trains on one) are kept too, as they stand when it is called, and
        :meth:`load_checkpoint` puts them back: a model that draws random numbers while
        training (dropout) resumes with the draws of the uninterrupted run.

        CheckpointError naming the tensor and its first bad value, with nothing written (a
        checkpoint already at ``directory`` stays, ``overwrite`` or not), when a dense weight
        or an embedding row went NaN or Inf: serving and resuming would refuse it."""
        from training.checkpoint import dump_checkpoint

        # First: where the loop's next draw comes from (nothing below should draw, but a
        # model's scripting or a tier's dump is not ours to vouch for).
        rng_state = self._rng_state()
        if self.signature is None:
            # Checked here, not when a server refuses the checkpoint much later.
            log.warning(
                "dumping %s before any batch went through forward(): the checkpoint has "
                "no feature signature and cannot be served (resuming it works)",
                directory,
            )
        self.wait_for_embedding_updates()
        return dump_checkpoint(
            Path(directory),
            self.dense_model,
            self.dense_optimizer,
            self.embedding_tier,
            step=self.step,
            signature=self.signature,
            with_jit_model=with_jit_model,
            overwrite=overwrite,
            grad_scaler=self.grad_scaler,
            train_state={
                **(train_state or {}),
                **{name: getattr(self, name) for name in NONFINITE_COUNTERS},
            },
            rng_state=rng_state,
        )

    def load_checkpoint(self, directory: str | os.PathLike) -> CheckpointManifest:
        """Resume from a checkpoint: dense weights and optimizer state on every rank; the
        embeddings once (rank 0) into the shared tier, the other ranks wait for it. Returns
        the manifest: ``step`` and the loop's own ``train_state`` tell where to go on.

        A torch LR scheduler is the loop's, not in the checkpoint: ``opt.pt`` gives the param
        groups back with their current ``lr``, and the scheduler goes on from there once its
        ``last_epoch`` is the number of times it had stepped (``manifest.step`` for one
        step per batch), set before its next ``step()``.

        The torch random number generators this rank had when the checkpoint was written
        (see :meth:`dump_checkpoint`) are put back; a checkpoint without them (written before
        they were kept) or from another number of ranks resumes all the same, its generators
        as the loop seeded them, with a logged note.

        A forward() still waiting for its backward() is given up: its gradients belong to
        the weights and rows the load replaces, and that backward() raises
        FailedPreconditionError naming the checkpoint, with nothing applied."""
        from training.checkpoint import load_checkpoint, read_manifest, read_rng_states

        self.wait_for_embedding_updates()
        self._forget_forward_before_load(directory)
        # No rank's late updates may land on the loaded embeddings.
        distributed.checkpoint_barrier()
        failure: BaseException | None = None
        rng_states = None
        try:
            # Read (and verified) before anything moves, as the other files are.
            rng_states = read_rng_states(read_manifest(Path(directory)))
            manifest = load_checkpoint(
                Path(directory),
                self.dense_model,
                self.dense_optimizer,
                self.embedding_tier,
                load_embeddings=distributed.rank() == 0,
                grad_scaler=self.grad_scaler,
            )
        except BaseException as error:
            failure = error
        if not distributed.checkpoint_agree(failure is None):  # all resume, or none does
            if failure is not None:
                raise failure
            raise CheckpointError(
                f"another rank failed to load checkpoint {directory}; its log has the error"
            )
        self.step = manifest.step
        for name in NONFINITE_COUNTERS:
            # Run totals like step (the warnings say "N skipped so far" next to the step);
            # 0 from a checkpoint written before they were kept.
            count = manifest.train_state.get(name)
            valid = isinstance(count, int) and not isinstance(count, bool) and count >= 0
            setattr(self, name, count if valid else 0)
        self.signature = manifest.signature or self.signature
        self._restore_rng_state(manifest, rng_states)
        return manifest

    def _forget_forward_before_load(self, directory: str | os.PathLike) -> None:
        """Give up the last forward() if it still waits for its backward(): the load
        replaces the dense weights and the embedding rows its output came from, and its
        gradients, computed against the old ones, would move the loaded ones (the rows of
        the same IDs). Its backward() is refused naming the checkpoint; its slot and its
        context on the worker are given back as for a forward left without backward (on
        every rank: each has its own, and a remote tier's load only invalidates those of
        the worker it went through)."""
        if self._pending is None:
            return
        ref, _, leaves = self._pending
        self._pending = None
        self._abandoned = leaves  # a later loss that still reaches them is refused too
        for leaf in leaves:
            leaf.grad = None
        drop = getattr(self.embedding_tier, "drop_forward_contexts", None)
        if drop is not None:
            drop([ref])
        self._in_flight.release()
        self._loaded_since_forward = os.fspath(directory)

    def _rng_state(self) -> dict[str, torch.Tensor]:
        """This rank's torch generator states by kind (``model_checkpoint.RNG_KINDS``):
        the CPU one, and its GPU's when it trains on one; uint8 [n] each, as torch gives
        them. numpy's and Python's global generators are not kept: nothing of the trainer
        draws from them (the Adult example's data order comes from seeded local ones)."""
        state = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def _restore_rng_state(
        self, manifest: CheckpointManifest, states: list[dict[str, torch.Tensor]] | None
    ) -> None:
        """Put back this rank's generator states from ``states`` (by rank; None: the
        checkpoint has none), or log why they stay as the loop seeded them."""
        rank, ranks = distributed.rank(), max(distributed.world_size(), 1)
        unchanged = (
            "the random number generators stay as this run seeded them, so a model that "
            "draws random numbers while training (dropout) draws otherwise than the "
            "uninterrupted run"
        )
        if states is None:
            if rank == 0:
                log.warning(
                    "note: checkpoint %s holds no random number generator states (written "
                    "before checkpoints kept them): %s",
                    manifest.directory,
                    unchanged,
                )
            return
        if len(states) != ranks:
            if rank == 0:
                log.warning(
                    "note: checkpoint %s holds the random number generator states of %d "
                    "rank(s), this run has %d: %s",
                    manifest.directory,
                    len(states),
                    ranks,
                    unchanged,
                )
            return
        saved = states[rank]
        for kind, current in self._rng_state().items():
            state = saved.get(kind)
            if state is None or state.numel() != current.numel():
                if state is None and kind == "cuda":
                    why = "it has none: written by a run on the CPU"
                elif state is None:
                    why = "it has none"
                else:
                    why = f"{state.numel()} bytes where this torch's take {current.numel()}"
                log.warning(
                    "note: rank %d: checkpoint %s's %s generator state was not restored (%s): %s",
                    rank,
                    manifest.directory,
                    kind,
                    why,
                    unchanged,
                )
            elif kind == "cpu":
                torch.set_rng_state(state)
            else:
                torch.cuda.set_rng_state(state, self.device)
