# One thin paho-mqtt session: MQTT v5, persistent session, auto-reconnect, QoS 1; messages handed to the main loop.
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from urllib.parse import urlparse

import paho.mqtt.client as paho
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

log = logging.getLogger(__name__)

DEFAULT_SESSION_EXPIRY_SECONDS = 3600
DEFAULT_KEEPALIVE_SECONDS = 30
CLOSE_WAIT_SECONDS = 1.0


class PayloadTooLargeError(ValueError):
    """A publish that the broker would refuse: paho would otherwise resend it after every reconnect."""


class BrokerUnavailableError(ConnectionError):
    """No connection to the broker within the time allowed."""


@dataclass(frozen=True)
class BrokerAddress:
    """Where the broker is and how to authenticate: parsed from mqtt://host:port or mqtts://host:port."""

    host: str
    port: int
    tls: bool = False
    username: str | None = None
    password: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    @property
    def url(self) -> str:
        """The address as a URL, without credentials."""
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"


def parse_broker_url(url: str) -> BrokerAddress:
    """mqtt://[user:pass@]host[:port] or mqtts://...; a clear ValueError for anything else."""
    parsed = urlparse(url)
    if parsed.scheme not in ("mqtt", "mqtts") or not parsed.hostname:
        raise ValueError(f"broker URL {url!r} must look like mqtt://HOST:PORT or mqtts://HOST:PORT")
    try:
        port = parsed.port or (8883 if parsed.scheme == "mqtts" else 1883)
    except ValueError:
        raise ValueError(f"broker URL {url!r} has an invalid port") from None
    return BrokerAddress(
        host=parsed.hostname,
        port=port,
        tls=parsed.scheme == "mqtts",
        username=parsed.username,
        password=parsed.password,
    )


@dataclass(frozen=True)
class IncomingMessage:
    """A message as the main loop sees it, copied out of paho's network thread."""

    topic: str
    payload: bytes
    retain: bool
    mid: int = 0
    qos: int = 0


@dataclass(frozen=True)
class LastWill:
    """What the broker publishes for this client if it vanishes without a clean disconnect."""

    topic: str
    payload: bytes
    retain: bool = True


MANUAL_ACK_WINDOW = 16


