# Head-sized updates: a frozen backbone never travels; the round commits what full float32 updates committed.
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from coordinators import FakeSession

from bench.oracle import SimulatedOracle
from coordinator.asynchronous.intake import AsyncPolicy
from coordinator.asynchronous.rounds import AsyncCoordinator
from coordinator.intake.observer import RoundObserver
from coordinator.intake.update_intake import UpdateIntake
from coordinator.intake.validation import MAX_REASON_CHARS, Rejection, validate_update
from coordinator.rounds.closing import RoundCloser
from coordinator.rounds.evaluation import Evaluator, LabelledSplit
from coordinator.rounds.loop import Coordinator, RoundParts, round_expectation
from coordinator.rounds.presence import Presence
from coordinator.rounds.publisher import Artefacts, RetainedPublisher
from coordinator.rounds.rules import RoundPolicy, RoundRules
from coordinator.storage.store import RunStore
from coordinator.strategies.registry import STRATEGIES, make_strategy
from edge_agent.data.device_data import DeviceData
from edge_agent.learning.learner_choice import make_learner
from edge_agent.learning.local_data import training_view
from edge_agent.learning.models import build_model, get_weights
from edge_agent.loop.agent_settings import AgentSettings
from edge_agent.loop.artefacts import RoundArtefacts
from edge_agent.loop.footprint import PhaseMeter
from edge_agent.loop.round_inputs import RoundModels
from edge_agent.loop.round_runner import RoundRunner
from protocol import messages, wire
from protocol.messages import RejectionKind
from protocol.model_spec import ModelSpec, spec_hash
from protocol.tensors import Weights, weights_hash
from protocol.trained_set import trained_set, with_trained
from protocol.update_codec import ResidualStore, UpdateCodec, encode_update

FLEET = "heads"
CLASSES = [f"class-{index}" for index in range(10)]
SIDE = 28  # grey 28x28: the images a shard device holds
RECIPE = messages.Recipe(epochs=1, batch_size=4)
DEVICES = ("dev-0", "dev-1", "dev-2")


def small_spec(trainable: str) -> ModelSpec:
    """A grey MobileNet at 28 px (width 0.25): small enough to train three devices in a test."""
    return ModelSpec("mobilenet", 1, SIDE, SIDE, [0.5], [0.25], CLASSES, 0.25, trainable=trainable)


def test_the_trained_set_is_what_the_spec_trains_and_completes_the_model_untouched() -> None:
    model = get_weights(build_model(small_spec("all"), seed=0))
    head, last = trained_set(small_spec("head"), model), trained_set(small_spec("last:1"), model)
    assert list(head) == ["classifier_fc.weight", "classifier_fc.bias"]
    assert set(head) < set(last) < set(model) and any(name.startswith("blocks.") for name in last)
    assert trained_set(small_spec("all"), model) == model
    changed = {name: array + 1 for name, array in head.items()}
    whole = with_trained(model, changed)
    assert list(whole) == list(model) and all(whole[name] is model[name] for name in model if name not in head)
    assert all(whole[name] is changed[name] for name in head)
    with pytest.raises(ValueError, match="1 trained tensor"):
        with_trained(head, {"stem.0.weight": model["stem.0.weight"]})


def trained_device(
    tmp_path: Path, spec: ModelSpec, base: Weights, device_id: str, seed: int, recipe: messages.Recipe
) -> tuple[bytes, bytes]:
    """A device's real round work on `spec`: the torch trainer (its backbone frozen as the spec says) trains one
    epoch of the recipe's local rule on a few labelled images; (the update the round runner builds, the whole model as a float32 update built
    the same way, as every update was before it carried the trained set only)."""
    rng = np.random.default_rng(seed)
    images, labels = rng.integers(0, 256, (12, SIDE, SIDE), dtype=np.uint8), rng.integers(0, 10, 12)
    data = DeviceData.create(tmp_path / spec.trainable.replace(":", "-") / device_id, images)
    data.add_labels(np.arange(8), labels[:8])
    settings = AgentSettings(FLEET, device_id)
    session = FakeSession(FLEET)
    artefacts = RoundArtefacts(session, FLEET, tmp_path / "bundles", tmp_path / "backbone")  # type: ignore[arg-type]
    runner = RoundRunner(settings, data, SimulatedOracle(labels), artefacts, lambda *_: None, PhaseMeter())
    learner = make_learner(settings.compute, data.state_dir, spec, base, None)
    none = np.zeros(0, dtype=np.int64)
    metrics = learner.train(training_view(data, none, none, 1), recipe, seed)
    announcement = messages.RoundAnnouncement("run", 1, weights_hash(base), recipe, 0.0, spec_hash=spec_hash(spec))
    models = RoundModels(learner, weights_hash(base), recipe)
    sent, whole = (runner.update_of(announcement, s, models, metrics, base) for s in (spec, small_spec("all")))
    return wire.encode(sent), wire.encode(whole)


