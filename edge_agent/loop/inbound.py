# What a device (and a relay, upstream) does with each message from its coordinator, routed by topic pattern: the
# round announcement, the model, bundle, backbone and encoder it follows, the acks of its updates.
from __future__ import annotations

import logging
from collections.abc import Callable

from edge_agent.loop.artefacts import SERVING_MODEL, RoundArtefacts
from protocol import messages, topics, wire
from protocol.mqtt import IncomingMessage

log = logging.getLogger(__name__)

# A route's handler: True when the run is over for the device.
Handler = Callable[[IncomingMessage], bool]
# The artefact topics and the kinds that follow them: a model or bundle topic is the latest model's, the serving
# version's, or both (the same content-addressed topic).
ARTEFACT_TOPICS = (
    (topics.MODEL, ("model", SERVING_MODEL)),
    (topics.BUNDLE, ("bundle", "serving")),
    (topics.BACKBONE, ("backbone",)),
    (topics.ENCODER, ("encoder",)),
)


def device_router(
    fleet: str,
    device_id: str,
    on_announcement: Callable[[messages.RoundAnnouncement], bool],
    receive: Callable[[str, bytes], None],
    artefacts: RoundArtefacts,
    on_ack: Callable[[messages.Ack], None],
) -> topics.Router[Handler]:
    """The routes of a device's inbound messages: its fleet's round and its own acks (subscribed), and the model,
    bundle, backbone and encoder topics (followed by `artefacts`; `receive` takes the kind and payload of one)."""
    router: topics.Router[Handler] = topics.Router()
    router.add(topics.ROUND.bind(fleet=fleet), lambda message: on_announcement(announcement_in(message)))
    router.add(topics.ACK.bind(fleet=fleet, device=device_id), acks_to(on_ack))
    for pattern, kinds in ARTEFACT_TOPICS:
        router.add(pattern.bind(fleet=fleet), artefacts_to(kinds, artefacts, receive), subscribed=False)
    return router


def announcement_in(message: IncomingMessage) -> messages.RoundAnnouncement:
    """The round announcement a message carries (WireError if it is malformed)."""
    return wire.decode(message.payload, messages.RoundAnnouncement)


def acks_to(on_ack: Callable[[messages.Ack], None]) -> Handler:
    """The handler that decodes an ack and hands it on."""

    def handle(message: IncomingMessage) -> bool:
        on_ack(wire.decode(message.payload, messages.Ack))
        return False

    return handle


def artefacts_to(kinds: tuple[str, ...], artefacts: RoundArtefacts, receive: Callable[[str, bytes], None]) -> Handler:
    """The handler that hands on a model, bundle, backbone or encoder as each kind that follows its topic."""

    def handle(message: IncomingMessage) -> bool:
        for kind in kinds:
            if artefacts.follows(kind, message.topic):
                receive(kind, message.payload)
        return False

    return handle


def handle_inbound(router: topics.Router[Handler], message: IncomingMessage, source: str) -> bool:
    """Handles one message by its route; True when the run is over. A message no route takes is ignored, a
    malformed one logged (with `source`, where it came from) and ignored."""
    found = router.route(message.topic)
    if found is None:
        return False
    handler, _ = found
    try:
        return handler(message)
    except wire.WireError as error:
        if message.payload:
            log.warning("ignored bad %s message topic=%s error=%s", source, message.topic[:200], error)
    return False
