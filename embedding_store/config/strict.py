"""Strict, typed configuration loading: frozen dataclasses from YAML mappings and back.

:func:`from_mapping` builds a (frozen) dataclass recursively from the output of a YAML load,
driven by the dataclass field type hints. Nothing is coerced silently: a string is never an
integer, a ``1`` is never a boolean, unknown keys are rejected (with a did-you-mean) and missing
required keys are reported. Every failure is a :class:`~embedding_store.errors.ConfigError`
whose message reads ``<file>: <key.path>: <what was expected>, got <value>``.

Files are read by the YAML 1.2 core schema for numbers (see :class:`_StrictLoader`): ``1e6``
is a float, ``1:00`` and ``1_000`` are strings, and ``016`` (octal 14 to YAML 1.1 tools,
16 to YAML 1.2) is refused with a hint. An ``int`` field takes integers only: ``1e6`` or
``2.0`` is refused with the digits to write instead, never rounded.

Supported field types: ``int``, ``float`` (ints are accepted and widened, booleans are not),
``bool`` (real YAML booleans only), ``str``, ``Optional[X]`` / ``X | None`` (and unions tried
in order), ``list[X]``, ``tuple[X, ...]``, ``tuple[X, Y]``, ``dict[str, X]`` or
``Mapping[str, X]`` (insertion order kept), nested dataclasses, ``Enum`` subclasses (by
value), ``Literal[...]`` and ``Any``.

Range and cross-field checks live in each dataclass's ``__post_init__`` and raise
:class:`ConfigFieldError` with a key path *relative to that dataclass*. The loader catches it
and re-raises a :class:`ConfigError` carrying the file name and the full key path, so a check
written once reads well both from a file and from direct construction in Python.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import math
import os
import re
import types
from collections.abc import Iterator, Mapping
from typing import Any, Literal, TypeVar, Union, cast, get_args, get_origin, get_type_hints

import yaml

from embedding_store.errors import ConfigError

__all__ = [
    "ConfigFieldError",
    "LeadingZeroInteger",
    "describe_value",
    "dump_yaml",
    "from_mapping",
    "join_path",
    "load_yaml",
    "read_yaml_mapping",
    "require_int_in_range",
    "require_non_empty_str",
    "require_non_negative_int",
    "require_positive_int",
    "to_mapping",
]

T = TypeVar("T")

_MAX_REPR = 80
_TYPE_NAMES: dict[type, str] = {  # LeadingZeroInteger is added below its definition
    bool: "boolean",
    int: "integer",
    float: "float",
    str: "string",
    list: "list",
    tuple: "list",
    dict: "mapping",
    type(None): "null",
}


class ConfigFieldError(ConfigError):
    """A config dataclass's own check failed; ``key`` is relative to that dataclass.

    Raised from ``__post_init__``. When the dataclass is built by :func:`from_mapping` the
    loader turns it into a :class:`ConfigError` naming the file and the full key path.
    """

    def __init__(self, key: str, detail: str) -> None:
        super().__init__(f"{key}: {detail}" if key else detail)
        self.key = key
        self.detail = detail


# ----------------------------------------------------------------------------------------------
# Message helpers


def _repr_pieces(value: Any) -> Iterator[str]:
    """``repr(value)`` in pieces, lazily: lists, tuples and dicts piece by piece, so a caller
    can stop after a few. A YAML alias bomb (``&a [x, x, ...]``, ``&b [*a, *a, ...]``, ...)
    is small in memory (its lists are shared) but its full repr has billions of characters."""
    kind = type(value)
    if kind is list or kind is tuple:
        yield "[" if kind is list else "("
        for i, item in enumerate(value):
            if i:
                yield ", "
            yield from _repr_pieces(item)
        yield "]" if kind is list else ("," if len(value) == 1 else "") + ")"
    elif kind is dict:
        yield "{"
        for i, (key, item) in enumerate(value.items()):
            yield ", " if i else ""
            yield from _repr_pieces(key)
            yield ": "
            yield from _repr_pieces(item)
        yield "}"
    else:
        yield repr(value)


def _short_repr(value: Any) -> str:
    """``repr(value)``, cut to :data:`_MAX_REPR` characters (ending in ``...``) when longer;
    only as much of it is made as is shown."""
    text = ""
    for piece in _repr_pieces(value):
        text += piece
        if len(text) > _MAX_REPR:
            return text[: _MAX_REPR - 3] + "..."
    return text


def describe_value(value: Any) -> str:
    """``repr`` of ``value`` (shortened) followed by its YAML-ish type name in parentheses."""
    type_name = _TYPE_NAMES.get(type(value), type(value).__name__)
    return f"{_short_repr(value)} ({type_name})"


def join_path(prefix: str, key: str) -> str:
    """Append ``key`` (a name, or an index like ``[3]``) to the dotted key path ``prefix``."""
    if not prefix:
        return key
    if not key:
        return prefix
    if key.startswith("["):
        return prefix + key
    return f"{prefix}.{key}"


def _error(source: str, path: str, detail: str) -> ConfigError:
    return ConfigError(f"{source}: {path}: {detail}" if path else f"{source}: {detail}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _got(value: Any, type_ok: bool) -> str:
    # A value of the right type is shown bare ("got -3"); a wrong type also names its type.
    return _short_repr(value) if type_ok else describe_value(value)


#: The largest integer a config value may hold: counts and sizes end up in int64 arrays
#: and arithmetic (doubling a capacity, say), where a larger one overflows far from here.
MAX_CONFIG_INT = 2**62


def require_positive_int(key: str, value: Any, maximum: int = MAX_CONFIG_INT) -> None:
    """Raise :class:`ConfigFieldError` unless ``value`` is an int (not bool) in
    ``[1, maximum]``."""
    if not (_is_int(value) and value > 0):
        raise ConfigFieldError(
            key, f"expected a positive integer, got {_got(value, _is_int(value))}"
        )
    _require_at_most(key, value, maximum)


def require_non_negative_int(key: str, value: Any, maximum: int = MAX_CONFIG_INT) -> None:
    """Raise :class:`ConfigFieldError` unless ``value`` is an int (not bool) in
    ``[0, maximum]``."""
    if not (_is_int(value) and value >= 0):
        raise ConfigFieldError(
            key, f"expected a non-negative integer, got {_got(value, _is_int(value))}"
        )
    _require_at_most(key, value, maximum)


def _require_at_most(key: str, value: int, maximum: int) -> None:
    if value > maximum:
        # Large powers of two read better as such (2**40); small limits in decimal (65536).
        power = maximum >= 2**20 and maximum & (maximum - 1) == 0
        limit = f"2**{maximum.bit_length() - 1}" if power else maximum
        raise ConfigFieldError(key, f"expected at most {limit}, got {_short_repr(value)}")


def require_int_in_range(key: str, value: Any, low: int, high: int) -> None:
    """Raise :class:`ConfigFieldError` unless ``value`` is an int (not bool) in ``[low, high]``."""
    if not (_is_int(value) and low <= value <= high):
        raise ConfigFieldError(
            key, f"expected an integer in [{low}, {high}], got {_got(value, _is_int(value))}"
        )


def require_non_empty_str(key: str, value: Any) -> None:
    """Raise :class:`ConfigFieldError` unless ``value`` is a string with non-blank content."""
    if not (isinstance(value, str) and value.strip()):
        raise ConfigFieldError(
            key, f"expected a non-empty string, got {_got(value, isinstance(value, str))}"
        )


def _hint(value: Any) -> str:
    """How to write an integer that YAML read as something else, or ""."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        # 1e6 is a float (YAML 1.2): an integer field takes digits only, no silent rounding.
        return f": integers are written in digits only, e.g. {int(value)}"
    text = value.strip() if isinstance(value, str) else ""
    if re.fullmatch(r"[-+]?[0-9][0-9_:]*", text) and ("_" in text or ":" in text):
        # YAML 1.1 read 1_000 as 1000 and 1:00 as 60; YAML 1.2 (this loader) reads strings.
        return ": integers are written in plain decimal digits (no '_' or ':')"
    return ""


