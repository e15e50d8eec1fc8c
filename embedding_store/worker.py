"""Embedding worker core: route a batch's IDs to shards, pool the rows, scatter gradients back.

For every forward pass the worker

1. expands each slot's IDs by its hash stack and adds the slot's feature-group prefix,
2. concatenates all slots that share an embedding dim into one *dim group*,
3. deduplicates the group's IDs once (``torch.unique``), routes the unique IDs to their owning
   shards by a stable hash and gathers the rows,
4. pools every slot with one fused ``embedding_bag`` over the whole group: a *bag* is a sample
   (summation slots, optionally weighted by ``1/sqrt(n)``) or one position of a sample's padded
   sequence (raw slots, ``embedding_summation: false``; a hash-stacked ID's rounds are summed).

Backward reverses step 4 with one ``index_add_`` per dim group: pooled gradients are scattered
to the unique IDs (with the same ``1/sqrt(n)`` weights), rows with NaN/Inf are skipped and
counted, and each shard receives the summed gradient of the rows it owns. There is no per-ID
Python loop anywhere; Python loops run over slots and shards only.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np
import torch

from embedding_store.batch import Batch, IDTypeFeature, IDTypeFeatureWithSingleID
from embedding_store.config import EmbeddingConfig, SlotConfig
from embedding_store.errors import BatchValidationError, InvalidArgumentError, NotFoundError
from embedding_store.hashing import shard_of, splitmix64
from embedding_store.interfaces import ParameterServer
from embedding_store.shard import EmbeddingShard

IdFeature = IDTypeFeature | IDTypeFeatureWithSingleID


@dataclass(frozen=True)
class SlotOutput:
    """Embeddings of one slot for one batch.

    ``embeddings`` is float32 [batch, dim] for summation slots, or float32
    [batch, sample_fixed_size, dim] for raw slots, whose ``mask`` (bool [batch,
    sample_fixed_size]) is True where a real ID sits; padding rows are zeros.
    """

    name: str
    embeddings: torch.Tensor
    mask: torch.Tensor | None = None


@dataclass(frozen=True)
class LookupResult:
    """The worker's answer to one batch: slot outputs in the batch's feature order.

    ``ref`` identifies the forward context kept for :meth:`EmbeddingWorker.backward`
    (train lookups only, else None).
    """

    slots: tuple[SlotOutput, ...]
    ref: int | None = None

    def slot(self, name: str) -> SlotOutput:
        for output in self.slots:
            if output.name == name:
                return output
        raise NotFoundError(f"no slot {name!r} in this lookup result")


@dataclass(frozen=True)
class BackwardStats:
    """What one backward pass pushed: unique rows sent, and rows skipped for NaN/Inf."""

    rows_pushed: int
    nonfinite_rows_skipped: int


@dataclass(frozen=True)
class _SlotLayout:
    """Where one slot's bags sit inside its dim group's bag list."""

    name: str
    config: SlotConfig
    batch_size: int
    first_bag: int
    num_bags: int
    lengths: np.ndarray  # int64 [batch]: IDs per sample before truncation


@dataclass(frozen=True)
class _GroupPlan:
    """Everything needed to pool one dim group, and to scatter its gradients back.

    ``ids`` uint64 [n]: table IDs of every occurrence, ordered by bag; ``bag_lengths`` int64
    [num_bags]; ``bag_offsets`` int64 [num_bags] (torch, for ``embedding_bag``);
    ``id_weights`` float32 [n] or None (``1/sqrt(n)`` pooling weights).
    """

    dim: int
    slots: tuple[_SlotLayout, ...]
    ids: np.ndarray
    bag_lengths: np.ndarray
    bag_offsets: torch.Tensor
    id_weights: torch.Tensor | None
    num_bags: int

    def bag_of_id(self) -> torch.Tensor:
        """Bag index of every ID occurrence: int64 [n]."""
        return torch.repeat_interleave(torch.arange(self.num_bags), torch.tensor(self.bag_lengths))


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
        self._refs = itertools.count(1)
        self.expired_forward_contexts = 0
        self.nonfinite_rows_skipped = 0
        self._id_mask = np.uint64(embedding_config.id_mask)
        # Deduplicating costs a sort (~1 ms per 26k IDs here) and pays off only when it saves
        # traffic: by default only for shards that are not in this process.
        if deduplicate is None:
            deduplicate = not all(isinstance(shard, EmbeddingShard) for shard in self.shards)
        self.deduplicate = deduplicate

    # ------------------------------------------------------------------ forward
    def lookup(self, batch: Batch | Sequence[IdFeature], *, train: bool) -> LookupResult:
        """Embeddings for every ID feature of ``batch``.

        ``train=True`` inserts unknown IDs on the shards and keeps the forward context for
        :meth:`backward` (at most ``forward_buffer_size`` contexts; older ones expire).
        """
        features = batch.id_type_features if isinstance(batch, Batch) else tuple(batch)
        plans = self._plan(features)
        outputs: dict[str, SlotOutput] = {}
        for plan in plans:
            if self.deduplicate:
                unique, inverse = _unique(plan.ids)
                rows = self._gather(unique, plan.dim, train=train)
            else:
                rows = self._gather(plan.ids, plan.dim, train=train)
                inverse = torch.arange(len(plan.ids))
            pooled = torch.nn.functional.embedding_bag(
                inverse,
                rows,
                plan.bag_offsets,
                mode="sum",
                per_sample_weights=plan.id_weights,
            )
            for layout in plan.slots:
                outputs[layout.name] = _slot_output(layout, pooled, plan.dim)
        ref = self._remember(plans) if train else None
        return LookupResult(slots=tuple(outputs[f.name] for f in features), ref=ref)

    def _gather(self, ids: np.ndarray, dim: int, *, train: bool) -> torch.Tensor:
        """Rows of ``ids`` (uint64 [n]) from their owning shards: float32 [n, dim]."""
        num_shards = len(self.shards)
        if num_shards == 1:
            rows = self.shards[0].lookup(ids, dim, train=train)
            return torch.from_numpy(_as_rows(rows, len(ids), dim))
        owner = shard_of(ids, num_shards)
        gathered = np.empty((len(ids), dim), dtype=np.float32)

        def fetch(shard_index: int) -> None:
            picked = np.flatnonzero(owner == shard_index)
            if len(picked):
                rows = self.shards[shard_index].lookup(ids[picked], dim, train=train)
                gathered[picked] = _as_rows(rows, len(picked), dim)

        self._for_each_shard(fetch)
        return torch.from_numpy(gathered)

    def _for_each_shard(self, task) -> None:
        if self._executor is None:
            for s in range(len(self.shards)):
                task(s)
            return
        futures = [self._executor.submit(task, s) for s in range(len(self.shards))]
        for future in futures:
            future.result()  # re-raises the shard's error (it names the shard)

    # ------------------------------------------------------------------ backward
    def backward(self, ref: int, grads: Mapping[str, torch.Tensor | np.ndarray]) -> BackwardStats:
        """Scatter pooled gradients of forward ``ref`` to unique IDs and push them to shards.

        ``grads[slot]`` has the shape of that slot's output: float32 [batch, dim] (summation)
        or [batch, sample_fixed_size, dim] (raw). Slots without a gradient get zeros.
        """
        with self._pending_lock:
            plans = self._pending.pop(ref, None)
        if plans is None:
            raise NotFoundError(
                f"no forward context {ref}: it was already used or expired "
                f"(forward_buffer_size={self.forward_buffer_size})"
            )
        pushed = skipped = 0
        for plan in plans:
            bag_grads = torch.zeros(plan.num_bags, plan.dim, dtype=torch.float32)
            for layout in plan.slots:
                if layout.name in grads:
                    bag_grads[layout.first_bag : layout.first_bag + layout.num_bags] = (
                        _bag_gradient(layout, grads[layout.name], plan.dim)
                    )
            per_id = bag_grads.index_select(0, plan.bag_of_id())
            if plan.id_weights is not None:
                per_id = per_id * plan.id_weights.unsqueeze(1)
            unique, inverse = _unique(plan.ids)
            unique_grads = torch.zeros(len(unique), plan.dim, dtype=torch.float32)
            unique_grads.index_add_(0, inverse, per_id)
            finite = torch.isfinite(unique_grads).all(dim=1).numpy()
            skipped += int((~finite).sum())
            pushed += self._push(unique[finite], unique_grads.numpy()[finite])
        self.nonfinite_rows_skipped += skipped
        return BackwardStats(rows_pushed=pushed, nonfinite_rows_skipped=skipped)

    def _push(self, ids: np.ndarray, grads: np.ndarray) -> int:
        if len(ids) == 0:
            return 0
        num_shards = len(self.shards)
        if num_shards == 1:
            self.shards[0].update(ids, grads)
            return len(ids)
        owner = shard_of(ids, num_shards)

        def push(shard_index: int) -> None:
            picked = np.flatnonzero(owner == shard_index)
            if len(picked):
                self.shards[shard_index].update(ids[picked], np.ascontiguousarray(grads[picked]))

        self._for_each_shard(push)
        return len(ids)

    def _remember(self, plans: tuple[_GroupPlan, ...]) -> int:
        ref = next(self._refs)
        with self._pending_lock:
            self._pending[ref] = plans
            while len(self._pending) > self.forward_buffer_size:
                self._pending.popitem(last=False)
                self.expired_forward_contexts += 1
        return ref

    @property
    def pending_backward(self) -> int:
        """Number of forward contexts waiting for their backward pass."""
        return len(self._pending)

    # ------------------------------------------------------------------ planning
    def _plan(self, features: Sequence[IdFeature]) -> tuple[_GroupPlan, ...]:
        """Group slots by dim and build the bag layout of each group (vectorized per slot)."""
        if not features:
            raise BatchValidationError("the batch has no ID-type features to look up")
        by_dim: dict[int, list[tuple[IdFeature, SlotConfig]]] = {}
        for feature in features:
            config = self._slot_config(feature.name)
            by_dim.setdefault(config.dim, []).append((feature, config))
        return tuple(self._plan_group(dim, members) for dim, members in by_dim.items())

    def _slot_config(self, name: str) -> SlotConfig:
        if name not in self.embedding_config.slots_config:
            known = ", ".join(self.embedding_config.slot_names)
            raise BatchValidationError(
                f"ID feature {name!r} is not a slot of the embedding config (known: {known})"
            )
        return self.embedding_config.slots_config[name]

    def _plan_group(self, dim: int, members: list[tuple[IdFeature, SlotConfig]]) -> _GroupPlan:
        """Concatenate one dim group's slots into one bag list.

        Plain summation slots (the common case) are handled together with whole-array numpy
        calls; raw and hash-stacked slots take a per-slot path.
        """
        plain = [
            (f, c)
            for f, c in members
            if c.embedding_summation and c.hash_stack_config.hash_stack_rounds == 0
        ]
        special = [
            (f, c)
            for f, c in members
            if not (c.embedding_summation and c.hash_stack_config.hash_stack_rounds == 0)
        ]
        ids_parts: list[np.ndarray] = []
        length_parts: list[np.ndarray] = []
        weight_parts: list[np.ndarray | None] = []
        layouts: list[_SlotLayout] = []
        first_bag = 0
        if plain:
            ids, lengths, weights = self._plain_bags(plain)
            ids_parts.append(ids)
            length_parts.append(lengths)
            weight_parts.append(weights)
            for feature, config in plain:
                layouts.append(
                    _SlotLayout(
                        feature.name,
                        config,
                        feature.batch_size,
                        first_bag,
                        feature.batch_size,
                        feature.lengths,
                    )
                )
                first_bag += feature.batch_size
        for feature, config in special:
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
                    feature.lengths,
                )
            )
            first_bag += len(lengths)
        all_ids = _concat(ids_parts)
        bag_lengths = _concat(length_parts)
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
            dim=dim,
            slots=tuple(layouts),
            ids=all_ids,
            bag_lengths=bag_lengths,
            bag_offsets=torch.from_numpy(offsets),
            id_weights=id_weights,
            num_bags=first_bag,
        )

    def _plain_bags(
        self, members: list[tuple[IdFeature, SlotConfig]]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Summation slots without hash stack, all at once: one bag per sample.

        Returns (ids uint64 [n], bag lengths int64 [sum of batch sizes], weights float32 [n]
        or None).
        """
        values = _concat([f.values for f, _ in members])
        lengths = _concat([f.lengths for f, _ in members])
        if self.embedding_config.feature_index_prefix_bit:
            prefixes = np.array(
                [self.embedding_config.index_prefix(f.name) for f, _ in members], dtype=np.uint64
            )
            per_id_prefix = np.repeat(prefixes, [len(f.values) for f, _ in members])
            ids = (values & self._id_mask) | per_id_prefix
        else:
            ids = np.ascontiguousarray(values, dtype=np.uint64)
        weights = None
        if any(c.sqrt_scaling for _, c in members):
            bag_weights = _concat(
                [
                    _sqrt_weights(f.lengths)
                    if c.sqrt_scaling
                    else np.ones(f.batch_size, np.float32)
                    for f, c in members
                ]
            )
            weights = np.repeat(bag_weights, lengths)
        return ids, lengths, weights

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


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _sqrt_weights(lengths: np.ndarray) -> np.ndarray:
    """Per-sample pooling weight ``1/sqrt(n)`` (1 for empty samples): float32 [batch]."""
    return (1.0 / np.sqrt(np.maximum(lengths, 1))).astype(np.float32)


