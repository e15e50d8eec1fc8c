"""Strict configuration files: ``embedding_config.yml`` and ``global_config.yml``.

Both are frozen dataclasses loaded by a strict YAML loader (:mod:`.strict`): unknown keys,
wrong types and out-of-range values are :class:`~embedding_store.errors.ConfigError` naming
the file, the key path and the bad value.
"""

from embedding_store.config.embedding import (
    EMBEDDING_CONFIG_ENV,
    EMBEDDING_CONFIG_FLAG,
    MAX_FEATURE_INDEX_PREFIX_BIT,
    EmbeddingConfig,
    HashStackConfig,
    SlotConfig,
    embedding_config_from_mapping,
    embedding_config_to_mapping,
    load_embedding_config,
)
from embedding_store.config.global_config import (
    GLOBAL_CONFIG_ENV,
    GLOBAL_CONFIG_FLAG,
    CheckpointingConfig,
    CommonConfig,
    EmbeddingParameterServerConfig,
    EmbeddingWorkerConfig,
    GlobalConfig,
    InferConfig,
    JobType,
    MetricsConfig,
    global_config_from_mapping,
    global_config_to_mapping,
    load_global_config,
)
from embedding_store.config.strict import (
    ConfigFieldError,
    from_mapping,
    load_yaml,
    read_yaml_mapping,
    to_mapping,
)

__all__ = [
    "EMBEDDING_CONFIG_ENV",
    "EMBEDDING_CONFIG_FLAG",
    "GLOBAL_CONFIG_ENV",
    "GLOBAL_CONFIG_FLAG",
    "MAX_FEATURE_INDEX_PREFIX_BIT",
    "CheckpointingConfig",
    "CommonConfig",
    "ConfigFieldError",
    "EmbeddingConfig",
    "EmbeddingParameterServerConfig",
    "EmbeddingWorkerConfig",
    "GlobalConfig",
    "HashStackConfig",
    "InferConfig",
    "JobType",
    "MetricsConfig",
    "SlotConfig",
    "embedding_config_from_mapping",
    "embedding_config_to_mapping",
    "from_mapping",
    "global_config_from_mapping",
    "global_config_to_mapping",
    "load_embedding_config",
    "load_global_config",
    "load_yaml",
    "read_yaml_mapping",
    "to_mapping",
]
