# A relay: runs its site's rounds on the site broker and answers each central round upstream as one signed device
# (under secure aggregation: a secure site round, and the site's mean as the relay's one masked input upstream); it
# passes the central serving version down to its site and its site devices' predictions up.
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

from coordinator.fleet.provision import load_secure_fleet
from coordinator.intake.observer import RoundObserver
from coordinator.intake.predictions import REFUSAL_LOG_SECONDS, PredictionIntake
from coordinator.intake.update_intake import UpdateIntake
from coordinator.rounds.closing import RoundCloser
from coordinator.rounds.evaluation import RoundScores, TestScores
from coordinator.rounds.loop import Coordinator, RoundParts
from coordinator.rounds.mode import RoundMode
from coordinator.rounds.presence import Presence
from coordinator.rounds.publisher import Artefacts, RetainedPublisher
from coordinator.rounds.rules import RoundRules
from coordinator.secure.mode import SecureMode
from coordinator.server import bundle_exporter, coordinator_session, secured
from coordinator.setup.settings import ServerSettings
from coordinator.storage.store import SECURE_WEIGHT, RunStore
from coordinator.strategies.contract import Strategy
from coordinator.strategies.pooled_head import SiteStatistics
from coordinator.strategies.registry import make_strategy
from edge_agent.data.journal import Journal
from edge_agent.loop.agent import last_will
from edge_agent.loop.agent_settings import AgentSettings
from edge_agent.loop.artefacts import SERVING_MODEL, RoundArtefacts
from edge_agent.loop.inbound import device_router, handle_inbound
from edge_agent.loop.outbox import OUTBOX_FOLDER, UpdateSender
from edge_agent.loop.secure_rounds import SecureRounds
from protocol import messages, topics, wire
from protocol.backbone import SHA256_HEX
from protocol.credentials import DeviceIdentity
from protocol.dp import DP_CENTRAL, DP_DEVICE
from protocol.errors import UsageError
from protocol.model_spec import DEFAULT_SPEC, ModelSpec, spec_hash
from protocol.mqtt import BrokerAddress, IncomingMessage, MqttSession
from protocol.prediction_messages import PredictionBatch
from protocol.secagg.weighting import weighted_samples
from protocol.serving_messages import ServingMessage
from protocol.supervision import Health, MessageGuard, SupervisedThread
from protocol.tensors import Weights
from protocol.trained_set import STATISTICS_RULE, trained_set

log = logging.getLogger(__name__)

# The site aggregate must be the sample-weighted mean, so that the central FedAvg of relays equals flat FedAvg.
RELAY_STRATEGY = "fedavg"
RELAY_PROFILE = "relay"
ANSWERED_KEY = "answered_round"
UPSTREAM_SECAGG = "upstream-secagg"  # the run directory's folder of the relay's upstream secure-round state
FORWARD_QUEUE = 64  # site prediction batches waiting to go upstream (each at most 1 MiB); more are dropped
FORWARDER = "prediction-forwarder"  # the part that passes site predictions upstream, as health names it


@dataclass(frozen=True)
class RelaySettings:
    """Who the relay is upstream (a device id of the central fleet and its signing key) and its site: a coordinator's
    settings for the site fleet (run directory, site round policy, site security, bundles, kept updates)."""

    relay_id: str
    fleet: str
    site: ServerSettings
    signing_key: bytes = b""
    identity: DeviceIdentity = field(default_factory=DeviceIdentity)  # upstream: signs its secure-round adverts

    def __post_init__(self) -> None:
        wire.check_identifier("relay id", self.relay_id)
        wire.check_identifier("fleet", self.fleet)
        if self.site.strategy != RELAY_STRATEGY:
            raise ValueError(f"a relay's site rounds use {RELAY_STRATEGY!r}, not {self.site.strategy!r}")

    @property
    def device(self) -> AgentSettings:
        """The relay as a device of the central fleet (its outbox and last will are a device's)."""
        return AgentSettings(
            self.fleet, self.relay_id, profile=RELAY_PROFILE, signing_key=self.signing_key, identity=self.identity
        )


