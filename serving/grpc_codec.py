"""KServe v2 gRPC messages <-> :class:`~serving.infer_request.InferRequest` and predictions.

Inputs come as typed ``contents`` or as ``raw_input_contents`` (little-endian, sizes checked;
zero-copy ``np.frombuffer`` views, so decoded arrays may be read-only). Outputs go back as
``raw_output_contents`` when the request used raw inputs, else typed (the protocol allows
either). tritonclient always sends raw inputs, and reads only raw outputs. Also the metadata
response messages. Malformed tensors raise InvalidArgumentError naming the input.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from embedding_store.errors import InvalidArgumentError
from serving.core import ModelMetadata, Prediction, ServerMetadata
from serving.infer_request import (
    SHARED_MEMORY_REGION,
    InferRequest,
    RequestedOutput,
    array_from_bytes,
    count_mismatch,
    datatype_of,
    dtype_of,
    little_endian_bytes,
    request_timeout,
    response_parameters,
    select_outputs,
    shape_of,
    shared_memory_error,
)
from serving.proto import V2

#: gRPC InferTensorContents field per datatype, and the dtype that field holds on the wire.
_CONTENTS: dict[str, tuple[str, np.dtype]] = {
    "BOOL": ("bool_contents", np.dtype(bool)),
    "INT8": ("int_contents", np.dtype(np.int32)),
    "INT16": ("int_contents", np.dtype(np.int32)),
    "INT32": ("int_contents", np.dtype(np.int32)),
    "INT64": ("int64_contents", np.dtype(np.int64)),
    "UINT8": ("uint_contents", np.dtype(np.uint32)),
    "UINT16": ("uint_contents", np.dtype(np.uint32)),
    "UINT32": ("uint_contents", np.dtype(np.uint32)),
    "UINT64": ("uint64_contents", np.dtype(np.uint64)),
    "FP32": ("fp32_contents", np.dtype(np.float32)),
    "FP64": ("fp64_contents", np.dtype(np.float64)),
}


def parameter_value(parameter: Any) -> Any:
    """An InferParameter -> its Python value (None when unset)."""
    choice = parameter.WhichOneof("parameter_choice")
    return getattr(parameter, choice) if choice else None


def set_parameter(parameter: Any, value: Any) -> None:
    """Python value -> InferParameter (bool, int64/uint64, double, or string)."""
    if isinstance(value, (bool, np.bool_)):
        parameter.bool_param = bool(value)
    elif isinstance(value, (int, np.integer)):
        value = int(value)
        if value > np.iinfo(np.int64).max:
            parameter.uint64_param = value
        else:
            parameter.int64_param = value
    elif isinstance(value, (float, np.floating)):
        parameter.double_param = float(value)
    else:
        parameter.string_param = str(value)


def _grpc_tensor(name: str, tensor: Any) -> np.ndarray:
    dtype = dtype_of(name, tensor.datatype)
    dims = shape_of(name, list(tensor.shape))
    datatype = tensor.datatype
    if datatype not in _CONTENTS:
        # FP16 and the like have no typed contents field. Say in the same answer what the
        # inputs take, or the caller learns it one round trip later.
        raise InvalidArgumentError(
            f"input {name!r}: {datatype} tensors must be sent in raw_input_contents (and "
            "recserve models take IDs as INT64 or UINT64, lengths as INT32 or INT64, dense "
            "features as FP32)"
        )
    field, wire_dtype = _CONTENTS[datatype]
    values = getattr(tensor.contents, field)
    count = math.prod(dims)
    present = [descriptor.name for descriptor, _ in tensor.contents.ListFields()]
    if present and field not in present:
        # Checked before the count: values in another field are data the caller meant to
        # send, also when the shape holds no element (a count of 0 would match and drop them).
        raise InvalidArgumentError(
            f"input {name!r}: datatype {datatype} takes contents.{field}, got contents.{present[0]}"
        )
    if len(values) != count:
        raise InvalidArgumentError(count_mismatch(name, dims, len(values), f"contents.{field}"))
    if len(present) > 1:
        # A second typed field is data the caller meant to send: never drop it silently.
        others = sorted(other for other in present if other != field)
        raise InvalidArgumentError(
            f"input {name!r}: datatype {datatype} takes contents.{field} only, but "
            f"{', '.join('contents.' + other for other in others)} is also set"
        )
    array = np.fromiter(values, dtype=wire_dtype, count=count)
    if wire_dtype != dtype.newbyteorder("="):
        if count:
            info = np.iinfo(dtype)
            low, high = int(array.min()), int(array.max())
            if low < info.min or high > info.max:
                bad = low if low < info.min else high
                raise InvalidArgumentError(
                    f"input {name!r}: value {bad} is out of range for {datatype}"
                )
        array = array.astype(dtype.newbyteorder("="))
    return array.reshape(dims)


def decode_grpc_request(request: Any) -> InferRequest:
    """A ``ModelInferRequest`` (typed contents or raw_input_contents) -> :class:`InferRequest`.

    An input that names a shared-memory region carries no data, so its request fails to
    decode; the error then says why (the parameter is looked for only then: ~7 us a request
    for 27 inputs, a tenth of decoding them)."""
    try:
        return _decode_grpc_request(request)
    except InvalidArgumentError:
        for tensor in request.inputs:
            if SHARED_MEMORY_REGION in tensor.parameters:
                raise shared_memory_error(f"input {tensor.name!r}", output=False) from None
        raise


def _decode_grpc_request(request: Any) -> InferRequest:
    """:func:`decode_grpc_request` but for the shared-memory error."""
    raw = request.raw_input_contents
    if not request.inputs:
        raise InvalidArgumentError("the request has no inputs")
    if raw and len(raw) != len(request.inputs):
        raise InvalidArgumentError(
            f"raw_input_contents has {len(raw)} entries but the request has "
            f"{len(request.inputs)} inputs"
        )
    inputs: dict[str, np.ndarray] = {}
    for position, tensor in enumerate(request.inputs):
        name = tensor.name
        if name in inputs:
            raise InvalidArgumentError(f"input {name!r} is given twice")
        if raw:
            if tensor.HasField("contents"):
                raise InvalidArgumentError(
                    f"input {name!r}: contents must be empty when raw_input_contents is used"
                )
            inputs[name] = array_from_bytes(
                name,
                tensor.datatype,
                list(tensor.shape),
                raw[position],
                f"raw_input_contents[{position}]",
            )
        else:
            inputs[name] = _grpc_tensor(name, tensor)
    parameters = {key: parameter_value(value) for key, value in request.parameters.items()}
    outputs = None
    if request.outputs:
        names = [output.name for output in request.outputs]
        if len(set(names)) != len(names):
            twice = next(name for position, name in enumerate(names) if name in names[:position])
            # As over HTTP: name the output.
            raise InvalidArgumentError(f"output {twice!r} is requested twice")
        for output in request.outputs:
            # As over HTTP: a classification client must not get raw scores unannounced.
            classification = output.parameters.get("classification")
            if classification is not None and parameter_value(classification):
                raise InvalidArgumentError(
                    f"output {output.name!r}: the classification extension is not supported"
                )
            if SHARED_MEMORY_REGION in output.parameters:
                raise shared_memory_error(f"output {output.name!r}", output=True)
        outputs = tuple(RequestedOutput(name) for name in names)
    return InferRequest(
        inputs=inputs,
        id=request.id,
        parameters=parameters,
        outputs=outputs,
        raw=bool(raw),
        timeout=request_timeout(parameters),
    )


def encode_grpc_response(prediction: Prediction, request: InferRequest) -> Any:
    """:class:`Prediction` -> ``ModelInferResponse`` (raw outputs iff the request was raw;
    FP16 outputs force raw, since typed contents have no field for them)."""
    selected = select_outputs(prediction, request.outputs, False)
    datatypes = [datatype_of(array) for _, array, _ in selected]
    raw = request.raw or any(datatype not in _CONTENTS for datatype in datatypes)
    response = V2.ModelInferResponse(
        model_name=prediction.model_name, model_version=prediction.model_version, id=request.id
    )
    for key, value in response_parameters(prediction).items():
        set_parameter(response.parameters[key], value)
    for (name, array, _), datatype in zip(selected, datatypes):
        output = response.outputs.add(name=name, datatype=datatype, shape=array.shape)
        if raw:
            response.raw_output_contents.append(little_endian_bytes(array))
        else:
            field, _ = _CONTENTS[datatype]
            getattr(output.contents, field).extend(array.reshape(-1).tolist())
    return response


def model_metadata_message(metadata: ModelMetadata) -> Any:
    """:class:`ModelMetadata` -> ``ModelMetadataResponse``."""
    response = V2.ModelMetadataResponse(
        name=metadata.name, versions=list(metadata.versions), platform=metadata.platform
    )
    for specs, field in ((metadata.inputs, response.inputs), (metadata.outputs, response.outputs)):
        for spec in specs:
            field.add(name=spec.name, datatype=spec.datatype, shape=list(spec.shape))
    return response


def server_metadata_message(metadata: ServerMetadata) -> Any:
    """:class:`ServerMetadata` -> ``ServerMetadataResponse``."""
    return V2.ServerMetadataResponse(
        name=metadata.name, version=metadata.version, extensions=list(metadata.extensions)
    )
