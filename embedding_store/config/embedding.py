"""``embedding_config.yml``: the sparse features (slots), their tables and ID spaces.

Key names follow PERSIA. Each slot is one sparse feature with its own embedding dim; slots
listed together in a feature group share one ID space and therefore one table (so they must
have the same dim). With ``feature_index_prefix_bit = b > 0`` every ID space gets a number,
starting at 1 (first the feature groups in declaration order, then each ungrouped slot in
``slots_config`` order), and an ID is stored in the tables as
``(raw_id & id_mask) | (index << (64 - b))``. With ``b = 0`` IDs are stored unchanged.
"""

from __future__ import annotations

import difflib
import os
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from embedding_store.config.strict import (
    ConfigFieldError,
    from_mapping,
    load_yaml,
    require_int_in_range,
    require_non_negative_int,
    require_positive_int,
    to_mapping,
)
from embedding_store.errors import ConfigError, NotFoundError

__all__ = [
    "EMBEDDING_CONFIG_ENV",
    "EMBEDDING_CONFIG_FLAG",
    "MAX_DIM",
    "MAX_FEATURE_INDEX_PREFIX_BIT",
    "MAX_HASH_STACK_EMBEDDING_SIZE",
    "MAX_HASH_STACK_ROUNDS",
    "MAX_SAMPLE_FIXED_SIZE",
    "EmbeddingConfig",
    "HashStackConfig",
    "SlotConfig",
    "embedding_config_from_mapping",
    "embedding_config_to_mapping",
    "load_embedding_config",
]

EMBEDDING_CONFIG_ENV = "RECSERVE_EMBEDDING_CONFIG"
EMBEDDING_CONFIG_FLAG = "--embedding-config"
MAX_FEATURE_INDEX_PREFIX_BIT = 16
#: Realistic maxima: the first lookup allocates ``batch x sample_fixed_size x dim`` floats
#: (and ``hash_stack_rounds`` rows per ID), so a typo like ``dim: 1600000`` would otherwise
#: load fine and then try to allocate gigabytes to terabytes far from the config file.
MAX_DIM = 65536
MAX_SAMPLE_FIXED_SIZE = 100_000
MAX_HASH_STACK_ROUNDS = 64
#: Rows per hash-stacking round: at most a shard's capacity limit (2**40), so that
#: ``hash_stack_rounds x embedding_size`` (<= 2**46) stays below the ID mask of every
#: ``feature_index_prefix_bit`` (48 bits at 16 prefix bits).
MAX_HASH_STACK_EMBEDDING_SIZE = 2**40
_ALL_BITS = (1 << 64) - 1
#: The suffix of a jagged ID feature's lengths input over KServe v2 (serving.tensor_specs,
#: which this package does not import).
_LENGTHS_SUFFIX = ".lengths"


#: Unicode categories of characters no slot or group name may hold: control (Cc), format
#: (Cf: zero-width spaces and joiners, direction marks, the BOM) and line/paragraph separators.
_INVISIBLE_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp"})


def _name_problem(name: str) -> str | None:
    """Why ``name`` (non-blank) cannot name a slot or feature group, or None. A name is an
    input tensor name and a key in requests and checkpoints: "user\u200b" or "user " loads,
    then looks like "user" in every message while it never matches it."""
    if name != name.strip():
        return "has leading or trailing whitespace"
    for char in name:
        category = unicodedata.category(char)
        if category in _INVISIBLE_CATEGORIES:
            return (
                f"contains the invisible or control character {char!r} "
                f"(U+{ord(char):04X}, category {category})"
            )
    return None


def _require_bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigFieldError(key, f"expected a boolean (true/false), got {value!r}")


