# The Home Assistant bridge: every device's status and predictions in, discovery configs, JSON states and availability
# out (retained, published again after each reconnect), on a supervised thread.
from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence

from coordinator.bridge.home_assistant import (
    OFFLINE,
    ONLINE,
    Camera,
    SensorTopics,
    availability,
    discovery_config,
    encoded,
    prediction_state,
)
from coordinator.intake.observer import RoundObserver
from coordinator.intake.predictions import PredictionIntake
from coordinator.rounds.presence import Presence
from protocol import messages, topics
from protocol.mqtt import BrokerAddress, IncomingMessage, LastWill, MqttSession
from protocol.prediction_messages import PredictionBatch
from protocol.supervision import MessageGuard, SupervisedThread, bounded_name

log = logging.getLogger(__name__)

PART = "ha-bridge"
MAX_CAMERAS = 1000  # sensors the bridge keeps; a device beyond them is refused once in the log, never stored
STOP_PUBLISH_SECONDS = 2.0

Handler = Callable[[str, IncomingMessage], None]


def bridge_session(address: BrokerAddress, where: SensorTopics) -> MqttSession:
    """The bridge's session (client `ha-bridge-<fleet>`), whose last will makes every camera unavailable in Home
    Assistant if the bridge vanishes (its states would no longer follow the devices)."""
    will = LastWill(where.bridge, OFFLINE.encode())
    return MqttSession(address, client_id=f"{PART}-{where.fleet}", last_will=will)


