# One thin paho-mqtt session: MQTT v5, persistent session, auto-reconnect, QoS 1, messages too large for the broker
# sent and received in chunks; messages handed to the main loop.
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlparse

import paho.mqtt.client as paho
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from protocol.backlog import Backlog
from protocol.chunks import ChunkingError, Outgoing
from protocol.errors import RefusalError, UsageError
from protocol.messages import RejectionKind
from protocol.reassembly import ChunkLimits, Completed, Dropped, Reassembler
from protocol.topics import CHUNKS

log = logging.getLogger(__name__)

DEFAULT_SESSION_EXPIRY_SECONDS = 3600
DEFAULT_KEEPALIVE_SECONDS = 30
CLOSE_WAIT_SECONDS = 1.0
SWEEP_SECONDS = 1.0


class PayloadTooLargeError(RefusalError, ValueError):
    """A publish that the broker would refuse: paho would otherwise resend it after every reconnect."""

    kind = RejectionKind.TOO_LARGE


class BrokerUnavailableError(UsageError):
    """No connection to the broker within the time allowed: the address a person gave, shown in one line."""


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
    max_packet_bytes: int | None = None

    @property
    def url(self) -> str:
        """The address as a URL, without credentials."""
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"


def parse_broker_url(url: str) -> BrokerAddress:
    """mqtt://[user:pass@]host[:port] or mqtts://...; a UsageError for anything else."""
    parsed = urlparse(url)
    if parsed.scheme not in ("mqtt", "mqtts") or not parsed.hostname:
        raise UsageError(f"broker URL {url!r} must look like mqtt://HOST:PORT or mqtts://HOST:PORT")
    try:
        port = parsed.port or (8883 if parsed.scheme == "mqtts" else 1883)
    # urllib raises ValueError for a port that is no number in 0..65535: the person's URL
    except ValueError:
        raise UsageError(f"broker URL {url!r} has an invalid port") from None
    return BrokerAddress(
        host=parsed.hostname,
        port=port,
        tls=parsed.scheme == "mqtts",
        username=parsed.username,
        password=parsed.password,
    )


@dataclass(frozen=True)
class IncomingMessage:
    """A message as the main loop sees it, copied out of paho's network thread. A chunked message arrives whole, on
    its own topic; a chunked transfer that was refused or abandoned arrives as an empty payload with `dropped` saying
    why (its kind and reason)."""

    topic: str
    payload: bytes
    retain: bool
    mid: int = 0
    qos: int = 0
    dropped: Dropped | None = None


@dataclass(frozen=True)
class LastWill:
    """What the broker publishes for this client if it vanishes without a clean disconnect."""

    topic: str
    payload: bytes
    retain: bool = True


MANUAL_ACK_WINDOW = 16


class Subscriptions:
    """A session's topic filters and their QoS (each with its chunk filter), renewed after every reconnect; paho's
    network thread reads them while the owner's thread changes them."""

    def __init__(self) -> None:
        self._filters: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, topic: str, qos: int) -> list[str]:
        """Notes a subscription; the filters to subscribe to."""
        filters = CHUNKS.with_chunks(topic)
        with self._lock:
            self._filters.update(dict.fromkeys(filters, qos))
        return filters

    def remove(self, topic: str) -> list[str]:
        """Forgets a subscription; the filters to unsubscribe from."""
        filters = CHUNKS.with_chunks(topic)
        with self._lock:
            for name in filters:
                self._filters.pop(name, None)
        return filters

    def items(self) -> list[tuple[str, int]]:
        """Every filter and its QoS."""
        with self._lock:
            return list(self._filters.items())


def publish_all(client: paho.Client, planned: list[tuple[str, bytes, bool]], qos: int, wait: float | None) -> bool:
    """Publishes every (topic, payload, retain) of one message; with `wait`, whether the broker confirmed them all
    within `wait` seconds. A QoS 1 publish while the broker is away is queued, not failed: paho sends it on reconnect
    (and its wait would raise)."""
    infos = [client.publish(topic, payload, qos=qos, retain=retain) for topic, payload, retain in planned]
    for info in infos:
        if qos > 0 and info.rc == paho.MQTT_ERR_NO_CONN:
            info.rc = paho.MQTT_ERR_SUCCESS
    if wait is None:
        return True
    deadline = time.monotonic() + wait
    for info in infos:
        info.wait_for_publish(timeout=max(0.0, deadline - time.monotonic()))
    return all(info.is_published() for info in infos)