def committed(
    tmp_path: Path, spec: ModelSpec, strategy: str, payloads: dict[str, bytes], base: Weights, mode: str = "round"
) -> Weights:
    """The model a coordinator of `spec` commits for round 1 from these update payloads, sent in a round, taken
    back from the spool a killed predecessor left ("spooled"), or folded as asynchronous version 1 ("async"); every
    device model and the strategy's candidates are evaluated on a small split, so the server sees whole models."""
    session, store, observer = FakeSession(FLEET), RunStore(tmp_path / f"run-{spec.trainable}-{mode}"), RoundObserver()
    images = np.random.default_rng(5).integers(0, 256, (6, SIDE, SIDE), dtype=np.uint8)
    split = LabelledSplit.from_uint8(images, np.arange(6) % 10)
    parts = RoundParts(
        presence=Presence(observer),
        intake=UpdateIntake(FLEET, session, store, observer),
        publisher=RetainedPublisher(session, FLEET, "run", Artefacts()),
        closer=RoundCloser(store, make_strategy(strategy), Evaluator(spec, split, split, 2, 0), True, 0),
        observer=observer,
    )
    rules = RoundRules(RECIPE, RoundPolicy(1, quorum=len(payloads), round_timeout=5.0), spec=spec)
    for device, payload in payloads.items():
        if mode == "spooled":
            store.spool.add(1, device, payload)
        else:
            session.send(device, payload)
    with store:
        if mode == "async":
            coordinator = AsyncCoordinator(FLEET, session, rules, parts, AsyncPolicy(len(payloads), 1))
            weights, result = coordinator.run_version(coordinator.resumed_collector(0, base), base)
        else:
            weights, result = Coordinator(FLEET, session, rules, parts).run_round(1, base)
        assert sorted(result.device_accuracy) == sorted(payloads) and not result.rejected
        assert weights_hash(store.checkpoints.load(1)) == weights_hash(weights)
    return weights


def same_devices_both_ways(tmp_path: Path, spec: ModelSpec, strategy: str) -> tuple[Weights, dict, dict]:
    """(the round's model, each device's update as the spec's trained set, and as its whole model in float32)."""
    base = get_weights(build_model(spec, seed=0))
    recipe = dataclasses.replace(RECIPE, local_rule="dmlu") if strategy == "fmlu" else RECIPE  # FMLU weighs by DMLU's
    sent = {device: trained_device(tmp_path, spec, base, device, seed, recipe) for seed, device in enumerate(DEVICES)}
    heads, fulls = ({device: pair[index] for device, pair in sent.items()} for index in (0, 1))
    return base, heads, fulls


def assert_the_same_model(new: Weights, old: Weights, base: Weights, trained: Weights) -> None:
    """The same bits in every tensor; the frozen ones are the round's model's own arrays, the trained ones moved."""
    assert list(new) == list(base)
    assert all(new[name] is base[name] for name in base if name not in trained)  # never touched
    assert all(np.array_equal(new[name], old[name]) for name in base)
    assert any(not np.array_equal(new[name], base[name]) for name in trained)


@pytest.mark.parametrize("trainable", ["head", "last:1"])
@pytest.mark.parametrize("strategy", STRATEGIES.select(lambda known: not known.statistics))  # models, not statistics
def test_a_head_sized_round_commits_the_model_full_float32_updates_commit(
    tmp_path: Path, trainable: str, strategy: str
) -> None:
    """The same devices' trained models, sent as the trained set (the spec's) and as whole float32 models to a
    coordinator that expects the whole model (the old way): the two rounds commit the same bits."""
    spec, whole = small_spec(trainable), small_spec("all")
    base, heads, fulls = same_devices_both_ways(tmp_path, spec, strategy)
    trained = trained_set(spec, base)
    for device in DEVICES:
        carried = wire.decode(heads[device], messages.Update).tensors
        assert list(carried) == list(trained)
        full = wire.decode(fulls[device], messages.Update).tensors
        assert all(np.array_equal(full[name], carried[name]) for name in trained)
        assert all(np.array_equal(full[name], base[name]) for name in base if name not in trained)  # frozen
    new, old = committed(tmp_path, spec, strategy, heads, base), committed(tmp_path, whole, strategy, fulls, base)
    assert_the_same_model(new, old, base, trained)


