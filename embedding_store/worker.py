"""Embedding worker core: route a batch's IDs to shards, pool the rows, scatter gradients back.

For every forward pass the worker

1. expands each slot's IDs by its hash stack and adds the slot's feature-group prefix,
2. concatenates all slots that share an embedding dim into one *dim group* (the grouping and
   the layout of plain summation slots are cached per tuple of slot names and batch shape),
3. with ``deduplicate`` (the default for remote shards), deduplicates the group's IDs once
   (``torch.unique``); routes the IDs to their owning shards by a stable hash and gathers the
   rows,
4. pools every slot with one fused ``embedding_bag`` over the whole group: a *bag* is a sample
   (summation slots, optionally weighted by ``1/sqrt(n)``) or one position of a sample's padded
   sequence (raw slots, ``embedding_summation: false``; a hash-stacked ID's rounds are summed).

With exactly one in-process :class:`EmbeddingShard` (and no deduplication) steps 3 and 4 are
one call, :meth:`EmbeddingShard.lookup_pooled`: the shard probes its index and sums the rows
straight from its weight array in one kernel, with no row copies (same sums, same order).

Backward reverses step 4 with one numba kernel per dim group: pooled gradients are scattered
to the unique IDs (with the same ``1/sqrt(n)`` weights, summed in occurrence order exactly like
``index_add_``), rows with NaN/Inf are skipped and counted, and each shard receives the summed
gradient of the rows it owns. There is no per-ID Python loop anywhere; Python loops run over
slots and shards only.
"""

from __future__ import annotations

import contextvars
import itertools
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor
from concurrent.futures import wait as wait_for_all
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np
import torch
from numba import njit

