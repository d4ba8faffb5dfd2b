# Secure aggregation over a real mosquitto: a coordinator's round against five device participants, the committed
# model (FedAvg of the survivors), a device gone after confirming its view, too many gone (abandoned), the run dir.
from __future__ import annotations

import functools
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from coordinators import FakeSession, RoundThread, evaluator_of, gate_decisions, plain_bytes_in

from coordinator.dashboard.views import RunSnapshot, divergence_view, secure_view
from coordinator.intake.round_aggregator import SuspectPolicy
from coordinator.secure.rounds import check_secure_settings
from coordinator.storage.store import RunStore
from edge_agent.data.journal import Journal
from edge_agent.learning.models import build_model, get_weights
from edge_agent.loop.secagg_participant import SecAggParticipant
from protocol import messages, topics, wire
from protocol.errors import UsageError
from protocol.model_spec import DEFAULT_SPEC
from protocol.mqtt import MqttSession
from protocol.secagg.weighting import device_weight
from protocol.tensors import Weights, weights_hash

FLEET = "secure"
DEVICES = [f"dev{i}" for i in range(5)]
SAMPLES = [40, 100, 250, 10, 60]
LABELS = [3, 0, 12, 5, 7]  # each device's oracle labels so far
RECIPE = messages.Recipe(secure_aggregation="secagg", secagg_sample_cap=200)


class Fleet:
    """Five device participants, each on its own session, pumped from the test's thread."""

    def __init__(self, broker_address, tmp_path: Path, base: Weights) -> None:
        self.sessions: dict[str, MqttSession] = {}
        self.devices: dict[str, SecAggParticipant] = {}
        generator = np.random.default_rng(3)
        self.trained = {
            device: {
                name: (array + generator.normal(0, 0.01, array.shape)).astype(np.float32)
                for name, array in base.items()
            }
            for device in DEVICES
        }
        for device in DEVICES:
            session = MqttSession(broker_address, client_id=device)
            session.connect(timeout=10)
            session.subscribe(topics.SECAGG_DOWN.build(fleet=FLEET, device=device))
            self.sessions[device] = session
            (tmp_path / device).mkdir()
            journal = Journal(tmp_path / device / "state.json")
            self.devices[device] = SecAggParticipant(FLEET, device, session, tmp_path / device, journal)

    def begin(self, base: Weights, masking: list[str]) -> None:
        """Every device advertises its keys; those `masking` keep their trained update (masked once their shares
        arrive), the others never finish training."""
        announcement = messages.RoundAnnouncement("run", 1, weights_hash(base), RECIPE, time.time() + 60)
        for device, samples, labels in zip(DEVICES, SAMPLES, LABELS):
            participant = self.devices[device]
            participant.begin(announcement)
            participant.begin(announcement)  # the retained announcement seen again: no second advert
            if device in masking:
                update = messages.Update(device, 1, "u", "", samples, [], labels, {}, self.trained[device])
                participant.send_update(update, base, DEFAULT_SPEC, RECIPE)

    def pump(self, unmasking: list[str], until: threading.Thread) -> None:
        """Hands each device its messages until the coordinator's thread ends; only `unmasking` devices answer an
        unmask request (the others are gone after confirming their survivor view)."""
        deadline = time.monotonic() + 60
        while until.is_alive() and time.monotonic() < deadline:
            for device, session in self.sessions.items():
                message = session.next_message(timeout=0.01)
                if message is None:
                    continue
                if device in unmasking or not message.payload.count(messages.UnmaskRequest.KIND.encode()):
                    self.devices[device].on_message(message)
                session.acknowledge(message)

    def close(self) -> None:
        for session in self.sessions.values():
            session.close()


def fedavg(trained: dict[str, Weights], base: Weights) -> Weights:
    """The FedAvg a secure round must commit: weights min(samples, cap) / cap."""
    weights = [device_weight(samples, RECIPE.secagg_sample_cap) for samples in SAMPLES]
    return {name: np.average([trained[d][name] for d in DEVICES], axis=0, weights=weights) for name in base}


def secure_round(broker, tmp_path: Path, fashion, unmasking: list[str], masking: list[str]) -> tuple:
    """Runs round 1 of a secure run: `masking` devices send masked inputs, `unmasking` answer the unmask."""
    base = get_weights(build_model(seed=0))
    session = MqttSession(broker.address, client_id="coordinator")
    fleet = Fleet(broker.address, tmp_path, base)
    store = RunStore(tmp_path / "run")
    try:
        thread, outcome = RoundThread(FLEET, session, store, evaluator_of(fashion), RECIPE).start(DEVICES, base)
        fleet.begin(base, masking)
        fleet.pump(unmasking, thread)
        thread.join(timeout=30)
        return base, fleet.trained, outcome[0], store
    finally:
        fleet.close()
        session.close()