class ChunkInbox:
    """The receiving side of chunked transfer for one session: chunks in, whole messages (or dropped transfers) out.
    paho's network thread adds chunks, the owner's thread sweeps out idle transfers: a lock keeps them apart.
    A chunk that only joins a transfer is acknowledged at once; the one that completes (or ends) a transfer is
    acknowledged with the message, by its owner (with manual acks: after handling it)."""

    def __init__(self, limits: ChunkLimits | None) -> None:
        self.reassembler = Reassembler(limits)
        self._lock = threading.Lock()
        self._last_sweep = 0.0

    def deliver(
        self, incoming: IncomingMessage, put: Callable[[IncomingMessage], None], ack: Callable[[IncomingMessage], None]
    ) -> None:
        """Puts a message for the owner: as it is, or, for a chunk, the whole message once it is (else acks it)."""
        if CHUNKS.match(incoming.topic) is None:
            put(incoming)
            return
        whole = self.take(incoming)
        if whole is None:
            ack(incoming)
        else:
            put(whole)

    def take(self, incoming: IncomingMessage) -> IncomingMessage | None:
        """The whole message a chunk completes, its transfer dropped (`dropped` set), or None (held or ignored)."""
        with self._lock:
            result = self.reassembler.add(incoming.topic, incoming.payload, time.monotonic())
        if isinstance(result, Completed):
            return dataclasses.replace(incoming, topic=result.topic, payload=result.payload)
        if isinstance(result, Dropped):
            return self.dropped(result, dataclasses.replace(incoming, topic=result.topic, payload=b""))
        return None

    def sweep(self, put: Callable[[IncomingMessage], None]) -> None:
        """Puts a message for every transfer idle past its timeout, now dropped (looks once every SWEEP_SECONDS)."""
        now = time.monotonic()
        if now - self._last_sweep < SWEEP_SECONDS:
            return
        self._last_sweep = now
        with self._lock:
            expired = self.reassembler.expire(now)
        for drop in expired:
            put(self.dropped(drop, IncomingMessage(drop.topic, b"", False)))

    def forget(self, topic_filter: str) -> None:
        """Drops the unfinished transfers of a subscription that ended."""
        with self._lock:
            self.reassembler.forget(lambda topic: paho.topic_matches_sub(topic_filter, topic))

    def dropped(self, drop: Dropped, message: IncomingMessage) -> IncomingMessage:
        """Logs a dropped transfer; the message that tells the owner (who answers the sender, if it has one to
        answer, and logs the rejection then)."""
        log.info("chunked transfer dropped topic=%s kind=%s: %s", drop.topic[:200], drop.kind, drop.reason)
        return dataclasses.replace(message, dropped=drop)

    def log_stats(self, client_id: str) -> None:
        """One line of what the session's transfers came to (nothing if it had none)."""
        stats = self.reassembler.stats
        if stats.completed or stats.dropped:
            log.info(
                "mqtt chunk transfers client=%s completed=%d dropped=%d reports_suppressed=%d duplicates=%d "
                "ignored=%d peak_reserved_bytes=%d peak_held_bytes=%d",
                *(client_id, stats.completed, stats.dropped, stats.suppressed, stats.duplicates, stats.ignored),
                *(stats.peak_reserved, stats.peak_held),
            )


def paho_client(address: BrokerAddress, client_id: str, manual_ack: bool, last_will: LastWill | None) -> paho.Client:
    """A paho MQTT v5 client with the address's login and TLS, a short reconnect back-off and the last will."""
    client = paho.Client(
        callback_api_version=paho.CallbackAPIVersion.VERSION2,
        client_id=client_id,
        protocol=paho.MQTTv5,
        manual_ack=manual_ack,
    )
    client.reconnect_delay_set(min_delay=1, max_delay=8)
    if address.username is not None:
        client.username_pw_set(address.username, address.password)
    if address.tls:
        client.tls_set(ca_certs=address.ca_file, certfile=address.cert_file, keyfile=address.key_file)
    if last_will is not None:
        client.will_set(last_will.topic, last_will.payload, qos=1, retain=last_will.retain)
    return client


