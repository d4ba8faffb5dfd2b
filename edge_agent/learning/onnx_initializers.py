# A graph's weights read from its ONNX bytes without the onnx package: the few protobuf fields initializers use.
from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from protocol.errors import FalError
from protocol.manifest import weight_of_initializer
from protocol.tensors import Weights

# Protobuf field numbers (onnx.proto): ModelProto.graph, GraphProto.initializer and .output, and TensorProto's fields.
MODEL_GRAPH, GRAPH_INITIALIZER, GRAPH_OUTPUT = 7, 5, 12
# ValueInfoProto.type, TypeProto.tensor_type, TypeProto.Tensor.shape, TensorShapeProto.dim, Dimension.dim_value.
VALUE_TYPE, TYPE_TENSOR, TENSOR_SHAPE, SHAPE_DIM, DIM_VALUE = 2, 1, 2, 1, 1
TENSOR_DIMS, TENSOR_DATA_TYPE, TENSOR_NAME, TENSOR_RAW_DATA, TENSOR_DATA_LOCATION = 1, 2, 8, 9, 14
FLOAT, EXTERNAL = 1, 1
VARINT, FIXED64, LENGTH, FIXED32 = 0, 1, 2, 5
Field = tuple[int, int, int | memoryview]


class OnnxGraphError(FalError, ValueError):
    """ONNX bytes this reader cannot take its weights from (malformed, or not raw float32 initializers)."""


def _varint(data: memoryview, at: int) -> tuple[int, int]:
    """The varint at `at` and the position after it."""
    value = shift = 0
    while at < len(data) and shift < 64:
        byte = data[at]
        value, at, shift = value | (byte & 0x7F) << shift, at + 1, shift + 7
        if byte < 0x80:
            return value, at
    raise OnnxGraphError("ONNX graph: truncated or overlong varint")


def _fields(data: memoryview) -> Iterator[Field]:
    """(field number, wire type, value) of every field of one protobuf message: an int, or a view of its bytes."""
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        number, kind = key >> 3, key & 7
        if kind == VARINT:
            value, at = _varint(data, at)
            yield number, kind, value
            continue
        if kind == LENGTH:
            size, at = _varint(data, at)
        elif kind in (FIXED64, FIXED32):
            size = 8 if kind == FIXED64 else 4
        else:
            raise OnnxGraphError(f"ONNX graph: protobuf wire type {kind} is not one ONNX uses")
        if at + size > len(data):
            raise OnnxGraphError("ONNX graph: a field runs past the end of the bytes")
        yield number, kind, data[at : at + size]
        at += size


def _dims(value: int | memoryview) -> list[int]:
    """One dims field: a single varint, or a packed run of them."""
    if isinstance(value, int):
        return [value]
    dims, at = [], 0
    while at < len(value):
        dim, at = _varint(value, at)
        dims.append(dim)
    return dims


def _tensor(data: memoryview) -> tuple[str, np.ndarray]:
    """An initializer's name and its float32 array, a read-only view of the graph's bytes."""
    dims: list[int] = []
    data_type, name, raw = 0, "", memoryview(b"")
    for number, _, value in _fields(data):
        if number == TENSOR_DIMS:
            dims += _dims(value)
        elif number == TENSOR_DATA_TYPE and isinstance(value, int):
            data_type = value
        elif number == TENSOR_NAME and isinstance(value, memoryview):
            name = bytes(value).decode("utf-8", "replace")
        elif number == TENSOR_RAW_DATA and isinstance(value, memoryview):
            raw = value
        elif number == TENSOR_DATA_LOCATION and value == EXTERNAL:
            raise OnnxGraphError(f"ONNX graph: initializer {name[:64]!r} keeps its data in an external file")
    if data_type != FLOAT or len(raw) != 4 * math.prod(dims):
        raise OnnxGraphError(f"ONNX graph: initializer {name[:64]!r} is not raw float32 data of shape {dims[:8]}")
    return name, np.frombuffer(raw, dtype="<f4").reshape(dims)


def graph_weights(data: bytes) -> Weights:
    """The model weights an exported fp32 graph holds as initializers (named by the exporter's convention), as
    read-only views of `data`: how a device completes a model from its frozen backbone without the onnx package."""
    weights: Weights = {}
    for graph in _graphs(data):
        for field, _, tensor in _fields(graph):
            if field == GRAPH_INITIALIZER and isinstance(tensor, memoryview):
                name, array = _tensor(tensor)
                weight = weight_of_initializer(name)
                if weight is not None:
                    weights[weight] = array
    return weights


def _graphs(data: bytes) -> Iterator[memoryview]:
    """The graph field of an ONNX model's bytes (the ModelProto)."""
    for number, _, graph in _fields(memoryview(data)):
        if number == MODEL_GRAPH and isinstance(graph, memoryview):
            yield graph


def _field(data: memoryview, wanted: int) -> memoryview:
    """The bytes of a message's first length-delimited field `wanted` (empty when it has none)."""
    for number, _, value in _fields(data):
        if number == wanted and isinstance(value, memoryview):
            return value
    return memoryview(b"")


def _dimension(data: memoryview) -> int | None:
    """One Dimension's fixed size, or None for a named (dynamic) or unset one."""
    for number, _, value in _fields(data):
        if number == DIM_VALUE and isinstance(value, int):
            return value
    return None


def output_shape(data: bytes) -> list[int | None]:
    """The first output's shape an ONNX graph declares (None for each dynamic axis, such as the batch), read from
    its bytes without the onnx package: what a device checks a frozen prefix's cached rows against."""
    graph = next(_graphs(data), None)
    if graph is None:
        raise OnnxGraphError("ONNX graph: the bytes hold no graph")
    shape = _field(_field(_field(_field(graph, GRAPH_OUTPUT), VALUE_TYPE), TYPE_TENSOR), TENSOR_SHAPE)
    return [_dimension(dim) for number, _, dim in _fields(shape) if number == SHAPE_DIM and isinstance(dim, memoryview)]
