# The device loop against a real mosquitto, with the test playing the coordinator's part.
from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from bench.oracle import SimulatedOracle
from bench.shard import Shard, open_device_data
from coordinator.fleet.broker import EmbeddedBroker
from edge_agent.data.device_data import DeviceData
from edge_agent.data.fashion_mnist import load_fashion_mnist
from edge_agent.learning.models import build_model, get_weights
from edge_agent.loop.agent import LAST_ROUND_KEY, Agent, last_will
from edge_agent.loop.agent_settings import AgentSettings
from export.bundle_writer import ensure_bundle_files
from protocol import messages, topics, wire
from protocol.model_spec import DEFAULT_SPEC, ModelSpec
from protocol.mqtt import MqttSession
from protocol.serving_messages import ServingMessage
from protocol.tensors import weights_hash

FLEET = "agent-test"
DEVICE = "dev-a"
RECIPE = messages.Recipe(
    sampler="entropy", labels_per_acquisition=12, acquisitions_per_round=2, epochs=1, batch_size=8, mc_passes=3
)


@pytest.fixture(scope="module")
def shard() -> Shard:
    dataset = load_fashion_mnist()
    seeds = np.concatenate([np.flatnonzero(dataset.test_labels == c)[:1] for c in range(10)])
    pool = np.arange(1000, 1080)
    return Shard(
        dataset.test_images[pool],
        dataset.test_labels[pool].astype(np.int64),
        dataset.test_images[seeds],
        dataset.test_labels[seeds].astype(np.int64),
    )


class FakeCoordinator:
    """Publishes a round and its model like the coordinator does, and collects what the device sends back."""

    def __init__(self, broker: EmbeddedBroker) -> None:
        self.session = MqttSession(broker.address, client_id="fake-coordinator")
        self.session.connect(timeout=10)
        self.session.subscribe(topics.UPDATE.filter(fleet=FLEET))
        self.session.subscribe(topics.STATUS.filter(fleet=FLEET))

    def start_round(
        self,
        round_id: int,
        weights: dict,
        model_hash: str | None = None,
        recipe: messages.Recipe = RECIPE,
        spec: ModelSpec = DEFAULT_SPEC,
    ) -> str:
        model_hash = model_hash or weights_hash(weights)
        message = messages.ModelMessage(model_hash, spec, weights)
        self.session.publish(
            topics.MODEL.build(fleet=FLEET, hash=model_hash), wire.encode(message), retain=True, wait=10
        )
        announcement = messages.RoundAnnouncement("run-1", round_id, model_hash, recipe, time.time() + 60)
        self.session.publish(topics.ROUND.build(fleet=FLEET), wire.encode(announcement), retain=True, wait=10)
        return model_hash

    def ship_bundle(self, weights: dict, folder: Path, tamper: bool = False) -> None:
        """Publishes the weights' ONNX bundle as the coordinator does; `tamper` flips a byte of the tail graph."""
        files = ensure_bundle_files(weights, folder)
        if tamper:
            files["tail.onnx"] = files["tail.onnx"][:-1] + bytes([files["tail.onnx"][-1] ^ 1])
        message = messages.BundleMessage(weights_hash(weights), files)
        self.session.publish(
            topics.BUNDLE.build(fleet=FLEET, hash=message.model_hash), wire.encode(message), retain=True, wait=10
        )

    def serve(self, version: int, weights: dict, publish_predictions: bool = False) -> None:
        """Promotes the weights as the coordinator does: the retained serving message naming their hash (their
        bundle is published apart)."""
        message = ServingMessage("run-1", version, weights_hash(weights), time.time(), publish_predictions)
        self.session.publish(topics.SERVING.build(fleet=FLEET), wire.encode(message), retain=True, wait=10)

    def next_on(self, leaf: str, timeout: float, accept=lambda message: True):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            message = self.session.next_message(timeout=0.2)
            if message is not None and message.topic.endswith(f"/{leaf}") and accept(message):
                return message
        return None

    def close(self) -> None:
        self.session.close()


def start_agent(
    broker: EmbeddedBroker, state_dir: Path, shard: Shard, max_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES, **options
):
    settings = AgentSettings(fleet=FLEET, device_id=DEVICE, max_update_bytes=max_bytes, **options)
    session = MqttSession(broker.address, client_id=DEVICE, last_will=last_will(settings), max_payload_bytes=max_bytes)
    agent = Agent(settings, session, open_device_data(state_dir, shard), SimulatedOracle(shard.all_labels))
    session.connect(timeout=10)
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    return agent, thread


