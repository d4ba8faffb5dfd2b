# The coordinator's side of devices' predictions: batches checked and bounded, counted per device by hour, a jump in
# the uncertain share flagged, shown on /api/devices and /metrics.
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
from browser import ARTIFACTS, headless_chromium, needs_chromium, wait_for
from run_records import DEVICES, fill_store

from coordinator.dashboard.live import LiveState
from coordinator.dashboard.metrics import render_metrics
from coordinator.dashboard.server import Dashboard, ListenAddress
from coordinator.intake.predictions import DevicePredictions, PredictionIntake
from coordinator.rounds.loop import device_routes
from protocol import topics, wire
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


def test_the_coordinator_routes_a_devices_predictions_topic_to_the_intake() -> None:
    heard = []
    router = device_routes("plant", *(lambda *a: None,) * 3, lambda device, message, opened: heard.append(device))
    found = router.route(topics.PREDICTIONS.build(fleet="plant", device="cam-7"))
    assert found is not None and found[1] == {"device": "cam-7"}
    assert topics.PREDICTIONS.filter(fleet="plant") in router.filters()


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
