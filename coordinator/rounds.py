# The round state machine: announce, collect and validate updates, aggregate, measure, evaluate, persist.
from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from coordinator.authentication import UpdateAuthenticator
from coordinator.divergence import flag_suspects, fleet_divergence, layer_divergence
from coordinator.evaluation import Evaluator
from coordinator.store import DeviceRoundRecord, RoundRecord, RunStore, StrategyState
from coordinator.strategies import (
    ClientUpdate,
    Evaluate,
    RunningSum,
    Strategy,
    StreamingWeightedAverage,
    coordinate_median,
)
from coordinator.validation import Expectation, Rejection, validate_update
from edge_agent import wire
from edge_agent.models import NUM_CLASSES, build_model, weight_spec
from edge_agent.mqtt import IncomingMessage, MqttSession
from edge_agent.tensors import Weights, weights_hash

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundPolicy:
    """When a round may close: the quorum, the minimum and the deadline."""

    rounds: int
    min_devices: int = 1
    quorum: int | None = None
    round_timeout: float = 600.0
    max_update_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES
    participation: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 < self.participation <= 1.0:
            raise ValueError(f"--participation must lie in (0, 1], got {self.participation}")
        if self.rounds < 1:
            raise ValueError(f"--rounds must be at least 1, got {self.rounds}")
        if self.min_devices < 1:
            raise ValueError(f"--min-devices must be at least 1, got {self.min_devices}")
        if self.quorum is not None and self.quorum < self.min_devices:
            raise ValueError(f"--quorum {self.quorum} is below --min-devices {self.min_devices}")
        if self.round_timeout <= 0:
            raise ValueError(f"--round-timeout must be positive, got {self.round_timeout}")


@dataclass(frozen=True)
class SuspectPolicy:
    """How updates whose per-layer divergence is an outlier across devices are treated.

    Suspicion is judged against the coordinate median of the round's updates, not against the aggregate: a
    poisoned aggregate makes every honest device look far away. A device is a suspect when at least
    `min_layer_fraction` of its layers have a robust z-score above `threshold` (single layers of a few devices
    cross it by chance).
    """

    threshold: float = 3.5
    min_layer_fraction: float = 0.5
    exclude: bool = False


def find_suspects(updates: list[ClientUpdate], policy: SuspectPolicy) -> dict[str, list[str]]:
    """Device -> its outlier layers, for the devices whose updates stand apart from the others."""
    reference = coordinate_median([u.weights for u in updates])
    return suspects_by_divergence(fleet_divergence({u.device_id: u.weights for u in updates}, reference), policy)


def suspects_by_divergence(divergence: dict[str, dict[str, float]], policy: SuspectPolicy) -> dict[str, list[str]]:
    """Device -> outlier layers, for devices with at least policy.min_layer_fraction of their layers flagged."""
    flagged = flag_suspects(divergence, policy.threshold)
    layer_count = len(next(iter(divergence.values()), {}))
    return {
        device: layers for device, layers in flagged.items() if len(layers) >= policy.min_layer_fraction * layer_count
    }


def choose_participants(online: Sequence[str], participation: float, seed: int, round_id: int) -> list[str]:
    """KAFAL's S_t: a seeded random ceil(R*K) of the K online devices, sorted; [] (everyone) when R = 1."""
    if participation >= 1.0 or not online:
        return []
    count = math.ceil(participation * len(online))
    rng = np.random.default_rng([seed, round_id])
    return sorted(rng.choice(sorted(online), size=count, replace=False).tolist())


@dataclass
class StreamedRound:
    """A streaming strategy's round in progress: the running aggregate and each device's per-layer divergence from
    the round's base model, so accepted tensors need not stay in memory (they are in the spool).

    Suspects are judged on the divergence from the base model (the last trusted global model) rather than from the
    coordinate median, which would need every update at once.
    """

    strategy: StreamingWeightedAverage
    base: Weights
    running: RunningSum
    from_base: dict[str, dict[str, float]] = field(default_factory=dict)

    def absorb(self, update: ClientUpdate) -> None:
        """Adds an accepted update to the aggregate and notes how far it moved from the base model."""
        self.strategy.accumulate(self.running, update)
        self.from_base[update.device_id] = layer_divergence(update.weights, self.base)

    def finish(self, policy: SuspectPolicy) -> tuple[Weights, dict, dict[str, list[str]]]:
        """(aggregate, report, suspects) once the round's updates are in."""
        new_weights, report = self.strategy.finish(self.running)
        suspects = suspects_by_divergence(self.from_base, policy)
        report["suspects"] = suspects
        report["streamed"] = True
        return new_weights, report, suspects


