"""training.distributed and training.env: DDP options and the torchrun environment."""

from __future__ import annotations

import pytest
import torch

from embedding_store.errors import ConfigError
from training import distributed
from training.distributed import DDPOption


def test_ddp_option_backend_must_be_gloo_or_nccl():
    with pytest.raises(ConfigError) as refused:
        DDPOption(backend="mpi")
    assert str(refused.value) == "DDPOption.backend must be 'gloo' or 'nccl', got 'mpi'"
    assert DDPOption().backend == "gloo"


def test_ddp_option_nccl_needs_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError) as refused:
        DDPOption(backend="nccl")
    assert str(refused.value) == "DDPOption.backend 'nccl' needs CUDA; use 'gloo' on CPU"


def test_rank_world_size_and_local_rank_come_from_torchruns_environment(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert (distributed.rank(), distributed.local_rank(), distributed.world_size()) == (0, 0, 1)
    # Second node of two, four processes each: global rank 5 is local rank 1.
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert (distributed.rank(), distributed.local_rank(), distributed.world_size()) == (5, 1, 8)


def test_a_single_process_is_not_distributed_and_agrees_with_itself(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert distributed.init_distributed(DDPOption()) is False
    assert distributed.all_agree(True) is True
    assert distributed.all_agree(False) is False
    distributed.barrier()  # nothing to wait for
