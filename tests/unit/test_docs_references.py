"""What the user-facing docs name exists in the code: metrics (names, labels, types), RECSERVE_*
environment variables, Python names (``serving.infer_ctx.InferCtx``, ``TierStatus``), config
key paths (``infer_config.embedding_checkpoint``), HTTP routes, repository paths, the objects
of deploy/k8s, and defaults, both those the docs give for flags and those the ``--help`` texts
state (and the Python names the help texts give import).

The docs are README.md and docs/*.md but docs/BENCHMARKS.md (a measurement log), as in
test_docs_commands.py, whose command checks these complete.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import re
import typing
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

import embedding_store.grpc_common
from embedding_store.cli import build_parser
from embedding_store.config.embedding import EmbeddingConfig
from embedding_store.config.global_config import GlobalConfig
from embedding_store.ps_metrics import ParameterServerMetrics
from embedding_store.remote_tier import WorkerStats
from embedding_store.shard import ShardStats
from embedding_store.worker_metrics import EmbeddingWorkerMetrics
from serving.metrics import ServingMetrics
from tests.unit.test_docs_commands import DOCS, ROOT

#: Labels every parameter-server shard metric carries (the deploy docs say so once, up front).
SHARD_LABELS = {"replica", "replicas"}
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def _docs() -> dict[str, str]:
    return {doc.relative_to(ROOT).as_posix(): doc.read_text(encoding="utf-8") for doc in DOCS}


@dataclasses.dataclass(frozen=True)
class _Exported:
    """One metric family as a scrape shows it: its type and label names (no ``le``)."""

    type: str
    labels: frozenset[str]


def _add_wrapper(found: dict[str, _Exported], metric: MetricWrapperBase) -> None:
    # A labelled metric with no series yet shows nothing in a scrape: read its declaration.
    name = metric._name + ("_total" if metric._type == "counter" else "")
    found[name] = _Exported(metric._type, frozenset(metric._labelnames))


def _add_collected(found: dict[str, _Exported], registry: Any) -> None:
    for family in registry.collect():
        labels = frozenset(k for s in family.samples for k in s.labels if k != "le")
        name = family.name + ("_total" if family.type == "counter" else "")
        if name not in found and family.samples:
            found[name] = _Exported(family.type, labels)


def _exported(monkeypatch: pytest.MonkeyPatch) -> dict[str, _Exported]:
    """Every metric the prediction server, a parameter server and an embedding worker export,
    by the name a query uses (counters with ``_total``), TLS reload counters included."""
    tls = SimpleNamespace(counts={"ok": 0, "failed": 0})
    monkeypatch.setattr(embedding_store.grpc_common, "tier_tls_files", lambda: tls)
    zeros = {f.name: 0 for f in dataclasses.fields(ShardStats)}
    shard = SimpleNamespace(stats=lambda: ShardStats(**zeros))
    ps = ParameterServerMetrics(0, 2)
    ps.watch_shard(shard, lambda: True)
    worker = EmbeddingWorkerMetrics()
    stats = WorkerStats(**{f.name: 0 for f in dataclasses.fields(WorkerStats)})
    worker.watch_tier(SimpleNamespace(stats=lambda: stats))
    found: dict[str, _Exported] = {}
    for holder in (ServingMetrics(), ps, worker):
        for value in vars(holder).values():
            if isinstance(value, MetricWrapperBase):
                _add_wrapper(found, value)
        _add_collected(found, holder.registry)
    return found


def _resolve(name: str, exported: dict[str, _Exported]) -> _Exported | None:
    """The family of a sample name (``..._bucket`` of a histogram too), or None."""
    if name in exported:
        return exported[name]
    for suffix in _HISTOGRAM_SUFFIXES:
        base = exported.get(name.removesuffix(suffix))
        if name.endswith(suffix) and base is not None and base.type == "histogram":
            return base
    return None


_METRIC = re.compile(r"\b(recserve_[a-z0-9_]*[a-z0-9])(?![a-z0-9_])(\{[^}]*\})?")
#: A bare name in a doc's metric table or list: ``lookups_total{mode}``, ``rows``.
_BARE_METRIC = re.compile(r"`([a-z][a-z0-9_]*)(\{[^}`]*\})?`")


def _label_names(braces: str | None) -> set[str]:
    """``{a,b}`` -> {a, b}; ``{mode="eval"}`` -> {mode} (a selector names some labels)."""
    if not braces:
        return set()
    return {part.split("=")[0].strip() for part in braces.strip("{}").split(",") if part.strip()}


def test_every_metric_the_docs_name_is_exported(monkeypatch: pytest.MonkeyPatch) -> None:
    exported = _exported(monkeypatch)
    assert "recserve_requests_total" in exported and "recserve_ps_misses_total" in exported
    wrong = []
    for doc, text in _docs().items():
        for match in _METRIC.finditer(text):
            name, braces = match.group(1), match.group(2)
            family = _resolve(name, exported)
            if family is None:
                wrong.append(f"{doc}: {name}: no such metric")
            elif not _label_names(braces) <= family.labels:
                wrong.append(f"{doc}: {match.group(0)}: its labels are {sorted(family.labels)}")
    assert not wrong, wrong


def _metric_sections(text: str) -> list[tuple[str, str]]:
    """(prefix, text) of each list of metrics in deploy.md: what follows "prefixed `P`" up to
    the next blank line that is not inside a table."""
    sections = []
    for match in re.finditer(r"prefixed\s+`(recserve_[a-z_]*)`", text):
        rest = text[match.end() :]
        body = re.match(r"[^\n]*(?:\n(?!\n)[^\n]*)*(?:\n\n\|[^\n]*(?:\n\|[^\n]*)*)?", rest)
        assert body is not None
        sections.append((match.group(1), body.group(0)))
    return sections


def test_deploy_metric_tables_match_the_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """deploy.md lists each process's metrics under a prefix, with their labels (all of them,
    but a shard's replica labels) and, in its tables, their types."""
    exported = _exported(monkeypatch)
    text = (ROOT / "docs" / "deploy.md").read_text(encoding="utf-8")
    sections = _metric_sections(text)
    assert [prefix for prefix, _ in sections] == ["recserve_worker_", "recserve_ps_", "recserve_"]
    wrong, checked = [], 0
    for prefix, body in sections:
        rows = [line for line in body.splitlines() if line.startswith("| `")]
        if rows:  # a table: | `name{labels}`, ... | type | what |
            cells = [(row.split("|")[1], row.split("|")[2].strip()) for row in rows]
        else:  # prose: `name_total{labels}`; the gauges' bare names are left out
            cells = [(body, None)]
        for cell, kind in cells:
            for name, braces in _BARE_METRIC.findall(cell):
                if not rows and not name.endswith(("_total", "_seconds")):
                    continue
                family = _resolve(prefix + name, exported)
                checked += 1
                if family is None:
                    wrong.append(f"{prefix}{name}: no such metric")
                    continue
                labels = family.labels - (SHARD_LABELS if prefix == "recserve_ps_" else set())
                documented = _label_names(braces)
                # A table gives every label; prose gives them where it writes braces.
                exact = (rows or braces) and not (braces and "=" in braces)
                if exact and documented != labels:
                    wrong.append(f"{prefix}{name}{braces}: labels {sorted(labels)}")
                if kind is not None and kind != family.type:
                    wrong.append(f"{prefix}{name}: a {family.type}, not a {kind}")
    assert checked > 25, checked
    assert not wrong, wrong


