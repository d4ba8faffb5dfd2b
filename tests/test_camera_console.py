# The camera demo's lines a person reads: rounds from a real store, peaks from the agents' own log lines, the table.
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest
from run_records import DEVICES, fill_store

from bench.camera_console import SUMMARY_HEADERS, footprint_peaks, round_line, round_rows, summary, table
from bench.probe import leading_rows
from coordinator.storage.serving_history import GATE, HELD, PROMOTED, ServingDecision
from coordinator.storage.store import RunStore
from edge_agent.loop.footprint import PhaseMeter
from protocol.logs import LOG_FORMAT


def write_agent_log(path: Path, peaks_by_round: dict[int, dict[str, float]]) -> None:
    """The footprint lines an agent logs after each round, written through its own logger and the CLI's format."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logger = logging.getLogger("edge_agent.loop.footprint")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        meter = PhaseMeter()
        for round_id, peaks in sorted(peaks_by_round.items()):
            meter.peaks, meter.overall = dict(peaks), max(peaks.values())
            meter.log(round_id)
    finally:
        logger.removeHandler(handler)
        handler.close()


def test_footprint_peaks_reads_each_rounds_highest_phase(tmp_path: Path) -> None:
    log = tmp_path / "cam-0.log"
    write_agent_log(log, {1: {"idle": 96.0, "score": 164.9, "train": 165.5}, 2: {"idle": 165.6, "train": 171.2}})
    with log.open("a") as extra:
        extra.write("2026-11-27 09:14:23,817 level=INFO logger=edge_agent.loop.agent round=3 acquired=20\n")
    assert footprint_peaks(log) == {1: 165.5, 2: 171.2}


def test_round_rows_name_the_slowest_device_and_its_peak(tmp_path: Path) -> None:
    """fill_store: dev-02's update arrives last in both rounds; each device holds 20 labels a round more."""
    fill_store(tmp_path / "run")
    logs = {device: tmp_path / f"{device}.log" for device in DEVICES}
    for number, device in enumerate(DEVICES):
        write_agent_log(logs[device], {1: {"train": 100.0 + number}, 2: {"train": 150.0 + number}})
    rows = round_rows(tmp_path / "run", logs)
    assert [(row.round_id, row.slowest_device, row.slowest_rss_mb) for row in rows] == [
        (1, "dev-02", 102.0),
        (2, "dev-02", 152.0),
    ]
    assert [row.device_labels for row in rows] == [dict.fromkeys(DEVICES, 20), dict.fromkeys(DEVICES, 40)]
    assert [(row.labels, row.accuracy, row.seconds) for row in rows] == [(160, 0.6, 12.5), (220, 0.7, 12.5)]


def test_a_device_without_a_log_leaves_its_peak_unknown(tmp_path: Path) -> None:
    fill_store(tmp_path / "run")
    rows = round_rows(tmp_path / "run", {device: tmp_path / f"{device}.log" for device in DEVICES})
    assert [row.slowest_rss_mb for row in rows] == [None, None]
    line = round_line(dataclasses.asdict(rows[0]), total_rounds=5)
    assert "slowest dev-02 peak - MB" in line and "probe -" in line


def test_a_round_line_splits_the_labels_between_server_and_devices(tmp_path: Path) -> None:
    fill_store(tmp_path / "run")
    logs = {device: tmp_path / f"{device}.log" for device in DEVICES}
    for device in DEVICES:
        write_agent_log(logs[device], {1: {"train": 176.4}, 2: {"train": 180.0}})
    row = dataclasses.replace(round_rows(tmp_path / "run", logs)[1], probe_accuracy=0.8123)
    assert round_line(dataclasses.asdict(row), total_rounds=5) == (
        "round  2/5  labels  220 (server 100 + devices 120)  accuracy 0.7000  probe 0.8123  "
        "slowest dev-02 peak 180 MB  12.5s"
    )