@dataclass(frozen=True)
class HashStackConfig:
    """Hash stacking: map each raw ID to ``hash_stack_rounds`` rows, round ``r`` among its own
    ``embedding_size`` rows, so the feature uses at most ``hash_stack_rounds x embedding_size``
    rows (size shard capacity for that).

    ``hash_stack_rounds = 0`` disables it (one row per distinct ID).
    """

    hash_stack_rounds: int = 0
    embedding_size: int = 0

    def __post_init__(self) -> None:
        require_non_negative_int(
            "hash_stack_rounds", self.hash_stack_rounds, maximum=MAX_HASH_STACK_ROUNDS
        )
        require_non_negative_int(
            "embedding_size", self.embedding_size, maximum=MAX_HASH_STACK_EMBEDDING_SIZE
        )
        if self.hash_stack_rounds > 0 and self.embedding_size <= 0:
            raise ConfigFieldError(
                "embedding_size",
                "expected a positive integer when hash_stack_rounds > 0 "
                f"(hash_stack_rounds is {self.hash_stack_rounds}), got {self.embedding_size}",
            )

    @property
    def enabled(self) -> bool:
        """Whether hash stacking is on."""
        return self.hash_stack_rounds > 0


@dataclass(frozen=True)
class SlotConfig:
    """One sparse feature: its embedding dim and how its IDs of one sample are pooled."""

    dim: int
    embedding_summation: bool = True
    sqrt_scaling: bool = False
    sample_fixed_size: int = 10
    hash_stack_config: HashStackConfig = field(default_factory=HashStackConfig)

    def __post_init__(self) -> None:
        require_positive_int("dim", self.dim, maximum=MAX_DIM)
        _require_bool("embedding_summation", self.embedding_summation)
        _require_bool("sqrt_scaling", self.sqrt_scaling)
        require_positive_int(
            "sample_fixed_size", self.sample_fixed_size, maximum=MAX_SAMPLE_FIXED_SIZE
        )
        if not isinstance(self.hash_stack_config, HashStackConfig):
            raise ConfigFieldError(
                "hash_stack_config",
                f"expected a HashStackConfig, got {type(self.hash_stack_config).__name__}",
            )
        if self.sqrt_scaling and not self.embedding_summation:
            raise ConfigFieldError(
                "sqrt_scaling",
                "sqrt_scaling: true needs embedding_summation: true (only a summed embedding "
                "is scaled), got sqrt_scaling: true with embedding_summation: false",
            )


