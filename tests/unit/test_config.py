"""Strict configuration files: embedding_config.yml and global_config.yml."""

from __future__ import annotations

import dataclasses
import enum
import json
import re
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
import yaml

from embedding_store.config import (
    EMBEDDING_CONFIG_ENV,
    GLOBAL_CONFIG_ENV,
    CheckpointingConfig,
    CommonConfig,
    ConfigFieldError,
    EmbeddingConfig,
    EmbeddingParameterServerConfig,
    EmbeddingWorkerConfig,
    GlobalConfig,
    HashStackConfig,
    InferConfig,
    JobType,
    MetricsConfig,
    SlotConfig,
    embedding_config_from_mapping,
    embedding_config_to_mapping,
    from_mapping,
    global_config_from_mapping,
    global_config_to_mapping,
    load_embedding_config,
    load_global_config,
    load_yaml,
    to_mapping,
)
from embedding_store.errors import ConfigError, NotFoundError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "configs"


def write(tmp_path: Path, text: str, name: str = "embedding_config.yml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def write_mapping(tmp_path: Path, data: object, name: str = "embedding_config.yml") -> Path:
    return write(tmp_path, yaml.safe_dump(data, sort_keys=False), name)


def load_error(tmp_path: Path, data: object, name: str = "embedding_config.yml") -> str:
    path = write_mapping(tmp_path, data, name)
    loader = load_embedding_config if name.startswith("embedding") else load_global_config
    with pytest.raises(ConfigError) as info:
        loader(path)
    return info.value.message


# ----------------------------------------------------------------------------------------------
# Example files and defaults


def test_example_embedding_config_loads() -> None:
    config = load_embedding_config(EXAMPLES / "embedding_config.yml")
    assert config.slot_names == (
        "user_id",
        "item_id",
        "clicked_item_ids",
        "age",
        "city",
        "recent_queries",
    )
    assert config.feature_index_prefix_bit == 8
    assert config.feature_groups == {"item_group": ("item_id", "clicked_item_ids")}
    assert config.slot("user_id").hash_stack_config == HashStackConfig(2, 1_000_000)
    assert config.slot("recent_queries").embedding_summation is False
    assert config.id_space_of("clicked_item_ids") == "item_group"
    assert config.id_space_of("age") == "age"


def test_example_embedding_config_shows_every_key() -> None:
    raw = yaml.safe_load((EXAMPLES / "embedding_config.yml").read_text())
    assert set(raw) == {f.name for f in dataclasses.fields(EmbeddingConfig) if f.init}
    first_slot = raw["slots_config"]["user_id"]
    assert set(first_slot) == {f.name for f in dataclasses.fields(SlotConfig)}
    assert set(first_slot["hash_stack_config"]) == {
        f.name for f in dataclasses.fields(HashStackConfig)
    }


def test_example_global_config_loads_and_shows_every_key_with_defaults() -> None:
    config = load_global_config(EXAMPLES / "global_config.yml")
    assert config == GlobalConfig()
    raw = yaml.safe_load((EXAMPLES / "global_config.yml").read_text())
    assert raw == global_config_to_mapping(GlobalConfig())


def test_slot_defaults_are_persias() -> None:
    slot = SlotConfig(dim=8)
    assert slot.embedding_summation is True
    assert slot.sqrt_scaling is False
    assert slot.sample_fixed_size == 10
    assert slot.hash_stack_config == HashStackConfig(hash_stack_rounds=0, embedding_size=0)
    assert not slot.hash_stack_config.enabled
    config = EmbeddingConfig(slots_config={"a": slot})
    assert config.feature_index_prefix_bit == 8
    assert config.feature_groups == {}


def test_global_defaults_are_persias() -> None:
    config = GlobalConfig()
    common = config.common_config
    assert common.job_type is JobType.TRAIN
    assert common.metrics_config == MetricsConfig(True, "recserve", 10)
    assert common.checkpointing_config == CheckpointingConfig(num_workers=4)
    assert common.infer_config == InferConfig(servers=[], embedding_checkpoint=None)
    ps = config.embedding_parameter_server_config
    assert ps == EmbeddingParameterServerConfig(
        capacity=1_000_000,
        num_hashmap_internal_shards=1,
        enable_incremental_update=False,
        incremental_buffer_size=1_000_000,
        incremental_dir="/tmp/recserve/incremental",
    )
    assert config.embedding_worker_config == EmbeddingWorkerConfig(forward_buffer_size=1000)
    assert [j.value for j in JobType] == ["Train", "Eval", "Infer"]


def test_minimal_embedding_file_gets_defaults(tmp_path: Path) -> None:
    config = load_embedding_config(write(tmp_path, "slots_config:\n  age:\n    dim: 4\n"))
    assert config == EmbeddingConfig(slots_config={"age": SlotConfig(dim=4)})


def test_empty_global_file_is_defaults(tmp_path: Path) -> None:
    assert load_global_config(write(tmp_path, "", "global_config.yml")) == GlobalConfig()


# ----------------------------------------------------------------------------------------------
# Feature index prefixes


def grouped_config(bit: int = 8) -> EmbeddingConfig:
    return embedding_config_from_mapping(
        {
            "feature_index_prefix_bit": bit,
            "slots_config": {
                "u": {"dim": 8},
                "item": {"dim": 16},
                "age": {"dim": 4},
                "clicked": {"dim": 16},
                "user": {"dim": 8},
                "city": {"dim": 4},
            },
            "feature_groups": {
                "items": ["item", "clicked"],
                "users": ["user", "u"],
            },
        }
    )


def test_prefixes_two_groups_two_ungrouped() -> None:
    config = grouped_config(8)
    # ID spaces: items=1, users=2 (groups in declaration order), then age=3, city=4.
    assert config.id_spaces == ("items", "users", "age", "city")
    assert config.index_prefix("item") == 1 << 56 == 72057594037927936
    assert config.index_prefix("clicked") == 72057594037927936
    assert config.index_prefix("user") == 2 << 56 == 144115188075855872
    assert config.index_prefix("u") == 144115188075855872
    assert config.index_prefix("age") == 3 << 56 == 216172782113783808
    assert config.index_prefix("city") == 4 << 56 == 288230376151711744
    assert config.id_mask == (1 << 56) - 1 == 72057594037927935
    assert config.id_space_of("u") == "users"
    assert config.id_space_of("city") == "city"
    assert config.slot_names == ("u", "item", "age", "clicked", "user", "city")
    assert config.slot("age") == SlotConfig(dim=4)


def test_prefix_ids_masks_and_prefixes() -> None:
    config = grouped_config(8)
    raw = np.array([0, 5, 0xFFFF_FFFF_FFFF_FFFF, 1 << 56], dtype=np.uint64)
    stored = config.prefix_ids("city", raw)
    assert stored.dtype == np.uint64
    expected = [(int(r) & config.id_mask) | (4 << 56) for r in raw]
    assert stored.tolist() == expected
    assert stored.tolist()[2] == (4 << 56) | ((1 << 56) - 1)
    assert stored.tolist()[3] == 4 << 56


def test_prefix_with_other_bit_count() -> None:
    config = grouped_config(3)
    assert config.index_prefix("age") == 3 << 61
    assert config.index_prefix("city") == 4 << 61 == 9223372036854775808
    assert config.id_mask == (1 << 61) - 1


def test_prefix_bit_zero_has_no_prefix_and_no_mask() -> None:
    config = grouped_config(0)
    assert all(config.index_prefix(name) == 0 for name in config.slot_names)
    assert config.id_mask == 0xFFFF_FFFF_FFFF_FFFF
    raw = np.array([0, 0xFFFF_FFFF_FFFF_FFFF], dtype=np.uint64)
    assert config.prefix_ids("age", raw).tolist() == raw.tolist()
    assert config.id_space_of("u") == "users"


def test_id_spaces_must_fit_prefix_bits() -> None:
    slots = {f"s{i}": {"dim": 2} for i in range(3)}
    # 3 ID spaces fit in 2 bits (prefixes 1..3) ...
    config = embedding_config_from_mapping({"feature_index_prefix_bit": 2, "slots_config": slots})
    assert config.index_prefix("s2") == 3 << 62
    # ... 4 do not (prefix 0 is never used).
    slots["s3"] = {"dim": 2}
    with pytest.raises(ConfigError) as info:
        embedding_config_from_mapping(
            {"feature_index_prefix_bit": 2, "slots_config": slots}, source="e.yml"
        )
    message = info.value.message
    assert message.startswith("e.yml: feature_index_prefix_bit: 4 ID spaces")
    assert "at most 3" in message and "got 2" in message
    # A group counts once.
    ok = embedding_config_from_mapping(
        {
            "feature_index_prefix_bit": 2,
            "slots_config": slots,
            "feature_groups": {"g": ["s0", "s1"]},
        }
    )
    assert ok.id_spaces == ("g", "s2", "s3")


def test_unknown_slot_lookup_is_not_found() -> None:
    config = grouped_config()
    for lookup in (config.slot, config.index_prefix, config.id_space_of):
        with pytest.raises(NotFoundError) as info:
            lookup("nope")
        assert "unknown slot 'nope'" in info.value.message
        assert "u, item, age, clicked, user, city" in info.value.message


# ----------------------------------------------------------------------------------------------
# Validation errors name file, key path and value


def test_negative_dim(tmp_path: Path) -> None:
    message = load_error(tmp_path, {"slots_config": {"age": {"dim": -3}}})
    assert message.endswith(
        "embedding_config.yml: slots_config.age.dim: expected a positive integer, got -3"
    )
    assert str(tmp_path) in message


@pytest.mark.parametrize(
    ("slot", "fragment"),
    [
        ({"dim": 0}, "slots_config.s.dim: expected a positive integer, got 0"),
        (
            {"dim": 4, "sample_fixed_size": 0},
            "slots_config.s.sample_fixed_size: expected a positive integer, got 0",
        ),
        (
            {"dim": 4, "hash_stack_config": {"hash_stack_rounds": -1}},
            "slots_config.s.hash_stack_config.hash_stack_rounds: "
            "expected a non-negative integer, got -1",
        ),
        (
            {"dim": 4, "hash_stack_config": {"hash_stack_rounds": 2}},
            "slots_config.s.hash_stack_config.embedding_size: expected a positive integer when "
            "hash_stack_rounds > 0 (hash_stack_rounds is 2), got 0",
        ),
        (
            {"dim": 4, "embedding_summation": False, "sqrt_scaling": True},
            "slots_config.s.sqrt_scaling: sqrt_scaling: true needs embedding_summation: true",
        ),
        ({}, "slots_config.s.dim: required key is missing"),
    ],
)
def test_slot_validation(tmp_path: Path, slot: dict, fragment: str) -> None:
    message = load_error(tmp_path, {"slots_config": {"s": slot}})
    assert "embedding_config.yml: " + fragment in message


def test_prefix_bit_range(tmp_path: Path) -> None:
    message = load_error(
        tmp_path, {"feature_index_prefix_bit": 17, "slots_config": {"a": {"dim": 1}}}
    )
    assert (
        "embedding_config.yml: feature_index_prefix_bit: expected an integer in [0, 16], got 17"
        in message
    )
    message = load_error(
        tmp_path, {"feature_index_prefix_bit": -1, "slots_config": {"a": {"dim": 1}}}
    )
    assert "feature_index_prefix_bit: expected an integer in [0, 16], got -1" in message


def test_missing_and_empty_slots_config(tmp_path: Path) -> None:
    message = load_error(tmp_path, {"feature_index_prefix_bit": 8})
    assert "embedding_config.yml: slots_config: required key is missing" in message
    message = load_error(tmp_path, {"slots_config": {}})
    assert "embedding_config.yml: slots_config: expected at least one slot, got {}" in message


def test_group_with_unknown_slot(tmp_path: Path) -> None:
    message = load_error(
        tmp_path,
        {"slots_config": {"item": {"dim": 4}}, "feature_groups": {"g": ["item", "itme"]}},
    )
    assert "embedding_config.yml: feature_groups.g[1]: unknown slot 'itme'" in message
    assert "did you mean 'item'" in message


def test_slot_in_two_groups(tmp_path: Path) -> None:
    message = load_error(
        tmp_path,
        {
            "slots_config": {"a": {"dim": 4}, "b": {"dim": 4}, "c": {"dim": 4}},
            "feature_groups": {"g1": ["a", "b"], "g2": ["c", "b"]},
        },
    )
    assert (
        "embedding_config.yml: feature_groups.g2[1]: slot 'b' is in feature groups 'g1' and 'g2'"
        in message
    )


def test_slot_twice_in_one_group(tmp_path: Path) -> None:
    message = load_error(
        tmp_path, {"slots_config": {"a": {"dim": 4}}, "feature_groups": {"g": ["a", "a"]}}
    )
    assert "feature_groups.g[1]: slot 'a' is listed twice in feature group 'g'" in message


def test_group_dims_must_match(tmp_path: Path) -> None:
    message = load_error(
        tmp_path,
        {
            "slots_config": {"a": {"dim": 8}, "b": {"dim": 16}},
            "feature_groups": {"g": ["a", "b"]},
        },
    )
    assert "embedding_config.yml: feature_groups.g: slots of feature group 'g'" in message
    assert "same dim, got dims a: 8, b: 16" in message


def test_group_hash_stacking_must_match(tmp_path: Path) -> None:
    message = load_error(
        tmp_path,
        {
            "slots_config": {
                "a": {"dim": 8, "hash_stack_config": {"hash_stack_rounds": 2, "embedding_size": 9}},
                "b": {"dim": 8},
            },
            "feature_groups": {"g": ["a", "b"]},
        },
    )
    assert "feature_groups.g: slots of feature group 'g'" in message
    assert "same hash_stack_config" in message


def test_empty_group_and_name_collision(tmp_path: Path) -> None:
    message = load_error(tmp_path, {"slots_config": {"a": {"dim": 8}}, "feature_groups": {"g": []}})
    assert "feature_groups.g: expected a non-empty list of slot names, got []" in message
    message = load_error(
        tmp_path,
        {
            "slots_config": {"a": {"dim": 8}, "b": {"dim": 8}, "c": {"dim": 8}},
            "feature_groups": {"c": ["a", "b"]},
        },
    )
    assert (
        "feature_groups.c: feature group name 'c' collides with the ungrouped slot 'c'" in message
    )


def test_unknown_key_did_you_mean(tmp_path: Path) -> None:
    message = load_error(tmp_path, {"slot_config": {"a": {"dim": 8}}})
    assert "embedding_config.yml: slot_config: unknown key; did you mean 'slots_config'?" in message
    message = load_error(tmp_path, {"slots_config": {"a": {"dim": 8, "sqrt_scalling": True}}})
    assert "slots_config.a.sqrt_scalling: unknown key; did you mean 'sqrt_scaling'?" in message
    message = load_error(tmp_path, {"slots_config": {"a": {"dim": 8, "zzz": 1}}})
    assert "slots_config.a.zzz: unknown key (allowed keys: dim, embedding_summation" in message


@pytest.mark.parametrize(
    ("slot", "fragment"),
    [
        ({"dim": "8"}, "slots_config.a.dim: expected an integer, got '8' (string)"),
        ({"dim": True}, "slots_config.a.dim: expected an integer, got True (boolean)"),
        ({"dim": 8.0}, "slots_config.a.dim: expected an integer, got 8.0 (float)"),
        ({"dim": None}, "slots_config.a.dim: expected an integer, got None (null)"),
        (
            {"dim": 8, "embedding_summation": 1},
            "slots_config.a.embedding_summation: expected a boolean (true/false), got 1 (integer)",
        ),
        (
            {"dim": 8, "sqrt_scaling": "yes please"},
            "slots_config.a.sqrt_scaling: expected a boolean (true/false), got 'yes please'",
        ),
        (
            {"dim": 8, "hash_stack_config": [1, 2]},
            "slots_config.a.hash_stack_config: expected a mapping, got [1, 2] (list)",
        ),
    ],
)
def test_wrong_types(tmp_path: Path, slot: dict, fragment: str) -> None:
    message = load_error(tmp_path, {"slots_config": {"a": slot}})
    assert "embedding_config.yml: " + fragment in message


def test_wrong_container_types(tmp_path: Path) -> None:
    message = load_error(tmp_path, {"slots_config": [{"dim": 8}]})
    assert (
        "embedding_config.yml: slots_config: expected a mapping, got [{'dim': 8}] (list)" in message
    )
    message = load_error(
        tmp_path, {"slots_config": {"a": {"dim": 8}}, "feature_groups": {"g": "a"}}
    )
    assert "feature_groups.g: expected a list, got 'a' (string)" in message
    message = load_error(
        tmp_path, {"slots_config": {"a": {"dim": 8}}, "feature_groups": {"g": [1]}}
    )
    assert "feature_groups.g[0]: expected a string, got 1 (integer)" in message
    message = load_error(tmp_path, {"slots_config": {1: {"dim": 8}}})
    assert "slots_config: keys must be strings, got key 1 (integer)" in message


def test_top_level_must_be_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_embedding_config(write(tmp_path, "- a\n- b\n"))
    assert "embedding_config.yml: expected a mapping at the top level, got ['a', 'b'] (list)" in (
        info.value.message
    )


def test_global_validation_errors(tmp_path: Path) -> None:
    name = "global_config.yml"
    cases = [
        (
            {"common_config": {"job_type": "Training"}},
            "common_config.job_type: expected one of 'Train', 'Eval', 'Infer', got 'Training'",
        ),
        (
            {"common_config": {"metrics_config": {"push_interval_sec": 0}}},
            "common_config.metrics_config.push_interval_sec: expected a positive integer, got 0",
        ),
        (
            {"common_config": {"checkpointing_config": {"num_workers": -2}}},
            "common_config.checkpointing_config.num_workers: expected a positive integer, got -2",
        ),
        (
            {"common_config": {"infer_config": {"servers": ["ps-0:8000", "ps-1"]}}},
            "common_config.infer_config.servers[1]: expected a 'host:port' address, got 'ps-1'",
        ),
        (
            {"common_config": {"infer_config": {"servers": ["ps-0:99999"]}}},
            "common_config.infer_config.servers[0]: expected a 'host:port' address with a port "
            "in 1..65535, got 'ps-0:99999'",
        ),
        (
            {"common_config": {"infer_config": {"servers": ["a:1", "a:1"]}}},
            "common_config.infer_config.servers[1]: duplicate server address 'a:1'",
        ),
        (
            {"common_config": {"job_type": "Infer", "infer_config": {"embedding_checkpoint": ""}}},
            "common_config.infer_config.embedding_checkpoint: expected a non-empty path when "
            "job_type is Infer, got ''",
        ),
        (
            {"embedding_parameter_server_config": {"capacity": 0}},
            "embedding_parameter_server_config.capacity: expected a positive integer, got 0",
        ),
        (
            {"embedding_parameter_server_config": {"num_hashmap_internal_shards": -1}},
            "embedding_parameter_server_config.num_hashmap_internal_shards: "
            "expected a positive integer, got -1",
        ),
        (
            {"embedding_parameter_server_config": {"incremental_buffer_size": 0}},
            "embedding_parameter_server_config.incremental_buffer_size: "
            "expected a positive integer, got 0",
        ),
        (
            {"embedding_parameter_server_config": {"enable_incremental_update": "false"}},
            "embedding_parameter_server_config.enable_incremental_update: "
            "expected a boolean (true/false), got 'false' (string)",
        ),
        (
            {"embedding_worker_config": {"forward_buffer_size": 0}},
            "embedding_worker_config.forward_buffer_size: expected a positive integer, got 0",
        ),
        (
            {"embedding_worker_config": {"forward_buffer_size": False}},
            "embedding_worker_config.forward_buffer_size: expected an integer, got False (boolean)",
        ),
        (
            {"common_config": {"infer_config": {"servers": "a:1"}}},
            "common_config.infer_config.servers: expected a list, got 'a:1' (string)",
        ),
        (
            {"common_conifg": {}},
            "common_conifg: unknown key; did you mean 'common_config'?",
        ),
    ]
    for data, fragment in cases:
        message = load_error(tmp_path, data, name)
        assert f"{name}: {fragment}" in message, message


def test_global_valid_infer_config(tmp_path: Path) -> None:
    data = {
        "common_config": {
            "job_type": "Infer",
            "infer_config": {
                "servers": ["ps-0:8000", "10.0.0.2:8001", "[::1]:8002"],
                "embedding_checkpoint": "/ckpt/v3",
            },
        },
        "embedding_parameter_server_config": {"incremental_dir": "/x"},
    }
    config = load_global_config(write_mapping(tmp_path, data, "global_config.yml"))
    assert config.common_config.job_type is JobType.INFER
    assert config.common_config.infer_config.servers == ("ps-0:8000", "10.0.0.2:8001", "[::1]:8002")
    assert config.common_config.infer_config.embedding_checkpoint == "/ckpt/v3"
    assert config.embedding_parameter_server_config.incremental_dir == "/x"
    # Incremental dumps are not implemented: asking for them names the key, not a silent no.
    data["embedding_parameter_server_config"] = {"enable_incremental_update": True}
    path = write_mapping(tmp_path, data, "incremental.yml")
    with pytest.raises(ConfigError) as caught:
        load_global_config(path)
    message = str(caught.value)
    assert "incremental.yml" in message
    assert "embedding_parameter_server_config.enable_incremental_update" in message
    assert "not implemented" in message
    # An empty checkpoint string is only an error for Infer jobs.
    train = global_config_from_mapping(
        {"common_config": {"infer_config": {"embedding_checkpoint": ""}}}
    )
    assert train.common_config.infer_config.embedding_checkpoint == ""


def test_direct_construction_validates_too() -> None:
    with pytest.raises(ConfigFieldError) as info:
        SlotConfig(dim=-3)
    assert info.value.message == "dim: expected a positive integer, got -3"
    assert isinstance(info.value, ConfigError)
    with pytest.raises(ConfigError, match="embedding_summation"):
        SlotConfig(dim=4, embedding_summation=False, sqrt_scaling=True)
    with pytest.raises(ConfigError, match=r"common_config|job_type"):
        CommonConfig(job_type="Train")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------
# Files and entry points


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "slots_config:\n  age:\n    dim: [8\n  city:\n    dim: 4\n")
    with pytest.raises(ConfigError) as info:
        load_embedding_config(path)
    message = info.value.message
    assert message.startswith(f"{path}: YAML syntax error at line ")
    line = int(message.split("at line ")[1].split(",")[0])
    assert 3 <= line <= 5


