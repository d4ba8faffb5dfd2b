# Coordinator under load: K fake devices (real paho clients, pre-made valid updates) publish to one real coordinator.
"""Prints one JSON object. For each K, a real `python -m coordinator run` process (embedded mosquitto, W0 without
training, no per-device evaluation) opens round 1 with quorum K; worker processes host the K devices' MQTT clients,
build one valid update per device from the announced model (its weights plus noise) before a shared start signal,
then all publish at once. Reported per K: updates accepted per second (first publish to last ack), seconds from
the last update's ack to the round's close (the store's closed_at), the coordinator's CPU time per update (user
plus system, from the start signal to the round's close: steadier than the rate on a shared machine), and its peak
RSS (VmHWM, read while it waits in round 2) against its RSS once the round was announced. Each K runs once per `--spool-batch`
(the coordinator's group-commit bound; 1, one fsync per update, is the baseline the speed-up is against) and once
per `--trees` checkout, in turn (`--trees before=DIR after=.` compares two versions of the coordinator in one run on
one machine). Must hold: every update accepted."""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import multiprocessing.process
import multiprocessing.queues
import multiprocessing.synchronize
import os
import queue
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import IO

import numpy as np
import paho.mqtt.client as paho

from protocol import messages, topics, wire
from protocol.model_spec import DEFAULT_SPEC

FLEET = "load"
CONNECT_SECONDS = 120.0
ROUND_SECONDS = 600.0


def connect_devices(address: tuple[str, int], device_ids: list[str], acks: queue.Queue, inbox: queue.Queue) -> list:
    """One started paho client per device, subscribed to its ack topic; acks and everything else go to two queues
    as (arrival time, topic, payload)."""
    clients = []
    for device_id in device_ids:
        client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=device_id, protocol=paho.MQTTv5)
        client.on_message = lambda c, u, m: (acks if m.topic.endswith("/ack") else inbox).put(
            (time.time(), m.topic, bytes(m.payload))
        )
        client.connect(*address)
        client.loop_start()
        client.subscribe(topics.ACK.build(fleet=FLEET, device=device_id), qos=1)
        clients.append(client)
    return clients


def announced_round(
    client: paho.Client, inbox: queue.Queue
) -> tuple[messages.RoundAnnouncement, messages.ModelMessage]:
    """Round 1's announcement and its model, as one device's client receives them."""
    client.subscribe(topics.ROUND.build(fleet=FLEET), qos=1)
    announcement = None
    while True:
        _, topic, payload = inbox.get(timeout=CONNECT_SECONDS)
        if topic == topics.ROUND.build(fleet=FLEET):
            announcement = wire.decode(payload, messages.RoundAnnouncement)
            client.subscribe(topics.MODEL.build(fleet=FLEET, hash=announcement.model_hash), qos=1)
        elif announcement is not None and topic == topics.MODEL.build(fleet=FLEET, hash=announcement.model_hash):
            return announcement, wire.decode(payload, messages.ModelMessage)


def encoded_updates(
    device_ids: list[str], announcement: messages.RoundAnnouncement, model: messages.ModelMessage
) -> list[bytes]:
    """One valid encoded update per device: the announced weights plus a little noise, 100 samples each."""
    rng = np.random.default_rng(zlib.crc32(device_ids[0].encode()))  # hash() of a str changes per process
    return [
        wire.encode(
            messages.Update(
                device_id,
                announcement.round_id,
                f"load-{device_id}",
                announcement.model_hash,
                100,
                [10] * DEFAULT_SPEC.num_classes,
                0,
                {},
                {
                    name: (array + rng.normal(0, 0.01, array.shape)).astype(array.dtype)
                    for name, array in model.tensors.items()
                },
            )
        )
        for device_id in device_ids
    ]


def first_verdicts(acks: queue.Queue, devices: int) -> dict[str, tuple[float, bool, str]]:
    """Each device's first ack as (arrival time, accepted, reason), once every device has one."""
    verdicts: dict[str, tuple[float, bool, str]] = {}
    while len(verdicts) < devices:
        received, _, payload = acks.get(timeout=ROUND_SECONDS)
        ack = wire.decode(payload, messages.Ack)
        verdicts.setdefault(ack.device_id, (received, ack.accepted, ack.reason))
    return verdicts


def worker(
    address: tuple[str, int],
    device_ids: list[str],
    ready: multiprocessing.synchronize.Event,
    go: multiprocessing.synchronize.Event,
    results: multiprocessing.queues.Queue,
) -> None:
    """Hosts many devices: connects them, waits for round 1 and its model, pre-encodes their updates, publishes on
    `go`, and reports (first publish, last ack, accepted count, rejection reasons) in wall-clock seconds."""
    acks: queue.Queue = queue.Queue()
    inbox: queue.Queue = queue.Queue()
    clients = connect_devices(address, device_ids, acks, inbox)
    payloads = encoded_updates(device_ids, *announced_round(clients[0], inbox))
    update_bytes = len(payloads[0])
    ready.set()
    go.wait()
    first_publish = time.time()
    for client, device_id, payload in zip(clients, device_ids, payloads):
        client.publish(topics.UPDATE.build(fleet=FLEET, device=device_id), payload, qos=1)
    del payloads
    verdicts = first_verdicts(acks, len(device_ids))
    for client in clients:
        client.disconnect()
        client.loop_stop()
    results.put(
        {
            "update_bytes": update_bytes,
            "first_publish": first_publish,
            "last_ack": max(v[0] for v in verdicts.values()),
            "accepted": sum(v[1] for v in verdicts.values()),
            "reasons": sorted({v[2] for v in verdicts.values() if not v[1]}),
        }
    )


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds a process (all its threads) has used, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return int(fields[11]) / os.sysconf("SC_CLK_TCK"), int(fields[12]) / os.sysconf("SC_CLK_TCK")


