"""Scripts of this repository that are no package (deploy/scripts, benchmarks), loaded as
modules so that tests can call their functions."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parents[1]


def load_script(path: Path, name: str) -> ModuleType:
    """The Python file ``path`` (absolute, or relative to the repository root) executed as a
    new module named ``name`` (not put in sys.modules: each call runs the file again)."""
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