@dataclass
class RoundResult:
    """What one closed round produced, for progress lines, JSON output and summaries."""

    round_id: int
    accuracy: float
    device_accuracy: dict[str, float]
    labels: int
    divergence: dict[str, dict[str, float]]
    seconds: float
    rejected: dict[str, str]
    report: dict
    suspects: dict[str, list[str]] = field(default_factory=dict)


class RoundObserver:
    """Hears what the coordinator sees as it happens: device presence, answered updates, round boundaries.

    This base hears nothing; the dashboard's live state overrides it. Called from the coordinator's loop only.
    """

    def device_status(self, device_id: str, status: wire.Status | None) -> None:
        """A device's status message arrived (None: its retained status was cleared)."""

    def update_answered(self, device_id: str, round_id: int, size: int, reason: str | None) -> None:
        """An update of `size` bytes was acked: accepted when reason is None, else rejected for that reason."""

    def round_opened(self, round_id: int, needed: int) -> None:
        """A round was announced; `needed` accepted updates close it early."""

    def round_closed(self, result: RoundResult) -> None:
        """A round was aggregated, evaluated and committed."""


@dataclass
class RoundCollector:
    """The updates of one round as they arrive: accepted once per device, duplicates answered idempotently.

    With `absorb` set, each accepted update's tensors go into it (a streaming aggregate) and only the update's
    metadata is kept.
    """

    expectation: Expectation
    accepted: dict[str, wire.Update] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    absorb: Callable[[wire.Update], None] | None = None
    rejection_count: int = 0

    def reject(self, device_id: str, reason: str) -> None:
        """Notes a rejected update: the device's latest reason, and one more in the round's count."""
        self.rejected[device_id] = reason
        self.rejection_count += 1

    def offer(self, device_id: str, payload: bytes) -> tuple[wire.Update | None, bool]:
        """(update, is_new): a valid first update is new; a redelivery of the accepted one is not; else Rejection."""
        update = validate_update(device_id, payload, self.expectation)
        previous = self.accepted.get(device_id)
        if previous is not None:
            if previous.update_id == update.update_id:
                return previous, False
            raise Rejection(
                f"duplicate: {device_id} already has an accepted update for round {self.expectation.round_id}"
            )
        if self.absorb is not None:
            self.absorb(update)
            update = dataclasses.replace(update, tensors={})
        self.accepted[device_id] = update
        self.sizes[device_id] = len(payload)
        return update, True


def aggregate_with_suspects(
    strategy: Strategy,
    global_weights: Weights,
    updates: list[ClientUpdate],
    evaluate: Evaluate | None,
    policy: SuspectPolicy,
) -> tuple[Weights, dict, dict[str, dict[str, float]], dict[str, list[str]]]:
    """(aggregate, report, divergence, suspects): flags outlier updates and, if the policy says so, leaves them
    out of the aggregate; divergence is measured for every update against the final aggregate."""
    suspects = find_suspects(updates, policy)
    trusted = [u for u in updates if u.device_id not in suspects]
    excluded = policy.exclude and bool(suspects) and bool(trusted)
    new_weights, report = strategy.aggregate(global_weights, trusted if excluded else updates, evaluate)
    divergence = fleet_divergence({u.device_id: u.weights for u in updates}, new_weights)
    if excluded:
        report["excluded"] = sorted(suspects)
    report["suspects"] = suspects
    return new_weights, report, divergence, suspects