class NoEvaluation:
    """A relay holds no test data: its site rounds score nothing (the central coordinator evaluates)."""

    def test_scores(self, weights: Weights) -> TestScores:
        """No test split: NaN accuracy."""
        return TestScores(float("nan"))

    def round_scores(self, version: int, weights: Weights) -> RoundScores:
        """No test split and no field set: NaN accuracies on no images."""
        return RoundScores(TestScores(float("nan")), TestScores(float("nan")))

    def selection_accuracy(self, weights: Weights) -> float:
        """Never asked: the relay's strategy (FedAvg) chooses no model."""
        raise ValueError("a relay has no selection split")


def is_committed(store: RunStore, round_id: int) -> bool:
    """Whether the relay's store already committed this site round (a restart does not run it again)."""
    return any(record.round_id == round_id for record in store.rounds())


def upstream_update(
    store: RunStore, relay_id: str, round_id: int, base_hash: str, spec: ModelSpec, sample_cap: int = 0
) -> messages.Update:
    """The relay's one update for a central round, from what its site round committed: the site's weighted mean
    (the trained set of the round's checkpoint: head-sized for a frozen backbone, as a device's; under a central
    pooled head, the site's mean class statistics the round committed as its strategy tensors), the labels its
    site acquired so far (cumulative, as a device's), and the devices it sums. A plain site round gives the total
    sample count, the summed class counts and each device with its count (which central validation adds up against
    num_samples). A secure site round knows only sums: its samples are the survivors' summed weight in samples
    (each capped at `sample_cap`, the recipe's --secagg-sample-cap), its survivors are listed with no count of
    their own; such an update is masked upstream (SecureRounds), never sent or validated as it is."""
    record = next(record for record in store.rounds() if record.round_id == round_id)
    site_state = store.strategy_state(round_id)
    if site_state is not None and site_state.strategy == SiteStatistics.name:
        tensors = site_state.tensors
    else:
        tensors = trained_set(spec, store.checkpoints.load(round_id))
    devices = [device for device in store.device_rounds(round_id) if device.accepted]
    counts = [device.num_samples for device in devices]
    secure_weight = record.metrics.get(SECURE_WEIGHT)
    samples = sum(counts) if secure_weight is None else weighted_samples(float(secure_weight), sample_cap)
    return messages.Update(
        device_id=relay_id,
        round_id=round_id,
        update_id=uuid.uuid4().hex,
        base_hash=base_hash,
        num_samples=samples,
        class_counts=[sum(column) for column in zip(*(device.class_counts for device in devices))],
        acquired_labels=record.labels,
        metrics={},
        tensors=tensors,
        nonce=os.urandom(16),
        contributors=[device.device_id for device in devices],
        contributor_samples=counts,
    )


def site_strategy(recipe: messages.Recipe) -> Strategy:
    """A site round's strategy: FedAvg of its devices' models (RELAY_STRATEGY), or under a central pooled head (the
    class-statistics rule) the mean of their statistics (SiteStatistics)."""
    return SiteStatistics() if recipe.local_rule == STATISTICS_RULE else make_strategy(RELAY_STRATEGY)


def refuse_device_dp(announcement: messages.RoundAnnouncement) -> None:
    """A UsageError (one line: the relay stops, exit 2) for a central run with --dp device: each site device would
    add its share of the noise for the central round's participants, and the relay's site mean would divide that
    noise by the site's size, so the aggregate would carry less noise than the accountant counts. Under --dp central
    a relay is one unit: the coordinator clips its site mean and noises the sum."""
    if announcement.recipe.dp == DP_DEVICE:
        raise UsageError(
            f"relays cannot carry --dp {DP_DEVICE}: central run {wire.shown(announcement.run_id)} would be less noised "
            f"than its accountant says; run it with --dp {DP_CENTRAL} (each relay's site one unit) or without relays"
        )


