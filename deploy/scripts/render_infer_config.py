#!/usr/bin/env python3
"""Write an inference ``global_config.yml`` whose shards load a given embedding checkpoint.

    python deploy/scripts/render_infer_config.py --embedding-checkpoint DIR --out FILE \\
        [--base deploy/configs/global_config.infer.yml]

The config files hold no variables, so the Procfile of the serving stack
(``deploy/Procfile.serving``) renders one per shard from ``--base`` with
``common_config.job_type: Infer`` and ``common_config.infer_config.embedding_checkpoint``
set to the absolute path of DIR. The base is read with recserve's strict YAML reader
(duplicate keys, a non-mapping top level and YAML 1.1 number quirks are errors), the result
is checked with recserve's own loader and written atomically (a temporary file renamed into
place). Errors are one line on stderr: exit 2 for bad arguments, 1 for a bad base config or
an unwritable output.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from embedding_store.config import global_config_from_mapping, load_global_config
from embedding_store.config.strict import describe_value, dump_yaml, read_yaml_mapping
from embedding_store.errors import ConfigError

DEFAULT_BASE = Path(__file__).resolve().parents[1] / "configs" / "global_config.infer.yml"
PROG = Path(__file__).name


def _mapping_at(parent: dict[str, Any], key: str, source: str, path: str) -> dict[str, Any]:
    """``parent[key]``, created empty when absent; ConfigError when it is not a mapping."""
    if key not in parent:
        parent[key] = {}
    value = parent[key]
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: {path}: expected a mapping, got {describe_value(value)}")
    return value


def render(base: Path, embedding_checkpoint: str) -> dict[str, Any]:
    """The config of ``base`` with job type Infer and ``embedding_checkpoint`` (made absolute).

    ConfigError (naming ``base``, the key path and the value) for a missing, unreadable or
    invalid base, or when the result would not load.
    """
    source = os.fspath(base)
    data = read_yaml_mapping(base)
    common = _mapping_at(data, "common_config", source, "common_config")
    common["job_type"] = "Infer"
    infer = _mapping_at(common, "infer_config", source, "common_config.infer_config")
    infer["embedding_checkpoint"] = os.path.abspath(embedding_checkpoint)
    global_config_from_mapping(data, source=source)  # fail here, not in the shard
    return data


def _directory_name(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a checkpoint directory, got {text!r}")
    return text


def main(argv: list[str] | None = None) -> int:
    """Render and write the config; 0 on success, 1 (one line on stderr) on failure."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument(
        "--embedding-checkpoint",
        required=True,
        type=_directory_name,
        metavar="DIR",
        help="the embedding checkpoint the shards load (written as an absolute path)",
    )
    parser.add_argument(
        "--out", required=True, type=Path, metavar="FILE", help="the config file to write"
    )
    parser.add_argument(
        "--base",
        type=Path,
        default=DEFAULT_BASE,
        metavar="FILE",
        help="the global config the rest is taken from (default "
        "deploy/configs/global_config.infer.yml)",
    )
    args = parser.parse_args(argv)
    if not str(args.out).strip() or args.out.is_dir():
        parser.error(f"argument --out: expected a file path, got {str(args.out)!r}")
    try:
        data = render(args.base, args.embedding_checkpoint)
        _write(args.out, data, args.base)
    except ConfigError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1
    except OSError as error:
        print(f"{PROG}: error: cannot write {args.out}: {error.strerror or error}", file=sys.stderr)
        return 1
    print(f"wrote {args.out} (embedding_checkpoint {os.path.abspath(args.embedding_checkpoint)})")
    return 0


def _write(out: Path, data: dict[str, Any], base: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", dir=out.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(f"# rendered by {PROG} from {base}\n")
            f.write(dump_yaml(data, sort_keys=False))
        load_global_config(tmp)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


if __name__ == "__main__":
    sys.exit(main())
