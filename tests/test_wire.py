# Tests for protocol.wire: message and tensor round trips, every decode failure, HMAC, topics, identifiers.
from __future__ import annotations

import dataclasses
import re
import zlib

import msgpack
import numpy as np
import pytest

from protocol import label_messages, messages, wire
from protocol.model_spec import DEFAULT_SPEC

KEY = b"fleet-secret-key"


def tensors() -> dict[str, np.ndarray]:
    """Two small tensors with distinct, non-trivial values."""
    return {
        "conv.weight": np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 7,
        "fc.bias": np.array([-1.5, 0.0, 2.25], dtype=np.float32),
    }


def make_update(**changes) -> messages.Update:
    """A plausible update; keyword arguments replace fields."""
    update = messages.Update(
        device_id="dev-1",
        round_id=3,
        update_id="u-3-a",
        base_hash="ab" * 32,
        num_samples=400,
        class_counts=[40] * 10,
        acquired_labels=350,
        metrics={"loss": 0.25, "seconds": 3.0},
        tensors=tensors(),
        nonce=b"\x00\x01nonce",
    )
    return dataclasses.replace(update, **changes)


def envelope(kind: str = "ack", **fields) -> dict:
    """A raw v1 envelope for an Ack, with fields overridden or removed (value None removes)."""
    raw = {
        "v": wire.WIRE_VERSION,
        "kind": kind,
        "device_id": "dev-1",
        "round_id": 2,
        "update_id": "u",
        "accepted": True,
        "reason": "",
    }
    raw.update(fields)
    return {k: v for k, v in raw.items() if v is not None}


def pack(raw) -> bytes:
    return msgpack.packb(raw, use_bin_type=True)


def assert_tensors_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype.newbyteorder("="), name
        assert got[name].shape == want[name].shape, name
        np.testing.assert_array_equal(got[name], want[name])


# --- message round trips ---------------------------------------------------------------------------------------


def test_round_announcement_round_trip_with_recipe_options():
    recipe = messages.Recipe(
        sampler="bald",
        labels_per_acquisition=123,
        epochs=2,
        learning_rate=0.01,
        seed=7,
        options={"temperature": 0.5, "mix": 2.0},
    )
    message = messages.RoundAnnouncement("run-1", 4, "cd" * 32, recipe, deadline=1700000000.5, final=True)
    decoded = wire.decode(wire.encode(message), messages.RoundAnnouncement)
    assert decoded == message
    assert isinstance(decoded.recipe, messages.Recipe)
    assert decoded.recipe.options == {"temperature": 0.5, "mix": 2.0}


def test_model_message_round_trip():
    message = messages.ModelMessage("ef" * 32, DEFAULT_SPEC, tensors())
    decoded = wire.decode(wire.encode(message), messages.ModelMessage)
    assert (decoded.model_hash, decoded.spec) == (message.model_hash, message.spec)
    assert_tensors_equal(decoded.tensors, message.tensors)


def test_bundle_message_round_trip():
    message = messages.BundleMessage("ab" * 32, {"manifest.json": b"{}", "tail.onnx": bytes(range(256))})
    assert wire.decode(wire.encode(message), messages.BundleMessage) == message


@pytest.mark.parametrize(
    "files, fragment",
    [
        ({"../evil.onnx": b"x"}, "bundle file name '../evil.onnx'"),
        ({"sub/tail.onnx": b"x"}, "bundle file name 'sub/tail.onnx'"),
        ({"..": b"x"}, "'..' must be 1 to 64"),
        ({"tail.onnx": "text"}, "map of file names to bytes"),
        ({f"f{i}": b"" for i in range(17)}, "17 files, more than 16"),
    ],
)
def test_bundle_message_refuses_paths_and_wrong_types(files, fragment):
    payload = pack({"v": wire.WIRE_VERSION, "kind": "bundle", "model_hash": "ab" * 32, "files": files})
    with pytest.raises(wire.WireError, match=re.escape(fragment)):
        wire.decode(payload, messages.BundleMessage)


def test_update_round_trip():
    message = make_update(signature=b"\xffsig")
    decoded = wire.decode(wire.encode(message), messages.Update)
    for f in dataclasses.fields(messages.Update):
        if f.name != "tensors":
            assert getattr(decoded, f.name) == getattr(message, f.name), f.name
    assert isinstance(decoded.nonce, bytes) and isinstance(decoded.signature, bytes)
    assert_tensors_equal(decoded.tensors, message.tensors)


