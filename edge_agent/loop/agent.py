# The device loop: model in -> acquire labels -> train -> update out, all on the main thread.
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Protocol

from edge_agent.data.device_data import DeviceData
from edge_agent.data.oracle import Oracle
from edge_agent.learning.bundle import Bundle
from edge_agent.learning.predict import ServingModel
from edge_agent.learning.prior_shift import LABEL_SHARES_KEY
from edge_agent.loop.agent_settings import AgentSettings
from edge_agent.loop.artefacts import BUNDLES_FOLDER, RoundArtefacts
from edge_agent.loop.backbone_store import BACKBONE_FOLDER
from edge_agent.loop.footprint import PhaseMeter
from edge_agent.loop.inbound import device_router, handle_inbound
from edge_agent.loop.outbox import OUTBOX_FOLDER, UpdateSender
from edge_agent.loop.prediction_publisher import PredictionPublisher
from edge_agent.loop.round_runner import RoundRunner
from edge_agent.loop.secure_rounds import SecureRounds
from edge_agent.loop.serving import ServingSlot
from protocol import messages, topics, wire
from protocol.model_spec import ModelSpec
from protocol.mqtt import IncomingMessage, LastWill, MqttSession, PayloadTooLargeError
from protocol.prediction_messages import PredictionBatch
from protocol.supervision import LEDGER, SET_ASIDE, Health, MessageGuard
from protocol.tensors import Weights

log = logging.getLogger(__name__)

COORDINATOR = "coordinator"  # who the fleet topics a device reads come from, as its set-aside counts name them

LAST_ROUND_KEY = "last_finished_round"


@dataclass(frozen=True)
class LatestModel:
    """The newest global model a device holds, its spec, the recipe it was announced with, its bundle (if any) and
    its hash (verified when it arrived: whether the bundle is this model's is a comparison, not a rehash)."""

    spec: ModelSpec
    weights: Weights
    recipe: messages.Recipe
    bundle: Bundle | None
    model_hash: str


@dataclass(frozen=True)
class HeldUpdate:
    """A finished round's update (None: the round gave none) that a bench's slow device publishes at `due`."""

    announcement: messages.RoundAnnouncement
    update: messages.Update | None
    due: float


class UpdateHold:
    """Holds a finished round's update until a bench's slow device would have finished it: k times the round's
    compute time (slowdown k > 1; outside the learning path, off by default). It holds the update rather than the
    thread, so devices sharing a host are not slowed with it. The process's first round is not stretched: it pays
    one-off costs (imports, building the learner) that would dominate a short bench."""

    def __init__(self, slowdown: float) -> None:
        self.slowdown = slowdown
        self.held: HeldUpdate | None = None
        self.warm = False

    @property
    def busy(self) -> bool:
        """Whether an update still waits (the device works on nothing else meanwhile)."""
        return self.held is not None

    def keep(
        self, announcement: messages.RoundAnnouncement, update: messages.Update | None, started: float, ended: float
    ) -> None:
        """Holds the update of a round computed from `started` to `ended` (monotonic seconds)."""
        factor = self.slowdown if self.warm else 1.0
        self.warm = True
        self.held = HeldUpdate(announcement, update, started + factor * (ended - started))

    def take_due(self) -> HeldUpdate | None:
        """The held update once its time has come (and no longer held), else None."""
        held = self.held
        if held is None or time.monotonic() < held.due:
            return None
        self.held = None
        return held


class BackgroundWork(Protocol):
    """Work the main loop does between messages (a field device's folder scans, stream scoring and predictions);
    `health` is its supervised parts' (the central labelling link's), which the device's status reports."""

    health: Health

    def tick(self, latest: LatestModel | None, round_id: int, serving: ServingModel | None) -> PredictionBatch | None:
        """Called every loop turn with the newest global model (None before the first), the round worked toward and
        the serving model (None before one serves); returns the predictions it made (None: none)."""


def last_will(settings: AgentSettings) -> LastWill:
    """The retained 'offline' status the broker publishes if the device disappears."""
    offline = messages.Status(settings.device_id, "offline", 0.0, profile=settings.profile)
    return LastWill(topics.STATUS.build(fleet=settings.fleet, device=settings.device_id), wire.encode(offline))


