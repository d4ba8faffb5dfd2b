# The coordinator's side of devices' predictions: batches checked and bounded, counted per device by hour, a jump in
# the uncertain share flagged, shown on /api/devices and /metrics, the counts kept in the run's store.
from __future__ import annotations

import dataclasses
import json
import logging
import time
import urllib.request
from pathlib import Path

import pytest
from browser import ARTIFACTS, headless_chromium, needs_chromium, wait_for
from fleet import kill, start_coordinator, wait_exit, wait_until
from run_records import DEVICES, fill_store

from coordinator.dashboard.live import LiveState
from coordinator.dashboard.metrics import render_metrics
from coordinator.dashboard.server import Dashboard, ListenAddress
from coordinator.fleet.broker import EmbeddedBroker, free_loopback_port
from coordinator.intake.predictions import FLUSH_SECONDS, HOURS_KEPT, DevicePredictions, PredictionIntake
from coordinator.rounds.loop import device_routes
from coordinator.storage.prediction_counts import StoredDevice, StoredHour
from coordinator.storage.store import RunStore
from protocol import topics, wire
from protocol.mqtt import MqttSession
from protocol.prediction_messages import PredictionBatch
from protocol.reassembly import Dropped

HOUR = 3600.0


def batch(device: str, count: int, uncertain: int, names: tuple[str, ...] = ("person", "vehicle")) -> PredictionBatch:
    """`count` predictions of which `uncertain` are uncertain, classes taken in turn from `names`."""
    classes = [index % len(names) for index in range(count)]
    return PredictionBatch(
        device_id=device,
        serving_version=3,
        model_hash="ab" * 32,
        files=[f"{index}.jpg" for index in range(count)],
        content_hashes=["00" * 32] * count,
        class_indices=classes,
        class_names=[names[index] for index in classes],
        probabilities=[0.9] * count,
        uncertainties=[0.8] * uncertain + [0.1] * (count - uncertain),
        times=[0.0] * count,
    )


def test_a_jump_in_the_uncertain_share_is_flagged_only_with_enough_predictions() -> None:
    counts = DevicePredictions()
    for hour in range(3):  # a steady camera: 10% uncertain
        counts.add(batch("cam", 40, 4), hour * HOUR + 10)
    assert counts.summary(3 * HOUR + 20)["drift"] is False
    counts.add(batch("cam", 10, 9), 3 * HOUR + 30)  # too few this hour to tell
    assert counts.summary(3 * HOUR + 40)["drift"] is False
    counts.add(batch("cam", 20, 18), 3 * HOUR + 50)  # the light changed: 90% uncertain
    summary = counts.summary(3 * HOUR + 60)
    assert summary["drift"] is True and summary["per_hour"] == 30
    assert summary["uncertain_share_last_hour"] == pytest.approx(27 / 30)
    assert summary["uncertain_share_before"] == pytest.approx(12 / 120)
    assert summary["class_mix"] == pytest.approx({"person": 0.5, "vehicle": 0.5})
    assert [(hour["hour"], hour["predictions"]) for hour in summary["hours"]] == [
        (0, 40),
        (3600, 40),
        (7200, 40),
        (10800, 30),
    ]
    assert counts.summary(30 * HOUR)["per_hour"] == 0 and counts.summary(30 * HOUR)["class_mix"] == {}


