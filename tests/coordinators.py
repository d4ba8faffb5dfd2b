# Test helpers: a coordinator assembled from its parts around a given session, store, strategy and evaluator; a fake
# session (no broker) for in-process rounds; a round run on its own thread against a live broker; what a secure run's
# folders must not hold.
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from coordinator.intake.observer import RoundObserver
from coordinator.intake.round_aggregator import Aggregate
from coordinator.intake.update_intake import RoundCollector, UpdateIntake
from coordinator.intake.validation import Expectation
from coordinator.rounds.closing import RoundCloser
from coordinator.rounds.evaluation import Evaluator, LabelledSplit
from coordinator.rounds.loop import Coordinator, RoundParts
from coordinator.rounds.mode import RoundMode
from coordinator.rounds.presence import Presence
from coordinator.rounds.promotion import GateEvidence, PromotionGate
from coordinator.rounds.publisher import Artefacts, RetainedPublisher
from coordinator.rounds.rules import RoundPolicy, RoundRules
from coordinator.rounds.serving import ServingKeeper
from coordinator.secure.mode import SecureMode
from coordinator.storage.store import RoundRecord, RunStore
from coordinator.strategies.contract import Strategy
from coordinator.strategies.registry import make_strategy
from edge_agent.learning.models import build_model, weight_spec
from protocol import messages, topics, wire
from protocol.model_spec import DEFAULT_SPEC
from protocol.mqtt import BrokerAddress, IncomingMessage, MqttSession
from protocol.serving_messages import ServingMessage
from protocol.tensors import Weights, weights_hash

NUM_CLASSES = DEFAULT_SPEC.num_classes


def local_coordinator(
    fleet: str,
    session: MqttSession,
    store: RunStore,
    strategy: Strategy,
    evaluator: Evaluator,
    policy: RoundPolicy,
    recipe: messages.Recipe | None = None,
    observer: RoundObserver | None = None,
    identities: dict[str, bytes] | None = None,
) -> Coordinator:
    """A coordinator with no bundles, no encoder, no device evaluation and an observer that hears nothing (unless
    one is given: the dashboard's LiveState, to read /metrics); a secure one checks key adverts against
    `identities` (a provisioned fleet's identity public keys) when given."""
    observer = observer or RoundObserver()
    intake = UpdateIntake(fleet, session, store, observer)
    parts = RoundParts(
        presence=Presence(observer),
        intake=intake,
        publisher=RetainedPublisher(session, fleet, "run", Artefacts()),
        closer=RoundCloser(store, strategy, evaluator, evaluate_devices=False, base_labels=0),
        observer=observer,
        mode=SecureMode(RoundMode(), session, fleet, intake, identities)
        if recipe and recipe.secure_aggregation != "off"
        else RoundMode(),
    )
    return Coordinator(fleet, session, RoundRules(recipe or messages.Recipe(), policy), parts)


@dataclass
class RoundThread:
    """A FedAvg coordinator (`local_coordinator`: a secure one for a secure recipe, checking adverts against
    `identities` when given) on a live broker session, running one round on its own thread."""

    fleet: str
    session: MqttSession
    store: RunStore
    evaluator: Evaluator
    recipe: messages.Recipe
    observer: RoundObserver | None = None
    identities: dict[str, bytes] | None = None

    def start(self, devices: list[str], base: Weights) -> tuple[threading.Thread, list]:
        """Connects, marks `devices` online and runs round 1 from `base` on a thread, returning once the secure round
        is open (its state saved: the coordinator reads stage messages from then on): the thread, and the list its
        result joins."""
        strategy, policy = make_strategy("fedavg"), RoundPolicy(rounds=1, round_timeout=3.0)
        coordinator = local_coordinator(
            self.fleet,
            self.session,
            self.store,
            strategy,
            self.evaluator,
            policy,
            self.recipe,
            self.observer,
            self.identities,
        )
        self.session.connect(timeout=10)
        coordinator.start()
        for device in devices:
            coordinator.parts.presence.statuses[device] = messages.Status(device, "online", time.time())
        outcome: list = []
        thread = threading.Thread(target=lambda: outcome.append(coordinator.run_round(1, base)))
        thread.start()
        opened, deadline = self.store.spool.folder / "secagg-1.rec", time.monotonic() + 30
        while not opened.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        return thread, outcome


