# Issue 33's attacks on secure aggregation replayed over a real mosquitto: three real device participants, and a
# malicious coordinator colluding with one device ("mal"), written as a plain paho + msgpack + cryptography client.
from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from coordinators import RoundThread, evaluator_of
from secagg_attacker import (
    MASK_PURPOSE,
    MaliciousCoordinator,
    Party,
    PlainDevice,
    agreed,
    combine,
    commitment,
    flat_tensors,
    prg,
    seal,
    split,
    unseal,
)

from bench.secagg_fleet import provisioned
from coordinator.dashboard.live import LiveState
from coordinator.dashboard.metrics import render_metrics
from coordinator.storage.store import RunStore
from edge_agent.data.journal import Journal
from edge_agent.learning.models import build_model, get_weights
from edge_agent.loop.secagg_participant import SecAggParticipant
from protocol import messages, topics
from protocol.credentials import DeviceIdentity
from protocol.model_spec import DEFAULT_SPEC, trainable_names
from protocol.mqtt import MqttSession
from protocol.secagg.fixed_point import FixedPoint, flat
from protocol.secagg.weighting import device_weight, in_fixed_units, weighted_delta
from protocol.tensors import Weights, weights_hash

FLEET, RUN = "attacked", "run"
HONEST = ["dev0", "dev1", "dev2"]
TARGET = "dev0"
RECIPE = messages.Recipe(secure_aggregation="secagg", secagg_sample_cap=200)  # FedAvg weights, as in the issue
THRESHOLD, SUMMANDS = 2, 4  # 4 devices: 3 neighbours each (a complete graph), a strict majority of them
SAMPLES, LABELS = 150, 4


class HonestFleet:
    """The three honest devices (the project's participants, each on its own MQTT session, with their identity keys
    and the fleet's roster where `identities` gives them), run by one thread that hands them their messages and the
    test's actions in turn."""

    def __init__(
        self, address, tmp_path: Path, base: Weights, identities: dict[str, DeviceIdentity] | None = None
    ) -> None:
        self.base = base
        self.actions: queue.Queue = queue.Queue()
        self.sessions, self.participants = {}, {}
        generator = np.random.default_rng(5)
        self.trained = {
            d: {n: (a + generator.normal(0, 0.01, a.shape)).astype(np.float32) for n, a in base.items()} for d in HONEST
        }
        for device in HONEST:
            session = MqttSession(address, client_id=device)
            session.connect(timeout=10)
            session.subscribe(topics.SECAGG_DOWN.build(fleet=FLEET, device=device))
            (tmp_path / device).mkdir()
            journal = Journal(tmp_path / device / "state.json")
            self.sessions[device] = session
            identity = (identities or {}).get(device)
            self.participants[device] = SecAggParticipant(FLEET, device, session, tmp_path / device, journal, identity)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.pump, daemon=True)
        self.thread.start()

    def pump(self) -> None:
        """The fleet's thread: the test's actions and each device's messages, in turn, until stopped."""
        while not self.stop.is_set():
            with contextlib.suppress(queue.Empty):
                self.actions.get_nowait()()
            for device, session in self.sessions.items():
                message = session.next_message(timeout=0.01)
                if message is not None:
                    self.participants[device].on_message(message)
                    session.acknowledge(message)

    def run(self, action: Callable[[], Any]) -> Any:
        """Runs an action on the fleet's thread and returns its result."""
        done: queue.Queue = queue.Queue()
        self.actions.put(lambda: done.put(action()))
        return done.get(timeout=30)

    def begin(self, round_id: int) -> None:
        """Every device advertises its keys for a round."""
        announcement = messages.RoundAnnouncement(RUN, round_id, weights_hash(self.base), RECIPE, time.time() + 60)
        self.run(lambda: [participant.begin(announcement) for participant in self.participants.values()])

    def train(self, round_id: int, devices: list[str]) -> None:
        """These devices hand their trained update to be masked (sent at once if their shares are in)."""

        def send() -> None:
            for device in devices:
                update = messages.Update(device, round_id, "u", "", SAMPLES, [], LABELS, {}, self.trained[device])
                self.participants[device].send_update(update, self.base, DEFAULT_SPEC, RECIPE)

        self.run(send)

    def stage(self, device: str) -> str:
        """A device's secure-round stage."""
        return self.run(lambda: self.participants[device].device.state.stage)

    def truth(self, device: str) -> np.ndarray:
        """What the device masked, decoded: its weighted delta, weight and labels in fixed point."""
        names = trainable_names(DEFAULT_SPEC, self.base)
        weight = device_weight(SAMPLES, RECIPE.secagg_sample_cap)
        delta = weighted_delta(self.trained[device], self.base, names, weight, RECIPE.secagg_clip, LABELS)
        fixed = FixedPoint(RECIPE.secagg_clip, SUMMANDS)
        return fixed.decode_sum(fixed.encode(flat(in_fixed_units(delta, fixed))))

    def close(self) -> None:
        """Stops the fleet's thread and closes the sessions."""
        self.stop.set()
        self.thread.join(timeout=10)
        for session in self.sessions.values():
            session.close()


