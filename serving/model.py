"""A loaded model version: TorchScript dense model + embedding tier + feature signature.

A :class:`LoadedModel` is immutable once warmed: hot reload builds a new one next to the old
and swaps the reference, so in-flight requests finish on the version they started with.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from embedding_store import checkpoint_load, checkpoint_manifest, model_checkpoint
from embedding_store.batch import (
    Batch,
    IDFeature,
    IDTypeFeature,
    IDTypeFeatureWithSingleID,
    NonIDTypeFeature,
)
from embedding_store.config import EmbeddingConfig
from embedding_store.errors import (
    CheckpointError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    ModelInputError,
    RecserveError,
    UnavailableError,
    error_summary,
)
from embedding_store.signature import FeatureSignature
from embedding_store.tier import EmbeddingTier, InProcessEmbeddingTier, TierStatus
from embedding_store.worker import LookupResult, SlotOutput
from serving import onednn_linear

if TYPE_CHECKING:
    from embedding_store.worker_client import RemoteEmbeddingWorker

log = logging.getLogger(__name__)

_thread_torch_threads = threading.local()


def adopt_torch_threads() -> None:
    """Give the calling thread the process's torch thread count (``torch.get_num_threads()``).

    OpenMP keeps the team size per thread, and ``torch.set_num_threads`` only sets the calling
    thread's. MKL's GEMMs (every ``nn.Linear``) started from another thread (an event loop, the
    batcher, a reload) otherwise use a team as wide as the machine, whose idle members
    spin-wait between calls: measured on 2 cores, one such thread kept a whole core busy while
    the server answered ~4k requests/s. Cheap after the first call in a thread.
    """
    wanted = torch.get_num_threads()
    if getattr(_thread_torch_threads, "count", None) != wanted:
        torch.set_num_threads(wanted)
        _thread_torch_threads.count = wanted


OUTPUT_TRANSFORMS = ("identity", "sigmoid")

#: What a dense model's error says when an index it took from its inputs is out of range:
#: torch's "index out of range in self" (nn.Embedding), "index 7 is out of bounds for
#: dimension 0 with size 3" (tensor indexing), or an IndexError the model raised itself.
_INDEX_ERROR = re.compile(r"\bIndexError\b|\bindex\b.*\bout of (range|bounds)\b", re.IGNORECASE)

#: The integer inputs a ModelInputError names at most.
_NAMED_INPUTS = 8
FALLBACK_POLICIES = ("fail", "default")


@dataclass(frozen=True)
class InferenceOutput:
    """Predictions float32 [batch, 1] and how the embeddings were obtained.

    ``unknown_ids``: ID occurrences the tier did not hold (:attr:`LookupResult.unknown_ids`);
    ``unknown_per_sample``: the same split by sample, int64 [batch], or None where the tier
    could not split it (:attr:`LookupResult.unknown_per_sample`)."""

    predictions: np.ndarray
    unknown_ids: int
    fallback_ids: int
    lookup_seconds: float
    compute_seconds: float
    unknown_per_sample: np.ndarray | None = None


class LoadedModel:
    """One servable version. ``version`` names the (dense, embedding snapshot) pair."""

    def __init__(
        self,
        *,
        name: str,
        manifest: model_checkpoint.CheckpointManifest,
        signature: FeatureSignature,
        embedding_config: EmbeddingConfig,
        dense: torch.jit.ScriptModule,
        tier: EmbeddingTier,
        owns_tier: bool,
        output_transform: str = "identity",
        fallback_policy: str = "fail",
        embedding_version: str = "",
    ) -> None:
        if output_transform not in OUTPUT_TRANSFORMS:
            raise InvalidArgumentError(
                f"output transform must be one of {OUTPUT_TRANSFORMS}, got {output_transform!r}"
            )
        if fallback_policy not in FALLBACK_POLICIES:
            raise InvalidArgumentError(
                f"fallback policy must be one of {FALLBACK_POLICIES}, got {fallback_policy!r}"
            )
        self.name = name
        self.manifest = manifest
        self.version = manifest.version
        self.created_unix = manifest.created_unix
        self.signature = signature
        self.embedding_config = embedding_config
        self.dense = dense
        self.tier = tier
        self.owns_tier = owns_tier
        self.output_transform = output_transform
        self.fallback_policy = fallback_policy
        # The version of the checkpoint's embeddings (EmbeddingManifest.version): what a
        # remote tier's shards should report having loaded.
        self.embedding_version = embedding_version
        # The dense model rewritten for oneDNN (serving.onednn_linear), used for merged batches
        # of at least ``large_batch_rows`` rows; None: every batch runs ``dense``.
        self.large_batch_dense: torch.jit.ScriptModule | None = None
        self.large_batch_rows = 0
        self._falling_back = False  # lookups are being answered with default vectors
        self._fallback_batches = 0

    # ------------------------------------------------------------------ inference
    def lookup(self, batch: Batch) -> tuple[LookupResult, int]:
        """Embeddings for ``batch`` (read-only) and how many IDs fell back to defaults."""
        try:
            result = self.tier.lookup(batch, train=False), 0
        except InvalidArgumentError as error:
            if isinstance(self.tier, InProcessEmbeddingTier):
                raise
            # The request passed the model's signature, so a remote tier that refuses it
            # disagrees with the checkpoint (a worker restarted with another
            # embedding_config.yml, say): the server's fault, which a 400 would have put
            # on the client.
            raise RecserveError(
                f"the embedding tier refused a lookup that model {self.name} version "
                f"{self.version} allows: {error.message}"
            ) from None
        except (DeadlineExceededError, UnavailableError) as error:
            if self.fallback_policy != "default":
                raise
            # Said when fallback starts and when it ends, not per batch: during an outage
            # every batch falls back (recserve_fallback_ids_total counts them).
            if not self._falling_back:
                self._falling_back, self._fallback_batches = True, 0
                log.warning(
                    "embedding lookups fail (%s); answering with default (zero) vectors "
                    "until they work again",
                    getattr(error, "message", error),
                )
            self._fallback_batches += 1
            return self.default_lookup(batch), batch.num_ids
        if self._falling_back:
            self._falling_back = False
            log.info(
                "embedding lookups work again; %d batch(es) got default vectors",
                self._fallback_batches,
            )
        return result

    def default_lookup(self, batch: Batch) -> LookupResult:
        """Every ID answered as unknown: zero vectors, and for raw slots the mask the tier
        gives (True where an ID sits, up to ``sample_fixed_size``), so that a model that
        averages over the mask sees a sequence of zero vectors, not an empty one (the
        fallback when the tier cannot answer in time)."""
        slots = []
        for feature in batch.id_type_features:
            config = self.embedding_config.slots_config[feature.name]
            if config.embedding_summation:
                slots.append(SlotOutput(feature.name, torch.zeros(feature.batch_size, config.dim)))
            else:
                fixed = config.sample_fixed_size
                # A copy: the batch's lengths are read-only, which torch warns about.
                lengths = torch.from_numpy(np.array(feature.lengths, dtype=np.int64))
                mask = torch.arange(fixed).unsqueeze(0) < lengths.unsqueeze(1)
                slots.append(
                    SlotOutput(
                        feature.name, torch.zeros(feature.batch_size, fixed, config.dim), mask
                    )
                )
        return LookupResult(slots=tuple(slots))

    def forward(self, batch: Batch, lookup: LookupResult) -> np.ndarray:
        """Dense model on looked-up embeddings: float32 [batch, 1] after the output transform.

        Each non-ID feature reaches the model in the dtype training handed it
        (:attr:`FeatureSignature.model_dtypes`: float32 for float32/float64 data, an integer
        feature as its integer dtype), in one copy per feature (the batch's arrays are
        read-only), as before for float32."""
        non_ids = [
            torch.from_numpy(np.array(f.data, dtype=dtype, copy=True))
            for f, dtype in zip(
                batch.non_id_type_features, self.signature.model_dtypes, strict=True
            )
        ]
        embeddings = [slot.embeddings for slot in lookup.slots]
        with torch.inference_mode():
            try:
                output = self._dense_forward(batch.batch_size, non_ids, embeddings)
            except Exception as error:
                if isinstance(error, IndexError) or _INDEX_ERROR.search(error_summary(error)):
                    raise self._input_error(batch, error) from error
                raise
            if self.output_transform == "sigmoid":
                output = torch.sigmoid(output)
        return output.detach().to(torch.float32).reshape(batch.batch_size, -1).numpy()

    def _input_error(self, batch: Batch, error: Exception) -> ModelInputError:
        """The error a request whose inputs made the dense model index out of range is
        answered (400): the model's summary line and the values of the request's integer
        inputs (the only ones a model can index with; IDs reach it as embeddings), never
        its traceback, which goes to the log."""
        message = (
            "the model failed on this request's inputs: an index is out of range "
            f"({error_summary(error)})"
        )
        held = [
            f"{feature.name!r} holds {_value_range(feature.data)}"
            for feature, dtype in zip(
                batch.non_id_type_features, self.signature.model_dtypes, strict=True
            )
            if np.issubdtype(dtype, np.integer)
        ]
        if held:
            more = len(held) - _NAMED_INPUTS
            named = "; ".join(held[:_NAMED_INPUTS]) + (f"; {more} more" if more > 0 else "")
            message += f"; is an integer input beyond what the model takes? {named}"
        return ModelInputError(message)

    def _dense_forward(
        self, rows: int, non_ids: list[torch.Tensor], embeddings: list[torch.Tensor]
    ) -> torch.Tensor:
        large = self.large_batch_dense
        if large is None or rows < self.large_batch_rows:
            return self.dense(non_ids, embeddings)
        try:
            return self._run_in_chunks(large, self.large_batch_rows, rows, non_ids, embeddings)
        except Exception as large_error:  # RuntimeError from a kernel, torch.jit.Error
            # It matched the loaded model at load time, so this is a case the check did not
            # cover, or inputs no model takes (a request's out-of-range index): the loaded
            # model decides which. If it fails too, its error is the answer and oneDNN stays
            # (one bad request must not slow every later large batch down).
            output = self.dense(non_ids, embeddings)
            log.error(
                "model %s version %s: the oneDNN dense model failed on %d rows where the "
                "model as loaded does not; every batch runs the model as loaded from now on",
                self.name,
                self.version,
                rows,
                exc_info=large_error,
            )
            self.large_batch_dense = None
            return output

    def _run_in_chunks(
        self,
        large: torch.jit.ScriptModule,
        min_rows: int,
        rows: int,
        non_ids: list[torch.Tensor],
        embeddings: list[torch.Tensor],
    ) -> torch.Tensor:
        """``large`` on chunks of the sizes :func:`onednn_linear.chunk_sizes` allows (the
        largest that fits, in turn), the loaded model on the rest: fewer than ``min_rows``
        rows, or fewer than 16. A chunk below 1024 rows leaves under a step (64 rows from
        256, 16 below), so a batch takes at most two chunks past its 1024-row ones, and a
        threshold under 16 never runs its smallest chunk over and over on what is left
        (``--onednn-min-rows 1`` made 63 one-row calls of a 63-row batch, ~100x the loaded
        model's time).

        Why those sizes: oneDNN builds a kernel for each input shape it meets (~1.3-3 ms each
        for the synthetic model), so merged batches of every size would keep building them.
        A fixed, small set of sizes, all built at load, never builds one while serving; and
        one large call is cheaper per row than several small ones (synthetic model, per 64
        rows: 268 us at 256 rows, 245 us at 1024)."""
        outputs = []
        start = 0
        while rows - start >= min_rows:
            size = onednn_linear.chunk_size(min_rows, rows - start)
            outputs.append(
                large(
                    [t[start : start + size] for t in non_ids],
                    [t[start : start + size] for t in embeddings],
                )
            )
            start += size
            if rows - start < onednn_linear.SMALL_ROW_STEP:
                break  # under 16 rows left: one call of the loaded model
        if start < rows:
            outputs.append(
                self.dense([t[start:] for t in non_ids], [t[start:] for t in embeddings])
            )
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def use_onednn_for_large_batches(self, min_rows: int | None) -> bool:
        """Run merged batches of at least ``min_rows`` rows on the dense model rewritten for
        oneDNN (:mod:`serving.onednn_linear`), in chunks of the sizes
        :func:`onednn_linear.chunk_sizes` gives, once it answers as the loaded model does on
        random inputs: on a chunk and a remainder, and on every chunk size (which also builds
        every kernel it will need, so that none is built while serving). ``None``: the
        threshold is measured here (:func:`onednn_linear.choose_min_rows`). Returns whether
        it is in use; when it is not, a log line says why and every batch runs the model as
        loaded."""
        if min_rows is not None and min_rows <= 0:
            return False
        if not onednn_linear.onednn_available():
            log.info("model %s: this torch build has no oneDNN linear kernels", self.name)
            return False
        try:
            rewritten, layers = onednn_linear.rewrite_linear_layers(
                self.dense, min_rows or onednn_linear.DEFAULT_MIN_ROWS
            )
        except RuntimeError as error:
            log.warning(
                "model %s: the dense model cannot be rewritten for oneDNN: %s", self.name, error
            )
            return False
        if layers == 0:
            log.info("model %s: the dense model has no linear layers to run on oneDNN", self.name)
            return False
        how = "given"
        if min_rows is None:
            try:
                min_rows, ratios = self._choose_onednn_min_rows(rewritten)
            except Exception as error:  # either model failing: the checks below say which
                min_rows, ratios = onednn_linear.DEFAULT_MIN_ROWS, {}
                log.debug("model %s: timing the oneDNN dense model failed: %s", self.name, error)
            how = "measured at load: oneDNN / loaded time " + (
                ", ".join(f"{ratio:.2f} at {rows} rows" for rows, ratio in ratios.items())
                or "not measured"
            )
        # One chunk; two chunks and a remainder (a model whose rows depend on each other
        # answers differently); then each chunk size on its own.
        checks = [(min_rows, True), (2 * min_rows + 37, True)]
        checks += [(rows, False) for rows in onednn_linear.chunk_sizes(min_rows)[1:]]
        for rows, chunked in checks:
            non_ids, embeddings = self._random_dense_inputs(rows)
            with torch.inference_mode():
                try:
                    loaded = self.dense(non_ids, embeddings)
                except Exception as error:  # the loaded model's own fault: infer reports it
                    log.warning(
                        "model %s: the dense model fails on %d rows: %s", self.name, rows, error
                    )
                    return False
                try:
                    if chunked:
                        output = self._run_in_chunks(rewritten, min_rows, rows, non_ids, embeddings)
                    else:
                        output = rewritten(non_ids, embeddings)
                except Exception as error:
                    log.warning(
                        "model %s: the oneDNN dense model fails on %d rows; not used: %s",
                        self.name,
                        rows,
                        error,
                    )
                    return False
            if not onednn_linear.outputs_match(output, loaded):
                log.warning(
                    "model %s: the oneDNN dense model's outputs differ from the loaded model's "
                    "on %d rows; not used",
                    self.name,
                    rows,
                )
                return False
        self.large_batch_dense = rewritten
        self.large_batch_rows = min_rows
        log.info(
            "model %s: %d linear layers run as oneDNN kernels for batches of >= %d rows (%s)",
            self.name,
            layers,
            min_rows,
            how,
        )
        return True

    def _choose_onednn_min_rows(
        self, rewritten: torch.jit.ScriptModule
    ) -> tuple[int, dict[int, float]]:
        """``--onednn-min-rows auto``: the threshold from which the rewritten model is clearly
        faster than the loaded one on this machine (:func:`onednn_linear.choose_min_rows`),
        timed on random inputs shaped as served."""
        inputs = {rows: self._random_dense_inputs(rows) for rows in onednn_linear.AUTO_PROBE_ROWS}

        def run(module: torch.jit.ScriptModule) -> Callable[[int], object]:
            return lambda rows: module(*inputs[rows])

        with torch.inference_mode():
            return onednn_linear.choose_min_rows(
                run(self.dense), run(rewritten), onednn_linear.AUTO_PROBE_ROWS
            )

    def _random_dense_inputs(
        self, rows: int, seed: int = 0
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Inputs of the dense model for ``rows`` rows, shaped as served, drawn from N(0, 1)."""
        batch = self.example_batch(rows)
        lookup = self.default_lookup(batch)  # shapes only: no call to the embedding tier
        generator = torch.Generator().manual_seed(seed)
        # In the dtypes served (an integer feature's N(0, 1) draws truncated, as serving
        # truncates what a client sends for it).
        non_ids = [
            torch.randn(np.shape(f.data), generator=generator).to(_torch_dtype(dtype))
            for f, dtype in zip(
                batch.non_id_type_features, self.signature.model_dtypes, strict=True
            )
        ]
        embeddings = [
            torch.randn(slot.embeddings.shape, generator=generator) for slot in lookup.slots
        ]
        return non_ids, embeddings

    def infer(self, batch: Batch) -> InferenceOutput:
        adopt_torch_threads()
        started = time.perf_counter()
        lookup, fallback_ids = self.lookup(batch)
        looked_up = time.perf_counter()
        predictions = self.forward(batch, lookup)
        return InferenceOutput(
            predictions=predictions,
            unknown_ids=lookup.unknown_ids,
            unknown_per_sample=lookup.unknown_per_sample,
            fallback_ids=fallback_ids,
            lookup_seconds=looked_up - started,
            compute_seconds=time.perf_counter() - looked_up,
        )

    def example_batch(self, batch_size: int = 2) -> Batch:
        """A syntactically valid batch (IDs 0..n, zeros) for warm-up and checks."""
        id_features: list[IDFeature] = []
        for feature in self.signature.id_features:
            ids = np.arange(batch_size, dtype=np.uint64)
            if feature.single_id:
                id_features.append(IDTypeFeatureWithSingleID(feature.name, ids))
            else:
                id_features.append(
                    IDTypeFeature(feature.name, ids, np.ones(batch_size, dtype=np.int64))
                )
        non_ids = [
            NonIDTypeFeature(np.zeros((batch_size, *spec.sample_shape), np.float32), spec.name)
            for spec in self.signature.non_id_features
        ]
        return Batch(id_features, non_ids, requires_grad=False)

    def warm_up(self, rounds: int = 3) -> None:
        """Run the full path a few times (TorchScript optimizes on the first calls) and check
        the output shape, so a broken checkpoint fails here and not on the first request."""
        for batch_size in (1, 2, 8)[:rounds]:
            try:
                output = self.infer(self.example_batch(batch_size)).predictions
            except ModelInputError as error:  # zeros: inputs any servable model takes
                raise CheckpointError(
                    f"checkpoint {self.manifest.directory} cannot be served: "
                    f"{error_summary(error.__cause__ or error)} (its dense model fails on a "
                    "batch of the inputs its signature and embedding dims describe)"
                ) from error
            except RecserveError:
                raise
            except Exception as error:  # the checkpoint's fault: its parts do not fit
                raise CheckpointError(
                    f"checkpoint {self.manifest.directory} cannot be served: "
                    f"{error_summary(error)} (its dense model fails on a batch of the inputs "
                    "its signature and embedding dims describe)"
                ) from error
            if output.shape != (batch_size, 1):
                raise CheckpointError(
                    f"model {self.name} version {self.version}: the dense model returns shape "
                    f"{list(output.shape)} for a batch of {batch_size}; expected "
                    f"[{batch_size}, 1]"
                )
        self._warn_if_rows_depend_on_each_other()

    def _warn_if_rows_depend_on_each_other(self, rows: int = 8) -> None:
        """Log a warning when the dense model answers a row differently alone than among
        others (on random inputs, beyond rounding): a model that mixes its batch's rows
        (normalizes over the batch, a batch norm left in training mode) gives each client an
        answer that depends on the requests dynamic batching merged with it, and on none of
        them in training's eval. It is still served, as loaded."""
        non_ids, embeddings = self._random_dense_inputs(rows, seed=1)
        try:
            with torch.inference_mode():
                whole = self.dense(non_ids, embeddings)
                alone = [
                    self.dense([t[i : i + 1] for t in non_ids], [t[i : i + 1] for t in embeddings])
                    for i in range(rows)
                ]
            together = whole.reshape(rows, -1).to(torch.float32)
            single = torch.cat([a.reshape(1, -1).to(torch.float32) for a in alone])
        except Exception:  # random inputs it cannot take: warm-up passed, requests decide
            return
        if not onednn_linear.outputs_match(single, together):
            log.warning(
                "model %s version %s: the dense model answers a row differently alone than in "
                "a batch of %d: each answer depends on the other requests merged with it "
                "(--max-batch-size, --max-queue-delay-ms) and the rows of its own request; "
                "does it normalize over the batch, or hold a batch norm in training mode?",
                self.name,
                self.version,
                rows,
            )

    def close(self) -> None:
        if self.owns_tier:
            self.tier.close()


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    """torch's dtype for numpy ``dtype``."""
    return torch.from_numpy(np.zeros(0, dtype)).dtype


def _value_range(data: np.ndarray) -> str:
    """``"30"`` or ``"3 to 30"``: the smallest and largest of a feature's values (whole
    numbers: integer features are checked as such before they reach a model)."""
    if data.size == 0:
        return "no values"
    low, high = int(np.min(data)), int(np.max(data))
    return f"{low}" if low == high else f"{low} to {high}"


def worker_config_mismatch(
    worker: str, reported: EmbeddingConfig | None, model_config: EmbeddingConfig, checkpoint: Path
) -> FailedPreconditionError | None:
    """The error to raise when the embedding worker ``worker`` (an address) reported an
    embedding config (``reported``; None: it did not say) under which the model's slots
    (``model_config``, its checkpoint's) would be read from other rows or pooled otherwise;
    None when they would not. The shards check their own config against the checkpoint
    they load, but only the worker routes and pools IDs: one started with another
    embedding_config.yml (another feature_index_prefix_bit, say) answers every ID with
    zeros, as unknown, and the model gives wrong predictions that no error reports."""
    if reported is None:
        return None
    names = model_config.slot_names
    problems = [
        f"slot {name!r} is not in the worker's config"
        for name in names
        if name not in reported.slots_config
    ]
    shared = [name for name in names if name in reported.slots_config]
    problems += checkpoint_load.slot_mismatches(
        model_config, reported, shared, saved_as="in the checkpoint", config_as="at the worker"
    )
    for name in shared:
        ours, theirs = model_config.slots_config[name], reported.slots_config[name]
        pooling = ("embedding_summation", "sqrt_scaling", "sample_fixed_size")
        if ours.dim == theirs.dim and any(
            getattr(ours, key) != getattr(theirs, key) for key in pooling
        ):
            problems.append(
                f"slot {name!r} is pooled otherwise at the worker ("
                + ", ".join(
                    f"{key} {getattr(ours, key)} in the checkpoint, {getattr(theirs, key)} "
                    "at the worker"
                    for key in pooling
                    if getattr(ours, key) != getattr(theirs, key)
                )
                + ")"
            )
    if not problems:
        return None
    return FailedPreconditionError(
        f"embedding worker {worker} serves another embedding config than checkpoint "
        f"{checkpoint}: {'; '.join(problems[:8])}"
        + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        + " (start the worker with the checkpoint's embedding_config.yml)"
    )


def _wait_for_worker_shards(
    worker: RemoteEmbeddingWorker, address: str, deadline: float, timeout: float
) -> TierStatus:
    """The embedding worker's status once each of its shards serves. A worker is ready once
    it reaches its shards, loaded or not (readiness must not follow the shared tier), so a
    server started while an inference shard still loads its checkpoint would fail its
    warm-up on that shard. UnavailableError naming the shards still waited for at
    ``deadline`` (``timeout`` s after the start)."""
    while True:
        status = worker.status(partial=True)
        waiting = []
        for index, serving in enumerate(status.shard_serving):
            error = status.shard_errors[index] if status.shard_errors else ""
            task = status.shard_tasks[index] if status.shard_tasks else ""
            if error:
                waiting.append(f"shard {index}: {error}")
            elif not serving:
                waiting.append(f"shard {index}: not serving yet" + (f" ({task})" if task else ""))
        if not waiting:
            return status
        if time.monotonic() >= deadline:
            raise UnavailableError(
                f"embedding worker {address}: its shards are not serving after {timeout:g} s "
                f"({'; '.join(waiting)})"
            )
        time.sleep(0.1)


def load_model(
    checkpoint_dir: str | Path,
    *,
    name: str,
    embedding_workers: Sequence[str] | None = None,
    embedding_ps: Sequence[str] | None = None,
    capacity: int | None = None,
    output_transform: str = "identity",
    fallback_policy: str = "fail",
    lookup_timeout: float = 5.0,
    warm_up: bool = True,
    onednn_min_rows: int | None = None,
    startup_timeout: float = 60.0,
) -> LoadedModel:
    """Load and verify a checkpoint: dense TorchScript + embeddings (in-process, or already
    served by remote read-only workers when ``embedding_workers`` are given, or by remote
    read-only shards with the worker core in this process when ``embedding_ps`` are given).

    Merged batches of at least ``onednn_min_rows`` rows run the dense model rewritten for oneDNN
    when it gives the same outputs (:meth:`LoadedModel.use_onednn_for_large_batches`; 0: off;
    None: a threshold measured at load).
    A remote embedding worker, or the remote shards, get ``startup_timeout`` seconds to
    report SERVING (the worker's shards too, unless ``fallback_policy`` is ``"default"``)."""
    if embedding_workers and embedding_ps:
        raise InvalidArgumentError(
            "give embedding_workers or embedding_ps, not both: a model uses one tier"
        )
    if embedding_workers and len(embedding_workers) > 1:
        raise InvalidArgumentError(
            f"embedding_workers lists {len(embedding_workers)} addresses: a model talks to one "
            "embedding worker (put a Kubernetes Service in front of several)"
        )
    manifest = model_checkpoint.read_manifest(checkpoint_dir)
    if manifest.signature is None:
        raise CheckpointError(
            f"checkpoint {manifest.directory} has no feature signature (written by an older "
            "recserve?); serving needs it to name the model's inputs"
        )
    if not manifest.has_jit_model:
        raise CheckpointError(
            f"checkpoint {manifest.directory} has no jit_dense.pt (dumped with "
            "with_jit_model=False): serving runs the TorchScript model; dump the checkpoint "
            "with with_jit_model=True (the default), which needs a scriptable forward "
            '(docs/own_model.md, "The model contract")'
        )
    dense = model_checkpoint.load_jit_model(manifest)
    dense.eval()
    embedding_manifest = checkpoint_manifest.read_manifest(manifest.embeddings_directory)
    model_checkpoint.check_embeddings_match(manifest, embedding_manifest)
    embedding_config = embedding_manifest.embedding_config
    tier: EmbeddingTier
    if embedding_ps:
        # The worker core runs in this process against remote (infer-mode) shards: one gRPC
        # hop fewer than going through an embedding-worker service.
        from embedding_store.remote_tier import RemoteShardTier

        shards = RemoteShardTier(embedding_config, list(embedding_ps), shard_timeout=lookup_timeout)
        log.info(
            "waiting up to %.0f s for %d embedding shard(s) to serve: %s",
            startup_timeout,
            len(embedding_ps),
            ", ".join(embedding_ps),
        )
        try:
            # Under --fallback-policy default, default vectors stand in for a shard still
            # loading (the warm-up too): only the replica order is checked.
            shards.wait_for_serving(startup_timeout, serving=fallback_policy == "fail")
        except BaseException:
            shards.close()
            raise
        tier = shards
    elif embedding_workers:
        from embedding_store.worker_client import RemoteEmbeddingWorker

        worker = RemoteEmbeddingWorker(
            embedding_workers[0], embedding_config, timeout=lookup_timeout
        )
        log.info(
            "waiting up to %.0f s for embedding worker %s to serve",
            startup_timeout,
            embedding_workers[0],
        )
        try:
            deadline = time.monotonic() + startup_timeout
            worker.wait_for_serving(timeout=startup_timeout)
            if fallback_policy == "fail":
                status = _wait_for_worker_shards(
                    worker, embedding_workers[0], deadline, startup_timeout
                )
            else:  # default vectors stand in for a shard that is away, in the warm-up too
                status = worker.status(partial=True)
            mismatch = worker_config_mismatch(
                embedding_workers[0], status.embedding_config, embedding_config, manifest.directory
            )
            if mismatch is not None:
                raise mismatch
        except BaseException:
            worker.close()
            raise
        # Built with a config, so its embedding_config is not None as EmbeddingTier wants (the
        # class also takes None, for admin clients that need no config).
        tier = cast(EmbeddingTier, worker)
    else:
        rows = embedding_manifest.total_rows
        tier = InProcessEmbeddingTier(
            embedding_config, capacity=capacity or max(rows, 1), read_only=True
        )
        try:
            loaded = tier.load(manifest.embeddings_directory)
            if loaded.version != embedding_manifest.version:
                # The load reads the directory again by its path: a new version published
                # there meanwhile (renamed into place) would be served under this one's name,
                # with the other's embeddings. The watcher tries the path again later.
                raise CheckpointError(
                    f"checkpoint {manifest.directory} changed while it was loaded: its "
                    f"embeddings are now {loaded.version}, its manifest named "
                    f"{embedding_manifest.version}"
                )
        except BaseException:
            tier.close()
            raise
    try:
        model = LoadedModel(
            name=name,
            manifest=manifest,
            signature=manifest.signature,
            embedding_config=embedding_config,
            dense=dense,
            tier=tier,
            owns_tier=True,
            output_transform=output_transform,
            fallback_policy=fallback_policy,
            embedding_version=embedding_manifest.version,
        )
    except BaseException:  # an output transform or fallback policy it does not know
        tier.close()
        raise
    try:
        if warm_up:
            model.warm_up()
        model.use_onednn_for_large_batches(onednn_min_rows)
    except BaseException:
        model.close()
        raise
    return model