def test_yaml_bad_indentation_line(tmp_path: Path) -> None:
    path = write(tmp_path, "slots_config:\n  age:\n    dim: 8\n   bad: 1\n")
    with pytest.raises(ConfigError, match=r"embedding_config\.yml: YAML syntax error at line 4"):
        load_embedding_config(path)


def test_duplicate_key_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path, "slots_config:\n  age:\n    dim: 8\n    dim: 16\n")
    with pytest.raises(ConfigError) as info:
        load_embedding_config(path)
    assert (
        "embedding_config.yml: YAML syntax error at line 4, column 5: found duplicate key 'dim'"
        in (info.value.message)
    )


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.yml: config file not found"):
        load_embedding_config(tmp_path / "nope.yml")
    with pytest.raises(ConfigError, match=r"nope\.yml: config file not found"):
        load_global_config(tmp_path / "nope.yml")
    with pytest.raises(ConfigError, match="is a directory"):
        load_global_config(tmp_path)


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "global_config.yml"
    path.write_bytes(b"common_config: \xff\xfe\n")
    with pytest.raises(ConfigError, match=r"global_config\.yml: not valid UTF-8"):
        load_global_config(path)


def test_env_var_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    embedding = write(tmp_path, "slots_config:\n  a:\n    dim: 3\n")
    global_path = write(tmp_path, "embedding_worker_config:\n  forward_buffer_size: 7\n", "g.yml")
    monkeypatch.setenv(EMBEDDING_CONFIG_ENV, str(embedding))
    monkeypatch.setenv(GLOBAL_CONFIG_ENV, str(global_path))
    assert EMBEDDING_CONFIG_ENV == "RECSERVE_EMBEDDING_CONFIG"
    assert GLOBAL_CONFIG_ENV == "RECSERVE_GLOBAL_CONFIG"
    assert load_embedding_config().slot("a").dim == 3
    assert load_global_config().embedding_worker_config.forward_buffer_size == 7
    # An explicit path wins over the environment.
    other = write(tmp_path, "slots_config:\n  b:\n    dim: 5\n", "other.yml")
    assert load_embedding_config(str(other)).slot_names == ("b",)


