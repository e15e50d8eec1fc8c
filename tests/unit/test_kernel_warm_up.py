"""A parameter server and an embedding worker compile their kernels before they report
SERVING: a fresh process's first lookup, update or backward must not pay numba's compilation
(seconds on a busy machine, close to a caller's timeout). Checked in one fresh interpreter,
where nothing compiled them yet: the worker starts first, then an inference shard, then a
training shard, and each line gives how many signatures each kernel has after that start."""

from __future__ import annotations

import pytest

from tests.unit.python_script import run_python

SCRIPT = """
from embedding_store import hashmap, initializer, optimizers, worker
from embedding_store.config import CommonConfig, EmbeddingConfig, GlobalConfig, JobType, SlotConfig
from embedding_store.initializer import InitializationConfig
from embedding_store.optimizers import Adagrad
from embedding_store.ps_client import RemoteParameterServer
from embedding_store.ps_process import ParameterServerOptions, ParameterServerProcess
from embedding_store.worker_service import serve_embedding_worker

WORKER = [worker._scatter_kernel, hashmap.get_or_insert_kernel]
LOOKUP = [
    hashmap.lookup_stamp_kernel,
    initializer._init_kernel,
    hashmap.gather_rows_kernel,
    hashmap.lookup_kernel,
]
UPDATE = [
    initializer._admit_kernel,
    optimizers.sgd_kernel,
    optimizers.adagrad_kernel,
    optimizers.adam_kernel,
]
CONFIG = EmbeddingConfig(slots_config={"a": SlotConfig(dim=4)})


def compiled():
    return " ".join(str([len(k.signatures) for k in ks]) for ks in (WORKER, LOOKUP, UPDATE))


print("fresh", compiled())
# No shard answers at 127.0.0.1:1 and there is no time to wait: the worker gives up in the
# wait for its shards, which is where it would turn SERVING.
code = serve_embedding_worker(CONFIG, ["127.0.0.1:1"], startup_timeout=0.0)
print("worker", code, compiled())
for job in ("Infer", "Train"):
    global_config = GlobalConfig(common_config=CommonConfig(job_type=JobType(job)))
    process = ParameterServerProcess(
        CONFIG, global_config, ParameterServerOptions(host="127.0.0.1", port=0)
    )
    process.start()
    try:
        print(job, "started", compiled())
        if job == "Train":
            with RemoteParameterServer(process.address, timeout=20) as client:
                client.configure(Adagrad(lr=0.5), InitializationConfig(admit_probability=0.9))
                print(job, "configured", client.health(), compiled())
    finally:
        process.stop(0)
"""


@pytest.fixture(scope="module")
def lines() -> list[str]:
    """The script's own lines (the worker also prints where it listens)."""
    printed = run_python(SCRIPT).stdout.splitlines()
    return [line for line in printed if line.split(" ")[0] in ("fresh", "worker", "Infer", "Train")]


def test_nothing_is_compiled_before_a_component_starts(lines):
    assert lines[0] == "fresh [0, 0] [0, 0, 0, 0] [0, 0, 0, 0]"


def test_an_embedding_worker_compiles_its_kernels_before_it_serves(lines):
    # The gradient scatter and the dedup index were compiled before the shards were asked.
    assert lines[1] == "worker 1 [1, 1] [0, 0, 0, 0] [0, 0, 0, 0]"


def test_an_inference_parameter_server_compiles_its_lookups_before_it_serves(lines):
    # Read-only: lookups only (the train lookup's kernels fill the scratch shard).
    assert lines[2] == "Infer started [1, 1] [1, 1, 1, 1] [0, 0, 0, 0]"


def test_a_training_parameter_server_compiles_its_kernels_before_it_serves(lines):
    # Started: admission and every optimizer's update are compiled (one signature each): the
    # shard's optimizer is not known before a trainer's Configure.
    assert lines[3] == "Train started [1, 1] [1, 1, 1, 1] [1, 1, 1, 1]"
    # Configure made it SERVING and had nothing left to compile (no second signature).
    assert lines[4] == "Train configured SERVING [1, 1] [1, 1, 1, 1] [1, 1, 1, 1]"
