from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Sgd(_message.Message):
    __slots__ = ("lr", "weight_decay")
    LR_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    lr: float
    weight_decay: float
    def __init__(self, lr: _Optional[float] = ..., weight_decay: _Optional[float] = ...) -> None: ...

class Adagrad(_message.Message):
    __slots__ = ("lr", "initial_accumulator_value", "g_square_momentum", "eps", "weight_decay", "vectorwise_shared")
    LR_FIELD_NUMBER: _ClassVar[int]
    INITIAL_ACCUMULATOR_VALUE_FIELD_NUMBER: _ClassVar[int]
    G_SQUARE_MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    VECTORWISE_SHARED_FIELD_NUMBER: _ClassVar[int]
    lr: float
    initial_accumulator_value: float
    g_square_momentum: float
    eps: float
    weight_decay: float
    vectorwise_shared: bool
    def __init__(self, lr: _Optional[float] = ..., initial_accumulator_value: _Optional[float] = ..., g_square_momentum: _Optional[float] = ..., eps: _Optional[float] = ..., weight_decay: _Optional[float] = ..., vectorwise_shared: bool = ...) -> None: ...

class Adam(_message.Message):
    __slots__ = ("lr", "beta1", "beta2", "eps", "weight_decay")
    LR_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    def __init__(self, lr: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., weight_decay: _Optional[float] = ...) -> None: ...