class Attack:
    """One round the malicious coordinator runs against the honest fleet, up to the masked inputs."""

    def __init__(self, fleet: HonestFleet, mal: MaliciousCoordinator, round_id: int) -> None:
        self.fleet, self.mal, self.round_id = fleet, mal, round_id
        self.context = f"{RUN}/{round_id}".encode()
        fleet.begin(round_id)
        adverts = mal.collect("secagg_keys", len(HONEST))
        self.parties = {d: Party(a["cipher_key"], a["mask_key"]) for d, a in adverts.items()} | {mal.me: mal.keys}
        for device in HONEST:
            peers = self.neighbours(device)
            mal.send(
                device,
                "secagg_roster",
                run_id=RUN,
                device_id=device,
                round_id=round_id,
                graph_seed=b"any",
                threshold=THRESHOLD,
                min_survivors=2,
                clip=RECIPE.secagg_clip,
                max_summands=SUMMANDS,
                advertised=SUMMANDS,
                neighbours=peers,
                cipher_keys=[self.parties[p].cipher_public for p in peers],
                mask_keys=[self.parties[p].mask_public for p in peers],
            )
        self.bundles = mal.collect("secagg_shares", len(HONEST))
        self.stolen = {owner: self.opened(owner) for owner in HONEST}  # mal's own share of each honest seed

    def neighbours(self, device: str) -> list[str]:
        """Everyone else: four devices make a complete graph."""
        return sorted(set(self.parties) - {device})

    def opened(self, owner: str) -> bytes:
        """The share of the owner's seed that the owner sealed for the colluding device."""
        bundle = self.bundles[owner]
        sealed = bundle["ciphertexts"][bundle["recipients"].index(self.mal.me)]
        share = unseal(self.mal.keys, sealed, self.context, (owner, self.mal.me))
        assert share is not None
        return share

    def records_for(self, device: str) -> tuple[list[str], list[bytes]]:
        """Every record addressed to a device: the other honest devices' and the colluder's own (a real share)."""
        senders, sealed = [], []
        for owner in HONEST:
            if owner != device:
                bundle = self.bundles[owner]
                senders.append(owner)
                sealed.append(bundle["ciphertexts"][bundle["recipients"].index(device)])
        peers = self.neighbours(self.mal.me)
        share = split(b"\x01" * 32, THRESHOLD, len(peers))[peers.index(device)]
        record, _ = seal(self.mal.keys, self.parties[device].cipher_public, self.context, (self.mal.me, device), share)
        return [*senders, self.mal.me], [*sealed, record]

    def deliver(self, device: str, count: int | None = None) -> None:
        """Sends a device its records (only the first `count` of them when given)."""
        senders, sealed = self.records_for(device)
        self.mal.send(
            device,
            "secagg_delivery",
            device_id=device,
            round_id=self.round_id,
            senders=senders[:count],
            ciphertexts=sealed[:count],
        )

    def partner(self, device: str) -> None:
        """Tells a device to mask with all its neighbours."""
        self.mal.send(device, "secagg_mask", device_id=device, round_id=self.round_id, partners=self.neighbours(device))

    def masked(self) -> dict[str, np.ndarray]:
        """Every honest device's shares delivered (acknowledged), updates trained, partners named: each one's masked
        input, kept apart."""
        for device in HONEST:
            self.deliver(device)
        assert all(ack["accused"] == [] for ack in self.mal.collect("secagg_ack", len(HONEST)).values())
        self.fleet.train(self.round_id, HONEST)
        for device in HONEST:
            self.partner(device)
        inputs = self.mal.collect("secagg_masked", len(HONEST))
        return {device: flat_tensors(message["masked"]) for device, message in inputs.items()}

    def split(self, views: dict[str, list[str]]) -> dict[str, dict[str, Any]]:
        """Each honest device told its own view of who survived; their confirmations."""
        for device, survivors in views.items():
            self.mal.send(
                device, "secagg_view", device_id=device, round_id=self.round_id, survivors=survivors, survivor_count=4
            )
        return self.mal.collect("secagg_confirm", len(views))

    def ask(self, holder: str, owner: str, tags: list[bytes], control: tuple[str, bytes]) -> list[bytes]:
        """Asks a holder for its share of the owner's seed once with each tag, then for a share it will give (the
        control: the device answers in order, so once the control's answer is in, every earlier one is); the
        owner's shares that came back."""
        for sender, tag in [*((owner, tag) for tag in tags), control]:
            self.mal.send(
                holder, "secagg_unmask", device_id=holder, round_id=self.round_id, senders=[sender], tags=[tag]
            )
        shares, deadline = [], time.monotonic() + 30
        while time.monotonic() < deadline:
            message = self.mal.collect("secagg_reveal", 1)[holder]
            pairs = dict(zip(message["seed_owners"], message["seed_shares"]))
            shares += [pairs[owner]] if owner in pairs else []
            if control[0] in pairs:
                return shares
        raise AssertionError("the control request got no answer")

    def committed(self, owner: str, seed: bytes) -> bool:
        """Whether a rebuilt seed is the one the owner committed to."""
        return commitment(self.context, owner, seed) == self.bundles[owner]["seed_commitment"]

    def mask_seed(self, secret: bytes, peer: str) -> bytes:
        """The pairwise mask seed of the holder of `secret` with a peer."""
        return agreed(secret, self.parties[peer].mask_public, MASK_PURPOSE, self.context)