def test_batches_are_checked_bound_to_their_device_and_counted_for_the_dashboard_and_metrics(caplog) -> None:
    live = LiveState(total_rounds=1)
    intake = PredictionIntake(live)
    good = wire.encode(batch("cam-1", 30, 3))
    lying = wire.encode(batch("cam-2", 5, 0))  # cam-1 sends a batch naming cam-2
    uneven = wire.encode(dataclasses.replace(batch("cam-1", 4, 0), probabilities=[0.5]))
    dropped = Dropped("t", "x", "bad_chunk", "chunks missing at the timeout")
    with caplog.at_level(logging.WARNING, logger="coordinator.intake.predictions"):
        intake.on_predictions("cam-1", good, None)
        for payload in (lying, uneven, b"\x00" * 100, b"x" * (2 << 20)):
            intake.on_predictions("cam-1", payload, None)
        intake.on_predictions("cam-3", b"", dropped)
    refused = [record.getMessage() for record in caplog.records]
    assert len(refused) == 2 and all(len(line) < 400 for line in refused), refused  # once a minute per device
    assert "batch names device 'cam-2'" in refused[0] and "cam-3" in refused[1]
    counters = live.counters()
    assert (counters.predictions_received, counters.predictions_refused) == (30, 5)
    device = live.devices()["cam-1"]["predictions"]
    assert device["per_hour"] == 30 and device["uncertain_share"] == pytest.approx(0.1)
    text = render_metrics(counters, live.online_count(), 0, predictions=live.predictions())
    assert 'fl_device_predictions_last_hour{device="cam-1"} 30' in text
    assert 'fl_device_predicted_class_share{device="cam-1",class="person"} 0.5' in text
    assert 'fl_device_prediction_drift{device="cam-1"} 0' in text
    assert "fl_prediction_batches_refused_total 5" in text


def test_the_coordinator_routes_a_devices_predictions_and_a_relays_relayed_ones_to_their_handlers() -> None:
    router = device_routes("plant", *(lambda *a: None,) * 3, "direct", "relayed")  # handlers stand in as names
    found = router.route(topics.PREDICTIONS.build(fleet="plant", device="cam-7"))
    assert found == ("direct", {"device": "cam-7"})
    found = router.route(topics.RELAYED_PREDICTIONS.build(fleet="plant", device="relay-00"))
    assert found == ("relayed", {"device": "relay-00"})
    filters = router.filters()
    assert {topics.PREDICTIONS.filter(fleet="plant"), topics.RELAYED_PREDICTIONS.filter(fleet="plant")} <= set(filters)


