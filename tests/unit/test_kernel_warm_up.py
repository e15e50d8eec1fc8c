"""A parameter server and an embedding worker compile their kernels before they report
SERVING: a fresh process's first lookup, update or backward must not pay numba's compilation
(seconds on a busy machine, close to a caller's timeout). Checked in a fresh interpreter,
where nothing compiled them yet."""

from __future__ import annotations

from tests.unit.python_script import run_python

SCRIPT = """
import sys

from embedding_store import hashmap, initializer, optimizers
from embedding_store.config import CommonConfig, EmbeddingConfig, GlobalConfig, JobType, SlotConfig
from embedding_store.initializer import InitializationConfig
from embedding_store.optimizers import Adagrad
from embedding_store.ps_client import RemoteParameterServer
from embedding_store.ps_process import ParameterServerOptions, ParameterServerProcess

LOOKUP = [
    hashmap.lookup_stamp_kernel,
    hashmap.get_or_insert_kernel,
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


def compiled(kernels):
    return [len(kernel.signatures) for kernel in kernels]


infer = sys.argv[1] == "Infer"
global_config = GlobalConfig(common_config=CommonConfig(job_type=JobType(sys.argv[1])))
process = ParameterServerProcess(
    EmbeddingConfig(slots_config={"a": SlotConfig(dim=4)}),
    global_config,
    ParameterServerOptions(host="127.0.0.1", port=0),
)
process.start()
try:
    print("started", compiled(LOOKUP), compiled(UPDATE))
    if not infer:
        with RemoteParameterServer(process.address, timeout=20) as client:
            client.configure(Adagrad(lr=0.5), InitializationConfig(admit_probability=0.9))
            print("configured", client.health(), compiled(LOOKUP), compiled(UPDATE))
finally:
    process.stop(0)
"""


def test_a_training_parameter_server_compiles_its_kernels_before_it_serves():
    lines = run_python(SCRIPT, "Train").stdout.splitlines()
    # Started: the lookup kernels, admission and every optimizer's update are compiled (one
    # signature each): the shard's optimizer is not known before a trainer's Configure.
    assert lines[0] == "started [1, 1, 1, 1, 1] [1, 1, 1, 1]"
    # Configure made it SERVING and had nothing left to compile (no second signature).
    assert lines[1] == "configured SERVING [1, 1, 1, 1, 1] [1, 1, 1, 1]"


def test_an_inference_parameter_server_compiles_its_lookups_before_it_serves():
    lines = run_python(SCRIPT, "Infer").stdout.splitlines()
    # Read-only: lookups only (the train lookup's kernels fill the scratch shard).
    assert lines == ["started [1, 1, 1, 1, 1] [0, 0, 0, 0]"]


WORKER_SCRIPT = """
from embedding_store import hashmap, worker
from embedding_store.config import EmbeddingConfig, SlotConfig
from embedding_store.worker_service import serve_embedding_worker

# No shard answers at 127.0.0.1:1 and there is no time to wait: the worker gives up in the
# wait for its shards, which is where it would turn SERVING.
code = serve_embedding_worker(
    EmbeddingConfig(slots_config={"a": SlotConfig(dim=4)}), ["127.0.0.1:1"], startup_timeout=0.0
)
compiled = [hashmap.get_or_insert_kernel, worker._scatter_kernel]
print("exit", code, [len(kernel.signatures) for kernel in compiled])
"""


def test_an_embedding_worker_compiles_its_kernels_before_it_serves():
    lines = run_python(WORKER_SCRIPT).stdout.splitlines()
    # The dedup index and the gradient scatter were compiled before the shards were asked.
    assert lines[-1] == "exit 1 [1, 1]"
