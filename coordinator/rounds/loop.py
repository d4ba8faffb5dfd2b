# The round loop: open a round (announce), collect updates until quorum or deadline, close it, commit, repeat.
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from coordinator.intake.observer import RoundObserver, RoundResult
from coordinator.intake.predictions import PredictionIntake
from coordinator.intake.round_aggregator import RoundAggregator
from coordinator.intake.scratch import TensorScratch
from coordinator.intake.update_intake import RoundCollector, UpdateIntake
from coordinator.intake.validation import Expectation, Rejection
from coordinator.rounds.closing import RoundCloser, RoundTiming, label_shares
from coordinator.rounds.mode import Opening, RoundMode, StagedRound
from coordinator.rounds.presence import Presence
from coordinator.rounds.publisher import RetainedPublisher
from coordinator.rounds.rules import RoundRules, sample_bounds
from coordinator.rounds.serving import ServingKeeper
from coordinator.strategies.contract import Strategy
from protocol import topics
from protocol.messages import RejectionKind
from protocol.mqtt import IncomingMessage, MqttSession
from protocol.supervision import MessageGuard
from protocol.tensors import Weights, spec_of, weights_hash
from protocol.trained_set import trained_set, update_base

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundParts:
    """The coordinator's collaborators: presence, intake, retained publishing, closing, who hears about it, the
    run's round mode (plain unless the assembly chooses another), the serving version's keeper (None: a relay's
    site rounds, which serve nothing) and the guard its device messages are handled under (None: unguarded)."""

    presence: Presence
    intake: UpdateIntake
    publisher: RetainedPublisher
    closer: RoundCloser
    observer: RoundObserver
    mode: RoundMode = field(default_factory=RoundMode)
    serving: ServingKeeper | None = None
    guard: MessageGuard | None = None


@dataclass(frozen=True)
class OpenRound:
    """A round being collected: its collector, its aggregator, the devices chosen to train ([] = all) and its own
    stages if its mode runs some (a secure round)."""

    collector: RoundCollector
    aggregator: RoundAggregator
    participants: list[str]
    staged: StagedRound | None = None


# A device topic's handler: the device id the topic names, the message, the open round (None: none is open).
DeviceHandler = Callable[[str, IncomingMessage, OpenRound | None], None]


def device_routes(
    fleet: str,
    on_update: DeviceHandler,
    on_status: DeviceHandler,
    on_stage: DeviceHandler,
    on_predictions: DeviceHandler,
    on_relayed: DeviceHandler,
) -> topics.Router[DeviceHandler]:
    """What a coordinator takes from its fleet's devices, by topic: their updates, their status, their
    secure-round stage messages, their predictions and those relays pass on from their sites' devices."""
    router: topics.Router[DeviceHandler] = topics.Router()
    router.add(topics.UPDATE.bind(fleet=fleet), on_update)
    router.add(topics.STATUS.bind(fleet=fleet), on_status)
    router.add(topics.SECAGG_UP.bind(fleet=fleet), on_stage)
    router.add(topics.PREDICTIONS.bind(fleet=fleet), on_predictions)
    router.add(topics.RELAYED_PREDICTIONS.bind(fleet=fleet), on_relayed)
    return router


def round_expectation(rules: RoundRules, strategy: Strategy, round_id: int, global_weights: Weights) -> Expectation:
    """What a valid update of this round looks like: the one place the expected layout is derived, as the tensors
    the model spec trains or the class-statistics rule's statistics (`update_base`): what updates carry, validation
    checks and the round aggregates."""
    authenticator = rules.authenticator
    trained = update_base(rules.spec, global_weights, rules.recipe.local_rule)
    return Expectation(
        round_id,
        weights_hash(global_weights),
        spec_of(trained),
        rules.spec.num_classes,
        rules.policy.max_update_bytes,
        authenticator.check if authenticator else None,
        strategy.metric_bounds(rules.spec.num_classes),
        trained,
        *sample_bounds(rules, strategy, round_id),
        rules.relays,
    )