class SiteRounds:
    """The site half: the coordinator's round machinery (intake, spool, closing by site_strategy, retained
    publishing) on the site broker, one site round per central round with the central model and recipe, committed
    in the relay's own store before anything goes upstream; a restarted relay resumes an open site round from its
    spool. A recipe that asks for secure aggregation makes the site round a secure round among the site's devices
    (at least two): the relay learns only the site's sum."""

    def __init__(self, settings: ServerSettings, session: MqttSession, store: RunStore, rules: RoundRules) -> None:
        self.settings = settings
        self.session = session
        self.store = store
        self.rules = rules
        self.closers: dict[str, RoundCloser] = {}
        observer = RoundObserver()
        self.parts = RoundParts(
            presence=Presence(observer),
            intake=UpdateIntake(settings.fleet, session, store, observer),
            publisher=RetainedPublisher(session, settings.fleet, "", Artefacts()),
            closer=self.closer(messages.Recipe()),
            observer=observer,
        )

    def closer(self, recipe: messages.Recipe) -> RoundCloser:
        """The closer of the recipe's site strategy (site_strategy), built once; it restores no state (site
        strategies carry none from round to round)."""
        strategy = site_strategy(recipe)
        if strategy.name not in self.closers:
            closer = RoundCloser(self.store, strategy, NoEvaluation(), False, 0, restore=False)
            self.closers[strategy.name] = closer
        return self.closers[strategy.name]

    def coordinator(self, recipe: messages.Recipe, spec: ModelSpec) -> Coordinator:
        """A site coordinator following the central round's recipe and model spec."""
        rules = dataclasses.replace(self.rules, recipe=recipe, spec=spec)
        mode = RoundMode()
        if recipe.secure_aggregation != "off":
            site = self.settings.secure_dir
            identities = load_secure_fleet(site).identities if site is not None else {}
            mode = SecureMode(mode, self.session, self.settings.fleet, self.parts.intake, identities)
        parts = dataclasses.replace(self.parts, mode=mode, closer=self.closer(recipe))
        return Coordinator(self.settings.fleet, self.session, rules, parts)

    def start(self) -> None:
        """Subscribes to the site devices' updates and status."""
        self.coordinator(messages.Recipe(), DEFAULT_SPEC).start()

    def run_round(
        self, announcement: messages.RoundAnnouncement, weights: Weights, spec: ModelSpec, encoder: bytes
    ) -> None:
        """Runs the site round of a central round (unless already committed): announce the central model on the
        site broker, collect until the site quorum or deadline, aggregate and commit."""
        if is_committed(self.store, announcement.round_id):
            log.info("site round already committed round=%d", announcement.round_id)
            return
        publisher = self.parts.publisher
        publisher.artefacts, publisher.run_id = self.artefacts(spec, encoder), announcement.run_id
        self.coordinator(announcement.recipe, spec).run_round(announcement.round_id, weights)

    def artefacts(self, spec: ModelSpec, encoder: bytes) -> Artefacts:
        """What the site's models travel with: the central spec, the site's own bundle export (which splits off a
        frozen backbone again, retained on the site broker) and the central encoder."""
        bundles = bundle_exporter(dataclasses.replace(self.settings, spec=spec)) if self.settings.ship_bundles else None
        return Artefacts(spec, bundles, encoder)

    def serve(self, message: ServingMessage, spec: ModelSpec, weights: Weights) -> None:
        """Passes the central serving version on to the site's devices: its model and the site's own bundle export
        of it retained on the site broker as the serving version's (a frozen backbone's graphs apart, as a
        coordinator's), then the serving message as the centre sent it (its `publish_predictions` included)."""
        publisher = self.parts.publisher
        publisher.artefacts = self.artefacts(spec, publisher.artefacts.encoder)
        if publisher.artefacts.bundle_files is None:
            log.warning("serving version passed on without a bundle (--no-bundles): the site's devices cannot predict")
        publisher.publish_serving(message, weights)
        log.info("serving version passed on version=%d model=%s", message.version, message.model_hash[:12])

    def finish(self, announcement: messages.RoundAnnouncement) -> None:
        """Passes the central run's end on to the site devices."""
        self.parts.publisher.run_id = announcement.run_id
        self.parts.publisher.announce_final(announcement.round_id, announcement.model_hash, announcement.recipe)


