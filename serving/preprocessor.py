"""``recserve serve --preprocessor MODULE:FUNCTION``: importing the user's function.

Light to import (no torch, no model): the supervisor of a ``--workers`` server imports the
preprocessor once before it starts its processes, so that a bad one is reported once (each
process then imports it again for its own use).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, cast

from embedding_store.errors import InvalidArgumentError, summary_with_origin

if TYPE_CHECKING:
    from embedding_store.batch import Batch

__all__ = ["load_preprocessor"]


def load_preprocessor(spec: str) -> Callable[[list[Mapping[str, Any]]], Batch]:
    """Import ``module:function`` (e.g. ``examples.adult_income.preprocess:instances_to_batch``).

    InvalidArgumentError naming the spec when it is not ``MODULE:FUNCTION``, cannot be
    imported (the module's own error and where it was raised), or is not callable."""
    if os.getcwd() not in sys.path:
        # Modules of the current folder (as uvicorn's --app-dir), but after the standard
        # library and installed packages: a server started in a folder others can write to
        # (/tmp) must not import their json.py or uvloop.py in place of the real ones.
        sys.path.append(os.getcwd())
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise InvalidArgumentError(f"--preprocessor must be MODULE:FUNCTION, got {spec!r}")
    try:
        function = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise InvalidArgumentError(f"cannot import preprocessor {spec!r}: {error}") from None
    except Exception as error:
        # The module itself raised on import (its SyntaxError, NameError, a failed config
        # read): a bare traceback that named neither the flag nor the spec otherwise.
        raise InvalidArgumentError(
            f"cannot import preprocessor {spec!r}: importing {module_name!r} raised "
            f"{summary_with_origin(error)}"
        ) from None
    if not callable(function):  # else every friendly request failed with a TypeError
        raise InvalidArgumentError(
            f"--preprocessor {spec!r} is not a function: got a {type(function).__name__}"
        )
    return cast("Callable[[list[Mapping[str, Any]]], Batch]", function)
