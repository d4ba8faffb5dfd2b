# End to end over a real mosquitto: real agent processes, real Fashion-MNIST slices, real SQLite and checkpoints.
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from fleet import pi_zero_fleet

from bench.simulate import BenchSettings, simulate
from coordinator.fleet.broker import EmbeddedBroker
from coordinator.intake.observer import RoundResult
from coordinator.rounds.rules import RoundPolicy
from coordinator.setup.settings import InitSettings, ServerSettings
from coordinator.storage.store import RunStore
from protocol import messages, topics, wire
from protocol.mqtt import MqttSession
from protocol.tensors import weights_hash

pytestmark = pytest.mark.integration


class GarbageSender:
    """A rogue client: once round 1 is announced, sends undecodable bytes on an update topic and records the ack."""

    def __init__(self, broker: EmbeddedBroker, fleet: str) -> None:
        self.fleet = fleet
        self.session = MqttSession(broker.address, client_id="intruder")
        self.ack: messages.Ack | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        self.session.connect(timeout=10)
        self.session.subscribe(topics.ROUND.build(fleet=self.fleet))
        self.session.subscribe(topics.ACK.build(fleet=self.fleet, device="intruder"))
        sent = False
        while not self.done.is_set():
            message = self.session.next_message(timeout=0.2)
            if message is None:
                continue
            if message.topic.endswith("/round") and not sent:
                self.session.publish(topics.UPDATE.build(fleet=self.fleet, device="intruder"), b"\xc1not msgpack")
                sent = True
            elif message.topic.endswith("/ack"):
                self.ack = wire.decode(message.payload, messages.Ack)
                self.done.set()
        self.session.close()


def test_three_devices_two_rounds_over_a_real_broker(tmp_path: Path) -> None:
    """3 agents x 2 rounds: the global model changes, the store holds 2 rounds, checkpoints load, garbage is rejected."""
    settings = ServerSettings(
        run_dir=tmp_path / "run",
        fleet="itest",
        strategy="avefl",
        recipe=messages.Recipe(sampler="entropy", labels_per_acquisition=40, epochs=2, mc_passes=4, batch_size=20),
        policy=RoundPolicy(rounds=2, min_devices=3, quorum=3, round_timeout=120),
        init=InitSettings(samples=50, epochs=3),
        validation_samples=100,
        test_samples=500,
    )
    bench = BenchSettings(devices=3, partition="type1", pool_size=200)
    results: list[RoundResult] = []
    with EmbeddedBroker(tmp_path / "broker") as broker:
        intruder = GarbageSender(broker, settings.fleet)
        intruder.thread.start()
        simulate(settings, bench, results.append, broker.address)
        intruder.done.wait(timeout=10)
        intruder.done.set()
        intruder.thread.join(timeout=10)

    assert [r.round_id for r in results] == [1, 2]
    assert all(sorted(r.device_accuracy) == ["dev-00", "dev-01", "dev-02"] for r in results)
    assert results[-1].labels == 50 + 3 * 2 * 40
    assert intruder.ack is not None and not intruder.ack.accepted
    assert intruder.ack.reason.startswith("undecodable")

    with RunStore(settings.run_dir) as store:
        rounds = store.rounds()
        assert [r.round_id for r in rounds] == [1, 2]
        assert all(r.accepted == 3 for r in rounds)
        initial, first, second = (store.checkpoints.load(i) for i in (0, 1, 2))
        assert rounds[1].model_hash != rounds[0].model_hash
        assert any(not np.array_equal(initial[k], first[k]) for k in initial)
        assert any(not np.array_equal(first[k], second[k]) for k in first)
        devices = store.device_rounds(2)
        assert sorted(d.device_id for d in devices) == ["dev-00", "dev-01", "dev-02"]
        assert all(d.acquired_labels == 80 for d in devices)
        assert all(sum(d.class_counts) == d.num_samples == 80 + 50 for d in devices)
        assert sum(store.rejection_counts().values()) >= 1


def test_devices_with_an_onnxruntime_profile_score_with_the_shipped_bundle(tmp_path: Path) -> None:
    """2 agents on the Pi Zero 2 W profile: each round's bundle is exported once, shipped, verified and used."""
    settings, bench = pi_zero_fleet(tmp_path / "run", "ortfleet", rounds=2, mc_passes=30)
    results: list[RoundResult] = []
    with EmbeddedBroker(tmp_path / "broker") as broker:
        simulate(settings, bench, results.append, broker.address)
    assert [r.round_id for r in results] == [1, 2]
    with RunStore(settings.run_dir) as store:
        hashes = [weights_hash(store.checkpoints.load(0)), store.rounds()[0].model_hash]
        serving = weights_hash(store.checkpoints.load(store.serving.serving_version()))
    exported = sorted(p.name for p in (settings.run_dir / "bundles").iterdir())
    assert exported == sorted({*hashes, serving}), "the announced models' bundles, and the serving version's"
    for device in ("dev-00", "dev-01"):
        log = next(settings.run_dir.rglob(f"{device}/agent.log")).read_text()
        assert all(f"bundle stored model={h[:12]}" in log for h in hashes)
        assert "scoring backend=onnxruntime passes=10" in log, "the profile caps MC passes at 10"
        stored = [p.name for p in next(settings.run_dir.rglob(f"{device}/state")).joinpath("bundles").iterdir()]
        assert stored == [hashes[1]], "a device keeps only the current model's bundle"