class PredictionForwarder(RoundObserver):
    """The site devices' prediction batches passed on upstream, on a supervised thread of its own (a site round does
    not hold them up). The site session's predictions topics are diverted to a queue of at most FORWARD_QUEUE
    batches (a batch beyond it is dropped); each is checked as the central coordinator checks a device's
    (`PredictionIntake`: decoded within its bound, its columns, bound to the site device its topic names) and
    published on the relay's own relayed-predictions topic upstream (which the device ACL lets the relay write),
    naming its site device, while the upstream session is connected (else dropped: paho would hold it without
    bound). Each site message is acknowledged once it is passed on or dropped. Drops are counted and logged at most
    once a minute; each device's own predictions log keeps every prediction."""

    def __init__(self, fleet: str, relay_id: str, site: MqttSession, upstream: MqttSession, health: Health) -> None:
        super().__init__()
        self.topic = topics.RELAYED_PREDICTIONS.build(fleet=fleet, device=relay_id)
        self.site = site
        self.upstream = upstream
        self.intake = PredictionIntake(self)
        self.guard = MessageGuard(FORWARDER, health, None)
        self.forwarded = 0  # predictions passed on
        self.dropped = 0  # batches dropped
        self._queue: queue.Queue[IncomingMessage] = queue.Queue(maxsize=FORWARD_QUEUE)
        self._pending: IncomingMessage | None = None
        self._lock = threading.Lock()
        self._logged = -math.inf
        self._thread = SupervisedThread(FORWARDER, self._serve, health)

    def open(self, site_fleet: str) -> None:
        """Diverts the site devices' predictions topics to the queue (call it before the site session connects)."""
        self.site.divert(topics.PREDICTIONS.filter(fleet=site_fleet), self.take)

    def start(self) -> None:
        """Starts passing batches on."""
        self._thread.start()

    def close(self) -> None:
        """Stops the thread (the sessions are the relay's)."""
        self._thread.stop()

    def take(self, message: IncomingMessage) -> None:
        """On the site session's network thread: queues a batch, or drops (and acknowledges) it when the queue is
        full."""
        try:
            self._queue.put_nowait(message)
        except queue.Full:
            self.site.acknowledge(message)
            self.drop("the queue to upstream is full")

    def forward(self, device_id: str | None, message: IncomingMessage) -> None:
        """Checks one site message of a device's predictions topic (None: its topic names no device); its batch
        goes upstream through `predictions_received`."""
        if device_id is None:
            self.drop(f"topic {wire.shown(message.topic)} names no device")
            return
        self.intake.on_predictions(device_id, message.payload, message.dropped)

    def predictions_received(self, device_id: str, batch: PredictionBatch) -> None:
        """Publishes a checked batch of a site device upstream (dropped while the upstream broker is away)."""
        if not self.upstream.connected:
            self.drop("the upstream broker is away")
            return
        self.upstream.publish(self.topic, wire.encode(batch))
        with self._lock:
            self.forwarded += len(batch)

    def drop(self, reason: str) -> None:
        """Counts a dropped batch; logs it unless a drop was logged under a minute ago."""
        now = time.monotonic()
        with self._lock:
            self.dropped += 1
            if now - self._logged < REFUSAL_LOG_SECONDS:
                return
            self._logged = now
        log.warning("site predictions dropped batches=%d reason=%s", self.dropped, reason[:200])

    def _serve(self, stop: threading.Event) -> None:
        """The forwarder's thread: each queued message passed on under the guard (one whose handling failed is taken
        again when the loop restarts, and set aside after the guard's attempts), then acknowledged."""
        while not stop.is_set():
            message = self._pending or self._next()
            if message is None:
                continue
            self._pending = message
            found = topics.PREDICTIONS.match(message.topic)
            device = None if found is None else found["device"]
            forward = functools.partial(self.forward, device, message)
            self.guard.handle(message.topic, message.payload, device or "(no device)", forward)
            self._pending = None
            self.site.acknowledge(message)

    def _next(self) -> IncomingMessage | None:
        """The next queued message, or None after a short wait."""
        try:
            return self._queue.get(timeout=0.2)
        except queue.Empty:
            return None


def upstream_secure_rounds(settings: RelaySettings, session: MqttSession) -> SecureRounds:
    """The relay's door to the central fleet's secure rounds, as a device's: its keys, shares and pending masked
    input kept in the run directory's UPSTREAM_SECAGG folder, its journal there."""
    state_dir = settings.site.run_dir / UPSTREAM_SECAGG
    state_dir.mkdir(parents=True, exist_ok=True)
    journal = Journal(state_dir / "journal.json")
    return SecureRounds(settings.fleet, settings.relay_id, session, state_dir, journal, settings.identity)


