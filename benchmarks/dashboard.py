# Dashboard API, /metrics and report speed over a large synthetic run store (real SQLite, real HTTP, real matplotlib).
"""Prints one JSON object: the median and worst milliseconds of each dashboard endpoint over --requests GETs
against a store of --rounds rounds x --devices devices (the paper CNN's 12 layers per divergence row), and the
seconds `fl-coordinator report` takes to write that run's HTML report."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from coordinator.dashboard.live import LiveState
from coordinator.dashboard.report import write_report
from coordinator.dashboard.server import Dashboard, ListenAddress
from coordinator.storage.store import DeviceRoundRecord, RoundRecord, RunStore

LAYERS = [
    f"{block}.{kind}" for block in ("conv1", "conv2", "conv3", "conv4", "fc1", "fc2") for kind in ("weight", "bias")
]


def fill(run_dir: Path, rounds: int, devices: int) -> None:
    """A run store of `rounds` committed rounds, each with `devices` accepted updates and per-class accuracies."""
    names = [f"dev-{index:03d}" for index in range(devices)]
    with RunStore(run_dir) as store:
        store.set_config(
            {"run_id": "bench", "settings": {"fleet": "bench", "strategy": "avefl", "policy": {"rounds": rounds}}}
        )
        for round_id in range(1, rounds + 1):
            store.commit_round(
                RoundRecord(
                    round_id,
                    10.0 * round_id,
                    10.0 * round_id + 8,
                    "ab" * 32,
                    0.5,
                    100 * round_id,
                    devices,
                    0,
                    {"suspects": {}, "aggregation_seconds": 0.1},
                    {
                        "quorum": devices,
                        "stragglers": [],
                        "class_accuracy": [0.5] * 10,
                        "device_class_accuracy": {name: [0.4] * 10 for name in names},
                    },
                ),
                [
                    DeviceRoundRecord(
                        round_id,
                        name,
                        True,
                        "",
                        100,
                        [10] * 10,
                        0.4,
                        {layer: 0.01 * (i + 1) for i, layer in enumerate(LAYERS)},
                        212000,
                        10.0 * round_id + 5,
                        20 * round_id,
                    )
                    for name in names
                ],
            )


def time_get(url: str, requests: int) -> dict[str, float]:
    """Median and worst milliseconds of `requests` GETs of url."""
    timings = []
    for _ in range(requests):
        started = time.perf_counter()
        with urllib.request.urlopen(url, timeout=60) as response:
            response.read()
        timings.append(1000 * (time.perf_counter() - started))
    return {"median_ms": round(statistics.median(timings), 2), "max_ms": round(max(timings), 2)}


def main() -> None:
    """Runs the benchmark and prints its JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--devices", type=int, default=20)
    parser.add_argument("--requests", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        run_dir = Path(folder) / "run"
        fill(run_dir, args.rounds, args.devices)
        with Dashboard(ListenAddress("127.0.0.1", 0), run_dir, LiveState(args.rounds), None) as dashboard:
            paths = ["api/run", "api/devices", "api/rounds", f"api/rounds/{args.rounds}/divergence", "metrics"]
            endpoints = {path: time_get(dashboard.url + path, args.requests) for path in paths}
        started = time.perf_counter()
        write_report(run_dir)
        report_seconds = time.perf_counter() - started
    print(
        json.dumps(
            {
                "rounds": args.rounds,
                "devices": args.devices,
                "requests": args.requests,
                "endpoints": endpoints,
                "report_seconds": round(report_seconds, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
