# Virtual devices (issue 14): many agents in a few worker processes learn exactly as one process per device does.
from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from bench.cli import main as bench_main
from bench.simulate import BenchSettings, simulate
from coordinator.intake.observer import RoundResult
from coordinator.rounds.rules import RoundPolicy
from coordinator.setup.settings import InitSettings, ServerSettings
from protocol import messages

pytestmark = pytest.mark.integration


def tiny_bench(run_dir: Path, fleet: str, rounds: int, devices: int) -> ServerSettings:
    """A bench small enough for a test: 60-image pools, 10 labels a round, 1 epoch, no per-device evaluation."""
    return ServerSettings(
        run_dir=run_dir,
        fleet=fleet,
        recipe=messages.Recipe(labels_per_acquisition=10, epochs=1, mc_passes=2, batch_size=10),
        policy=RoundPolicy(rounds=rounds, quorum=devices, round_timeout=600),
        init=InitSettings(samples=100, epochs=2),
        validation_samples=100,
        test_samples=500,
        evaluate_devices=False,
    )


def test_virtual_devices_learn_exactly_as_one_process_per_device(tmp_path: Path) -> None:
    """The same seed gives the same accuracies, labels and per-layer divergences in both modes: devices sharing a
    worker do not perturb each other's randomness."""
    outcomes = []
    for process_per_device in (True, False):
        results: list[RoundResult] = []
        settings = tiny_bench(tmp_path / f"run-{process_per_device}", "same", rounds=2, devices=3)
        bench = BenchSettings(devices=3, partition="iid", pool_size=60, process_per_device=process_per_device)
        simulate(settings, bench, results.append)
        outcomes.append([(r.round_id, r.accuracy, r.labels, r.divergence) for r in results])
    processes, virtual = outcomes
    assert [round_id for round_id, *_ in virtual] == [1, 2]
    assert virtual == processes
    assert (tmp_path / "run-False" / "workers" / "worker-01.json").exists(), "3 devices ran in 2 workers"


def kill_worker_once_serving(log_file: Path, devices_file: Path, done: threading.Event) -> None:
    """Kills (SIGKILL) the worker hosting `devices_file` as soon as its log says it serves its devices."""
    while not done.is_set():
        if log_file.exists() and "host serving" in log_file.read_text():
            for pid in (name for name in os.listdir("/proc") if name.isdigit()):
                try:
                    command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if str(devices_file).encode() in command:
                    os.kill(int(pid), signal.SIGKILL)
                    return
        time.sleep(0.05)


def test_a_killed_worker_takes_its_devices_and_the_round_goes_on(tmp_path: Path, caplog) -> None:
    """SIGKILL on one of two workers: its devices are named dead at once and the round closes with the others'
    updates instead of waiting for the 600 s deadline."""
    settings = tiny_bench(tmp_path / "run", "killed", rounds=1, devices=4)
    settings = dataclasses.replace(settings, recipe=dataclasses.replace(settings.recipe, epochs=3))
    workers = settings.run_dir / "workers"
    done = threading.Event()
    killer = threading.Thread(
        target=kill_worker_once_serving, args=(workers / "worker-01.log", workers / "worker-01.json", done)
    )
    killer.start()
    results: list[RoundResult] = []
    started = time.monotonic()
    try:
        with caplog.at_level("ERROR", logger="bench.simulate"):
            simulate(settings, BenchSettings(devices=4, partition="iid", pool_size=60, workers=2), results.append)
    finally:
        done.set()
        killer.join()
    assert time.monotonic() - started < 300
    assert [sorted(r.divergence) for r in results] == [["dev-00", "dev-02"]]
    errors = sorted(record.getMessage() for record in caplog.records if record.levelname == "ERROR")
    assert [error.split(" log=")[0] for error in errors] == [
        "agent died device=dev-01 exit=-9",
        "agent died device=dev-03 exit=-9",
    ]


@pytest.mark.parametrize("text", ["not json", '{"devices": [{"device_id": "dev-00"}]}', '{"hosts": []}'])
def test_a_malformed_devices_file_is_refused_in_one_line(tmp_path: Path, capsys, text: str) -> None:
    """`fl-bench host` names the file and what is wrong with it, in at most 300 characters, and starts nothing."""
    devices = tmp_path / "worker.json"
    devices.write_text(text)
    assert bench_main(["host", "--devices", str(devices)]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"fl-bench: {devices} is not a devices file: ") and len(error) <= 300
