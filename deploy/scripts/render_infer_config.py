#!/usr/bin/env python3
"""Write an inference ``global_config.yml`` whose shards load a given embedding checkpoint.

    python deploy/scripts/render_infer_config.py --embedding-checkpoint DIR --out FILE \\
        [--base deploy/configs/global_config.infer.yml]

The config files hold no variables, so the Procfile of the serving stack
(``deploy/Procfile.serving``) renders one per shard from ``--base`` with
``common_config.job_type: Infer`` and ``common_config.infer_config.embedding_checkpoint``
set to the absolute path of DIR. The result is checked with recserve's own loader and written
atomically (a temporary file renamed into place).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import yaml

from embedding_store.config import global_config_from_mapping, load_global_config

DEFAULT_BASE = Path(__file__).resolve().parents[1] / "configs" / "global_config.infer.yml"


def render(base: Path, embedding_checkpoint: str) -> dict:
    data = yaml.safe_load(base.read_text()) or {}
    common = data.setdefault("common_config", {})
    common["job_type"] = "Infer"
    common.setdefault("infer_config", {})["embedding_checkpoint"] = os.path.abspath(
        embedding_checkpoint
    )
    global_config_from_mapping(data, source=str(base))  # fail here, not in the shard
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--embedding-checkpoint", required=True, metavar="DIR")
    parser.add_argument("--out", required=True, type=Path, metavar="FILE")
    parser.add_argument("--base", type=Path, default=DEFAULT_BASE, metavar="FILE")
    args = parser.parse_args(argv)
    data = render(args.base, args.embedding_checkpoint)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=args.out.name + ".", dir=args.out.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(f"# rendered by {Path(__file__).name} from {args.base}\n")
            yaml.safe_dump(data, f, sort_keys=False)
        load_global_config(tmp)
        os.replace(tmp, args.out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    print(f"wrote {args.out} (embedding_checkpoint {os.path.abspath(args.embedding_checkpoint)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