def _string_hint(value: Any) -> str:
    """How to write a string that YAML read as a boolean or a number, or "".

    A feature named ``no`` or ``on``, or a column named ``2024``, reads as False, True or an
    integer: the message shows that value, not what was typed, so it says why."""
    if isinstance(value, bool):
        return (
            ": YAML reads unquoted yes/no/on/off/true/false as booleans; quote it for a "
            "string (e.g. 'no')"
        )
    if isinstance(value, (int, float)):
        return ": quote it for a string"
    return ""


# ----------------------------------------------------------------------------------------------
# Mapping -> dataclass


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _init_fields(cls: type) -> tuple[dataclasses.Field, ...]:
    return tuple(f for f in dataclasses.fields(cls) if f.init)


def from_mapping(cls: type[T], data: Any, *, source: str, path: str = "") -> T:
    """Build dataclass ``cls`` from ``data`` (a ``yaml.safe_load`` result), strictly.

    ``source`` names the file (or other origin) in error messages; ``path`` is the key path of
    ``data`` inside that source ("" for the top level). Raises :class:`ConfigError`.
    """
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"from_mapping needs a dataclass type, got {cls!r}")
    return _build_dataclass(cls, data, source, path)


def _build_dataclass(cls: type[T], value: Any, source: str, path: str) -> T:
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        where = "" if path else " at the top level"
        raise _error(source, path, f"expected a mapping{where}, got {describe_value(value)}")
    # mypy does not see type[T] (a class) as Hashable for functools.cache; it is.
    hints = _type_hints(cast(type, cls))
    fields = _init_fields(cls)
    names = [f.name for f in fields]
    for key in value:
        if isinstance(key, str) and key in names:
            continue
        if isinstance(key, LeadingZeroInteger):
            raise _error(source, path, f"key {key.detail()}")
        if isinstance(key, str):
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise _error(
                source,
                join_path(path, key),
                f"unknown key{hint} (allowed keys: {', '.join(names)})",
            )
        raise _error(
            source,
            path,
            f"unknown key {describe_value(key)} (allowed keys: {', '.join(names)})",
        )
    kwargs: dict[str, Any] = {}
    for f in fields:
        sub = join_path(path, f.name)
        if f.name in value:
            kwargs[f.name] = _convert(hints[f.name], value[f.name], source, sub)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise _error(source, sub, "required key is missing")
    try:
        return cls(**kwargs)
    except ConfigFieldError as err:
        raise _error(source, join_path(path, err.key), err.detail) from None


