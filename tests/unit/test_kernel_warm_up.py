"""A parameter server and an embedding worker compile their kernels before they report
SERVING: a fresh process's first lookup, update or backward must not pay numba's compilation
(seconds on a busy machine, close to a caller's timeout). Checked in a fresh interpreter,
where nothing compiled them yet."""

from __future__ import annotations

from tests.unit.python_script import run_python

SCRIPT = """
from embedding_store import hashmap, initializer, optimizers
from embedding_store.config import EmbeddingConfig, GlobalConfig, SlotConfig
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
process = ParameterServerProcess(
    EmbeddingConfig(slots_config={"a": SlotConfig(dim=4)}),
    GlobalConfig(),
    ParameterServerOptions(host="127.0.0.1", port=0),
)
process.start()
try:
    print("started", [len(k.signatures) for k in LOOKUP], len(optimizers.adagrad_kernel.signatures))
    with RemoteParameterServer(process.address, timeout=20) as client:
        client.configure(Adagrad(lr=0.1))
        print("configured", client.health(), len(optimizers.adagrad_kernel.signatures))
finally:
    process.stop(0)
"""


def test_a_parameter_server_compiles_its_kernels_before_it_serves():
    lines = run_python(SCRIPT).stdout.splitlines()
    # Started: the lookup kernels are compiled (one signature each), no optimizer's yet.
    assert lines[0] == "started [1, 1, 1, 1, 1] 0"
    # Configure returns with the shard SERVING and its optimizer's update kernel compiled.
    assert lines[1] == "configured SERVING 1"


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