class Relay:
    """Upstream, one device of the central fleet: follows its announcements and models, answers each round it takes
    part in with its site round's one update through a durable outbox (signed, re-sent until acked), and journals
    the rounds it answered in its store, so a restart neither loses nor repeats an answer. In a secure central run
    the update goes to the relay's SecureRounds instead, masked as one participant's input weighted like a device
    (its site's summed weight, capped at --secagg-sample-cap): the central coordinator learns only the sum over
    relays and direct devices, never one site's sum."""

    def __init__(self, settings: RelaySettings, session: MqttSession, site: SiteRounds, store: RunStore) -> None:
        self.settings = settings
        self.session = session
        self.site = site
        self.store = store
        run_dir = settings.site.run_dir
        self.artefacts = RoundArtefacts(
            session, settings.fleet, run_dir / "upstream-bundles", run_dir / "upstream-backbone"
        )
        self.sender = UpdateSender(settings.device, session, settings.site.run_dir / OUTBOX_FOLDER)
        self.secure = upstream_secure_rounds(settings, session)
        self.pending: messages.RoundAnnouncement | None = None
        self.router = device_router(
            settings.fleet,
            settings.relay_id,
            self.on_announcement,
            self.artefacts.receive,
            self.artefacts,
            self.sender.on_ack,
        )
        self.router.add(topics.SECAGG_DOWN.bind(fleet=settings.fleet, device=settings.relay_id), self.secure.on_message)
        self.router.add(topics.SERVING.bind(fleet=settings.fleet), self.on_serving)
        self.serving: ServingMessage | None = None  # the central serving version whose model is awaited
        self.served: ServingMessage | None = None  # the one passed on to the site last

    @property
    def last_answered_round(self) -> int:
        """The newest central round answered: journalled, or with its update still in the outbox."""
        return max(int((self.store.config() or {}).get(ANSWERED_KEY, 0)), self.sender.outbox.last_round())

    def run(self) -> None:
        """Serves central rounds until the central run's final announcement."""
        fleet, relay_id = self.settings.fleet, self.settings.relay_id
        for topic_filter in self.router.filters():
            self.session.subscribe(topic_filter)
        self.publish_status("online")
        log.info("relay ready relay=%s fleet=%s last_round=%d", relay_id, fleet, self.last_answered_round)
        try:
            while not self.step():
                pass
        finally:
            self.publish_status("offline")

    def step(self) -> bool:
        """One turn of the relay's loop: due updates re-sent, one upstream message handled and only then acknowledged
        to the broker (see `upstream_session`), the pending round answered once its model is in; True on the central
        run's final announcement."""
        self.sender.resend_due()
        message = self.session.next_message(timeout=0.5)
        if message is not None:
            final = self.handle(message)
            self.session.acknowledge(message)
            if final:
                return True
        self.maybe_answer()
        self.maybe_serve()
        return False

    def handle(self, message: IncomingMessage) -> bool:
        """Routes one upstream message; True on the central run's final announcement."""
        return handle_inbound(self.router, message, "upstream")

    def on_announcement(self, announcement: messages.RoundAnnouncement) -> bool:
        """Takes up a central round this relay has not answered and takes part in; True on the final one."""
        bound = (self.store.config() or {}).get("run_id")
        if bound is not None and bound != announcement.run_id:
            log.error("announcement of another run ignored run=%s relay_run=%s", announcement.run_id[:64], bound)
            return False
        if announcement.final:
            self.site.finish(announcement)
            return True
        refuse_device_dp(announcement)
        chosen = not announcement.participants or self.settings.relay_id in announcement.participants
        if announcement.round_id <= self.last_answered_round or not chosen:
            return False
        self.pending = announcement
        self.secure.on_announcement(announcement)
        self.artefacts.follow("model", topics.MODEL.build(fleet=self.settings.fleet, hash=announcement.model_hash))
        if announcement.recipe.encoder:
            self.artefacts.follow(
                "encoder", topics.ENCODER.build(fleet=self.settings.fleet, hash=announcement.recipe.encoder)
            )
        return False

    def on_serving(self, message: IncomingMessage) -> bool:
        """The central serving version (WireError if malformed): its model followed, to be passed on to the site
        once it is in; one the site has already been given, or whose hash is no sha256, is ignored."""
        serving = wire.decode(message.payload, ServingMessage)
        if not SHA256_HEX.fullmatch(serving.model_hash):
            log.warning("ignored serving message model=%s: not a sha256", wire.shown(serving.model_hash))
            return False
        if self.served is not None and same_version(serving, self.served):
            return False
        self.serving = serving
        self.artefacts.follow(SERVING_MODEL, topics.MODEL.build(fleet=self.settings.fleet, hash=serving.model_hash))
        return False

    def maybe_serve(self) -> None:
        """Passes the awaited serving version on to the site once its model arrived."""
        serving = self.serving
        held = None if serving is None else self.artefacts.serving_models.get(serving.model_hash)
        if serving is None or held is None:
            return
        self.serving = None
        self.site.serve(serving, *held)
        self.served = serving

    def maybe_answer(self) -> None:
        """Answers the pending central round once its model (and encoder) arrived."""
        announcement = self.pending
        if announcement is None or not self.artefacts.ready(announcement, needs_bundle=False):
            return
        self.pending = None
        spec = self.artefacts.specs[announcement.model_hash]
        if announcement.spec_hash and spec_hash(spec) != announcement.spec_hash:
            log.error("model spec does not match the announcement round=%d; not answered", announcement.round_id)
            return
        self.answer(announcement, spec)

    def answer(self, announcement: messages.RoundAnnouncement, spec: ModelSpec) -> None:
        """Runs (or takes back) the site round, sends its one update upstream (in a secure run: hands it to be masked
        once the central round's shares are in), journals the round as answered."""
        round_id, model_hash = announcement.round_id, announcement.model_hash
        self.publish_status("training", round_id)
        encoder = self.artefacts.encoders.get(announcement.recipe.encoder, b"")
        self.site.run_round(announcement, self.artefacts.models[model_hash], spec, encoder)
        cap = announcement.recipe.secagg_sample_cap
        update = upstream_update(self.store, self.settings.relay_id, round_id, model_hash, spec, cap)
        if not self.secure.took(announcement, update, self.artefacts):
            self.sender.send(update, announcement.recipe.update_compression)
        log.info(
            "site round sent upstream round=%d devices=%d samples=%d",
            *(round_id, len(update.contributors), update.num_samples),
        )
        journal = {
            "run_id": announcement.run_id,
            ANSWERED_KEY: round_id,
            "settings": {"spec": dataclasses.asdict(spec)},
        }
        self.store.set_config({**(self.store.config() or {}), **journal})
        self.publish_status("idle", round_id)

    def publish_status(self, state: str, round_id: int | None = None) -> None:
        """The relay's retained presence upstream, as a device's."""
        status = messages.Status(
            self.settings.relay_id,
            state,
            time.time(),
            round_id=self.last_answered_round if round_id is None else round_id,
            profile=RELAY_PROFILE,
        )
        topic = topics.STATUS.build(fleet=self.settings.fleet, device=self.settings.relay_id)
        self.session.publish(topic, wire.encode(status), retain=True)


