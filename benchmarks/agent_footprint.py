# The agent's peak RSS per phase (idle, receive, score, label, train, publish) over a real round, for each profile.
"""Prints one JSON object. For every device profile in firmware_configs/ it starts the real agent process
(`fl-bench device`: `edge-agent run` over a shard) against a real mosquitto, announces one round as the coordinator
does (the model, and its ONNX bundle for an onnxruntime profile) and reads the agent's own per-phase peaks (its `footprint` log line: /proc VmHWM,
reset at each phase) and its status's overall peak. Two rounds per profile: a full round (score, label, train,
publish) and a score-only round (the device is not a participant: it acquires labels but does not train).

Settings (the issue's): pool 4000, 10 MC passes, 400 labels, 5 epochs, batch 32, one acquisition.
Targets for the Pi Zero 2 W profile: full round <= 250 MB, score-only round <= 120 MB."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.simulate import BenchSettings, DeviceLaunch, spawn_agent, write_shards  # noqa: E402
from coordinator.fleet.broker import EmbeddedBroker  # noqa: E402
from coordinator.setup.server_data import load_server_data  # noqa: E402
from coordinator.setup.settings import InitSettings, ServerSettings  # noqa: E402
from edge_agent.learning.models import build_model, get_weights  # noqa: E402
from edge_agent.loop.profile import load_profile  # noqa: E402
from export.bundle_writer import ensure_bundle_files  # noqa: E402
from protocol import messages, topics, wire  # noqa: E402
from protocol.model_spec import DEFAULT_SPEC  # noqa: E402
from protocol.mqtt import BrokerAddress, MqttSession  # noqa: E402
from protocol.tensors import weights_hash  # noqa: E402

FLEET = "footprint"
TARGETS_MB = {"raspberry-pi-zero-2w": {"full": 250.0, "score_only": 120.0}}


def recipe(pool_labels: int, epochs: int) -> messages.Recipe:
    """The round recipe of the measurement."""
    return messages.Recipe(
        labels_per_acquisition=pool_labels, epochs=epochs, batch_size=32, mc_passes=10, sampler="entropy"
    )


class Announcer:
    """Plays the coordinator: retains a round's model (and bundle) and announcement; hears the device's status."""

    def __init__(self, address: BrokerAddress, work: Path) -> None:
        self.session = MqttSession(address, client_id="footprint-coordinator", session_expiry=0)
        self.session.connect(timeout=10)
        self.session.subscribe(topics.STATUS.filter(fleet=FLEET))
        self.weights = get_weights(build_model(seed=0))
        self.model_hash = weights_hash(self.weights)
        model = wire.encode(messages.ModelMessage(self.model_hash, DEFAULT_SPEC, self.weights))
        self.session.publish(topics.MODEL.build(fleet=FLEET, hash=self.model_hash), model, retain=True, wait=10)
        files = ensure_bundle_files(self.weights, work / "bundle")
        bundle = wire.encode(messages.BundleMessage(self.model_hash, files))
        self.session.publish(topics.BUNDLE.build(fleet=FLEET, hash=self.model_hash), bundle, retain=True, wait=10)

    def announce(self, round_id: int, round_recipe: messages.Recipe, participants: list[str]) -> None:
        """Retains the round's announcement."""
        announcement = messages.RoundAnnouncement(
            "footprint", round_id, self.model_hash, round_recipe, time.time() + 3600, False, participants
        )
        self.session.publish(topics.ROUND.build(fleet=FLEET), wire.encode(announcement), retain=True, wait=10)

    def wait_idle_after(self, round_id: int, timeout: float) -> messages.Status:
        """The device's status once it reports round `round_id` done."""
        return idle_after(self.session, round_id, timeout)


def idle_after(session: MqttSession, round_id: int, timeout: float) -> messages.Status:
    """The status a device retains once it reports round `round_id` done, read from `session` (subscribed to it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        message = session.next_message(timeout=0.5)
        if message is None or not message.payload:
            continue
        status = wire.decode(message.payload, messages.Status)
        if status.state == "idle" and status.round_id >= round_id:
            return status
    raise TimeoutError(f"the device did not finish round {round_id} within {timeout:.0f}s")


def footprint_lines(log_file: Path) -> list[dict[str, float]]:
    """The agent's `footprint` log lines as dicts of phase -> MB, in order."""
    rows = []
    for line in log_file.read_text(errors="replace").splitlines():
        if "footprint round=" in line:
            fields = line.split("peak_rss_mb ", 1)[1].split()
            rows.append({key: float(value) for key, value in (field.split("=") for field in fields)})
    return rows


def measure_profile(profile: Path, launch: DeviceLaunch, broker: EmbeddedBroker, labels: int, epochs: int) -> dict:
    """Runs a score-only round, then a full round, with a fresh agent process; returns the peaks."""
    name = load_profile(profile).name
    with tempfile.TemporaryDirectory() as work:
        announcer = Announcer(broker.address, Path(work))
        agent = spawn_agent(
            launch, broker.address, FLEET, BenchSettings(agent_profile=profile, agent_threads=2)
        ).process
        try:
            started = time.monotonic()
            announcer.announce(1, recipe(labels, epochs), participants=["someone-else"])
            score_only = announcer.wait_idle_after(1, 900)
            announcer.announce(2, recipe(labels, epochs), participants=[])
            full = announcer.wait_idle_after(2, 900)
            seconds = time.monotonic() - started
        finally:
            agent.terminate()
            agent.wait(timeout=30)
            announcer.session.close()
    phases = footprint_lines(launch.log_file)
    return {
        "profile": name,
        "score_only_round": {**phases[0], "status_peak_mb": score_only.peak_rss_mb},
        "full_round": {**phases[1], "status_peak_mb": full.peak_rss_mb},
        "seconds": round(seconds, 1),
        "targets_mb": TARGETS_MB.get(name),
    }


def main() -> None:
    """Measures every profile (or those named) and prints the JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles", nargs="*", type=Path, default=sorted((ROOT / "firmware_configs").glob("*.toml")))
    parser.add_argument("--pool-size", type=int, default=4000)
    parser.add_argument("--labels", type=int, default=400)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as work, EmbeddedBroker(Path(work) / "broker") as broker:
        settings = ServerSettings(run_dir=Path(work), init=InitSettings(samples=100))
        data = load_server_data(settings)
        for index, profile in enumerate(args.profiles):
            bench = BenchSettings(devices=1, partition="iid", pool_size=args.pool_size, seed=index)
            [launch] = write_shards(data, bench, Path(work) / f"profile-{index}")
            rows.append(measure_profile(profile, launch, broker, args.labels, args.epochs))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"pool_size": args.pool_size, "labels": args.labels, "epochs": args.epochs, "profiles": rows}))


if __name__ == "__main__":
    main()