class MqttSession:
    """A persistent MQTT v5 session. Callbacks only enqueue; the owner drains `next_message` on its own thread.

    With `manual_ack`, a QoS 1 message is acknowledged to the broker only when the owner calls `acknowledge`
    after handling it: a process killed between receiving and handling a message gets it again on reconnect.
    The session then also tells the broker (MQTT v5 Receive Maximum) to have at most MANUAL_ACK_WINDOW such
    messages in flight, so a burst of large updates waits in the broker rather than in this process's memory.
    """

    def __init__(
        self,
        address: BrokerAddress,
        client_id: str,
        last_will: LastWill | None = None,
        keepalive: int = DEFAULT_KEEPALIVE_SECONDS,
        session_expiry: int = DEFAULT_SESSION_EXPIRY_SECONDS,
        max_payload_bytes: int | None = None,
        manual_ack: bool = False,
    ) -> None:
        self.address = address
        self.client_id = client_id
        self.max_payload_bytes = max_payload_bytes
        self._manual_ack = manual_ack
        self._keepalive = keepalive
        self._session_expiry = session_expiry
        self._subscriptions: dict[str, int] = {}
        self._lock = threading.Lock()
        self._connected = threading.Event()
        self._messages: queue.Queue[IncomingMessage] = queue.Queue()
        self._client = paho.Client(
            callback_api_version=paho.CallbackAPIVersion.VERSION2,
            client_id=client_id,
            protocol=paho.MQTTv5,
            manual_ack=manual_ack,
        )
        self._client.reconnect_delay_set(min_delay=1, max_delay=8)
        if address.username is not None:
            self._client.username_pw_set(address.username, address.password)
        if address.tls:
            self._client.tls_set(ca_certs=address.ca_file, certfile=address.cert_file, keyfile=address.key_file)
        if last_will is not None:
            self._client.will_set(last_will.topic, last_will.payload, qos=1, retain=last_will.retain)
        self._client.on_connect = self._on_connect
        self._client.on_disconnect = self._on_disconnect
        self._client.on_message = self._on_message

    def connect(self, timeout: float = 30.0) -> None:
        """Starts the network thread and waits for the first CONNACK; it reconnects by itself afterwards."""
        properties = Properties(PacketTypes.CONNECT)
        properties.SessionExpiryInterval = self._session_expiry
        if self._manual_ack:
            properties.ReceiveMaximum = MANUAL_ACK_WINDOW
        self._client.connect_async(
            self.address.host,
            self.address.port,
            keepalive=self._keepalive,
            clean_start=False,
            properties=properties,
        )
        self._client.loop_start()
        log.info("mqtt connecting client=%s broker=%s", self.client_id, self.address.url)
        if not self._connected.wait(timeout):
            self._client.loop_stop()
            raise BrokerUnavailableError(f"no connection to the broker at {self.address.url} within {timeout:.0f}s")

    @property
    def connected(self) -> bool:
        """Whether the session is connected right now."""
        return self._connected.is_set()

    def subscribe(self, topic: str, qos: int = 1) -> None:
        """Subscribes now and again after every reconnect."""
        with self._lock:
            self._subscriptions[topic] = qos
        self._client.subscribe(topic, qos=qos)

    def unsubscribe(self, topic: str) -> None:
        """Stops a subscription for good."""
        with self._lock:
            self._subscriptions.pop(topic, None)
        self._client.unsubscribe(topic)

    def publish(
        self, topic: str, payload: bytes, retain: bool = False, qos: int = 1, wait: float | None = None
    ) -> bool:
        """Publishes (QoS 1 by default) after checking the size. With `wait`, blocks up to `wait` seconds for the
        broker's confirmation and returns whether it came; without, returns True at once. While the broker is away
        a QoS 1 message waits in paho's queue and goes out on reconnect."""
        self.check_size(topic, payload)
        info = self._client.publish(topic, payload, qos=qos, retain=retain)
        if qos > 0 and info.rc == paho.MQTT_ERR_NO_CONN:
            info.rc = paho.MQTT_ERR_SUCCESS  # queued, not failed: paho sends it on reconnect (its wait would raise)
        if wait is None:
            return True
        info.wait_for_publish(timeout=wait)
        return info.is_published()

    def check_size(self, topic: str, payload: bytes) -> None:
        """PayloadTooLargeError if the payload exceeds this session's limit (checked before anything keeps it)."""
        if self.max_payload_bytes is not None and len(payload) > self.max_payload_bytes:
            raise PayloadTooLargeError(
                f"payload of {len(payload)} bytes for {topic} exceeds the limit of {self.max_payload_bytes}"
            )

    def acknowledge(self, message: IncomingMessage) -> None:
        """Acknowledges a handled QoS 1 message to the broker (only needed, and only sent, with manual_ack)."""
        if message.qos > 0:
            self._client.ack(message.mid, message.qos)

    def next_message(self, timeout: float | None = None) -> IncomingMessage | None:
        """The next received message, or None after `timeout` seconds."""
        try:
            return self._messages.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self, timeout: float = CLOSE_WAIT_SECONDS) -> None:
        """Disconnects cleanly (no last will) and stops the network thread, waiting at most `timeout` seconds for it:
        a thread in the middle of a reconnect attempt is left to end with the process, so a stop is never held up."""
        self._connected.clear()
        self._client.disconnect()
        stopper = threading.Thread(target=self._client.loop_stop, daemon=True)
        stopper.start()
        stopper.join(timeout)

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log.warning("mqtt connect refused client=%s reason=%s", self.client_id, reason_code)
            return
        with self._lock:
            subscriptions = list(self._subscriptions.items())
        for topic, qos in subscriptions:
            client.subscribe(topic, qos=qos)
        log.info(
            "mqtt connected client=%s broker=%s session_present=%s",
            self.client_id,
            self.address.url,
            flags.session_present,
        )
        self._connected.set()

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        if self._connected.is_set():
            log.warning("mqtt disconnected client=%s reason=%s", self.client_id, reason_code)
        self._connected.clear()

    def _on_message(self, client, userdata, message) -> None:
        self._messages.put(
            IncomingMessage(message.topic, bytes(message.payload), bool(message.retain), message.mid, message.qos)
        )
