# A cheating secure-aggregation device on its own MQTT connection: the plain device of tests/secagg_attacker.py
# (paho-mqtt + msgpack + `cryptography`, written from the message layouts) answering every stage as it comes, masking
# whatever it is given (no clip, any weight), optionally forging a seed share at unmasking or its view confirmations,
# and able to claim a 17 MiB chunked stage message.
from __future__ import annotations

import hashlib
import queue
import threading

import msgpack
import numpy as np
import paho.mqtt.client as paho
from secagg_attacker import WAIT, PlainDevice, envelope

from protocol.mqtt import BrokerAddress


class SecAggAttacker:
    """One malicious participant of a secure round on `fleet`: `values` is what it masks, by tensor name (the round's
    layout: the trained tensors, `secagg.weight` and `secagg.labels`, already weighted, never clipped); `forge`
    makes it return one altered seed share when asked to unmask, `bad_tags` send random view confirmations, and
    `identity` (a provisioned fleet's secret) signs what it sends. It answers the coordinator's stage messages on paho's thread; an error there is raised by `close`."""

    def __init__(
        self,
        address: BrokerAddress,
        fleet: str,
        device_id: str,
        values: dict[str, np.ndarray],
        forge: bool = False,
        bad_tags: bool = False,
        identity: bytes = b"",
    ) -> None:
        self.fleet, self.device_id = fleet, device_id
        self.device = PlainDevice(device_id, inputs=values, forge=forge, bad_tags=bad_tags, identity=identity)
        self.errors: queue.Queue[Exception] = queue.Queue()
        subscribed = threading.Event()
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=device_id, protocol=paho.MQTTv5)
        self.client.on_message = self.on_message
        self.client.on_connect = lambda client, *_: client.subscribe(f"fl/{fleet}/devices/{device_id}/secagg_in", 1)
        self.client.on_subscribe = lambda *_: subscribed.set()
        self.client.connect(address.host, address.port)
        self.client.loop_start()
        if not subscribed.wait(WAIT):
            raise TimeoutError(f"{device_id} did not subscribe within {WAIT} s")

    @property
    def up(self) -> str:
        """The topic its stage messages go to."""
        return f"fl/{self.fleet}/devices/{self.device_id}/secagg"

    def publish(self, payload: bytes, topic: str | None = None) -> None:
        """One QoS 1 message, waited for (from the test's thread)."""
        self.client.publish(topic or self.up, payload, qos=1).wait_for_publish(WAIT)

    def advertise(self, round_id: int) -> None:
        """Stage 1: its two public keys."""
        self.publish(self.device.advert(round_id))

    def claim_too_large(self, total_bytes: int) -> None:
        """The first chunk of a stage message that claims `total_bytes` (the rest never comes)."""
        digest = hashlib.sha256(b"never sent").hexdigest()
        chunk = envelope(
            "chunk", transfer_id="a" * 32, index=0, count=2, total_bytes=total_bytes, digest=digest, data=b"x" * 1024
        )
        self.publish(chunk, f"{self.up}/chunk/0")

    def on_message(self, client: paho.Client, userdata: object, message: paho.MQTTMessage) -> None:
        """Answers one of the coordinator's stage messages (an error is kept for the test to raise)."""
        try:
            client.publish(self.up, self.device.answer(msgpack.unpackb(message.payload, raw=False)), qos=1)
        except Exception as error:  # reported to the test's thread by close(), not lost in paho's
            self.errors.put(error)

    def close(self) -> None:
        """Disconnects; any error its callbacks met is raised here."""
        self.client.loop_stop()
        self.client.disconnect()
        if not self.errors.empty():
            raise self.errors.get()
