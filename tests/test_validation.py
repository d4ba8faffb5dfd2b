# Tests for coordinator.intake.validation and RoundCollector: one test per rejection reason, on the paper CNN's real spec.
from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest

from coordinator.intake.update_intake import RoundCollector
from coordinator.intake.validation import Expectation, Rejection, decoded, validate_update
from edge_agent.learning.models import build_model, get_weights, weight_spec
from protocol import messages, wire
from protocol.messages import RejectionKind
from protocol.model_spec import DEFAULT_SPEC
from protocol.tensors import weights_hash

NUM_CLASSES = DEFAULT_SPEC.num_classes

MODEL = build_model(seed=0)
WEIGHTS = get_weights(MODEL)
BASE_HASH = weights_hash(WEIGHTS)
ROUND = 7
DEVICE = "dev-1"
MAX_BYTES = 4 * 1024 * 1024
# a tensor name present in the CNN; the tests below would be vacuous if it were not
WEIGHT_NAME = "conv2.weight"


def expectation(**changes) -> Expectation:
    base = Expectation(ROUND, BASE_HASH, weight_spec(MODEL), NUM_CLASSES, MAX_BYTES)
    return dataclasses.replace(base, **changes)


def trained_weights() -> dict[str, np.ndarray]:
    """The base weights moved a little, as a device would return them."""
    rng = np.random.default_rng(1)
    return {name: (array + rng.normal(0, 0.01, array.shape)).astype(array.dtype) for name, array in WEIGHTS.items()}


def make_update(**changes) -> messages.Update:
    update = messages.Update(
        device_id=DEVICE,
        round_id=ROUND,
        update_id="u-7-1",
        base_hash=BASE_HASH,
        num_samples=400,
        class_counts=[40] * NUM_CLASSES,
        acquired_labels=350,
        metrics={"loss": 0.3},
        tensors=trained_weights(),
    )
    return dataclasses.replace(update, **changes)


def with_tensor(name: str, array: np.ndarray | None) -> dict[str, np.ndarray]:
    """The trained weights with one tensor replaced (or removed when array is None)."""
    weights = trained_weights()
    if array is None:
        del weights[name]
    else:
        weights[name] = array
    return weights


def reason_for(payload: bytes, device_id: str = DEVICE, exp: Expectation | None = None) -> str:
    with pytest.raises(Rejection) as info:
        validate_update(device_id, payload, exp or expectation())
    assert str(info.value) == info.value.reason
    return info.value.reason


def offer(collector: RoundCollector, device_id: str, payload: bytes) -> tuple[messages.Update, bool]:
    """The collector's verdict on a payload, decoded once as the intake decodes it."""
    return collector.offer(decoded(device_id, payload, collector.expectation))


def test_spec_is_the_paper_cnn():
    spec = weight_spec(MODEL)
    assert spec[WEIGHT_NAME] == ((16, 64, 5, 5), "float32")
    assert all(dtype == "float32" for _, dtype in spec.values())
    assert len(spec) == 12  # six layers, weight and bias each


def test_valid_update_passes_and_returns_the_same_tensors():
    sent = make_update()
    update = validate_update(DEVICE, wire.encode(sent), expectation())
    assert (update.device_id, update.round_id, update.update_id, update.num_samples) == (DEVICE, ROUND, "u-7-1", 400)
    assert update.class_counts == [40] * NUM_CLASSES
    assert set(update.tensors) == set(sent.tensors)
    for name, array in sent.tensors.items():
        assert update.tensors[name].dtype == np.float32
        np.testing.assert_array_equal(update.tensors[name], array)
    assert not np.array_equal(update.tensors[WEIGHT_NAME], WEIGHTS[WEIGHT_NAME])  # really the trained ones


def test_zero_samples_and_zero_counts_are_valid():
    update = validate_update(
        DEVICE,
        wire.encode(make_update(num_samples=0, acquired_labels=0, class_counts=[0] * NUM_CLASSES)),
        expectation(),
    )
    assert update.num_samples == 0


def test_too_large():
    payload = wire.encode(make_update())
    reason = reason_for(payload, exp=expectation(max_bytes=len(payload) - 1))
    assert reason.startswith("too large")
    assert f"{len(payload)} bytes exceeds the limit of {len(payload) - 1}" in reason
    validate_update(DEVICE, payload, expectation(max_bytes=len(payload)))  # exactly at the limit is fine


def test_undecodable():
    reason = reason_for(wire.encode(make_update())[:-10])
    assert reason.startswith("undecodable: ")


def test_undecodable_names_the_schema_problem():
    reason = reason_for(wire.encode(messages.Ack(DEVICE, ROUND, "u", True)))
    assert reason.startswith("undecodable: ") and "expected a 'update' message" in reason


def test_device_id_mismatch():
    reason = reason_for(wire.encode(make_update(device_id="dev-2")), device_id=DEVICE)
    assert reason == "device id 'dev-2' does not match the topic's 'dev-1'"


def test_stale_round():
    reason = reason_for(wire.encode(make_update(round_id=ROUND - 1)))
    assert reason == f"stale round: update is for round {ROUND - 1}, the current round is {ROUND}"


def test_future_round_is_rejected_too():
    reason = reason_for(wire.encode(make_update(round_id=ROUND + 1)))
    assert reason == f"future round: update is for round {ROUND + 1}, the current round is {ROUND}"


