"""Threads that run the model must not leave OpenMP workers spinning a core between batches."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from serving.model import adopt_torch_threads


def _cpu_per_wall_second(adopt: bool) -> float:
    """Process CPU seconds per wall second while a fresh thread runs small GEMMs 1 ms apart."""
    weights = torch.randn(64, 64)

    def batches() -> None:
        if adopt:
            adopt_torch_threads()
        for _ in range(300):
            weights @ weights  # MKL GEMM: the op that starts an OpenMP team
            time.sleep(0.001)

    cpu, wall = time.process_time(), time.perf_counter()
    worker = threading.Thread(target=batches)
    worker.start()
    worker.join()
    return (time.process_time() - cpu) / (time.perf_counter() - wall)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: OpenMP teams have one thread")
def test_adopted_thread_leaves_no_spinning_openmp_worker() -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # A spinning team member shows up as ~1 CPU second per wall second; 300 tiny GEMMs and
        # sleeps cost a small fraction of that.
        assert _cpu_per_wall_second(adopt=True) < 0.5
    finally:
        torch.set_num_threads(previous)
