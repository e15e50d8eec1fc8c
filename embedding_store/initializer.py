"""Deterministic, counter-based initialization and admission of embedding rows.

Every value is a pure function of ``(id, column, seed)``: column ``c`` of ID ``x`` is
SplitMix64 step ``c + 1`` of a stream whose state starts at a seeded mix of ``x``, mapped to a
uniform float in ``[low, high)``. So an ID gets the same initial vector whatever the shard
count, the replica, the batch it arrives in or the order of IDs in that batch, and a column's
value does not depend on the row width ``dim``. Admission is likewise a pure function of
``(id, seed)``: an ID is admitted when its hash, as a uniform in ``[0, 1)``, is below
``admit_probability`` (a rejected ID stays rejected for that seed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit

from embedding_store.errors import ConfigError, InvalidArgumentError

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)
_S11 = np.uint64(11)
_INIT_SALT = np.uint64(0xA0761D6478BD642F)
_ADMIT_SALT = np.uint64(0xE7037ED1A0B428DB)
_TWO_POW_M53 = 1.0 / 9007199254740992.0  # 2**-53
_FLOAT32_MAX = float(np.finfo(np.float32).max)


@njit(cache=True, nogil=True)
def _mix(z: np.uint64) -> np.uint64:
    z = (z ^ (z >> _S30)) * _MIX1
    z = (z ^ (z >> _S27)) * _MIX2
    return z ^ (z >> _S31)


@njit(cache=True, nogil=True)
def _seed_state(seed: np.uint64, salt: np.uint64) -> np.uint64:
    return _mix(seed ^ salt)


@njit(cache=True, nogil=True)
def _init_kernel(
    ids: np.ndarray, seed: np.uint64, low: float, high: float, bound: float, out: np.ndarray
) -> None:
    """``out[i, c]`` = uniform in [low, high) from the hash of (ids[i], c, seed), clamped."""
    seed_state = _seed_state(seed, _INIT_SALT)
    span = high - low
    top = np.float32(high)
    # the largest float32 strictly below ``high``: float rounding must never yield ``high``
    below_top = np.nextafter(top, np.float32(-np.inf))
    lo_bound = np.float32(-bound)
    hi_bound = np.float32(bound)
    dim = out.shape[1]
    for i in range(ids.shape[0]):
        state = _mix(ids[i] ^ seed_state)
        for c in range(dim):
            state = state + _GOLDEN
            h = _mix(state)
            u = np.float64(h >> _S11) * _TWO_POW_M53
            v = np.float32(low + span * u)
            if v >= top:
                v = below_top
            if v < lo_bound:
                v = lo_bound
            elif v > hi_bound:
                v = hi_bound
            out[i, c] = v


@njit(cache=True, nogil=True)
def _admit_kernel(ids: np.ndarray, seed: np.uint64, p: float, out: np.ndarray) -> None:
    seed_state = _seed_state(seed, _ADMIT_SALT)
    for i in range(ids.shape[0]):
        h = _mix((ids[i] ^ seed_state) + _GOLDEN)
        out[i] = np.float64(h >> _S11) * _TWO_POW_M53 < p


def _finite(name: str, value: object) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ):
        raise ConfigError(f"initialization.{name} must be a number, got {value!r}")
    if not math.isfinite(float(value)):
        raise ConfigError(f"initialization.{name} must be finite, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class InitializationConfig:
    """How new rows are initialized and admitted.

    ``weight_bound`` (if set) clamps both initial vectors and every optimizer update to
    ``[-weight_bound, weight_bound]``.
    """

    low: float = -0.01
    high: float = 0.01
    admit_probability: float = 1.0
    weight_bound: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        low = _finite("low", self.low)
        high = _finite("high", self.high)
        for name, value in (("low", low), ("high", high)):
            # Rows are float32: a bound beyond its range makes initial values +-Inf (and a
            # span high - low beyond float64's, NaN), stored rows no update can mend.
            if abs(value) > _FLOAT32_MAX:
                raise ConfigError(
                    f"initialization.{name} must be within float32's range "
                    f"(+-{_FLOAT32_MAX:.7g}), got {value!r}"
                )
        if not low < high:
            raise ConfigError(f"initialization.low ({low}) must be < initialization.high ({high})")
        p = _finite("admit_probability", self.admit_probability)
        if not 0.0 < p <= 1.0:
            raise ConfigError(f"initialization.admit_probability must be in (0, 1], got {p}")
        bound = self.weight_bound
        if bound is not None:
            bound = _finite("weight_bound", bound)
            if bound <= 0:
                raise ConfigError(f"initialization.weight_bound must be > 0, got {bound}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)):
            raise ConfigError(f"initialization.seed must be an integer, got {self.seed!r}")
        if not 0 <= int(self.seed) < 2**64:
            raise ConfigError(f"initialization.seed must be in [0, 2**64), got {self.seed}")
        object.__setattr__(self, "low", low)
        object.__setattr__(self, "high", high)
        object.__setattr__(self, "admit_probability", p)
        object.__setattr__(self, "weight_bound", bound)
        object.__setattr__(self, "seed", int(self.seed))

    def to_dict(self) -> dict:
        return {
            "low": self.low,
            "high": self.high,
            "admit_probability": self.admit_probability,
            "weight_bound": self.weight_bound,
            "seed": self.seed,
        }


def _check_ids(ids: np.ndarray) -> np.ndarray:
    if not isinstance(ids, np.ndarray) or ids.dtype != np.uint64 or ids.ndim != 1:
        actual = (
            f"{ids.dtype}{list(ids.shape)}" if isinstance(ids, np.ndarray) else type(ids).__name__
        )
        raise InvalidArgumentError(f"ids must be a uint64 [n] array, got {actual}")
    return np.ascontiguousarray(ids)


def initial_vectors(
    ids: np.ndarray, dim: int, config: InitializationConfig | None = None
) -> np.ndarray:
    """Initial rows of ``ids`` (uint64 [n]) -> float32 [n, dim], deterministic per ID."""
    config = config or InitializationConfig()
    ids = _check_ids(ids)
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 1:
        raise InvalidArgumentError(f"dim must be a positive integer, got {dim!r}")
    out = np.empty((ids.shape[0], int(dim)), dtype=np.float32)
    bound = math.inf if config.weight_bound is None else config.weight_bound
    _init_kernel(ids, np.uint64(config.seed), config.low, config.high, bound, out)
    return out


def admitted(ids: np.ndarray, config: InitializationConfig | None = None) -> np.ndarray:
    """Which ``ids`` (uint64 [n]) are admitted -> bool [n]; deterministic per (id, seed)."""
    config = config or InitializationConfig()
    ids = _check_ids(ids)
    if config.admit_probability >= 1.0:
        return np.ones(ids.shape[0], dtype=bool)
    out = np.empty(ids.shape[0], dtype=np.bool_)
    _admit_kernel(ids, np.uint64(config.seed), config.admit_probability, out)
    return out
