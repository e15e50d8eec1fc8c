from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class SendBatchRequest(_message.Message):
    __slots__ = ("loader_index", "sequence", "batch")
    LOADER_INDEX_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    loader_index: int
    sequence: int
    batch: bytes
    def __init__(self, loader_index: _Optional[int] = ..., sequence: _Optional[int] = ..., batch: _Optional[bytes] = ...) -> None: ...

class SendBatchResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EndOfStreamRequest(_message.Message):
    __slots__ = ("loader_index", "batches_sent", "failure")
    LOADER_INDEX_FIELD_NUMBER: _ClassVar[int]
    BATCHES_SENT_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    loader_index: int
    batches_sent: int
    failure: str
    def __init__(self, loader_index: _Optional[int] = ..., batches_sent: _Optional[int] = ..., failure: _Optional[str] = ...) -> None: ...

class EndOfStreamResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