def pairwise_seeds(confirmations: dict[str, dict[str, Any]], target: str) -> dict[str, bytes]:
    """Every pairwise seed of the target the confirmations revealed, by its partner."""
    seeds = {}
    for device, message in confirmations.items():
        for peer, seed in zip(message["dropped"], message["pair_seeds"]):
            if target in (device, peer):
                seeds[peer if device == target else device] = seed
    return seeds


def unmasked(masked: np.ndarray, seed: bytes | None, pairs: dict[str, bytes], owner: str) -> np.ndarray:
    """The attacker's best estimate of one device's input: its masked input less every mask it knows, decoded."""
    result = masked.astype(np.uint32, copy=True)
    if seed is not None:
        result -= prg(seed, result.size)
    for peer, pair in pairs.items():
        mask = prg(pair, result.size)
        result = result - mask if owner < peer else result + mask
    return FixedPoint(RECIPE.secagg_clip, SUMMANDS).decode_sum(result)


@pytest.fixture
def attacked(broker, tmp_path):
    base = get_weights(build_model(seed=0))
    fleet = HonestFleet(broker.address, tmp_path, base)
    mal = MaliciousCoordinator(broker.address.host, broker.address.port, FLEET)
    yield fleet, mal
    mal.close()
    fleet.close()


def test_a_device_with_fewer_than_threshold_shares_sends_no_masked_input(attacked) -> None:
    """Issue 33, item 1: a spoofed delivery with no shares, or fewer than the threshold, is refused; the device's
    state is unchanged and nothing masked leaves it; a full delivery then gets its masked input."""
    fleet, mal = attacked
    attack = Attack(fleet, mal, 1)
    fleet.train(1, [TARGET])
    for count in (0, THRESHOLD - 1):
        attack.deliver(TARGET, count)
    attack.deliver(TARGET)  # the device reads its messages in order: the first acknowledgement answers this one
    ack = mal.collect("secagg_ack", 1)[TARGET]
    assert sorted(ack["held"]) == attack.neighbours(TARGET) and fleet.stage(TARGET) == "delivered"
    attack.partner(TARGET)
    assert list(mal.collect("secagg_masked", 1)) == [TARGET]


