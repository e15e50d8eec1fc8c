"""KServe v2 / Open Inference Protocol messages for the serving front ends.

``grpc_predict_v2.proto`` is compiled by ``scripts/gen_proto.sh`` into the usual
``grpc_predict_v2_pb2*.py`` modules. The servers do NOT import those modules: they register the
``inference.*`` symbols in protobuf's process-wide default descriptor pool, and so does
``tritonclient.grpc`` (same package, other file), so importing both in one process (tests, a
benchmark that embeds a server, a client library next to a server) fails with "duplicate symbol
'inference.ServerLiveRequest'". Instead, :data:`V2` builds the same messages from the same
serialized descriptor (read out of the generated module's source) in a private pool: identical
wire format and method paths, no global registration. Use ``V2.ModelInferRequest`` etc.
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

from google.protobuf import descriptor_pool, message_factory

#: The gRPC service of the protocol, as it appears in method paths.
SERVICE_NAME = "inference.GRPCInferenceService"
_GENERATED = Path(__file__).with_name("grpc_predict_v2_pb2.py")


def _serialized_file_descriptor(path: Path) -> bytes:
    """The FileDescriptorProto that protoc embedded in a generated ``*_pb2.py`` module."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "AddSerializedFile"
            and node.args
        ):
            value = ast.literal_eval(node.args[0])
            if isinstance(value, bytes):
                return value
    raise RuntimeError(f"{path}: no serialized file descriptor found; rerun scripts/gen_proto.sh")


def _build() -> SimpleNamespace:
    pool = descriptor_pool.DescriptorPool()
    file = pool.AddSerializedFile(_serialized_file_descriptor(_GENERATED))
    namespace: dict[str, object] = {"pool": pool, "file": file, "SERVICE_NAME": SERVICE_NAME}
    for name, descriptor in file.message_types_by_name.items():
        namespace[name] = message_factory.GetMessageClass(descriptor)
    return SimpleNamespace(**namespace)


#: Message classes (``V2.ModelInferRequest``, ``V2.InferParameter``, ...), ``V2.pool`` (the
#: private descriptor pool, for server reflection) and ``V2.SERVICE_NAME``.
V2 = _build()

__all__ = ["SERVICE_NAME", "V2"]
