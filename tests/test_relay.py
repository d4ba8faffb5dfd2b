# A relay's upstream update: built from its committed site round, signed as a central device, its counts checked.
from __future__ import annotations

import dataclasses
import os
import queue
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import msgpack
import numpy as np
import paho.mqtt.client as paho
import pytest
from coordinators import blank_evaluator, local_coordinator
from fleet import FakeDevice, perturbed
from test_pooled_head import HEAD, device_updates, fitted_head, gaussian_classes

from coordinator.dashboard.live import LiveState
from coordinator.dashboard.metrics import render_metrics
from coordinator.fleet.provision import provision
from coordinator.intake.authentication import UpdateAuthenticator
from coordinator.intake.round_aggregator import SuspectPolicy, make_aggregator
from coordinator.intake.scratch import TensorScratch
from coordinator.intake.validation import MAX_CONTRIBUTORS, MAX_REASON_CHARS, Expectation, Rejection, validate_update
from coordinator.relay import RELAY_STRATEGY, Relay, RelaySettings, SiteRounds, upstream_update
from coordinator.rounds.loop import round_expectation
from coordinator.rounds.rules import RoundPolicy, RoundRules
from coordinator.setup.settings import ServerSettings
from coordinator.storage.store import DeviceRoundRecord, RoundRecord, RunStore, StrategyState
from coordinator.strategies.aggregate import ClientUpdate
from coordinator.strategies.means import FedAvg
from coordinator.strategies.pooled_head import SiteStatistics
from edge_agent.learning.models import build_model, get_weights
from protocol import head_statistics, messages, topics, wire
from protocol.errors import UsageError
from protocol.model_spec import DEFAULT_SPEC
from protocol.mqtt import BrokerAddress, MqttSession
from protocol.tensors import spec_of, weights_hash
from protocol.trained_set import STATISTICS_RULE

NUM_CLASSES = DEFAULT_SPEC.num_classes
BASE = get_weights(build_model(seed=1))
SITE_COUNTS = {"dev-00": 30, "dev-01": 50}