@pytest.mark.parametrize("target_view", [["dev2", "mal"], ["dev1", "dev2", "mal"]])
def test_split_survivor_views_and_one_colluder_recover_nothing(attacked, target_view) -> None:
    """Issue 33, item 2, the collusion the issue saw (3 honest devices and one attacker, FedAvg): the coordinator
    tells dev1 that dev0 survived and dev2 that it dropped, and dev0 either that dev1 dropped (so dev0 reveals its
    pairwise seed with dev1) or that everyone survived. With one colluder (fewer than t = 2) the attacker rebuilds
    dev0's self-mask seed only in the second case, and then lacks the pairwise mask dev0 shares with dev1: its
    estimate of dev0's input is noise. The test's own knowledge of that one seed (read from dev0's saved state,
    which the attacker does not have) shows the estimate is otherwise exact."""
    fleet, mal = attacked
    attack = Attack(fleet, mal, 1)
    masked = attack.masked()
    confirmations = attack.split({TARGET: target_view, "dev1": ["dev0", "dev2", "mal"], "dev2": ["dev1", "mal"]})
    ours = confirmations[TARGET]
    tags = dict(zip(ours["recipients"], ours["tags"]))
    candidates = [tags["dev1"]] if "dev1" in tags else [*tags.values(), bytes(32)]
    dev2 = confirmations["dev2"]
    control = ("dev2", dev2["tags"][dev2["recipients"].index("dev1")])  # dev2 saw dev1 survive
    shares = attack.ask("dev1", TARGET, candidates, control)
    assert len(shares) == ("dev1" in tags)  # dev1 gives its share only with dev0's own confirmation
    seed = combine([attack.stolen[TARGET], *shares]) if shares else None
    assert (seed is not None and attack.committed(TARGET, seed)) == ("dev1" in tags)
    pairs = pairwise_seeds(confirmations, TARGET)
    pairs["mal"] = attack.mask_seed(mal.keys.mask_secret, TARGET)
    assert sorted(pairs) == (["dev1", "dev2", "mal"] if "dev1" not in tags else ["dev2", "mal"])
    truth = fleet.truth(TARGET)
    estimate = unmasked(masked[TARGET], seed, pairs, TARGET)
    assert np.median(np.abs(estimate - truth)) > RECIPE.secagg_clip / 2  # noise over the whole +-4 range
    if seed is not None:
        secret = fleet.run(lambda: fleet.participants[TARGET].device.state.mask_secret)
        known = {**pairs, "dev1": attack.mask_seed(secret, "dev1")}
        assert np.abs(unmasked(masked[TARGET], seed, known, TARGET) - truth).max() < 1e-6


class PlainForger:
    """A plain device (`PlainDevice`, written from the message layouts) that takes part in a real coordinator's
    secure round on the malicious client's connection and seals a record holding no share, under the pair's MAC,
    for each victim; it settles the complaints against it (`answers`) or stays silent."""

    def __init__(self, mal: MaliciousCoordinator, victims: Callable[[list[str]], list[str]], answers: bool) -> None:
        self.mal, self.answers = mal, answers
        self.device = PlainDevice(mal.me, mal.keys, victims)

    def publish(self, payload: bytes) -> None:
        """One stage message from the forger."""
        self.mal.client.publish(f"fl/{FLEET}/devices/{self.mal.me}/secagg", payload, qos=1).wait_for_publish(30)

    def play(self, round_id: int) -> None:
        """Advertises, shares (forging its victims' records), acknowledges, and settles or ignores complaints."""
        self.publish(self.device.advert(round_id))
        for kind in ["secagg_roster", "secagg_delivery", *(["secagg_key_request"] if self.answers else [])]:
            self.publish(self.device.answer(self.mal.collect(kind, 1)[self.mal.me]))


