# Tests for protocol.mqtt against a real mosquitto started per test on a free loopback port.
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from coordinator.fleet.broker import EmbeddedBroker, port_is_free
from protocol.mqtt import (
    BrokerAddress,
    IncomingMessage,
    LastWill,
    MqttSession,
    PayloadTooLargeError,
    parse_broker_url,
)

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
WAIT = 10.0  # upper bound for anything to arrive; the tests return as soon as it does


def receive(session: MqttSession, timeout: float = WAIT) -> IncomingMessage:
    message = session.next_message(timeout=timeout)
    assert message is not None, f"{session.client_id} received nothing within {timeout}s"
    return message


def sync(session: MqttSession, topic: str, marker: bytes = b"sync-marker") -> list[IncomingMessage]:
    """Publishes a marker on `topic` from `session` itself and waits for it to come back.

    The broker handles one client's packets in order, so once the marker is back, the session's earlier
    subscriptions are in place and everything the broker had for it before the marker has arrived.
    Returns the messages that arrived before the marker.
    """
    session.publish(topic, marker, wait=WAIT)
    before = []
    while True:
        message = receive(session)
        if message.payload == marker:
            return before
        before.append(message)


def subscribe(session: MqttSession, topic: str) -> None:
    session.subscribe(topic, qos=1)
    assert sync(session, topic) == []


# --- basic delivery ----------------------------------------------------------------------------------------------


def test_two_sessions_exchange_qos1_messages(broker, sessions):
    alice = sessions(broker.address, "alice")
    bob = sessions(broker.address, "bob")
    subscribe(alice, "t/to-alice")
    subscribe(bob, "t/to-bob")
    alice.publish("t/to-bob", b"hello bob \x00\xff", qos=1, wait=WAIT)
    got = receive(bob)
    assert (got.topic, got.payload, got.retain) == ("t/to-bob", b"hello bob \x00\xff", False)
    bob.publish("t/to-alice", b"hello alice", qos=1, wait=WAIT)
    got = receive(alice)
    assert (got.topic, got.payload) == ("t/to-alice", b"hello alice")
    assert alice.connected and bob.connected


def test_retained_message_reaches_a_later_subscriber(broker, sessions):
    publisher = sessions(broker.address, "publisher")
    publisher.publish("fl/f/round", b"round-3", retain=True, wait=WAIT)
    late = sessions(broker.address, "late")
    late.subscribe("fl/f/round")
    got = receive(late)
    assert (got.topic, got.payload, got.retain) == ("fl/f/round", b"round-3", True)


def test_cleared_retained_message_is_not_replayed(broker, sessions):
    publisher = sessions(broker.address, "publisher")
    publisher.publish("fl/f/model/old", b"weights", retain=True, wait=WAIT)
    publisher.publish("fl/f/model/old", b"", retain=True, wait=WAIT)
    late = sessions(broker.address, "late")
    late.subscribe("fl/f/model/old")
    assert sync(late, "fl/f/model/old") == []


def test_publish_over_the_limit_raises_before_sending(broker, sessions):
    listener = sessions(broker.address, "listener")
    subscribe(listener, "t/big")
    sender = sessions(broker.address, "sender", max_payload_bytes=16)
    with pytest.raises(PayloadTooLargeError, match="payload of 17 bytes for t/big exceeds the limit of 16"):
        sender.publish("t/big", b"x" * 17, wait=WAIT)
    sender.publish("t/big", b"y" * 16, wait=WAIT)  # exactly at the limit goes out
    got = receive(listener)
    assert got.payload == b"y" * 16  # the first thing the broker delivered: the big one never left
    assert issubclass(PayloadTooLargeError, ValueError)


# --- last will ---------------------------------------------------------------------------------------------------