def test_base_model_mismatch():
    other = "0" * 64
    reason = reason_for(wire.encode(make_update(base_hash=other)))
    assert reason.startswith("base model mismatch")
    assert other[:12] in reason and BASE_HASH[:12] in reason


def test_missing_tensor():
    reason = reason_for(wire.encode(make_update(tensors=with_tensor(WEIGHT_NAME, None))))
    assert reason.startswith("tensor mismatch")
    assert f"missing ['{WEIGHT_NAME}']" in reason


def test_unexpected_tensor():
    weights = trained_weights()
    weights["extra.weight"] = np.zeros(3, dtype=np.float32)
    reason = reason_for(wire.encode(make_update(tensors=weights)))
    assert "unexpected ['extra.weight']" in reason


def test_wrong_shape():
    wrong = np.zeros((16, 64, 5, 4), dtype=np.float32)
    reason = reason_for(wire.encode(make_update(tensors=with_tensor(WEIGHT_NAME, wrong))))
    assert reason.startswith("tensor mismatch")
    assert f"tensor '{WEIGHT_NAME}' has shape (16, 64, 5, 4), expected (16, 64, 5, 5)" in reason


def test_wrong_dtype_float64():
    wrong = trained_weights()[WEIGHT_NAME].astype(np.float64)
    reason = reason_for(wire.encode(make_update(tensors=with_tensor(WEIGHT_NAME, wrong))))
    assert reason.startswith("tensor mismatch")
    assert f"tensor '{WEIGHT_NAME}' has dtype float64, expected float32" in reason


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values(bad):
    array = trained_weights()[WEIGHT_NAME].copy()
    array[3, 5, 2, 1] = bad
    reason = reason_for(wire.encode(make_update(tensors=with_tensor(WEIGHT_NAME, array))))
    assert reason == f"non-finite values in tensor '{WEIGHT_NAME}'"


def test_negative_sample_count():
    reason = reason_for(wire.encode(make_update(num_samples=-1)))
    assert reason == "negative sample count -1"


@pytest.mark.parametrize("counts", [[40] * (NUM_CLASSES - 1), [40] * (NUM_CLASSES + 1), []])
def test_wrong_class_counts_length(counts):
    reason = reason_for(wire.encode(make_update(class_counts=counts)))
    assert reason == f"class_counts must be {NUM_CLASSES} non-negative integers"


def test_negative_class_count():
    counts = [40] * NUM_CLASSES
    counts[4] = -1
    assert reason_for(wire.encode(make_update(class_counts=counts))).startswith("class_counts must be")


# --- RoundCollector ----------------------------------------------------------------------------------------------


def test_collector_accepts_the_same_payload_once():
    collector = RoundCollector(expectation())
    payload = wire.encode(make_update())
    first, is_new = offer(collector, DEVICE, payload)
    assert is_new is True
    again, is_new_again = offer(collector, DEVICE, payload)
    assert is_new_again is False
    assert again is first
    assert list(collector.accepted) == [DEVICE]
    assert collector.accepted[DEVICE] is first
    assert collector.sizes[DEVICE] == len(payload)


def test_collector_rejects_a_different_update_from_the_same_device():
    collector = RoundCollector(expectation())
    first, _ = offer(collector, DEVICE, wire.encode(make_update()))
    other = wire.encode(make_update(update_id="u-7-2", num_samples=999))
    with pytest.raises(Rejection, match="duplicate") as info:
        offer(collector, DEVICE, other)
    assert DEVICE in info.value.reason and str(ROUND) in info.value.reason
    assert collector.accepted[DEVICE] is first and collector.accepted[DEVICE].num_samples == 400


def test_the_same_update_id_with_other_content_is_a_duplicate_and_the_accepted_one_stays():
    collector = RoundCollector(expectation())
    accepted = make_update()
    first, _ = offer(collector, DEVICE, wire.encode(accepted))
    same_id_other_weights = make_update(
        tensors={name: array + np.float32(1.0) for name, array in accepted.tensors.items()}
    )
    assert same_id_other_weights.update_id == accepted.update_id
    with pytest.raises(Rejection) as info:
        offer(collector, DEVICE, wire.encode(same_id_other_weights))
    assert info.value.kind == RejectionKind.DUPLICATE
    assert info.value.reason == f"duplicate: update {accepted.update_id!r} was already accepted with different content"
    assert offer(collector, DEVICE, wire.encode(accepted)) == (first, False)
    assert (
        list(collector.accepted) == [DEVICE]
        and collector.digests[DEVICE] == hashlib.sha256(wire.encode(accepted)).hexdigest()
    )


def test_collector_keeps_devices_apart_and_does_not_record_invalid_ones():
    collector = RoundCollector(expectation())
    offer(collector, "dev-1", wire.encode(make_update(device_id="dev-1")))
    _, is_new = offer(collector, "dev-2", wire.encode(make_update(device_id="dev-2")))
    assert is_new is True
    with pytest.raises(Rejection, match="stale round"):
        offer(collector, "dev-3", wire.encode(make_update(device_id="dev-3", round_id=ROUND - 1)))
    assert sorted(collector.accepted) == ["dev-1", "dev-2"]


def test_acquired_labels_beyond_the_sample_count_is_rejected():
    reason = reason_for(wire.encode(make_update(acquired_labels=401)))
    assert "acquired_labels 401 must lie in [0, num_samples=400]" in reason