def _code_paths() -> list[Path]:
    """The product packages, examples, deploy scripts, load tests and benchmarks."""
    folders = ("embedding_store", "serving", "training", "clients", "examples", "load_tests")
    paths = [p for f in folders for p in (ROOT / f).rglob("*.py")]
    scripts = [*(ROOT / "deploy" / "scripts").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
    return [*paths, *scripts]


def _code_text() -> str:
    """The source of the product packages, examples, deploy scripts, load tests, benchmarks."""
    return "\n".join(p.read_text(encoding="utf-8") for p in _code_paths())


def test_every_environment_variable_the_docs_name_is_read() -> None:
    code = _code_text()
    variables = {
        (doc, name)
        for doc, text in _docs().items()
        for name in re.findall(r"\bRECSERVE_[A-Z0-9_]*[A-Z0-9]\b", text)
    }
    assert ("docs/deploy.md", "RECSERVE_TIER_TLS_RELOAD_SECONDS") in variables
    unread = sorted((doc, name) for doc, name in variables if f'"{name}"' not in code)
    assert not unread, unread


_PACKAGES = ("embedding_store", "serving", "training", "clients")


def _import_attribute(dotted: str) -> object:
    """``pkg.module.Name.attr`` imported: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for part in parts[cut:]:
            target = getattr(target, part)
        return target
    raise ModuleNotFoundError(dotted)


def test_every_python_name_the_docs_give_exists() -> None:
    pattern = re.compile(rf"`((?:{'|'.join(_PACKAGES)})(?:\.[A-Za-z_]\w*)+)`")
    names = {(doc, name) for doc, text in _docs().items() for name in pattern.findall(text)}
    assert ("docs/own_model.md", "serving.infer_ctx.InferCtx") in names
    missing = []
    for doc, name in sorted(names):
        try:
            _import_attribute(name)
        except (ImportError, AttributeError) as error:
            missing.append(f"{doc}: {name}: {error}")
    assert not missing, missing


def _config_keys() -> dict[str, set[str]]:
    """Each config section's keys: {"common_config": {"job_type", ...}, ...}, for every
    dataclass reachable from GlobalConfig and EmbeddingConfig (a slot's keys under
    ``slots_config``'s values)."""
    keys: dict[str, set[str]] = {}

    def visit(section: str, cls: type) -> None:
        hints = typing.get_type_hints(cls)
        fields = [f for f in dataclasses.fields(cls) if not f.name.startswith("_")]
        keys.setdefault(section, set()).update(f.name for f in fields)
        for f in fields:
            for inner in (hints[f.name], *typing.get_args(hints[f.name])):
                if dataclasses.is_dataclass(inner) and isinstance(inner, type):
                    visit(f.name, inner)

    visit("global_config", GlobalConfig)
    visit("embedding_config", EmbeddingConfig)
    return keys


def test_every_config_key_path_the_docs_give_exists() -> None:
    """`infer_config.embedding_checkpoint`, `metrics_config.enable_metrics`: each key is a key
    of the section before it."""
    keys = _config_keys()
    sections = set(keys) - {"global_config", "embedding_config"}
    paths = {
        (doc, path)
        for doc, text in _docs().items()
        for path in re.findall(r"`([a-z_]+(?:\.[a-z_]+)+)`", text)
        if path.split(".")[0] in sections
    }
    assert ("docs/deploy.md", "infer_config.embedding_checkpoint") in paths
    wrong = [
        f"{doc}: {path}"
        for doc, path in sorted(paths)
        for section, key in zip(path.split("."), path.split(".")[1:])
        if key not in keys.get(section, set())
    ]
    assert not wrong, wrong


def _options(
    parser: argparse.ArgumentParser, command: str = "recserve"
) -> list[tuple[str, argparse.Action]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _options(sub, f"{command} {name}")
        elif action.option_strings and action.help not in (None, argparse.SUPPRESS):
            found.append((command, action))
    return found


_UNITS = {"KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}
_HELP_DEFAULT = re.compile(r"\bdefault:?\s+([^\s;,)]+?)(?:\s*(KiB|MiB|GiB)\b)?(?=[\s;,)]|$)")


def _stated_default_is_wrong(value: str, unit: str, action: argparse.Action) -> bool | None:
    """Whether "default VALUE" in ``action``'s help is not its default; None for prose
    ("default: the system's", "use default vectors")."""
    default = action.default
    if re.fullmatch(r"-?\d+(?:\.\d+)?", value):
        stated = float(value) * _UNITS.get(unit, 1)
        return not isinstance(default, (int, float)) or float(default) != stated
    if value == str(default):
        return False
    if value in (action.choices or ()) or any(c.isdigit() for c in value):
        return True  # another choice, or another address
    return None


def test_defaults_the_help_texts_state_are_the_defaults() -> None:
    """A ``--help`` line that says "default 256" (or "64 MiB", "127.0.0.1", a choice) has
    that default."""
    checked, wrong = 0, []
    for command, action in _options(build_parser()):
        for value, unit in _HELP_DEFAULT.findall(str(action.help)):
            if command == "recserve train" and action.dest == "master_port":
                assert action.default is None  # torchrun's 29500, or --standalone's free port
                continue
            verdict = _stated_default_is_wrong(value, unit, action)
            checked += verdict is not None
            if verdict:
                flag = action.option_strings[0]
                stated = f"{value} {unit}".strip()
                wrong.append(f"{command} {flag}: says {stated}, is {action.default!r}")
    assert checked > 15, checked
    assert not wrong, wrong


def test_doc_checks_see_the_docs() -> None:
    """The checks above read every doc (none renamed away) and the packages they import."""
    assert set(_docs()) >= {"README.md", "docs/deploy.md", "docs/own_model.md"}
    assert all(isinstance(importlib.import_module(p), ModuleType) for p in _PACKAGES)


def _routes() -> list[re.Pattern[str]]:
    """The HTTP routes the server declares (FastAPI's ``{name}`` as one path segment)."""
    source = "\n".join(
        (ROOT / "serving" / name).read_text(encoding="utf-8")
        for name in ("http_app.py", "server.py")
    )
    templates = set(re.findall(r'"(/(?:v1|v2|admin|metrics)[^"]*)"', source))
    assert "/v2/models/{name}/infer" in templates and "/metrics" in templates
    return [re.compile(re.sub(r"\\\{\w+\\\}", "[^/]+", re.escape(t))) for t in templates]


def test_every_http_route_the_docs_give_exists() -> None:
    routes = _routes()
    paths = {
        (doc, path)
        for doc, text in _docs().items()
        for path in re.findall(r"(/(?:v1/models|v2|admin)/[\w/.:<>-]*)", text)
    }
    assert ("docs/own_model.md", "/v2/models/click/infer") in paths
    # "/admin/": the prefix a proxy should block.
    wrong = [
        f"{doc}: {path}"
        for doc, path in sorted(paths)
        if path != "/admin/" and not any(route.fullmatch(path) for route in routes)
    ]
    assert not wrong, wrong


def test_every_repository_path_the_docs_name_exists() -> None:
    """`deploy/k8s/server.yaml`, `examples/configs/`, `embedding_store/shard.py`: a path
    whose first folder is one of the repository's (or, in deploy.md, of deploy/'s) exists."""
    top = {p.name for p in ROOT.iterdir() if p.is_dir()}
    deploy = {p.name for p in (ROOT / "deploy").iterdir() if p.is_dir()}
    checked, missing = 0, []
    for doc, text in _docs().items():
        for path in set(re.findall(r"`([\w.-]+(?:/[\w.-]+)+/?)`", text)):
            first = path.split("/")[0]
            bases = [ROOT] if first in top else []
            if doc == "docs/deploy.md" and first in deploy:  # `k8s/`, `scripts/healthcheck.py`
                bases.append(ROOT / "deploy")
            if not bases:
                continue  # a user's file (runs/click), a label (apps.kubernetes.io/pod-index)
            checked += 1
            if not any((base / path).exists() for base in bases):
                missing.append(f"{doc}: {path}")
    assert checked > 30, checked
    assert not missing, missing


#: The kinds deploy.md's table of deploy/k8s names, as it writes them.
_K8S_KINDS = {
    "namespace": "Namespace",
    "ConfigMap": "ConfigMap",
    "PVC": "PersistentVolumeClaim",
    "Service": "Service",
    "StatefulSet": "StatefulSet",
    "PDB": "PodDisruptionBudget",
    "Deployment": "Deployment",
    "Job": "Job",
    "HorizontalPodAutoscaler": "HorizontalPodAutoscaler",
    "NetworkPolicies": "NetworkPolicy",
}


def _metadata_names(node: object) -> set[str]:
    """Every ``metadata.name`` in a manifest (volume claim templates' too)."""
    names: set[str] = set()
    if isinstance(node, dict):
        metadata = node.get("metadata")
        if isinstance(metadata, dict) and isinstance(metadata.get("name"), str):
            names.add(metadata["name"])
        for value in node.values():
            names |= _metadata_names(value)
    elif isinstance(node, list):
        for value in node:
            names |= _metadata_names(value)
    return names


def test_deploy_k8s_table_lists_what_the_manifests_create() -> None:
    """deploy.md's "What `kubectl apply -k deploy/k8s` creates": the kustomization's files,
    each with the kinds of its objects (all of them) and their names."""
    k8s = ROOT / "deploy" / "k8s"
    text = (ROOT / "docs" / "deploy.md").read_text(encoding="utf-8")
    table = text.split("What `kubectl apply -k deploy/k8s` creates", 1)[1].split("\n\n")[1]
    rows = [line.split("|")[1:3] for line in table.splitlines() if line.startswith("| `")]
    listed, wrong = [], []
    for files_cell, objects_cell in rows:
        files = re.findall(r"`([\w.-]+\.yaml)`", files_cell)
        listed += files
        objects = [
            o for f in files for o in yaml.safe_load_all((k8s / f).read_text()) if o is not None
        ]
        kinds = {_K8S_KINDS[w] for w in re.findall(r"\w+", objects_cell) if w in _K8S_KINDS}
        if kinds != {o["kind"] for o in objects}:
            wrong.append(
                f"{files}: says {sorted(kinds)}, holds {sorted(o['kind'] for o in objects)}"
            )
        names = _metadata_names(objects)
        for name in re.findall(r"`([\w.-]+)`", objects_cell):
            if name not in names:
                wrong.append(f"{files}: no object named {name}")
    resources = yaml.safe_load((k8s / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(resources)
    assert not wrong, wrong


#: CamelCase words the docs put in code that are not recserve's (a Kubernetes pod state).
_NOT_OURS = {"ContainerCreating"}


def test_every_class_the_docs_name_exists() -> None:
    """`TrainCtx`, `RemoteShardTier`, `CapacityError`, `PackedSlots`, `TierStatus.shard_errors`:
    each is defined in a package (a class, function or name) or a .proto message, and an
    attribute given after it is one of its own."""
    folders = [ROOT / p for p in _PACKAGES]
    source = "\n".join(p.read_text(encoding="utf-8") for f in folders for p in f.rglob("*.py"))
    protos = "\n".join(p.read_text(encoding="utf-8") for f in folders for p in f.rglob("*.proto"))
    defined = set(re.findall(r"^\s*(?:class|def)\s+(\w+)", source, re.M))
    defined |= set(re.findall(r"^(\w+)\s*[:=]", source, re.M))
    defined |= set(re.findall(r"^\s*(?:message|service)\s+(\w+)", protos, re.M))
    pattern = re.compile(r"`([A-Z][a-z0-9]+(?:[A-Z][A-Za-z0-9]*)+)(?:\.(\w+))?[^`]*`")
    checked, missing = 0, []
    for doc, text in _docs().items():
        for name, attribute in set(pattern.findall(text)):
            if name in _NOT_OURS:
                continue
            checked += 1
            if name not in defined:
                missing.append(f"{doc}: {name}")
            elif attribute:
                body = re.search(rf"^class {name}\b.*?(?=^\S)", source + "\nEND", re.M | re.S)
                if body is None or not re.search(rf"\b{attribute}\b", body.group(0)):
                    missing.append(f"{doc}: {name}.{attribute}")
    assert checked > 25, checked
    assert not missing, missing


#: "`--flag` (60)", "`--flag` rows or more (default 256", "`--flag` (64 MiB": a default the
#: docs give for a flag (not "`--max-body-bytes` (413: ..."): a number that closes the
#: parenthesis, has a unit, or follows "default".
_DOC_DEFAULT = re.compile(
    r"`(--[a-z][a-z-]*)`[^`(\n]{0,30}\("
    r"(?:default:?\s+(\d[\d.]*)(?:\s*(KiB|MiB|GiB)\b)?|(\d[\d.]*)\s*(KiB|MiB|GiB)\b|(\d[\d.]*)\))"
)


def test_defaults_the_docs_give_for_flags_are_the_defaults() -> None:
    defaults: dict[str, set[object]] = {}
    for _, action in _options(build_parser()):
        for flag in action.option_strings:
            defaults.setdefault(flag, set()).add(action.default)
    checked, wrong = 0, []
    for doc, text in _docs().items():
        for match in _DOC_DEFAULT.finditer(" ".join(text.split())):
            flag = match.group(1)
            value = match.group(2) or match.group(4) or match.group(6)
            unit = match.group(3) or match.group(5) or ""
            stated = float(value) * _UNITS.get(unit, 1)
            checked += 1
            if defaults.get(flag) != {stated}:  # one default, whichever command has the flag
                wrong.append(f"{doc}: {match.group(0)}: the default is {defaults.get(flag)}")
    assert checked >= 5, checked
    assert not wrong, wrong


def _help_texts(parser: argparse.ArgumentParser) -> list[str]:
    """The description and every option's help of ``parser`` and its subcommands."""
    texts = [parser.description or ""]
    for action in parser._actions:
        texts.append(str(action.help or ""))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                texts += _help_texts(sub)
    return texts


def test_every_python_name_the_help_texts_give_exists() -> None:
    """`recserve train --help` names training.ctx.TrainCtx, `serve --help` a --preprocessor
    example (MODULE:FUNCTION): each imports."""
    text = "\n".join(_help_texts(build_parser()))
    packages = "|".join((*_PACKAGES, "examples"))
    names = set(re.findall(rf"\b((?:{packages})(?:\.\w+)+(?::\w+)?)", text))
    assert {"training.ctx.TrainCtx", "training.data.DataCtx"} <= names, names
    missing = []
    for name in sorted(names):
        try:
            _import_attribute(name.replace(":", "."))
        except (ImportError, AttributeError) as error:
            missing.append(f"{name}: {error}")
    assert not missing, missing


def _options_without_help(source: str) -> list[tuple[int, str]]:
    """(line, flag) of each ``add_argument`` call in ``source`` that adds an option (not a
    positional) and gives it no ``help=``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr != "add_argument" or not node.args:
            continue
        first = node.args[0]
        literal = first.value if isinstance(first, ast.Constant) else None
        if isinstance(literal, str) and not literal.startswith("-"):
            continue  # a positional: the usage line and its metavar say what it is
        given = {k.arg: k.value for k in node.keywords}
        action = given.get("action")
        if isinstance(action, ast.Constant) and action.value == "version":
            continue  # argparse's own help: "show program's version number and exit"
        if "help" not in given:
            found.append((node.lineno, literal if isinstance(literal, str) else ast.unparse(first)))
    return found


def test_every_flag_has_a_help_text() -> None:
    """`--help` is where a flag's meaning and default are looked up: every option of
    `recserve` and of the scripts the docs run (examples, deploy scripts, load tests,
    benchmarks) has a help text (peers.py's --ts-workers, train.py's --batch-size and
    quickstart.py's ports had none)."""
    missing = [
        f"{path.relative_to(ROOT)}:{line} {flag}"
        for path, source in ((p, p.read_text(encoding="utf-8")) for p in _code_paths())
        if "add_argument" in source  # parse only the files that build a command line
        for line, flag in _options_without_help(source)
    ]
    assert not missing, missing
    assert _options_without_help('p.add_argument("--x", default=1)\np.add_argument("dir")') == [
        (1, "--x")
    ]