def committed_site_round(run_dir: Path) -> RunStore:
    """A relay store whose site round 1 committed two devices' FedAvg (as the relay's RoundCloser commits it)."""
    store = RunStore(run_dir)
    store.checkpoints.save(1, perturbed(BASE, seed=3))
    devices = [
        DeviceRoundRecord(1, device, True, "", count, [count // 10] * 10, None, {}, 1000, 0.0, count // 2)
        for device, count in SITE_COUNTS.items()
    ]
    store.commit_round(RoundRecord(1, 0.0, 1.0, "", None, 40, 2, 0, {}, {}), devices)
    return store


def expectation(authenticator: UpdateAuthenticator | None = None) -> Expectation:
    """Round 1 of the central fleet, from BASE, with relay-00 its relay."""
    check = authenticator.check if authenticator else None
    size = wire.DEFAULT_MAX_MESSAGE_BYTES
    return Expectation(1, weights_hash(BASE), spec_of(BASE), NUM_CLASSES, size, check, relays=("relay-00",))


def rejection(update: messages.Update, expected: Expectation | None = None) -> Rejection:
    """The Rejection a central coordinator gives the update."""
    with pytest.raises(Rejection) as info:
        validate_update(update.device_id, wire.encode(update), expected or expectation())
    assert len(info.value.reason) <= MAX_REASON_CHARS
    return info.value


def test_the_upstream_update_carries_the_site_mean_and_total_count(tmp_path: Path) -> None:
    """num_samples is the site's total, the tensors its committed mean, each device listed with its count; central
    validation accepts it, and a device's update without contributions keeps its old bytes."""
    with committed_site_round(tmp_path / "relay") as store:
        update = upstream_update(store, "relay-00", 1, weights_hash(BASE), DEFAULT_SPEC)
        mean = store.checkpoints.load(1)
    assert (update.num_samples, update.acquired_labels) == (80, 40)
    assert update.class_counts == [8] * NUM_CLASSES
    assert dict(zip(update.contributors, update.contributor_samples)) == SITE_COUNTS
    assert all(np.array_equal(update.tensors[name], mean[name]) for name in mean)
    assert validate_update("relay-00", wire.encode(update), expectation()).num_samples == 80
    plain = dataclasses.replace(update, contributors=[], contributor_samples=[])
    assert b"contributor" not in wire.encode(plain)


def test_a_relay_of_a_frozen_backbone_sends_the_trained_set_of_its_site_mean(tmp_path: Path) -> None:
    """Upstream, a relay is a device: its update carries the tensors the spec trains (here the classifier) of the
    committed site mean, and central validation of that spec accepts it."""
    head = dataclasses.replace(DEFAULT_SPEC, trainable="head")
    with committed_site_round(tmp_path / "relay") as store:
        update = upstream_update(store, "relay-00", 1, weights_hash(BASE), head)
        mean = store.checkpoints.load(1)
    assert list(update.tensors) == ["fc2.weight", "fc2.bias"]
    assert all(np.array_equal(update.tensors[name], mean[name]) for name in update.tensors)
    rules = RoundRules(messages.Recipe(), RoundPolicy(1), spec=head, relays=("relay-00",))
    central = round_expectation(rules, FedAvg(), 1, BASE)
    assert list(validate_update("relay-00", wire.encode(update), central).tensors) == ["fc2.weight", "fc2.bias"]


@pytest.mark.parametrize(
    ("names", "counts", "expected"),
    [
        (["dev-00", "dev-01"], [30, 40], "claims 80 samples, but its 2 contributors reported 70"),
        (["dev-00", "dev-01"], [30, 60], "claims 80 samples, but its 2 contributors reported 90"),
        (["dev-00"], [30, 50], "1 contributors but 2 contributor sample counts"),
        (["dev-00", "dev-00"], [30, 50], "contributors must be distinct device ids: ['dev-00']"),
        (["dev/00", "dev-01"], [30, 50], "contributors must be distinct device ids: ['dev/00']"),
        (["dev-00", "dev-01"], [90, -10], "contributor sample counts must be non-negative"),
        (["x" * 1000, "dev-01"], [30, 50], "contributors must be distinct device ids: ['xxxx"),
    ],
)
def test_a_relay_update_whose_counts_do_not_add_up_is_bad_counts(
    tmp_path: Path, names: list[str], counts: list[int], expected: str
) -> None:
    """A relay may not weigh more (or less) than its devices reported, nor list a device twice or a non-device."""
    with committed_site_round(tmp_path / "relay") as store:
        update = upstream_update(store, "relay-00", 1, weights_hash(BASE), DEFAULT_SPEC)
    refused = rejection(dataclasses.replace(update, contributors=names, contributor_samples=counts))
    assert refused.kind == messages.RejectionKind.BAD_COUNTS
    assert expected in refused.reason


def test_too_many_contributors_is_bad_counts_in_a_bounded_reason(tmp_path: Path) -> None:
    """More than MAX_CONTRIBUTORS devices is refused before anything else is looked at."""
    with committed_site_round(tmp_path / "relay") as store:
        update = upstream_update(store, "relay-00", 1, weights_hash(BASE), DEFAULT_SPEC)
    count = MAX_CONTRIBUTORS + 1
    names = [f"d{index}" for index in range(count)]
    refused = rejection(dataclasses.replace(update, contributors=names, contributor_samples=[0] * count))
    assert (refused.kind, refused.reason) == ("bad_counts", f"{count} contributors, more than {MAX_CONTRIBUTORS}")


def upstream_update_like(update: messages.Update) -> messages.Update:
    """The same relay update with a fresh id and nonce (a second, distinct message)."""
    return dataclasses.replace(update, update_id=uuid.uuid4().hex, nonce=os.urandom(16))


def test_a_secured_central_coordinator_answers_relay_updates_on_the_wire(tmp_path: Path, broker) -> None:
    """A relay provisioned as a device of the central fleet: its unsigned update is bad_signature, its signed update
    claiming more samples than its devices reported is bad_counts, its signed honest update is accepted and weighs
    by the site's total, each answered on its ack topic with the reason."""
    secure = provision("central", 2, tmp_path / "central-secure", prefix="relay")
    key = secure.device_keys["relay-00"]
    store = RunStore(tmp_path / "central")
    session = MqttSession(broker.address, client_id="coordinator-central", manual_ack=True)
    session.connect(timeout=30)
    relay = FakeDevice(broker.address, "central", "relay-00")
    try:
        coordinator = local_coordinator("central", session, store, FedAvg(), blank_evaluator(), RoundPolicy(1))
        authenticator = UpdateAuthenticator(secure.device_keys, store)
        relays = ("relay-00",)
        coordinator.rules = dataclasses.replace(coordinator.rules, authenticator=authenticator, relays=relays)
        coordinator.start()
        opened = coordinator.open(1, BASE, TensorScratch(tmp_path / "scratch"))
        with committed_site_round(tmp_path / "relay") as relay_store:
            honest = upstream_update(relay_store, "relay-00", 1, weights_hash(BASE), DEFAULT_SPEC)
        inflated = dataclasses.replace(upstream_update_like(honest), num_samples=800)
        signed = [wire.signed(wire.encode(update), key) for update in (inflated, upstream_update_like(honest))]
        for payload in (wire.encode(honest), *signed):
            relay.publish(payload)
        for _ in range(50):
            coordinator.handle_next(opened)
            if len(opened.collector.accepted) + opened.collector.rejection_count == 3:
                break
        acks = relay.acks(3)
    finally:
        relay.close()
        session.close()
    assert [(ack.accepted, ack.rejection) for ack in acks] == [
        (False, "bad_signature"),
        (False, "bad_counts"),
        (True, ""),
    ]
    assert acks[0].reason == "bad signature: the update is not signed (no nonce or no signature)"
    assert acks[1].reason == "claims 800 samples, but its 2 contributors reported 80"
    assert opened.collector.accepted["relay-00"].num_samples == 80
    store.close()


def relay_on(upstream: MqttSession, run_dir: Path, store: RunStore) -> Relay:
    """A relay of central fleet `central` as relay-00 over an upstream session (its site session never connects)."""
    site = ServerSettings(run_dir=run_dir, fleet="site", strategy=RELAY_STRATEGY, policy=RoundPolicy(1))
    settings = RelaySettings("relay-00", "central", site)
    site_session = MqttSession(upstream.address, client_id="never-connects")
    rules = RoundRules(messages.Recipe(), site.policy)
    return Relay(settings, upstream, SiteRounds(site, site_session, store, rules), store)


def announcement(
    round_id: int, run_id: str = "run-t", participants: list[str] | None = None
) -> messages.RoundAnnouncement:
    """A central announcement of BASE."""
    return messages.RoundAnnouncement(
        run_id, round_id, weights_hash(BASE), messages.Recipe(), 0.0, False, participants or []
    )


def test_a_relay_restarted_after_its_site_round_committed_answers_it_once_from_its_store(
    tmp_path: Path, broker, sessions
) -> None:
    """A relay killed between committing site round 1 and sending upstream: on restart it does not run the site round
    again but sends the update rebuilt from its store, journals the round, and ignores round 1's announcement (and
    those of another run, or of rounds it was not chosen for) from then on."""
    central = sessions(broker.address, "central-watch")
    central.subscribe(topics.UPDATE.build(fleet="central", device="relay-00"))
    upstream = sessions(broker.address, "relay-00")
    with committed_site_round(tmp_path / "relay") as store:
        relay = relay_on(upstream, tmp_path / "relay", store)
        relay.artefacts.on_model(messages.ModelMessage(weights_hash(BASE), DEFAULT_SPEC, BASE))
        relay.answer(announcement(1), DEFAULT_SPEC)
        message = central.next_message(timeout=10)
        assert message is not None
        sent = wire.decode(message.payload, messages.Update)
        relay.sender.on_ack(messages.Ack("relay-00", 1, sent.update_id, True))
        assert relay.sender.outbox.pending() == [] and relay.last_answered_round == 1
        ignored = [announcement(1), announcement(2, run_id="run-other"), announcement(2, participants=["relay-01"])]
        assert not any(relay.on_announcement(each) or relay.pending for each in ignored)
        relay.on_announcement(announcement(2))
        assert relay.pending == announcement(2)
        assert len(store.rounds()) == 1
    assert (sent.round_id, sent.num_samples, sent.contributors) == (1, 80, ["dev-00", "dev-01"])
    assert central.next_message(timeout=0.5) is None


@pytest.mark.parametrize(("weight", "cap", "samples"), [(1.7, 200, 340), (3.0, 0, 3), (0.0, 200, 0)])
def test_a_secure_site_round_goes_upstream_as_its_summed_weight_and_cumulative_labels(
    tmp_path: Path, weight: float, cap: int, samples: int
) -> None:
    """A secure site round's survivors carry no counts: the relay's samples are their summed weight in samples
    (capped per device; one per device with no cap; none for an abandoned round), its labels the site's so far
    (the record's cumulative count, as a device reports), its contributors the survivors."""
    with RunStore(tmp_path / "relay") as store:
        for round_id, labels in ((1, 15), (2, 22)):
            store.checkpoints.save(round_id, perturbed(BASE, seed=round_id))
            survivors = [DeviceRoundRecord(round_id, d, True, "", 0, [], None, {}, 0, 0.0) for d in SITE_COUNTS]
            metrics = {"secure_aggregation": "committed", "secagg_labels": labels - 15 * (round_id - 1)}
            record = RoundRecord(round_id, 0.0, 1.0, "", None, labels, 2, 0, {}, {**metrics, "secagg_weight": weight})
            store.commit_round(record, survivors)
        update = upstream_update(store, "relay-00", 2, weights_hash(BASE), DEFAULT_SPEC, cap)
    assert (update.num_samples, update.acquired_labels, update.class_counts) == (samples, 22, [])
    assert update.contributors == sorted(SITE_COUNTS)


def test_a_relay_asked_for_device_placed_dp_stops_in_one_line(tmp_path: Path) -> None:
    """A central run with --dp device (a round for this relay or not) stops the relay with a one-line UsageError: its
    site mean would divide the devices' noise shares, leaving the aggregate less noised than the accountant says."""
    upstream = MqttSession(BrokerAddress("127.0.0.1", 1), client_id="relay-00")
    noised = dataclasses.replace(announcement(1), recipe=messages.Recipe(dp="device", dp_noise_multiplier=1.0))
    with RunStore(tmp_path / "relay") as store:
        relay = relay_on(upstream, tmp_path / "relay", store)
        for asked in (noised, dataclasses.replace(noised, participants=["relay-01"])):
            with pytest.raises(UsageError) as caught:
                relay.on_announcement(asked)
            assert "--dp device" in str(caught.value) and "\n" not in str(caught.value)
        assert relay.pending is None and store.rounds() == []
        central = dataclasses.replace(announcement(1), recipe=messages.Recipe(dp="central", dp_noise_multiplier=1.0))
        relay.on_announcement(central)
        assert relay.pending == central


def plain_update(device_id: str, contributors: int, samples: int) -> bytes:
    """A wire v2 update, msgpack by hand, from a device that claims `contributors` site devices of `samples` each."""
    tensors = {
        name: {"dtype": "<f4", "shape": list(array.shape), "data": (array + 0.01).astype("<f4").tobytes()}
        for name, array in BASE.items()
    }
    names = [f"site-{index:02d}" for index in range(contributors)]
    fields = {
        **{"v": 2, "kind": "update", "device_id": device_id, "round_id": 1, "update_id": uuid.uuid4().hex},
        **{"base_hash": weights_hash(BASE), "num_samples": contributors * samples, "acquired_labels": 0},
        **{"class_counts": [0] * NUM_CLASSES, "metrics": {}, "tensors": tensors},
        **{"contributors": names, "contributor_samples": [samples] * contributors},
    }
    return msgpack.packb(fields, use_bin_type=True)


def plain_acks(address: BrokerAddress, fleet: str, sent: dict[str, bytes], handle: Callable[[], None]) -> dict:
    """Publishes each device's payload from a plain paho client on its own update topic and returns each device's
    ack, as msgpack decodes it (`handle`: lets the coordinator take a batch of messages)."""
    acks: queue.Queue = queue.Queue()
    client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="plain-claimer", protocol=paho.MQTTv5)
    client.on_message = lambda _client, _data, message: acks.put(msgpack.unpackb(message.payload, raw=False))
    client.connect(address.host, address.port)
    client.loop_start()
    try:
        for device in sent:
            client.subscribe(topics.ACK.build(fleet=fleet, device=device), qos=1)
        time.sleep(0.5)
        for device, payload in sent.items():
            client.publish(topics.UPDATE.build(fleet=fleet, device=device), payload, qos=1).wait_for_publish(30)
        answered: dict = {}
        deadline = time.monotonic() + 30
        while len(answered) < len(sent) and time.monotonic() < deadline:
            handle()
            while not acks.empty():
                ack = acks.get()
                answered[ack["device_id"]] = ack
        return answered
    finally:
        client.loop_stop()
        client.disconnect()


def test_only_a_device_named_as_a_relay_may_claim_contributors(tmp_path: Path, broker) -> None:
    """An open fleet, FedAvg with the 0.5 share cap: a plain client claiming 10 contributors of 10^8 samples (which
    took 0.9999998 of the round) is refused as not_relay, named in its ack, the store and /metrics; the same claim
    from relay-00, named with --relay, is accepted and its contributors lift its cap."""
    store, live = RunStore(tmp_path / "central"), LiveState(1)
    session = MqttSession(broker.address, client_id="coordinator-central", manual_ack=True)
    session.connect(timeout=30)
    try:
        coordinator = local_coordinator(
            "central", session, store, FedAvg(), blank_evaluator(), RoundPolicy(1), observer=live
        )
        coordinator.rules = dataclasses.replace(coordinator.rules, max_sample_share=0.5, relays=("relay-00",))
        coordinator.start()
        opened = coordinator.open(1, BASE, TensorScratch(tmp_path / "scratch"))
        claims = {device: plain_update(device, 10, 10**8) for device in ("dev-07", "relay-00")}
        acks = plain_acks(broker.address, "central", claims, lambda: coordinator.handle_next(opened))
        kinds, rows = store.rejection_kinds(), store.rejections()
    finally:
        session.close()
        store.close()
    assert (acks["dev-07"]["accepted"], acks["dev-07"]["rejection"]) == (False, "not_relay")
    reason = "'dev-07' names 10 contributors but is no relay of this fleet (fl-coordinator run --relay names them)"
    assert acks["dev-07"]["reason"] == reason
    assert acks["relay-00"]["accepted"] and list(opened.collector.accepted) == ["relay-00"]
    assert kinds == {"not_relay": 1} and [row[:3] for row in rows] == [(1, "dev-07", reason)]
    assert 'fl_updates_rejected_total{reason="not_relay"} 1' in render_metrics(live.counters(), 0, 1)


def test_under_a_pooled_head_a_relay_sends_its_sites_mean_statistics_and_the_centre_fits_the_flat_fleets_head(
    tmp_path: Path,
) -> None:
    """A central recipe of class statistics makes the site round SiteStatistics: its model stays the central one, the
    site's mean statistics are committed as the round's tensors (read back by a relay restarted after the commit:
    its closer restores nothing, whatever the store holds) and go upstream with the site's label count; the centre's
    pooled head over the relay and a direct device is the head the four devices give sent directly."""
    features, labels = gaussian_classes(400, seed=5)
    updates = device_updates(features, labels, np.random.default_rng(6).integers(4, size=len(labels)))
    direct, site_devices = updates[0], updates[1:]
    with RunStore(tmp_path / "relay") as store:
        closer = relay_on(MqttSession(BrokerAddress("127.0.0.1", 1), "unused"), tmp_path / "relay", store).site.closer(
            messages.Recipe(local_rule=STATISTICS_RULE)
        )
        site = closer.strategy
        assert isinstance(site, SiteStatistics)
        base = head_statistics.layout(*HEAD["classifier_fc.weight"].shape)
        aggregator = make_aggregator(site, base, SuspectPolicy(), TensorScratch(tmp_path), model=HEAD, head=HEAD)
        for update in site_devices:
            aggregator.absorb(update)
        assert all(np.array_equal(array, HEAD[name]) for name, array in aggregator.finish(None).weights.items())
        records = [
            DeviceRoundRecord(1, update.device_id, True, "", int(update.num_samples), [], None, {}, 0, 0.0, 0)
            for update in site_devices
        ]
        stored = StrategyState(site.name, site.state() or {}, site.tensors())
        store.commit_round(RoundRecord(1, 0.0, 1.0, "", None, 300, 3, 0, {}, {}), records, stored)
        restarted = relay_on(MqttSession(BrokerAddress("127.0.0.1", 1), "unused"), tmp_path / "relay", store)
        assert restarted.site.closer(messages.Recipe()).strategy.name == RELAY_STRATEGY
        update = upstream_update(store, "relay-00", 1, weights_hash(BASE), DEFAULT_SPEC)
    assert update.num_samples == sum(int(device.num_samples) for device in site_devices)
    relayed = ClientUpdate("relay-00", update.tensors, float(update.num_samples))
    through_relay = fitted_head([direct, relayed], tmp_path / "central")
    flat = fitted_head(updates, tmp_path / "flat")
    for name, array in flat.items():
        np.testing.assert_allclose(through_relay[name], array, rtol=1e-5, atol=1e-6, err_msg=name)
