"""A parameter-server shard is numpy and numba only: its process must not import torch, which
cost each shard ~1 s of CPU at start (``embedding_store.nonfinite``, imported for checkpoint
dumps and loads, imported it at the top), paid by every cluster start and shard restart."""

from __future__ import annotations

from tests.unit.python_script import run_python


def test_a_parameter_server_process_does_not_import_torch():
    result = run_python(
        "import sys\n"
        "from embedding_store import commands, ps_process\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    assert result.stdout.strip() == "[]", result.stdout[:2000]