class HaBridge(RoundObserver):
    """Hears the fleet as the coordinator does (devices' statuses through `Presence`, their prediction batches
    through `PredictionIntake`: decoded within its bound, checked, bound to their topic's device, a refusal counted
    and logged at most once a minute per device) and keeps Home Assistant's view of it on the broker, retained: one
    discovery config per camera, its latest prediction as JSON, its availability. Everything it published is kept
    (one payload per topic) and published again after every reconnect, so a broker that restarted without its store
    shows the same sensors. Runs on a SupervisedThread; each message is handled under a MessageGuard (a handler that
    fails is retried when the loop restarts; the third failure sets the message aside, named and counted).

    The devices named as `relays` pass on their site devices' batches: each site device is a camera of its own,
    `relay/device` as the coordinator counts it, available while its relay is (a site device's status stays on its
    site's broker)."""

    def __init__(
        self, session: MqttSession, where: SensorTopics, class_names: Sequence[str] = (), relays: Sequence[str] = ()
    ) -> None:
        super().__init__()
        self.session = session
        self.where = where
        self.presence = Presence(self)
        self.intake = PredictionIntake(self, class_names, relays)
        self.guard = MessageGuard(PART, self.health, None)
        self.router: topics.Router[Handler] = topics.Router()
        self.router.add(topics.STATUS.bind(fleet=where.fleet), self.on_status)
        self.router.add(topics.PREDICTIONS.bind(fleet=where.fleet), self.on_predictions)
        if relays:
            self.router.add(topics.RELAYED_PREDICTIONS.bind(fleet=where.fleet), self.on_relayed)
        self.relays = frozenset(relays)
        self.cameras: dict[str, Camera] = {}
        self.retained: dict[str, bytes] = {}
        self.refused: Counter[str] = Counter()
        self.unbridged = 0
        self._connections = 0
        self._pending: IncomingMessage | None = None
        self._thread = SupervisedThread(PART, self._serve, self.health)

    def start(self) -> HaBridge:
        """Subscribes to every device's status and predictions and starts the thread."""
        for topic_filter in self.router.filters():
            self.session.subscribe(topic_filter)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops the thread and says the bridge is offline (a clean disconnect sends no last will); the session is
        its owner's to close."""
        self._thread.stop()
        self.session.publish(self.where.bridge, OFFLINE.encode(), retain=True, wait=STOP_PUBLISH_SECONDS)
        parts, set_aside = self.health.snapshot()
        log.info(
            "ha bridge stopped fleet=%s cameras=%d refused_batches=%d unbridged=%d set_aside=%d restarts=%d",
            *(self.where.fleet, len(self.cameras), sum(self.refused.values()), self.unbridged),
            *(sum(set_aside.values()), sum(part.restarts for part in parts)),
        )

    def device_status(self, device_id: str, status: messages.Status | None) -> None:
        """A device's status: its camera (its profile the model) and its availability (a cleared status of a device
        never bridged adds no camera)."""
        if status is None and device_id not in self.cameras:
            return
        if self.admit(device_id, profile=None if status is None else status.profile):
            self.publish(self.where.availability(device_id), availability(status).encode())
        if device_id in self.relays:
            for site_device in [name for name in self.cameras if name.startswith(f"{device_id}/")]:
                self.publish(self.where.availability(site_device), availability(status).encode())

    def predictions_received(self, device_id: str, batch: PredictionBatch) -> None:
        """A checked batch: its newest prediction becomes the camera's state (and its serving version the camera's
        software); a camera heard of only through its predictions is online (a relay's site device: as its relay)."""
        state = prediction_state(batch)
        if state is None or not self.admit(device_id, serving_version=batch.serving_version):
            return
        if self.where.availability(device_id) not in self.retained:
            relay = device_id.partition("/")[0] if "/" in device_id else None
            said = None if relay is None else self.retained.get(self.where.availability(relay))
            self.publish(self.where.availability(device_id), said or ONLINE.encode())
        self.publish(self.where.state(device_id), encoded(state))

    def predictions_refused(self, device_id: str) -> None:
        """Counts a refused batch by its device (bounded: devices beyond the first named are counted together)."""
        self.refused[bounded_name(set(self.refused), device_id)] += 1

    def admit(self, device_id: str, profile: str | None = None, serving_version: int | None = None) -> bool:
        """Updates the device's camera with what is now known of it (None: unchanged), adding it while fewer than
        MAX_CAMERAS are kept, and publishes its discovery config if that changed; False for a device beyond the
        bound (counted; the first one logged)."""
        camera = self.cameras.get(device_id)
        if camera is None and len(self.cameras) >= MAX_CAMERAS:
            if not self.unbridged:
                log.warning("camera not bridged device=%s: %d cameras are the most kept", device_id, MAX_CAMERAS)
            self.unbridged += 1
            return False
        camera = Camera(device_id) if camera is None else camera
        self.cameras[device_id] = camera = Camera(
            device_id,
            camera.profile if profile is None else profile,
            camera.serving_version if serving_version is None else serving_version,
        )
        self.publish(self.where.discovery(device_id), encoded(discovery_config(self.where, camera)))
        return True

    def publish(self, topic: str, payload: bytes) -> None:
        """Publishes a retained message unless the same payload is on its topic already, and keeps it."""
        if self.retained.get(topic) == payload:
            return
        self.retained[topic] = payload
        self.session.publish(topic, payload, retain=True)

    def republish(self) -> None:
        """After a (re)connect: the bridge online, then every retained message again (a broker that restarted without
        its store has lost them; one that kept them replaces each with itself)."""
        self.session.publish(self.where.bridge, ONLINE.encode(), retain=True)
        for topic, payload in self.retained.items():
            self.session.publish(topic, payload, retain=True)
        log.info("ha bridge connected fleet=%s republished=%d", self.where.fleet, len(self.retained))

    def on_status(self, device_id: str, message: IncomingMessage) -> None:
        """A device's status or last will (a broken chunked status says nothing)."""
        if message.dropped is None:
            self.presence.on_status(device_id, message.payload)

    def on_predictions(self, device_id: str, message: IncomingMessage) -> None:
        """A device's batch of predictions, through the intake's checks."""
        self.intake.on_predictions(device_id, message.payload, message.dropped)

    def on_relayed(self, relay_id: str, message: IncomingMessage) -> None:
        """A relay's batch of one of its site devices' predictions, through the intake's checks."""
        self.intake.on_relayed(relay_id, message.payload, message.dropped)

    def _serve(self, stop: threading.Event) -> None:
        """The bridge's loop: after each (re)connect everything republished, then messages as they come (one whose
        handler failed first, when the loop restarts)."""
        while not stop.is_set():
            if self.session.connections != self._connections:
                self._connections = self.session.connections
                self.republish()
            message = self._pending or self.session.next_message(timeout=0.2)
            if message is not None:
                self._pending = message
                self._handle(message)
                self._pending = None

    def _handle(self, message: IncomingMessage) -> None:
        """Routes one message to its handler under the guard."""
        found = self.router.route(message.topic)
        if found is None:
            log.warning("message on an unexpected topic topic=%s", message.topic[:200])
            return
        handler, values = found
        device = values["device"]
        self.guard.handle(message.topic, message.payload, device, lambda: handler(device, message))
