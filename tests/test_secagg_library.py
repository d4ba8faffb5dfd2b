# The pure pieces of secure aggregation: fixed point, Shamir, the masks, keys and seals, the neighbour graph, the wire.
from __future__ import annotations

import math

import numpy as np
import pytest

from protocol import wire
from protocol.errors import UsageError
from protocol.messages import (
    SECAGG_TYPES,
    DeliveryAck,
    KeyAdvert,
    MaskedInput,
    RejectionKind,
    UnmaskResponse,
    ViewConfirmation,
)
from protocol.secagg import graph, keys, masks, shamir
from protocol.secagg.errors import SecAggRefusal
from protocol.secagg.fixed_point import FixedPoint


def test_fixed_point_sums_wrap_and_decode_within_the_stated_bound() -> None:
    fixed = FixedPoint(clip=2.0, max_summands=1000)
    values = np.random.default_rng(0).uniform(-2, 2, (1000, 50))
    values[0, :5] = [2.0, -2.0, 1e9, -1e9, 0.0]  # the clip's edges and beyond
    total = np.zeros(50, np.uint32)
    for row in values:
        total += fixed.encode(row)
    expected = np.clip(values, -2, 2).sum(axis=0)
    assert np.abs(fixed.decode_sum(total) - expected).max() <= fixed.error_bound(1000)
    assert fixed.bits == math.floor(math.log2((2**31 - 1) / 1000 - 0.5) - 1)


@pytest.mark.parametrize(("clip", "summands"), [(0.0, 10), (math.inf, 10), (1.0, 0), (2.0**31, 2)])
def test_fixed_point_settings_that_do_not_fit_are_usage_errors(clip: float, summands: int) -> None:
    with pytest.raises(UsageError):
        FixedPoint(clip, summands)


def test_any_threshold_of_shares_rebuilds_the_secret_and_fewer_do_not() -> None:
    secret = bytes(range(32))
    shares = shamir.split(secret, 4, 7)
    assert shamir.combine(shares[3:]) == secret and shamir.combine(shares[::2]) == secret
    assert shamir.interpolate(shares[:3]) != int.from_bytes(secret, "big")
    assert [shamir.Share.from_bytes(s.to_bytes()) for s in shares] == shares


@pytest.mark.parametrize("record", [b"", bytes(shamir.SHARE_BYTES), b"\x00\x01" + b"\xff" * 66])
def test_a_share_record_off_the_field_is_a_forged_share(record: bytes) -> None:
    with pytest.raises(SecAggRefusal) as caught:
        shamir.Share.from_bytes(record)
    assert caught.value.kind == RejectionKind.FORGED_SHARE


def test_pairwise_keys_agree_and_masks_cancel() -> None:
    a, b = keys.KeyPair.generate(), keys.KeyPair.generate()
    context = keys.round_context("run", 3)
    shared = keys.agreed_key(a.secret, b.public, keys.MASK_PURPOSE, context)
    assert shared == keys.agreed_key(b.secret, a.public, keys.MASK_PURPOSE, context)
    assert shared != keys.agreed_key(a.secret, b.public, keys.SHARE_PURPOSE, context)
    assert shared != keys.agreed_key(a.secret, b.public, keys.MASK_PURPOSE, keys.round_context("run", 4))
    zero = np.zeros(1000, np.uint32)
    seed_a, seed_b = bytes(32), bytes([1]) * 32
    total = masks.masked(zero, seed_a, [(masks.pairwise_sign("a", "b"), shared)])
    total += masks.masked(zero, seed_b, [(masks.pairwise_sign("b", "a"), shared)])
    assert np.array_equal(total, masks.prg(seed_a, 1000) + masks.prg(seed_b, 1000))


def test_a_low_order_public_key_is_refused() -> None:
    with pytest.raises(SecAggRefusal):
        keys.agreed_key(keys.KeyPair.generate().secret, bytes(32), keys.MASK_PURPOSE, b"x")


def test_a_sealed_share_opens_only_for_its_sender_recipient_and_round() -> None:
    key = bytes(range(32))
    sealed = keys.encrypt(key, b"share", keys.share_context(b"r1", "a", "b"))
    assert keys.decrypt(key, sealed, keys.share_context(b"r1", "a", "b")) == b"share"
    for wrong in (keys.share_context(b"r1", "a", "c"), keys.share_context(b"r2", "a", "b")):
        with pytest.raises(SecAggRefusal):
            keys.decrypt(key, sealed, wrong)


@pytest.mark.parametrize("devices", [2, 3, 10, 101, 500])
def test_the_neighbour_graph_is_regular_symmetric_and_logarithmic(devices: int) -> None:
    ids = [f"d{i}" for i in range(devices)]
    degree = graph.degree_for(devices, 0.1)
    neighbours = graph.neighbours(ids, b"seed", degree)
    assert {len(peers) for peers in neighbours.values()} == {degree}
    assert all(
        device in neighbours[peer] and device not in peers for device, peers in neighbours.items() for peer in peers
    )
    assert degree <= max(devices - 1, 2 * math.ceil(1.5 * math.log(devices) / 0.5108) + 2)
    assert neighbours == graph.neighbours(list(reversed(ids)), b"seed", degree)


def test_a_dropout_of_one_half_is_a_usage_error() -> None:
    with pytest.raises(UsageError):
        graph.degree_for(10, 0.5)


def test_every_stage_message_round_trips_the_wire() -> None:
    samples = [
        KeyAdvert("d1", 3, bytes(32), bytes([1]) * 32),
        MaskedInput("d1", 3, {"w": np.arange(6, dtype=np.uint32).reshape(2, 3)}),
        UnmaskResponse("d1", 3, ["d2"], [b"x" * 68]),
        ViewConfirmation("d1", 3, ["d2"], [bytes(32)], ["d3"], [bytes([2]) * 32]),
        DeliveryAck("d1", 3, ["d2"], ["d3"], [bytes([3]) * 32]),
    ]
    for message in samples:
        decoded = wire.decode(wire.encode(message), type(message))
        assert wire.encode(decoded) == wire.encode(message)
    assert len(SECAGG_TYPES) == 13
    with pytest.raises(wire.WireError):
        wire.decode(wire.encode(samples[2]).replace(b"seed_shares", b"seed_sharez"), UnmaskResponse)