def test_a_round_line_ends_with_the_gates_decision_and_the_serving_version(tmp_path: Path) -> None:
    fill_store(tmp_path / "run")
    with RunStore(tmp_path / "run") as store:
        store.serving.record(lambda served: ServingDecision(1, PROMOTED, "accuracy 0.6000 is no worse", GATE))
        store.serving.record(lambda served: ServingDecision(2, HELD, "class 3 recall fell", GATE))
    rows = round_rows(tmp_path / "run", {})
    assert [(row.gate, row.serving) for row in rows] == [(PROMOTED, 1), (HELD, 1)]
    assert round_line(dataclasses.asdict(rows[0]), total_rounds=5).endswith("12.5s  promoted, serving round 1")
    assert round_line(dataclasses.asdict(rows[1]), total_rounds=5).endswith("12.5s  held, serving round 1")


def test_the_summary_names_what_each_fleet_serves_and_what_it_predicted(tmp_path: Path) -> None:
    run = {
        **dict.fromkeys(("backbone", "sampler", "report"), "x"),
        **{"seed": 0, "labels": [10], "accuracy": [0.5], "device_peak_rss_mb": [100.0], "seconds": 1.0},
        **{"serving_version": 0, "predictions": {"cam-0": 50, "cam-1": 48}},
    }
    central = {**run, "serving_version": 3, "page_answers": 40, "predictions_published": {"cam-0": 50, "cam-1": 48}}
    lines = summary([run, central], tmp_path / "camera_bench.json").splitlines()
    assert "serving (x, x, seed 0): W0; predictions per device: cam-0 50, cam-1 48" in lines
    assert "serving (x, x, seed 0): round 3; predictions per device: cam-0 50, cam-1 48" in lines
    assert "labelling page (x, x, seed 0): 40 answers; predictions published: cam-0 50, cam-1 48" in lines


def test_the_summary_table_has_a_row_per_run_and_names_each_report(tmp_path: Path) -> None:
    run = {
        "backbone": "efficientnet-lite0",
        "sampler": "margin",
        "seed": 0,
        "labels": [280, 360],
        "accuracy": [0.78, 0.81],
        "probe_accuracy": 0.82,
        "device_peak_rss_mb": [176.4, 188.2],
        "seconds": 35.06,
        "report": "runs/x/report.html",
    }
    baseline = {**run, "backbone": "mobilenet", "report": "runs/y/report.html", "accuracy": [0.2, 0.3]}
    del baseline["probe_accuracy"]
    text = summary([run, baseline], tmp_path / "camera_bench.json")
    lines = text.strip().splitlines()
    assert lines[0].split() == list(SUMMARY_HEADERS[:-2]) + ["peak", "MB", "seconds"]
    assert lines[1].split() == [
        "efficientnet-lite0",
        "margin",
        "0",
        "2",
        "360",
        "0.8100",
        "0.8200",
        "-0.0100",
        "188",
        "35.1",
    ]
    assert lines[2].split()[5:8] == ["0.3000", "-", "-"]
    assert "report (efficientnet-lite0, margin, seed 0): runs/x/report.html" in text
    assert text.endswith(f"results: {tmp_path / 'camera_bench.json'}")


def test_table_aligns_text_left_and_numbers_right() -> None:
    assert table(("name", "n"), [["a", "10"], ["long", "2"]], text_columns=1).splitlines() == [
        "name   n",
        "a     10",
        "long   2",
    ]


@pytest.mark.parametrize(
    ("sizes", "taken", "expected"),
    [
        ([3, 4, 2], [3, 1, 0], [0, 1, 2, 3]),
        ([3, 4, 2], [3, 9, 2], list(range(9))),
        ([2, 0, 3], [2, 0, 2], [0, 1, 2, 3]),
    ],
)
def test_leading_rows_take_the_first_labels_of_each_block(sizes: list, taken: list, expected: list) -> None:
    assert leading_rows(sizes, taken).tolist() == expected
    assert leading_rows(sizes, taken).dtype == np.int64
