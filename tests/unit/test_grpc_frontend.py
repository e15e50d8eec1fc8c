"""gRPC front end on 127.0.0.1, driven by the real tritonclient.grpc client and raw stubs."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tritonclient.grpc import service_pb2 as triton_service_pb2
from tritonclient.utils import InferenceServerException

from embedding_store.errors import UnavailableError
from serving.grpc_frontend import GrpcHealth, InferenceServicer, InferenceStub, build_grpc_server
from serving.proto import SERVICE_NAME, V2
from tests.unit.fake_core import FakeCore, expected_predictions

USERS = [[1, 2], [3000], [2**63 + 5, 4, 9]]
AGES = [0.5, 1.0, -2.0]


@pytest.fixture(scope="module")
def core() -> FakeCore:
    return FakeCore()


@pytest.fixture(scope="module")
def served(core) -> Iterator[tuple[int, object]]:
    server, port, health = build_grpc_server(core, host="127.0.0.1", port=0, max_workers=4)
    server.start()
    try:
        yield port, health
    finally:
        health.shutdown()
        server.stop(None)


@pytest.fixture(scope="module")
def channel(served) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{served[0]}") as channel:
        yield channel


@pytest.fixture(scope="module")
def stub(channel) -> InferenceStub:
    return InferenceStub(channel)


@pytest.fixture(scope="module")
def triton(served) -> Iterator[triton_grpc.InferenceServerClient]:
    client = triton_grpc.InferenceServerClient(f"127.0.0.1:{served[0]}")
    yield client
    client.close()


@pytest.fixture(autouse=True)
def _reset(core):
    core.is_ready, core.fail_with, core.fallback_ids = True, None, 0
    core.calls.clear()
    yield


def _typed_request(users=USERS, ages=AGES, model="tiny") -> V2.ModelInferRequest:
    request = V2.ModelInferRequest(model_name=model, id="typed-1")
    ids = [i for row in users for i in row]
    request.inputs.add(
        name="user", datatype="UINT64", shape=[len(ids)]
    ).contents.uint64_contents.extend(ids)
    request.inputs.add(
        name="user.lengths", datatype="INT32", shape=[len(users)]
    ).contents.int_contents.extend([len(r) for r in users])
    request.inputs.add(
        name="age", datatype="FP32", shape=[len(ages), 1]
    ).contents.fp32_contents.extend(ages)
    return request


def _triton_inputs() -> list:
    ids = np.array([i for row in USERS for i in row], np.uint64)
    inputs = [
        triton_grpc.InferInput("user", [ids.size], "UINT64"),
        triton_grpc.InferInput("user.lengths", [3], "INT64"),
        triton_grpc.InferInput("age", [3, 1], "FP32"),
    ]
    inputs[0].set_data_from_numpy(ids)
    inputs[1].set_data_from_numpy(np.array([2, 1, 3], np.int64))
    inputs[2].set_data_from_numpy(np.array(AGES, np.float32).reshape(-1, 1))
    return inputs


def test_proto_matches_the_spec_messages_tritonclient_uses():
    ours, theirs = descriptor_pb2.FileDescriptorProto(), descriptor_pb2.FileDescriptorProto()
    V2.file.CopyToProto(ours)
    triton_service_pb2.DESCRIPTOR.CopyToProto(theirs)
    assert ours.package == theirs.package == "inference"
    reference = {message.name: message for message in theirs.message_type}
    for message in ours.message_type:
        assert message == reference[message.name], message.name
    (service,) = ours.service
    methods = {m.name: m for m in theirs.service[0].method}
    assert service.name == "GRPCInferenceService"
    for method in service.method:
        assert method == methods[method.name]


def test_tritonclient_grpc_health_and_metadata(triton, core):
    assert triton.is_server_live() and triton.is_server_ready()
    assert triton.is_model_ready("tiny") and triton.is_model_ready("tiny", "1")
    metadata = triton.get_server_metadata()
    assert metadata.name == "recserve-fake" and list(metadata.extensions) == ["binary_tensor_data"]
    model = triton.get_model_metadata("tiny")
    assert model.name == "tiny" and list(model.versions) == ["1"]
    assert [(t.name, t.datatype, list(t.shape)) for t in model.inputs] == [
        ("user", "UINT64", [-1]),
        ("user.lengths", "INT32", [-1]),
        ("age", "FP32", [-1, 1]),
    ]
    assert [t.name for t in model.outputs] == ["prediction"]
    core.is_ready = False
    assert not triton.is_server_ready() and not triton.is_model_ready("tiny")
    with pytest.raises(InferenceServerException, match="unknown model 'nope'"):
        triton.get_model_metadata("nope")


def test_tritonclient_grpc_infer_raw(triton, core):
    core.fallback_ids = 3
    result = triton.infer("tiny", _triton_inputs(), request_id="r-1", model_version="1")
    np.testing.assert_allclose(
        result.as_numpy("prediction"), expected_predictions(USERS, AGES), rtol=1e-6
    )
    response = result.get_response()
    assert (response.model_name, response.model_version, response.id) == ("tiny", "1", "r-1")
    assert response.parameters["fallback_ids"].int64_param == 3
    assert response.parameters["unknown_ids"].int64_param == 2
    assert len(response.raw_output_contents) == 1  # raw in, raw out
    (call,) = core.calls
    assert call["protocol"] == "grpc" and call["version"] == "1"


def test_client_deadline_reaches_the_core(triton, core):
    triton.infer("tiny", _triton_inputs(), client_timeout=5.0)
    assert 0 < core.calls[0]["timeout"] <= 5.1  # gRPC rounds deadlines up a little


def test_typed_contents_in_typed_contents_out(stub):
    response = stub.ModelInfer(_typed_request(), timeout=5)
    assert response.id == "typed-1" and not response.raw_output_contents
    (output,) = response.outputs
    assert (output.datatype, list(output.shape)) == ("FP32", [3, 1])
    np.testing.assert_allclose(
        np.asarray(output.contents.fp32_contents).reshape(3, 1),
        expected_predictions(USERS, AGES),
        rtol=1e-6,
    )
    assert response.parameters["unknown_ids"].int64_param == 2


def _code_and_details(call, *args):
    with pytest.raises(grpc.RpcError) as error:
        call(*args, timeout=5)
    return error.value.code(), error.value.details()


def test_errors_map_to_status_codes(stub, core):
    request = _typed_request()
    del request.inputs[1].contents.int_contents[-1]
    code, details = _code_and_details(stub.ModelInfer, request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        details == "input 'user.lengths': shape [3] has 3 elements but contents.int_contents has 2"
    )

    request = _typed_request()
    request.inputs[0].name = "users"
    code, details = _code_and_details(stub.ModelInfer, request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "unknown input 'users'" in details

    request = _typed_request()
    request.raw_input_contents.append(b"\0" * 8)
    code, _ = _code_and_details(stub.ModelInfer, request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT

    code, details = _code_and_details(stub.ModelInfer, _typed_request(model="other"))
    assert code == grpc.StatusCode.NOT_FOUND and "unknown model 'other'" in details
    code, _ = _code_and_details(
        stub.ModelMetadata, V2.ModelMetadataRequest(name="tiny", version="2")
    )
    assert code == grpc.StatusCode.NOT_FOUND
    # A model (or version) not served is not ready: an answer, as HTTP's 404 is a "false".
    assert stub.ModelReady(V2.ModelReadyRequest(name="x"), timeout=5).ready is False
    assert stub.ModelReady(V2.ModelReadyRequest(name="tiny", version="2"), timeout=5).ready is False
    assert stub.ModelReady(V2.ModelReadyRequest(name="tiny"), timeout=5).ready is True

    core.is_ready = False
    code, details = _code_and_details(stub.ModelInfer, _typed_request())
    assert code == grpc.StatusCode.UNAVAILABLE and details == "model 'tiny' is not ready"

    core.is_ready = True
    core.fail_with = RuntimeError("secret internals")
    code, details = _code_and_details(stub.ModelInfer, _typed_request())
    assert code == grpc.StatusCode.INTERNAL and "secret" not in details


def test_tritonclient_sees_invalid_argument(triton):
    inputs = _triton_inputs()[:2]
    with pytest.raises(InferenceServerException, match="input 'age' is missing") as error:
        triton.infer("tiny", inputs)
    assert error.value.status() == "StatusCode.INVALID_ARGUMENT"


def test_health_service(served, channel, core):
    _, health = served
    checker = health_pb2_grpc.HealthStub(channel)
    for service in ("", SERVICE_NAME):
        response = checker.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert response.status == health_pb2.HealthCheckResponse.SERVING
    health.set_serving(False)
    response = checker.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
    assert response.status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert health.refresh(core) is True
    response = checker.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert response.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_and_describes_the_service(channel):
    reflector = reflection_pb2_grpc.ServerReflectionStub(channel)
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE_NAME),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="grpc.health.v1.Health"),
    ]
    listed, described, health = list(reflector.ServerReflectionInfo(iter(requests), timeout=5))
    names = {service.name for service in listed.list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names
    file = descriptor_pb2.FileDescriptorProto.FromString(
        described.file_descriptor_response.file_descriptor_proto[0]
    )
    assert file.package == "inference"
    assert [m.name for m in file.service[0].method][:6] == [
        "ServerLive",
        "ServerReady",
        "ModelReady",
        "ServerMetadata",
        "ModelMetadata",
        "ModelInfer",
    ]
    assert health.file_descriptor_response.file_descriptor_proto


def test_message_size_limit(core):
    server, port, _ = build_grpc_server(core, host="127.0.0.1", max_message_bytes=1024)
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            request = _typed_request(users=[[2**63] * 200], ages=[1.0])
            code, _ = _code_and_details(InferenceStub(channel).ModelInfer, request)
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        server.stop(None)


def test_a_malformed_protobuf_is_invalid_argument_naming_the_message(channel):
    """gRPC answers INTERNAL when its deserializer fails; the request is parsed by the
    handler instead, so a client's garbage is the client's error."""
    raw_infer = channel.unary_unary(
        "/inference.GRPCInferenceService/ModelInfer",
        request_serializer=lambda payload: payload,
        response_deserializer=lambda payload: payload,
    )
    with pytest.raises(grpc.RpcError) as refused:
        raw_infer(b"\x0a\xff", timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith("malformed ModelInferRequest: ")


def _with_timeout_parameter(microseconds: int) -> V2.ModelInferRequest:
    request = _typed_request()
    request.parameters["timeout"].int64_param = microseconds
    return request


def test_the_core_waits_the_shorter_of_deadline_and_timeout_parameter_or_its_own_default(
    stub, core
):
    stub.ModelInfer(_with_timeout_parameter(2_000_000), timeout=30)
    stub.ModelInfer(_with_timeout_parameter(60_000_000), timeout=30)
    stub.ModelInfer(_with_timeout_parameter(3_000_000))
    stub.ModelInfer(_typed_request())  # no deadline, no parameter: the server's default
    timeouts = [call["timeout"] for call in core.calls]
    assert timeouts[0] == 2.0
    assert 25 < timeouts[1] <= 30.1
    assert timeouts[2:] == [3.0, None]


# --------------------------------------------------------------------------- servicer, direct
class _AbortedError(Exception):
    """What a real ServicerContext.abort raises."""


class _Context:
    """The parts of grpc.ServicerContext the servicer uses."""

    def __init__(self, remaining: float | None = None) -> None:
        self.remaining = remaining
        self.callbacks: list = []
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    def time_remaining(self) -> float | None:
        return self.remaining

    def add_callback(self, callback) -> bool:
        self.callbacks.append(callback)
        return True

    def abort(self, code: grpc.StatusCode, details: str):
        self.aborted = (code, details)
        raise _AbortedError(details)


class _ServiceLikeCore(FakeCore):
    """A core with PredictionService's optional parts: ``on_cancel``, ``record_rejected``."""

    def __init__(self) -> None:
        super().__init__()
        self.is_live = True
        self.rejected: list[tuple[str, str, str]] = []
        self.cancel_hooks: list = []
        self.cancelled = False

    def live(self) -> bool:
        return self.is_live

    def record_rejected(self, protocol: str, name: str, error: BaseException) -> None:
        self.rejected.append((protocol, name, type(error).__name__))

    def predict(self, name, version, inputs, *, protocol, timeout=None, on_cancel=None):
        self.cancel_hooks.append(on_cancel)
        if self.cancelled:
            raise futures.CancelledError()
        return super().predict(name, version, inputs, protocol=protocol, timeout=timeout)


