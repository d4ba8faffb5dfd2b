# The round loop: open a round (announce), collect updates until quorum or deadline, close it, commit, repeat.
from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from coordinator.intake.authentication import UpdateAuthenticator
from coordinator.intake.observer import RoundObserver, RoundResult
from coordinator.intake.round_aggregator import RoundAggregator, SuspectPolicy, make_aggregator
from coordinator.intake.scratch import TensorScratch
from coordinator.intake.update_intake import RoundCollector, UpdateIntake
from coordinator.intake.validation import Expectation, Rejection
from coordinator.privacy.rounds import PrivateRounds
from coordinator.rounds.closing import RoundCloser, RoundTiming
from coordinator.rounds.presence import Presence
from coordinator.rounds.publisher import RetainedPublisher
from coordinator.secure.rounds import HeldMessages, LiveSecureRound, start_secure
from coordinator.strategies.contract import Strategy
from edge_agent.loop.schedule import labels_by_round
from protocol import messages, topics, wire
from protocol.errors import UsageError
from protocol.messages import RejectionKind
from protocol.model_spec import DEFAULT_SPEC, ModelSpec
from protocol.mqtt import IncomingMessage, MqttSession
from protocol.tensors import Weights, spec_of, weights_hash
from protocol.trained_set import trained_set

log = logging.getLogger(__name__)


DEFAULT_BATCH = 32  # messages handled per group commit at most (also the broker's in-flight window for us)


@dataclass(frozen=True)
class RoundPolicy:
    """When a round may close: the quorum, the minimum and the deadline; and how many messages one group commit of
    the spool takes at most (`batch`)."""

    rounds: int
    min_devices: int = 1
    quorum: int | None = None
    round_timeout: float = 600.0
    max_update_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES
    participation: float = 1.0
    batch: int = DEFAULT_BATCH

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise UsageError(f"--spool-batch must be at least 1, got {self.batch}")
        if not 0.0 < self.participation <= 1.0:
            raise UsageError(f"--participation must lie in (0, 1], got {self.participation}")
        if self.rounds < 1:
            raise UsageError(f"--rounds must be at least 1, got {self.rounds}")
        if self.min_devices < 1:
            raise UsageError(f"--min-devices must be at least 1, got {self.min_devices}")
        if self.quorum is not None and self.quorum < self.min_devices:
            raise UsageError(f"--quorum {self.quorum} is below --min-devices {self.min_devices}")
        if self.round_timeout <= 0:
            raise UsageError(f"--round-timeout must be positive, got {self.round_timeout}")


@dataclass(frozen=True)
class RoundRules:
    """What every round follows: the recipe devices get, when rounds close, how suspects are treated, and who may
    send (None: any device; else signed updates of provisioned devices only), and the model spec (class count).

    For a strategy that weighs by samples: `seed_labels`, the labels a device holds before round 1 (None: unknown,
    so no per-device bound), and `max_sample_share`, the most of a round's weight one device's claim may carry where
    no such bound is known (1: no cap; the command lines default to DEFAULT_MAX_SAMPLE_SHARE)."""

    recipe: messages.Recipe
    policy: RoundPolicy
    suspects: SuspectPolicy = field(default_factory=SuspectPolicy)
    authenticator: UpdateAuthenticator | None = None
    spec: ModelSpec = DEFAULT_SPEC
    seed_labels: int | None = None
    max_sample_share: float = 1.0


@dataclass(frozen=True)
class RoundParts:
    """The coordinator's collaborators: presence, intake, retained publishing, closing, and who hears about it."""

    presence: Presence
    intake: UpdateIntake
    publisher: RetainedPublisher
    closer: RoundCloser
    observer: RoundObserver
    privacy: PrivateRounds | None = None


@dataclass(frozen=True)
class OpenRound:
    """A round being collected: its collector, its aggregator and the devices chosen to train ([] = all)."""

    collector: RoundCollector
    aggregator: RoundAggregator
    participants: list[str]
    secure: LiveSecureRound | None = None


# A device topic's handler: the device id the topic names, the message, the open round (None: none is open).
DeviceHandler = Callable[[str, IncomingMessage, OpenRound | None], None]


def device_routes(
    fleet: str, on_update: DeviceHandler, on_status: DeviceHandler, held: HeldMessages
) -> topics.Router[DeviceHandler]:
    """What a coordinator takes from its fleet's devices, by topic: their updates, their status and their
    secure-round stage messages (taken by the open round's secure part, or `held` for it while no round is open)."""
    router: topics.Router[DeviceHandler] = topics.Router()
    router.add(topics.UPDATE.bind(fleet=fleet), on_update)
    router.add(topics.STATUS.bind(fleet=fleet), on_status)
    router.add(topics.SECAGG_UP.bind(fleet=fleet), functools.partial(on_secagg, held))
    return router


