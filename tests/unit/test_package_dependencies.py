"""The one-way dependency rule between packages (docs/architecture.md, "Packages and the
one-way rule"): serving and training use embedding_store, embedding_store imports neither, and
serving and training do not import each other. Every import counts, including the ones made
inside functions (lazy imports), since a lazy import is still a dependency."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# package -> top-level packages of this repository it must never import
FORBIDDEN = {
    "embedding_store": ("serving", "training", "clients", "load_tests", "benchmarks"),
    "training": ("serving", "clients", "load_tests", "benchmarks"),
    "serving": ("training", "clients", "load_tests", "benchmarks"),
}


def imported_modules(path: Path, root: Path = REPO) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import statement in ``path``, at any depth.
    Relative imports are resolved against the file's package (its folders below ``root``)."""
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.append((node.lineno, module))
    return found


def test_imports_are_found_at_any_depth_and_relative_ones_resolved(tmp_path: Path) -> None:
    """The scanner must see what the rule is about, or the rule test below could never fail."""
    probe = tmp_path / "embedding_store" / "probe.py"
    probe.parent.mkdir()
    probe.write_text(
        "import os\n"
        "from . import batch\n"
        "def lazy():\n"
        "    from serving.core import PredictionCore\n"
        "    import training.ctx as ctx\n",
        encoding="utf-8",
    )
    assert imported_modules(probe, root=tmp_path) == [
        (1, "os"),
        (2, "embedding_store"),
        (4, "serving.core"),
        (5, "training.ctx"),
    ]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_never_imports_the_packages_above_it(package: str) -> None:
    modules = sorted((REPO / package).rglob("*.py"))
    assert len(modules) > 5, f"no modules found under {package}/"
    violations = [
        f"{path.relative_to(REPO)}:{line}: imports {module}"
        for path in modules
        for line, module in imported_modules(path)
        if module.split(".")[0] in FORBIDDEN[package]
    ]
    assert violations == []


def test_clients_use_the_server_only_to_score_a_checkpoint_in_process() -> None:
    """clients/ speak the wire protocol; the one exception is ``recserve eval --checkpoint``,
    which scores in-process through ``serving.infer_ctx`` (imported lazily, by the scorer)."""
    uses = [
        (path.name, module)
        for path in sorted((REPO / "clients").rglob("*.py"))
        for _, module in imported_modules(path)
        if module.split(".")[0] in ("serving", "training", "examples", "load_tests", "benchmarks")
    ]
    assert uses == [("eval_scorers.py", "serving.infer_ctx")]
