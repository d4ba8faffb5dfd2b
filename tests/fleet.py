# Test helpers for fault tests: real coordinator and agent processes against a real mosquitto, tiny settings.
from __future__ import annotations

import functools
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.simulate import BenchSettings, DeviceLaunch, spawn_agent, write_shards
from coordinator.rounds.rules import RoundPolicy
from coordinator.setup.server_data import ServerData, load_server_data
from coordinator.setup.settings import InitSettings, ServerSettings
from edge_agent.data.device_data import LABELS_FILE
from edge_agent.data.labelled_record import source_code
from edge_agent.learning.models import build_model, get_weights
from export.bundle_writer import ensure_bundle_files
from protocol import messages, topics, wire
from protocol.files import load_arrays
from protocol.model_spec import DEFAULT_SPEC
from protocol.mqtt import BrokerAddress, MqttSession
from protocol.tensors import weights_hash

# `python -m MODULE ARGS` with torch unimportable, as on a device installed with '.[agent]' only:
# [sys.executable, "-c", WITHOUT_TORCH, MODULE, *ARGS].
WITHOUT_TORCH = """
import runpy, sys
class RefuseTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"torch is not installed on this device ({name})")
sys.meta_path.insert(0, RefuseTorch())
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""

INIT_SAMPLES = 50
VALIDATION_SAMPLES = 100
LABELS = 40
WAIT = 120.0  # upper bound for a fleet event; every wait returns as soon as the event happens

# The coordinator's tiny run: W0 from 50 images, 40 labels a round, 1 epoch, 500 test images.
TINY_RUN = [
    "--init-samples",
    str(INIT_SAMPLES),
    "--init-epochs",
    "2",
    "--validation-samples",
    str(VALIDATION_SAMPLES),
    "--test-samples",
    "500",
    "--no-device-eval",
    "--labels-per-acquisition",
    str(LABELS),
    "--epochs",
    "1",
    "--mc-passes",
    "2",
    "--batch-size",
    "20",
    "--torch-threads",
    "1",
    "--log-level",
    "info",
    "--seed",
    "0",
]


@functools.lru_cache(maxsize=1)
def server_data() -> ServerData:
    """Fashion-MNIST with the server's share reserved exactly as the coordinator processes reserve it."""
    settings = ServerSettings(
        run_dir=Path("unused"), init=InitSettings(samples=INIT_SAMPLES), validation_samples=VALIDATION_SAMPLES
    )
    return load_server_data(settings)


def fleet_shards(directory: Path, devices: int, partition: str = "iid", pool_size: int = 200) -> list[DeviceLaunch]:
    """The bench's per-device shards (deterministic for a seed), with state and log paths under `directory`."""
    return write_shards(
        server_data(), BenchSettings(devices=devices, partition=partition, pool_size=pool_size), directory
    )


def start_coordinator(
    address: BrokerAddress | None, run_dir: Path, fleet: str, *options: str, prelude: str | None = None
) -> subprocess.Popen:
    """`python -m coordinator run` against the broker (None: its embedded one), logging to RUN_DIR/coordinator.log;
    with a `prelude`, `python -c PRELUDE coordinator run ...` instead (the prelude runs the module, as WITHOUT_TORCH)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    broker = ["--broker", address.url] if address is not None else []
    command = [
        sys.executable,
        *(["-m"] if prelude is None else ["-c", prelude]),
        "coordinator",
        "run",
        *broker,
        "--fleet",
        fleet,
        "--run-dir",
        str(run_dir),
        *TINY_RUN,
        *options,
    ]
    with open(run_dir / "coordinator.log", "ab") as log_stream:
        return subprocess.Popen(
            command, stdout=log_stream, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )


def start_agent(launch: DeviceLaunch, address: BrokerAddress, fleet: str) -> subprocess.Popen:
    """The real `python -m bench device` of one device (the bench's own launcher)."""
    return spawn_agent(launch, address, fleet, BenchSettings(agent_threads=1)).process


def wait_until(condition: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    """Polls `condition` every 20 ms; fails the test naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(0.02)


def wait_exit(process: subprocess.Popen, what: str, timeout: float = WAIT) -> int:
    """The process's exit code; fails the test if it is still running after `timeout` seconds."""
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{what} did not exit within {timeout:.0f}s") from None


def kill(process: subprocess.Popen) -> None:
    """SIGKILL, and reap it."""
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)


def stop_all(processes: list[subprocess.Popen]) -> None:
    """Ends every still-running process a test started (on failure too)."""
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)