def _convert(tp: Any, value: Any, source: str, path: str) -> Any:
    if isinstance(value, LeadingZeroInteger):
        raise _error(source, path, value.detail())
    if tp is Any:
        return value
    origin = get_origin(tp)
    args = get_args(tp)
    if origin is Union or origin is types.UnionType:
        return _convert_union(args, value, source, path)
    if origin is Literal:
        for choice in args:
            if type(choice) is type(value) and choice == value:
                return choice
        allowed = ", ".join(repr(a) for a in args)
        raise _error(source, path, f"expected one of {allowed}, got {describe_value(value)}")
    if origin in (list, tuple) or tp in (list, tuple):
        return _convert_sequence(tp, origin or tp, args, value, source, path)
    if origin in (dict, Mapping) or tp is dict:
        return _convert_dict(args, value, source, path)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _error(source, path, f"expected a boolean (true/false), got {describe_value(value)}")
    if tp is int:
        if _is_int(value):
            return value
        raise _error(
            source, path, f"expected an integer, got {describe_value(value)}{_hint(value)}"
        )
    if tp is float:
        if isinstance(value, float) or _is_int(value):
            return float(value)
        raise _error(source, path, f"expected a number, got {describe_value(value)}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise _error(
            source, path, f"expected a string, got {describe_value(value)}{_string_hint(value)}"
        )
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(value, tp):
            return value
        for member in tp:
            if type(member.value) is type(value) and member.value == value:
                return member
        allowed = ", ".join(repr(m.value) for m in tp)
        raise _error(source, path, f"expected one of {allowed}, got {describe_value(value)}")
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _build_dataclass(tp, value, source, path)
    raise TypeError(f"unsupported config field type {tp!r} at {path!r}")


