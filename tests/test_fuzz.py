# Property tests (issue #5): arbitrary bytes and mutated valid updates never raise anything but WireError from the
# decoder, never anything but a Rejection from the validator, and never anything out of the coordinator's handler.
from __future__ import annotations

import contextlib
import os

import msgpack
import numpy as np
import pytest
from coordinators import local_coordinator
from fleet import server_data
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.fleet.broker import EmbeddedBroker
from coordinator.intake.round_aggregator import BatchAggregator, SuspectPolicy
from coordinator.intake.update_intake import RoundCollector
from coordinator.intake.validation import Expectation, Rejection, validate_update
from coordinator.rounds.evaluation import Evaluator, LabelledSplit
from coordinator.rounds.loop import Coordinator, OpenRound
from coordinator.rounds.rules import RoundPolicy
from coordinator.storage.store import RunStore
from coordinator.strategies.means import AveFL
from edge_agent.learning.models import build_model, get_weights, weight_spec
from protocol import messages, wire
from protocol.model_spec import DEFAULT_SPEC
from protocol.mqtt import IncomingMessage, MqttSession
from protocol.tensors import weights_hash

FLEET = "fuzz"
DEVICE = "dev-1"
BASE = get_weights(build_model(seed=0))
EXPECTATION = Expectation(3, weights_hash(BASE), weight_spec(build_model()), 10, wire.DEFAULT_MAX_MESSAGE_BYTES)
VALID = wire.encode(
    messages.Update(
        device_id=DEVICE,
        round_id=3,
        update_id="u-1",
        base_hash=EXPECTATION.base_hash,
        num_samples=60,
        class_counts=[6] * 10,
        acquired_labels=10,
        metrics={"train_loss": 0.5},
        tensors=BASE,
        nonce=os.urandom(16),
    )
)
EXAMPLES = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Any value msgpack can carry: what a broken or hostile encoder might put in a field.
PACKABLE = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=10,
)


@st.composite
def mutated_updates(draw) -> bytes:
    """A valid update altered at the msgpack level: fields dropped, replaced or added (any type), a tensor's
    dtype/shape/data/whole replaced, then a few bytes of the encoding flipped."""
    envelope = msgpack.unpackb(VALID, raw=False)
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        action = draw(st.sampled_from(["drop", "replace", "add", "tensor"]))
        if action == "drop":
            envelope.pop(draw(st.sampled_from(sorted(envelope))), None)
        elif action in ("replace", "add"):
            key = draw(st.sampled_from(sorted(envelope))) if action == "replace" else draw(st.text(max_size=12))
            envelope[key] = draw(PACKABLE)
        elif isinstance(envelope.get("tensors"), dict) and envelope["tensors"]:
            name = draw(st.sampled_from(sorted(envelope["tensors"])))
            part = draw(st.sampled_from(["dtype", "shape", "data", "whole"]))
            if part == "whole" or not isinstance(envelope["tensors"][name], dict):
                envelope["tensors"][name] = draw(PACKABLE)
            else:
                envelope["tensors"][name][part] = draw(PACKABLE | st.sampled_from(["<f8", "<i4", "|b1", "<f2"]))
    payload = bytearray(msgpack.packb(envelope, use_bin_type=True))
    for position in draw(st.lists(st.integers(min_value=0, max_value=len(payload) - 1), max_size=3)):
        payload[position] ^= draw(st.integers(min_value=1, max_value=255))
    return bytes(payload)


PAYLOADS = st.binary(max_size=2048) | mutated_updates()


def test_the_unmutated_update_is_valid() -> None:
    """The base of every mutation passes, so rejections below come from the mutations."""
    assert validate_update(DEVICE, VALID, EXPECTATION).update_id == "u-1"


@EXAMPLES
@given(data=st.binary(max_size=4096), kind=st.sampled_from(sorted(messages.MESSAGE_TYPES)))
def test_decoding_arbitrary_bytes_raises_only_wire_errors(data: bytes, kind: str) -> None:
    with contextlib.suppress(wire.WireError):
        wire.decode(data, messages.MESSAGE_TYPES[kind])


@EXAMPLES
@given(payload=mutated_updates())
def test_decoding_a_mutated_update_raises_only_wire_errors(payload: bytes) -> None:
    with contextlib.suppress(wire.WireError):
        wire.decode(payload, messages.Update)


@EXAMPLES
@given(payload=PAYLOADS)
def test_validating_anything_returns_an_update_or_raises_a_rejection(payload: bytes) -> None:
    try:
        update = validate_update(DEVICE, payload, EXPECTATION)
    except Rejection as rejection:
        assert rejection.reason
        return
    assert set(update.tensors) == set(BASE)
    assert all(np.isfinite(array).all() for array in update.tensors.values())


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory):
    """A real coordinator (store, MQTT session to a real broker) with round 3 open, for its message handler."""
    work = tmp_path_factory.mktemp("fuzz")
    data = server_data().dataset
    split = LabelledSplit.from_uint8(data.test_images[:4], data.test_labels[:4])
    with EmbeddedBroker(work / "broker") as broker, RunStore(work / "run") as store:
        session = MqttSession(broker.address, client_id="fuzz-coordinator", manual_ack=True)
        session.connect(timeout=30)
        try:
            yield local_coordinator(
                FLEET, session, store, AveFL(), Evaluator(DEFAULT_SPEC, split, split, 1, 0), RoundPolicy(rounds=3)
            )
        finally:
            session.close()


TOPICS = st.one_of(
    st.text(max_size=40),
    st.builds(
        lambda device, leaf: f"fl/{FLEET}/devices/{device}/{leaf}",
        st.text(max_size=12) | st.just(DEVICE),
        st.sampled_from(["update", "status", "ack", "x"]),
    ),
)


@EXAMPLES
@given(topic=TOPICS, payload=PAYLOADS, open_round=st.booleans())
def test_the_coordinator_handler_never_raises(
    coordinator: Coordinator, topic: str, payload: bytes, open_round: bool
) -> None:
    collector = RoundCollector(EXPECTATION)
    opened = OpenRound(collector, BatchAggregator(AveFL(), BASE, SuspectPolicy()), []) if open_round else None
    coordinator.dispatch(IncomingMessage(topic, payload, False), opened)
    if opened is not None:
        for device, update in collector.accepted.items():
            assert validate_update(device, payload, EXPECTATION).update_id == update.update_id
