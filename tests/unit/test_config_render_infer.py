"""deploy/scripts/render_infer_config.py reads its base with recserve's strict YAML reader and
reports every problem as one line (exit 1; 2 for bad arguments), never a traceback."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import yaml

from embedding_store.config import load_global_config
from tests.scripts import load_script

PROG = "render_infer_config.py"


@functools.cache
def _script():
    return load_script(Path("deploy/scripts/render_infer_config.py"), "render_infer_config")


def _render(capsys, *argv: str) -> tuple[int, str, str]:
    code = _script().main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_renders_an_infer_config_from_the_default_base(tmp_path, capsys) -> None:
    out = tmp_path / "sub" / "ps0.yml"
    code, stdout, err = _render(capsys, "--embedding-checkpoint", "ckpt", "--out", str(out))
    assert (code, err) == (0, "")
    expected = os.path.abspath("ckpt")
    assert stdout == f"wrote {out} (embedding_checkpoint {expected})\n"
    config = load_global_config(out)
    assert config.common_config.job_type.value == "Infer"
    assert config.common_config.infer_config.embedding_checkpoint == expected


@pytest.mark.parametrize(
    ("text", "detail"),
    [
        (None, "config file not found"),
        ("dir", "is a directory, expected a YAML config file"),
        ("- 1\n", "expected a mapping at the top level, got [1] (list)"),
        ("common_config: x\n", "common_config: expected a mapping, got 'x' (string)"),
        (
            "common_config: {infer_config: [a]}\n",
            "common_config.infer_config: expected a mapping, got ['a'] (list)",
        ),
        (
            "bogus: 1\n",
            "bogus: unknown key (allowed keys: common_config, embedding_parameter_server_config, "
            "embedding_worker_config)",
        ),
        (
            "common_config: {}\ncommon_config: {}\n",
            "YAML syntax error at line 2, column 1: found duplicate key 'common_config'",
        ),
        (
            "embedding_parameter_server_config: {capacity: 016}\n",
            "embedding_parameter_server_config.capacity: integer 016 has a leading zero, which "
            "YAML 1.1 tools read as octal and YAML 1.2 as decimal: write 16; octal 016 is "
            "0o16, or quote it for a string",
        ),
    ],
)
def test_a_bad_base_is_one_line_and_exit_1(tmp_path, capsys, text, detail) -> None:
    base = tmp_path / "base.yml"
    if text == "dir":
        base.mkdir()
    elif text is not None:
        base.write_text(text, encoding="utf-8")
    out = tmp_path / "out.yml"
    argv = ("--embedding-checkpoint", "ckpt", "--out", str(out), "--base", str(base))
    code, stdout, err = _render(capsys, *argv)
    assert (code, stdout) == (1, "")
    assert err == f"{PROG}: error: {base}: {detail}\n"
    assert not out.exists() and list(tmp_path.iterdir()) == ([base] if text else [])


@pytest.mark.parametrize("checkpoint", ["", "  "])
def test_a_blank_checkpoint_is_an_argument_error(tmp_path, capsys, checkpoint) -> None:
    out = tmp_path / "out.yml"
    with pytest.raises(SystemExit) as caught:
        _script().main(["--embedding-checkpoint", checkpoint, "--out", str(out)])
    assert caught.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"{PROG}: error: argument --embedding-checkpoint: expected a checkpoint directory, "
        f"got {checkpoint!r}"
    )
    assert not out.exists()  # it used to write the current directory as the checkpoint


def test_an_out_directory_is_an_argument_error(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as caught:
        _script().main(["--embedding-checkpoint", "ckpt", "--out", str(tmp_path)])
    assert caught.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"{PROG}: error: argument --out: expected a file path, got {str(tmp_path)!r}"
    )


def test_render_keeps_the_base_and_sets_only_the_infer_keys(tmp_path) -> None:
    base = tmp_path / "base.yml"
    base.write_text("embedding_worker_config: {forward_buffer_size: 7}\n", encoding="utf-8")
    data = _script().render(base, str(tmp_path / "ck"))
    assert data == {
        "embedding_worker_config": {"forward_buffer_size": 7},
        "common_config": {
            "job_type": "Infer",
            "infer_config": {"embedding_checkpoint": str(tmp_path / "ck")},
        },
    }
    yaml.safe_dump(data)


def test_a_string_that_looks_like_a_number_survives_the_render(tmp_path, capsys) -> None:
    base = tmp_path / "base.yml"
    base.write_text("common_config:\n  metrics_config:\n    job_name: '1e6'\n")
    out = tmp_path / "infer.yml"
    code, _, err = _render(
        capsys, "--embedding-checkpoint", "ckpt", "--out", str(out), "--base", str(base)
    )
    assert code == 0, err
    assert load_global_config(out).common_config.metrics_config.job_name == "1e6"
