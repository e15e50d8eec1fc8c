"""The command lines the user-facing docs show still parse with the real ``recserve`` parser.

README.md and docs/*.md (not docs/BENCHMARKS.md, a measurement log) show ``recserve ...``
lines in ```bash blocks and in inline code. Each must parse: no renamed or removed flag, no
invalid choice or value. Inline fragments may leave out required arguments (`recserve serve
--workers N`), nothing else. Every ``--flag`` the docs name must exist somewhere: in a recserve
parser, a repository script, the docs' own example scripts, or a tool listed below. The files
docs/own_model.md has the user save (scripts, configs, requests) must compile and load, and
every relative link must reach a file (and heading).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import shlex
from pathlib import Path

import pytest

from embedding_store.cli import build_parser
from embedding_store.config import load_embedding_config, load_global_config

ROOT = Path(__file__).resolve().parents[2]
DOCS = [
    ROOT / "README.md",
    *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "BENCHMARKS.md"),
]
#: Flags of other tools the docs use (docker, kubectl, ruff): not recserve's to check.
EXTERNAL_FLAGS = {
    "--build",  # docker compose up
    "--build-arg",  # docker build
    "--cert",  # kubectl create secret tls
    "--check",  # ruff format
    "--entrypoint",  # docker run
    "--from-file",  # kubectl create secret generic
    "--from-literal",  # kubectl create secret
    "--gpus",  # docker run
    "--ipc",  # docker run
    "--key",  # kubectl create secret tls
    "--network",  # docker build
    "--no-build",  # docker compose up
    "--patch-file",  # kubectl patch
    "--replicas",  # kubectl scale
    "--rm",  # docker run
    "--shm-size",  # docker run
    "--type",  # kubectl patch
}
#: What a placeholder in a doc's command stands for, where argparse checks the value's type.
PLACEHOLDERS = {"N": "2", "I": "0", "S": "5", "M": "9100"}

_FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.S | re.M)
_INLINE = re.compile(r"`([^`]+)`")
_SHELL_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\([^)]*\)")
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
#: A file docs/own_model.md has the user save: **`name`**, then its block.
_SAVED_FILE = re.compile(
    r"^\*\*`([^`]+)`\*\*[^\n]*\n(?:(?!```)[^\n]*\n)*?```[^\n]*\n(.*?)^```", re.M | re.S
)


class _ParseError(Exception):
    """argparse refused a documented command line (the message is argparse's own)."""


def _parser() -> argparse.ArgumentParser:
    """The real parser, whose errors (its own and its subparsers') raise _ParseError."""
    parser = build_parser()

    def patch(p: argparse.ArgumentParser) -> None:
        def error(message: str) -> None:
            raise _ParseError(message)

        p.error = error  # type: ignore[method-assign]
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    patch(sub)

    patch(parser)
    return parser


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    flags: set[str] = set()
    for action in parser._actions:
        flags.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags |= _option_strings(sub)
    return flags


def _commands() -> set[str]:
    (subparsers,) = (
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    )
    return set(subparsers.choices)


def _code(text: str) -> list[str]:
    """Shell lines of the ```bash blocks (continuations joined) and every inline code span."""
    snippets = []
    for match in _FENCE.finditer(text):
        if match.group(1).strip() in ("bash", "sh", "shell", "console"):
            snippets += [
                " ".join(line.split()) for line in match.group(2).replace("\\\n", " ").splitlines()
            ]
    outside = _FENCE.sub("", text)
    snippets += [" ".join(m.group(1).split()) for m in _INLINE.finditer(outside)]
    return snippets


def _recserve_lines(text: str, commands: set[str]) -> list[str]:
    """Each ``recserve COMMAND ...`` in the code of ``text``, cut at shell operators."""
    found = []
    for snippet in _code(text):
        for match in re.finditer(r"(?<![\w./-])recserve ([\w|-]+)", snippet):
            if set(match.group(1).split("|")) <= commands:
                line = snippet[match.start() :]
                for end in (" && ", " ; ", " | ", '"]', " #"):
                    line = line.split(end)[0]
                found.append(line.strip())
    return found


def _argvs(line: str) -> list[list[str]]:
    """The argument lists of one doc line: placeholders filled in, alternatives expanded
    (`recserve checkpoint inspect|verify`, `--embedding-config/--global-config`)."""
    tokens = shlex.split(_SHELL_VARIABLE.sub("0", line))[1:]
    argv: list[str] = []
    for token in tokens:
        if token == "...":  # "more arguments", or a value left out
            if argv and argv[-1].startswith("--") and "=" not in argv[-1]:
                argv.append("x")
            continue
        if token != "--help":  # shows the help and exits: the command before it is checked
            argv.append(PLACEHOLDERS.get(token, token))
    variants = [argv]
    for index, token in enumerate(argv):
        flags = token.split("/")
        if len(flags) > 1 and all(flag.startswith("--") for flag in flags):
            variants = [[*v[:index], f, *v[index + 1 :]] for v in variants for f in flags]
        alternatives = token.split("|")
        if len(alternatives) > 1 and index < 2:  # a command or action: `inspect|verify`
            variants = [[*v[:index], a, *v[index + 1 :]] for v in variants for a in alternatives]
    return variants


def _doc_lines() -> list[tuple[str, str]]:
    commands = _commands()
    return [
        (doc.relative_to(ROOT).as_posix(), line)
        for doc in DOCS
        for line in _recserve_lines(doc.read_text(encoding="utf-8"), commands)
    ]


def _saved_files() -> dict[str, str]:
    text = (ROOT / "docs" / "own_model.md").read_text(encoding="utf-8")
    return {m.group(1): m.group(2) for m in _SAVED_FILE.finditer(text)}


def test_docs_show_recserve_commands() -> None:
    lines = _doc_lines()
    assert len(lines) > 30, lines
    # The walk-through's and the README's main commands are among them.
    assert any(line.startswith("recserve serve --checkpoint runs/click") for _, line in lines)
    assert any(line.startswith("recserve eval --checkpoint runs/adult") for _, line in lines)


@pytest.mark.parametrize(("doc", "line"), _doc_lines())
def test_doc_command_parses(doc: str, line: str) -> None:
    for argv in _argvs(line):
        try:
            args = _parser().parse_args(argv)
        except _ParseError as error:
            message = str(error)
            if message.startswith("the following arguments are required"):
                continue  # an inline fragment that names only some flags
            last = argv[-1]
            if message == f"argument {last}: expected one argument":
                continue  # a fragment naming a flag, e.g. `recserve train --embedding-workers`
            pytest.fail(f"{doc}: `{line}` -> recserve {' '.join(argv)}: {message}")
        _check_script_arguments(doc, line, args)


def _check_script_arguments(doc: str, line: str, args: argparse.Namespace) -> None:
    """The flags after ``--`` of ``recserve train|data-loader --entry SCRIPT`` are SCRIPT's."""
    entry = getattr(args, "entry", None)
    script_args = [a for a in getattr(args, "script_args", []) if a.startswith("--")]
    if entry is None or not script_args or script_args == ["--"]:
        return
    path = ROOT / entry
    source = path.read_text(encoding="utf-8") if path.is_file() else _saved_files().get(entry)
    assert source is not None, f"{doc}: `{line}`: no script {entry}"
    for flag in script_args[1:] if script_args[0] == "--" else script_args:
        name = flag.split("=")[0]
        assert f'"{name}"' in source, f"{doc}: `{line}`: {entry} takes no {name}"


#: The files a doc's commands read (``recserve ... --input/--data/--mapping/--entry/...``).
_INPUT_ARGUMENTS = ("input", "data", "mapping", "entry", "embedding_config", "global_config")


def _made_by_saved_scripts() -> set[str]:
    """Files the scripts docs/own_model.md has the user save write (``open("test.csv", "w"``)."""
    texts = [text for name, text in _saved_files().items() if name.endswith(".py")]
    return {m for text in texts for m in re.findall(r"""open\(["']([^"']+)["'], ["']w""", text)}


def test_files_the_docs_commands_read_exist() -> None:
    """README.md's and docs/deploy.md's commands run from the repository root: a file they
    read is in the repository (README's `recserve predict ... --input rows.jsonl` named none,
    and deploy.md's TLS example sent own_model.md's click rows to the Adult model).
    docs/own_model.md's run in the user's directory: its saved files and what its scripts
    write."""
    own = set(_saved_files()) | _made_by_saved_scripts()
    allowed = {"README.md": set(), "docs/own_model.md": own, "docs/deploy.md": set()}
    missing = []
    for doc, line in _doc_lines():
        for argv in _argvs(line):
            try:
                args = _parser().parse_args(argv)
            except _ParseError:
                continue  # a fragment: test_doc_command_parses judges it
            for name in _INPUT_ARGUMENTS:
                values = getattr(args, name, None)
                for value in values if isinstance(values, list) else [values]:
                    path = str(value) if value is not None else None
                    if path is None or (ROOT / path).exists() or path in allowed.get(doc, own):
                        continue
                    missing.append(f"{doc}: `{line}`: --{name.replace('_', '-')} {path}")
    assert not missing, missing


def _known_flags() -> set[str]:
    flags = _option_strings(build_parser()) | EXTERNAL_FLAGS
    sources = [
        *(ROOT / "examples").rglob("*.py"),
        *(ROOT / "load_tests").glob("*.py"),
        *(ROOT / "benchmarks").glob("*.py"),
        *(ROOT / "deploy" / "scripts").glob("*.py"),
    ]
    texts = [p.read_text(encoding="utf-8") for p in sources] + list(_saved_files().values())
    for text in texts:
        flags.update(re.findall(r"""["'](--[a-z][a-z0-9-]*)["']""", text))
    return flags


def test_every_flag_the_docs_name_exists() -> None:
    known = _known_flags()
    unknown = {
        (doc.relative_to(ROOT).as_posix(), flag)
        for doc in DOCS
        for snippet in _code(doc.read_text(encoding="utf-8"))
        for flag in _FLAG.findall(snippet)
        if flag not in known
    }
    assert not unknown, sorted(unknown)


def test_own_model_files_compile_and_load(tmp_path: Path) -> None:
    files = _saved_files()
    expected = {"embedding_config.yml", "global_config.yml", "data.py", "model.py", "train.py"}
    expected |= {"v2.json", "rows.jsonl", "make_csv.py", "parity.py"}
    assert set(files) == expected
    for name, text in files.items():
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        if name.endswith(".py"):
            ast.parse(text, filename=name)
        elif name.endswith(".json"):
            json.loads(text)
        elif name.endswith(".jsonl"):
            assert [json.loads(line) for line in text.splitlines() if line.strip()]
    config = load_embedding_config(tmp_path / "embedding_config.yml")
    load_global_config(tmp_path / "global_config.yml")
    # The KServe v2 request names every slot (and a multi-ID slot's lengths) and the dense input.
    names = {tensor["name"] for tensor in json.loads(files["v2.json"])["inputs"]}
    assert set(config.slots_config) <= names
    assert {"hist_items.lengths", "dense"} <= names


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_doc_links_reach_a_file_and_heading() -> None:
    broken = []
    for doc in DOCS:
        for link in re.findall(r"\]\(([^)\s]+)\)", doc.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+://", link):
                continue
            path, _, anchor = link.partition("#")
            target = (doc.parent / path) if path else doc
            if not target.exists():
                broken.append(f"{doc.name}: {link} (no such file)")
            elif anchor:
                text = target.read_text(encoding="utf-8")
                if anchor not in {_anchor(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}:
                    broken.append(f"{doc.name}: {link} (no such heading)")
    assert not broken, broken
