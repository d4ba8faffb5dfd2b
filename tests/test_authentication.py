# Signed updates: unknown devices, bad signatures and replays are rejected; a QoS 1 redelivery is applied once.
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from coordinator.authentication import UpdateAuthenticator
from coordinator.intake import RoundCollector
from coordinator.store import RunStore
from coordinator.validation import Expectation, Rejection
from edge_agent.learning.models import build_model, get_weights, weight_spec
from protocol import messages, wire
from protocol.model_spec import DEFAULT_SPEC
from protocol.tensors import weights_hash

NUM_CLASSES = DEFAULT_SPEC.num_classes

MODEL = build_model(seed=0)
WEIGHTS = get_weights(MODEL)
BASE_HASH = weights_hash(WEIGHTS)
KEYS = {"dev-00": b"k" * 32, "dev-01": b"q" * 32}


def signed_update(device: str = "dev-00", round_id: int = 1, key: bytes | None = None, **changes) -> messages.Update:
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
    return wire.sign_update(dataclasses.replace(update, **changes), KEYS.get(device, b"x") if key is None else key)


def collector(authenticator: UpdateAuthenticator, round_id: int = 1) -> RoundCollector:
    return RoundCollector(
        Expectation(round_id, BASE_HASH, weight_spec(MODEL), NUM_CLASSES, 1 << 22, authenticator.check)
    )


def rejection(round_collector: RoundCollector, update: messages.Update) -> str:
    with pytest.raises(Rejection) as info:
        round_collector.offer(update.device_id, wire.encode(update))
    return info.value.reason


def test_a_signed_update_is_accepted_and_its_redelivery_applied_once() -> None:
    round_one = collector(UpdateAuthenticator(KEYS))
    payload = wire.encode(signed_update())
    assert round_one.offer("dev-00", payload)[1] is True
    assert round_one.offer("dev-00", payload)[1] is False
    assert list(round_one.accepted) == ["dev-00"]


def test_unknown_devices_and_bad_signatures_are_rejected_with_their_reason() -> None:
    round_one = collector(UpdateAuthenticator(KEYS))
    assert rejection(round_one, signed_update("dev-99")) == "unknown device: 'dev-99' has no provisioned key"
    assert rejection(round_one, signed_update(key=KEYS["dev-01"])).startswith("bad signature: the HMAC does not match")
    unsigned = dataclasses.replace(signed_update(), signature=b"")
    assert rejection(round_one, unsigned).startswith("bad signature: the update is not signed")
    tampered = dataclasses.replace(signed_update(), num_samples=4000)
    assert rejection(round_one, tampered).startswith("bad signature")
    assert round_one.accepted == {}


def test_a_replayed_update_from_an_earlier_round_is_rejected() -> None:
    authenticator = UpdateAuthenticator(KEYS)
    original = signed_update(round_id=1)
    assert collector(authenticator, 1).offer("dev-00", wire.encode(original))[1] is True
    assert rejection(collector(authenticator, 2), original).startswith("replay: nonce")
    reused_nonce = signed_update(round_id=2, nonce=original.nonce)
    assert rejection(collector(authenticator, 2), reused_nonce) == (
        f"replay: nonce {original.nonce.hex()[:16]} was already used in round 1"
    )
    assert collector(authenticator, 2).offer("dev-00", wire.encode(signed_update(round_id=2)))[1] is True


def test_a_replay_after_a_coordinator_restart_is_still_refused(tmp_path) -> None:
    original = signed_update(round_id=1)
    with RunStore(tmp_path / "run") as store:
        assert collector(UpdateAuthenticator(KEYS, store), 1).offer("dev-00", wire.encode(original))[1] is True
    with RunStore(tmp_path / "run") as restarted:
        after_restart = UpdateAuthenticator(KEYS, restarted)
        assert collector(after_restart, 1).offer("dev-00", wire.encode(original))[1] is True
        with pytest.raises(Rejection) as info:
            collector(after_restart, 2).offer("dev-00", wire.encode(original))
    assert info.value.kind == messages.RejectionKind.REPLAY
    assert info.value.reason == f"replay: nonce {original.nonce.hex()[:16]} was already used in round 1"