def stop_agent(agent: Agent, thread: threading.Thread) -> None:
    agent.stop_event.set()
    thread.join(timeout=20)
    agent.session.close()


def test_agent_answers_a_round_with_one_update_and_keeps_its_labels(broker, tmp_path, shard):
    coordinator = FakeCoordinator(broker)
    agent, thread = start_agent(broker, tmp_path / "state", shard)
    try:
        base = get_weights(build_model(seed=3))
        base_hash = coordinator.start_round(1, base)
        message = coordinator.next_on("update", timeout=60)
        assert message is not None, "no update within 60 s"
        update = wire.decode(message.payload, messages.Update)
        assert (update.device_id, update.round_id, update.base_hash) == (DEVICE, 1, base_hash)
        assert update.acquired_labels == 2 * 12
        assert update.num_samples == 24 + 10 and sum(update.class_counts) == 34
        assert any(not np.array_equal(update.tensors[k], base[k]) for k in base)
    finally:
        stop_agent(agent, thread)
        coordinator.close()
    on_disk = DeviceData.open(tmp_path / "state")
    assert on_disk.count_labels("oracle") == 24 and on_disk.get_state(LAST_ROUND_KEY) == 1
    labelled_indices, labels = on_disk.labelled()
    assert np.array_equal(labels, shard.all_labels[labelled_indices])


@pytest.mark.parametrize(
    ("spec", "recipe", "reason"),
    [
        (
            ModelSpec("rgb-cnn", 3, 32, 32, [0.5] * 3, [0.25] * 3, list("abcdefghij")),
            RECIPE,
            "the model takes 32x32x3 images, this device holds 28x28",
        ),
        (
            ModelSpec(class_names=[f"class {index}" for index in range(5)]),
            RECIPE,
            "the model has 5 classes, this device's labels have 10",
        ),
        (
            DEFAULT_SPEC,
            dataclasses.replace(RECIPE, lr_schedule="warmup" * 1000),
            f"unknown learning-rate schedule {('warmup' * 7)[:40]!r}; known: constant, cosine",
        ),
    ],
)
def test_a_device_that_cannot_do_the_round_refuses_it_in_one_bounded_line_and_keeps_everything(
    broker, tmp_path, shard, caplog, spec: ModelSpec, recipe: messages.Recipe, reason: str
):
    coordinator = FakeCoordinator(broker)
    agent, thread = start_agent(broker, tmp_path / "state", shard)
    before = (tmp_path / "state" / "labels.npz").read_bytes()
    try:
        coordinator.start_round(1, get_weights(build_model(spec, seed=3)), recipe=recipe, spec=spec)
        status = coordinator.next_on("status", 60, lambda m: wire.decode(m.payload, messages.Status).state == "error")
        assert status is not None, "the device did not report the refused round"
        assert coordinator.next_on("update", timeout=1) is None
    finally:
        stop_agent(agent, thread)
        coordinator.close()
    refusals = [r.getMessage() for r in caplog.records if "round refused" in r.getMessage()]
    assert refusals == [f"round refused device={DEVICE} round=1 reason={reason}"]
    assert (tmp_path / "state" / "labels.npz").read_bytes() == before


def test_restarted_agent_does_not_redo_a_finished_round(broker, tmp_path, shard):
    coordinator = FakeCoordinator(broker)
    agent, thread = start_agent(broker, tmp_path / "state", shard)
    weights = get_weights(build_model(seed=4))
    coordinator.start_round(1, weights)
    first = coordinator.next_on("update", timeout=60)
    assert first is not None
    stop_agent(agent, thread)
    agent, thread = start_agent(broker, tmp_path / "state", shard)
    try:
        again = coordinator.next_on("update", timeout=10)
        assert again is not None and again.payload == first.payload, "the unanswered update is re-sent as it was"
        assert coordinator.next_on("update", timeout=3) is None
        assert DeviceData.open(tmp_path / "state").count_labels("oracle") == 24
        coordinator.start_round(2, weights)
        second = coordinator.next_on("update", timeout=60)
        assert second is not None and wire.decode(second.payload, messages.Update).acquired_labels == 48
    finally:
        stop_agent(agent, thread)
        coordinator.close()


def test_oversize_update_is_refused_before_sending_and_the_agent_lives_on(broker, tmp_path, shard):
    coordinator = FakeCoordinator(broker)
    agent, thread = start_agent(broker, tmp_path / "state", shard, max_bytes=50_000)
    try:
        coordinator.start_round(1, get_weights(build_model(seed=5)))
        error = coordinator.next_on("status", 60, lambda m: wire.decode(m.payload, messages.Status).state == "error")
        assert error is not None
        assert coordinator.next_on("update", timeout=2) is None
        assert thread.is_alive()
        assert DeviceData.open(tmp_path / "state").count_labels("oracle") == 24
    finally:
        stop_agent(agent, thread)
        coordinator.close()


