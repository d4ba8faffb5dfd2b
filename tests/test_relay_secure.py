# A relay in a secure central run over a real mosquitto: its site round is a secure round among the site's devices,
# its site mean is its one masked input upstream beside direct devices, and no run folder holds a device's update.
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from coordinators import blank_evaluator, local_coordinator, plain_bytes_in

from coordinator.mean_strategies import FedAvg
from coordinator.relay import RELAY_STRATEGY, Relay, RelaySettings, SiteRounds, upstream_update
from coordinator.rounds import Coordinator, RoundPolicy, RoundRules
from coordinator.server import ServerSettings
from coordinator.store import RoundRecord, RunStore
from edge_agent.data.journal import Journal
from edge_agent.learning.models import build_model, get_weights
from edge_agent.loop.secagg_participant import SecAggParticipant
from protocol import messages, topics
from protocol.model_spec import DEFAULT_SPEC
from protocol.mqtt import BrokerAddress, MqttSession
from protocol.secagg.weighting import device_weight
from protocol.tensors import Weights, weights_hash

CAP = 200
RECIPE = messages.Recipe(secure_aggregation="secagg", secagg_sample_cap=CAP)
SITE = {"site-0": (40, 3), "site-1": (100, 0), "site-2": (250, 12)}  # samples, labels acquired so far
DIRECT = {"direct-0": (60, 4), "direct-1": (150, 2)}
BASE = get_weights(build_model(seed=0))


class Participants:
    """SecAggParticipant devices of one fleet, each on its own session, pumped from the test's thread."""

    def __init__(self, address: BrokerAddress, fleet: str, devices: dict[str, tuple[int, int]], folder: Path) -> None:
        self.fleet, self.devices = fleet, devices
        generator = np.random.default_rng(len(devices))
        self.trained = {
            device: {
                name: (array + generator.normal(0, 0.01, array.shape)).astype(np.float32)
                for name, array in BASE.items()
            }
            for device in devices
        }
        self.sessions: dict[str, MqttSession] = {}
        self.participants: dict[str, SecAggParticipant] = {}
        for device in devices:
            session = MqttSession(address, client_id=device)
            session.connect(timeout=10)
            session.subscribe(topics.SECAGG_DOWN.build(fleet=fleet, device=device))
            (folder / device).mkdir(parents=True)
            journal = Journal(folder / device / "state.json")
            self.sessions[device] = session
            self.participants[device] = SecAggParticipant(fleet, device, session, folder / device, journal)

    def train(self) -> None:
        """Every device advertises its keys for round 1 and keeps its trained update, masked once its shares arrive."""
        announcement = messages.RoundAnnouncement("run", 1, weights_hash(BASE), RECIPE, time.time() + 60)
        for device, (samples, labels) in self.devices.items():
            update = messages.Update(device, 1, "u", "", samples, [], labels, {}, self.trained[device])
            self.participants[device].begin(announcement)
            self.participants[device].send_update(update, BASE, DEFAULT_SPEC, RECIPE)

    def pump(self) -> None:
        """Hands each device the stage messages waiting for it."""
        for device, session in self.sessions.items():
            message = session.next_message(timeout=0.01)
            if message is not None:
                self.participants[device].on_message(message)
                session.acknowledge(message)

    def fedavg(self) -> Weights:
        """The FedAvg a secure round over these devices commits: weights min(samples, cap) / cap."""
        weights = [device_weight(samples, CAP) for samples, _ in self.devices.values()]
        return {
            name: np.average([self.trained[d][name] for d in self.devices], axis=0, weights=weights) for name in BASE
        }

    def close(self) -> None:
        for session in self.sessions.values():
            session.close()


def site_relay(address: BrokerAddress, run_dir: Path, store: RunStore) -> tuple[Relay, list[MqttSession]]:
    """relay-00 of central fleet `central`, coordinating site fleet `site` on the same broker, its site devices
    marked online (they publish no status here)."""
    site = ServerSettings(
        run_dir=run_dir, fleet="site", strategy=RELAY_STRATEGY, policy=RoundPolicy(1, round_timeout=15)
    )
    upstream, site_session = (
        MqttSession(address, client_id="relay-00"),
        MqttSession(address, client_id="coordinator-site"),
    )
    upstream.connect(timeout=10)
    site_session.connect(timeout=10)
    site_rounds = SiteRounds(site, site_session, store, RoundRules(messages.Recipe(), site.policy))
    site_rounds.start()
    for device in SITE:
        site_rounds.parts.presence.statuses[device] = messages.Status(device, "online", time.time())
    return Relay(RelaySettings("relay-00", "central", site), upstream, site_rounds, store), [upstream, site_session]