class MqttSession:
    """A persistent MQTT v5 session. Callbacks only enqueue; the owner drains `next_message` on its own thread.

    With `manual_ack`, a QoS 1 message is acknowledged to the broker only when the owner calls `acknowledge`
    after handling it: a process killed between receiving and handling a message gets it again on reconnect.
    The session then also tells the broker (MQTT v5 Receive Maximum) to have at most MANUAL_ACK_WINDOW such
    messages in flight (`ack_window`; the coordinator makes it its group-commit batch), and holds to that itself
    (protocol.backlog), so a burst of large updates waits in the broker rather than in this process's memory.
    Messages too large for the broker go in chunks (`chunking`), and `inbox` puts them together (protocol.reassembly).
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
        chunk_limits: ChunkLimits | None = None,
        ack_window: int = MANUAL_ACK_WINDOW,
    ) -> None:
        self.address = address
        self._ack_window = ack_window
        self.client_id = client_id
        self.max_payload_bytes = max_payload_bytes
        self.chunking = Outgoing(address.max_packet_bytes)
        self.inbox = ChunkInbox(chunk_limits)
        self._manual_ack = manual_ack
        self._keepalive = keepalive
        self._session_expiry = session_expiry
        self._subscriptions = Subscriptions()
        self._connected = threading.Event()
        self._connections = 0
        window = ack_window if manual_ack else None  # (see protocol.backlog: the broker may not hold to it)
        self.backlog: Backlog[IncomingMessage] = Backlog(window, hold_seconds=keepalive / 3)
        self._client = paho_client(address, client_id, manual_ack, last_will)
        self._client.on_connect = self._on_connect
        self._client.on_disconnect = self._on_disconnect
        self._client.on_message = self._on_message
        self._diverted: list[tuple[str, Callable[[IncomingMessage], None]]] = []

    def connect(self, timeout: float = 30.0) -> None:
        """Starts the network thread and waits for the first CONNACK; it reconnects by itself afterwards."""
        properties = Properties(PacketTypes.CONNECT)
        properties.SessionExpiryInterval = self._session_expiry
        if self._manual_ack:
            properties.ReceiveMaximum = self._ack_window
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

    @property
    def connections(self) -> int:
        """How many times the session has connected (each reconnect adds one): an owner that keeps retained messages
        on the broker watches it to publish them again where a broker restarted without its store."""
        return self._connections

    def subscribe(self, topic: str, qos: int = 1) -> None:
        """Subscribes (to the topic and its chunks) now and again after every reconnect."""
        for name in self._subscriptions.add(topic, qos):
            self._client.subscribe(name, qos=qos)

    def divert(self, topic: str, take: Callable[[IncomingMessage], None]) -> None:
        """Subscribes to `topic` (a filter) and hands its whole messages to `take` on paho's network thread instead
        of the owner's queue: a second reader of one session (a device has one login, so one session), which must
        only enqueue. Call it before `connect`."""
        self._diverted.append((topic, take))
        self.subscribe(topic)

    def unsubscribe(self, topic: str) -> None:
        """Stops a subscription (and its chunks) for good, dropping its unfinished transfers."""
        for name in self._subscriptions.remove(topic):
            self._client.unsubscribe(name)
        self.inbox.forget(topic)

    def publish(
        self, topic: str, payload: bytes, retain: bool = False, qos: int = 1, wait: float | None = None
    ) -> bool:
        """Publishes (QoS 1 by default, in chunks if the broker's limit calls for them) after checking the size. With
        `wait`, blocks up to `wait` seconds for the broker's confirmation and returns whether it came; without,
        returns True at once. While the broker is away a QoS 1 message waits in paho's queue for the reconnect."""
        self.check_size(topic, payload)
        try:
            planned = self.chunking.plan(topic, payload, retain)
        except ChunkingError as error:
            raise PayloadTooLargeError(str(error)) from None
        if wait is None:
            return publish_all(self._client, planned, qos, wait)
        with self.backlog.owner_waiting():
            return publish_all(self._client, planned, qos, wait)

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
        """The next received message (idle chunked transfers dropped on the way), or None after `timeout` seconds."""
        self.inbox.sweep(self.backlog.put_now)
        return self.backlog.get(timeout)

    def has_message(self) -> bool:
        """Whether a received message is waiting (a host of many sessions steps only those with one)."""
        return not self.backlog.empty()

    def close(self, timeout: float = CLOSE_WAIT_SECONDS) -> None:
        """Disconnects cleanly (no last will) and stops the network thread, waiting at most `timeout` seconds for it:
        a thread in the middle of a reconnect attempt is left to end with the process, so a stop is never held up."""
        self._connected.clear()
        self.backlog.close()
        self.inbox.log_stats(self.client_id)
        self._client.disconnect()
        stopper = threading.Thread(target=self._client.loop_stop, daemon=True)
        stopper.start()
        stopper.join(timeout)

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log.warning("mqtt connect refused client=%s reason=%s", self.client_id, reason_code)
            return
        for topic, qos in self._subscriptions.items():
            client.subscribe(topic, qos=qos)
        self.chunking.announced = getattr(properties, "MaximumPacketSize", None) if properties else None
        log.info(
            "mqtt connected client=%s broker=%s session_present=%s max_packet_bytes=%s",
            *(self.client_id, self.address.url, flags.session_present, self.chunking.announced),
        )
        self._connections += 1
        self._connected.set()

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        if self._connected.is_set():
            log.warning("mqtt disconnected client=%s reason=%s", self.client_id, reason_code)
        self._connected.clear()

    def _on_message(self, client, userdata, message) -> None:
        got = IncomingMessage(message.topic, bytes(message.payload), bool(message.retain), message.mid, message.qos)
        self.inbox.deliver(got, self._put, self.acknowledge)

    def _put(self, message: IncomingMessage) -> None:
        """A whole message to its reader: a diverted topic's taker, else the owner's queue."""
        for topic, take in self._diverted:
            if paho.topic_matches_sub(topic, message.topic):
                take(message)
                return
        self.backlog.put(message)