def evaluator_of(fashion: Any) -> Evaluator:
    """An evaluator over Fashion-MNIST's first 20 test images (validation and test alike)."""
    split = LabelledSplit.from_uint8(fashion.test_images[:20], fashion.test_labels[:20])
    return Evaluator(DEFAULT_SPEC, split, split, 1, 0)


def blank_evaluator() -> Evaluator:
    """Two blank test images: for a coordinator that here only validates and aggregates."""
    split = LabelledSplit.from_uint8(np.zeros((2, 28, 28), dtype=np.uint8), np.zeros(2, dtype=np.int64))
    return Evaluator(DEFAULT_SPEC, split, split, 1, 0)


def coordinator_on(store: RunStore, strategy: Strategy) -> Coordinator:
    """A coordinator over a store that never connects (for restart tests of its committed state)."""
    session = MqttSession(BrokerAddress("127.0.0.1", 1), client_id="never-connects")
    return local_coordinator("fleet", session, store, strategy, blank_evaluator(), RoundPolicy(3))


def commit_weights(coordinator: Coordinator, round_id: int, weights: Weights, base: Weights) -> None:
    """Commits a round through the coordinator's own commit step (checkpoint, records, strategy state)."""
    collector = RoundCollector(Expectation(round_id, weights_hash(base), weight_spec(build_model()), NUM_CLASSES, 1))
    record = RoundRecord(round_id, 0.0, 1.0, "", None, 0, 0, 0, {}, {})
    coordinator.parts.closer.commit(collector, Aggregate(weights, {}, {}, {}), record, {})


class FakeSession:
    """The coordinator's side of a broker for one fleet: messages queued by the test, publications kept."""

    def __init__(self, fleet: str) -> None:
        self.fleet = fleet
        self.inbox: queue.Queue[IncomingMessage] = queue.Queue()
        self.published: list[tuple[str, bytes]] = []

    def send(self, device_id: str, payload: bytes) -> None:
        """Queues an update as a device publishes it."""
        self.inbox.put(IncomingMessage(topics.UPDATE.build(fleet=self.fleet, device=device_id), payload, False))

    def subscribe(self, topic: str, qos: int = 1) -> None:
        """Nothing to subscribe to."""

    def publish(self, topic: str, payload: bytes, retain: bool = False, qos: int = 1, wait: Any = None) -> bool:
        """Keeps the publication."""
        self.published.append((topic, payload))
        return True

    def acknowledge(self, message: IncomingMessage) -> None:
        """Nothing to acknowledge."""

    def next_message(self, timeout: float | None = None) -> IncomingMessage | None:
        """The next queued message, or None at once."""
        try:
            return self.inbox.get_nowait()
        except queue.Empty:
            return None

    def acks(self) -> list[messages.Ack]:
        """The acks published so far."""
        return [wire.decode(payload, messages.Ack) for topic, payload in self.published if topic.endswith("/ack")]


def plain_bytes_in(folder: Path, trained: dict[str, Weights], base: Weights) -> list[str]:
    """Files under `folder` that hold any device's plain weights or delta (the first tensor's bytes, which are
    unique to the device: random noise on the model)."""
    name = next(iter(base))
    needles = [weights[name].tobytes()[:4096] for weights in trained.values()]
    needles += [(weights[name] - base[name]).tobytes()[:4096] for weights in trained.values()]
    return [str(path) for path in folder.rglob("*") if path.is_file() and any(n in path.read_bytes() for n in needles)]


class ServingRecorder:
    """A stand-in for the retained publisher's serving side: keeps each serving message it is asked to publish,
    after checking the weights are the model it names."""

    run_id = "run"

    def __init__(self) -> None:
        self.published: list[ServingMessage] = []

    def publish_serving(self, message: ServingMessage, weights: Weights) -> None:
        """Keeps the message, as the wire carries it."""
        assert weights_hash(weights) == message.model_hash
        self.published.append(wire.decode(wire.encode(message), ServingMessage))


def gate_decisions(store: RunStore, evaluator: Evaluator) -> tuple[list[tuple[int, str, int]], ServingRecorder]:
    """Runs the serving keeper (default gate, judging with the evaluator's test images) over a store: its
    (round, decision, serving) events and what it published."""
    recorder = ServingRecorder()

    def judge(candidate: int, serving: int) -> GateEvidence:
        return evaluator.evidence(candidate, serving, store.checkpoints.load)

    ServingKeeper(store, recorder, PromotionGate(), DEFAULT_SPEC.class_names, judge).refresh()  # type: ignore[arg-type]
    return [(event.round_id, event.decision, event.serving) for event in store.serving.events()], recorder
