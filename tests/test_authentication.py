# Signed updates: unknown devices, bad signatures and replays are rejected; a QoS 1 redelivery is applied once.
from __future__ import annotations

import dataclasses
import os

import msgpack
import numpy as np
import pytest

from coordinator.intake.authentication import UpdateAuthenticator
from coordinator.intake.update_intake import RoundCollector
from coordinator.intake.validation import Expectation, Rejection, decoded
from coordinator.storage.store import RunStore
from edge_agent.learning.models import build_model, get_weights, weight_spec
from protocol import messages, wire
from protocol.model_spec import DEFAULT_SPEC
from protocol.tensors import weights_hash

NUM_CLASSES = DEFAULT_SPEC.num_classes

MODEL = build_model(seed=0)
WEIGHTS = get_weights(MODEL)
BASE_HASH = weights_hash(WEIGHTS)
KEYS = {"dev-00": b"k" * 32, "dev-01": b"q" * 32}


def update_of(device: str = "dev-00", round_id: int = 1, **changes) -> messages.Update:
    update = messages.Update(
        device,
        round_id,
        os.urandom(8).hex(),
        BASE_HASH,
        40,
        [4] * NUM_CLASSES,
        20,
        {},
        {name: array + np.float32(0.01) for name, array in WEIGHTS.items()},
        nonce=os.urandom(16),
    )
    return dataclasses.replace(update, **changes)


def signed(update: messages.Update, key: bytes | None = None) -> bytes:
    """The update as its device sends it: encoded, in an envelope signed with the device's key (or `key`)."""
    return wire.signed(wire.encode(update), KEYS.get(update.device_id, b"x") if key is None else key)


def tampered(payload: bytes, **changes) -> bytes:
    """A signed payload whose update was changed after signing (the signature kept)."""
    envelope = msgpack.unpackb(payload)
    update = dataclasses.replace(wire.decode(envelope["data"], messages.Update), **changes)
    return msgpack.packb({**envelope, "data": wire.encode(update)})


def collector(authenticator: UpdateAuthenticator, round_id: int = 1) -> RoundCollector:
    return RoundCollector(
        Expectation(round_id, BASE_HASH, weight_spec(MODEL), NUM_CLASSES, 1 << 22, authenticator.check)
    )


def offer(round_collector: RoundCollector, payload: bytes, device: str = "dev-00") -> tuple[messages.Update, bool]:
    return round_collector.offer(decoded(device, payload, round_collector.expectation))


def rejection(round_collector: RoundCollector, payload: bytes, device: str = "dev-00") -> str:
    with pytest.raises(Rejection) as info:
        offer(round_collector, payload, device)
    return info.value.reason


def test_a_signed_update_is_accepted_and_its_redelivery_applied_once() -> None:
    round_one = collector(UpdateAuthenticator(KEYS))
    payload = signed(update_of())
    assert offer(round_one, payload)[1] is True
    assert offer(round_one, payload)[1] is False
    assert list(round_one.accepted) == ["dev-00"]


def test_unknown_devices_and_bad_signatures_are_rejected_with_their_reason() -> None:
    round_one = collector(UpdateAuthenticator(KEYS))
    unknown = signed(update_of("dev-99"))
    assert rejection(round_one, unknown, "dev-99") == "unknown device: 'dev-99' has no provisioned key"
    assert rejection(round_one, signed(update_of(), KEYS["dev-01"])).startswith(
        "bad signature: the HMAC does not match"
    )
    unsigned = wire.encode(update_of())
    assert rejection(round_one, unsigned).startswith("bad signature: the update is not signed")
    assert rejection(round_one, tampered(signed(update_of()), num_samples=4000)).startswith("bad signature")
    signature_inside = wire.encode(update_of(signature=b"\x01" * 32))  # a signature only a signed envelope carries
    assert rejection(round_one, signature_inside).startswith("bad signature: the HMAC does not match")
    assert round_one.accepted == {}


def test_a_replayed_update_from_an_earlier_round_is_rejected() -> None:
    authenticator = UpdateAuthenticator(KEYS)
    original = update_of(round_id=1)
    assert offer(collector(authenticator, 1), signed(original))[1] is True
    assert rejection(collector(authenticator, 2), signed(original)).startswith("replay: nonce")
    reused_nonce = update_of(round_id=2, nonce=original.nonce)
    assert rejection(collector(authenticator, 2), signed(reused_nonce)) == (
        f"replay: nonce {original.nonce.hex()[:16]} was already used in round 1"
    )
    assert offer(collector(authenticator, 2), signed(update_of(round_id=2)))[1] is True


def test_a_replay_after_a_coordinator_restart_is_still_refused(tmp_path) -> None:
    original = update_of(round_id=1)
    with RunStore(tmp_path / "run") as store:
        assert offer(collector(UpdateAuthenticator(KEYS, store), 1), signed(original))[1] is True
    with RunStore(tmp_path / "run") as restarted:
        after_restart = UpdateAuthenticator(KEYS, restarted)
        assert offer(collector(after_restart, 1), signed(original))[1] is True
        with pytest.raises(Rejection) as info:
            offer(collector(after_restart, 2), signed(original))
    assert info.value.kind == messages.RejectionKind.REPLAY
    assert info.value.reason == f"replay: nonce {original.nonce.hex()[:16]} was already used in round 1"