def memory_kb(pid: int, field: str) -> int:
    """VmHWM (peak) or VmRSS (now) of a process, in kB, from /proc/<pid>/status."""
    text = Path(f"/proc/{pid}/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/{pid}/status has no {field} line")
    return int(match.group(1))


def start_coordinator(
    run_dir: Path, devices: int, strategy: str, spool_batch: int, tree: Path
) -> tuple[subprocess.Popen, tuple[str, int]]:
    """The coordinator process (the code of `tree`) with its embedded broker; returns it and the broker's
    (host, port)."""
    command = [
        sys.executable,
        "-m",
        "coordinator",
        "run",
        "--fleet",
        FLEET,
        "--run-dir",
        str(run_dir),
        "--strategy",
        strategy,
        "--rounds",
        "2",
        "--quorum",
        str(devices),
        "--min-devices",
        str(devices),
        "--round-timeout",
        str(ROUND_SECONDS),
        "--init-samples",
        "0",
        "--validation-samples",
        "10",
        "--test-samples",
        "100",
        "--no-device-eval",
        "--torch-threads",
        "1",
        "--spool-batch",
        str(spool_batch),
        "--json",
    ]
    environment = {**os.environ, "PYTHONPATH": str(tree)}
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment, cwd=tree
    )  # run from the tree: `python -m` puts the working folder first on the path
    assert process.stderr is not None  # stderr=PIPE
    line = process.stderr.readline()
    match = re.search(r"mqtt://([\d.]+):(\d+)", line)
    if match is None:
        process.kill()
        raise RuntimeError(f"coordinator did not report its broker: {line!r}{process.stderr.read()}")
    return process, (match.group(1), int(match.group(2)))


def ready_fake_devices(
    address: tuple[str, int], devices: int, workers: int
) -> tuple[list[multiprocessing.process.BaseProcess], multiprocessing.synchronize.Event, multiprocessing.queues.Queue]:
    """Worker processes hosting `devices` fake devices, each worker with its updates encoded and waiting for the
    returned `go` event; their reports arrive on the returned queue."""
    ids = [f"dev-{index:03d}" for index in range(devices)]
    context = multiprocessing.get_context("spawn")
    ready = [context.Event() for _ in range(workers)]
    go, results = context.Event(), context.Queue()
    processes: list[multiprocessing.process.BaseProcess] = [
        context.Process(target=worker, args=(address, ids[index::workers], ready[index], go, results))
        for index in range(workers)
    ]
    for process in processes:
        process.start()
    for event in ready:
        if not event.wait(CONNECT_SECONDS):
            raise RuntimeError("fake devices did not get ready in time")
    return processes, go, results


def drain(stream: IO[str], sink: Callable[[str], object]) -> None:
    """Hands every line of a child's pipe to `sink` until the pipe closes (a reader thread's whole job)."""
    for line in stream:
        sink(line)