def publish_status(
    session: MqttSession,
    settings: AgentSettings,
    state: str,
    round_id: int,
    labelled: int,
    peak_mb: float,
    health: tuple[int, int] = (0, 0),
) -> None:
    """Retains a device's presence and progress (state, round, labels, peak memory, its parts' restarts and set-aside
    messages) on its status topic."""
    status = messages.Status(
        device_id=settings.device_id,
        state=state,
        timestamp=time.time(),
        round_id=round_id,
        labelled=labelled,
        profile=settings.profile,
        peak_rss_mb=round(peak_mb, 1),
        part_restarts=health[0],
        set_aside=health[1],
    )
    session.publish(
        topics.STATUS.build(fleet=settings.fleet, device=settings.device_id), wire.encode(status), retain=True
    )


def health_counts(health: Health) -> tuple[int, int]:
    """A device's parts' restarts and set-aside messages, as its status reports them."""
    parts, set_aside = health.snapshot()
    return sum(part.restarts for part in parts), sum(set_aside.values())


def log_footprint(meter: PhaseMeter, round_id: int, budget_mb: int | None) -> None:
    """Logs a round's per-phase memory, and a warning when its peak went above the device's budget."""
    meter.log(round_id)
    if budget_mb is not None and meter.overall > budget_mb:
        log.warning("footprint above the memory budget peak_mb=%.1f budget_mb=%d", meter.overall, budget_mb)