class Coordinator:
    """Runs a fleet's rounds over one MQTT session, persisting each round before announcing the next."""

    def __init__(
        self,
        fleet: str,
        run_id: str,
        session: MqttSession,
        store: RunStore,
        strategy: Strategy,
        evaluator: Evaluator,
        recipe: wire.Recipe,
        policy: RoundPolicy,
        model_name: str = "paper-cnn",
        base_labels: int = 0,
        evaluate_devices: bool = True,
        suspect_policy: SuspectPolicy = SuspectPolicy(),
        bundle_files: Callable[[Weights, str], dict[str, bytes]] | None = None,
        authenticator: UpdateAuthenticator | None = None,
        observer: RoundObserver | None = None,
        dead_devices: Callable[[], set[str]] = set,
        encoder: bytes = b"",
    ) -> None:
        """`bundle_files(weights, hash)` gives the ONNX bundle shipped beside each global model (None: none)."""
        self.fleet = fleet
        self.run_id = run_id
        self.session = session
        self.store = store
        self.strategy = strategy
        self.evaluator = evaluator
        self.recipe = recipe
        self.policy = policy
        self.model_name = model_name
        self.base_labels = base_labels
        self.evaluate_devices = evaluate_devices
        self.suspect_policy = suspect_policy
        self.authenticator = authenticator
        self.observer = observer or RoundObserver()
        self.dead_devices = dead_devices
        self.spec = weight_spec(build_model(model_name))
        self.online: dict[str, wire.Status] = {}
        self.device_labels: dict[str, int] = {}
        self.bundle_files = bundle_files
        self._retained: dict[str, str] = {}
        self.encoder = encoder
        self.participants: list[str] = []
        self.restore_strategy_state()

    def restore_strategy_state(self) -> None:
        """Gives a stateful strategy the state committed with the last round, so a restart continues it."""
        stored = self.store.latest_strategy_state()
        if stored is None:
            return
        if stored.strategy != self.strategy.name:
            raise ValueError(
                f"the run in {self.store.run_dir} holds state of strategy {stored.strategy!r}; "
                f"it cannot resume with {self.strategy.name!r}"
            )
        self.strategy.load_state(stored.state)
        log.info("strategy state restored strategy=%s", stored.strategy)

    def start(self) -> None:
        """Subscribes to every device's updates and status."""
        self.session.subscribe(wire.all_devices_topic(self.fleet, "update"))
        self.session.subscribe(wire.all_devices_topic(self.fleet, "status"))

    def wait_for_devices(self, count: int, timeout: float) -> int:
        """Processes status messages until `count` devices (less those known dead) are online or the timeout passes;
        returns how many are."""
        deadline = time.monotonic() + timeout
        while len(self.online_devices()) < count - len(self.dead_devices()) and time.monotonic() < deadline:
            self.handle_next(collector=None)
        return len(self.online_devices())

    def online_devices(self) -> set[str]:
        """Devices whose last status is anything but 'offline'."""
        return {device for device, status in self.online.items() if status.state != "offline"}

    def run(self, global_weights: Weights, first_round: int, on_round: Callable[[RoundResult], None]) -> Weights:
        """Runs rounds first_round..policy.rounds from `global_weights`; returns the final global model."""
        for round_id in range(first_round, self.policy.rounds + 1):
            global_weights, result = self.run_round(round_id, global_weights)
            on_round(result)
        self.announce(self.policy.rounds, weights_hash(global_weights), final=True)
        return global_weights

    def run_round(self, round_id: int, global_weights: Weights) -> tuple[Weights, RoundResult]:
        """One full round: announce, collect until quorum or deadline, aggregate, evaluate, persist."""
        started_wall, started = time.time(), time.monotonic()
        base_hash = weights_hash(global_weights)
        streamed = StreamedRound(self.strategy, global_weights, self.strategy.begin()) if self.streams() else None
        collector = RoundCollector(
            Expectation(
                round_id,
                base_hash,
                self.spec,
                NUM_CLASSES,
                self.policy.max_update_bytes,
                self.authenticator.check if self.authenticator else None,
                self.strategy.required_metrics,
            ),
            absorb=(lambda update: streamed.absorb(self.client_update(update))) if streamed else None,
        )
        self.participants = choose_participants(
            sorted(self.online_devices()), self.policy.participation, self.recipe.seed, round_id
        )
        self.resume_spooled(collector)
        self.publish_model(global_weights, base_hash)
        self.publish_encoder()
        self.announce(round_id, base_hash)
        self.observer.round_opened(round_id, self.needed(collector))
        self.collect(collector, started)
        # in device order: float sums then do not depend on arrival order, so a resumed round gives the same model
        updates = [self.client_update(collector.accepted[device]) for device in sorted(collector.accepted)]
        aggregation_started = time.monotonic()
        if streamed is None:
            updates = [self.client_update(update) for update in collector.accepted.values()]
            evaluate = self.evaluator.selection_accuracy if self.strategy.needs_evaluation else None
            new_weights, report, divergence, suspects = aggregate_with_suspects(
                self.strategy, global_weights, updates, evaluate, self.suspect_policy
            )
            models: Iterable[ClientUpdate] = updates
        else:
            new_weights, report, suspects = streamed.finish(self.suspect_policy)
            divergence, models = {}, self.spooled_models(collector)
        for device, layers in suspects.items():
            log.warning("suspect update round=%d device=%s layers=%s", round_id, device, ",".join(layers))
        report["aggregation_seconds"] = time.monotonic() - aggregation_started
        if self.participants:
            report["participants"] = list(self.participants)
        scores = self.evaluator.test_scores(new_weights)
        device_scores = {}
        for update in models:
            if streamed is not None:
                divergence[update.device_id] = layer_divergence(update.weights, new_weights)
            if self.evaluate_devices:
                device_scores[update.device_id] = self.evaluator.test_scores(update.weights)
        accuracy = scores.accuracy
        device_accuracy = {device: score.accuracy for device, score in device_scores.items()}
        for update in collector.accepted.values():
            self.device_labels[update.device_id] = update.acquired_labels
        labels = self.base_labels + sum(self.device_labels.values())
        self.persist(
            collector,
            new_weights,
            RoundRecord(
                round_id,
                started_wall,
                time.time(),
                "",
                accuracy,
                labels,
                len(collector.accepted),
                collector.rejection_count,
                report,
                {
                    **self.presence(collector),
                    "class_accuracy": scores.per_class,
                    "device_class_accuracy": {device: score.per_class for device, score in device_scores.items()},
                },
            ),
            device_accuracy,
            divergence,
        )
        result = RoundResult(
            round_id,
            accuracy,
            device_accuracy,
            labels,
            divergence,
            time.monotonic() - started,
            dict(collector.rejected),
            report,
            suspects,
        )
        log.info(
            "round closed round=%d accepted=%d rejected=%d accuracy=%.4f seconds=%.1f",
            round_id,
            len(collector.accepted),
            collector.rejection_count,
            accuracy,
            result.seconds,
        )
        self.observer.round_closed(result)
        return new_weights, result

    def persist(
        self,
        collector: RoundCollector,
        weights: Weights,
        record: RoundRecord,
        device_accuracy: dict[str, float],
        divergence: dict[str, dict[str, float]],
    ) -> None:
        """Checkpoints the new global model, then commits the round, its per-device records and the strategy's
        state in one transaction."""
        record.model_hash = self.store.save_checkpoint(record.round_id, weights)
        state = self.strategy.state()
        strategy_state = None if state is None else StrategyState(self.strategy.name, state)
        self.store.commit_round(
            record,
            [
                DeviceRoundRecord(
                    record.round_id,
                    device,
                    True,
                    "",
                    update.num_samples,
                    list(update.class_counts),
                    device_accuracy.get(device),
                    divergence[device],
                    collector.sizes.get(device, 0),
                    time.time(),
                    update.acquired_labels,
                )
                for device, update in collector.accepted.items()
            ],
            strategy_state,
        )

    def streams(self) -> bool:
        """Whether rounds aggregate as updates arrive: a streaming strategy, and no suspect to leave out first."""
        return self.strategy.streaming and not self.suspect_policy.exclude

    def spooled_models(self, collector: RoundCollector) -> Iterator[ClientUpdate]:
        """The round's accepted updates read back from the spool one at a time (a streamed round keeps none)."""
        for device_id, payload in self.store.iter_spooled_updates(collector.expectation.round_id):
            if device_id in collector.accepted:
                yield self.client_update(wire.decode(payload, wire.Update, max_bytes=self.policy.max_update_bytes))

    def stragglers(self, collector: RoundCollector) -> list[str]:
        """Online devices with no accepted update in this round."""
        return sorted(self.online_devices() - set(collector.accepted))

    def presence(self, collector: RoundCollector) -> dict:
        """The round's quorum and who was missing: online devices that sent nothing, devices known offline."""
        offline = {device for device, status in self.online.items() if status.state == "offline"}
        return {
            "quorum": self.needed(collector),
            "stragglers": self.stragglers(collector),
            "offline": sorted((offline | self.dead_devices()) - set(collector.accepted)),
        }

    def client_update(self, update: wire.Update) -> ClientUpdate:
        """The strategy's view of a validated update."""
        return ClientUpdate(update.device_id, update.tensors, update.num_samples, dict(update.metrics))

    def needed(self, collector: RoundCollector) -> int:
        """How many accepted updates close the round early: the quorum less the devices known dead (a bench's
        crashed agents), else every online device; never fewer than the minimum. With a participant list, never
        more than its length (only participants may send)."""
        if self.participants:
            return min(self.policy.quorum or len(self.participants), len(self.participants))
        if self.policy.quorum is not None:
            lost = len(self.dead_devices() - set(collector.accepted))
            return max(self.policy.min_devices, self.policy.quorum - lost)
        return max(self.policy.min_devices, len(self.online_devices() | set(collector.accepted)))

    def collect(self, collector: RoundCollector, started: float) -> None:
        """Handles messages until the quorum is in, or the deadline passes with at least the minimum."""
        deadline = started + self.policy.round_timeout
        while True:
            have = len(collector.accepted)
            if have >= self.needed(collector):
                return
            if time.monotonic() >= deadline:
                if have >= self.policy.min_devices:
                    log.warning(
                        "round deadline passed round=%d accepted=%d needed=%d stragglers=%s",
                        collector.expectation.round_id,
                        have,
                        self.needed(collector),
                        self.stragglers(collector),
                    )
                    return
                log.warning(
                    "round deadline passed below the minimum round=%d accepted=%d min=%d; waiting longer",
                    collector.expectation.round_id,
                    have,
                    self.policy.min_devices,
                )
                deadline = time.monotonic() + self.policy.round_timeout
            self.handle_next(collector)

    def handle_next(self, collector: RoundCollector | None) -> None:
        """Handles the next message, if one comes within 0.2 s, and only then acknowledges it to the broker:
        an update received but not yet spooled when the process dies is redelivered, not lost."""
        message = self.session.next_message(timeout=0.2)
        if message is not None:
            self.dispatch(message, collector)
            self.session.acknowledge(message)

    def dispatch(self, message: IncomingMessage, collector: RoundCollector | None) -> None:
        """Routes a status or update message; nothing a device sends can raise out of here."""
        try:
            device_id = wire.device_from_topic(message.topic)
        except wire.WireError as error:
            log.warning("message on an unexpected topic topic=%s error=%s", message.topic, error)
            return
        if message.topic.endswith("/status"):
            self.on_status(device_id, message.payload)
        elif message.topic.endswith("/update"):
            self.on_update(device_id, message.payload, collector)

    def on_status(self, device_id: str, payload: bytes) -> None:
        """Tracks presence from retained status messages and last wills."""
        if not payload:
            self.online.pop(device_id, None)
            self.observer.device_status(device_id, None)
            return
        try:
            status = wire.decode(payload, wire.Status)
        except wire.WireError as error:
            log.warning("bad status device=%s error=%s", device_id, error)
            return
        previous = self.online.get(device_id)
        if previous is None or previous.state != status.state:
            log.info("device status device=%s state=%s", device_id, status.state)
        self.online[device_id] = status
        self.observer.device_status(device_id, status)

    def on_update(self, device_id: str, payload: bytes, collector: RoundCollector | None) -> None:
        """Validates, spools and acks an update; a rejection is acked with its reason, logged and counted."""
        if collector is None:
            self.reject(device_id, 0, "", "no round is open", len(payload))
            return
        if self.participants and device_id not in self.participants:
            reason = f"not selected: {device_id} is not a participant of round {collector.expectation.round_id}"
            collector.rejected[device_id] = reason
            self.reject(device_id, collector.expectation.round_id, self.update_id_of(payload), reason, len(payload))
            return
        try:
            update, is_new = collector.offer(device_id, payload)
        except Rejection as rejection:
            collector.reject(device_id, rejection.reason)
            self.reject(
                device_id, collector.expectation.round_id, self.update_id_of(payload), rejection.reason, len(payload)
            )
            return
        if is_new:
            self.store.spool_update(update.round_id, device_id, payload)
            self.observer.update_answered(device_id, update.round_id, len(payload), None)
            log.info("update accepted device=%s round=%d samples=%d", device_id, update.round_id, update.num_samples)
        self.ack(wire.Ack(device_id, update.round_id, update.update_id, True))

    def resume_spooled(self, collector: RoundCollector) -> None:
        """Takes back the updates a previous coordinator process accepted for this round before it died."""
        for device_id, payload in self.store.iter_spooled_updates(collector.expectation.round_id):
            try:
                collector.offer(device_id, payload)
                log.info("resumed spooled update device=%s round=%d", device_id, collector.expectation.round_id)
            except Rejection as rejection:
                log.warning("spooled update no longer valid device=%s reason=%s", device_id, rejection.reason)

    @staticmethod
    def update_id_of(payload: bytes) -> str:
        """The update id of a payload if it can be read at all, for the rejection ack."""
        try:
            return wire.decode(payload, wire.Update).update_id
        except wire.WireError:
            return ""

    def reject(self, device_id: str, round_id: int, update_id: str, reason: str, size: int) -> None:
        """Acks a rejection, counts it in the store and logs it once."""
        log.warning("update rejected device=%s round=%d reason=%s", device_id, round_id, reason)
        self.store.record_rejection(round_id, device_id, reason, size)
        self.observer.update_answered(device_id, round_id, size, reason)
        self.ack(wire.Ack(device_id, round_id, update_id, False, reason))

    def ack(self, ack: wire.Ack) -> None:
        """Publishes an ack on the device's ack topic."""
        self.session.publish(wire.device_topic(self.fleet, ack.device_id, "ack"), wire.encode(ack))

    def publish_model(self, weights: Weights, model_hash: str) -> None:
        """Retains the weights (and their ONNX bundle) on hash topics, clearing the previous model's copies."""
        self.retain_current(
            "model",
            wire.model_topic(self.fleet, model_hash),
            lambda: wire.ModelMessage(model_hash, self.model_name, weights),
        )
        if self.bundle_files is not None:
            self.retain_current(
                "bundle",
                wire.bundle_topic(self.fleet, model_hash),
                lambda: wire.BundleMessage(model_hash, self.bundle_files(weights, model_hash)),
            )

    def retain_current(self, kind: str, topic: str, message: Callable[[], wire.Message]) -> None:
        """Retains one message of a kind on its topic unless it is already there, then clears the kind's previous
        topic, so a new subscriber finds only the current model (retained messages replay to everyone)."""
        previous = self._retained.get(kind)
        if topic == previous:
            return
        self.session.publish(topic, wire.encode(message()), retain=True, wait=30.0)
        if previous is not None:
            self.session.publish(previous, b"", retain=True)
        self._retained[kind] = topic

    def publish_encoder(self) -> None:
        """Retains the recipe's frozen encoder (FAST) on its hash topic, so late devices get it too."""
        if self.recipe.encoder:
            self.retain_current(
                "encoder",
                wire.encoder_topic(self.fleet, self.recipe.encoder),
                lambda: wire.EncoderMessage(self.recipe.encoder, self.encoder),
            )

    def announce(self, round_id: int, model_hash: str, final: bool = False) -> None:
        """Retains the round announcement: round id, base model hash, recipe, deadline, participants."""
        announcement = wire.RoundAnnouncement(
            self.run_id,
            round_id,
            model_hash,
            self.recipe,
            time.time() + self.policy.round_timeout,
            final,
            [] if final else list(self.participants),
        )
        self.session.publish(wire.round_topic(self.fleet), wire.encode(announcement), retain=True, wait=30.0)
        log.info("round announced round=%d model=%s final=%s", round_id, model_hash[:12], final)