def _convert_union(args: tuple[Any, ...], value: Any, source: str, path: str) -> Any:
    none_type = type(None)
    if value is None and none_type in args:
        return None
    arms = [a for a in args if a is not none_type]
    if len(arms) == 1:
        if value is None:
            raise _error(source, path, "expected a value, got null")
        return _convert(arms[0], value, source, path)
    failures: list[tuple[Any, ConfigError]] = []
    for arm in arms:
        try:
            return _convert(arm, value, source, path)
        except ConfigError as error:
            failures.append((arm, error))
    # A list or mapping that one arm takes by its shape failed on an item: that arm's error
    # names the item and why ("positive[0]: expected a string, got True ... quote it"), where
    # the union's own read "expected str or list or null, got [True, '1'] (list)".
    shaped = [error for arm, error in failures if _takes_shape_of(arm, value)]
    if len(shaped) == 1:
        raise shaped[0]
    names = " or ".join(getattr(a, "__name__", repr(a)) for a in arms)
    if none_type in args:
        names += " or null"
    hint = _string_hint(value) if str in arms else ""
    raise _error(source, path, f"expected {names}, got {describe_value(value)}{hint}")


def _takes_shape_of(tp: Any, value: Any) -> bool:
    """Whether ``tp`` is a list, tuple, mapping or dataclass type and ``value`` of that kind."""
    container = get_origin(tp) or tp
    if container in (list, tuple):
        return isinstance(value, (list, tuple))
    if container in (dict, Mapping) or (isinstance(tp, type) and dataclasses.is_dataclass(tp)):
        return isinstance(value, Mapping)
    return False


def _convert_sequence(
    tp: Any, container: type, args: tuple[Any, ...], value: Any, source: str, path: str
) -> Any:
    if not isinstance(value, (list, tuple)):
        raise _error(source, path, f"expected a list, got {describe_value(value)}")
    if container is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
        if len(value) != len(args):
            raise _error(
                source,
                path,
                f"expected a list of exactly {len(args)} items, got {describe_value(value)}",
            )
        return tuple(
            _convert(a, v, source, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value))
        )
    item_type = args[0] if args else Any
    items = [_convert(item_type, v, source, f"{path}[{i}]") for i, v in enumerate(value)]
    return tuple(items) if container is tuple else items


def _convert_dict(args: tuple[Any, ...], value: Any, source: str, path: str) -> dict[Any, Any]:
    if not isinstance(value, Mapping):
        raise _error(source, path, f"expected a mapping, got {describe_value(value)}")
    key_type, value_type = args if args else (Any, Any)
    out: dict[Any, Any] = {}
    for key, item in value.items():
        if isinstance(key, LeadingZeroInteger):
            raise _error(source, path, f"key {key.detail()}")
        if key_type is str and not isinstance(key, str):
            raise _error(
                source,
                path,
                f"keys must be strings, got key {describe_value(key)}{_string_hint(key)}",
            )
        sub = join_path(path, str(key))
        out[_convert(key_type, key, source, sub)] = _convert(value_type, item, source, sub)
    return out


# ----------------------------------------------------------------------------------------------
# dataclass -> mapping


def to_mapping(obj: Any) -> dict[str, Any]:
    """Inverse of :func:`from_mapping`: plain dicts, lists, str, int, float, bool and None.

    Enums become their values and tuples become lists, so the result is safe for
    :func:`dump_yaml` and JSON, and ``from_mapping(type(obj), to_mapping(obj)) == obj``.
    """
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        raise TypeError(f"to_mapping needs a dataclass instance, got {type(obj).__name__}")
    return _to_plain(obj)


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_plain(getattr(value, f.name)) for f in _init_fields(type(value))}
    if isinstance(value, enum.Enum):
        return _to_plain(value.value)
    if isinstance(value, Mapping):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    return value


# ----------------------------------------------------------------------------------------------
# Files


_INT_TAG = "tag:yaml.org,2002:int"
_FLOAT_TAG = "tag:yaml.org,2002:float"
_LEADING_ZERO_TAG = "tag:recserve,2024:leading-zero-int"
_TIMESTAMP_TAG = "tag:yaml.org,2002:timestamp"
#: YAML 1.2 core schema numbers (PyYAML implements YAML 1.1, where ``016`` is octal 14,
#: ``1:00`` is sexagesimal 60, ``1_000`` is 1000 and ``1e6`` is a string).
#: The longest integer literal read: far beyond any config value (MAX_CONFIG_INT has 19
#: digits), far below Python's 4300-digit conversion limit.
_MAX_INT_CHARACTERS = 100
_LEADING_ZERO_RE = re.compile(r"^[-+]?0[0-9]+$")
_INT_RE = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
_FLOAT_RE = re.compile(
    r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)