def _unique(ids: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
    """Unique IDs (uint64 [U]) and the position of each input ID among them (int64 [n])."""
    unique, inverse = torch.unique(
        torch.from_numpy(ids.view(np.int64)), sorted=False, return_inverse=True
    )
    return unique.numpy().view(np.uint64), inverse


def _as_rows(rows: np.ndarray, count: int, dim: int) -> np.ndarray:
    """Check a shard's answer: float32 [count, dim], or a clear error."""
    if rows.dtype != np.float32 or rows.shape != (count, dim):
        raise InvalidArgumentError(
            f"shard answered rows of dtype {rows.dtype} and shape {rows.shape}; "
            f"expected float32 {(count, dim)}"
        )
    return rows


def _slot_output(layout: _SlotLayout, pooled: torch.Tensor, dim: int) -> SlotOutput:
    bags = pooled[layout.first_bag : layout.first_bag + layout.num_bags]
    if layout.config.embedding_summation:
        return SlotOutput(layout.name, bags)
    fixed = layout.config.sample_fixed_size
    embeddings = bags.reshape(layout.batch_size, fixed, dim)
    positions = torch.arange(fixed).unsqueeze(0)
    mask = positions < torch.tensor(layout.lengths).unsqueeze(1)
    return SlotOutput(layout.name, embeddings, mask=mask)


def _bag_gradient(layout: _SlotLayout, grad: torch.Tensor | np.ndarray, dim: int) -> torch.Tensor:
    tensor = torch.as_tensor(grad, dtype=torch.float32)
    if layout.config.embedding_summation:
        expected: tuple[int, ...] = (layout.batch_size, dim)
    else:
        expected = (layout.batch_size, layout.config.sample_fixed_size, dim)
    if tuple(tensor.shape) != expected:
        raise InvalidArgumentError(
            f"gradient of slot {layout.name!r} has shape {tuple(tensor.shape)}; expected {expected}"
        )
    return tensor.reshape(layout.num_bags, dim)