@pytest.mark.parametrize(
    "message",
    [
        messages.Ack("dev-1", 5, "u-5", True),
        messages.Ack("dev-2", 6, "u-6", False, "stale round: nope"),
        messages.Status("dev-1", "training", 1700000001.25, round_id=5, labelled=800, profile="pi-zero"),
        messages.Status("dev-3", "offline", 0.0),
    ],
)
def test_small_messages_round_trip(message):
    assert wire.decode(wire.encode(message), type(message)) == message


# --- tensors -----------------------------------------------------------------------------------------------------

ALL_DTYPES = [
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
]


def extreme_values(dtype: np.dtype) -> np.ndarray:
    """Values that exercise every byte of the type: extremes, sign, fractions."""
    if dtype.kind == "b":
        return np.array([True, False, True, True, False], dtype=dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return np.array([info.min, info.max, 0, 1, info.max // 3], dtype=dtype)
    info = np.finfo(dtype)
    return np.array([info.min, info.max, -0.0, info.tiny, 1 / 3, -2.5], dtype=dtype)


@pytest.mark.parametrize("name", ALL_DTYPES)
@pytest.mark.parametrize("order", ["<", ">"])
def test_tensor_round_trip_every_dtype_and_byte_order(name, order):
    dtype = np.dtype(name).newbyteorder(order)
    array = extreme_values(dtype)
    assert array.dtype == dtype
    raw = wire.encode_tensor(array)
    assert raw["dtype"] in wire.ALLOWED_DTYPES
    assert raw["dtype"][0] in "<|"  # always little-endian (or byte-order free) on the wire
    decoded = wire.decode_tensor("t", raw)
    assert decoded.dtype == np.dtype(name)
    np.testing.assert_array_equal(decoded, array)
    assert decoded.tobytes() == array.astype(np.dtype(name)).tobytes()  # bit-exact, -0.0 included
    # and through a whole message, too
    message = wire.decode(wire.encode(messages.ModelMessage("h", DEFAULT_SPEC, {"t": array})), messages.ModelMessage)
    np.testing.assert_array_equal(message.tensors["t"], array)


def test_big_endian_bytes_are_swapped_on_the_wire():
    array = np.array([1.0, -2.0], dtype=">f4")
    raw = wire.encode_tensor(array)
    assert raw["dtype"] == "<f4"
    assert raw["data"] == np.array([1.0, -2.0], dtype="<f4").tobytes() != array.tobytes()


@pytest.mark.parametrize("shape", [(0,), (3, 0, 2), (), (1, 1, 1, 7), (5, 3, 1)])
def test_tensor_round_trip_odd_shapes(shape):
    array = (np.arange(int(np.prod(shape)), dtype=np.int32) - 3).reshape(shape)
    decoded = wire.decode_tensor("t", wire.encode_tensor(array))
    assert decoded.shape == shape
    assert decoded.dtype == np.int32
    np.testing.assert_array_equal(decoded, array)


def test_non_contiguous_tensor_round_trip():
    array = np.arange(30, dtype=np.float64).reshape(5, 6)[::2, 1::2].T
    decoded = wire.decode_tensor("t", wire.encode_tensor(array))
    np.testing.assert_array_equal(decoded, array)


@pytest.mark.parametrize("dtype", ["complex64", "object", "<U3"])
def test_encode_tensor_rejects_unsupported_dtype(dtype):
    array = np.array([1, 2], dtype=dtype)
    with pytest.raises(wire.WireError, match="cannot go on the wire"):
        wire.encode_tensor(array)


# --- decode errors -----------------------------------------------------------------------------------------------


def model_with_tensor(raw_tensor) -> bytes:
    """A ModelMessage envelope carrying one hand-made tensor map."""
    return pack({"v": wire.WIRE_VERSION, "kind": "model", "model_hash": "h", "spec": {}, "tensors": {"w": raw_tensor}})


def good_tensor(**fields) -> dict:
    raw = {"dtype": "<f4", "shape": [2, 3], "data": bytes(24)}
    raw.update(fields)
    return raw


def test_good_hand_made_envelopes_decode():
    # the baselines the error cases below are mutations of
    assert wire.decode(pack(envelope()), messages.Ack) == messages.Ack("dev-1", 2, "u", True, "")
    assert wire.decode(model_with_tensor(good_tensor()), messages.ModelMessage).tensors["w"].shape == (2, 3)


@pytest.mark.parametrize(
    "payload, expected, fragment",
    [
        (wire.encode(messages.Ack("dev-1", 1, "u", True))[:-3], messages.Ack, "undecodable msgpack"),
        (b"\xc1", messages.Ack, "undecodable msgpack"),
        (b"", messages.Ack, "undecodable msgpack"),
        (wire.encode(messages.Ack("d", 1, "u", True)) + b"\x00", messages.Ack, "undecodable msgpack"),
        (pack(envelope(v=1)), messages.Ack, "wire version 1 is not supported (this side speaks 2)"),
        (pack(envelope(v=None)), messages.Ack, "wire version None is not supported"),
        (pack(envelope(v=2.0)), messages.Ack, "wire version 2.0 is not supported (this side speaks 2)"),
        (pack(envelope(v=True)), messages.Ack, "wire version True is not supported"),
        (pack(envelope(kind="status")), messages.Ack, "expected a 'ack' message, got kind 'status'"),
        (
            wire.encode(messages.Status("d", "idle", 1.0)),
            messages.Update,
            "expected a 'update' message, got kind 'status'",
        ),
        (pack([1, "ack"]), messages.Ack, "message must be a map, got list"),
        (pack(5), messages.Ack, "message must be a map, got int"),
        (pack(envelope(update_id=None)), messages.Ack, "missing field 'update_id'"),
        (pack(envelope(extra=1)), messages.Ack, "unknown fields ['extra']"),
        (pack(envelope(round_id="2")), messages.Ack, "ack.round_id must be an integer"),
        (pack(envelope(round_id=True)), messages.Ack, "ack.round_id must be an integer"),
        (pack(envelope(round_id=2.0)), messages.Ack, "ack.round_id must be an integer"),
        (pack(envelope(accepted=1)), messages.Ack, "ack.accepted must be a boolean"),
        (pack(envelope(reason=b"bytes")), messages.Ack, "ack.reason must be a string"),
        (pack({**envelope(), 1: "x"}), messages.Ack, "undecodable msgpack"),  # non-string map key
        (
            model_with_tensor(good_tensor(data=bytes(23))),
            messages.ModelMessage,
            "has 23 bytes, shape [2, 3] of float32 needs 24",
        ),
        (model_with_tensor(good_tensor(data=bytes(28))), messages.ModelMessage, "has 28 bytes"),
        (model_with_tensor(good_tensor(dtype="<c8", data=bytes(48))), messages.ModelMessage, "unsupported dtype '<c8'"),
        (model_with_tensor(good_tensor(dtype="O")), messages.ModelMessage, "unsupported dtype 'O'"),
        (model_with_tensor(good_tensor(dtype=">f4")), messages.ModelMessage, "unsupported dtype '>f4'"),
        (model_with_tensor(good_tensor(shape=[-2, -3])), messages.ModelMessage, "invalid shape [-2, -3]"),
        (model_with_tensor(good_tensor(shape=[2, True])), messages.ModelMessage, "invalid shape"),
        (model_with_tensor(good_tensor(shape=[1] * 9, data=bytes(4))), messages.ModelMessage, "invalid shape"),
        (model_with_tensor(good_tensor(data="text")), messages.ModelMessage, "data must be bytes"),
        (model_with_tensor({"dtype": "<f4", "shape": [0]}), messages.ModelMessage, "exactly dtype, shape and data"),
        (model_with_tensor([1, 2]), messages.ModelMessage, "exactly dtype, shape and data"),
    ],
)
def test_decode_errors_say_what_is_wrong(payload, expected, fragment):
    with pytest.raises(wire.WireError) as info:
        wire.decode(payload, expected)
    assert fragment in str(info.value)


def test_decode_rejects_payload_over_max_bytes_before_parsing():
    payload = wire.encode(messages.Ack("dev-1", 1, "u", True))
    assert wire.decode(payload, messages.Ack, max_bytes=len(payload)).round_id == 1  # exactly at the limit is fine
    with pytest.raises(
        wire.WireError, match=f"message of {len(payload)} bytes exceeds the limit of {len(payload) - 1}"
    ):
        wire.decode(payload, messages.Ack, max_bytes=len(payload) - 1)


def test_decode_rejects_non_bytes():
    with pytest.raises(wire.WireError, match="payload must be bytes"):
        wire.decode("not bytes", messages.Ack)  # type: ignore[arg-type]


def test_decode_error_in_nested_recipe_names_the_field():
    raw = msgpack.unpackb(wire.encode(messages.RoundAnnouncement("r", 1, "h", messages.Recipe(), 1.0)))
    raw["recipe"]["epochs"] = "five"
    with pytest.raises(wire.WireError, match="epochs must be an integer"):
        wire.decode(pack(raw), messages.RoundAnnouncement)
    raw["recipe"]["epochs"] = 5
    raw["recipe"]["options"] = {"a": "b"}
    with pytest.raises(wire.WireError, match="options must be a map of names to finite numbers"):
        wire.decode(pack(raw), messages.RoundAnnouncement)


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("momentum", 5.0, "recipe.momentum must be within [0, 1]"),
        ("learning_rate", -1.0, "recipe.learning_rate must be within [0, inf]"),
        ("learning_rate", float("nan"), "recipe.learning_rate must be a finite number"),
    ],
)
def test_a_recipe_out_of_its_flags_range_is_refused_on_the_wire(field, value, fragment):
    """A device takes no recipe the coordinator's own flags would refuse (a retained announcement anyone could put
    on an open broker), and no error text grows with the value."""
    raw = msgpack.unpackb(wire.encode(messages.RoundAnnouncement("r", 1, "h", messages.Recipe(), 1.0)))
    raw["recipe"][field] = value
    with pytest.raises(wire.WireError, match=re.escape(fragment)):
        wire.decode(pack(raw), messages.RoundAnnouncement)


@pytest.mark.parametrize(
    ("kind", "fields", "fragment"),
    [
        (
            label_messages.LabelQuery,
            {"asked_at": float("nan")},
            "label_query.asked_at must be a finite number, got nan",
        ),
        (label_messages.LabelQuery, {"score": 1e300}, "label_query.score must be within [-1e+09, 1e+09]"),
        (label_messages.LabelQuery, {"guess": 2**64 - 1}, "label_query.guess must be an integer"),
        (label_messages.LabelAnswer, {"answered_at": float("inf")}, "label_answer.answered_at must be a finite"),
        (messages.Status, {"timestamp": -1.0}, "status.timestamp must be within [0, 8.58993e+09]"),
    ],
)
def test_every_number_is_checked_finite_and_in_its_range_once_at_decoding(kind, fields, fragment):
    valid = {
        label_messages.LabelQuery: label_messages.LabelQuery("d", "q", b"x", "image/png", 1.7e9),
        label_messages.LabelAnswer: label_messages.LabelAnswer("q", 1, "ana", 1.7e9),
        messages.Status: messages.Status("d", "online", 1.7e9),
    }[kind]
    raw = msgpack.unpackb(wire.encode(valid))
    raw.update(fields)
    with pytest.raises(wire.WireError, match=re.escape(fragment)):
        wire.decode(pack(raw), kind)


def test_decode_error_in_update_lists():
    raw = msgpack.unpackb(wire.encode(make_update()))
    raw["class_counts"] = [1, 2.5]
    with pytest.raises(wire.WireError, match="update.class_counts must be a list of integers"):
        wire.decode(pack(raw), messages.Update)


def test_wire_error_is_a_value_error():
    assert issubclass(wire.WireError, ValueError)


# --- HMAC --------------------------------------------------------------------------------------------------------


def test_signed_update_verifies_over_the_bytes_it_carries_and_survives_the_wire():
    payload = wire.encode(make_update())
    update, signed_bytes = wire.decode_update(wire.signed(payload, KEY))
    assert signed_bytes == payload and len(update.signature) == 32
    assert wire.signature_valid(signed_bytes, update.signature, KEY)
    assert wire.encode(dataclasses.replace(update, signature=b"")) == payload
    assert wire.decode(wire.signed(payload, KEY), messages.Update).signature == update.signature
    unsigned, nothing_signed = wire.decode_update(payload)  # an unsigned update's bytes are what they always were
    assert nothing_signed == b"" and unsigned.signature == b"" and wire.encode(unsigned) == payload


def test_a_signed_envelope_holds_a_deflated_update_and_nothing_else():
    payload = wire.deflated(wire.encode(make_update()))
    update, signed_bytes = wire.decode_update(wire.signed(payload, KEY))
    assert signed_bytes == payload and wire.signature_valid(payload, update.signature, KEY)
    signed_ack = wire.signed(wire.encode(messages.Ack("dev-1", 3, "u", True)), KEY)
    cases = [
        (signed_ack, messages.Update, "expected a 'update' message, got kind 'ack'"),
        (wire.signed(wire.encode(make_update()), KEY), messages.Ack, "expected a 'ack' message, got kind 'signed'"),
        (wire.signed(wire.signed(payload, KEY), KEY), messages.Update, "got kind 'signed'"),
        (wire.deflated(wire.signed(payload, KEY)), messages.Update, "got kind 'signed'"),
        (pack({"v": wire.WIRE_VERSION, "kind": "signed", "data": payload}), messages.Update, "exactly bytes data"),
        (pack({"v": 2, "kind": "signed", "data": "x", "signature": b"s"}), messages.Update, "exactly bytes data"),
    ]
    for data, expected, fragment in cases:
        with pytest.raises(wire.WireError, match=re.escape(fragment)):
            wire.decode(data, expected)


def changed_tensor() -> dict[str, np.ndarray]:
    changed = {name: array.copy() for name, array in tensors().items()}
    changed["fc.bias"][1] = np.nextafter(np.float32(0.0), np.float32(1.0))  # the smallest possible change
    return changed


@pytest.mark.parametrize(
    "change",
    [
        {"round_id": 4},
        {"device_id": "dev-2"},
        {"nonce": b"\x00\x01nonce!"},
        {"update_id": "u-3-b"},
        {"num_samples": 401},
        {"tensors": "changed"},
    ],
)
def test_any_change_invalidates_the_signature(change):
    update, _ = wire.decode_update(wire.signed(wire.encode(make_update()), KEY))
    if change.get("tensors") == "changed":
        change = {"tensors": changed_tensor()}
    tampered = wire.encode(dataclasses.replace(make_update(), **change))
    assert not wire.signature_valid(tampered, update.signature, KEY)


def test_wrong_key_and_missing_signature_are_invalid():
    payload = wire.encode(make_update())
    update, signed_bytes = wire.decode_update(wire.signed(payload, KEY))
    assert not wire.signature_valid(signed_bytes, update.signature, b"another-key")
    assert not wire.signature_valid(payload, b"", KEY)


def test_decoded_tensors_are_read_only_views_of_the_message():
    decoded = wire.decode(wire.encode(make_update()), messages.Update)
    for array in decoded.tensors.values():
        assert not array.flags.writeable and not array.flags.owndata
    assert_tensors_equal(decoded.tensors, tensors())


# --- identifiers (topic levels: tests/test_topics.py) -----------------------------------------------------------------


def test_identifier_of_64_characters_is_accepted():
    assert wire.check_identifier("device id", "a" * 64) == "a" * 64


BAD_IDENTIFIERS = ["a/b", "dev+", "dev#", "#", "+", "", "a" * 65, "dev 1", "dév", "dev\n", "a" * 64 + "\n", None]


@pytest.mark.parametrize("bad", BAD_IDENTIFIERS)
def test_bad_identifiers_are_rejected(bad):
    with pytest.raises(wire.WireError, match="must be 1 to 64"):
        wire.check_identifier("device id", bad)


def test_a_deflated_message_decodes_as_itself_and_every_bad_envelope_is_refused() -> None:
    update = messages.Update("dev-1", 3, "u", "ab" * 32, 10, [1] * 10, 5, {}, tensors())
    payload = wire.encode(update)
    packed = wire.deflated(payload)
    assert wire.decode(packed, messages.Update).tensors.keys() == update.tensors.keys()
    assert wire.encode(wire.decode(packed, messages.Update)) == payload

    def envelope(**fields) -> bytes:
        raw = {"v": wire.WIRE_VERSION, "kind": wire.DEFLATE, "size": len(payload), "data": zlib.compress(payload)}
        return pack({**raw, **fields})

    bomb = zlib.compress(bytes(50 * 1024 * 1024))
    cases = [
        (envelope(size=10), "does not inflate to its declared 10 bytes"),
        (envelope(size=len(payload) + 1), "does not inflate to its declared"),
        (envelope(size=1 << 40), "claims 1099511627776 bytes, the limit is"),
        (envelope(size=100, data=bomb), "does not inflate to its declared 100 bytes"),
        (envelope(data=b"not zlib"), "undecodable deflate data"),
        (envelope(data=zlib.compress(payload)[:-5]), "does not inflate"),
        (envelope(extra=1), "must hold exactly an integer size and bytes data"),
        (wire.deflated(packed), "expected a 'update' message, got kind 'deflate'"),
    ]
    for data, fragment in cases:
        with pytest.raises(wire.WireError) as caught:
            wire.decode(data, messages.Update)
        assert fragment in str(caught.value) and len(str(caught.value)) < 300