from embedding_store.batch import Batch, IDTypeFeature, IDTypeFeatureWithSingleID
from embedding_store.config import EmbeddingConfig, SlotConfig
from embedding_store.errors import (
    BatchValidationError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from embedding_store.hashing import shard_of, splitmix64
from embedding_store.hashmap import IdIndex
from embedding_store.interfaces import ParameterServer
from embedding_store.shard import EmbeddingShard
from embedding_store.tier_types import BackwardStats, IdFeature, LookupResult, SlotOutput

# Bounds of the plan caches: slot-name tuples per worker, batch shapes per dim group.
_SPEC_CACHE_SIZE = 64
_LAYOUT_CACHE_SIZE = 8


class _SlotLayout(NamedTuple):
    """Where one slot's bags sit inside its dim group's bag list.

    ``lengths`` (int64 [batch], IDs per sample before truncation) is kept for raw slots only
    (their output mask); summation slots have None.
    """

    name: str
    config: SlotConfig
    batch_size: int
    first_bag: int
    num_bags: int
    lengths: np.ndarray | None


@dataclass(frozen=True)
class _GroupSpec:
    """The part of a dim group's plan that depends only on the batch's slot names.

    ``plain``: positions (in the batch's feature order) of summation slots without hash
    stack, pooled together with whole-array calls; ``special``: raw or hash-stacked slots.
    ``layouts`` caches, per tuple of (batch size, ID count) of the plain slots, their layouts and
    the per-ID prefix array (a few recent shapes; a batch never mutates them).
    """

    dim: int
    plain: tuple[int, ...]
    plain_configs: tuple[SlotConfig, ...]
    plain_prefixes: np.ndarray  # uint64 [len(plain)]
    special: tuple[int, ...]
    layouts: dict = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class _GroupPlan:
    """Everything needed to pool one dim group, and to scatter its gradients back.

    ``ids`` uint64 [n]: table IDs of every occurrence, ordered by bag; ``bag_lengths`` int64
    [num_bags]; ``bag_offsets`` int64 [num_bags] (torch, for ``embedding_bag``);
    ``id_weights`` float32 [n] or None (``1/sqrt(n)`` pooling weights); ``one_id_per_bag``:
    every bag holds exactly one ID (bag i is ``ids[i]``: single-ID summation slots).
    ``generations``: after a train lookup, each shard's row generation when it answered (by
    replica; None where the shard did not say or was not asked), sent back with the
    gradients so that a shard whose rows a load or clear replaced since refuses them; None
    when no shard said.
    """

    dim: int
    slots: tuple[_SlotLayout, ...]
    ids: np.ndarray
    bag_lengths: np.ndarray
    bag_offsets: torch.Tensor
    id_weights: torch.Tensor | None
    num_bags: int
    one_id_per_bag: bool = False
    generations: tuple[int | None, ...] | None = None


#: What a train lookup keeps for its backward pass: the plan of each dim group (opaque).
ForwardContext = tuple[_GroupPlan, ...]


def hash_stack(ids: np.ndarray, rounds: int, embedding_size: int) -> np.ndarray:
    """Expand each ID into ``rounds`` hashed IDs: uint64 [n] -> uint64 [n * rounds].

    Round r of an ID lands in ``[r * embedding_size, (r + 1) * embedding_size)``, so a huge raw
    ID space shares ``rounds * embedding_size`` rows. Output is ID-major (an ID's rounds are
    adjacent), which keeps each sample's IDs contiguous.
    """
    out = np.empty((len(ids), rounds), dtype=np.uint64)
    hashed = np.asarray(ids, dtype=np.uint64)
    size = np.uint64(embedding_size)
    for r in range(rounds):  # loop over rounds (a handful), vectorized over IDs
        hashed = splitmix64(hashed)
        out[:, r] = hashed % size + np.uint64(r) * size
    return out.reshape(-1)


class EmbeddingWorker:
    """Routes batches to parameter-server shards, pools embeddings and scatters gradients.

    ``shards[i]`` must be replica ``i`` of ``len(shards)``: an ID is owned by shard
    ``shard_of(id, len(shards))``. ``executor`` (optional) runs the per-shard calls of one
    dim group concurrently, which pays off for remote shards.
    """

    def __init__(
        self,
        embedding_config: EmbeddingConfig,
        shards: Sequence[ParameterServer],
        *,
        forward_buffer_size: int = 1000,
        executor: Executor | None = None,
        deduplicate: bool | None = None,
    ) -> None:
        if not shards:
            raise InvalidArgumentError("an embedding worker needs at least one shard")
        if forward_buffer_size < 1:
            raise InvalidArgumentError(
                f"forward_buffer_size must be >= 1, got {forward_buffer_size}"
            )
        self.embedding_config = embedding_config
        self.shards = tuple(shards)
        self.forward_buffer_size = forward_buffer_size
        self._executor = executor
        self._pending: OrderedDict[int, tuple[_GroupPlan, ...]] = OrderedDict()
        self._pending_lock = threading.Lock()
        # Contexts dropped by invalidate_forward_contexts (a checkpoint load replaced their
        # rows), by ref, with why: their backward is refused saying so, not "expired". At
        # most forward_buffer_size of them, oldest forgotten first.
        self._invalidated: OrderedDict[int, str] = OrderedDict()
        self._refs = itertools.count(1)
        self.expired_forward_contexts = 0
        self.nonfinite_rows_skipped = 0
        self._id_mask = np.uint64(embedding_config.id_mask)
        # Deduplicating costs a sort (~1 ms per 26k IDs here) and pays off only when it saves
        # traffic: by default only for shards that are not in this process.
        if deduplicate is None:
            deduplicate = not all(isinstance(shard, EmbeddingShard) for shard in self.shards)
        self.deduplicate = deduplicate
        self._specs: dict[tuple[str, ...], tuple[_GroupSpec, ...]] = {}
        # With one in-process shard (and no deduplication, which would change what the shard
        # sees) the shard pools itself: no row copies, no embedding_bag. See
        # EmbeddingShard.lookup_pooled.
        only = self.shards[0]
        self._pooling_shard = (
            only if len(self.shards) == 1 and isinstance(only, EmbeddingShard) else None
        )

    # ------------------------------------------------------------------ forward
    def lookup(self, batch: Batch | Sequence[IdFeature], *, train: bool) -> LookupResult:
        """Embeddings for every ID feature of ``batch``.

        ``train=True`` inserts unknown IDs on the shards and keeps the forward context for
        :meth:`backward` (at most ``forward_buffer_size`` contexts; older ones expire).
        """
        features = batch.id_type_features if isinstance(batch, Batch) else checked_features(batch)
        plans = self._plan(features)
        outputs: dict[str, SlotOutput] = {}
        unknown = _UnknownTally(features[0].batch_size if features else 0)
        kept: list[_GroupPlan] = []  # the plans, with the generations the shards said
        for plan in plans:
            pooled, generations = self._pool(plan, train=train, unknown=unknown)
            _slot_outputs(plan, pooled, outputs)
            kept.append(plan if generations is None else replace(plan, generations=generations))
        ref = self._remember(tuple(kept)) if train else None
        return LookupResult(
            slots=tuple(outputs[f.name] for f in features),
            ref=ref,
            unknown_ids=unknown.total,
            unknown_per_sample=unknown.per_sample,
        )

    def _pool(
        self, plan: _GroupPlan, *, train: bool, unknown: _UnknownTally
    ) -> tuple[torch.Tensor, tuple[int | None, ...] | None]:
        """Pooled rows of one dim group: float32 [num_bags, dim], and (train lookups) each
        shard's row generation (see :attr:`_GroupPlan.generations`); counts the ID
        occurrences answered with zeros into ``unknown``."""
        generations: tuple[int | None, ...] | None
        if self._pooling_shard is not None and not self.deduplicate:
            weights = None if plan.id_weights is None else plan.id_weights.numpy()
            sums = self._pooling_shard.lookup_pooled(
                plan.ids, plan.dim, plan.bag_offsets.numpy(), weights, train=train
            )
            misses = self._pooling_shard.last_misses
            if misses:
                unknown.add(plan, self._pooling_shard.last_missing, misses)
            generations = (self._pooling_shard.last_generation,) if train else None
            return torch.from_numpy(sums), generations
        if self.deduplicate:
            unique, inverse = _unique(plan.ids)
            rows, missing, misses, generations = self._gather(unique, plan.dim, train=train)
            if misses:
                # Per distinct ID -> per occurrence: the inverse index picks each
                # occurrence's flag (an ID asked once for 3 occurrences counts 3 times).
                occurrences = None if missing is None else missing[inverse.numpy()]
                unknown.add(plan, occurrences, misses)
        else:
            rows, missing, misses, generations = self._gather(plan.ids, plan.dim, train=train)
            if misses:
                unknown.add(plan, missing, misses)
            inverse = torch.arange(len(plan.ids))
        pooled = torch.nn.functional.embedding_bag(
            inverse,
            rows,
            plan.bag_offsets,
            mode="sum",
            per_sample_weights=plan.id_weights,
        )
        return pooled, generations

    def _gather(
        self, ids: np.ndarray, dim: int, *, train: bool
    ) -> tuple[torch.Tensor, np.ndarray | None, int, tuple[int | None, ...] | None]:
        """Rows of ``ids`` (uint64 [n]) from their owning shards, which of them were
        answered with zeros, and (train lookups) each shard's row generation: (float32
        [n, dim], bool [n] or None, how many, generations by replica or None).

        The flags are None when none was, or when a shard told only how many (one that
        predates ``LookupResponse.missing``, or a stand-in without ``last_missing``); the
        count is then what the shards said. The generations are None when no shard said
        one (eval lookups; shards that predate it, stand-ins without ``last_generation``)."""
        num_shards = len(self.shards)
        if num_shards == 1:
            shard = self.shards[0]
            rows = shard.lookup(ids, dim, train=train)
            count = getattr(shard, "last_misses", 0)
            flags = _checked_missing(getattr(shard, "last_missing", None), len(ids), count)
            generation = getattr(shard, "last_generation", None) if train else None
            alone = None if generation is None else (generation,)
            return torch.from_numpy(_as_rows(rows, len(ids), dim)), flags, count, alone
        owner = shard_of(ids, num_shards)
        gathered = np.empty((len(ids), dim), dtype=np.float32)
        lock = threading.Lock()
        misses = 0
        missing: np.ndarray | None = None  # bool [n], made once a shard flags a miss
        flagless = False  # a shard told only how many
        # Per replica; each fetch writes only its own.
        shard_generations: list[int | None] = [None] * num_shards

        def fetch(shard_index: int) -> None:
            nonlocal misses, missing, flagless
            picked = np.flatnonzero(owner == shard_index)
            if len(picked):
                shard = self.shards[shard_index]
                rows = shard.lookup(ids[picked], dim, train=train)
                if train:  # per thread, as last_misses: read in the thread that asked
                    shard_generations[shard_index] = getattr(shard, "last_generation", None)
                # last_misses and last_missing are per thread: read in the thread that asked.
                missed = getattr(shard, "last_misses", 0)
                if missed:
                    flags = _checked_missing(
                        getattr(shard, "last_missing", None), len(picked), missed
                    )
                    with lock:
                        misses += missed
                        if flags is None:
                            flagless = True
                        else:
                            if missing is None:
                                missing = np.zeros(len(ids), dtype=np.bool_)
                            missing[picked[flags]] = True
                gathered[picked] = _as_rows(rows, len(picked), dim)

        self._for_each_shard(fetch)
        said = any(g is not None for g in shard_generations)
        generations = tuple(shard_generations) if said else None
        return torch.from_numpy(gathered), None if flagless else missing, misses, generations

    def _for_each_shard(self, task: Callable[[int], None]) -> None:
        """Run ``task(shard_index)`` for every shard: shards 1.. on the executor, shard 0 on
        the calling thread, which would otherwise only wait (one pool hand-off saved).

        Returns, or raises the first failure in replica order, only once every shard's task
        ended. Shards that did not fail keep what they did: an update pushed to several
        shards is applied in part when one of them fails (none is rolled back)."""
        if self._executor is None:
            for s in range(len(self.shards)):
                task(s)
            return
        # In the caller's context: a shard client reads its caller's deadline there.
        futures = [
            self._executor.submit(contextvars.copy_context().run, task, s)
            for s in range(1, len(self.shards))
        ]
        try:
            task(0)
        finally:
            # Every shard's call ends (each has its deadline) before this returns or raises:
            # a caller told of one shard's failure goes on (the pusher's next batch, a load
            # or clear after the failed push), and must not race another shard's call still
            # applying its part.
            wait_for_all(futures)
        for future in futures:  # shard 0's error, if any, is already raised: replica order
            error = future.exception()
            if error is not None:
                raise error  # it names the shard

    # ------------------------------------------------------------------ backward
    def backward(self, ref: int, grads: Mapping[str, torch.Tensor | np.ndarray]) -> BackwardStats:
        """Scatter pooled gradients of forward ``ref`` to unique IDs and push them to shards.

        ``grads[slot]`` has the shape of that slot's output: float32 [batch, dim] (summation)
        or [batch, sample_fixed_size, dim] (raw). Slots left out of ``grads`` train nothing:
        their rows are not pushed (a zero gradient is not a no-op for Adam, whose moments
        would move the rows and count a step, nor for weight decay), so ``grads={}`` drops
        the forward context without touching any row.
        """
        return self.apply_gradients(self.take_forward_context(ref, grads), grads)

    def take_forward_context(
        self, ref: int, grads: Mapping[str, torch.Tensor | np.ndarray] | None = None
    ) -> ForwardContext:
        """Remove forward context ``ref`` from the buffer and return it (for
        :meth:`apply_gradients`); NotFoundError if it was already used or expired.

        With ``grads``, they are checked first (:func:`check_gradients`): gradients that do
        not fit leave the context in the buffer, so the caller can send corrected ones.
        Callers that apply gradients later (an asynchronous pusher) claim the context first,
        so later lookups cannot expire it while its gradients wait.
        """
        with self._pending_lock:
            plans = self._pending.get(ref)
            if plans is not None:
                if grads is not None:
                    check_gradients(plans, grads)
                del self._pending[ref]
            invalidated = self._invalidated.pop(ref, None) if plans is None else None
        if invalidated is not None:
            raise FailedPreconditionError(
                f"forward context {ref} was taken before {invalidated} replaced the rows it "
                "looked up: its gradients were computed against the old rows and are not "
                "applied (look the batch up again)"
            )
        if plans is None:
            raise NotFoundError(
                f"no forward context {ref}: it was already used or expired "
                f"(forward_buffer_size={self.forward_buffer_size})"
            )
        return plans

    def apply_gradients(
        self, context: ForwardContext, grads: Mapping[str, torch.Tensor | np.ndarray]
    ) -> BackwardStats:
        """:meth:`backward` for a context taken with :meth:`take_forward_context`.

        The gradients are checked (:func:`check_gradients`) before any row is pushed."""
        check_gradients(context, grads)
        pushed = skipped = 0
        for plan in context:
            present = [layout for layout in plan.slots if layout.name in grads]
            if not present:
                continue
            bag_grads = torch.zeros(plan.num_bags, plan.dim, dtype=torch.float32)
            for layout in present:
                bag_grads[layout.first_bag : layout.first_bag + layout.num_bags] = _bag_gradient(
                    layout, grads[layout.name], plan.dim
                )
            if len(present) < len(plan.slots):
                plan, bag_grads = _only_slots(plan, present, bag_grads)
            unique, unique_grads, finite = _scatter_to_unique(plan, bag_grads.numpy())
            skipped += len(finite) - int(np.count_nonzero(finite))
            pushed += self._push(unique[finite], unique_grads[finite], plan.generations)
        self.nonfinite_rows_skipped += skipped
        return BackwardStats(rows_pushed=pushed, nonfinite_rows_skipped=skipped)

    def _push(
        self, ids: np.ndarray, grads: np.ndarray, generations: tuple[int | None, ...] | None
    ) -> int:
        """Send each shard the summed gradients of the rows it owns, with the generation its
        lookup said (:attr:`_GroupPlan.generations`): a shard whose rows a load or clear
        replaced since (through any worker) refuses them, FailedPreconditionError."""
        if len(ids) == 0:
            return 0
        num_shards = len(self.shards)
        if num_shards == 1:
            self._update(0, ids, grads, generations)
            return len(ids)
        owner = shard_of(ids, num_shards)

        def push(shard_index: int) -> None:
            picked = np.flatnonzero(owner == shard_index)
            if len(picked):
                self._update(
                    shard_index, ids[picked], np.ascontiguousarray(grads[picked]), generations
                )

        self._for_each_shard(push)
        return len(ids)

    def _update(
        self,
        shard_index: int,
        ids: np.ndarray,
        grads: np.ndarray,
        generations: tuple[int | None, ...] | None,
    ) -> None:
        shard = self.shards[shard_index]
        generation = None if generations is None else generations[shard_index]
        if generation is None:  # not said: shards and stand-ins that predate generations
            shard.update(ids, grads)
        else:
            shard.update(ids, grads, generation=generation)

    def _remember(self, plans: tuple[_GroupPlan, ...]) -> int:
        ref = next(self._refs)
        with self._pending_lock:
            self._pending[ref] = plans
            while len(self._pending) > self.forward_buffer_size:
                self._pending.popitem(last=False)
                self.expired_forward_contexts += 1
        return ref

    def drop_forward_contexts(self, refs: Iterable[int]) -> int:
        """Drop forward contexts ``refs`` from the buffer: train lookups abandoned without a
        backward (a loss that raised), which would otherwise wait there until they expire,
        counted in :attr:`expired_forward_contexts`. Refs not in the buffer (already used,
        expired or unknown) are ignored. Returns how many were dropped."""
        with self._pending_lock:
            return sum(self._pending.pop(int(ref), None) is not None for ref in refs)

    def invalidate_forward_contexts(self, reason: str) -> int:
        """Drop every forward context in the buffer because ``reason`` (e.g. "the load of
        embedding checkpoint /ckpt") replaced the rows they looked up: a later backward for
        one of them raises FailedPreconditionError naming ``reason`` instead of applying
        gradients computed against the old rows to the new rows of the same IDs. Returns
        how many were dropped (not counted as expired)."""
        with self._pending_lock:
            for ref in self._pending:
                self._invalidated[ref] = reason
            dropped = len(self._pending)
            self._pending.clear()
            while len(self._invalidated) > self.forward_buffer_size:
                self._invalidated.popitem(last=False)
        return dropped

    @property
    def pending_backward(self) -> int:
        """Number of forward contexts waiting for their backward pass."""
        return len(self._pending)

    # ------------------------------------------------------------------ planning
    def _plan(self, features: Sequence[IdFeature]) -> tuple[_GroupPlan, ...]:
        """Group slots by dim and build the bag layout of each group (vectorized per slot)."""
        if not features:
            raise BatchValidationError("the batch has no ID-type features to look up")
        names = tuple(f.name for f in features)
        specs = self._specs.get(names)
        if specs is None:
            specs = self._group_specs(features)
            if len(self._specs) >= _SPEC_CACHE_SIZE:
                self._specs.clear()
            self._specs[names] = specs
        return tuple(self._plan_group(spec, features) for spec in specs)

    def _group_specs(self, features: Sequence[IdFeature]) -> tuple[_GroupSpec, ...]:
        """Split the batch's slots into dim groups, and each group into plain and special."""
        by_dim: dict[int, tuple[list[int], list[SlotConfig], list[int]]] = {}
        for position, feature in enumerate(features):
            config = self._slot_config(feature.name)
            plain, plain_configs, special = by_dim.setdefault(config.dim, ([], [], []))
            if config.embedding_summation and config.hash_stack_config.hash_stack_rounds == 0:
                plain.append(position)
                plain_configs.append(config)
            else:
                special.append(position)
        return tuple(
            _GroupSpec(
                dim=dim,
                plain=tuple(plain),
                plain_configs=tuple(plain_configs),
                plain_prefixes=np.array(
                    [self.embedding_config.index_prefix(features[i].name) for i in plain],
                    dtype=np.uint64,
                ),
                special=tuple(special),
            )
            for dim, (plain, plain_configs, special) in by_dim.items()
        )

    def _slot_config(self, name: str) -> SlotConfig:
        if name not in self.embedding_config.slots_config:
            known = ", ".join(self.embedding_config.slot_names)
            raise BatchValidationError(
                f"ID feature {name!r} is not a slot of the embedding config (known: {known})"
            )
        return self.embedding_config.slots_config[name]

    def _plan_group(self, spec: _GroupSpec, features: Sequence[IdFeature]) -> _GroupPlan:
        """Concatenate one dim group's slots into one bag list.

        Plain summation slots (the common case) are handled together with whole-array numpy
        calls; raw and hash-stacked slots take a per-slot path.
        """
        ids_parts: list[np.ndarray] = []
        length_parts: list[np.ndarray] = []
        weight_parts: list[np.ndarray | None] = []
        layouts: list[_SlotLayout] = []
        first_bag = 0
        all_single = not spec.special
        if spec.plain:
            plain = [features[i] for i in spec.plain]
            ids, lengths, weights, plain_layouts = self._plain_bags(spec, plain)
            all_single = all_single and lengths is None
            ids_parts.append(ids)
            length_parts.append(np.ones(len(ids), np.int64) if lengths is None else lengths)
            weight_parts.append(weights)
            layouts.extend(plain_layouts)
            first_bag = len(length_parts[0])
        for position in spec.special:
            feature = features[position]
            config = self._slot_config(feature.name)
            ids, lengths, weights = self._special_bags(feature, config)
            ids_parts.append(ids)
            length_parts.append(lengths)
            weight_parts.append(weights)
            layouts.append(
                _SlotLayout(
                    feature.name,
                    config,
                    feature.batch_size,
                    first_bag,
                    len(lengths),
                    None if config.embedding_summation else feature.lengths,
                )
            )
            first_bag += len(lengths)
        all_ids = _concat(ids_parts)
        bag_lengths = _concat(length_parts)
        if all_single:  # one ID per bag: offsets are 0, 1, 2, ...
            offsets = np.arange(first_bag, dtype=np.int64)
        else:
            offsets = np.zeros(first_bag, dtype=np.int64)
            if first_bag > 1:
                np.cumsum(bag_lengths[:-1], out=offsets[1:])
        id_weights = None
        if any(w is not None for w in weight_parts):
            id_weights = torch.from_numpy(
                _concat(
                    [
                        w if w is not None else np.ones(len(i), np.float32)
                        for w, i in zip(weight_parts, ids_parts)
                    ]
                )
            )
        return _GroupPlan(
            dim=spec.dim,
            slots=tuple(layouts),
            ids=all_ids,
            bag_lengths=bag_lengths,
            bag_offsets=torch.from_numpy(offsets),
            id_weights=id_weights,
            num_bags=first_bag,
            one_id_per_bag=all_single,
        )

    def _plain_bags(
        self, spec: _GroupSpec, members: list[IdFeature]
    ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, tuple[_SlotLayout, ...]]:
        """Summation slots without hash stack, all at once: one bag per sample.

        Returns (ids uint64 [n], bag lengths int64 [sum of batch sizes] or None when every
        slot has exactly one ID per sample, weights float32 [n] or None, layouts).
        """
        sizes = tuple(f.batch_size for f in members)
        single = all(isinstance(f, IDTypeFeatureWithSingleID) for f in members)
        counts = sizes if single else tuple(len(f.values) for f in members)
        cached = spec.layouts.get(counts if single else (sizes, counts))
        if cached is None:
            new_layouts = []
            first_bag = 0
            for feature, config, size in zip(members, spec.plain_configs, sizes):
                new_layouts.append(_SlotLayout(feature.name, config, size, first_bag, size, None))
                first_bag += size
            per_id_prefix = None
            if self.embedding_config.feature_index_prefix_bit:
                per_id_prefix = np.repeat(spec.plain_prefixes, counts)
            cached = (tuple(new_layouts), per_id_prefix)
            if len(spec.layouts) >= _LAYOUT_CACHE_SIZE:
                spec.layouts.clear()
            spec.layouts[counts if single else (sizes, counts)] = cached
        layouts, per_id_prefix = cached
        values = _concat([f.values for f in members])
        if per_id_prefix is not None:
            ids = np.bitwise_and(values, self._id_mask)
            ids |= per_id_prefix
        else:
            ids = np.ascontiguousarray(values, dtype=np.uint64)
        lengths = None if single else _concat([f.lengths for f in members])
        weights = None
        if any(c.sqrt_scaling for c in spec.plain_configs):
            bag_weights = _concat(
                [
                    _sqrt_weights(f.lengths) if c.sqrt_scaling else np.ones(size, np.float32)
                    for f, c, size in zip(members, spec.plain_configs, sizes)
                ]
            )
            # lengths is None exactly when single (one ID per sample)
            weights = bag_weights if lengths is None else np.repeat(bag_weights, lengths)
        return ids, lengths, weights, layouts

    def _special_bags(
        self, feature: IdFeature, config: SlotConfig
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """One raw or hash-stacked slot: (ids uint64 [n], bag lengths int64, weights or None).

        Raw slots (``embedding_summation: false``) have ``sample_fixed_size`` bags per sample,
        one per position; IDs past that size are truncated. A hash-stacked ID contributes its
        ``hash_stack_rounds`` rows to the same bag.
        """
        values = feature.values
        lengths = feature.lengths
        batch_size = feature.batch_size
        rounds = max(config.hash_stack_config.hash_stack_rounds, 1)
        if config.embedding_summation:
            bag_lengths = lengths * rounds
            sample_of_id = None
        else:
            fixed = config.sample_fixed_size
            sample_of_id = np.repeat(np.arange(batch_size, dtype=np.int64), lengths)
            position = np.arange(len(values), dtype=np.int64) - feature.offsets[:-1][sample_of_id]
            keep = position < fixed
            if not keep.all():
                values = values[keep]
                sample_of_id = sample_of_id[keep]
                position = position[keep]
            bag_lengths = (
                np.bincount(sample_of_id * fixed + position, minlength=batch_size * fixed).astype(
                    np.int64
                )
                * rounds
            )
        if config.hash_stack_config.hash_stack_rounds > 0:
            values = hash_stack(values, rounds, config.hash_stack_config.embedding_size)
        ids = self._prefixed(values, feature.name)
        weights = None
        if config.sqrt_scaling:  # only valid with summation: one weight per sample
            weights = np.repeat(_sqrt_weights(lengths), lengths * rounds)
        return ids, bag_lengths, weights

    def _prefixed(self, values: np.ndarray, slot_name: str) -> np.ndarray:
        prefix = self.embedding_config.index_prefix(slot_name)
        if self.embedding_config.feature_index_prefix_bit == 0:
            return np.ascontiguousarray(values, dtype=np.uint64)
        return (values & self._id_mask) | np.uint64(prefix)


class _UnknownTally:
    """The IDs of one lookup answered with zeros, as ID occurrences: in all (``total``) and
    per sample (``per_sample``, int64 [batch], summing to ``total``; None once a shard told
    only how many, so that they cannot be placed).

    Counted per looked-up row: each round of a hash-stacked ID, no ID past a raw slot's
    ``sample_fixed_size`` (never looked up)."""

    def __init__(self, batch_size: int) -> None:
        self.total = 0
        self.per_sample: np.ndarray | None = np.zeros(batch_size, dtype=np.int64)
        self._batch_size = batch_size

    def add(self, plan: _GroupPlan, missing: np.ndarray | None, count: int) -> None:
        """Count ``count`` misses of dim group ``plan``: at ``missing`` (bool [n] over
        ``plan.ids``), or, when None, only as a number (``per_sample`` becomes None)."""
        if missing is None:
            self.total += count
            self.per_sample = None
            return
        positions = np.flatnonzero(missing)
        self.total += len(positions)
        if self.per_sample is None:
            return
        # Occurrence -> its bag (the last bag starting at or before it; empty bags start
        # where the next one does) -> its slot (bags are slot-major) -> its sample (a slot
        # has the same bags, one or sample_fixed_size, for every sample, sample-major). The
        # common case, single-ID summation slots, skips both searches (~70 us per 2.6k
        # misses among 26k IDs): bag = position, and with one bag per sample in every slot
        # (each slot starts at a multiple of the batch size) sample = bag % batch size.
        if plan.one_id_per_bag:
            bags = positions
        else:
            bags = np.searchsorted(plan.bag_offsets.numpy(), positions, side="right") - 1
        batch = self._batch_size
        if plan.num_bags == batch * len(plan.slots):  # every slot: one bag per sample
            samples = bags % batch
        else:
            firsts = np.fromiter((s.first_bag for s in plan.slots), np.int64, len(plan.slots))
            slot = np.searchsorted(firsts, bags, side="right") - 1
            per_sample = (
                np.fromiter((s.num_bags for s in plan.slots), np.int64, len(plan.slots)) // batch
            )
            samples = (bags - firsts[slot]) // per_sample[slot]
        self.per_sample += np.bincount(samples, minlength=batch)


def _checked_missing(missing: np.ndarray | None, n: int, misses: int) -> np.ndarray | None:
    """A shard's flags of which of its ``n`` IDs it answered with zeros (bool [n]); None
    when it missed none or gave no flags (only its count ``misses`` is then known).
    InvalidArgumentError for flags of another shape or dtype."""
    if misses == 0 or missing is None:
        return None
    if missing.shape != (n,) or missing.dtype != np.bool_:
        raise InvalidArgumentError(
            f"shard flagged missing IDs as {missing.dtype} {missing.shape}; expected bool ({n},)"
        )
    return missing


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _sqrt_weights(lengths: np.ndarray) -> np.ndarray:
    """Per-sample pooling weight ``1/sqrt(n)`` (1 for empty samples): float32 [batch]."""
    return (1.0 / np.sqrt(np.maximum(lengths, 1))).astype(np.float32)


def _unique(ids: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
    """Unique IDs (uint64 [U], in the order of their LAST occurrence) and the position of
    each input ID among them (int64 [n]). A throwaway hash index: O(n), ~4x faster here than
    the sort behind ``torch.unique``.

    Last occurrence, not first: a shard stamps a train lookup's rows in the order it gets
    them, the last position of a repeated ID winning (the LRU order of
    :mod:`embedding_store.shard`). The deduplicated IDs must keep that order, or a remote
    tier (which deduplicates) would evict other rows than the in-process one (which sends
    the batch as it is) once a shard is full: [1, 2, 1] makes 2 the older row, not 1.
    Numbered by first occurrence in the reversed IDs, then counted back from the end."""
    index = IdIndex(2 * len(ids))  # slots for load <= 0.5: no growth during the insert
    backwards, count = index.get_or_insert(np.ascontiguousarray(ids[::-1]), 0)
    inverse = (count - 1) - backwards[::-1]
    unique = np.empty(count, dtype=np.uint64)
    unique[inverse] = ids
    return unique, torch.from_numpy(np.ascontiguousarray(inverse))


_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)


@njit(cache=True, nogil=True)
def _scatter_kernel(
    ids: np.ndarray,
    offsets: np.ndarray,
    bag_grads: np.ndarray,
    id_weights: np.ndarray,
    slots: np.ndarray,
    unique: np.ndarray,
    unique_grads: np.ndarray,
    finite: np.ndarray,
) -> int:
    """Sum each ID occurrence's gradient into its unique ID's row, in occurrence order.

    Occurrence ``i`` of bag ``b`` (``offsets`` as for ``embedding_bag``) adds
    ``bag_grads[b] * id_weights[i]`` (or ``bag_grads[b]`` when ``id_weights`` is empty) to the
    row of ``ids[i]``: exactly ``zeros.index_add_(0, inverse, bag_grads[bag_of_id] * weights)``.
    Unique IDs are numbered by first occurrence through a hash set (``slots``, int64 [power
    of two >= 2n], all -1). Fills ``unique`` uint64, ``unique_grads`` float32 [U, dim] and
    ``finite`` (bool [U], rows without NaN/Inf); returns U.
    """
    n = ids.shape[0]
    num_bags = offsets.shape[0]
    dim = bag_grads.shape[1]
    mask = np.uint64(slots.shape[0] - 1)
    weighted = id_weights.shape[0] > 0
    count = 0
    for b in range(num_bags):
        end = offsets[b + 1] if b + 1 < num_bags else n
        for i in range(offsets[b], end):
            k = ids[i]
            z = k + np.uint64(0x9E3779B97F4A7C15)
            z = (z ^ (z >> _S30)) * _MIX1
            z = (z ^ (z >> _S27)) * _MIX2
            s = np.int64((z ^ (z >> _S31)) & mask)
            while True:
                u = slots[s]
                if u < 0:
                    u = count
                    count += 1
                    slots[s] = u
                    unique[u] = k
                    for c in range(dim):
                        unique_grads[u, c] = 0.0
                    break
                if unique[u] == k:
                    break
                s = np.int64((np.uint64(s) + np.uint64(1)) & mask)
            if weighted:
                w = id_weights[i]
                for c in range(dim):
                    unique_grads[u, c] += bag_grads[b, c] * w
            else:
                for c in range(dim):
                    unique_grads[u, c] += bag_grads[b, c]
    for u in range(count):
        ok = True
        for c in range(dim):
            if not math.isfinite(unique_grads[u, c]):
                ok = False
        finite[u] = ok
    return count


def _only_slots(
    plan: _GroupPlan, present: list[_SlotLayout], bag_grads: torch.Tensor
) -> tuple[_GroupPlan, torch.Tensor]:
    """``plan`` and its bags' gradients (float32 [num_bags, dim]) cut down to the bags of the
    ``present`` slots, so that rows only the other slots looked up are not pushed at all."""
    keep_bag = np.zeros(plan.num_bags, dtype=np.bool_)
    for layout in present:
        keep_bag[layout.first_bag : layout.first_bag + layout.num_bags] = True
    keep_id = np.repeat(keep_bag, plan.bag_lengths)
    lengths = plan.bag_lengths[keep_bag]
    offsets = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=offsets[1:])
    weights = None if plan.id_weights is None else plan.id_weights[torch.from_numpy(keep_id)]
    kept = replace(
        plan,
        slots=tuple(present),
        ids=plan.ids[keep_id],
        bag_lengths=lengths,
        bag_offsets=torch.from_numpy(offsets),
        id_weights=weights,
        num_bags=len(lengths),
    )
    return kept, bag_grads[torch.from_numpy(keep_bag)]


def _scatter_to_unique(
    plan: _GroupPlan, bag_grads: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(unique IDs uint64 [U], their summed gradients float32 [U, dim], finite bool [U])."""
    n = len(plan.ids)
    slots = np.full(max(16, 1 << (2 * n - 1).bit_length()), -1, dtype=np.int64)
    unique = np.empty(n, dtype=np.uint64)
    unique_grads = np.empty((n, plan.dim), dtype=np.float32)
    finite = np.empty(n, dtype=np.bool_)
    weights = _NO_WEIGHTS if plan.id_weights is None else plan.id_weights.numpy()
    count = _scatter_kernel(
        plan.ids,
        plan.bag_offsets.numpy(),
        np.ascontiguousarray(bag_grads),
        weights,
        slots,
        unique,
        unique_grads,
        finite,
    )
    return unique[:count], unique_grads[:count], finite[:count]


_NO_WEIGHTS = np.zeros(0, dtype=np.float32)


def _as_rows(rows: np.ndarray, count: int, dim: int) -> np.ndarray:
    """Check a shard's answer: float32 [count, dim], or a clear error."""
    if rows.dtype != np.float32 or rows.shape != (count, dim):
        raise InvalidArgumentError(
            f"shard answered rows of dtype {rows.dtype} and shape {rows.shape}; "
            f"expected float32 {(count, dim)}"
        )
    return rows


def _slot_outputs(plan: _GroupPlan, pooled: torch.Tensor, outputs: dict[str, SlotOutput]) -> None:
    """Slice one dim group's pooled bags into its slots' outputs (one ``split`` call)."""
    pieces = pooled.split([layout.num_bags for layout in plan.slots])
    for layout, bags in zip(plan.slots, pieces):
        if layout.lengths is None:  # summation slot
            outputs[layout.name] = SlotOutput(layout.name, bags)
            continue
        fixed = layout.config.sample_fixed_size
        embeddings = bags.reshape(layout.batch_size, fixed, plan.dim)
        positions = torch.arange(fixed).unsqueeze(0)
        mask = positions < torch.tensor(layout.lengths).unsqueeze(1)
        outputs[layout.name] = SlotOutput(layout.name, embeddings, mask=mask)


def checked_features(features: Sequence[IdFeature]) -> tuple[IdFeature, ...]:
    """``features`` as a tuple, checked as a :class:`Batch` checks them (feature types, unique
    names, one batch size of at least 1); BatchValidationError naming the problem."""
    features = tuple(features)
    if features:
        Batch(features, requires_grad=False)
    return features


def _expected_gradient_shape(layout: _SlotLayout, dim: int) -> tuple[int, ...]:
    if layout.config.embedding_summation:
        return (layout.batch_size, dim)
    return (layout.batch_size, layout.config.sample_fixed_size, dim)


def check_gradients(
    context: ForwardContext, grads: Mapping[str, torch.Tensor | np.ndarray]
) -> None:
    """Refuse gradients that do not fit forward ``context``: a slot it did not look up (a
    misspelt name would otherwise train nothing, silently) or a gradient whose shape is not
    that slot's output shape. InvalidArgumentError naming the slot; nothing is applied."""
    shapes = {
        layout.name: _expected_gradient_shape(layout, plan.dim)
        for plan in context
        for layout in plan.slots
    }
    unknown = sorted(set(grads) - set(shapes))
    if unknown:
        raise InvalidArgumentError(
            f"gradients for slots {unknown} that this forward pass did not look up; "
            f"it looked up {sorted(shapes)}"
        )
    for name, grad in grads.items():
        shape = tuple(getattr(grad, "shape", ()))
        if shape != shapes[name]:
            raise InvalidArgumentError(
                f"gradient of slot {name!r} has shape {shape}; expected {shapes[name]}"
            )


def _bag_gradient(layout: _SlotLayout, grad: torch.Tensor | np.ndarray, dim: int) -> torch.Tensor:
    """One slot's gradient (shape checked by :func:`check_gradients`) as float32
    [num_bags, dim]."""
    if isinstance(grad, np.ndarray) and not grad.flags.writeable:
        grad = grad.copy()  # decoded from a message: torch wants writable memory
    # detach: a caller's tensor that requires grad is data here (numpy() refuses it).
    tensor = torch.as_tensor(grad, dtype=torch.float32).detach()
    return tensor.reshape(layout.num_bags, dim)


class _ZerosShard:
    """The stand-in shard of :func:`warm_up_kernels`: zero rows for every lookup, updates
    taken and dropped. Not an :class:`EmbeddingShard`, so the worker takes the path it takes
    for remote shards (deduplication, no fused pooling)."""

    def lookup(self, ids: np.ndarray, dim: int, *, train: bool) -> np.ndarray:
        return np.zeros((ids.shape[0], dim), dtype=np.float32)

    def update(self, ids: np.ndarray, grads: np.ndarray, *, generation: int | None = None) -> int:
        return int(ids.shape[0])


def warm_up_kernels(embedding_config: EmbeddingConfig) -> None:
    """Compile (or load from numba's on-disk cache) a worker's kernels, and run torch's
    pooling once, before the worker reports SERVING: a train lookup (the dedup index), its
    backward (the gradient scatter) and an eval lookup of two samples of every slot of
    ``embedding_config``, over a stand-in shard. A fresh worker's first backward otherwise
    compiles the scatter kernel (~0.3 s with an empty cache, as a container's under /tmp
    starts)."""
    worker = EmbeddingWorker(embedding_config, [_ZerosShard()])
    ids = np.arange(1, 5, dtype=np.uint64)
    lengths = np.full(2, 2, dtype=np.int64)
    batch = Batch(
        [IDTypeFeature(name, ids, lengths) for name in embedding_config.slot_names],
        requires_grad=False,
    )
    result = worker.lookup(batch, train=True)
    if result.ref is not None:  # always, for a train lookup
        grads = {s.name: torch.zeros(s.embeddings.shape) for s in result.slots}
        worker.backward(result.ref, grads)
    worker.lookup(batch, train=False)
