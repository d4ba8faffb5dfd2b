# A field fleet of its own: 5 RGB classes at 96x96, the MobileNet-style model, a 256 KB broker, people as oracles.
from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from fleet import committed_rounds, start_coordinator, stop_all, wait_exit

from bench.camera_fleet import (
    ANSWERS_FILE,
    POOL_DIR,
    SERVER_FILE,
    SPEC_FILE,
    FleetSettings,
    PeopleAtTheOracles,
    build_fleet,
    camera_agent_command,
    device_dir,
    read_answer_key,
)
from coordinator.dashboard.live import LiveState
from coordinator.dashboard.server import Dashboard, ListenAddress
from coordinator.fleet.broker import EmbeddedBroker
from coordinator.storage.store import RunStore
from edge_agent.data.image_arrays import ImageDataset
from edge_agent.data.image_files import InputSpec
from edge_agent.field.folder_pool import folder_pool_of, open_folder_data
from protocol.model_spec import load_model_spec

FLEET = "cameras"
LIMIT = 256 * 1024
DEVICES = 2


def start_camera(broker: EmbeddedBroker, fleet_dir: Path, number: int, state_dir: Path) -> subprocess.Popen:
    """A real field agent over device NN's camera folder, with the fleet's model spec."""
    command = camera_agent_command(broker.address.url, FLEET, fleet_dir, number, state_dir)
    with open(state_dir.parent / f"cam-{number}.log", "ab") as log:
        return subprocess.Popen(command, stdout=log, stderr=log)


@pytest.mark.integration
def test_a_five_class_rgb_fleet_runs_two_rounds_through_a_256_kb_broker(tmp_path: Path, fashion: ImageDataset):
    fleet_dir = tmp_path / "fleet"
    settings = FleetSettings(DEVICES, per_class=8, test_per_class=10, server_per_class=12, backbone="mobilenet")
    build_fleet(fleet_dir, settings, fashion)
    spec = load_model_spec(fleet_dir / SPEC_FILE).spec
    names = tuple(spec.class_names)
    assert spec.architecture == "mobilenet" and spec.image_shape == (96, 96, 3) and len(names) == 5
    states = [tmp_path / f"cam-{n}" / "state" for n in range(DEVICES)]
    for state in states:
        state.mkdir(parents=True)
    run_dir, people = tmp_path / "run", PeopleAtTheOracles(fleet_dir, states, names)
    with EmbeddedBroker(tmp_path / "broker", max_packet_bytes=LIMIT) as broker:
        coordinator = start_coordinator(
            broker.address,
            run_dir,
            FLEET,
            *("--model-spec", str(fleet_dir / SPEC_FILE), "--dataset", str(fleet_dir / SERVER_FILE)),
            *("--rounds", "2", "--min-devices", "2", "--quorum", "2", "--round-timeout", "300"),
            *("--init-samples", "30", "--validation-samples", "20", "--test-samples", "50", "--mc-passes", "2"),
            *("--labels-per-acquisition", "6", "--epochs", "1", "--sampler", "margin"),
        )
        cameras = [start_camera(broker, fleet_dir, n, state) for n, state in enumerate(states)]
        people.start()
        try:
            assert wait_exit(coordinator, "coordinator", timeout=600) == 0
            assert all(wait_exit(camera, "camera agent", timeout=60) == 0 for camera in cameras)
        finally:
            people.stopped.set()
            stop_all([coordinator, *cameras])
        log = (tmp_path / "broker" / "mosquitto.log").read_text()
    assert committed_rounds(run_dir) == [(1, 2), (2, 2)]
    with RunStore(run_dir, read_only=True) as store:
        model_bytes = sum(array.nbytes for array in store.checkpoints.load(2).values())
        update_sizes = [record.update_bytes for record in store.device_rounds() if record.accepted]
    assert model_bytes > 3 * LIMIT and min(update_sizes) > LIMIT, "every model and update had to be chunked"
    assert "too large" not in log.lower() and "exceeded" not in log.lower()
    for number, state in enumerate(states):
        pool_dir, images = device_dir(fleet_dir, number) / POOL_DIR, InputSpec(3, 96, 96)
        data = open_folder_data(state, pool_dir, 1000, images, 0.0, (state / "labelling",), len(names))
        key = read_answer_key(device_dir(fleet_dir, number) / ANSWERS_FILE, names)
        assert data.count_labels("oracle") == 12, "6 labels per round, from the person, by class name"
        indices, labels = data.labelled()
        assert data.num_classes == 5 and len(indices) == 12
        assert labels.tolist() == [key[folder_pool_of(data).item(int(index)).path] for index in indices]
    with Dashboard(ListenAddress("127.0.0.1", 0), run_dir, LiveState(total_rounds=2), None) as dashboard:
        run = json.load(urllib.request.urlopen(f"{dashboard.url}/api/run", timeout=10))
        per_class = json.load(urllib.request.urlopen(f"{dashboard.url}/api/rounds/2/class-accuracy", timeout=10))
    assert run["model"]["class_names"] == list(names) and run["model"]["input_shape"] == [3, 96, 96]
    assert per_class["classes"] == list(names)
    report = subprocess.run(
        [sys.executable, "-m", "coordinator", "report", str(run_dir)], capture_output=True, text=True, check=True
    )
    html = Path(report.stdout.strip()).read_text()
    assert all(f"{index}: {name}" in html for index, name in enumerate(names)) and "mobilenet" in html
