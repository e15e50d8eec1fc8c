"""KServe v2 gRPC messages of the client, in a private descriptor pool.

``tritonclient.grpc`` and the server's own messages both define ``inference.*`` symbols; a
generated ``*_pb2`` module would register them in protobuf's process-wide default pool and clash
with either ("duplicate symbol 'inference.ServerLiveRequest'"). The client builds its message
classes from its own serialized descriptor (:mod:`clients._v2_descriptor`, compiled from
``clients/grpc_predict_v2.proto``) in a private pool instead: same wire format and method paths,
no global registration, so it shares a process with tritonclient and the server.
"""

from __future__ import annotations

from types import SimpleNamespace

from google.protobuf import descriptor_pool, message_factory

from clients._v2_descriptor import serialized

#: The gRPC service of the protocol, as it appears in method paths.
SERVICE_NAME = "inference.GRPCInferenceService"


def _build() -> SimpleNamespace:
    pool = descriptor_pool.DescriptorPool()
    file = pool.AddSerializedFile(serialized())
    namespace: dict[str, object] = {"pool": pool, "file": file}
    for name, descriptor in file.message_types_by_name.items():
        namespace[name] = message_factory.GetMessageClass(descriptor)
    return SimpleNamespace(**namespace)


#: ``V2.ModelInferRequest``, ``V2.ModelMetadataResponse``, ... (and ``V2.pool``, ``V2.file``).
V2 = _build()

#: (method, request class, response class) of the service.
METHODS = (
    ("ServerLive", V2.ServerLiveRequest, V2.ServerLiveResponse),
    ("ServerReady", V2.ServerReadyRequest, V2.ServerReadyResponse),
    ("ModelReady", V2.ModelReadyRequest, V2.ModelReadyResponse),
    ("ServerMetadata", V2.ServerMetadataRequest, V2.ServerMetadataResponse),
    ("ModelMetadata", V2.ModelMetadataRequest, V2.ModelMetadataResponse),
    ("ModelInfer", V2.ModelInferRequest, V2.ModelInferResponse),
)

__all__ = ["METHODS", "SERVICE_NAME", "V2"]