DOOMED_CLIENT = textwrap.dedent("""
    import os, signal, sys
    from protocol.mqtt import BrokerAddress, LastWill, MqttSession
    session = MqttSession(BrokerAddress("127.0.0.1", int(sys.argv[1])), client_id="doomed",
                          last_will=LastWill("fl/f/devices/doomed/status", b"offline-will"))
    session.connect(timeout=10)
    print("connected", flush=True)
    sys.stdin.readline()
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_last_will_is_published_when_the_client_process_dies(broker, sessions):
    topic = "fl/f/devices/doomed/status"
    watcher = sessions(broker.address, "watcher")
    subscribe(watcher, topic)
    child = subprocess.Popen(
        [sys.executable, "-c", DOOMED_CLIENT, str(broker.port)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert child.stdout.readline() == b"connected\n", child.stderr.read().decode()
        assert sync(watcher, topic, b"while-alive") == []  # no will while the client lives
        child.stdin.write(b"die\n")
        child.stdin.flush()
        assert child.wait(timeout=WAIT) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for stream in (child.stdin, child.stdout, child.stderr):
            stream.close()
    got = receive(watcher)
    assert (got.topic, got.payload) == (topic, b"offline-will")
    # the will is retained: a device that looks later still sees the client as offline
    later = sessions(broker.address, "later")
    later.subscribe(topic)
    got = receive(later)
    assert (got.payload, got.retain) == (b"offline-will", True)


def test_clean_close_does_not_publish_the_last_will(broker, sessions):
    topic = "fl/f/devices/polite/status"
    watcher = sessions(broker.address, "watcher")
    subscribe(watcher, topic)
    polite = MqttSession(broker.address, client_id="polite", last_will=LastWill(topic, b"offline-will"))
    polite.connect(timeout=WAIT)
    polite.close()
    # a fresh connection with the same id: the broker has processed the first one's end before accepting it
    sessions(broker.address, "polite")
    assert sync(watcher, topic, b"after-close") == []


# --- broker URLs -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url, expected",
    [
        ("mqtt://h:1", BrokerAddress("h", 1, tls=False)),
        ("mqtt://broker.local", BrokerAddress("broker.local", 1883, tls=False)),
        ("mqtts://h", BrokerAddress("h", 8883, tls=True)),
        ("mqtts://h:9999", BrokerAddress("h", 9999, tls=True)),
        ("mqtt://user:pass@h:1884", BrokerAddress("h", 1884, username="user", password="pass")),
        (
            "mqtts://dev-1:s3cret@10.0.0.2",
            BrokerAddress("10.0.0.2", 8883, tls=True, username="dev-1", password="s3cret"),
        ),
    ],
)
def test_parse_broker_url_accepts(url, expected):
    assert parse_broker_url(url) == expected


def test_address_url_drops_credentials():
    assert parse_broker_url("mqtts://user:pass@h:1884").url == "mqtts://h:1884"


@pytest.mark.parametrize(
    "url, fragment",
    [
        ("http://x", "must look like mqtt://HOST:PORT"),
        ("mqtt://", "must look like mqtt://HOST:PORT"),
        ("h:1883", "must look like mqtt://HOST:PORT"),
        ("mqtt://h:notaport", "invalid port"),
        ("mqtt://h:70000", "invalid port"),
    ],
)
def test_parse_broker_url_rejects(url, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_broker_url(url)


# --- persistent sessions and reconnects --------------------------------------------------------------------------


def test_persistent_session_keeps_messages_queued_while_disconnected(broker, sessions):
    device = MqttSession(broker.address, client_id="device-7")
    device.connect(timeout=WAIT)
    subscribe(device, "fl/f/devices/device-7/ack")
    device.close()
    coordinator = sessions(broker.address, "coordinator")
    for i in range(3):
        coordinator.publish("fl/f/devices/device-7/ack", f"ack-{i}".encode(), qos=1, wait=WAIT)
    back = sessions(broker.address, "device-7")  # same client id, no new subscription
    assert [receive(back).payload for _ in range(3)] == [b"ack-0", b"ack-1", b"ack-2"]


def test_without_session_expiry_queued_messages_are_lost(broker, sessions):
    # the control for the test above: it is the Session Expiry Interval that keeps them
    device = MqttSession(broker.address, client_id="device-8", session_expiry=0)
    device.connect(timeout=WAIT)
    subscribe(device, "fl/f/devices/device-8/ack")
    device.close()
    coordinator = sessions(broker.address, "coordinator")
    coordinator.publish("fl/f/devices/device-8/ack", b"lost", qos=1, wait=WAIT)
    back = sessions(broker.address, "device-8", session_expiry=0)
    back.subscribe("fl/f/devices/device-8/ack")
    assert sync(back, "fl/f/devices/device-8/ack") == []


def wait_until(condition, timeout: float = WAIT) -> bool:
    """Polls a condition that has no event to await (paho's connection state), up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def test_session_reconnects_by_itself_after_a_broker_restart(tmp_path, sessions):
    work_dir = tmp_path / "broker"
    first = EmbeddedBroker(work_dir).start()
    try:
        device = sessions(first.address, "device-9")
        subscribe(device, "fl/f/round")
    finally:
        first.stop()
    assert wait_until(lambda: not device.connected), "the session did not notice the broker going away"
    with EmbeddedBroker(work_dir, port=first.port) as second:
        assert wait_until(lambda: device.connected), "the session did not reconnect by itself"
        sync(device, "fl/f/round", b"device-is-back")  # its subscription is in place again
        coordinator = sessions(second.address, "coordinator")
        coordinator.publish("fl/f/round", b"after-restart", qos=1, wait=WAIT)
        got = receive(device)
        assert (got.topic, got.payload) == ("fl/f/round", b"after-restart")


def test_broker_restart_keeps_sessions_and_queued_messages(tmp_path, sessions):
    # the embedded broker promises on-disk persistence: a device's session and the QoS 1 messages queued
    # for it while it is away survive a broker restart
    work_dir = tmp_path / "broker"
    first = EmbeddedBroker(work_dir).start()
    try:
        device = MqttSession(first.address, client_id="device-10")
        device.connect(timeout=WAIT)
        subscribe(device, "fl/f/devices/device-10/ack")
        device.close()
        coordinator = sessions(first.address, "coordinator")
        coordinator.publish("fl/f/devices/device-10/ack", b"queued-before-restart", qos=1, wait=WAIT)
    finally:
        first.stop()
    with EmbeddedBroker(work_dir, port=first.port) as second:
        publisher = sessions(second.address, "publisher")
        publisher.publish("fl/f/devices/device-10/ack", b"queued-after-restart", qos=1, wait=WAIT)
        back = sessions(second.address, "device-10")  # same client id, no new subscription
        assert [receive(back).payload for _ in range(2)] == [b"queued-before-restart", b"queued-after-restart"]


def test_a_publish_while_the_broker_is_away_is_queued_and_delivered_when_it_returns(tmp_path, sessions):
    work_dir = tmp_path / "broker"
    first = EmbeddedBroker(work_dir).start()
    try:
        device = sessions(first.address, "device-11")
        coordinator = sessions(first.address, "coordinator-11")
        subscribe(coordinator, "fl/f/devices/device-11/update")
    finally:
        first.stop()
    assert wait_until(lambda: not device.connected), "the session did not notice the broker going away"
    assert device.publish("fl/f/devices/device-11/update", b"while-away", wait=0.5) is False  # queued, no error
    with EmbeddedBroker(work_dir, port=first.port):
        got = receive(coordinator)
        assert (got.topic, got.payload) == ("fl/f/devices/device-11/update", b"while-away")


def test_a_port_whose_last_connection_lingers_in_time_wait_is_free_and_a_listening_port_is_not():
    """A broker that closed a client's connection itself leaves it in TIME_WAIT on its own port for a minute; a new
    broker (SO_REUSEADDR, as mosquitto binds) can take the port at once, so the probe must say it is free."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert not port_is_free(port)
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = listener.accept()
            accepted.close()  # the server side closes first: its end of the connection goes to TIME_WAIT
            client.recv(1)
    assert port_is_free(port)
