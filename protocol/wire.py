# Wire format v2: typed msgpack envelopes (no pickle), raw little-endian tensors, identifiers, decode limits.
from __future__ import annotations

import dataclasses
import functools
import hmac
import math
import re
import typing
import zlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgpack
import numpy as np

from protocol.bounds import INT_RANGE, bounds_of
from protocol.errors import RefusalError, UsageError
from protocol.messages import (
    MAX_BUNDLE_FILES,
    BundleFiles,
    M,
    Message,
    Recipe,
    RejectionKind,
    Tensors,
    Update,
)
from protocol.model_spec import ModelSpec, SpecError, spec_from_dict

WIRE_VERSION = 2
DEFLATE = "deflate"
SIGNED = "signed"
COMPRESSIONS = ("none", DEFLATE)
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
MAX_TENSOR_DIMS = 8
MAX_TENSORS = 1024
MAX_STRING_BYTES = 64 * 1024
# Letters, digits, "_", "." and "-", never "." or ".." alone (a topic level and a file name: no way out of a folder).
IDENTIFIER = re.compile(r"^(?!\.{1,2}$)[A-Za-z0-9_.-]{1,64}$")
IDENTIFIER_RULE = "1 to 64 letters, digits, '_', '.' or '-', and not '.' or '..'"
R = TypeVar("R")
ALLOWED_DTYPES = frozenset(
    np.dtype(name).newbyteorder("<").str
    for name in (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
    )
) | {"|b1", "|i1", "|u1"}


class WireError(RefusalError, ValueError):
    """Any message that cannot be decoded or does not fit its schema; the text says exactly what is wrong."""

    kind = RejectionKind.UNDECODABLE


def encode_tensor(array: np.ndarray) -> dict[str, Any]:
    """A tensor as {dtype, shape, data} with little-endian bytes, whatever the host's byte order."""
    array = np.asarray(array)
    little = array.astype(array.dtype.newbyteorder("<"), copy=False)
    if little.dtype.str not in ALLOWED_DTYPES:
        raise WireError(f"dtype {array.dtype} cannot go on the wire")
    return {"dtype": little.dtype.str, "shape": list(array.shape), "data": np.ascontiguousarray(little).tobytes()}


def decode_tensor(name: str, raw: Any) -> np.ndarray:
    """The inverse of encode_tensor, checking dtype, shape and byte length before touching the data: a read-only
    view of the bytes msgpack unpacked (copied only on a big-endian host), so decoding copies a tensor once."""
    if not isinstance(raw, dict) or set(raw) != {"dtype", "shape", "data"}:
        raise WireError(f"tensor {shown(name)} must be a map with exactly dtype, shape and data")
    dtype_str, shape, data = raw["dtype"], raw["shape"], raw["data"]
    if not isinstance(dtype_str, str) or dtype_str not in ALLOWED_DTYPES:
        raise WireError(f"tensor {shown(name)} has unsupported dtype {shown(dtype_str)}")
    if not isinstance(shape, list) or len(shape) > MAX_TENSOR_DIMS or not all(_is_int(d) and d >= 0 for d in shape):
        raise WireError(f"tensor {shown(name)} has an invalid shape {shown(shape)}")
    if not isinstance(data, bytes):
        raise WireError(f"tensor {shown(name)} data must be bytes")
    dtype = np.dtype(dtype_str)
    expected = math.prod(shape) * dtype.itemsize
    if len(data) != expected:
        raise WireError(f"tensor {shown(name)} has {len(data)} bytes, shape {shape} of {dtype} needs {expected}")
    array = np.frombuffer(data, dtype=dtype).reshape(shape)
    return array if dtype.isnative else array.astype(dtype.newbyteorder("="))


def encode(message: Message) -> bytes:
    """Serialises a message into a versioned msgpack envelope."""
    return msgpack.packb({"v": WIRE_VERSION, "kind": message.KIND, **_to_wire(message)}, use_bin_type=True)


def encode_record(record: Any) -> bytes:
    """A dataclass of wire-typed fields with a KIND (a saved protocol state, not a message) as an envelope."""
    return encode(typing.cast(Message, record))