def on_secagg(held: HeldMessages, device_id: str, message: IncomingMessage, opened: OpenRound | None) -> None:
    """A device's secure-round message, for the open secure round; held for the next one while no round is open
    (a restarted coordinator reads what was queued for it before it reopens the round it resumes)."""
    if message.dropped is not None or (opened is not None and opened.secure is None):
        log.warning("secure-round message outside a secure round device=%s", device_id)
    elif opened is None or opened.secure is None:
        held.hold(device_id, message.payload)
    else:
        opened.secure.on_message(device_id, message.payload)


def choose_participants(online: Sequence[str], participation: float, seed: int, round_id: int) -> list[str]:
    """KAFAL's S_t: a seeded random ceil(R*K) of the K online devices, sorted; [] (everyone) when R = 1."""
    if participation >= 1.0 or not online:
        return []
    count = math.ceil(participation * len(online))
    rng = np.random.default_rng([seed, round_id])
    return sorted(rng.choice(sorted(online), size=count, replace=False).tolist())


def sample_bounds(rules: RoundRules, strategy: Strategy, round_id: int) -> tuple[int, int | None]:
    """(fewest, most) samples one device may claim in this round: at least 1 and at most its seeds plus what the
    schedule let it acquire so far when the strategy weighs by samples (no bound where either is unknown)."""
    if not strategy.weighs_by_samples:
        return 0, None
    acquired = labels_by_round(rules.recipe, round_id)
    seeds = rules.seed_labels
    return 1, (None if acquired is None or seeds is None else seeds + acquired)


def round_expectation(rules: RoundRules, strategy: Strategy, round_id: int, global_weights: Weights) -> Expectation:
    """What a valid update of this round looks like: the one place the expected layout is derived, as the tensors
    the model spec trains (`trained_set`): what updates carry, validation checks and the round aggregates."""
    authenticator = rules.authenticator
    trained = trained_set(rules.spec, global_weights)
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
    )