def run_load(devices: int, workers: int, strategy: str, spool_batch: int, tree: tuple[str, Path]) -> dict:
    """One load run with `devices` fake devices spread over `workers` processes, the coordinator (the code of the
    named tree) group-committing at most `spool_batch` messages per fsync."""
    with tempfile.TemporaryDirectory(prefix="load-") as folder:
        run_dir = Path(folder) / "run"
        coordinator, address = start_coordinator(run_dir, devices, strategy, spool_batch, tree[1])
        assert coordinator.stdout is not None and coordinator.stderr is not None  # both PIPE
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=drain, args=(coordinator.stdout, lines.put), daemon=True).start()
        stderr_tail: collections.deque = collections.deque(maxlen=20)  # drained, or a full pipe would block it
        threading.Thread(target=drain, args=(coordinator.stderr, stderr_tail.append), daemon=True).start()
        try:
            processes, go, results = ready_fake_devices(address, devices, workers)
            rss_before, cpu_before = memory_kb(coordinator.pid, "VmRSS"), cpu_seconds(coordinator.pid)
            go.set()
            reports = [results.get(timeout=ROUND_SECONDS) for _ in processes]
            round_line = json.loads(lines.get(timeout=ROUND_SECONDS))
            peak, cpu_after = memory_kb(coordinator.pid, "VmHWM"), cpu_seconds(coordinator.pid)
            for process in processes:
                process.join()
        finally:
            coordinator.send_signal(signal.SIGTERM)
            coordinator.wait(timeout=60)
        with sqlite3.connect(run_dir / "run.sqlite") as db:
            closed_at, accepted = db.execute("SELECT closed_at, accepted FROM rounds WHERE round_id = 1").fetchone()
    first = min(r["first_publish"] for r in reports)
    last_ack = max(r["last_ack"] for r in reports)
    return {
        "tree": tree[0],
        "devices": devices,
        "strategy": strategy,
        "spool_batch": spool_batch,
        "update_mb": round(reports[0]["update_bytes"] / 2**20, 3),
        "accepted_acks": sum(r["accepted"] for r in reports),
        "accepted_in_store": accepted,
        "lost_or_rejected": devices - min(accepted, sum(r["accepted"] for r in reports)),
        "rejections": sorted({x for r in reports for x in r["reasons"]}),
        "updates_per_second": round(devices / (last_ack - first), 1),
        "seconds_last_update_to_close": round(closed_at - last_ack, 3),
        "coordinator_rss_before_mb": round(rss_before / 1024, 1),
        "coordinator_peak_rss_mb": round(peak / 1024, 1),
        "coordinator_peak_above_idle_mb": round((peak - rss_before) / 1024, 1),
        "round_seconds_reported": round_line.get("seconds"),
        "coordinator_cpu_ms_per_update": round(1000 * (sum(cpu_after) - sum(cpu_before)) / devices, 3),
        "coordinator_system_ms_per_update": round(1000 * (cpu_after[1] - cpu_before[1]) / devices, 3),
    }


def named_tree(text: str) -> tuple[str, Path]:
    """NAME=DIR: a checkout whose coordinator a row runs."""
    name, _, folder = text.partition("=")
    if not name or not Path(folder, "coordinator").is_dir():
        raise argparse.ArgumentTypeError(f"expected NAME=DIR with DIR a checkout, got {text[:100]!r}")
    return name, Path(folder).resolve()


def add_trees_option(parser: argparse.ArgumentParser, help_text: str) -> None:
    """`--trees NAME=DIR ...`: the checkouts whose code a benchmark runs in turn (default: this one)."""
    parser.add_argument(
        "--trees",
        nargs="+",
        type=named_tree,
        default=[("this", Path(__file__).resolve().parents[1])],
        metavar="NAME=DIR",
        help=help_text,
    )


def add_ratios(rows: list[dict], baseline_tree: str) -> None:
    """Each row's speed against one fsync per update (same tree), and its speed and memory against the baseline
    tree's row of the same setting (same run, same machine)."""

    def key(row: dict) -> tuple:
        return row["strategy"], row["devices"], row["spool_batch"]

    batch_1 = {(r["tree"], r["strategy"], r["devices"]): r["updates_per_second"] for r in rows if r["spool_batch"] == 1}
    baseline = {key(r): r for r in rows if r["tree"] == baseline_tree}
    for row in rows:
        if (row["tree"], row["strategy"], row["devices"]) in batch_1:
            row["speedup_vs_batch_1"] = round(
                row["updates_per_second"] / batch_1[row["tree"], row["strategy"], row["devices"]], 2
            )
        if row["tree"] != baseline_tree:
            base = baseline[key(row)]
            row[f"speed_vs_{baseline_tree}"] = round(row["updates_per_second"] / base["updates_per_second"], 2)
            row[f"cpu_per_update_vs_{baseline_tree}"] = round(
                row["coordinator_cpu_ms_per_update"] / base["coordinator_cpu_ms_per_update"], 2
            )
            row[f"peak_above_idle_mb_minus_{baseline_tree}"] = round(
                row["coordinator_peak_above_idle_mb"] - base["coordinator_peak_above_idle_mb"], 1
            )


def main() -> int:
    """Runs every K and prints the JSON summary; exit status 1 if any update was lost or rejected."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, nargs="+", default=[10, 100, 500])
    parser.add_argument("--workers", type=int, default=4, help="processes hosting the fake devices")
    parser.add_argument(
        "--spool-batch",
        type=int,
        nargs="+",
        default=[1, 32],
        help="the coordinator's group-commit bounds to compare (1: one fsync per update, the baseline)",
    )
    parser.add_argument(
        "--strategy", nargs="+", default=["avefl"], help="avefl/fedavg stream; median keeps every update (for contrast)"
    )
    add_trees_option(
        parser,
        "coordinators to compare, each the code of one checkout (before=DIR after=DIR), run in turn for every row; "
        "the first is the baseline of the ratios",
    )
    args = parser.parse_args()
    os.environ.setdefault("PYTHONPATH", str(Path(__file__).resolve().parents[1]))
    rows = [
        run_load(k, min(args.workers, k), strategy, batch, tree)
        for strategy in args.strategy
        for k in args.devices
        for batch in args.spool_batch
        for tree in args.trees
    ]
    add_ratios(rows, args.trees[0][0])
    print(json.dumps({"cores": os.cpu_count(), "rows": rows}, indent=2))
    lost = [r for r in rows if r["accepted_acks"] != r["devices"] or r["accepted_in_store"] != r["devices"]]
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
