# The serving version with real processes: a round made worse on purpose is committed but does not serve, `rollback`
# and `promote` reach devices across a coordinator restart, and a device that joins late gets what serves.
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from fleet import WAIT, FakeDevice, perturbed, server_data, start_coordinator, wait_exit

from coordinator.storage.serving_history import GATE, HELD, PERSON, PROMOTED, ROLLED_BACK
from coordinator.storage.store import RunStore
from edge_agent.learning.bundle import bundle_weights, store_bundle
from edge_agent.learning.models import build_model, get_weights, set_weights
from edge_agent.learning.training import TrainSettings, train_supervised
from edge_agent.loop.artefacts import RoundArtefacts
from edge_agent.loop.inbound import device_router, handle_inbound
from edge_agent.loop.serving import STATE_FILE, ServingSlot, ServingVersion
from export.bundle_writer import ensure_bundle_files
from protocol import topics, wire
from protocol.model_spec import DEFAULT_SPEC
from protocol.mqtt import BrokerAddress, MqttSession
from protocol.serving_messages import ServingMessage
from protocol.tensors import weights_hash

FLEET = "serving"


class ServingFollower:
    """A device that only predicts: it follows the fleet's serving version (the agent's own slot and routes) and
    never trains."""

    def __init__(self, address: BrokerAddress, state_dir: Path, name: str) -> None:
        self.session = MqttSession(address, client_id=f"follower-{name}", session_expiry=0)
        self.session.connect(timeout=30)
        self.artefacts = RoundArtefacts(self.session, FLEET, state_dir / "bundles", state_dir / "backbone")
        self.slot = ServingSlot(FLEET, self.artefacts)
        self.seen: list[int] = []
        self.slot.on_change(lambda version: self.seen.append(version.version))
        self.router = device_router(FLEET, name, lambda _: False, self.receive, self.artefacts, lambda _: None)
        self.router.add(topics.SERVING.bind(fleet=FLEET), self.slot.handle)
        for topic_filter in self.router.filters():
            self.session.subscribe(topic_filter)

    def receive(self, kind: str, payload: bytes) -> None:
        """As the agent takes in a followed artefact."""
        self.artefacts.receive(kind, payload)
        self.slot.settle()

    def serving(self, version: int, timeout: float = WAIT) -> ServingVersion:
        """Handles messages until the slot serves `version`; fails the test after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            current = self.slot.current()
            if current is not None and current.version == version:
                return current
            message = self.session.next_message(timeout=0.2)
            if message is not None:
                handle_inbound(self.router, message, "fleet")
        raise AssertionError(f"serving version {version} never arrived (serving {self.slot.current()})")

    def close(self) -> None:
        """Disconnects."""
        self.session.close()


def trained_on_shuffled_labels(base: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A model made worse on purpose: the round's model trained on 300 images whose labels are shuffled."""
    data = server_data()
    picked = data.device_indices[:300]
    labels = np.random.default_rng(7).permutation(data.dataset.train_labels[picked])
    model = build_model()
    set_weights(model, base)
    train_supervised(model, data.dataset.train_images[picked], labels, TrainSettings(4, 20, 3e-3, optimizer="adam"))
    return get_weights(model)