@pytest.mark.parametrize("trainable", ["head", "last:1"])
@pytest.mark.parametrize("mode", ["spooled", "async"])
def test_a_spooled_round_and_an_asynchronous_version_take_head_sized_updates_too(
    tmp_path: Path, trainable: str, mode: str
) -> None:
    """A restarted coordinator takes a head-sized round back from its spool; FedBuff folds head-sized updates
    (their deltas rebased onto the version's trained set): both commit what whole float32 updates commit."""
    spec, whole = small_spec(trainable), small_spec("all")
    base, heads, fulls = same_devices_both_ways(tmp_path, spec, "fedavg")
    new = committed(tmp_path, spec, "fedavg", heads, base, mode)
    assert_the_same_model(new, committed(tmp_path, whole, "fedavg", fulls, base, mode), base, trained_set(spec, base))


def head_update(spec: ModelSpec, tensors: Weights, base: Weights, **changes: object) -> messages.Update:
    """A device's float32 update of round 1 carrying these tensors."""
    update = messages.Update("dev-0", 1, "u-0", weights_hash(base), 8, [1] * 8 + [0] * 2, 8, {}, tensors, b"n" * 16)
    return dataclasses.replace(update, **changes)


@pytest.mark.parametrize("encoding", ["float32", "int8-delta"])
def test_an_update_carrying_a_frozen_tensor_or_missing_a_trained_one_is_a_tensor_mismatch(encoding: str) -> None:
    spec = small_spec("last:1")
    base = get_weights(build_model(spec, seed=0))
    expected = round_expectation(RoundRules(RECIPE, RoundPolicy(1), spec=spec), make_strategy("fedavg"), 1, base)
    trained = trained_set(spec, base)
    frozen = next(name for name in base if name not in trained)
    codec = UpdateCodec(encoding)
    cases = {
        "whole model": base,
        "one frozen tensor": {**trained, frozen: base[frozen]},
        "no classifier bias": {name: array for name, array in trained.items() if name != "classifier_fc.bias"},
    }
    for carried in cases.values():
        encoded = codec.encode(carried, carried)[0]
        update = head_update(spec, encoded.tensors, base, encoding=encoded.encoding, scales=encoded.scales)
        with pytest.raises(Rejection) as refused:
            validate_update("dev-0", wire.encode(update), expected)
        assert refused.value.kind == RejectionKind.TENSOR_MISMATCH and len(refused.value.reason) <= MAX_REASON_CHARS
    accepted = validate_update("dev-0", wire.encode(head_update(spec, trained, base)), expected)
    assert list(accepted.tensors) == list(trained)


CODECS = {
    "float32": UpdateCodec(),
    "fp16-delta": UpdateCodec("fp16-delta"),
    "int8-delta": UpdateCodec("int8-delta", "channel"),
    "int8 top-k": UpdateCodec("int8-delta", top_k=0.1),
    "fp16 deflated": UpdateCodec("fp16-delta", compression="deflate"),
}


def payload_of(update: messages.Update, codec: UpdateCodec, key: bytes) -> bytes:
    """The update as a device sends it: encoded, deflated when the codec says so, signed with the key."""
    payload = wire.encode(update)
    return wire.signed(wire.deflated(payload) if codec.compression == "deflate" else payload, key)


def test_a_head_update_of_a_realistic_model_is_at_most_one_percent_of_the_full_one(tmp_path: Path) -> None:
    """MobileNet 1.0 at 96 px with 10 classes (~3.2M parameters): every codec's signed head update is a small
    fraction of the full float32 update's bytes, and validates against the head-only expectation."""
    spec = ModelSpec("mobilenet", 3, 96, 96, [0.5] * 3, [0.25] * 3, CLASSES, trainable="head")
    base = get_weights(build_model(spec, seed=0))
    assert 3_000_000 < sum(array.size for array in base.values()) < 3_500_000
    rng = np.random.default_rng(0)
    trained = {name: (array + rng.normal(0, 0.01, array.shape)).astype(array.dtype) for name, array in base.items()}
    full = len(payload_of(head_update(spec, trained, base), UpdateCodec(), b"k" * 32))
    expected = round_expectation(RoundRules(RECIPE, RoundPolicy(1), spec=spec), make_strategy("fedavg"), 1, base)
    expected = dataclasses.replace(expected, authenticate=None)
    for name, codec in CODECS.items():
        encoded = encode_update(trained_set(spec, trained), trained_set(spec, base), codec, ResidualStore(tmp_path))
        update = head_update(spec, encoded.tensors, base, encoding=encoded.encoding)
        update = dataclasses.replace(update, scales=encoded.scales, indices=encoded.indices)
        payload = payload_of(update, codec, b"k" * 32)
        assert len(payload) <= full / 100, (name, len(payload), full)
        accepted = validate_update("dev-0", payload, expected)
        assert list(accepted.tensors) == ["classifier_fc.weight", "classifier_fc.bias"]