@dataclass(frozen=True)
class EmbeddingConfig:
    """All slots, their feature groups and the ID prefix layout.

    Derived lookups (slot order, ID space of each slot, prefixes, mask) are computed once at
    construction. Frozen all the way down: the mappings are read-only views and the groups'
    members tuples, so nothing can change a config that other objects derived state from.
    """

    slots_config: Mapping[str, SlotConfig]
    feature_index_prefix_bit: int = 8
    feature_groups: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    _slot_names: tuple[str, ...] = field(init=False, repr=False, compare=False)
    _id_spaces: tuple[str, ...] = field(init=False, repr=False, compare=False)
    _id_space_of: dict[str, str] = field(init=False, repr=False, compare=False)
    _prefix_of: dict[str, int] = field(init=False, repr=False, compare=False)
    _id_mask: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        bit = self.feature_index_prefix_bit
        require_int_in_range("feature_index_prefix_bit", bit, 0, MAX_FEATURE_INDEX_PREFIX_BIT)
        slots = self.slots_config
        if not isinstance(slots, Mapping) or not slots:
            raise ConfigFieldError("slots_config", f"expected at least one slot, got {slots!r}")
        for name, slot in slots.items():
            if not isinstance(name, str) or not name.strip():
                raise ConfigFieldError(
                    "slots_config", f"slot names must be non-empty, got {name!r}"
                )
            problem = _name_problem(name)
            if problem:
                raise ConfigFieldError("slots_config", f"slot name {name!r} {problem}")
            if not isinstance(slot, SlotConfig):
                raise ConfigFieldError(
                    f"slots_config.{name}", f"expected a SlotConfig, got {type(slot).__name__}"
                )
            base = name.removesuffix(_LENGTHS_SUFFIX)
            if base != name and base in slots:
                # Found only when serving the trained model (check_input_names), after a
                # whole training run: the lengths of a jagged `base` are input `base.lengths`.
                raise ConfigFieldError(
                    f"slots_config.{name}",
                    f"slot {name!r} is named like the {_LENGTHS_SUFFIX!r} input of slot "
                    f"{base!r}, which KServe v2 requests send as the lengths of a jagged ID "
                    "feature; rename one of them",
                )
        if not isinstance(self.feature_groups, Mapping):
            raise ConfigFieldError(
                "feature_groups", f"expected a mapping, got {type(self.feature_groups).__name__}"
            )

        # Read-only from here on (after the type checks above, which name the bad value).
        object.__setattr__(self, "slots_config", MappingProxyType(dict(slots)))
        slots = self.slots_config
        group_of: dict[str, str] = {}
        for group, members in self.feature_groups.items():
            key = f"feature_groups.{group}"
            if not isinstance(group, str) or not group.strip():
                raise ConfigFieldError(
                    "feature_groups", f"group names must be non-empty, got {group!r}"
                )
            problem = _name_problem(group)
            if problem:
                raise ConfigFieldError("feature_groups", f"group name {group!r} {problem}")
            if not isinstance(members, (list, tuple)) or not members:
                shown = list(members) if isinstance(members, tuple) else members  # as in YAML
                raise ConfigFieldError(
                    key, f"expected a non-empty list of slot names, got {shown!r}"
                )
            for i, member in enumerate(members):
                if member not in slots:
                    close = difflib.get_close_matches(str(member), list(slots), n=1)
                    hint = f"; did you mean {close[0]!r}?" if close else ""
                    raise ConfigFieldError(
                        f"{key}[{i}]",
                        f"unknown slot {member!r}{hint} (slots: {', '.join(slots)})",
                    )
                if member in group_of:
                    other = group_of[member]
                    detail = (
                        f"slot {member!r} is listed twice in feature group {group!r}"
                        if other == group
                        else f"slot {member!r} is in feature groups {other!r} and {group!r}; "
                        "a slot belongs to at most one group"
                    )
                    raise ConfigFieldError(f"{key}[{i}]", detail)
                group_of[member] = group
            dims = {member: slots[member].dim for member in members}
            if len(set(dims.values())) > 1:
                listing = ", ".join(f"{member}: {dim}" for member, dim in dims.items())
                raise ConfigFieldError(
                    key,
                    f"slots of feature group {group!r} share one ID space and one table, so "
                    f"they need the same dim, got dims {listing}",
                )
            stacks = {member: slots[member].hash_stack_config for member in members}
            if len(set(stacks.values())) > 1:
                listing = ", ".join(
                    f"{member}: (hash_stack_rounds {hs.hash_stack_rounds}, "
                    f"embedding_size {hs.embedding_size})"
                    for member, hs in stacks.items()
                )
                raise ConfigFieldError(
                    key,
                    f"slots of feature group {group!r} share one ID space and one table, so "
                    f"they need the same hash_stack_config, got {listing}",
                )

        object.__setattr__(
            self,
            "feature_groups",
            MappingProxyType({group: tuple(m) for group, m in self.feature_groups.items()}),
        )
        ungrouped = [name for name in slots if name not in group_of]
        for group in self.feature_groups:
            if group in slots and group not in group_of:
                raise ConfigFieldError(
                    f"feature_groups.{group}",
                    f"feature group name {group!r} collides with the ungrouped slot {group!r} "
                    "(both would name an ID space)",
                )
        id_spaces = (*self.feature_groups, *ungrouped)
        if bit > 0 and len(id_spaces) >= (1 << bit):
            raise ConfigFieldError(
                "feature_index_prefix_bit",
                f"{len(id_spaces)} ID spaces ({len(self.feature_groups)} feature groups + "
                f"{len(ungrouped)} ungrouped slots) do not fit in {bit} prefix bits, which hold "
                f"at most {(1 << bit) - 1} (prefix 0 is never used), got {bit}",
            )

        space_index = {space: i + 1 for i, space in enumerate(id_spaces)}
        id_space_of = {name: group_of.get(name, name) for name in slots}
        shift = 64 - bit
        prefix_of = {
            name: (space_index[space] << shift) if bit > 0 else 0
            for name, space in id_space_of.items()
        }
        object.__setattr__(self, "_slot_names", tuple(slots))
        object.__setattr__(self, "_id_spaces", id_spaces)
        object.__setattr__(self, "_id_space_of", id_space_of)
        object.__setattr__(self, "_prefix_of", prefix_of)
        object.__setattr__(self, "_id_mask", ((1 << shift) - 1) if bit > 0 else _ALL_BITS)

    # -- lookups ---------------------------------------------------------------------------

    @property
    def slot_names(self) -> tuple[str, ...]:
        """Slot names in ``slots_config`` order."""
        return self._slot_names

    @property
    def id_spaces(self) -> tuple[str, ...]:
        """ID space names in prefix order (index ``i`` has prefix number ``i + 1``)."""
        return self._id_spaces

    @property
    def id_mask(self) -> int:
        """Mask applied to raw IDs before the prefix is OR-ed in (all 64 bits when b = 0)."""
        return self._id_mask

    def _check_slot(self, name: str) -> None:
        if name not in self._prefix_of:
            raise NotFoundError(
                f"unknown slot {name!r}; known slots: {', '.join(self._slot_names)}"
            )

    def slot(self, name: str) -> SlotConfig:
        """The config of slot ``name``; :class:`NotFoundError` for an unknown slot."""
        self._check_slot(name)
        return self.slots_config[name]

    def index_prefix(self, slot_name: str) -> int:
        """The prefix OR-ed into every ID of ``slot_name`` (0 when b = 0)."""
        self._check_slot(slot_name)
        return self._prefix_of[slot_name]

    def id_space_of(self, slot_name: str) -> str:
        """The ID space (table) of ``slot_name``: its feature group, or the slot itself."""
        self._check_slot(slot_name)
        return self._id_space_of[slot_name]

    def prefix_ids(self, slot_name: str, ids: np.ndarray) -> np.ndarray:
        """Raw IDs (uint64 [n]) of ``slot_name`` -> IDs as stored in the table (uint64 [n])."""
        prefix = self.index_prefix(slot_name)
        ids = np.asarray(ids, dtype=np.uint64)
        if self.feature_index_prefix_bit == 0:
            return ids
        return (ids & np.uint64(self._id_mask)) | np.uint64(prefix)


