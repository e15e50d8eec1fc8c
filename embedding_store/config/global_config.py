"""``global_config.yml``: job type, metrics, checkpointing, inference, PS and worker settings.

Key names follow PERSIA. Every key has a default, so an absent file means ``GlobalConfig()``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from embedding_store.cli_types import host_port_problem, url_problem
from embedding_store.config.strict import (
    ConfigFieldError,
    from_mapping,
    load_yaml,
    require_non_empty_str,
    require_positive_int,
    to_mapping,
)

__all__ = [
    "GLOBAL_CONFIG_ENV",
    "GLOBAL_CONFIG_FLAG",
    "CheckpointingConfig",
    "CommonConfig",
    "EmbeddingParameterServerConfig",
    "EmbeddingWorkerConfig",
    "GlobalConfig",
    "InferConfig",
    "JobType",
    "MetricsConfig",
    "global_config_from_mapping",
    "global_config_to_mapping",
    "load_global_config",
]

log = logging.getLogger(__name__)

GLOBAL_CONFIG_ENV = "RECSERVE_GLOBAL_CONFIG"
GLOBAL_CONFIG_FLAG = "--global-config"


class JobType(Enum):
    """What the job does; selects e.g. whether parameter servers accept gradient updates."""

    TRAIN = "Train"
    EVAL = "Eval"
    INFER = "Infer"


def _require_bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigFieldError(key, f"expected a boolean (true/false), got {value!r}")


def _check_server_address(key: str, value: Any) -> None:
    """``host:port`` with a non-empty host and a port in 1..65535 (``[::1]:8000`` for IPv6)."""
    expected = "expected a 'host:port' address"
    if not isinstance(value, str):
        raise ConfigFieldError(key, f"{expected}, got {value!r} ({type(value).__name__})")
    problem = url_problem(value)
    if problem:  # else refused below as an IPv6 host without brackets
        raise ConfigFieldError(key, f"{expected}: {problem}")
    host, sep, port = value.rpartition(":")
    if not sep or not host.strip() or host != host.strip():
        raise ConfigFieldError(key, f"{expected}, got {value!r}")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise ConfigFieldError(key, f"{expected} (write IPv6 hosts as [addr]:port), got {value!r}")
    if not (port.isdigit() and port.isascii() and 1 <= int(port) <= 65535):
        raise ConfigFieldError(key, f"{expected} with a port in 1..65535, got {value!r}")
    problem = host_port_problem(value)  # what the flags refuse too: "[]:80", "my host:80"
    if problem:
        raise ConfigFieldError(key, f"{expected}: {problem}")


@dataclass(frozen=True)
class MetricsConfig:
    """Prometheus metrics of every process."""

    enable_metrics: bool = True
    # PERSIA pushes metrics to a Pushgateway under this job name, every push_interval_sec.
    # recserve is scraped instead (/metrics; the job label comes from the scrape config):
    # both are accepted so PERSIA configs load, and a changed value is warned about.
    job_name: str = "recserve"
    push_interval_sec: int = 10

    def __post_init__(self) -> None:
        _require_bool("enable_metrics", self.enable_metrics)
        require_non_empty_str("job_name", self.job_name)
        require_positive_int("push_interval_sec", self.push_interval_sec)
        for key, default in (("job_name", "recserve"), ("push_interval_sec", 10)):
            if getattr(self, key) != default:
                log.warning(
                    "metrics_config.%s has no effect in recserve: metrics are scraped from "
                    "/metrics (set the job label in the scrape config), not pushed",
                    key,
                )


@dataclass(frozen=True)
class CheckpointingConfig:
    """Embedding checkpoint dump/load.

    PERSIA's ``num_workers`` (threads dumping/loading embedding files) is accepted so PERSIA
    configs load, and ignored: every parameter server dumps and loads its own shard's files
    (in parallel with the other shards, driven by the embedding worker). A changed value is
    warned about.
    """

    num_workers: int = 4

    def __post_init__(self) -> None:
        require_positive_int("num_workers", self.num_workers)
        if self.num_workers != 4:
            log.warning(
                "checkpointing_config.num_workers is accepted for compatibility with PERSIA "
                "configs and ignored: every parameter server dumps and loads its own shard"
            )


@dataclass(frozen=True)
class InferConfig:
    """Inference: the embedding servers to query and the checkpoint they serve."""

    servers: tuple[str, ...] = ()
    embedding_checkpoint: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.servers, (list, tuple)):
            raise ConfigFieldError("servers", f"expected a list, got {self.servers!r}")
        object.__setattr__(self, "servers", tuple(self.servers))
        seen: set[str] = set()
        for i, server in enumerate(self.servers):
            _check_server_address(f"servers[{i}]", server)
            if server in seen:
                raise ConfigFieldError(f"servers[{i}]", f"duplicate server address {server!r}")
            seen.add(server)
        if self.embedding_checkpoint is not None and not isinstance(self.embedding_checkpoint, str):
            raise ConfigFieldError(
                "embedding_checkpoint", f"expected a string, got {self.embedding_checkpoint!r}"
            )


@dataclass(frozen=True)
class CommonConfig:
    """Settings shared by every process of a job."""

    job_type: JobType = JobType.TRAIN
    metrics_config: MetricsConfig = field(default_factory=MetricsConfig)
    checkpointing_config: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    infer_config: InferConfig = field(default_factory=InferConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.job_type, JobType):
            allowed = ", ".join(repr(j.value) for j in JobType)
            raise ConfigFieldError("job_type", f"expected one of {allowed}, got {self.job_type!r}")
        checkpoint = self.infer_config.embedding_checkpoint
        if self.job_type is JobType.INFER and checkpoint is not None and not checkpoint.strip():
            raise ConfigFieldError(
                "infer_config.embedding_checkpoint",
                f"expected a non-empty path when job_type is Infer, got {checkpoint!r}",
            )


@dataclass(frozen=True)
class EmbeddingParameterServerConfig:
    """Embedding parameter server: table capacity, sharding, incremental updates."""

    capacity: int = 1_000_000
    num_hashmap_internal_shards: int = 1
    enable_incremental_update: bool = False
    incremental_buffer_size: int = 1_000_000
    incremental_dir: str = "/tmp/recserve/incremental"

    def __post_init__(self) -> None:
        # 2**40 rows: far beyond one server's memory, and its index (twice the capacity,
        # rounded up to a power of two) still fits int64.
        require_positive_int("capacity", self.capacity, maximum=2**40)
        require_positive_int("num_hashmap_internal_shards", self.num_hashmap_internal_shards)
        _require_bool("enable_incremental_update", self.enable_incremental_update)
        if self.enable_incremental_update:
            # Accepting it would promise incremental dumps that never get written.
            raise ConfigFieldError(
                "enable_incremental_update",
                "incremental updates are not implemented in recserve (servers pick up whole "
                "checkpoints: `recserve serve --watch-seconds`); set it to false",
            )
        require_positive_int("incremental_buffer_size", self.incremental_buffer_size)
        require_non_empty_str("incremental_dir", self.incremental_dir)


@dataclass(frozen=True)
class EmbeddingWorkerConfig:
    """Embedding worker: how many forwarded batches wait for their backward pass."""

    forward_buffer_size: int = 1000

    def __post_init__(self) -> None:
        require_positive_int("forward_buffer_size", self.forward_buffer_size)


@dataclass(frozen=True)
class GlobalConfig:
    """The whole ``global_config.yml``."""

    common_config: CommonConfig = field(default_factory=CommonConfig)
    embedding_parameter_server_config: EmbeddingParameterServerConfig = field(
        default_factory=EmbeddingParameterServerConfig
    )
    embedding_worker_config: EmbeddingWorkerConfig = field(default_factory=EmbeddingWorkerConfig)


def global_config_from_mapping(data: Any, source: str = "<mapping>") -> GlobalConfig:
    """Build a :class:`GlobalConfig` from a parsed YAML mapping; ``source`` names it."""
    return from_mapping(GlobalConfig, data, source=source)


def global_config_to_mapping(config: GlobalConfig) -> dict[str, Any]:
    """Plain-data form of ``config`` (inverse of :func:`global_config_from_mapping`)."""
    return to_mapping(config)


def load_global_config(path: str | os.PathLike[str] | None = None) -> GlobalConfig:
    """Load ``global_config.yml`` from ``path``, else ``$RECSERVE_GLOBAL_CONFIG`` (its errors
    then name the variable too), else defaults."""
    if path is not None:
        return load_yaml(GlobalConfig, path)
    from_env = os.environ.get(GLOBAL_CONFIG_ENV) or None
    if from_env is None:
        return GlobalConfig()
    return load_yaml(GlobalConfig, from_env, source=f"{from_env} (from {GLOBAL_CONFIG_ENV})")