class LeadingZeroInteger:
    """A plain YAML scalar like ``016``: octal 14 to YAML 1.1 tools, decimal 16 to YAML 1.2.

    The loader keeps it as this marker instead of guessing, and :func:`from_mapping` refuses
    it wherever it appears, naming the key path and the way to write what was meant.
    """

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LeadingZeroInteger) and other.text == self.text

    def __hash__(self) -> int:
        return hash((LeadingZeroInteger, self.text))

    def detail(self) -> str:
        """Why it is refused and what to write instead."""
        sign = "-" if self.text.startswith("-") else ""
        digits = self.text.lstrip("+-").lstrip("0") or "0"
        octal = f"; octal {self.text} is {sign}0o{digits}" if set(digits) <= set("1234567") else ""
        return (
            f"integer {self.text} has a leading zero, which YAML 1.1 tools read as octal and "
            f"YAML 1.2 as decimal: write {sign}{digits}{octal}, or quote it for a string"
        )


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> Any:
    text = loader.construct_scalar(node)
    if _LEADING_ZERO_RE.match(text):
        return LeadingZeroInteger(text)
    if not _INT_RE.match(text):
        raise yaml.constructor.ConstructorError(
            None, None, f"invalid integer {text!r} (YAML 1.2 core schema)", node.start_mark
        )
    if len(text) > _MAX_INT_CHARACTERS:
        # Python refuses to convert (and to print) integers of more than 4300 decimal
        # digits with a ValueError, which ended the command in a traceback.
        raise yaml.constructor.ConstructorError(
            None,
            None,
            f"integer of {len(text)} characters, too large for any config value",
            node.start_mark,
        )
    return int(text, 0)