def test_a_secure_round_commits_fedavg_and_the_run_holds_no_plain_update(broker, tmp_path, fashion) -> None:
    base, trained, (weights, result), store = secure_round(broker, tmp_path, fashion, DEVICES, DEVICES)
    expected = fedavg(trained, base)
    assert result.report.get("participants") is None
    assert max(float(np.abs(weights[n] - expected[n]).max()) for n in base) < 1e-5
    assert max(float(np.abs(weights[n] - base[n]).max()) for n in base) > 1e-3
    record = store.rounds()[0]
    assert record.metrics["secure_aggregation"] == "committed" and record.metrics["secagg_survivors"] == 5
    assert record.metrics["secagg_labels"] == sum(LABELS) and record.labels == sum(LABELS)
    assert store.rejection_kinds() == {}
    settings = {"settings": {"recipe": {"secure_aggregation": "secagg"}}}
    snapshot = RunSnapshot(settings, store.rounds(), store.device_rounds())
    assert "per-device divergence off" in secure_view(snapshot)["summary"]
    divergence = divergence_view(snapshot, 1)
    assert divergence is not None and divergence["devices"] == ["aggregate"]
    assert divergence["layers"] == sorted(base) and all(0 < value < 1 for value in divergence["values"][0])
    store.checkpoints.save(0, base)
    decided, published = gate_decisions(store, evaluator_of(fashion))  # it pairs the aggregate with W0 only
    assert decided == [(1, "promoted", 1)] and published.published[-1].model_hash == weights_hash(weights)
    store.close()
    assert plain_bytes_in(tmp_path / "run", trained, base) == []
    assert plain_bytes_in(tmp_path / "dev0", trained, base) == []  # the device keeps only its weighted delta


def test_a_device_gone_after_confirming_its_view_still_counts(broker, tmp_path, fashion) -> None:
    base, trained, (weights, _), store = secure_round(broker, tmp_path, fashion, DEVICES[1:], DEVICES)
    expected = fedavg(trained, base)
    assert max(float(np.abs(weights[n] - expected[n]).max()) for n in base) < 1e-5
    assert store.rounds()[0].metrics["secagg_survivors"] == 5
    store.close()


def test_too_many_gone_abandons_the_round_and_reveals_nothing(broker, tmp_path, fashion) -> None:
    base, _, (weights, _), store = secure_round(broker, tmp_path, fashion, DEVICES[:1], DEVICES[:1])
    assert all(np.array_equal(weights[n], base[n]) for n in base)
    metrics = store.rounds()[0].metrics
    assert metrics["secure_aggregation"] == "abandoned" and metrics["secagg_reason"]
    assert metrics["secagg_labels"] == 0 and store.rounds()[0].labels == 0
    store.checkpoints.save(0, base)
    assert gate_decisions(store, evaluator_of(fashion))[0] == [(1, "held", 0)]
    saved = (tmp_path / "run").rglob("secagg-1.rec")
    store.close()
    assert next(saved).exists()


@pytest.mark.parametrize(
    ("strategy", "recipe", "suspects", "asynchronous", "named"),
    [
        ("optfl", RECIPE, SuspectPolicy(), False, "--strategy optfl"),
        ("median", RECIPE, SuspectPolicy(), False, "--strategy median"),
        ("fedavg", RECIPE, SuspectPolicy(exclude=True), False, "--exclude-suspects"),
        ("fedavg", RECIPE, SuspectPolicy(), True, "--mode async"),
        (
            "fedavg",
            messages.Recipe(secure_aggregation="secagg", update_encoding="int8-delta"),
            SuspectPolicy(),
            False,
            "--update-encoding",
        ),
        ("avefl", RECIPE, SuspectPolicy(), False, "--secagg-sample-cap 0"),
    ],
)
def test_conflicts_with_secure_aggregation_are_refused_in_one_line(
    strategy, recipe, suspects, asynchronous, named
) -> None:
    with pytest.raises(UsageError) as caught:
        check_secure_settings(strategy, recipe, suspects, asynchronous)
    assert named in str(caught.value) and "\n" not in str(caught.value)


def test_a_restarted_coordinator_resumes_the_stage_and_sends_its_messages_again(tmp_path) -> None:
    from bench.secagg_fleet import head_updates
    from coordinator.intake.observer import RoundObserver
    from coordinator.intake.update_intake import UpdateIntake
    from coordinator.secure.rounds import LiveParts, LiveSecureRound, start_secure
    from coordinator.secure.secagg_bounds import SumLimits
    from coordinator.secure.secagg_round import SHARES
    from edge_agent.loop.secagg_device import SecAggDevice

    updates = head_updates(4)
    ids = sorted(updates)
    base = {name: np.zeros_like(array) for name, array in updates[ids[0]].items()}
    with RunStore(tmp_path / "run") as store:
        first = FakeSession(FLEET)
        start = functools.partial(start_secure, "run", 1, ids, base, DEFAULT_SPEC, RECIPE)
        limits = SumLimits(equal_weights=False)
        live = LiveSecureRound.opened(
            LiveParts(first, FLEET, UpdateIntake(FLEET, first, store, RoundObserver()), limits), start, 1
        )
        for device in ids:
            live.on_message(device, wire.encode(SecAggDevice.start(device, 1, 1.0, 0.1).advert()))
        rosters = live.server.rosters()
        live.send([wire.encode(roster) for roster in rosters], save=True)
        again = FakeSession(FLEET)
        resumed = LiveSecureRound.opened(
            LiveParts(again, FLEET, UpdateIntake(FLEET, again, store, RoundObserver()), limits), start, 1
        )
    assert resumed.server.state.stage == SHARES and resumed.server.state.advertised == ids
    assert again.published == first.published and len(again.published) == 4
    assert {topic for topic, _ in again.published} == {topics.SECAGG_DOWN.build(fleet=FLEET, device=d) for d in ids}
