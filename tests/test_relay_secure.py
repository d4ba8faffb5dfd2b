# A relay in a secure central run over a real mosquitto: its site round is a secure round among the site's devices,
# its site mean is its one masked input upstream beside direct devices, and no run folder holds a device's update.
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from coordinators import blank_evaluator, local_coordinator, plain_bytes_in

from coordinator.relay import (
    RELAY_STRATEGY,
    UPSTREAM_SECAGG,
    Relay,
    RelaySettings,
    SiteRounds,
    upstream_session,
    upstream_update,
)
from coordinator.rounds.loop import Coordinator
from coordinator.rounds.rules import RoundPolicy, RoundRules
from coordinator.secure.rounds import INBOUND, OUTBOUND
from coordinator.setup.settings import ServerSettings
from coordinator.storage.store import RoundRecord, RunStore
from coordinator.strategies.means import FedAvg
from edge_agent.data.journal import Journal
from edge_agent.learning.models import build_model, get_weights
from edge_agent.loop.secagg_device import SHARED
from edge_agent.loop.secagg_participant import ADVERTISED_KEY, PENDING_FILE, SecAggParticipant
from protocol import messages, topics, wire
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
        """Closes every device's session."""
        close_all(list(self.sessions.values()))


def site_relay(
    address: BrokerAddress, run_dir: Path, store: RunStore, timeout: float = 15.0
) -> tuple[Relay, list[MqttSession]]:
    """relay-00 of central fleet `central`, coordinating site fleet `site` on the same broker, its site devices
    marked online (they publish no status here)."""
    site = ServerSettings(
        run_dir=run_dir, fleet="site", strategy=RELAY_STRATEGY, policy=RoundPolicy(1, round_timeout=timeout)
    )
    settings = RelaySettings("relay-00", "central", site)
    upstream, site_session = upstream_session(settings, address), MqttSession(address, client_id="coordinator-site")
    upstream.connect(timeout=10)
    site_session.connect(timeout=10)
    site_rounds = SiteRounds(site, site_session, store, RoundRules(messages.Recipe(), site.policy))
    site_rounds.start()
    for device in SITE:
        site_rounds.parts.presence.statuses[device] = messages.Status(device, "online", time.time())
    return Relay(settings, upstream, site_rounds, store), [upstream, site_session]


def central_coordinator(session: MqttSession, store: RunStore, timeout: float) -> Coordinator:
    """The central fleet's secure FedAvg coordinator, the relay and the direct devices marked online."""
    policy = RoundPolicy(1, round_timeout=timeout)
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


# How a test runs central round 1 with relay-00 over a run directory: the central commit.
RelayRun = Callable[[BrokerAddress, Path, Coordinator, Participants, Participants], Weights]


def central_round(coordinator: Coordinator) -> tuple[threading.Thread, list]:
    """Central round 1 from BASE on its own thread, as the coordinator's process runs it; its outcome lands in the
    list."""
    outcome: list = []
    central = threading.Thread(target=lambda: outcome.append(coordinator.run_round(1, BASE)))
    central.start()
    return central, outcome


def pump_while(busy: threading.Thread, *fleets: Participants) -> None:
    """Hands the fleets' devices their stage messages while `busy` runs (a minute at most), so its rounds go on."""
    deadline = time.monotonic() + 60
    while busy.is_alive() and time.monotonic() < deadline:
        for fleet in fleets:
            fleet.pump()


def finish(
    relay: Relay, coordinator: Coordinator, central: tuple[threading.Thread, list], *fleets: Participants
) -> Weights:
    """Runs the relay (until the central run's end) on its own thread while the test's thread pumps the fleets'
    devices until the central round is over; the central commit, nothing plain sent upstream."""
    relaying = threading.Thread(target=relay.run)
    relaying.start()
    pump_while(central[0], *fleets)
    central[0].join(timeout=5)
    weights, _ = central[1][0]
    coordinator.parts.publisher.announce_final(1, weights_hash(weights), RECIPE)
    relaying.join(timeout=10)
    assert not relaying.is_alive()
    assert relay.sender.outbox.pending() == [] and relay.last_answered_round == 1  # nothing plain went upstream
    return weights


