# The one supervision rule: a part that fails is logged with its traceback, restarts after a back-off and shows it in
# its health; a message whose handler fails three times is set aside, kept for inspection and counted by sender.
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from coordinator.dashboard.live import LiveState
from coordinator.dashboard.metrics import render_metrics
from coordinator.dashboard.views import RunSnapshot, devices_view
from protocol import messages, wire
from protocol.supervision import MAX_SENDERS, OTHER_SENDERS, Health, MessageGuard, SupervisedThread


def wait_until(condition, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_a_failing_part_is_logged_restarted_and_shown(caplog) -> None:
    health, runs = Health(), []

    def loop(stop: threading.Event) -> None:
        runs.append(time.monotonic())
        if len(runs) == 1:
            raise OSError(24, "Too many open files")
        stop.wait()

    with caplog.at_level(logging.ERROR, logger="protocol.supervision"):
        part = SupervisedThread("desk", loop, health).start()
        wait_until(lambda: len(runs) == 2, "the part restarted")
    parts, _ = health.snapshot()
    assert [(p.name, p.up, p.restarts) for p in parts] == [("desk", True, 1)]
    assert parts[0].last_error.startswith("OSError: [Errno 24] Too many open files")
    assert runs[1] - runs[0] >= 0.9, "restarted after the back-off, not in a tight loop"
    failure = next(record for record in caplog.records if "part failed" in record.getMessage())
    assert failure.exc_info is not None, "the traceback is logged"
    part.stop()
    assert not part.alive and health.snapshot()[0][0].up is False


def test_a_message_failing_three_times_is_set_aside_and_named(tmp_path: Path) -> None:
    health = Health()
    guard = MessageGuard("desk", health, tmp_path / "aside")
    calls = []

    def handler() -> None:
        calls.append(1)
        raise ValueError("x" * 10_000)

    for _ in range(2):
        with pytest.raises(ValueError):
            guard.handle("fl/f/devices/cam-x/queries", b"poison", "cam-x", handler)
    assert guard.handle("fl/f/devices/cam-x/queries", b"poison", "cam-x", handler) is None
    assert len(calls) == 3
    assert health.snapshot()[1] == {("desk", "cam-x"): 1}
    kept = sorted((tmp_path / "aside").iterdir())
    assert [path.suffix for path in kept] == [".payload", ".txt"]
    assert kept[0].read_bytes() == b"poison"
    note = kept[1].read_text()
    assert "sender=cam-x" in note and len(note) < 600, "the note is bounded whatever the error's size"
    assert guard.handle("fl/f/devices/cam-x/queries", b"poison", "cam-x", lambda: "handled") == "handled", (
        "the same message sent again later is handled afresh"
    )


def test_senders_are_counted_by_name_up_to_a_bound() -> None:
    health = Health()
    for number in range(MAX_SENDERS + 50):
        health.note_set_aside("desk", f"cam-{number}")
    counts = health.snapshot()[1]
    assert len(counts) == MAX_SENDERS + 1 and counts[("desk", OTHER_SENDERS)] == 50


def test_a_set_aside_folder_that_cannot_be_written_loses_only_the_copy(tmp_path: Path) -> None:
    blocker = tmp_path / "aside"
    blocker.write_text("a file where the folder should be")
    health = Health()
    guard = MessageGuard("link", health, blocker, attempts=1)

    def handler() -> None:
        raise RuntimeError("bug")

    assert guard.handle("t", b"p", "queue", handler) is None
    assert health.snapshot()[1] == {("link", "queue"): 1}


def test_a_devices_reported_health_reaches_metrics_and_the_device_table(tmp_path: Path) -> None:
    """A device's status says its link restarted twice and set one message aside: the coordinator's /metrics body
    and its device table show both; a healthy device adds no sample and its status keeps its old bytes."""
    live = LiveState(total_rounds=1)
    live.device_status("cam-1", messages.Status("cam-1", "online", 1.7e9, part_restarts=2, set_aside=1))
    live.device_status("cam-2", messages.Status("cam-2", "online", 1.7e9))
    health = Health()
    health.note_set_aside("labelling-desk", "cam-9")
    body = render_metrics(
        live.counters(),
        2,
        0,
        health=health,
        device_health=live.device_health(),
    )
    assert (
        'fl_device_part_restarts{device="cam-1"} 2' in body and 'fl_device_messages_set_aside{device="cam-1"} 1' in body
    )
    assert 'device="cam-2"' not in body
    assert 'fl_messages_set_aside_total{part="labelling-desk",sender="cam-9"} 1' in body
    rows = {row["device_id"]: row for row in devices_view(RunSnapshot(), live)}
    assert (rows["cam-1"]["part_restarts"], rows["cam-1"]["set_aside"]) == (2, 1)
    healthy = wire.encode(messages.Status("cam-2", "online", 1.7e9))
    assert b"part_restarts" not in healthy and b"set_aside" not in healthy
