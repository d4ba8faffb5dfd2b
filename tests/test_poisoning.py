# Robust aggregation over a real broker (issue #5): 4 honest devices and one sending random weights at x50. Plain AveFL
# collapses; the coordinate median and --exclude-suspects keep the global accuracy of the clean run.
from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from fleet import FakeDevice, fleet_shards, server_data

from bench.oracle import SimulatedOracle
from bench.shard import load_shard, open_device_data
from coordinator.intake.observer import RoundResult
from coordinator.intake.round_aggregator import SuspectPolicy
from coordinator.rounds.rules import RoundPolicy
from coordinator.server import run_server
from coordinator.setup.server_data import initial_weights
from coordinator.setup.settings import InitSettings, ServerSettings
from coordinator.storage.store import RunStore
from edge_agent.loop.agent import Agent
from edge_agent.loop.agent_settings import AgentSettings
from protocol import messages, wire
from protocol.model_spec import DEFAULT_SPEC
from protocol.mqtt import BrokerAddress, MqttSession
from protocol.tensors import weights_hash

pytestmark = pytest.mark.integration

FLEET = "poison"
ATTACKER = "dev-04"
RECIPE = messages.Recipe(sampler="random", labels_per_acquisition=60, epochs=3, batch_size=20, mc_passes=2)
TEST_SAMPLES = 1000


@pytest.fixture(scope="module")
def round_one(tmp_path_factory, module_broker) -> tuple[dict, dict[str, bytes]]:
    """W0 and the encoded round-1 updates of 4 honest devices (IID shards), trained by the agent's own code."""
    torch.set_num_threads(1)  # the trained weights depend on the thread count; earlier tests may have set any
    work = tmp_path_factory.mktemp("honest")
    base = initial_weights(ServerSettings(run_dir=work, init=InitSettings(epochs=30)), server_data())
    announcement = messages.RoundAnnouncement("poison-run", 1, weights_hash(base), RECIPE, time.time() + 600)
    session = MqttSession(module_broker.address, client_id="honest-devices", session_expiry=0)
    session.connect(timeout=30)
    payloads = {}
    try:
        for launch in fleet_shards(work, devices=4):
            shard = load_shard(launch.shard)
            agent = Agent(
                AgentSettings(FLEET, launch.device_id),
                session,
                open_device_data(launch.state_dir, shard),
                SimulatedOracle(shard.all_labels),
            )
            payloads[launch.device_id] = wire.encode(agent.rounds.run(announcement, DEFAULT_SPEC, base))
    finally:
        session.close()
    return base, payloads


def random_at_fifty_times_the_scale(payload: bytes) -> bytes:
    """Random weights 50 times as large as an honest update's, re-labelled as the attacker's (all else valid).

    (Scaling the honest weights by +50 would not do: this ReLU network has no normalisation layer, so a positively
    scaled model predicts the same classes and drags the average much less than it seems.)
    """
    honest = wire.decode(payload, messages.Update)
    rng = np.random.default_rng(50)
    tensors = {
        name: (50.0 * array.std() * rng.standard_normal(array.shape)).astype(array.dtype)
        for name, array in honest.tensors.items()
    }
    return wire.encode(dataclasses.replace(honest, device_id=ATTACKER, update_id="attack", tensors=tensors))


def run_round_one(
    run_dir: Path,
    address: BrokerAddress,
    base: dict,
    payloads: dict[str, bytes],
    strategy: str,
    exclude_suspects: bool = False,
) -> RoundResult:
    """A real coordinator (thread) runs round 1 from W0 while a raw client publishes the given device payloads."""
    fleet = run_dir.name
    with RunStore(run_dir) as store:
        store.checkpoints.save(0, base)  # the coordinator resumes from this W0 instead of training its own
    settings = ServerSettings(
        run_dir=run_dir,
        fleet=fleet,
        strategy=strategy,
        recipe=RECIPE,
        policy=RoundPolicy(rounds=1, min_devices=len(payloads), quorum=len(payloads), round_timeout=120),
        test_samples=TEST_SAMPLES,
        evaluate_devices=False,
        suspects=SuspectPolicy(exclude=exclude_suspects),
        torch_threads=1,
    )
    results: list[RoundResult] = []
    coordinator = threading.Thread(target=run_server, args=(settings, address, results.append, server_data()))
    coordinator.start()
    sender = FakeDevice(address, fleet, "sender")
    try:
        announcement, _ = sender.current_round()
        assert announcement.model_hash == weights_hash(base)
        for device_id, payload in payloads.items():
            sender.publish(payload, device_id=device_id)
    finally:
        sender.close()
        coordinator.join(timeout=120)
    assert not coordinator.is_alive() and len(results) == 1
    return results[0]


def test_median_and_excluding_suspects_survive_a_device_sending_random_weights_at_fifty_times_the_scale(
    tmp_path: Path,
    module_broker,
    round_one,
) -> None:
    base, honest = round_one
    attacked = {**honest, ATTACKER: random_at_fifty_times_the_scale(honest["dev-00"])}
    clean = run_round_one(tmp_path / "clean", module_broker.address, base, honest, "avefl")
    plain = run_round_one(tmp_path / "plain", module_broker.address, base, attacked, "avefl")
    median = run_round_one(tmp_path / "median", module_broker.address, base, attacked, "median")
    excluded = run_round_one(
        tmp_path / "excluded", module_broker.address, base, attacked, "avefl", exclude_suspects=True
    )
    print(
        f"accuracy clean={clean.accuracy:.4f} avefl={plain.accuracy:.4f} median={median.accuracy:.4f} "
        f"excluded={excluded.accuracy:.4f}"
    )

    assert clean.accuracy > 0.4  # a real model, so that a collapse is visible
    assert plain.accuracy < clean.accuracy - 0.2
    # The median of 5 weakly trained models loses a little (2.3 points here with one thread), never the collapse
    assert median.accuracy >= clean.accuracy - 0.05
    assert excluded.accuracy == clean.accuracy
    for result in (plain, median, excluded):
        assert list(result.suspects) == [ATTACKER]  # flagged whatever the strategy; honest devices are not
    assert excluded.report["excluded"] == [ATTACKER]
    with RunStore(tmp_path / "excluded") as store:
        assert store.rounds()[0].report["suspects"].keys() == {ATTACKER}
        # leaving the attacker out gives exactly the clean aggregate of the same honest updates
        clean_model = RunStore(tmp_path / "clean").checkpoints.load(1)
        assert all(np.array_equal(store.checkpoints.load(1)[name], clean_model[name]) for name in clean_model)
