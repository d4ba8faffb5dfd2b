# A device's predictions to its fleet: each batch published on the device's predictions topic, QoS 1 (no torch).
from __future__ import annotations

import dataclasses
import logging

from protocol import topics, wire
from protocol.mqtt import MqttSession, PayloadTooLargeError
from protocol.prediction_messages import PredictionBatch

log = logging.getLogger(__name__)


class PredictionPublisher:
    """Publishes prediction batches on `fl/<fleet>/devices/<id>/predictions` (QoS 1: paho queues them while the
    broker is away). A batch that cannot be sent is logged and dropped: the predictions log keeps it."""

    def __init__(self, fleet: str, device_id: str, session: MqttSession) -> None:
        self.device_id = device_id
        self.session = session
        self.topic = topics.PREDICTIONS.build(fleet=fleet, device=device_id)
        self.published = 0

    def publish(self, batch: PredictionBatch) -> None:
        """Publishes one batch as this device's (its device id set to this device's)."""
        if not len(batch):
            return
        try:
            self.session.publish(self.topic, wire.encode(dataclasses.replace(batch, device_id=self.device_id)), qos=1)
        except (wire.WireError, PayloadTooLargeError) as error:
            log.error("predictions not published count=%d error=%s", len(batch), error)
            return
        self.published += len(batch)
        log.debug("predictions published count=%d total=%d", len(batch), self.published)