def committed_rounds(run_dir: Path) -> list[tuple[int, int]]:
    """(round id, accepted updates) of every committed round, read without touching the coordinator's store."""
    path = run_dir / "run.sqlite"
    if not path.exists():
        return []
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as connection:
        try:
            return connection.execute("SELECT round_id, accepted FROM rounds ORDER BY round_id").fetchall()
        except sqlite3.OperationalError:
            return []


def oracle_labels(state_dir: Path) -> np.ndarray:
    """The indices a device's labelled store holds from the oracle, read from its file (no agent needed)."""
    path = state_dir / LABELS_FILE
    if not path.exists():
        return np.zeros(0, dtype=np.int64)
    arrays = load_arrays(path)
    return arrays["indices"][arrays["sources"] == source_code("oracle")]


def log_text(path: Path) -> str:
    """A process's log so far ('' before it exists)."""
    return path.read_text(errors="replace") if path.exists() else ""


class FakeDevice:
    """A raw MQTT client posing as a device: reads the current round and model, publishes chosen payloads."""

    def __init__(self, address: BrokerAddress, fleet: str, device_id: str) -> None:
        self.fleet = fleet
        self.device_id = device_id
        self.session = MqttSession(address, client_id=f"fake-{device_id}", session_expiry=0)
        self.session.connect(timeout=30)
        self.session.subscribe(topics.ACK.build(fleet=fleet, device=device_id))

    def current_round(self, after: int = 0) -> tuple[messages.RoundAnnouncement, dict[str, np.ndarray]]:
        """The first announced round newer than `after`, with its model weights."""
        self.session.subscribe(topics.ROUND.build(fleet=self.fleet))
        announcement: messages.RoundAnnouncement | None = None
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            message = self.session.next_message(timeout=0.5)
            if message is None:
                continue
            if message.topic == topics.ROUND.build(fleet=self.fleet):
                candidate = wire.decode(message.payload, messages.RoundAnnouncement)
                if candidate.round_id > after and not candidate.final:
                    announcement = candidate
                    self.session.subscribe(topics.MODEL.build(fleet=self.fleet, hash=candidate.model_hash))
            elif announcement is not None and message.topic == topics.MODEL.build(
                fleet=self.fleet, hash=announcement.model_hash
            ):
                self.session.unsubscribe(topics.ROUND.build(fleet=self.fleet))
                self.session.unsubscribe(message.topic)
                return announcement, wire.decode(message.payload, messages.ModelMessage).tensors
        raise AssertionError(f"no round after {after} announced within {WAIT:.0f}s")

    def update(
        self, announcement: messages.RoundAnnouncement, tensors: dict[str, np.ndarray], **changes
    ) -> messages.Update:
        """A valid update for the announced round carrying these tensors (fields overridable)."""
        fields = dict(
            device_id=self.device_id,
            round_id=announcement.round_id,
            update_id=os.urandom(8).hex(),
            base_hash=announcement.model_hash,
            num_samples=100,
            class_counts=[10] * 10,
            acquired_labels=50,
            metrics={},
            tensors=tensors,
            nonce=os.urandom(16),
        )
        return messages.Update(**{**fields, **changes})

    def announce_online(self) -> None:
        """Publishes the device's retained online status, as an agent does once connected."""
        status = wire.encode(messages.Status(self.device_id, "online", time.time()))
        topic = topics.STATUS.build(fleet=self.fleet, device=self.device_id)
        assert self.session.publish(topic, status, retain=True, wait=30.0)

    def publish(self, payload: bytes, device_id: str | None = None) -> None:
        """Publishes raw bytes on a device's update topic (its own by default) and waits for the broker."""
        topic = topics.UPDATE.build(fleet=self.fleet, device=device_id or self.device_id)
        assert self.session.publish(topic, payload, wait=30.0)

    def acks(self, count: int, timeout: float = WAIT) -> list[messages.Ack]:
        """The next `count` acks on this device's ack topic."""
        received: list[messages.Ack] = []
        deadline = time.monotonic() + timeout
        while len(received) < count and time.monotonic() < deadline:
            message = self.session.next_message(timeout=0.5)
            if message is not None and message.topic.endswith("/ack"):
                received.append(wire.decode(message.payload, messages.Ack))
        assert len(received) == count, f"{self.device_id} got {len(received)} acks, expected {count}"
        return received

    def close(self) -> None:
        """Disconnects cleanly."""
        self.session.close()