@pytest.mark.parametrize(
    ("victims", "answers"),
    [(lambda peers: peers[:1], True), (lambda peers: peers, True), (lambda peers: peers, False)],
    ids=["one-reveals", "every-reveals", "every-silent"],
)
def test_a_forged_record_over_mqtt_excludes_the_forger_and_commits_the_honest_mean(
    broker, tmp_path, fashion, victims, answers
) -> None:
    """Issue 33, item 4, against a real coordinator: a plain device seals a record with no share (under the pair's
    MAC) for one neighbour or for every one. Each victim keeps the others' records and complains; the forger reveals
    the record's key (or says nothing) and is excluded; the round commits FedAvg of the three honest devices, the
    forger named in a forged_share rejection, in the round's metrics and in /metrics."""
    base = get_weights(build_model(seed=0))
    fleet = HonestFleet(broker.address, tmp_path, base)
    mal = MaliciousCoordinator(broker.address.host, broker.address.port, FLEET, listen="mal/secagg_in")
    forger = PlainForger(mal, victims, answers)
    session = MqttSession(broker.address, client_id="coordinator")
    store = RunStore(tmp_path / "run")
    live = LiveState(1)
    try:
        thread, outcome = RoundThread(FLEET, session, store, evaluator_of(fashion), RECIPE, live).start(
            [*HONEST, mal.me], base
        )
        fleet.begin(1)
        fleet.train(1, HONEST)
        forger.play(1)
        thread.join(timeout=60)
        weights, _ = outcome[0]
        record = store.rounds()[0]
        kinds = store.rejection_kinds()
    finally:
        mal.close()
        fleet.close()
        session.close()
        store.close()
    expected = {n: np.average([fleet.trained[d][n] for d in HONEST], axis=0) for n in base}  # equal samples
    assert max(float(np.abs(weights[n] - expected[n]).max()) for n in base) < 1e-5
    assert record.metrics["secure_aggregation"] == "committed" and record.metrics["secagg_survivors"] == 3
    reason = record.metrics["secagg_excluded"][mal.me]
    assert reason.startswith("'mal'") and len(reason) <= 300
    assert ("does not open" in reason) == answers and ("did not reveal" in reason) == (not answers)
    assert kinds == {"forged_share": 1}
    assert 'fl_updates_rejected_total{reason="forged_share"} 1' in render_metrics(live.counters(), 0, 1)


def roster_fields(device: str, adverts: dict[str, dict[str, Any]], keys: dict[str, Party]) -> dict:
    """A round 1 roster for `device` listing `keys`' neighbours (the coordinator's choice of keys for each) with each
    neighbour's advert signature (empty for a neighbour that sent none): the graph of that many devices."""
    peers = sorted(keys)
    return {
        "run_id": RUN,
        "device_id": device,
        "round_id": 1,
        "graph_seed": b"any",
        "threshold": len(peers) // 2 + 1,
        "min_survivors": 2,
        "clip": RECIPE.secagg_clip,
        "max_summands": len(peers) + 1,
        "advertised": len(peers) + 1,
        "neighbours": peers,
        "cipher_keys": [keys[p].cipher_public for p in peers],
        "mask_keys": [keys[p].mask_public for p in peers],
        "signatures": [adverts.get(p, {}).get("signature", b"") for p in peers],
    }


@pytest.mark.parametrize("invented", ["ghost", "impostor"])
def test_a_coordinator_cannot_invent_a_neighbour_on_a_provisioned_fleet(broker, tmp_path, invented) -> None:
    """Issue 43: on a provisioned fleet each device checks every neighbour's key advert against the fleet's identity
    roster. The malicious coordinator lists a neighbour it made up ("mal", no identity in the fleet) or puts keys it
    made under an honest device's name (its advert signature then covers other keys): every device it told so sends
    no shares (nothing is sealed for the coordinator's keys), and stays where it was; the same device answers a
    roster of the neighbours' own signed adverts."""
    base = get_weights(build_model(seed=0))
    fleet = HonestFleet(broker.address, tmp_path, base, provisioned(HONEST))
    mal = MaliciousCoordinator(broker.address.host, broker.address.port, FLEET)
    try:
        fleet.begin(1)
        adverts = mal.collect("secagg_keys", len(HONEST))
        assert all(len(advert["signature"]) == 64 for advert in adverts.values())
        own = {d: Party(a["cipher_key"], a["mask_key"]) for d, a in adverts.items()}
        for device in HONEST:
            others = {d: own[d] for d in HONEST if d != device}
            lied = {**others, mal.me: mal.keys} if invented == "ghost" else {**others, min(others): mal.keys}
            mal.send(device, "secagg_roster", **roster_fields(device, adverts, lied))
        assert [m for m in mal.quiet(2.0) if m.get("kind") == "secagg_shares"] == []
        assert {fleet.stage(device) for device in HONEST} == {"advertised"}
        for device in HONEST:
            others = {d: own[d] for d in HONEST if d != device}
            mal.send(device, "secagg_roster", **roster_fields(device, adverts, others))
        assert sorted(mal.collect("secagg_shares", len(HONEST))) == HONEST
    finally:
        mal.close()
        fleet.close()