def decode_record(data: bytes, cls: type[R], max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> R:
    """The record encode_record wrote, every field checked as a message's are (a WireError when it is not one)."""
    envelope = _envelope(data, max_bytes)
    kind = envelope.pop("kind", None)
    if kind != getattr(cls, "KIND", None):
        raise WireError(f"expected a {getattr(cls, 'KIND', '?')!r} record, got kind {shown(kind)}")
    return typing.cast(R, _from_fields(cls, envelope))


def deflated(payload: bytes) -> bytes:
    """An encoded message in a deflate envelope (lossless, for metered links); decode() unwraps it for any kind."""
    envelope = {"v": WIRE_VERSION, "kind": DEFLATE, "size": len(payload), "data": zlib.compress(payload, 6)}
    return msgpack.packb(envelope, use_bin_type=True)


def _inflated(envelope: dict[str, Any], max_bytes: int) -> bytes:
    """The message a deflate envelope holds, inflated no further than its declared size (at most max_bytes)."""
    size, data = envelope.get("size"), envelope.get("data")
    if set(envelope) != {"size", "data"} or not isinstance(size, int) or not isinstance(data, bytes):
        raise WireError("a deflate envelope must hold exactly an integer size and bytes data")
    if not 0 < size <= max_bytes:
        raise WireError(f"deflated message claims {shown(size)} bytes, the limit is {max_bytes}")
    inflater = zlib.decompressobj()
    try:
        inner = inflater.decompress(data, size + 1)
    except zlib.error as error:
        raise WireError(f"undecodable deflate data ({str(error)[:80]})") from None
    if len(inner) != size or not inflater.eof or inflater.unconsumed_tail:
        raise WireError(f"deflate data does not inflate to its declared {size} bytes")
    return inner


def signed(payload: bytes, key: bytes) -> bytes:
    """An encoded update in a signed envelope: the bytes as they are and their HMAC-SHA256 under the sender's key,
    checked over the very bytes decoded (no re-encoding)."""
    envelope = {"v": WIRE_VERSION, "kind": SIGNED, "data": payload, "signature": hmac.digest(key, payload, "sha256")}
    return msgpack.packb(envelope, use_bin_type=True)


def signature_valid(signed_bytes: bytes, signature: bytes, key: bytes) -> bool:
    """Constant-time check that the signature is the key's HMAC-SHA256 of the signed bytes."""
    return hmac.compare_digest(hmac.digest(key, signed_bytes, "sha256"), signature)


def decode(data: bytes, expected: type[M], max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> M:
    """A checked message of the expected type (through one deflate and an update's signed envelope), or a WireError."""
    envelope = _envelope(data, max_bytes)
    message: Any = _update(envelope, max_bytes)[0] if expected is Update else _message(envelope, expected, max_bytes)
    return message


def decode_any(data: bytes, expected: Sequence[Any], max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Any:
    """A message of whichever expected type its kind names (one topic, several kinds), else a WireError."""
    envelope = _envelope(data, max_bytes)
    kind = envelope.get("kind")
    for cls in expected:
        if kind == cls.KIND:
            return _message(envelope, cls, max_bytes)
    raise WireError(f"expected one of {shown_names([cls.KIND for cls in expected])}, got kind {shown(kind)}")


def decode_update(data: bytes, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> tuple[Update, bytes]:
    """An update (with its envelope's signature) and the bytes that covers: the signed message as sent, or b""."""
    return _update(_envelope(data, max_bytes), max_bytes)


def _update(envelope: dict[str, Any], max_bytes: int) -> tuple[Update, bytes]:
    if envelope.get("kind") != SIGNED:
        return _message(envelope, Update, max_bytes), b""
    data, sig = envelope.get("data"), envelope.get("signature")
    if set(envelope) != {"kind", "data", "signature"} or not isinstance(data, bytes) or not isinstance(sig, bytes):
        raise WireError("a signed envelope must hold exactly bytes data and a bytes signature")
    return dataclasses.replace(_message(_envelope(data, max_bytes), Update, max_bytes), signature=sig), data


def _envelope(data: bytes, max_bytes: int) -> dict[str, Any]:
    """The unpacked envelope of a payload of this wire version, its kind included."""
    if not isinstance(data, (bytes, bytearray)):
        raise WireError("payload must be bytes")
    if len(data) > max_bytes:
        raise WireError(f"message of {len(data)} bytes exceeds the limit of {max_bytes}")
    envelope = _unpack(bytes(data), max_bytes)
    version = envelope.pop("v", None)
    if not _is_int(version) or version != WIRE_VERSION:
        raise WireError(f"wire version {shown(version)} is not supported (this side speaks {WIRE_VERSION})")
    return envelope


def _message(envelope: dict[str, Any], expected: type[M], max_bytes: int, inflate: bool = True) -> M:
    """The message an envelope holds, inflating one deflate envelope."""
    kind = envelope.pop("kind", None)
    if kind == DEFLATE and inflate:
        return _message(_envelope(_inflated(envelope, max_bytes), max_bytes), expected, max_bytes, inflate=False)
    if kind != expected.KIND:
        raise WireError(f"expected a {expected.KIND!r} message, got kind {shown(kind)}")
    return _from_fields(expected, envelope)


def _unpack(data: bytes, max_bytes: int) -> dict[str, Any]:
    try:
        envelope = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=MAX_STRING_BYTES,
            max_bin_len=max_bytes,
            max_array_len=1 << 20,
            max_map_len=MAX_TENSORS + 64,
            max_ext_len=0,
        )
    # msgpack raises ValueError for malformed bytes and for its limits: the sender's message, refused
    except (ValueError, TypeError, msgpack.UnpackException, msgpack.ExtraData) as error:
        detail = f": {str(error)[:200]}" if str(error) else ""
        raise WireError(f"undecodable msgpack ({type(error).__name__}{detail})") from None
    if not isinstance(envelope, dict):
        raise WireError(f"message must be a map, got {type(envelope).__name__}")
    return envelope


def shown(value: Any, limit: int = 64) -> str:
    """repr(value) cut to `limit` characters, so no error message grows with what a sender put in a field."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def shown_names(names: Sequence[Any], count: int = 5, show: Callable[[Any], str] = lambda name: shown(name, 40)) -> str:
    """The first few items of a list (each as `show` writes it) and how many more there are."""
    head = ", ".join(show(name) for name in names[:count])
    return f"[{head}" + (f", ... and {len(names) - count} more]" if len(names) > count else "]")


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    """A message class's resolved field types, worked out once (resolving them took half of decoding an update)."""
    return typing.get_type_hints(cls)


def _from_fields(cls: type, raw: dict[str, Any]) -> Any:
    label = getattr(cls, "KIND", cls.__name__.lower())
    hints = type_hints(cls)
    fields = dataclasses.fields(cls)
    unknown = sorted(set(raw) - {f.name for f in fields})
    if unknown:
        raise WireError(f"{label} message has unknown fields {shown_names(unknown)}")
    values: dict[str, Any] = {}
    for f in fields:
        if f.name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise WireError(f"{label} message is missing field {f.name!r}")
            continue
        values[f.name] = _within(f"{label}.{f.name}", f, _check_value(f"{label}.{f.name}", hints[f.name], raw[f.name]))
    return cls(**values)


def _within(where: str, f: dataclasses.Field, value: Any) -> Any:
    """The value when the field declares no range or it lies inside it (both ends included), else a WireError."""
    within = bounds_of(f)
    if within is not None and not within[0] <= value <= within[1]:
        raise WireError(f"{where} must be within [{within[0]:g}, {within[1]:g}], got {shown(value, 32)}")
    return value


def _is_number(value: Any) -> bool:
    """True for a finite int or float that is not a bool: no number on the wire is NaN or infinite."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return INT_RANGE[0] <= value <= INT_RANGE[1] if isinstance(value, int) else math.isfinite(value)


def _plain(kind: type, what: str) -> Callable[[str, Any], Any]:
    """A checker for a plain value of one Python type."""

    def check(where: str, value: Any) -> Any:
        if not isinstance(value, kind) or (kind is int and not _is_int(value)):
            raise WireError(f"{where} must be {what}")
        return value

    return check


def _number(where: str, value: Any) -> float:
    if not _is_number(value):
        raise WireError(f"{where} must be a finite number, got {shown(value, 32)}")
    return float(value)


def _list_of(kind: type, what: str) -> Callable[[str, Any], list[Any]]:
    """A checker for a list whose every item is of one Python type (bool is not an integer)."""

    def check(where: str, value: Any) -> list[Any]:
        items = value if isinstance(value, list) else [None]
        if not all(isinstance(v, kind) and not (kind is int and not _is_int(v)) for v in items):
            raise WireError(f"{where} must be a list of {what}")
        return value

    return check


def _number_list(where: str, value: Any) -> list[float]:
    if not isinstance(value, list) or not all(_is_number(v) for v in value):
        raise WireError(f"{where} must be a list of finite numbers")
    return [float(v) for v in value]


def _number_map(where: str, value: Any) -> dict[str, float]:
    if not isinstance(value, dict) or not all(isinstance(k, str) and _is_number(v) for k, v in value.items()):
        raise WireError(f"{where} must be a map of names to finite numbers")
    return {k: float(v) for k, v in value.items()}


def _tensors(where: str, value: Any) -> Tensors:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise WireError(f"{where} must be a map of tensor names to tensors")
    if len(value) > MAX_TENSORS:
        raise WireError(f"{where} has {len(value)} tensors, more than {MAX_TENSORS}")
    return {name: decode_tensor(name, raw) for name, raw in value.items()}


def _bundle_files(where: str, value: Any) -> BundleFiles:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, bytes) for k, v in value.items()):
        raise WireError(f"{where} must be a map of file names to bytes")
    if len(value) > MAX_BUNDLE_FILES:
        raise WireError(f"{where} has {len(value)} files, more than {MAX_BUNDLE_FILES}")
    for name in value:
        check_identifier("bundle file name", name)
    return value


def _recipe(where: str, value: Any) -> Recipe:
    if not isinstance(value, dict):
        raise WireError(f"{where} must be a map")
    return _from_fields(Recipe, value)


def _model_spec(where: str, value: Any) -> ModelSpec:
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        raise WireError(f"{where} must be a map")
    try:
        return spec_from_dict(value, where)
    except SpecError as error:
        raise WireError(str(error)) from None


CHECKERS: dict[Any, Callable[[str, Any], Any]] = {
    bool: _plain(bool, "a boolean"),
    int: _plain(int, "an integer"),
    float: _number,
    str: _plain(str, "a string"),
    bytes: _plain(bytes, "bytes"),
    list[int]: _list_of(int, "integers"),
    list[float]: _number_list,
    list[str]: _list_of(str, "strings"),
    list[bytes]: _list_of(bytes, "byte strings"),
    dict[str, float]: _number_map,
    Tensors: _tensors,
    BundleFiles: _bundle_files,
    Recipe: _recipe,
    ModelSpec: _model_spec,
}


def _check_value(where: str, hint: Any, value: Any) -> Any:
    """The field's value after the check its type hint calls for (a TypeError for a hint with no rule)."""
    if hint not in CHECKERS:
        raise TypeError(f"no wire rule for {hint!r}")
    return CHECKERS[hint](where, value)


def _to_wire(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        fields = [f for f in dataclasses.fields(value) if not _omitted(value, f)]
        return {f.name: _to_wire(getattr(value, f.name)) for f in fields}
    if isinstance(value, np.ndarray):
        return encode_tensor(value)
    if isinstance(value, dict):
        return {key: _to_wire(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_wire(item) for item in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def _omitted(value: Any, f: dataclasses.Field) -> bool:
    """True for a field marked OMITTED_AT_DEFAULT that holds its default (decoding restores it)."""
    if not f.metadata.get("omitted_at_default"):
        return False
    default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
    current = getattr(value, f.name)
    return type(current) is type(default) and bool(current == default)


def _is_int(value: Any) -> bool:
    """True for an int (not a bool) that fits int64, as SQLite and numpy store it."""
    return isinstance(value, int) and not isinstance(value, bool) and INT_RANGE[0] <= value <= INT_RANGE[1]


def check_identifier(kind: str, value: str) -> str:
    """Fleet and device ids become topic levels and file names: letters, digits, '_', '.', '-' only."""
    if not isinstance(value, str) or not IDENTIFIER.fullmatch(value):
        raise WireError(f"{kind} {shown(value)} must be {IDENTIFIER_RULE}")
    return value


def given_identifier(kind: str, value: str) -> str:
    """A fleet or device id a person gave (a flag, a credential file): the same rule, its breach a UsageError."""
    try:
        return check_identifier(kind, value)
    except WireError as error:
        raise UsageError(str(error)) from None