def test_no_path_no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(EMBEDDING_CONFIG_ENV, raising=False)
    monkeypatch.delenv(GLOBAL_CONFIG_ENV, raising=False)
    assert load_global_config() == GlobalConfig()
    with pytest.raises(ConfigError) as info:
        load_embedding_config()
    assert "--embedding-config" in info.value.message
    assert "RECSERVE_EMBEDDING_CONFIG" in info.value.message
    monkeypatch.setenv(EMBEDDING_CONFIG_ENV, "")
    with pytest.raises(ConfigError, match="RECSERVE_EMBEDDING_CONFIG"):
        load_embedding_config()


def test_env_var_pointing_to_bad_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GLOBAL_CONFIG_ENV, str(tmp_path / "missing.yml"))
    with pytest.raises(ConfigError) as info:
        load_global_config()
    assert info.value.message == (
        f"{tmp_path / 'missing.yml'} (from RECSERVE_GLOBAL_CONFIG): config file not found"
    )


# ----------------------------------------------------------------------------------------------
# Round trip and immutability


def test_round_trip_embedding() -> None:
    config = load_embedding_config(EXAMPLES / "embedding_config.yml")
    data = embedding_config_to_mapping(config)
    assert json.loads(json.dumps(data)) == data
    assert yaml.safe_load(yaml.safe_dump(data, sort_keys=False)) == data
    again = embedding_config_from_mapping(yaml.safe_load(yaml.safe_dump(data, sort_keys=False)))
    assert again == config
    assert again.slot_names == config.slot_names
    assert [again.index_prefix(s) for s in again.slot_names] == [
        config.index_prefix(s) for s in config.slot_names
    ]
    assert "_prefix_of" not in data and "_slot_names" not in data


