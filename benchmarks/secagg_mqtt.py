# Secure aggregation over MQTT against plain rounds in the same run: `fl-bench simulate` with virtual devices, twice
# per fleet size (plain FedAvg, then SecAgg+), on one broker that a watcher counts every device's bytes on.
"""Run through `python benchmarks/secagg_cost.py mqtt` (the in-process bench is its default). For each fleet size,
`fl-bench simulate` runs the plain rounds and the secure rounds (`--secure-aggregation secagg`) on the same
broker, devices and settings (virtual devices in workers, pools of 50, 5 labels a round, 1 epoch, the default
paper-cnn whose whole model is trained and masked). A watcher subscribed to the fleet's device topics counts the
payload bytes each device sent (its update, or its secure-round stage messages) and was sent to it alone (acks, or
stage messages); what every device gets alike (the announcement, the model) is the same in both modes and left
out. The process tree is sampled from /proc: the coordinator's CPU seconds and peak RSS (VmHWM), the workers'."""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from virtual_fleet import TreeSampler, by_kind, run_sampled, simulate_command

from protocol.mqtt import BrokerAddress, MqttSession

UP, DOWN = ("update", "secagg"), ("ack", "secagg_in")  # a device topic's leaf: what it sends, what it alone gets


@dataclass
class ByteCounter:
    """Payload bytes per device and direction on one fleet's device topics, counted from a watcher's session."""

    address: BrokerAddress
    fleet: str
    sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    received: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        """Counts until `stop` is set (then drains what is still queued)."""
        session = MqttSession(self.address, client_id=f"watch-{self.fleet}")
        session.connect(timeout=10)
        session.subscribe(f"fl/{self.fleet}/devices/#")
        try:
            while (message := session.next_message(timeout=0.5)) is not None or not self.stop.is_set():
                if message is not None:
                    self.count(message.topic, len(message.payload))
                    session.acknowledge(message)
        finally:
            session.close()

    def count(self, topic: str, size: int) -> None:
        """One message (or chunk) on fl/FLEET/devices/DEVICE/LEAF[/chunk/I]."""
        levels = topic.split("/")
        device, leaf = levels[3], levels[4]
        if leaf in UP:
            self.sent[device] += size
        elif leaf in DOWN:
            self.received[device] += size


def fleet_run(
    address: BrokerAddress, devices: int, rounds: int, folder: Path, secure: bool, tree: tuple[str, Path] | None = None
) -> dict[str, Any]:
    """One `fl-bench simulate` on the shared broker (its fleet named by `prefix`, the mode and the size, so runs
    never share retained topics), its devices' bytes counted and its processes sampled. With a `tree` (name, checkout)
    the simulate run is that checkout's code: run in it, with it on PYTHONPATH for every process it starts."""
    prefix, cwd = tree if tree else ("", None)
    fleet = f"{prefix}{'secure' if secure else 'plain'}{devices}"
    mode = ["--secure-aggregation", "secagg", "--secagg-open-fleet-unsafe"] if secure else []
    extra = ["--broker", address.url, "--fleet", fleet, "--strategy", "fedavg", *mode]
    counter = ByteCounter(address, fleet)
    watcher = threading.Thread(target=counter.run, daemon=True)
    watcher.start()
    time.sleep(1.0)
    started = time.monotonic()
    command = simulate_command(devices, rounds, folder / fleet, extra)
    if cwd is not None:
        os.environ["PYTHONPATH"] = str(cwd)
    output, code, sampler = run_sampled(command, folder / f"{fleet}.log", cwd)
    counter.stop.set()
    watcher.join(timeout=60)
    return summary(devices, rounds, output.decode(), code, time.monotonic() - started, counter, sampler)


def summary(
    devices: int, rounds: int, output: str, code: int, wall: float, counter: ByteCounter, sampler: TreeSampler
) -> dict[str, Any]:
    """What one run cost: per round and per device bytes, round seconds, the coordinator's CPU and peak memory."""
    results = [json.loads(line) for line in output.splitlines() if line.startswith('{"round"')]
    kinds = by_kind(sampler.processes.values())
    coordinator = next((p for p in sampler.processes.values() if p.kind == "coordinator"), None)
    return {
        "devices": devices,
        "exit_code": code,
        "rounds_completed": len(results),
        "round_seconds": [r["seconds"] for r in results],
        "round_accuracy": [r["accuracy"] for r in results],
        "labels": [r["labels"] for r in results],
        "device_bytes_sent_per_round": per_round(counter.sent, rounds),
        "device_bytes_received_per_round": per_round(counter.received, rounds),
        "devices_that_sent": len(counter.sent),
        "coordinator_cpu_seconds": round(coordinator.cpu_seconds, 1) if coordinator else None,
        "coordinator_peak_rss_mb": round(coordinator.hwm_mb, 1) if coordinator else None,
        "processes": kinds,
        "wall_seconds": round(wall, 1),
    }


def per_round(counts: dict[str, int], rounds: int) -> int:
    """The mean over devices of their bytes, per round."""
    return round(statistics.fmean(counts.values()) / rounds) if counts else 0


def compare(
    address: BrokerAddress, sizes: list[int], rounds: int, folder: Path, trees: list[tuple[str, Path]]
) -> dict[str, Any]:
    """Plain then secure rounds at each fleet size on one broker, with each checkout's code in turn (its simulate
    run with PYTHONPATH on it), each pair printed as it finishes; the ratios."""
    rows = []
    for devices in sizes:
        for name, tree in trees:
            runs = folder / name
            runs.mkdir(parents=True, exist_ok=True)
            plain = fleet_run(address, devices, rounds, runs, secure=False, tree=(name, tree))
            secure = fleet_run(address, devices, rounds, runs, secure=True, tree=(name, tree))
            row = {"tree": name, "devices": devices, "plain": plain, "secure": secure, "ratios": ratios(plain, secure)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return {"rounds": rounds, "runs": str(folder), "trees": {name: str(tree) for name, tree in trees}, "sizes": rows}


def ratios(plain: dict[str, Any], secure: dict[str, Any]) -> dict[str, float | None]:
    """Secure over plain: bytes a device sends, mean round seconds, coordinator CPU seconds and peak RSS."""
    keys = ("device_bytes_sent_per_round", "coordinator_cpu_seconds", "coordinator_peak_rss_mb")
    found = {key: (secure[key] / plain[key] if plain[key] else None) for key in keys}
    seconds = (statistics.fmean(secure["round_seconds"] or [0]), statistics.fmean(plain["round_seconds"] or [0]))
    found["round_seconds"] = seconds[0] / seconds[1] if seconds[1] else None
    return {key: None if value is None else round(value, 2) for key, value in found.items()}