def uninterrupted(
    address: BrokerAddress, run_dir: Path, coordinator: Coordinator, site: Participants, direct: Participants
) -> Weights:
    """Central round 1 with relay-00 running throughout: the central commit."""
    with RunStore(run_dir) as store:
        relay, relay_sessions = site_relay(address, run_dir, store)
        try:
            central = central_round(coordinator)
            site.train()
            direct.train()
            return finish(relay, coordinator, central, site, direct)
        finally:
            close_all(relay_sessions)


def close_all(sessions: list[MqttSession]) -> None:
    """Closes the sessions (a relay's, a fleet's)."""
    for session in sessions:
        session.close()


def two_level_round(
    address: BrokerAddress, tmp_path: Path, run: RelayRun = uninterrupted, timeout: float = 30.0
) -> TwoLevelRound:
    """Central secure FedAvg round 1 over relay-00 (three site devices) and two direct devices, run by `run`, each
    secure stage waiting `timeout` seconds at most."""
    central_session = MqttSession(address, client_id="coordinator-central")
    central_session.connect(timeout=10)
    central_store = RunStore(tmp_path / "central")
    site = Participants(address, "site", SITE, tmp_path / "devices")
    direct = Participants(address, "central", DIRECT, tmp_path / "devices")
    try:
        coordinator = central_coordinator(central_session, central_store, timeout)
        weights = run(address, tmp_path / "relay", coordinator, site, direct)
        with RunStore(tmp_path / "relay") as relay_store:
            upstream = upstream_update(relay_store, "relay-00", 1, weights_hash(BASE), DEFAULT_SPEC, CAP)
            site_mean, records = relay_store.checkpoints.load(1), (central_store.rounds()[0], relay_store.rounds())
        assert len(records[1]) == 1  # one committed site round, however the relay ran
        return TwoLevelRound(weights, records[0], site_mean, records[1][0], upstream, site, direct)
    finally:
        site.close()
        direct.close()
        central_session.close()
        central_store.close()


def expected_central(done: TwoLevelRound) -> Weights:
    """The central commit a round over the relay's site mean (weighing one capped device) and the direct devices
    must give: their weighted mean."""
    inputs = [(done.site_mean, device_weight(done.upstream.num_samples, CAP))]
    inputs += [(done.direct_devices.trained[d], device_weight(n, CAP)) for d, (n, _) in DIRECT.items()]
    assert inputs[0][1] == 1.0  # the site's 390 samples weigh as much as one device holding the cap
    return {
        name: np.average([tensors[name] for tensors, _ in inputs], axis=0, weights=[w for _, w in inputs])
        for name in BASE
    }


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

    assert max(float(np.abs(done.weights[n] - expected_central(done)[n]).max()) for n in BASE) < 1e-5
    assert done.central.metrics["secure_aggregation"] == "committed" and done.central.metrics["secagg_survivors"] == 3
    assert done.central.labels == 15 + sum(labels for _, labels in DIRECT.values())
    everyone = {**done.site_devices.trained, **done.direct_devices.trained}
    assert plain_bytes_in(tmp_path / "relay", everyone, BASE) == []
    assert plain_bytes_in(tmp_path / "central", everyone, BASE) == []


def upstream_stage(relay: Relay) -> str:
    """Where the relay's part in the central secure round stands (its participant's saved state)."""
    participant = relay.secure.participant()
    assert participant is not None and participant.device is not None
    return participant.device.state.stage


def answer_then_crash(relay: Relay, sessions: list[MqttSession]) -> None:
    """relay.run's turns up to the crash: the retained announcement and model taken up (keys advertised), the round
    answered (site round committed, the site's weighted delta pending), the central roster handled (its shares sent);
    then, once the share delivery has reached the relay's session, the sessions closed with no graceful step."""
    for topic_filter in relay.router.filters():
        relay.session.subscribe(topic_filter)
    deadline = time.monotonic() + 30
    while (relay.last_answered_round < 1 or upstream_stage(relay) != SHARED) and time.monotonic() < deadline:
        relay.step()
    deadline = time.monotonic() + 30  # its own wait: on a loaded machine the steps above can take most of theirs
    while not relay.session.has_message() and time.monotonic() < deadline:
        time.sleep(0.05)
    close_all(sessions)