def person(command: str, run_dir: Path, *options: str) -> str:
    """`python -m coordinator promote|rollback RUN_DIR ...` as a person runs it; its one line."""
    done = subprocess.run(
        [sys.executable, "-m", "coordinator", command, str(run_dir), *options],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.strip()


def serving_round(device: FakeDevice, after: int, tensors_of) -> None:
    """Answers the next round with the model `tensors_of` makes of its base, and waits for the ack."""
    announcement, base = device.current_round(after=after)
    device.publish(wire.encode(device.update(announcement, tensors_of(base))))
    assert device.acks(1)[0].accepted


def test_a_worse_round_does_not_serve_and_people_promote_and_roll_back_across_a_restart(
    tmp_path: Path, broker, processes
) -> None:
    run_dir, options = tmp_path / "run", ("--quorum", "1", "--min-devices", "1")
    follower = ServingFollower(broker.address, tmp_path / "follower", "follower")
    device = FakeDevice(broker.address, FLEET, "dev-bad")
    try:
        processes.append(start_coordinator(broker.address, run_dir, FLEET, "--rounds", "2", *options))
        assert follower.serving(0).model_hash == FakeDevice.current_round(device)[0].model_hash
        serving_round(device, 0, lambda base: perturbed(base, seed=1, scale=1e-6))
        first = follower.serving(1)
        serving_round(device, 1, trained_on_shuffled_labels)
        assert wait_exit(processes[0], "coordinator") == 0
        assert follower.serving(1) == first and follower.seen == [0, 1]
        with RunStore(run_dir) as store:
            events = store.serving.events()
            assert [(e.round_id, e.decision, e.serving, e.who) for e in events] == [
                (1, PROMOTED, 1, GATE),
                (2, HELD, 1, GATE),
            ]
            assert [r.round_id for r in store.rounds()] == [1, 2]
        assert weights_hash(bundle_weights(first.bundle)) == first.model_hash

        assert person("rollback", run_dir) == "W0 (round 0) serves again (was round 1); " + (
            "devices get it as soon as the run's coordinator publishes it"
        )
        processes.append(start_coordinator(broker.address, run_dir, FLEET, "--rounds", "3", *options))
        w0 = follower.serving(0)
        late = ServingFollower(broker.address, tmp_path / "late", "late")
        assert late.serving(0).model_hash == w0.model_hash
        person("promote", run_dir, "--round", "2")
        assert follower.serving(2, timeout=10).version == 2
        serving_round(device, 2, lambda base: perturbed(base, seed=3, scale=1e-6))
        assert wait_exit(processes[1], "restarted coordinator") == 0
        assert follower.serving(3).version == late.serving(3).version == 3
        late.close()
    finally:
        follower.close()
        device.close()
    with RunStore(run_dir) as store:
        decided = [(e.round_id, e.decision, e.serving, e.who) for e in store.serving.events()]
    assert decided[2:] == [(1, ROLLED_BACK, 0, PERSON), (2, PROMOTED, 2, PERSON), (3, PROMOTED, 3, GATE)]
    assert follower.seen == [0, 1, 0, 2, 3]
    assert json.loads((tmp_path / "follower" / "serving" / STATE_FILE).read_text())["version"] == 3
    restarted = ServingSlot(FLEET, artefacts_in(tmp_path / "follower")).current()
    assert restarted is not None and (restarted.version, restarted.bundle.path) == (
        3,
        follower.slot.current().bundle.path,
    )
    (tmp_path / "follower" / "serving" / STATE_FILE).write_text("{not json")
    assert ServingSlot(FLEET, artefacts_in(tmp_path / "follower")).current() is None


def artefacts_in(state_dir: Path) -> RoundArtefacts:
    """A restarted device's artefacts over its state folder (a session that never connects: nothing arrives)."""
    session = MqttSession(BrokerAddress("127.0.0.1", 1), client_id="never-connects")
    return RoundArtefacts(session, FLEET, state_dir / "bundles", state_dir / "backbone")


def test_a_promotion_of_the_held_model_links_its_bundle_and_a_state_folder_that_refuses_the_note_costs_nothing(
    tmp_path: Path, caplog
) -> None:
    weights = get_weights(build_model(seed=3))
    model_hash = weights_hash(weights)
    artefacts = artefacts_in(tmp_path)
    files = ensure_bundle_files(weights, tmp_path / "export", DEFAULT_SPEC)
    artefacts.keep_bundle("bundle", store_bundle(tmp_path / "bundles" / model_hash, files), model_hash)
    slot = ServingSlot(FLEET, artefacts)
    slot.on_message(ServingMessage("r", 4, "../" + model_hash[3:], 1.0))  # no sha256: ignored, nothing followed
    assert slot.current() is None and artefacts.followed == {}
    (tmp_path / "serving" / STATE_FILE).mkdir(parents=True)  # the note cannot be written
    slot.on_message(ServingMessage("r", 4, model_hash, 1.0))
    current = slot.current()
    assert current is not None and (current.version, current.bundle.path) == (4, tmp_path / "serving" / model_hash)
    assert (current.bundle.path / "weights.npz").stat().st_ino == (
        tmp_path / "bundles" / model_hash / "weights.npz"
    ).stat().st_ino
    assert artefacts.followed == {} and "serving version not kept on disk" in caplog.text