class Initialization(_message.Message):
    __slots__ = ("low", "high", "admit_probability", "has_weight_bound", "weight_bound", "seed")
    LOW_FIELD_NUMBER: _ClassVar[int]
    HIGH_FIELD_NUMBER: _ClassVar[int]
    ADMIT_PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    HAS_WEIGHT_BOUND_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BOUND_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    low: float
    high: float
    admit_probability: float
    has_weight_bound: bool
    weight_bound: float
    seed: int
    def __init__(self, low: _Optional[float] = ..., high: _Optional[float] = ..., admit_probability: _Optional[float] = ..., has_weight_bound: bool = ..., weight_bound: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class ConfigureRequest(_message.Message):
    __slots__ = ("sgd", "adagrad", "adam", "initialization")
    SGD_FIELD_NUMBER: _ClassVar[int]
    ADAGRAD_FIELD_NUMBER: _ClassVar[int]
    ADAM_FIELD_NUMBER: _ClassVar[int]
    INITIALIZATION_FIELD_NUMBER: _ClassVar[int]
    sgd: Sgd
    adagrad: Adagrad
    adam: Adam
    initialization: Initialization
    def __init__(self, sgd: _Optional[_Union[Sgd, _Mapping]] = ..., adagrad: _Optional[_Union[Adagrad, _Mapping]] = ..., adam: _Optional[_Union[Adam, _Mapping]] = ..., initialization: _Optional[_Union[Initialization, _Mapping]] = ...) -> None: ...

class ConfigureResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckpointFile(_message.Message):
    __slots__ = ("shard", "dim", "path", "rows", "state_width", "bytes", "sha256")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    STATE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    shard: int
    dim: int
    path: str
    rows: int
    state_width: int
    bytes: int
    sha256: str
    def __init__(self, shard: _Optional[int] = ..., dim: _Optional[int] = ..., path: _Optional[str] = ..., rows: _Optional[int] = ..., state_width: _Optional[int] = ..., bytes: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class ClearRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClearResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("ids", "dim", "train", "replica_index", "replica_size")
    IDS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    TRAIN_FIELD_NUMBER: _ClassVar[int]
    REPLICA_INDEX_FIELD_NUMBER: _ClassVar[int]
    REPLICA_SIZE_FIELD_NUMBER: _ClassVar[int]
    ids: bytes
    dim: int
    train: bool
    replica_index: int
    replica_size: int
    def __init__(self, ids: _Optional[bytes] = ..., dim: _Optional[int] = ..., train: bool = ..., replica_index: _Optional[int] = ..., replica_size: _Optional[int] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("rows", "misses", "missing", "generation")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    rows: bytes
    misses: int
    missing: bytes
    generation: int
    def __init__(self, rows: _Optional[bytes] = ..., misses: _Optional[int] = ..., missing: _Optional[bytes] = ..., generation: _Optional[int] = ...) -> None: ...

class UpdateRequest(_message.Message):
    __slots__ = ("ids", "grads", "dim", "replica_index", "replica_size", "generation")
    IDS_FIELD_NUMBER: _ClassVar[int]
    GRADS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    REPLICA_INDEX_FIELD_NUMBER: _ClassVar[int]
    REPLICA_SIZE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ids: bytes
    grads: bytes
    dim: int
    replica_index: int
    replica_size: int
    generation: int
    def __init__(self, ids: _Optional[bytes] = ..., grads: _Optional[bytes] = ..., dim: _Optional[int] = ..., replica_index: _Optional[int] = ..., replica_size: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class UpdateResponse(_message.Message):
    __slots__ = ("rows_updated",)
    ROWS_UPDATED_FIELD_NUMBER: _ClassVar[int]
    rows_updated: int
    def __init__(self, rows_updated: _Optional[int] = ...) -> None: ...

class ShardDumpRequest(_message.Message):
    __slots__ = ("directory",)
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    directory: str
    def __init__(self, directory: _Optional[str] = ...) -> None: ...

class ShardDumpResponse(_message.Message):
    __slots__ = ("files", "optimizer_json")
    FILES_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    files: _containers.RepeatedCompositeFieldContainer[CheckpointFile]
    optimizer_json: str
    def __init__(self, files: _Optional[_Iterable[_Union[CheckpointFile, _Mapping]]] = ..., optimizer_json: _Optional[str] = ...) -> None: ...

class ShardLoadRequest(_message.Message):
    __slots__ = ("directory",)
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    directory: str
    def __init__(self, directory: _Optional[str] = ...) -> None: ...

class ShardLoadResponse(_message.Message):
    __slots__ = ("rows_loaded",)
    ROWS_LOADED_FIELD_NUMBER: _ClassVar[int]
    rows_loaded: int
    def __init__(self, rows_loaded: _Optional[int] = ...) -> None: ...

class RowChunk(_message.Message):
    __slots__ = ("dim", "ids", "weights", "state", "state_width", "has_state")
    DIM_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STATE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    HAS_STATE_FIELD_NUMBER: _ClassVar[int]
    dim: int
    ids: bytes
    weights: bytes
    state: bytes
    state_width: int
    has_state: bool
    def __init__(self, dim: _Optional[int] = ..., ids: _Optional[bytes] = ..., weights: _Optional[bytes] = ..., state: _Optional[bytes] = ..., state_width: _Optional[int] = ..., has_state: bool = ...) -> None: ...

class ExportRowsRequest(_message.Message):
    __slots__ = ("max_rows_per_chunk",)
    MAX_ROWS_PER_CHUNK_FIELD_NUMBER: _ClassVar[int]
    max_rows_per_chunk: int
    def __init__(self, max_rows_per_chunk: _Optional[int] = ...) -> None: ...

class ImportRowsResponse(_message.Message):
    __slots__ = ("rows_imported",)
    ROWS_IMPORTED_FIELD_NUMBER: _ClassVar[int]
    rows_imported: int
    def __init__(self, rows_imported: _Optional[int] = ...) -> None: ...

class ShardStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShardStatusResponse(_message.Message):
    __slots__ = ("replica_index", "replica_size", "rows", "capacity", "read_only", "job_type", "optimizer_json", "serving", "lookups", "ids_looked_up", "misses", "evictions", "task", "task_progress", "checkpoint_version", "embedding_config_json")
    REPLICA_INDEX_FIELD_NUMBER: _ClassVar[int]
    REPLICA_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    READ_ONLY_FIELD_NUMBER: _ClassVar[int]
    JOB_TYPE_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    IDS_LOOKED_UP_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    TASK_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_VERSION_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    replica_index: int
    replica_size: int
    rows: int
    capacity: int
    read_only: bool
    job_type: str
    optimizer_json: str
    serving: bool
    lookups: int
    ids_looked_up: int
    misses: int
    evictions: int
    task: str
    task_progress: float
    checkpoint_version: str
    embedding_config_json: str
    def __init__(self, replica_index: _Optional[int] = ..., replica_size: _Optional[int] = ..., rows: _Optional[int] = ..., capacity: _Optional[int] = ..., read_only: bool = ..., job_type: _Optional[str] = ..., optimizer_json: _Optional[str] = ..., serving: bool = ..., lookups: _Optional[int] = ..., ids_looked_up: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., task: _Optional[str] = ..., task_progress: _Optional[float] = ..., checkpoint_version: _Optional[str] = ..., embedding_config_json: _Optional[str] = ...) -> None: ...

class PackedSlots(_message.Message):
    __slots__ = ("slots", "data")
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedCompositeFieldContainer[SlotHeader]
    data: bytes
    def __init__(self, slots: _Optional[_Iterable[_Union[SlotHeader, _Mapping]]] = ..., data: _Optional[bytes] = ...) -> None: ...

class SlotHeader(_message.Message):
    __slots__ = ("name", "shape", "mask")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    MASK_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    mask: bytes
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., mask: _Optional[bytes] = ...) -> None: ...

class WorkerLookupRequest(_message.Message):
    __slots__ = ("batch", "train", "drop_refs")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    TRAIN_FIELD_NUMBER: _ClassVar[int]
    DROP_REFS_FIELD_NUMBER: _ClassVar[int]
    batch: bytes
    train: bool
    drop_refs: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, batch: _Optional[bytes] = ..., train: bool = ..., drop_refs: _Optional[_Iterable[int]] = ...) -> None: ...

class WorkerLookupResponse(_message.Message):
    __slots__ = ("slots", "ref", "unknown_ids", "unknown_per_sample")
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    REF_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_IDS_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_PER_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    slots: PackedSlots
    ref: int
    unknown_ids: int
    unknown_per_sample: bytes
    def __init__(self, slots: _Optional[_Union[PackedSlots, _Mapping]] = ..., ref: _Optional[int] = ..., unknown_ids: _Optional[int] = ..., unknown_per_sample: _Optional[bytes] = ...) -> None: ...

class BackwardRequest(_message.Message):
    __slots__ = ("ref", "grads")
    REF_FIELD_NUMBER: _ClassVar[int]
    GRADS_FIELD_NUMBER: _ClassVar[int]
    ref: int
    grads: PackedSlots
    def __init__(self, ref: _Optional[int] = ..., grads: _Optional[_Union[PackedSlots, _Mapping]] = ...) -> None: ...

class BackwardResponse(_message.Message):
    __slots__ = ("rows_queued", "nonfinite_rows_skipped")
    ROWS_QUEUED_FIELD_NUMBER: _ClassVar[int]
    NONFINITE_ROWS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    rows_queued: int
    nonfinite_rows_skipped: int
    def __init__(self, rows_queued: _Optional[int] = ..., nonfinite_rows_skipped: _Optional[int] = ...) -> None: ...

class WorkerDumpRequest(_message.Message):
    __slots__ = ("directory", "overwrite")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    OVERWRITE_FIELD_NUMBER: _ClassVar[int]
    directory: str
    overwrite: bool
    def __init__(self, directory: _Optional[str] = ..., overwrite: bool = ...) -> None: ...

class WorkerLoadRequest(_message.Message):
    __slots__ = ("directory",)
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    directory: str
    def __init__(self, directory: _Optional[str] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("stage", "done", "total", "message")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    stage: str
    done: int
    total: int
    message: str
    def __init__(self, stage: _Optional[str] = ..., done: _Optional[int] = ..., total: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class WorkerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatusResponse(_message.Message):
    __slots__ = ("shards", "shard_status", "pending_backward", "pending_gradient_batches", "nonfinite_rows_skipped", "task", "task_progress", "shard_errors", "embedding_config_json", "forward_buffer_size")
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    SHARD_STATUS_FIELD_NUMBER: _ClassVar[int]
    PENDING_BACKWARD_FIELD_NUMBER: _ClassVar[int]
    PENDING_GRADIENT_BATCHES_FIELD_NUMBER: _ClassVar[int]
    NONFINITE_ROWS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    TASK_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    SHARD_ERRORS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    FORWARD_BUFFER_SIZE_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedScalarFieldContainer[str]
    shard_status: _containers.RepeatedCompositeFieldContainer[ShardStatusResponse]
    pending_backward: int
    pending_gradient_batches: int
    nonfinite_rows_skipped: int
    task: str
    task_progress: float
    shard_errors: _containers.RepeatedScalarFieldContainer[str]
    embedding_config_json: str
    forward_buffer_size: int
    def __init__(self, shards: _Optional[_Iterable[str]] = ..., shard_status: _Optional[_Iterable[_Union[ShardStatusResponse, _Mapping]]] = ..., pending_backward: _Optional[int] = ..., pending_gradient_batches: _Optional[int] = ..., nonfinite_rows_skipped: _Optional[int] = ..., task: _Optional[str] = ..., task_progress: _Optional[float] = ..., shard_errors: _Optional[_Iterable[str]] = ..., embedding_config_json: _Optional[str] = ..., forward_buffer_size: _Optional[int] = ...) -> None: ...

class FlushRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FlushResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