def test_round_trip_global() -> None:
    config = global_config_from_mapping(
        {
            "common_config": {
                "job_type": "Eval",
                "infer_config": {"servers": ["a:1"], "embedding_checkpoint": "/c"},
                "metrics_config": {"enable_metrics": False, "job_name": "j"},
            },
            "embedding_parameter_server_config": {"capacity": 5, "incremental_dir": "/x"},
        }
    )
    data = global_config_to_mapping(config)
    assert data["common_config"]["job_type"] == "Eval"
    assert json.loads(json.dumps(data)) == data
    assert global_config_from_mapping(data) == config
    assert global_config_to_mapping(global_config_from_mapping(data)) == data


def test_frozen() -> None:
    config = grouped_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.feature_index_prefix_bit = 4  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.slot("u").dim = 3  # type: ignore[misc]
    global_config = GlobalConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        global_config.common_config.job_type = JobType.EVAL  # type: ignore[misc]


# ----------------------------------------------------------------------------------------------
# The generic loader on its own


class Color(enum.Enum):
    RED = "red"
    ONE = 1


@dataclasses.dataclass(frozen=True)
class Inner:
    x: float = 0.0


@dataclasses.dataclass(frozen=True)
class Everything:
    n: int
    f: float = 1.5
    flag: bool = False
    name: str | None = None
    color: Color = Color.RED
    mode: Literal["fast", "slow", 3] = "fast"
    pair: tuple[int, str] = (0, "")
    many: tuple[int, ...] = ()
    inners: list[Inner] = dataclasses.field(default_factory=list)
    table: dict[str, Inner] = dataclasses.field(default_factory=dict)
    either: int | str = 0