def embedding_config_from_mapping(data: Any, source: str = "<mapping>") -> EmbeddingConfig:
    """Build an :class:`EmbeddingConfig` from a parsed YAML mapping; ``source`` names it."""
    return from_mapping(EmbeddingConfig, data, source=source)


def embedding_config_to_mapping(config: EmbeddingConfig) -> dict[str, Any]:
    """Plain-data form of ``config`` (inverse of :func:`embedding_config_from_mapping`)."""
    return to_mapping(config)


def load_embedding_config(path: str | os.PathLike[str] | None = None) -> EmbeddingConfig:
    """Load ``embedding_config.yml`` from ``path``, else from ``$RECSERVE_EMBEDDING_CONFIG``
    (its errors then name the variable too).

    There is no default embedding config: with neither given this is a :class:`ConfigError`.
    """
    if path is not None:
        return load_yaml(EmbeddingConfig, path)
    from_env = os.environ.get(EMBEDDING_CONFIG_ENV) or None
    if from_env is None:
        raise ConfigError(
            f"no embedding config given: pass {EMBEDDING_CONFIG_FLAG} PATH or set the "
            f"{EMBEDDING_CONFIG_ENV} environment variable to the embedding_config.yml path"
        )
    # Named with the variable: a path set in a shell or an .env file long ago is not where a
    # user looks when no flag names it.
    return load_yaml(EmbeddingConfig, from_env, source=f"{from_env} (from {EMBEDDING_CONFIG_ENV})")
