# Tests for protocol.backlog: the session's own flow control, alone and against a real mosquitto.
from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from protocol.backlog import Backlog

WAIT = 10.0


def wait_until(condition: Callable[[], bool]) -> None:
    """Returns as soon as condition() holds; fails after WAIT seconds."""
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def blocked_put(backlog: Backlog[int], item: int) -> threading.Thread:
    """Starts a network-thread-like put of `item` and returns its thread."""
    thread = threading.Thread(target=backlog.put, args=(item,), daemon=True)
    thread.start()
    return thread


def test_a_put_waits_while_the_window_is_full_and_goes_in_once_the_owner_takes_one():
    backlog: Backlog[int] = Backlog(window=2, hold_seconds=60)
    backlog.put(1)
    backlog.put(2)
    third = blocked_put(backlog, 3)
    third.join(0.3)
    assert third.is_alive() and backlog.peak == 2
    assert backlog.get(0) == 1
    third.join(WAIT)
    assert not third.is_alive()
    assert [backlog.get(0), backlog.get(0), backlog.get(0)] == [2, 3, None]


@pytest.mark.parametrize("release", ["owner_waiting", "close"])
def test_an_owner_waiting_on_the_broker_or_a_closing_session_lets_a_held_put_go(release):
    backlog: Backlog[int] = Backlog(window=1, hold_seconds=60)
    backlog.put(1)
    if release == "close":
        held = blocked_put(backlog, 2)
        backlog.close()
        held.join(WAIT)
    else:
        with backlog.owner_waiting():
            held = blocked_put(backlog, 2)
            held.join(WAIT)
    assert not held.is_alive() and backlog.peak == 2


def test_a_put_is_held_at_most_hold_seconds_and_put_now_is_never_held():
    backlog: Backlog[int] = Backlog(window=1, hold_seconds=0.05)
    backlog.put(1)
    backlog.put(2)  # held 0.05 s, then in: the network thread still gets to send keep-alives
    backlog.put_now(3)
    assert [backlog.get(0) for _ in range(4)] == [1, 2, 3, None]


def test_without_a_window_nothing_is_held():
    backlog: Backlog[int] = Backlog()
    for item in range(1000):
        backlog.put(item)
    assert backlog.peak == 1000 and not backlog.empty()


@pytest.mark.integration
def test_a_manual_ack_session_holds_at_most_its_window_though_mosquitto_sends_more(broker, sessions):
    """mosquitto 2.0.11 refills a whole window on each PUBACK of the oldest message in flight (see backlog.py);
    acknowledging oldest first, as the coordinator does, the session still never holds more than its window."""
    receiver = sessions(broker.address, "coordinator", manual_ack=True, ack_window=8)
    receiver.subscribe("fl/+/update")
    sender = sessions(broker.address, "sender")
    payloads = [bytes([index]) * 50_000 for index in range(120)]
    for index, payload in enumerate(payloads):
        sender.publish(f"fl/d{index}/update", payload)
    received = []
    while len(received) < len(payloads):
        batch = [message] if (message := receiver.next_message(WAIT)) else []
        while len(batch) < 8 and (message := receiver.next_message(0)) is not None:
            batch.append(message)
        assert batch, f"only {len(received)} of {len(payloads)} arrived"
        received.extend(batch)
        for handled in batch:
            receiver.acknowledge(handled)
    assert sorted(m.payload for m in received) == sorted(payloads)
    assert receiver.backlog.peak <= 8


@pytest.mark.integration
def test_a_publish_the_owner_waits_for_goes_through_while_the_network_thread_is_held(broker, sessions):
    receiver = sessions(broker.address, "coordinator", manual_ack=True, ack_window=4)
    receiver.subscribe("fl/+/update")
    sender = sessions(broker.address, "sender")
    for index in range(20):
        sender.publish(f"fl/d{index}/update", b"u" * 10_000, wait=WAIT)
    taken = [receiver.next_message(WAIT) for _ in range(4)]
    for message in taken[:2]:  # each PUBACK of the oldest lets mosquitto send up to 4 more: 8 for a window of 4
        receiver.acknowledge(message)
    wait_until(lambda: receiver.backlog.peak == 4)
    # paho's thread is now held with the PUBACK of this publish somewhere behind the 4 messages it has not read
    assert receiver.publish("fl/model", b"m" * 10_000, retain=True, wait=WAIT)
    drained = [message for message in taken if message is not None]
    for message in drained[2:]:
        receiver.acknowledge(message)
    while (message := receiver.next_message(WAIT if len(drained) < 20 else 0.5)) is not None:
        drained.append(message)
        receiver.acknowledge(message)
    assert sorted(m.topic for m in drained) == sorted(f"fl/d{index}/update" for index in range(20))