def test_generic_loader_types() -> None:
    data = {
        "n": 3,
        "f": 2,
        "flag": True,
        "name": None,
        "color": 1,
        "mode": 3,
        "pair": [7, "seven"],
        "many": [1, 2, 3],
        "inners": [{"x": 1}, {}],
        "table": {"z": {"x": 0.5}, "a": {}},
        "either": "s",
    }
    obj = from_mapping(Everything, data, source="t.yml")
    assert obj.f == 2.0 and isinstance(obj.f, float)
    assert obj.color is Color.ONE
    assert obj.mode == 3
    assert obj.pair == (7, "seven")
    assert obj.many == (1, 2, 3)
    assert obj.inners == [Inner(1.0), Inner(0.0)]
    assert list(obj.table) == ["z", "a"]
    assert obj.either == "s"
    assert from_mapping(Everything, to_mapping(obj), source="t.yml") == obj
    assert to_mapping(obj)["color"] == 1 and to_mapping(obj)["pair"] == [7, "seven"]


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({}, "t.yml: n: required key is missing"),
        ({"n": 1, "f": True}, "t.yml: f: expected a number, got True (boolean)"),
        ({"n": 1, "f": "1.0"}, "t.yml: f: expected a number, got '1.0' (string)"),
        ({"n": 1, "name": 5}, "t.yml: name: expected a string, got 5 (integer)"),
        ({"n": 1, "color": "blue"}, "t.yml: color: expected one of 'red', 1, got 'blue' (string)"),
        ({"n": 1, "color": True}, "t.yml: color: expected one of 'red', 1, got True (boolean)"),
        (
            {"n": 1, "mode": "medium"},
            "t.yml: mode: expected one of 'fast', 'slow', 3, got 'medium'",
        ),
        ({"n": 1, "pair": [1]}, "t.yml: pair: expected a list of exactly 2 items, got [1] (list)"),
        ({"n": 1, "many": [1, "x"]}, "t.yml: many[1]: expected an integer, got 'x' (string)"),
        ({"n": 1, "inners": [{}, {"y": 1}]}, "t.yml: inners[1].y: unknown key"),
        ({"n": 1, "table": {"k": {"x": "no"}}}, "t.yml: table.k.x: expected a number, got 'no'"),
        ({"n": 1, "either": 1.5}, "t.yml: either: expected int or str, got 1.5 (float)"),
    ],
)
def test_generic_loader_errors(data: dict, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        from_mapping(Everything, data, source="t.yml")
    assert fragment in info.value.message


def test_generic_loader_path_prefix_and_load_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^s: outer\.inner\.x: expected a number"):
        from_mapping(Inner, {"x": "a"}, source="s", path="outer.inner")
    path = write(tmp_path, "x: 2.5\n", "inner.yml")
    assert load_yaml(Inner, path) == Inner(2.5)
    with pytest.raises(TypeError):
        to_mapping(Inner)
    with pytest.raises(TypeError):
        from_mapping(dict, {}, source="s")  # type: ignore[arg-type]


def test_configs_are_frozen_all_the_way_down(tmp_path) -> None:
    config = load_embedding_config(EXAMPLES / "embedding_config.yml")
    with pytest.raises(TypeError):
        config.slots_config["user_id"] = config.slots_config["age"]  # type: ignore[index]
    with pytest.raises(TypeError):
        config.feature_groups["other"] = ("age",)  # type: ignore[index]
    with pytest.raises(AttributeError):
        config.feature_groups["item_group"].append("age")  # type: ignore[attr-defined]
    infer = global_config_from_mapping(
        {"common_config": {"infer_config": {"servers": ["ps-0:8000"]}}}
    ).common_config.infer_config
    with pytest.raises(AttributeError):
        infer.servers.append("evil:1")  # type: ignore[attr-defined]
    # Still plain data on the way out, and equal after a round trip.
    mapping = embedding_config_to_mapping(config)
    assert mapping["feature_groups"] == {"item_group": ["item_id", "clicked_item_ids"]}
    assert embedding_config_from_mapping(mapping) == config
    yaml.safe_dump(mapping)


def test_integers_beyond_what_the_tier_can_hold_are_refused():
    # A capacity above int64 used to start a shard whose every Status call then failed.
    for section, key, value, message in (
        ("embedding_parameter_server_config", "capacity", 10**23, "expected at most 2**40"),
        ("embedding_parameter_server_config", "capacity", 2**40 + 1, "expected at most 2**40"),
        ("embedding_worker_config", "forward_buffer_size", 2**64, "expected at most 2**62"),
    ):
        with pytest.raises(
            ConfigError, match=re.escape(f"{section}.{key}: {message}, got {value}")
        ):
            global_config_from_mapping({section: {key: value}})
    config = global_config_from_mapping({"embedding_parameter_server_config": {"capacity": 2**40}})
    assert config.embedding_parameter_server_config.capacity == 2**40


# ----------------------------------------------------------------------------------------------
# Realistic maxima of slot sizes (the first lookup allocates batch x sample_fixed_size x dim)


@pytest.mark.parametrize(
    ("slot", "key", "value", "limit"),
    [
        ({"dim": 65537}, "dim", 65537, "65536"),
        ({"dim": 2**62}, "dim", 2**62, "65536"),
        ({"dim": 4, "sample_fixed_size": 100_001}, "sample_fixed_size", 100_001, "100000"),
        (
            {"dim": 4, "hash_stack_config": {"hash_stack_rounds": 65, "embedding_size": 10}},
            "hash_stack_config.hash_stack_rounds",
            65,
            "64",
        ),
        (
            {"dim": 4, "hash_stack_config": {"hash_stack_rounds": 2, "embedding_size": 2**40 + 1}},
            "hash_stack_config.embedding_size",
            2**40 + 1,
            "2**40",
        ),
    ],
)
def test_slot_sizes_have_realistic_maxima(
    tmp_path: Path, slot: dict, key: str, value: int, limit: str
) -> None:
    path = write_mapping(tmp_path, {"slots_config": {"s": slot}})
    with pytest.raises(ConfigError) as info:
        load_embedding_config(path)
    assert info.value.message == (
        f"{path}: slots_config.s.{key}: expected at most {limit}, got {value}"
    )


def test_slot_sizes_at_their_maxima_load() -> None:
    slot = SlotConfig(
        dim=65536,
        sample_fixed_size=100_000,
        hash_stack_config=HashStackConfig(hash_stack_rounds=64, embedding_size=2**40),
    )
    assert (slot.dim, slot.sample_fixed_size, slot.hash_stack_config.hash_stack_rounds) == (
        65536,
        100_000,
        64,
    )
    with pytest.raises(ConfigFieldError, match=r"^dim: expected at most 65536, got 65537$"):
        SlotConfig(dim=65537)


# ----------------------------------------------------------------------------------------------
# Numbers by the YAML 1.2 core schema (PyYAML alone reads YAML 1.1)


def test_yaml_numbers_follow_the_yaml_1_2_core_schema(tmp_path: Path) -> None:
    from embedding_store.config import read_yaml_mapping

    text = (
        "a: 16\nb: -3\nc: +7\nd: 0o17\ne: 0x1F\nf: 1e6\ng: 1.5e-3\nh: .5\ni: .inf\nj: -.Inf\n"
        "k: 1:00\nl: 1_000\nm: 2024-01-01\nn: 0\no: 1.\np: true\nq: yes\nr: ~\n"
    )
    data = read_yaml_mapping(write(tmp_path, text, "numbers.yml"))
    nan = read_yaml_mapping(write(tmp_path, "x: .nan\n", "nan.yml"))["x"]
    assert nan != nan
    assert data == {
        "a": 16,
        "b": -3,
        "c": 7,
        "d": 15,
        "e": 31,
        "f": 1e6,
        "g": 0.0015,
        "h": 0.5,
        "i": float("inf"),
        "j": float("-inf"),
        "k": "1:00",  # YAML 1.1: sexagesimal 60
        "l": "1_000",  # YAML 1.1: 1000
        "m": "2024-01-01",  # YAML 1.1: a date
        "n": 0,
        "o": 1.0,
        "p": True,
        "q": True,  # booleans kept: fields that are not booleans refuse them
        "r": None,
    }
    assert [type(data[k]) for k in "adf"] == [int, int, float]


@pytest.mark.parametrize(
    ("text", "detail"),
    [
        (
            "slots_config: {s: {dim: 016}}\n",  # YAML 1.1 tools: octal 14
            "slots_config.s.dim: integer 016 has a leading zero, which YAML 1.1 tools read as "
            "octal and YAML 1.2 as decimal: write 16; octal 016 is 0o16, or quote it for a "
            "string",
        ),
        (
            "slots_config: {s: {dim: 08}}\n",
            "slots_config.s.dim: integer 08 has a leading zero, which YAML 1.1 tools read as "
            "octal and YAML 1.2 as decimal: write 8, or quote it for a string",
        ),
        (
            "slots_config: {s: {dim: 1:00}}\n",  # YAML 1.1: 60
            "slots_config.s.dim: expected an integer, got '1:00' (string): integers are written "
            "in plain decimal digits (no '_' or ':')",
        ),
        (
            "slots_config: {s: {dim: 1e1}}\n",
            "slots_config.s.dim: expected an integer, got 10.0 (float): integers are written "
            "in digits only, e.g. 10",
        ),
        (
            "slots_config: {s: {dim: 2.5}}\n",
            "slots_config.s.dim: expected an integer, got 2.5 (float)",
        ),
        (
            "slots_config: {s: {dim: '12'}}\n",  # quoted: a string, whatever it reads like
            "slots_config.s.dim: expected an integer, got '12' (string)",
        ),
        (
            "slots_config: {s: {dim: 4, embedding_summation: yes, sqrt_scaling: 0}}\n",
            "slots_config.s.sqrt_scaling: expected a boolean (true/false), got 0 (integer)",
        ),
        (
            "slots_config: {007: {dim: 4}}\n",
            "slots_config: key integer 007 has a leading zero, which YAML 1.1 tools read as "
            "octal and YAML 1.2 as decimal: write 7; octal 007 is 0o7, or quote it for a string",
        ),
    ],
)
def test_yaml_1_1_number_quirks_are_refused_with_the_key_path(
    tmp_path: Path, text: str, detail: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_embedding_config(path)
    assert info.value.message == f"{path}: {detail}"


def test_a_float_capacity_names_the_integer_to_write(tmp_path: Path) -> None:
    path = write(tmp_path, "embedding_parameter_server_config: {capacity: 1e6}\n", "g.yml")
    with pytest.raises(ConfigError) as info:
        load_global_config(path)
    assert info.value.message == (
        f"{path}: embedding_parameter_server_config.capacity: expected an integer, got "
        "1000000.0 (float): integers are written in digits only, e.g. 1000000"
    )
    path.write_text("embedding_parameter_server_config: {capacity: 1000000}\n")
    assert load_global_config(path).embedding_parameter_server_config.capacity == 1_000_000


def test_yes_is_refused_where_a_string_is_expected(tmp_path: Path) -> None:
    path = write(tmp_path, "common_config: {metrics_config: {job_name: yes}}\n", "g.yml")
    with pytest.raises(ConfigError) as info:
        load_global_config(path)
    assert info.value.message == (
        f"{path}: common_config.metrics_config.job_name: expected a string, got True (boolean): "
        "YAML reads unquoted yes/no/on/off/true/false as booleans; quote it for a string "
        "(e.g. 'no')"
    )


# ----------------------------------------------------------------------------------------------
# PERSIA-only keys


def test_checkpointing_num_workers_is_accepted_and_ignored_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("WARNING", logger="embedding_store.config.global_config"):
        assert CheckpointingConfig().num_workers == 4
        assert caplog.messages == []
        config = global_config_from_mapping(
            {"common_config": {"checkpointing_config": {"num_workers": 16}}}
        )
    assert config.common_config.checkpointing_config.num_workers == 16
    assert caplog.messages == [
        "checkpointing_config.num_workers is accepted for compatibility with PERSIA configs "
        "and ignored: every parameter server dumps and loads its own shard"
    ]
    comment = next(
        line
        for line in (EXAMPLES / "global_config.yml").read_text().splitlines()
        if "num_workers:" in line
    )
    assert "no effect" in comment


@pytest.mark.parametrize(
    "text", ["1e6", "0o17", "0x1F", ".5", "-.inf", ".nan", "1.0", "16", "true"]
)
def test_dumped_strings_that_look_like_numbers_read_back_as_strings(tmp_path, text):
    """PyYAML's dumper quotes what YAML 1.1 reads as another type but leaves 1e6 or 0o17
    plain: the strict (YAML 1.2) loader would read them back as numbers."""
    from embedding_store.config.strict import dump_yaml, read_yaml_mapping

    data = {"job_name": text, "n": 3, "nested": {"items": [text, 1.5]}}
    path = tmp_path / "round.yml"
    path.write_text(dump_yaml(data, sort_keys=False))
    assert read_yaml_mapping(path) == data


# ----------------------------------------------------------------------------------------------
# Boundaries and messages the loaders promise


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"n": 1, "mode": 3.0}, "t.yml: mode: expected one of 'fast', 'slow', 3, got 3.0 (float)"),
        (
            {"n": 1, "pair": [1, "a", 2]},
            "t.yml: pair: expected a list of exactly 2 items, got [1, 'a', 2] (list)",
        ),
    ],
)
def test_generic_loader_refuses_near_misses(data: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        from_mapping(Everything, data, source="t.yml")
    assert info.value.message == message


def test_a_key_with_a_leading_zero_is_named_as_such(tmp_path: Path) -> None:
    path = write(tmp_path, "016: 1\n", "global_config.yml")
    with pytest.raises(ConfigError) as info:
        load_global_config(path)
    assert info.value.message == (
        f"{path}: key integer 016 has a leading zero, which YAML 1.1 tools read as octal and "
        "YAML 1.2 as decimal: write 16; octal 016 is 0o16, or quote it for a string"
    )


def test_the_largest_prefix_bit_count_loads() -> None:
    config = embedding_config_from_mapping(
        {"feature_index_prefix_bit": 16, "slots_config": {"a": {"dim": 1}}}
    )
    assert config.index_prefix("a") == 1 << 48 and config.id_mask == (1 << 48) - 1


@pytest.mark.parametrize("key", ["incremental_dir"])
def test_a_blank_string_is_refused(tmp_path: Path, key: str) -> None:
    message = load_error(
        tmp_path, {"embedding_parameter_server_config": {key: "   "}}, "global_config.yml"
    )
    assert message.endswith(
        f"embedding_parameter_server_config.{key}: expected a non-empty string, got '   '"
    )


def test_one_hash_stack_round_needs_an_embedding_size(tmp_path: Path) -> None:
    message = load_error(
        tmp_path, {"slots_config": {"a": {"dim": 2, "hash_stack_config": {"hash_stack_rounds": 1}}}}
    )
    assert message.endswith(
        "slots_config.a.hash_stack_config.embedding_size: expected a positive integer when "
        "hash_stack_rounds > 0 (hash_stack_rounds is 1), got 0"
    )


@pytest.mark.parametrize(
    ("server", "detail"),
    [
        ("host:0", "expected a 'host:port' address with a port in 1..65535, got 'host:0'"),
        ("host:65536", "expected a 'host:port' address with a port in 1..65535, got 'host:65536'"),
        (
            "::1:8000",
            "expected a 'host:port' address (write IPv6 hosts as [addr]:port), got '::1:8000'",
        ),
        (" host:80", "expected a 'host:port' address, got ' host:80'"),
    ],
)
def test_infer_server_addresses_are_checked(tmp_path: Path, server: str, detail: str) -> None:
    data = {"common_config": {"infer_config": {"servers": ["ok:1", server]}}}
    message = load_error(tmp_path, data, "global_config.yml")
    assert message.endswith(f"common_config.infer_config.servers[1]: {detail}")


def test_infer_server_addresses_at_the_bounds_load() -> None:
    servers = ("a:1", "b:65535", "[::1]:8000")
    config = global_config_from_mapping({"common_config": {"infer_config": {"servers": servers}}})
    assert config.common_config.infer_config.servers == servers


def test_an_empty_global_config_variable_means_the_defaults(monkeypatch) -> None:
    monkeypatch.setenv(GLOBAL_CONFIG_ENV, "")
    assert load_global_config() == GlobalConfig()


def test_pushgateway_metrics_settings_are_accepted_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("WARNING", logger="embedding_store.config.global_config"):
        assert MetricsConfig().job_name == "recserve"
        assert caplog.messages == []
        config = global_config_from_mapping(
            {"common_config": {"metrics_config": {"job_name": "ctr", "push_interval_sec": 5}}}
        )
    assert config.common_config.metrics_config.push_interval_sec == 5
    assert caplog.messages == [
        f"metrics_config.{key} has no effect in recserve: metrics are scraped from /metrics "
        "(set the job label in the scrape config), not pushed"
        for key in ("job_name", "push_interval_sec")
    ]


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ('slots_config:\n  "user\\u200b": {dim: 4}\n',
         "slots_config: slot name 'user\\u200b' contains the invisible or control character "
         "'\\u200b' (U+200B, category Cf)"),
        ('slots_config:\n  "\\u200b": {dim: 4}\n',
         "slots_config: slot name '\\u200b' contains the invisible or control character "
         "'\\u200b' (U+200B, category Cf)"),
        ('slots_config:\n  "us\\u0000er": {dim: 4}\n',
         "slots_config: slot name 'us\\x00er' contains the invisible or control character "
         "'\\x00' (U+0000, category Cc)"),
        ('slots_config:\n  "a\\u2028b": {dim: 4}\n',
         "slots_config: slot name 'a\\u2028b' contains the invisible or control character "
         "'\\u2028' (U+2028, category Zl)"),
        ('slots_config:\n  "user ": {dim: 4}\n',
         "slots_config: slot name 'user ' has leading or trailing whitespace"),
        ('slots_config:\n  "  ": {dim: 4}\n',
         "slots_config: slot names must be non-empty, got '  '"),
        ('slots_config:\n  a: {dim: 4}\nfeature_groups:\n  "\\tg": [a]\n',
         "feature_groups: group name '\\tg' has leading or trailing whitespace"),
        ('slots_config:\n  a: {dim: 4}\nfeature_groups:\n  "g\\u2029": [a]\n',
         "feature_groups: group name 'g\\u2029' has leading or trailing whitespace"),
        ('slots_config:\n  a: {dim: 4}\nfeature_groups:\n  "g\\u200dh": [a]\n',
         "feature_groups: group name 'g\\u200dh' contains the invisible or control character "
         "'\\u200d' (U+200D, category Cf)"),
    ],
)  # fmt: skip
def test_invisible_or_padded_slot_and_group_names_are_refused(tmp_path, yaml_text, message):
    """A slot named "user\\u200b" or "user " loaded, then read as "user" in every message
    while never matching it (an input tensor name, a key in requests and checkpoints)."""
    path = write(tmp_path, yaml_text)
    with pytest.raises(ConfigError) as caught:
        load_embedding_config(path)
    assert str(caught.value) == f"{path}: {message}"


def test_names_with_inner_spaces_and_other_scripts_load(tmp_path):
    text = 'slots_config:\n  "user id": {dim: 4}\n  "\\u7528\\u6237": {dim: 4}\n'
    config = load_embedding_config(write(tmp_path, text))
    assert config.slot_names == ("user id", "\u7528\u6237")