def test_the_servicer_passes_cancellation_and_reports_undecodable_requests() -> None:
    """A core that takes ``on_cancel`` gets the call's add_callback; a call the core drops as
    cancelled ends with an empty answer (no error status); a request that cannot be decoded
    is reported to the core's record_rejected and refused INVALID_ARGUMENT."""
    core = _ServiceLikeCore()
    servicer = InferenceServicer(core)
    context = _Context()
    response = servicer.ModelInfer(_typed_request(), context)
    assert list(response.outputs[0].shape) == [3, 1] and context.aborted is None
    assert core.cancel_hooks == [context.add_callback]

    core.cancelled = True
    assert servicer.ModelInfer(_typed_request(), context) == V2.ModelInferResponse()
    assert context.aborted is None

    broken = _typed_request(model="m7")
    del broken.inputs[1].contents.int_contents[-1]
    with pytest.raises(_AbortedError):
        servicer.ModelInfer(broken, context)
    assert context.aborted[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert core.rejected == [("grpc", "m7", "InvalidArgumentError")]


def test_an_infer_message_that_does_not_parse_is_counted_as_refused() -> None:
    """As HTTP counts a body it cannot decode: the model name unread, so ``""`` (the core
    labels it ``unknown``). Other methods count no prediction request."""
    core = _ServiceLikeCore()
    handlers = InferenceServicer(core).method_handlers()
    for method in ("ModelInfer", "ModelMetadata"):
        context = _Context()
        with pytest.raises(_AbortedError):
            handlers[method].unary_unary(b"\x0a\xff", context)
        assert context.aborted[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert core.rejected == [("grpc", "", "InvalidArgumentError")]


def test_server_live_answers_what_the_core_says() -> None:
    core = _ServiceLikeCore()
    servicer = InferenceServicer(core)
    assert servicer.ServerLive(V2.ServerLiveRequest(), _Context()).live is True
    core.is_live = False
    assert servicer.ServerLive(V2.ServerLiveRequest(), _Context()).live is False


def _health_status(health: GrpcHealth, service: str = SERVICE_NAME) -> int:
    request = health_pb2.HealthCheckRequest(service=service)
    return health.servicer.Check(request, _Context()).status


def test_health_is_not_serving_when_readiness_fails_and_for_good_after_shutdown() -> None:
    class Broken(FakeCore):
        def ready(self) -> bool:
            raise RuntimeError("readiness probe crashed")

    health = GrpcHealth()
    assert health.refresh(FakeCore()) is True
    assert _health_status(health) == health_pb2.HealthCheckResponse.SERVING
    assert health.refresh(Broken()) is False
    for service in GrpcHealth.SERVICES:
        assert _health_status(health, service) == health_pb2.HealthCheckResponse.NOT_SERVING
    health.set_serving(True)
    health.shutdown()
    health.set_serving(True)  # too late: a stopping server never reads SERVING again
    assert _health_status(health, "") == health_pb2.HealthCheckResponse.NOT_SERVING


def test_the_request_limit_is_its_own(core) -> None:
    """``max_request_bytes`` caps requests below ``max_message_bytes`` (--max-body-bytes)."""
    server, port, _ = build_grpc_server(
        core, host="127.0.0.1", max_message_bytes=1 << 20, max_request_bytes=1024
    )
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = InferenceStub(channel)
            assert stub.ModelInfer(_typed_request(), timeout=5).outputs
            request = _typed_request(users=[[2**63] * 200], ages=[1.0])
            code, _ = _code_and_details(stub.ModelInfer, request)
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        server.stop(None)


def test_an_ipv6_host_is_bracketed_and_a_failed_bind_is_unavailable(core) -> None:
    # 2001:db8::/32 is for documentation: no interface has it, so the bind fails.
    with pytest.raises(UnavailableError) as refused:
        build_grpc_server(core, host="2001:db8::1", port=0)
    assert refused.value.message.startswith("cannot listen for gRPC on [2001:db8::1]:0 (")


def test_tensors_naming_a_shared_memory_region_are_refused_saying_so(triton, core) -> None:
    # tritonclient's shared-memory API: the input's data would be in a region (none can be
    # registered here), the output would be written to one. An output answered in the
    # response instead would leave the client reading a region nobody wrote.
    inputs = _triton_inputs()
    inputs[2].set_shared_memory("age_region", 12)
    with pytest.raises(InferenceServerException) as error:
        triton.infer("tiny", inputs)
    assert error.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert error.value.message() == (
        "input 'age': parameter 'shared_memory_region': the shared-memory extensions are not "
        "supported (this server registers no region); send the input's data in the request "
        "(JSON 'data', binary data or raw contents)"
    )
    output = triton_grpc.InferRequestedOutput("prediction")
    output.set_shared_memory("out_region", 12)
    with pytest.raises(InferenceServerException) as error:
        triton.infer("tiny", _triton_inputs(), outputs=[output])
    assert error.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert error.value.message() == (
        "output 'prediction': parameter 'shared_memory_region': the shared-memory extensions "
        "are not supported (this server registers no region); ask for the output without "
        "one: it comes back in the response"
    )
    assert core.calls == []  # refused before the core


def test_tritonclient_grpc_outputs_and_timeout_parameter(triton, core) -> None:
    # Outputs named by the client come back; an unknown one is refused naming it. tritonclient's
    # `timeout` is the request parameter, in microseconds, as Triton reads it.
    outputs = [triton_grpc.InferRequestedOutput("prediction")]
    result = triton.infer("tiny", _triton_inputs(), outputs=outputs, timeout=1_500_000)
    assert [output.name for output in result.get_response().outputs] == ["prediction"]
    np.testing.assert_allclose(
        result.as_numpy("prediction"), expected_predictions(USERS, AGES), rtol=1e-6
    )
    assert core.calls[0]["timeout"] == 1.5
    with pytest.raises(InferenceServerException) as error:
        triton.infer("tiny", _triton_inputs(), outputs=[triton_grpc.InferRequestedOutput("p")])
    assert error.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert error.value.message() == "unknown output 'p'; the model has outputs ['prediction']"


class _BlockingCore(FakeCore):
    """Holds every predict call until :attr:`release` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def predict(self, *args, **kwargs):
        self.entered.set()
        self.release.wait(10)
        return super().predict(*args, **kwargs)


def test_calls_beyond_maximum_concurrent_rpcs_are_resource_exhausted() -> None:
    """--max-concurrent-rpcs: with one call in progress, another (even a health check) is
    refused at once with RESOURCE_EXHAUSTED; once it ends, calls are answered again."""
    core = _BlockingCore()
    server, port, health = build_grpc_server(
        core, host="127.0.0.1", port=0, max_workers=4, maximum_concurrent_rpcs=1
    )
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = InferenceStub(channel)
            held = stub.ModelInfer.future(_typed_request(), timeout=10)
            assert core.entered.wait(5)
            code, details = _code_and_details(stub.ServerLive, V2.ServerLiveRequest())
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert details == "Concurrent RPC limit exceeded!"  # grpcio's own words
            core.release.set()
            assert len(held.result(timeout=10).outputs) == 1
            assert stub.ServerLive(V2.ServerLiveRequest(), timeout=5).live
    finally:
        core.release.set()
        health.shutdown()
        server.stop(None)


def test_liveness_readiness_and_health_answer_while_every_rpc_thread_waits() -> None:
    """The RPC pool's threads all wait for predictions (a slow embedding tier): liveness,
    readiness, metadata and health checks answer at once from threads of their own. They queued
    behind the predictions (ServerLive took 4.3 s with 12 calls waiting on a hung shard),
    and probes with second-long timeouts failed."""
    core = _BlockingCore()
    server, port, health = build_grpc_server(core, host="127.0.0.1", port=0, max_workers=1)
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = InferenceStub(channel)
            held = [stub.ModelInfer.future(_typed_request(), timeout=10) for _ in range(2)]
            assert core.entered.wait(5)  # the one RPC thread waits; the other call queues
            assert stub.ServerLive(V2.ServerLiveRequest(), timeout=2).live
            assert stub.ServerReady(V2.ServerReadyRequest(), timeout=2).ready
            assert stub.ModelReady(V2.ModelReadyRequest(name="tiny"), timeout=2).ready
            # Metadata, read from memory, too (a client such as tritonclient asks first).
            server_metadata = stub.ServerMetadata(V2.ServerMetadataRequest(), timeout=2)
            assert server_metadata.name == "recserve-fake"
            metadata = stub.ModelMetadata(V2.ModelMetadataRequest(name="tiny"), timeout=2)
            assert (metadata.name, list(metadata.versions)) == ("tiny", ["1"])
            checks = health_pb2_grpc.HealthStub(channel)
            for service in ("", SERVICE_NAME):
                answer = checks.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                assert answer.status == health_pb2.HealthCheckResponse.SERVING
            assert not any(call.done() for call in held)
            core.release.set()
            assert [len(call.result(timeout=10).outputs) for call in held] == [1, 1]
    finally:
        core.release.set()
        health.shutdown()
        server.stop(None)
