# The durable outbox: kill -9 before the broker's PUBACK or before the coordinator's ack loses no update.
from __future__ import annotations

import time
from pathlib import Path

import pytest
from fleet import announce_round, fleet_shards, kill, start_agent, wait_for_state, wait_until, watch_status

from edge_agent.loop.outbox import OUTBOX_FOLDER, Outbox, next_resend_wait
from protocol import messages, topics, wire
from protocol.mqtt import IncomingMessage, MqttSession

FLEET = "outbox"
RECIPE = messages.Recipe(labels_per_acquisition=20, epochs=30, batch_size=8, mc_passes=2)  # trains for seconds


def test_the_outbox_keeps_updates_until_settled_and_ignores_strangers(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / OUTBOX_FOLDER)
    assert outbox.pending() == [] and outbox.last_round() == 0
    outbox.put(3, "u3", b"three")
    outbox.put(12, "u12", b"twelve")
    (tmp_path / OUTBOX_FOLDER / ".round_000013_u13.msgpack.tmp").write_bytes(b"a torn write")
    assert [(e.round_id, e.update_id, e.payload()) for e in outbox.pending()] == [
        (3, "u3", b"three"),
        (12, "u12", b"twelve"),
    ]
    assert outbox.last_round() == 12
    assert outbox.settle("u3") is True and outbox.settle("u3") is False
    assert outbox.settle("../u12") is False and outbox.settle("*") is False
    assert [entry.update_id for entry in outbox.pending()] == ["u12"]
    with pytest.raises(wire.WireError):
        outbox.put(1, "../escape", b"x")


class AckingCoordinator:
    """The coordinator's side of the wire, played by the test: a persistent session that sees updates and acks."""

    def __init__(self, address) -> None:
        self.session = MqttSession(address, client_id="outbox-coordinator")
        self.session.connect(timeout=10)
        self.session.subscribe(topics.UPDATE.filter(fleet=FLEET))

    def next_update(self, timeout: float = 120.0) -> IncomingMessage:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            message = self.session.next_message(timeout=0.5)
            if message is not None and message.topic.endswith("/update"):
                return message
        raise AssertionError(f"no update within {timeout:.0f}s")

    def ack(self, message: IncomingMessage) -> None:
        update = wire.decode(message.payload, messages.Update)
        ack = messages.Ack(update.device_id, update.round_id, update.update_id, True)
        self.session.publish(topics.ACK.build(fleet=FLEET, device=update.device_id), wire.encode(ack), wait=10)


def outbox_files(state_dir: Path) -> list[Path]:
    folder = state_dir / OUTBOX_FOLDER
    return sorted(folder.glob("round_*.msgpack")) if folder.is_dir() else []


def restart_and_settle(launch, broker, processes: list, coordinator: AckingCoordinator, kept: bytes) -> None:
    """Restarts the killed agent; the update it re-sends is the kept one byte for byte (so the coordinator applies
    it once); once acked, it leaves the outbox."""
    processes.append(start_agent(launch, broker.address, FLEET))
    received = coordinator.next_update()
    assert received.payload == kept, "the re-sent update differs from the one kept in the outbox"
    coordinator.ack(received)
    wait_until(lambda: outbox_files(launch.state_dir) == [], "the acked update leaving the outbox")
    coordinator.session.close()


@pytest.mark.integration
def test_an_update_killed_before_the_brokers_puback_is_sent_after_the_restart(
    tmp_path: Path, broker, processes
) -> None:
    [launch] = fleet_shards(tmp_path, 1)
    coordinator = AckingCoordinator(broker.address)
    watcher = watch_status(broker.address, FLEET)
    processes.append(start_agent(launch, broker.address, FLEET))
    wait_for_state(watcher, "online")
    announce_round(broker.address, FLEET, RECIPE)
    wait_for_state(watcher, "training")
    watcher.close()
    broker.stop()
    wait_until(lambda: len(outbox_files(launch.state_dir)) == 1, "the update in the outbox")
    kept = outbox_files(launch.state_dir)[0].read_bytes()
    kill(processes[-1])
    broker.start()
    restart_and_settle(launch, broker, processes, coordinator, kept)


@pytest.mark.integration
def test_an_update_killed_before_the_coordinators_ack_is_sent_again_identically(
    tmp_path: Path, broker, processes
) -> None:
    [launch] = fleet_shards(tmp_path, 1)
    coordinator = AckingCoordinator(broker.address)
    processes.append(start_agent(launch, broker.address, FLEET))
    announce_round(broker.address, FLEET, RECIPE)
    first = coordinator.next_update()
    assert [path.read_bytes() for path in outbox_files(launch.state_dir)] == [first.payload]
    kill(processes[-1])
    restart_and_settle(launch, broker, processes, coordinator, first.payload)


def test_an_unanswered_update_is_re_sent_ever_less_often() -> None:
    waits = [next_resend_wait(None)]
    while len(waits) < 8:
        waits.append(next_resend_wait(waits[-1]))
    assert waits == [60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 3600.0, 3600.0]