class Coordinator:
    """Runs a fleet's rounds over one MQTT session, committing each round before announcing the next."""

    def __init__(self, fleet: str, session: MqttSession, rules: RoundRules, parts: RoundParts) -> None:
        self.fleet = fleet
        self.session = session
        self.rules = rules
        self.parts = parts
        self.predictions = PredictionIntake(parts.observer, relays=rules.relays)
        self.router = device_routes(
            fleet, self.on_update, self.on_status, self.on_stage, self.on_predictions, self.on_relayed
        )

    def start(self) -> None:
        """Subscribes to every device's updates, status, stage messages and predictions, and publishes the serving
        version."""
        for topic_filter in self.router.filters():
            self.session.subscribe(topic_filter)
        self.refresh_serving()

    def refresh_serving(self) -> None:
        """Decides the rounds committed since at the promotion gate and publishes what serves now."""
        if self.parts.serving is not None:
            self.parts.serving.refresh()

    def wait_for_devices(self, count: int, timeout: float) -> int:
        """Processes status messages until `count` devices (less those known dead) are online or the timeout passes;
        returns how many are."""
        presence = self.parts.presence
        deadline = time.monotonic() + timeout
        while len(presence.online()) < count - len(presence.dead_devices()) and time.monotonic() < deadline:
            self.handle_next(None)
        return len(presence.online())

    def run(self, global_weights: Weights, first_round: int, on_round: Callable[[RoundResult], None]) -> Weights:
        """Runs rounds first_round..policy.rounds from `global_weights` (a private run stops before the round that
        would exceed its budget); returns the final global model."""
        last = self.rules.policy.rounds
        for round_id in range(first_round, self.rules.policy.rounds + 1):
            if self.parts.mode.exhausted(round_id):
                last = round_id - 1
                break
            global_weights, result = self.run_round(round_id, global_weights)
            on_round(result)
        shares = label_shares(self.parts.closer.store)
        self.parts.publisher.announce_final(last, weights_hash(global_weights), self.rules.recipe, shares)
        return global_weights

    def run_round(self, round_id: int, global_weights: Weights) -> tuple[Weights, RoundResult]:
        """One full round: open (announce), collect until quorum or deadline, close (aggregate, evaluate, commit)."""
        timing = RoundTiming(time.time(), time.monotonic())
        with TensorScratch(self.parts.intake.store.spool.folder) as scratch:
            opened = self.open(round_id, global_weights, scratch)
            self.collect(opened, timing)
            presence = self.parts.presence.round_metrics(self.needed(opened), opened.collector.accepted)
            presence.update(opened.staged.metrics() if opened.staged else {})
            new_weights, result = self.parts.closer.close(
                opened.collector, opened.aggregator, timing, presence, opened.participants
            )
        self.parts.mode.committed(result.report)
        self.refresh_serving()
        counts = (len(opened.collector.accepted), opened.collector.rejection_count, result.accuracy, result.seconds)
        log.info("round closed round=%d accepted=%d rejected=%d accuracy=%.4f seconds=%.1f", round_id, *counts)
        self.parts.observer.round_closed(result)
        return new_weights, result

    def open(self, round_id: int, global_weights: Weights, scratch: TensorScratch) -> OpenRound:
        """Takes back what a previous process spooled for the round, retains the model and announces the round
        (`scratch`: where a streamed round keeps its updates' weights until it closes)."""
        rules = self.rules
        strategy = self.parts.closer.strategy
        online = self.online_devices()
        expected = round_expectation(rules, strategy, round_id, global_weights)
        base_hash = expected.base_hash
        mode = self.parts.mode
        head = trained_set(rules.spec, global_weights)
        plan = mode.plan(rules, strategy, Opening(round_id, expected.base, global_weights, scratch, online, head))
        collector = RoundCollector(expected, plan.aggregator.absorb)
        run_id, selected = self.parts.publisher.run_id, plan.participants or online
        staged = mode.staged(rules, run_id, round_id, global_weights, selected)
        opened = OpenRound(collector, plan.aggregator, plan.participants, staged)
        self.parts.intake.resume_spooled(collector)
        self.parts.publisher.publish_model(global_weights, base_hash)
        self.parts.publisher.publish_encoder(rules.recipe.encoder)
        deadline = time.time() + rules.policy.round_timeout
        shares = label_shares(self.parts.closer.store)
        self.parts.publisher.announce(round_id, base_hash, plan.recipe, deadline, plan.participants, shares)
        self.parts.observer.round_opened(round_id, self.needed(opened))
        return opened

    def online_devices(self) -> list[str]:
        """The devices online now, sorted, once as many are as the run's mode waits for (RoundMode.fewest_online)."""
        fewest = self.parts.mode.fewest_online(self.rules)
        while len(self.parts.presence.online()) < fewest:
            self.handle_next(None)
        return sorted(self.parts.presence.online())

    def needed(self, opened: OpenRound) -> int:
        """How many accepted updates close the round early (see Presence.needed)."""
        policy = self.rules.policy
        return self.parts.presence.needed(
            policy.quorum, policy.min_devices, opened.participants, opened.collector.accepted
        )

    def collect(self, opened: OpenRound, timing: RoundTiming) -> None:
        """Handles messages until the quorum is in, or the deadline passes with at least the minimum (a secure round:
        until its stages are done or it is abandoned)."""
        if opened.staged is not None:
            result = opened.staged.collect(lambda: self.handle_next(opened), self.rules.policy.round_timeout)
            opened.staged.conclude(result, opened.collector, opened.aggregator, self.rules.spec)
            return
        collect_until_quorum(self, opened, timing)

    def handle_next(self, opened: OpenRound | None) -> None:
        """Handles the messages waiting (the first within 0.2 s, then up to policy.batch without waiting, stopping at
        the quorum) as one batch: the updates it accepted (or a secure round's state) are made durable with one
        fsync, and only then are the devices acked and the messages acknowledged to the broker, so one received but
        not yet durable when the process dies is redelivered, not lost. Then a person's promote or rollback in the
        store is published (looked for once a second)."""
        batch: list[IncomingMessage] = []
        message = self.session.next_message(timeout=0.2)
        while message is not None:
            self.dispatch(message, opened)
            batch.append(message)
            if len(batch) >= self.rules.policy.batch or (opened and self.quorum_reached(opened)):
                break
            message = self.session.next_message(timeout=0)
        self.parts.intake.commit()
        if opened is not None and opened.staged is not None:
            opened.staged.commit()
        for handled in batch:
            self.session.acknowledge(handled)
        if self.parts.serving is not None:
            self.parts.serving.poll()

    def quorum_reached(self, opened: OpenRound) -> bool:
        """Whether the round has the accepted updates that close it early."""
        return len(opened.collector.accepted) >= self.needed(opened)

    def dispatch(self, message: IncomingMessage, opened: OpenRound | None) -> None:
        """Routes a status or update message; nothing a device sends can raise out of here. Under the run's guard,
        whatever else raises is a bug: counted against the message, and the process exits with its traceback (to be
        restarted); the third time a message does so, it is set aside and named instead of redelivered forever."""
        found = self.router.route(message.topic)
        if found is None:
            log.warning("message on an unexpected topic topic=%s", message.topic[:200])
            return
        handler, parameters = found
        device = parameters["device"]
        if self.parts.guard is None:
            handler(device, message, opened)
            return

        def handled() -> bool:
            handler(device, message, opened)
            return True

        if self.parts.guard.handle(message.topic, message.payload, device, handled) is None:
            reason = f"set aside: its handling failed {self.parts.guard.attempts} times (the log has the traceback)"
            round_id = 0 if opened is None else opened.collector.expectation.round_id
            self.parts.intake.record(device, round_id, Rejection(RejectionKind.SET_ASIDE, reason), len(message.payload))

    def on_status(self, device_id: str, message: IncomingMessage, opened: OpenRound | None) -> None:
        """A device's status (a broken chunked status says nothing)."""
        if message.dropped is None:
            self.parts.presence.on_status(device_id, message.payload)

    def on_predictions(self, device_id: str, message: IncomingMessage, opened: OpenRound | None) -> None:
        """A device's batch of predictions (checked, then counted for the dashboard and /metrics)."""
        self.predictions.on_predictions(device_id, message.payload, message.dropped)

    def on_relayed(self, device_id: str, message: IncomingMessage, opened: OpenRound | None) -> None:
        """A relay's batch of one of its site devices' predictions (checked, then counted as that device's)."""
        self.predictions.on_relayed(device_id, message.payload, message.dropped)

    def on_stage(self, device_id: str, message: IncomingMessage, opened: OpenRound | None) -> None:
        """A device's stage message, for the open round's stages; held by the mode for the next round while no round
        is open (a restarted coordinator reads what was queued for it before it reopens the round it resumes). One that
        came in chunks the session dropped (too large, bad chunks) is counted as a rejection naming its sender."""
        if message.dropped is not None:
            dropped = message.dropped
            log.warning(
                "secure-round message dropped device=%s kind=%s reason=%s", device_id, dropped.kind, dropped.reason
            )
            round_id = opened.collector.round_id if opened is not None else 0
            rejection = Rejection(dropped.kind, dropped.reason)
            self.parts.intake.record(device_id, round_id, rejection, dropped.total_bytes)
        elif opened is None:
            self.parts.mode.hold(device_id, message.payload)
        elif opened.staged is None:
            log.warning("secure-round message outside a secure round device=%s", device_id)
        else:
            opened.staged.on_message(device_id, message.payload)

    def on_update(self, device_id: str, message: IncomingMessage, opened: OpenRound | None) -> None:
        """A device's update (or its chunked transfer, dropped), for the open round if there is one."""
        collector, participants = (opened.collector, opened.participants) if opened else (None, [])
        if opened is not None and opened.staged is not None:
            refusal = Rejection(RejectionKind.WRONG_STAGE, "a plain update in a secure round")
            self.parts.intake.reject(device_id, opened.collector.round_id, refusal, message.payload)
            return
        self.parts.intake.on_update(device_id, message.payload, collector, participants, message.dropped)


def collect_until_quorum(coordinator: Coordinator, opened: OpenRound, timing: RoundTiming) -> None:
    """A plain round's collection: messages until the quorum is in, or the deadline passes with at least the
    minimum (below it, the deadline moves on and the round waits longer)."""
    policy, collector = coordinator.rules.policy, opened.collector
    deadline = timing.monotonic + policy.round_timeout
    while len(collector.accepted) < coordinator.needed(opened):
        if time.monotonic() >= deadline:
            have = len(collector.accepted)
            stragglers = coordinator.parts.presence.stragglers(collector.accepted)
            if have >= policy.min_devices:
                log.warning(
                    "round deadline passed round=%d accepted=%d needed=%d stragglers=%s",
                    *(collector.round_id, have, coordinator.needed(opened), stragglers),
                )
                return
            log.warning(
                "round deadline passed below the minimum round=%d accepted=%d min=%d; waiting longer",
                *(collector.round_id, have, policy.min_devices),
            )
            deadline = time.monotonic() + policy.round_timeout
        coordinator.handle_next(opened)