def restarted(
    address: BrokerAddress, run_dir: Path, coordinator: Coordinator, site: Participants, direct: Participants
) -> Weights:
    """Central round 1 with relay-00 crashed as `answer_then_crash` says (its store's connection gone with it), then
    a new Relay over a new store, SiteRounds and sessions (same run directory and client ids, as run_relay builds
    them) run to the end while only the direct devices are pumped; no site device is asked anything again."""
    with RunStore(run_dir) as store:
        relay, relay_sessions = site_relay(address, run_dir, store, timeout=8)
        central = central_round(coordinator)
        site.train()
        direct.train()
        crashing = threading.Thread(target=answer_then_crash, args=(relay, relay_sessions))
        crashing.start()
        pump_while(crashing, site, direct)
    assert upstream_stage(relay) == SHARED and (run_dir / UPSTREAM_SECAGG / PENDING_FILE).exists()
    unhandled = relay.session.next_message(timeout=1)  # received by the crashed relay, never handled
    assert unhandled is not None and isinstance(wire.decode_any(unhandled.payload, OUTBOUND), messages.ShareDelivery)
    with RunStore(run_dir) as store:
        relay, relay_sessions = site_relay(address, run_dir, store, timeout=8)
        try:
            weights = finish(relay, coordinator, central, direct)
        finally:
            close_all(relay_sessions)
    assert not any(session.has_message() for session in site.sessions.values())
    return weights


def sent_kinds(watcher: MqttSession) -> list[str]:
    """The kinds of the secure-round messages the watcher saw relay-00 send upstream, in order."""
    kinds = []
    while (message := watcher.next_message(timeout=0.5)) is not None:
        kinds.append(wire.decode_any(message.payload, INBOUND).KIND)
    return kinds


def test_a_relay_restarted_mid_secure_round_masks_its_site_mean_once(broker, tmp_path, sessions) -> None:
    """A relay crashed after its site round committed and its site's delta went to SecureRounds (keys advertised,
    shares sent), with the central share delivery received but not handled, then rebuilt over the same run
    directory: it does not run its site round again nor advertise a second key set (the retained announcement seen
    again, the journal says which round's keys went out), it takes the delivery again and masks its pending delta,
    so the central round commits what the uninterrupted run commits, with nothing plain in any run folder and
    nothing in the relay's outbox. (The crash point is the deterministic one after the shares went out; while the
    relay's upstream session acknowledged messages on receipt, the delivery was lost there and the round abandoned.)"""
    watcher = sessions(broker.address, "watch-relay-00")
    watcher.subscribe(topics.SECAGG_UP.build(fleet="central", device="relay-00"))
    done = two_level_round(broker.address, tmp_path, restarted, timeout=8)
    once_each = ["secagg_keys", "secagg_shares", "secagg_ack", "secagg_masked", "secagg_confirm", "secagg_reveal"]
    assert sent_kinds(watcher) == once_each
    assert Journal(tmp_path / "relay" / UPSTREAM_SECAGG / "journal.json").get(ADVERTISED_KEY) == 1
    assert done.site.metrics["secure_aggregation"] == "committed" and done.site.metrics["secagg_survivors"] == 3
    assert done.central.metrics["secure_aggregation"] == "committed" and done.central.metrics["secagg_survivors"] == 3
    assert max(float(np.abs(done.weights[n] - expected_central(done)[n]).max()) for n in BASE) < 1e-5
    everyone = {**done.site_devices.trained, **done.direct_devices.trained}
    assert plain_bytes_in(tmp_path / "relay", everyone, BASE) == []
    assert plain_bytes_in(tmp_path / "central", everyone, BASE) == []