def _construct_float(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> float:
    text = loader.construct_scalar(node)
    if not _FLOAT_RE.match(text):
        raise yaml.constructor.ConstructorError(
            None, None, f"invalid float {text!r} (YAML 1.2 core schema)", node.start_mark
        )
    lowered = text.lower()
    if lowered.endswith(".inf"):
        return -math.inf if lowered.startswith("-") else math.inf
    if lowered == ".nan":
        return math.nan
    return float(text)


def _core_schema_resolvers() -> dict[Any, list[tuple[str, re.Pattern[str]]]]:
    """SafeLoader's implicit resolvers with YAML 1.2 core numbers and no timestamps.

    Booleans (``true``/``false`` and YAML 1.1's ``yes``/``no``/``on``/``off``) and nulls are
    kept: fields that are not booleans refuse a boolean anyway, naming it.
    """
    replaced = {_INT_TAG, _FLOAT_TAG, _TIMESTAMP_TAG}
    resolvers = {
        first: [(tag, regexp) for tag, regexp in entries if tag not in replaced]
        for first, entries in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    for tag, regexp, firsts in (
        (_LEADING_ZERO_TAG, _LEADING_ZERO_RE, "-+0"),  # before the int: 016 matches both
        (_INT_TAG, _INT_RE, "-+0123456789"),
        (_FLOAT_TAG, _FLOAT_RE, "-+.0123456789"),
    ):
        for first in firsts:
            resolvers.setdefault(first, []).append((tag, regexp))
    return {first: entries for first, entries in resolvers.items() if entries}


class _StrictLoader(yaml.SafeLoader):
    """``SafeLoader`` that rejects duplicate keys in a mapping (YAML would keep the last) and
    resolves numbers by the YAML 1.2 core schema: ``16``, ``-3``, ``0o17``, ``0x1F`` are
    integers; ``1.5``, ``1e6``, ``.5``, ``.inf``, ``.nan`` are floats; ``1:00`` and ``1_000``
    are strings; ``016`` is a :class:`LeadingZeroInteger` (refused by :func:`from_mapping`).
    """

    yaml_implicit_resolvers = _core_schema_resolvers()

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                    seen.add(key)
                except TypeError:  # unhashable: the base class reports it
                    continue
                if duplicate:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping",
                        node.start_mark,
                        f"found duplicate key {key!r}",
                        key_node.start_mark,
                    )
        return super().construct_mapping(node, deep=deep)


_TYPE_NAMES[LeadingZeroInteger] = "integer with a leading zero"
_StrictLoader.add_constructor(_INT_TAG, _construct_int)
_StrictLoader.add_constructor(_LEADING_ZERO_TAG, _construct_int)
_StrictLoader.add_constructor(_FLOAT_TAG, _construct_float)


class _StrictDumper(yaml.SafeDumper):
    """``SafeDumper`` whose plain strings read back as strings under :class:`_StrictLoader`:
    PyYAML quotes what YAML 1.1 would read as another type, but leaves ``1e6`` or ``0o17``
    plain, which YAML 1.2 (and this loader) reads as numbers."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    # resolve() is called on the class: it reads class attributes only.
    implicit_tag = _StrictLoader.resolve(_StrictLoader, yaml.ScalarNode, value, (True, False))
    style = "'" if implicit_tag != "tag:yaml.org,2002:str" else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_StrictDumper.add_representer(str, _represent_str)


def dump_yaml(data: Any, **options: Any) -> str:
    """``data`` as YAML text that :func:`read_yaml_mapping` reads back equal (strings that
    YAML 1.2 would read as numbers are quoted); ``options`` as for ``yaml.dump``."""
    return yaml.dump(data, Dumper=_StrictDumper, **options)


#: The largest config file read: configs are kilobytes (a thousand slots take ~100 KiB).
MAX_CONFIG_BYTES = 16 * 2**20


def read_yaml_mapping(path: str | os.PathLike[str], *, source: str | None = None) -> dict[str, Any]:
    """Read a YAML file whose top level is a mapping (an empty file reads as ``{}``).

    Numbers resolve by the YAML 1.2 core schema (see :class:`_StrictLoader`). Missing or
    unreadable files, syntax errors (with line and column), duplicate keys and a non-mapping
    top level are :class:`ConfigError` naming the file (``source``, by default the path).
    """
    source = os.fspath(path) if source is None else source
    try:
        with open(path, "rb") as handle:
            # Bounded: a mistyped path can name a checkpoint's gigabytes, or /dev/zero.
            raw = handle.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"{source}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{source}: is a directory, expected a YAML config file") from None
    except OSError as err:
        raise ConfigError(f"{source}: cannot read config file: {err.strerror or err}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{source}: larger than {MAX_CONFIG_BYTES // 2**20} MiB, expected a YAML config file"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{source}: not valid UTF-8 text ({err.reason})") from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass: safe
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        problem = err.problem or err.context or "invalid YAML"
        if mark is None:
            raise ConfigError(f"{source}: YAML syntax error: {problem}") from None
        raise ConfigError(
            f"{source}: YAML syntax error at line {mark.line + 1}, column {mark.column + 1}: "
            f"{problem}"
        ) from None
    except yaml.reader.ReaderError as err:
        # Its own text spans two lines and names '"<unicode string>", position N'.
        line = text.count("\n", 0, err.position) + 1
        column = err.position - (text.rfind("\n", 0, err.position) + 1) + 1
        raise ConfigError(
            f"{source}: YAML syntax error at line {line}, column {column}: character "
            f"{chr(err.character)!r} (#x{err.character:04x}) is not allowed in YAML"
        ) from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{source}: invalid YAML: {err}") from None
    except RecursionError:
        # PyYAML composes nested nodes recursively: a few hundred levels ([[[...]]]) exceed
        # Python's recursion limit, which ended the command in a traceback.
        raise ConfigError(
            f"{source}: nested too deeply to read (lists or mappings hundreds of levels "
            "deep), expected a YAML config file"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source}: expected a mapping at the top level, got {describe_value(data)}"
        )
    return data


def load_yaml(cls: type[T], path: str | os.PathLike[str], *, source: str | None = None) -> T:
    """Read the YAML file at ``path`` and build dataclass ``cls`` from it strictly; errors
    name ``source`` (by default the path)."""
    source = os.fspath(path) if source is None else source
    return from_mapping(cls, read_yaml_mapping(path, source=source), source=source)