class Coordinator:
    """Runs a fleet's rounds over one MQTT session, committing each round before announcing the next."""

    def __init__(self, fleet: str, session: MqttSession, rules: RoundRules, parts: RoundParts) -> None:
        self.fleet = fleet
        self.session = session
        self.rules = rules
        self.parts = parts
        self.held = HeldMessages()
        self.router = device_routes(fleet, self.on_update, self.on_status, self.held)

    def start(self) -> None:
        """Subscribes to every device's updates and status."""
        for topic_filter in self.router.filters():
            self.session.subscribe(topic_filter)

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
            if self.parts.privacy is not None and self.parts.privacy.exhausted(round_id):
                last = round_id - 1
                break
            global_weights, result = self.run_round(round_id, global_weights)
            on_round(result)
        self.parts.publisher.announce_final(last, weights_hash(global_weights), self.rules.recipe)
        return global_weights

    def run_round(self, round_id: int, global_weights: Weights) -> tuple[Weights, RoundResult]:
        """One full round: open (announce), collect until quorum or deadline, close (aggregate, evaluate, commit)."""
        timing = RoundTiming(time.time(), time.monotonic())
        with TensorScratch(self.parts.intake.store.spool.folder) as scratch:
            opened = self.open(round_id, global_weights, scratch)
            self.collect(opened, timing)
            presence = self.parts.presence.round_metrics(self.needed(opened), opened.collector.accepted)
            presence.update(opened.secure.metrics() if opened.secure else {})
            new_weights, result = self.parts.closer.close(
                opened.collector, opened.aggregator, timing, presence, opened.participants
            )
        if self.parts.privacy is not None:
            self.parts.privacy.committed(result.report["dp"])
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
        aggregator, participants, recipe = round_plan(self, round_id, expected.base, global_weights, scratch, online)
        collector = RoundCollector(expected, aggregator.absorb)
        secure = secure_part(self, round_id, global_weights, participants or online)
        opened = OpenRound(collector, aggregator, participants, secure)
        self.parts.intake.resume_spooled(collector)
        self.parts.publisher.publish_model(global_weights, base_hash)
        self.parts.publisher.publish_encoder(rules.recipe.encoder)
        deadline = time.time() + rules.policy.round_timeout
        self.parts.publisher.announce(round_id, base_hash, recipe, deadline, participants)
        self.parts.observer.round_opened(round_id, self.needed(opened))
        return opened

    def online_devices(self) -> list[str]:
        """The devices online now, sorted; a private round first waits for one (its sample and its noise shares are
        drawn from them, so an empty fleet cannot mean "everyone"), a secure round for --min-devices and at least
        two (its devices are fixed when it opens: those online then)."""
        secure = self.rules.recipe.secure_aggregation != "off"
        fewest = max(self.rules.policy.min_devices, 2) if secure else int(self.parts.privacy is not None)
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
        if opened.secure is not None:
            result = opened.secure.collect(lambda: self.handle_next(opened), self.rules.policy.round_timeout)
            opened.secure.conclude(result, opened.collector, opened.aggregator, self.rules.spec)
            return
        collect_until_quorum(self, opened, timing)

    def handle_next(self, opened: OpenRound | None) -> None:
        """Handles the messages waiting (the first within 0.2 s, then up to policy.batch without waiting, stopping at
        the quorum) as one batch: the updates it accepted (or a secure round's state) are made durable with one
        fsync, and only then are the devices acked and the messages acknowledged to the broker, so one received but
        not yet durable when the process dies is redelivered, not lost."""
        batch: list[IncomingMessage] = []
        message = self.session.next_message(timeout=0.2)
        while message is not None:
            self.dispatch(message, opened)
            batch.append(message)
            if len(batch) >= self.rules.policy.batch or (opened and self.quorum_reached(opened)):
                break
            message = self.session.next_message(timeout=0)
        self.parts.intake.commit()
        if opened is not None and opened.secure is not None:
            opened.secure.commit()
        for handled in batch:
            self.session.acknowledge(handled)

    def quorum_reached(self, opened: OpenRound) -> bool:
        """Whether the round has the accepted updates that close it early."""
        return len(opened.collector.accepted) >= self.needed(opened)

    def dispatch(self, message: IncomingMessage, opened: OpenRound | None) -> None:
        """Routes a status or update message; nothing a device sends can raise out of here."""
        found = self.router.route(message.topic)
        if found is None:
            log.warning("message on an unexpected topic topic=%s", message.topic[:200])
            return
        handler, parameters = found
        handler(parameters["device"], message, opened)

    def on_status(self, device_id: str, message: IncomingMessage, opened: OpenRound | None) -> None:
        """A device's status (a broken chunked status says nothing)."""
        if message.dropped is None:
            self.parts.presence.on_status(device_id, message.payload)

    def on_update(self, device_id: str, message: IncomingMessage, opened: OpenRound | None) -> None:
        """A device's update (or its chunked transfer, dropped), for the open round if there is one."""
        collector, participants = (opened.collector, opened.participants) if opened else (None, [])
        if opened is not None and opened.secure is not None:
            refusal = Rejection(RejectionKind.WRONG_STAGE, "a plain update in a secure round")
            self.parts.intake.reject(device_id, opened.collector.round_id, refusal, message.payload)
            return
        self.parts.intake.on_update(device_id, message.payload, collector, participants, message.dropped)


def round_plan(
    coordinator: Coordinator, round_id: int, base: Weights, model: Weights, scratch: TensorScratch, online: list[str]
) -> tuple[RoundAggregator, list[str], messages.Recipe]:
    """The round's aggregator (over the trained set `base` of the round's `model`), its participants ([] = all)
    and the recipe it announces: the run's own, or a private run's (its Poisson sample, its DP aggregator, the
    clip as adapted so far)."""
    rules, privacy = coordinator.rules, coordinator.parts.privacy
    strategy = coordinator.parts.closer.strategy
    if privacy is not None:
        participants = privacy.participants(online, rules.recipe.seed, round_id)
        private = privacy.aggregator(
            strategy, base, rules.suspects, scratch, (len(online), len(participants)), model=model
        )
        return private, participants, privacy.round_recipe(rules.recipe)
    share = rules.max_sample_share if sample_bounds(rules, strategy, round_id)[1] is None else 1.0
    aggregator = make_aggregator(strategy, base, rules.suspects, scratch, share, model=model)
    participants = choose_participants(online, rules.policy.participation, rules.recipe.seed, round_id)
    return aggregator, participants, rules.recipe


def secure_part(
    coordinator: Coordinator, round_id: int, global_weights: Weights, selected: list[str]
) -> LiveSecureRound | None:
    """A round's secure part when the recipe asks for one, over the `selected` devices (the round's participants,
    else the online ones); resumed if a previous process saved it."""
    rules, parts = coordinator.rules, coordinator.parts
    if rules.recipe.secure_aggregation == "off":
        return None
    args = (parts.publisher.run_id, round_id, selected, global_weights, rules.spec, rules.recipe)
    start = functools.partial(start_secure, *args)
    live = LiveSecureRound.opened(coordinator.session, coordinator.fleet, parts.intake.store, start, round_id)
    coordinator.held.release(live)
    return live


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
