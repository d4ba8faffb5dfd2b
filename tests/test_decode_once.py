# One decode per update: an in-process coordinator (a fake session, no broker) decodes each payload once through close.
from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from coordinators import NUM_CLASSES, FakeSession

from coordinator.asynchronous.intake import AsyncPolicy
from coordinator.asynchronous.rounds import AsyncCoordinator
from coordinator.intake import validation
from coordinator.intake.authentication import UpdateAuthenticator
from coordinator.intake.observer import RoundObserver
from coordinator.intake.update_intake import UpdateIntake
from coordinator.rounds.closing import RoundCloser
from coordinator.rounds.evaluation import Evaluator, LabelledSplit
from coordinator.rounds.loop import Coordinator, RoundParts
from coordinator.rounds.presence import Presence
from coordinator.rounds.publisher import Artefacts, RetainedPublisher
from coordinator.rounds.rules import RoundPolicy, RoundRules
from coordinator.storage.store import RunStore
from coordinator.strategies.registry import make_strategy
from edge_agent.learning.models import build_model, get_weights
from protocol import messages, wire
from protocol.model_spec import DEFAULT_SPEC
from protocol.tensors import Weights, weights_hash
from protocol.update_codec import UpdateCodec

FLEET = "once"
BASE = get_weights(build_model(seed=0))
KEYS = {f"dev-{index}": os.urandom(32) for index in range(3)}


def counted(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts every wire decode of an update and every codec decode of its tensors, wherever the coordinator calls
    them from."""
    calls: Counter[str] = Counter()

    def counting(name: str, function: Callable[..., Any], only: Callable[..., bool] = lambda *a: True) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name] += only(*args)
            return function(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(wire, "decode_update", counting("wire", wire.decode_update))
    monkeypatch.setattr(wire, "decode", counting("wire", wire.decode, lambda data, kind, *a: kind is messages.Update))
    monkeypatch.setattr(validation, "decode_update", counting("codec", validation.decode_update))
    return calls


def coordinator_in(
    run_dir: Path, session: FakeSession, strategy: str, authenticator: UpdateAuthenticator | None = None
) -> tuple[Coordinator, RoundParts, RoundRules]:
    """A coordinator over a fake session that scores every device model (so the close views each one twice)."""
    store, observer = RunStore(run_dir), RoundObserver()
    split = LabelledSplit.from_uint8(np.zeros((4, 28, 28), np.uint8), np.zeros(4, np.int64))
    parts = RoundParts(
        presence=Presence(observer),
        intake=UpdateIntake(FLEET, session, store, observer),
        publisher=RetainedPublisher(session, FLEET, "run", Artefacts()),
        closer=RoundCloser(store, make_strategy(strategy), Evaluator(DEFAULT_SPEC, split, split, 1, 0), True, 0),
        observer=observer,
    )
    rules = RoundRules(messages.Recipe(), RoundPolicy(1, quorum=3), authenticator=authenticator)
    return Coordinator(FLEET, session, rules, parts), parts, rules


def update_payload(device: str, base: Weights, seed: int, encoding: str = "float32", key: bytes = b"") -> bytes:
    """A device's encoded update of round 1 trained from `base` (signed with `key` if one is given)."""
    rng = np.random.default_rng(seed)
    weights = {name: (array + rng.normal(0, 0.01, array.shape)).astype(array.dtype) for name, array in base.items()}
    encoded = UpdateCodec(encoding).encode(weights, base)[0]
    update = messages.Update(
        *(device, 1, f"u-{device}", weights_hash(base), 10, [1] * NUM_CLASSES, 5, {}, encoded.tensors),
        *(os.urandom(16), b"", encoded.encoding, encoded.scales, encoded.indices),
    )
    payload = wire.encode(update)
    return wire.signed(payload, key) if key else payload


@pytest.mark.parametrize("encoding", ["float32", "int8-delta"])
def test_a_streamed_round_decodes_each_accepted_update_once_through_its_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, encoding: str
) -> None:
    session = FakeSession(FLEET)
    coordinator, _, _ = coordinator_in(tmp_path / "run", session, "avefl")
    for seed, device in enumerate(KEYS):
        session.send(device, update_payload(device, BASE, seed, encoding))
    calls = counted(monkeypatch)
    _, result = coordinator.run_round(1, BASE)
    assert sorted(result.device_accuracy) == sorted(KEYS) and len(result.divergence) == 3
    assert calls == {"wire": 3, "codec": 3}


def test_a_secured_round_checks_each_signature_without_another_decode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three signed updates and a forged one: four decodes in all, the forged one's ack quoting its decoded id."""
    session = FakeSession(FLEET)
    coordinator, _, _ = coordinator_in(tmp_path / "run", session, "avefl", UpdateAuthenticator(KEYS))
    session.send("dev-0", update_payload("dev-0", BASE, 9, key=b"guessed"))
    for seed, (device, key) in enumerate(KEYS.items()):
        session.send(device, update_payload(device, BASE, seed, key=key))
    calls = counted(monkeypatch)
    _, result = coordinator.run_round(1, BASE)
    assert result.rejected == {"dev-0": "bad signature: the HMAC does not match 'dev-0''s key"}
    assert calls == {"wire": 4, "codec": 3}
    acks = session.acks()
    assert [(ack.update_id, ack.rejection) for ack in acks if not ack.accepted] == [("u-dev-0", "bad_signature")]
    assert len([ack for ack in acks if ack.accepted]) == 3


def test_an_asynchronous_version_decodes_each_buffered_update_once_through_its_fold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = FakeSession(FLEET)
    _, parts, rules = coordinator_in(tmp_path / "run", session, "avefl")
    rules = dataclasses.replace(rules, policy=dataclasses.replace(rules.policy, quorum=None))
    coordinator = AsyncCoordinator(FLEET, session, rules, parts, AsyncPolicy(buffer=3, max_staleness=1))
    for seed, device in enumerate(KEYS):
        session.send(device, update_payload(device, BASE, seed, "int8-delta"))
    calls = counted(monkeypatch)
    collector = coordinator.resumed_collector(0, BASE)
    _, result = coordinator.run_version(collector, BASE)
    assert result.round_id == 1 and sorted(result.divergence) == sorted(KEYS)
    assert sorted(result.device_accuracy) == sorted(KEYS)
    assert calls == {"wire": 3, "codec": 3}