def perturbed(tensors: dict[str, np.ndarray], seed: int, scale: float = 0.01) -> dict[str, np.ndarray]:
    """The tensors plus small seeded noise, same dtypes: a plausible trained model."""
    rng = np.random.default_rng(seed)
    return {
        name: (array + scale * rng.standard_normal(array.shape)).astype(array.dtype) for name, array in tensors.items()
    }


def watch_status(address: BrokerAddress, fleet: str) -> MqttSession:
    """A test client that hears every device's status in the fleet."""
    session = MqttSession(address, client_id=f"{fleet}-status-watch", session_expiry=0)
    session.connect(timeout=10)
    session.subscribe(topics.STATUS.filter(fleet=fleet))
    return session


def wait_for_state(session: MqttSession, state: str, timeout: float = WAIT) -> None:
    """Waits until a device reports `state` on its status topic (other messages are skipped)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        message = session.next_message(timeout=0.5)
        status = message is not None and message.topic.endswith("/status")
        if status and wire.decode(message.payload, messages.Status).state == state:
            return
    raise AssertionError(f"no device reported {state!r} within {timeout:.0f}s")


def announce_round(
    address: BrokerAddress, fleet: str, recipe: messages.Recipe, round_id: int = 1, bundle_dir: Path | None = None
) -> str:
    """Retains a round and its model (a fresh paper CNN; with bundle_dir, its ONNX bundle too) as a coordinator
    would; returns the model hash."""
    session = MqttSession(address, client_id=f"{fleet}-announcer", session_expiry=0)
    session.connect(timeout=10)
    weights = get_weights(build_model(seed=1))
    model_hash = weights_hash(weights)
    model = wire.encode(messages.ModelMessage(model_hash, DEFAULT_SPEC, weights))
    session.publish(topics.MODEL.build(fleet=fleet, hash=model_hash), model, retain=True, wait=10)
    if bundle_dir is not None:
        bundle = wire.encode(messages.BundleMessage(model_hash, ensure_bundle_files(weights, bundle_dir)))
        session.publish(topics.BUNDLE.build(fleet=fleet, hash=model_hash), bundle, retain=True, wait=10)
    announcement = messages.RoundAnnouncement("run-t", round_id, model_hash, recipe, time.time() + 600)
    session.publish(topics.ROUND.build(fleet=fleet), wire.encode(announcement), retain=True, wait=10)
    session.close()
    return model_hash


def pi_zero_fleet(run_dir: Path, fleet: str, rounds: int, mc_passes: int) -> tuple[ServerSettings, BenchSettings]:
    """A tiny AveFL run of 2 bench devices on the Pi Zero 2 W profile (onnxruntime, so every round ships a bundle)."""
    settings = ServerSettings(
        run_dir=run_dir,
        fleet=fleet,
        strategy="avefl",
        recipe=messages.Recipe(
            sampler="entropy", labels_per_acquisition=20, epochs=1, mc_passes=mc_passes, batch_size=20
        ),
        policy=RoundPolicy(rounds=rounds, min_devices=2, quorum=2, round_timeout=120),
        init=InitSettings(samples=50, epochs=2),
        validation_samples=100,
        test_samples=300,
        evaluate_devices=False,
    )
    profile = Path(__file__).parent.parent / "firmware_configs" / "raspberry-pi-zero-2w.toml"
    return settings, BenchSettings(devices=2, partition="type1", pool_size=100, agent_profile=profile)