@needs_chromium
def test_the_dashboard_page_shows_each_devices_predictions(tmp_path: Path) -> None:
    """The real page in headless chromium: a predicting device's row shows its predictions this hour, its class mix
    and its uncertain share; a device that publishes none shows dashes. A screenshot is kept in test-artifacts/."""
    fill_store(tmp_path / "run")
    live = LiveState(total_rounds=2)
    live.predictions_received(DEVICES[0], batch(DEVICES[0], 40, 10))
    script = (
        "return [...document.querySelectorAll('#devices tbody tr')]"
        ".map(r => [...r.cells].slice(-4).map(c => c.textContent))"
    )
    served = Dashboard(ListenAddress("127.0.0.1", 0), tmp_path / "run", live, None)
    with served as dashboard, headless_chromium(tmp_path / "chromium-profile") as browser:
        browser.open(dashboard.url)
        rows = wait_for(lambda: browser.evaluate(script) or None, 60, "the device table")
        shot = browser.screenshot(ARTIFACTS / "dashboard-predictions.png")
    assert rows[0] == ["40", "person 50%, vehicle 50%", "25%", "-"]  # no labelling queue: its column a dash
    assert rows[1] == ["-", "-", "-", "-"]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_counts_are_kept_in_the_store_and_a_restart_shows_the_same_hours_with_old_ones_pruned(
    tmp_path: Path,
) -> None:
    """The intake and the live state over a real run store: a restarted process (a new live state on the store
    reopened) shows each device's hours, class mix and totals as they were; hours older than the 24 kept are taken
    back by no one and deleted from the store at the first write."""
    now_hour = int(time.time() // HOUR)
    with RunStore(tmp_path / "run") as store:
        earlier = StoredHour("cam-1", now_hour - 2, 40, 4, {"person": 40})
        stale = StoredHour("cam-old", now_hour - HOURS_KEPT - 5, 7, 0, {"vehicle": 7})
        store.predictions.save([earlier, stale], [StoredDevice("cam-1", 500, 2), StoredDevice("cam-old", 7, 1)], 0)
        live = LiveState(total_rounds=1)
        live.keep_in(store)
        intake = PredictionIntake(live)
        for device, count, uncertain in (("cam-1", 30, 3), ("cam-2", 12, 6), ("cam-1", 10, 1)):
            intake.on_predictions(device, wire.encode(batch(device, count, uncertain)), None)
        before = live.predictions()
        live.close()
        live.close()  # a second close writes nothing more and fails nothing
        assert store.predictions.hours(0) == [
            earlier,
            StoredHour("cam-1", now_hour, 40, 4, {"person": 20, "vehicle": 20}),
            StoredHour("cam-2", now_hour, 12, 6, {"person": 6, "vehicle": 6}),
        ], "the stale hour went"
    assert before["cam-1"]["total"] == 540 and before["cam-1"]["serving_version"] == 3
    assert [(hour["hour"], hour["predictions"]) for hour in before["cam-1"]["hours"]] == [
        ((now_hour - 2) * 3600, 40),
        (now_hour * 3600, 40),
    ]
    with RunStore(tmp_path / "run") as store:
        restarted = LiveState(total_rounds=1)
        restarted.keep_in(store)
        assert restarted.predictions() == {**before, "cam-old": restarted.predictions()["cam-old"]}
        assert restarted.predictions()["cam-old"]["hours"] == [], "its totals are kept, its stale hour is not"
        restarted.close()


def api_devices(port: int) -> dict:
    """The coordinator dashboard's /api/devices, by device id."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/devices", timeout=5) as response:
        return {device["device_id"]: device for device in json.loads(response.read())["devices"]}


def counted(port: int, device: str) -> int:
    """How many of a device's predictions the dashboard counts over the hours kept (-1: the page is not up yet)."""
    try:
        summary = api_devices(port).get(device, {}).get("predictions") or {"hours": []}
    except OSError:
        return -1
    return sum(hour["predictions"] for hour in summary["hours"])


def test_a_restarted_coordinator_process_shows_the_hours_counts_and_a_sigkill_loses_only_the_last_interval(
    tmp_path: Path, processes
) -> None:
    """A real coordinator with its dashboard counts a device's batches from its predictions topic; stopped (SIGTERM)
    and started again on its run directory, its page shows the same counts before any new batch. A batch written
    (FLUSH_SECONDS passed) survives a SIGKILL; one that came after the last write may be lost, nothing more."""
    port, run_dir = free_loopback_port(), tmp_path / "run"
    with EmbeddedBroker(tmp_path / "broker") as broker:
        device = MqttSession(broker.address, client_id="cam-1")
        device.connect(timeout=10)
        device.subscribe(topics.ROUND.build(fleet="fleet-c"))
        topic = topics.PREDICTIONS.build(fleet="fleet-c", device="cam-1")

        def coordinator():
            """A coordinator process, once it announced its round (it subscribed and took back its counts)."""
            while device.next_message(timeout=0) is not None:
                pass
            started = start_coordinator(broker.address, run_dir, "fleet-c", "--dashboard", str(port))
            processes.append(started)
            assert device.next_message(timeout=60) is not None, "the round announced"
            wait_until(lambda: counted(port, "cam-1") >= 0, "the coordinator's dashboard", 60)
            return started

        def send(count: int, total: int) -> None:
            device.publish(topic, wire.encode(batch("cam-1", count, count // 10)), wait=10)
            wait_until(lambda: counted(port, "cam-1") == total, f"{total} predictions counted", 30)

        try:
            first = coordinator()
            send(30, 30)
            first.terminate()
            assert wait_exit(first, "the coordinator") == 143
            second = coordinator()
            assert counted(port, "cam-1") == 30, "the counts before any new batch"
            send(20, 50)
            time.sleep(FLUSH_SECONDS + 1.0)
            send(10, 60)
            kill(second)
            coordinator()
            after_kill = counted(port, "cam-1")
        finally:
            device.close()
    assert after_kill in (50, 60), after_kill
    assert api_devices(port)["cam-1"]["predictions"]["class_mix"] == pytest.approx({"person": 0.5, "vehicle": 0.5})