def same_version(one: ServingMessage, other: ServingMessage) -> bool:
    """Whether two serving messages name the same version, model and request for predictions."""
    return (one.version, one.model_hash, one.publish_predictions) == (
        other.version,
        other.model_hash,
        other.publish_predictions,
    )


def upstream_session(settings: RelaySettings, address: BrokerAddress) -> MqttSession:
    """The relay's session on the central broker, as its device's (its last will), with manual acks: the central
    coordinator sends a secure round's roster and share delivery once, and they reach the relay while its site round
    runs; one received but not yet handled when the relay dies is delivered again on restart, not lost."""
    return MqttSession(address, client_id=settings.relay_id, last_will=last_will(settings.device), manual_ack=True)


def run_relay(settings: RelaySettings, upstream: BrokerAddress, site: BrokerAddress) -> None:
    """Connects to the central broker (as the relay's device) and the site broker (as the site's coordinator) and
    relays rounds until the central run ends."""
    store = RunStore(settings.site.run_dir, keep_updates=settings.site.keep_updates)
    site_address, authenticator = secured(settings.site, site, store)
    site_session = coordinator_session(settings.site, site_address)
    central_session = upstream_session(settings, upstream)
    forwarder = PredictionForwarder(settings.fleet, settings.relay_id, site_session, central_session, Health())
    try:
        rules = RoundRules(messages.Recipe(), settings.site.policy, authenticator=authenticator)
        site_rounds = SiteRounds(settings.site, site_session, store, rules)
        forwarder.open(settings.site.fleet)
        site_session.connect()
        central_session.connect()
        site_rounds.start()
        forwarder.start()
        Relay(settings, central_session, site_rounds, store).run()
    finally:
        forwarder.close()
        central_session.close()
        site_session.close()
        store.close()
