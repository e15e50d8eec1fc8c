"""Initialization and admission (embedding_store.initializer) against a pure-Python SplitMix64
reference of the documented formulas, and the checks on InitializationConfig."""

from __future__ import annotations

import math

import numpy as np
import pytest

from embedding_store.errors import ConfigError, InvalidArgumentError
from embedding_store.initializer import InitializationConfig, admitted, initial_vectors

_MASK = 2**64 - 1
_GOLDEN = 0x9E3779B97F4A7C15
_INIT_SALT = 0xA0761D6478BD642F
_ADMIT_SALT = 0xE7037ED1A0B428DB


def _mix(z: int) -> int:
    """SplitMix64's finalizer."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _uniform(h: int) -> float:
    """The top 53 bits of a hash as a float64 in [0, 1)."""
    return (h >> 11) * 2.0**-53


def _reference_row(id_: int, dim: int, low: float, high: float, seed: int) -> list[np.float32]:
    """Column c: SplitMix64 step c + 1 of a stream seeded with mix(id ^ mix(seed ^ salt))."""
    state = _mix(id_ ^ _mix(seed ^ _INIT_SALT))
    row = []
    for _ in range(dim):
        state = (state + _GOLDEN) & _MASK
        row.append(np.float32(low + (high - low) * _uniform(_mix(state))))
    return row


def _admission_uniform(id_: int, seed: int) -> float:
    return _uniform(_mix(((id_ ^ _mix(seed ^ _ADMIT_SALT)) + _GOLDEN) & _MASK))


IDS = [0, 1, 7, 123456789, 2**63, 2**64 - 1]


@pytest.mark.parametrize(("low", "high", "seed"), [(-0.01, 0.01, 0), (0.5, 2.0, 2**64 - 1)])
def test_initial_vectors_match_the_splitmix64_reference(low: float, high: float, seed: int) -> None:
    """Rows are a pure function of (id, column, seed): exactly the documented stream, so they
    stay the same across versions, shards and replicas."""
    config = InitializationConfig(low=low, high=high, seed=seed)
    got = initial_vectors(np.array(IDS, np.uint64), 5, config)
    expected = np.array([_reference_row(i, 5, low, high, seed) for i in IDS], np.float32)
    np.testing.assert_array_equal(got, expected)


def test_admission_matches_the_reference_and_is_strictly_below_p() -> None:
    """An ID is admitted when its hash, as a uniform in [0, 1), is *below* admit_probability:
    a probability equal to its uniform rejects it, the next float up admits it."""
    seed = 9
    ids = np.array(IDS, np.uint64)
    uniforms = [_admission_uniform(i, seed) for i in IDS]
    config = InitializationConfig(admit_probability=0.5, seed=seed)
    assert admitted(ids, config).tolist() == [u < 0.5 for u in uniforms]
    u = uniforms[1]
    assert 0.0 < u < 1.0
    one = np.array([1], np.uint64)
    assert not admitted(one, InitializationConfig(admit_probability=u, seed=seed))[0]
    next_up = math.nextafter(u, 1.0)
    assert admitted(one, InitializationConfig(admit_probability=next_up, seed=seed))[0]


def test_weight_bound_clamps_both_sides_to_the_nearest_bound() -> None:
    """Initial values below -weight_bound become -weight_bound, above it +weight_bound."""
    ids = np.arange(2000, dtype=np.uint64)
    raw = initial_vectors(ids, 4, InitializationConfig(low=-1, high=1))
    clamped = initial_vectors(ids, 4, InitializationConfig(low=-1, high=1, weight_bound=0.25))
    np.testing.assert_array_equal(clamped, np.clip(raw, np.float32(-0.25), np.float32(0.25)))
    assert (clamped == np.float32(-0.25)).any() and (clamped == np.float32(0.25)).any()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"low": 0.5, "high": 0.5}, r"low \(0\.5\) must be < initialization\.high \(0\.5\)"),
        ({"low": 1.0, "high": 0.0}, r"low \(1\.0\) must be < initialization\.high \(0\.0\)"),
        ({"low": True}, "initialization.low must be a number, got True"),
        ({"high": "1"}, "initialization.high must be a number, got '1'"),
        ({"high": math.inf}, "initialization.high must be finite, got inf"),
        ({"admit_probability": math.nan}, "admit_probability must be finite, got nan"),
        ({"weight_bound": math.inf}, "weight_bound must be finite, got inf"),
        ({"seed": True}, "initialization.seed must be an integer, got True"),
        ({"seed": 1.0}, "initialization.seed must be an integer, got 1.0"),
    ],
)
def test_invalid_settings_are_refused(settings: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        InitializationConfig(**settings)


@pytest.mark.parametrize(
    ("ids", "actual"),
    [
        (np.array([1, 2], np.int64), r"int64\[2\]"),
        (np.zeros((2, 1), np.uint64), r"uint64\[2, 1\]"),
        ([1, 2], "list"),
    ],
)
def test_ids_must_be_a_1d_uint64_array(ids: object, actual: str) -> None:
    for call in (lambda: initial_vectors(ids, 2), lambda: admitted(ids)):  # type: ignore[arg-type]
        with pytest.raises(
            InvalidArgumentError, match=rf"ids must be a uint64 \[n\] array, got {actual}"
        ):
            call()


def test_numpy_numbers_are_numbers() -> None:
    """A numpy scalar is a number, as the optimizers and the seed already take it (a value
    read from an array, e.g. np.float32(0.05), used to be refused as "not a number")."""
    config = InitializationConfig(
        low=np.float32(-0.5),
        high=np.int64(1),
        admit_probability=np.float32(0.5),
        weight_bound=np.float16(0.25),
        seed=np.uint64(3),
    )
    assert config.to_dict() == {
        "low": -0.5,
        "high": 1.0,
        "admit_probability": 0.5,
        "weight_bound": 0.25,
        "seed": 3,
    }
    assert all(type(v) is float for v in (config.low, config.high, config.admit_probability))
    assert type(config.weight_bound) is float
    with pytest.raises(ConfigError, match=r"initialization\.low must be a number, got np\.True_"):
        InitializationConfig(low=np.True_)
    with pytest.raises(
        ConfigError, match=r"initialization\.high must be finite, got np\.float32\(inf\)"
    ):
        InitializationConfig(high=np.float32("inf"))