def central_coordinator(session: MqttSession, store: RunStore) -> Coordinator:
    """The central fleet's secure FedAvg coordinator, the relay and the direct devices marked online."""
    policy = RoundPolicy(1, round_timeout=30)
    coordinator = local_coordinator("central", session, store, FedAvg(), blank_evaluator(), policy, RECIPE)
    coordinator.start()
    for device in ("relay-00", *DIRECT):
        coordinator.parts.presence.statuses[device] = messages.Status(device, "online", time.time())
    return coordinator


@dataclass
class TwoLevelRound:
    """What a central secure round over a relay and direct devices left: the central commit and record, the relay's
    committed site mean and record, the upstream update it masked, and the device fleets (their plain updates)."""

    weights: Weights
    central: RoundRecord
    site_mean: Weights
    site: RoundRecord
    upstream: messages.Update
    site_devices: Participants
    direct_devices: Participants


def drive(relay: Relay, coordinator: Coordinator, site: Participants, direct: Participants) -> Weights:
    """Runs central round 1 and the relay (until the central run's end) on their own threads while the test's
    thread pumps every device; the central commit."""
    outcome: list = []
    central = threading.Thread(target=lambda: outcome.append(coordinator.run_round(1, BASE)))
    relaying = threading.Thread(target=relay.run)
    central.start()
    relaying.start()
    site.train()
    direct.train()
    deadline = time.monotonic() + 60
    while central.is_alive() and time.monotonic() < deadline:
        site.pump()
        direct.pump()
    central.join(timeout=5)
    weights, _ = outcome[0]
    coordinator.parts.publisher.announce_final(1, weights_hash(weights), RECIPE)
    relaying.join(timeout=10)
    assert not relaying.is_alive()
    assert relay.sender.outbox.pending() == [] and relay.last_answered_round == 1  # nothing plain went upstream
    return weights


def two_level_round(address: BrokerAddress, tmp_path: Path) -> TwoLevelRound:
    """Central secure FedAvg round 1 over relay-00 (three site devices) and two direct devices."""
    central_session = MqttSession(address, client_id="coordinator-central")
    central_session.connect(timeout=10)
    central_store, relay_store = RunStore(tmp_path / "central"), RunStore(tmp_path / "relay")
    relay, relay_sessions = site_relay(address, tmp_path / "relay", relay_store)
    site = Participants(address, "site", SITE, tmp_path / "devices")
    direct = Participants(address, "central", DIRECT, tmp_path / "devices")
    try:
        weights = drive(relay, central_coordinator(central_session, central_store), site, direct)
        upstream = upstream_update(relay_store, "relay-00", 1, weights_hash(BASE), DEFAULT_SPEC, CAP)
        site_mean, records = relay_store.checkpoints.load(1), (central_store.rounds()[0], relay_store.rounds()[0])
        return TwoLevelRound(weights, records[0], site_mean, records[1], upstream, site, direct)
    finally:
        site.close()
        direct.close()
        for session in (central_session, *relay_sessions):
            session.close()
        central_store.close()
        relay_store.close()


def test_a_relay_runs_its_site_round_securely_and_its_site_sum_is_one_masked_input_upstream(broker, tmp_path) -> None:
    """Every level secure: the relay commits its site's FedAvg (learning only the site's sum) and enters the central
    round as one participant weighing device_weight(its site's summed weight in samples), capped like a device's;
    the central commit is the weighted mean over the relay and the direct devices; neither run folder holds any
    device's update."""
    done = two_level_round(broker.address, tmp_path)
    expected_site = done.site_devices.fedavg()
    assert max(float(np.abs(done.site_mean[n] - expected_site[n]).max()) for n in BASE) < 1e-5
    assert done.site.metrics["secure_aggregation"] == "committed" and done.site.metrics["secagg_survivors"] == 3
    site_weight = sum(device_weight(samples, CAP) for samples, _ in SITE.values())
    assert abs(done.site.metrics["secagg_weight"] - site_weight) < 1e-6
    assert (done.upstream.num_samples, done.upstream.acquired_labels) == (round(site_weight * CAP), 15)
    assert done.upstream.contributors == sorted(SITE)

    inputs = [(done.site_mean, device_weight(done.upstream.num_samples, CAP))]
    inputs += [(done.direct_devices.trained[d], device_weight(n, CAP)) for d, (n, _) in DIRECT.items()]
    expected = {
        name: np.average([tensors[name] for tensors, _ in inputs], axis=0, weights=[w for _, w in inputs])
        for name in BASE
    }
    assert inputs[0][1] == 1.0  # the site's 390 samples weigh as much as one device holding the cap
    assert max(float(np.abs(done.weights[n] - expected[n]).max()) for n in BASE) < 1e-5
    assert done.central.metrics["secure_aggregation"] == "committed" and done.central.metrics["secagg_survivors"] == 3
    assert done.central.labels == 15 + sum(labels for _, labels in DIRECT.values())
    everyone = {**done.site_devices.trained, **done.direct_devices.trained}
    assert plain_bytes_in(tmp_path / "relay", everyone, BASE) == []
    assert plain_bytes_in(tmp_path / "central", everyone, BASE) == []