class Agent:
    """One device: follows the retained round announcements of its fleet and answers each with one update."""

    def __init__(
        self,
        settings: AgentSettings,
        session: MqttSession,
        data: DeviceData,
        oracle: Oracle,
        background: BackgroundWork | None = None,
    ) -> None:
        self.settings = settings
        self.session = session
        self.data = data
        self.oracle = oracle
        self.background = background
        self.stop_event = threading.Event()
        state_dir = data.state_dir
        self.artefacts = RoundArtefacts(
            session, settings.fleet, state_dir / BUNDLES_FOLDER, state_dir / BACKBONE_FOLDER
        )
        self.serving = ServingSlot(settings.fleet, self.artefacts)
        self.meter = PhaseMeter()
        self.rounds = RoundRunner(settings, data, oracle, self.artefacts, self.publish_status, self.meter)
        self.sender = UpdateSender(settings, session, data.state_dir / OUTBOX_FOLDER)
        self._pending: messages.RoundAnnouncement | None = None
        self._recipe: messages.Recipe | None = None
        self.hold = UpdateHold(settings.slowdown)
        self.secure = SecureRounds(
            settings.fleet, settings.device_id, session, data.state_dir, data.journal, settings.identity
        )
        self.predictions = PredictionPublisher(settings.fleet, settings.device_id, session)
        self.router = agent_router(self)
        self.health = background.health if background is not None else Health()
        self._state, self._reported = "online", (0, 0)
        aside = state_dir / SET_ASIDE
        self.guard = MessageGuard("agent", self.health, aside, ledger=aside / LEDGER)

    @property
    def last_finished_round(self) -> int:
        """The last round this device finished (persisted, so a restart does not redo it; an update in the outbox
        counts as finished even if the process died before noting it)."""
        return max(int(self.data.get_state(LAST_ROUND_KEY, 0)), self.sender.outbox.last_round())

    def run(self) -> None:
        """Serves rounds until stopped, or until the final announcement when exit_on_final is set (a field device:
        the same start, steps and finish a host of many virtual devices drives in turn)."""
        self.start()
        try:
            while not self.stop_event.is_set():
                if self.step(timeout=0.5):
                    return
        finally:
            self.finish()

    def start(self) -> None:
        """Subscribes to the round and ack topics and says the device is online."""
        for topic_filter in self.router.filters():
            self.session.subscribe(topic_filter)
        self.publish_status("online")
        pool, labelled = len(self.data.pool_indices()), self.data.num_labelled
        log.info(
            "agent ready device=%s pool=%d labelled=%d last_round=%d",
            *(self.settings.device_id, pool, labelled, self.last_finished_round),
        )

    def step(self, timeout: float) -> bool:
        """One loop turn: waits up to `timeout` seconds for a message, handles it and every message queued behind
        it (an ack that waited while the device was busy settles its update before the resend timer looks), resends
        due updates, does the background work and runs the pending round if it is ready. True when the run is over
        for this agent."""
        message = self.session.next_message(timeout=timeout)
        self.meter.note("idle")
        while message is not None:
            if self.handle(message):
                return True
            message = self.session.next_message(timeout=0.0)
        self.sender.resend_due()
        self.release_held()
        if self.background is not None:
            serving = self.serving.current()
            made = self.background.tick(self.latest_model(), self.last_finished_round + 1, serving)
            if made is not None and serving is not None and serving.publish_predictions:
                self.predictions.publish(made)
        self.maybe_run_round()
        if health_counts(self.health) != self._reported:
            self.publish_status(self._state)
        return False

    def finish(self) -> None:
        """Says the device is offline (a clean leave: the last will is for vanishing)."""
        self.publish_status("offline")

    def latest_model(self) -> LatestModel | None:
        """The newest global model with its recipe and bundle, once both a model and an announcement arrived."""
        newest = self.artefacts.newest_model()
        if newest is None or self._recipe is None:
            return None
        model_hash, spec, weights = newest
        return LatestModel(spec, weights, self._recipe, next(iter(self.artefacts.bundles.values()), None), model_hash)

    def handle(self, message: IncomingMessage) -> bool:
        """Routes one message under the device's guard; True when the run is over for this agent. Whatever raises is
        a bug: the process exits with its traceback (systemd restarts it), and a message that did so three times
        (a retained one comes again at every start) is set aside instead of crash-looping the device."""
        handled = self.guard.handle(
            message.topic, message.payload, COORDINATOR, lambda: handle_inbound(self.router, message, "fleet")
        )
        return bool(handled)

    def receive(self, kind: str, payload: bytes) -> None:
        """Takes in a followed model, bundle (the latest's or the serving version's), backbone or encoder (its
        decoding counted as the receive phase); the serving version changes once its bundle is in."""
        with self.meter.phase("receive"):
            self.artefacts.receive(kind, payload)
        self.serving.settle()

    def on_announcement(self, announcement: messages.RoundAnnouncement) -> bool:
        """Remembers the newest unfinished round and the fleet's label shares (which the predictions it serves are
        adapted against) and asks for its model; True on the final announcement."""
        if announcement.label_shares:
            self.data.set_state(LABEL_SHARES_KEY, announcement.label_shares)
        if announcement.final:
            log.info("run finished run=%s round=%d", announcement.run_id, announcement.round_id)
            return self.settings.exit_on_final
        if announcement.round_id <= self.last_finished_round:
            log.debug("ignoring finished round %d", announcement.round_id)
            return False
        self._pending, self._recipe = announcement, announcement.recipe
        self.artefacts.follow_round(announcement, self.settings.scores_with_onnxruntime)
        self.secure.on_announcement(announcement)
        return False

    def maybe_run_round(self) -> None:
        """Runs the pending round once everything it needs has arrived (and no slowed update still waits), then
        publishes its update, at once or when a bench's slowdown lets it go."""
        announcement = self._pending
        if self.hold.busy or announcement is None:
            return
        if not self.artefacts.ready(announcement, self.settings.scores_with_onnxruntime):
            return
        self._pending = None
        model_hash, started = announcement.model_hash, time.monotonic()
        update = self.rounds.run(announcement, self.artefacts.specs[model_hash], self.artefacts.models[model_hash])
        self.hold.keep(announcement, update, started, time.monotonic())
        self.release_held()

    def release_held(self) -> None:
        """Publishes the held update once its time has come, journals the round and says the device is idle."""
        held = self.hold.take_due()
        if held is None:
            return
        announcement, update = held.announcement, held.update
        try:
            if update is not None and not self.secure.took(announcement, update, self.artefacts):
                with self.meter.phase("publish"):
                    self.sender.send(update, announcement.recipe.update_compression)
        except (wire.WireError, PayloadTooLargeError) as error:
            log.error(
                "update not sent device=%s round=%d error=%s", self.settings.device_id, announcement.round_id, error
            )
            self.publish_status("error", announcement.round_id)
            return
        self.data.set_state(LAST_ROUND_KEY, announcement.round_id)
        log_footprint(self.meter, announcement.round_id, self.settings.memory_budget_mb)
        self.publish_status("idle", announcement.round_id)

    def publish_status(self, state: str, round_id: int | None = None) -> None:
        """Retained presence and progress for the coordinator and its dashboard."""
        round_id = self.last_finished_round if round_id is None else round_id
        self._state, self._reported = state, health_counts(self.health)
        labelled, peak = self.data.num_labelled, self.meter.overall
        publish_status(self.session, self.settings, state, round_id, labelled, peak, self._reported)


def agent_router(agent: Agent) -> topics.Router:
    """A device's routes: its fleet's round, serving version, models, bundles, backbones and encoders, its acks,
    and its own secure aggregation messages."""
    settings = agent.settings
    router = device_router(
        settings.fleet, settings.device_id, agent.on_announcement, agent.receive, agent.artefacts, agent.sender.on_ack
    )
    router.add(topics.SECAGG_DOWN.bind(fleet=settings.fleet, device=settings.device_id), agent.secure.on_message)
    router.add(topics.SERVING.bind(fleet=settings.fleet), agent.serving.handle)
    return router