@pytest.mark.parametrize("signed", [True, False], ids=["provisioned", "open-fleet"])
def test_an_impostor_advert_recovers_nothing_on_a_provisioned_fleet(broker, tmp_path, fashion, signed) -> None:
    """Issue 43, against a real coordinator: a plain client advertises its own keys under dev0's id before dev0
    does, then reads what the coordinator sends dev0. On a provisioned fleet the coordinator refuses the unsigned
    advert (a bad_signature rejection naming dev0's seat), takes dev0's own, and the round commits the three honest
    devices' FedAvg; none of the records sealed for dev0 opens with the impostor's keys. On an open fleet (what
    --secagg-open-fleet-unsafe accepts) the impostor's advert takes dev0's seat (dev0's own is a duplicate) and it
    opens a share of each other device's seed: what the privacy guide says that flag gives up."""
    base = get_weights(build_model(seed=0))
    identities = provisioned(HONEST) if signed else {}
    fleet = HonestFleet(broker.address, tmp_path, base, identities)
    impostor = MaliciousCoordinator(broker.address.host, broker.address.port, FLEET, me=TARGET, listen="dev0/secagg_in")
    seat = PlainDevice(TARGET, impostor.keys)
    session = MqttSession(broker.address, client_id="coordinator")
    store = RunStore(tmp_path / "run")
    roster = {d: identity.roster[d] for d, identity in identities.items()}
    live = LiveState(1)
    try:
        rounds = RoundThread(FLEET, session, store, evaluator_of(fashion), RECIPE, live, roster)
        thread, outcome = rounds.start(HONEST, base)
        up = f"fl/{FLEET}/devices/{TARGET}/secagg"
        impostor.client.publish(up, seat.advert(1), qos=1).wait_for_publish(30)
        time.sleep(0.5)  # the impostor's advert in before dev0's
        fleet.begin(1)
        fleet.train(1, HONEST)
        if not signed:
            impostor.client.publish(up, seat.answer(impostor.collect("secagg_roster", 1)[TARGET]), qos=1)
        delivery = impostor.collect("secagg_delivery", 1)[TARGET]
        thread.join(timeout=60)
        record = store.rounds()[0]
        kinds = store.rejection_kinds()
        refused = [(device, reason) for _, device, reason, _, _ in store.rejections()]
    finally:
        impostor.close()
        fleet.close()
        session.close()
        store.close()
    context = f"{RUN}/1".encode()
    opened = [
        unseal(impostor.keys, sealed, context, (sender, TARGET)) is not None
        for sender, sealed in zip(delivery["senders"], delivery["ciphertexts"])
    ]
    assert len(opened) == 2
    if not signed:
        assert opened == [True, True] and (TARGET, "'dev0' already advertised its keys this round") in refused
        return
    assert opened == [False, False]
    assert kinds == {"bad_signature": 1}
    assert record.metrics["secure_aggregation"] == "committed" and record.metrics["secagg_survivors"] == 3
    expected = {n: np.average([fleet.trained[d][n] for d in HONEST], axis=0) for n in base}
    assert max(float(np.abs(outcome[0][0][n] - expected[n]).max()) for n in base) < 1e-5
    assert 'fl_updates_rejected_total{reason="bad_signature"} 1' in render_metrics(live.counters(), 0, 1)