def test_model_whose_content_does_not_match_its_hash_is_not_trained_on(broker, tmp_path, shard):
    coordinator = FakeCoordinator(broker)
    agent, thread = start_agent(broker, tmp_path / "state", shard)
    try:
        coordinator.start_round(1, get_weights(build_model(seed=6)), model_hash="0" * 64)
        assert coordinator.next_on("update", timeout=5) is None
        assert DeviceData.open(tmp_path / "state").count_labels("oracle") == 0
    finally:
        stop_agent(agent, thread)
        coordinator.close()


def labelled_after_one_round(broker: EmbeddedBroker, state_dir: Path, shard: Shard, weights: dict, **options):
    """Runs one round on a fresh agent and returns the pool indices it had labelled, in order."""
    coordinator = FakeCoordinator(broker)
    agent, thread = start_agent(broker, state_dir, shard, **options)
    try:
        if options.get("backend") == "onnxruntime":
            coordinator.ship_bundle(weights, state_dir.parent / "bundle")
        coordinator.start_round(1, weights)
        assert coordinator.next_on("update", timeout=60) is not None, "no update within 60 s"
    finally:
        stop_agent(agent, thread)
        coordinator.close()
    return DeviceData.open(state_dir).labelled()[0]


def test_onnxruntime_agent_scores_with_the_shipped_bundle_and_picks_what_torch_picks(broker, tmp_path, shard):
    weights = get_weights(build_model(seed=6))
    by_torch = labelled_after_one_round(broker, tmp_path / "torch" / "state", shard, weights)
    by_onnx = labelled_after_one_round(broker, tmp_path / "onnx" / "state", shard, weights, backend="onnxruntime")
    oracle_labels = 2 * RECIPE.labels_per_acquisition
    assert len(by_onnx) == len(by_torch) == oracle_labels + 10
    assert np.array_equal(by_onnx, by_torch), "the second acquisition scores the locally trained model in both"
    assert (tmp_path / "onnx" / "state" / "bundles" / weights_hash(weights) / "manifest.json").is_file()


def test_onnxruntime_agent_waits_for_a_bundle_that_verifies(broker, tmp_path, shard):
    coordinator = FakeCoordinator(broker)
    agent, thread = start_agent(broker, tmp_path / "state", shard, backend="onnxruntime")
    weights = get_weights(build_model(seed=7))
    try:
        coordinator.ship_bundle(weights, tmp_path / "bundle", tamper=True)
        coordinator.start_round(1, weights)
        assert coordinator.next_on("update", timeout=5) is None, "a tampered bundle must not be used"
        assert DeviceData.open(tmp_path / "state").count_labels("oracle") == 0
        coordinator.ship_bundle(weights, tmp_path / "bundle")
        update = coordinator.next_on("update", timeout=60)
        assert update is not None and wire.decode(update.payload, messages.Update).acquired_labels == 24
    finally:
        stop_agent(agent, thread)
        coordinator.close()


def test_a_device_whose_pool_is_used_up_still_trains_on_its_labels_and_reports_its_metrics(broker, tmp_path, shard):
    """The bench's Dirichlet shards run out before the last rounds: the update must stay a trained one, with the
    metric FMLU weighs by, not the global model sent back without it (which `fmlu` rejects, stalling the round)."""
    recipe = messages.Recipe(
        sampler="random", local_rule="dmlu", labels_per_acquisition=40, acquisitions_per_round=2, epochs=1, batch_size=8
    )
    coordinator = FakeCoordinator(broker)
    agent, thread = start_agent(broker, tmp_path / "state", shard)
    try:
        for round_id, seed in ((1, 3), (2, 4)):
            base = get_weights(build_model(seed=seed))
            coordinator.start_round(round_id, base, recipe=recipe)
            message = coordinator.next_on(
                "update", 60, lambda m, r=round_id: wire.decode(m.payload, messages.Update).round_id == r
            )
            assert message is not None, f"no update for round {round_id} within 60 s"
            update = wire.decode(message.payload, messages.Update)
            assert update.num_samples == len(shard.images) + len(shard.seed_images)
            assert "meme_entropy" in update.metrics
            assert any(not np.array_equal(update.tensors[k], base[k]) for k in base)
    finally:
        stop_agent(agent, thread)
        coordinator.close()
    assert DeviceData.open(tmp_path / "state").count_labels("oracle") == len(shard.images)
