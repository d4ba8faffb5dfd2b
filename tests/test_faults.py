# Faults survived (issue #5), each with real processes: mosquitto, `python -m coordinator run`, `python -m bench device`.
from __future__ import annotations

import dataclasses
import hashlib
import json
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from fleet import (
    INIT_SAMPLES,
    LABELS,
    VALIDATION_SAMPLES,
    FakeDevice,
    committed_rounds,
    fleet_shards,
    kill,
    log_text,
    oracle_labels,
    perturbed,
    start_agent,
    start_coordinator,
    wait_exit,
    wait_until,
)

from bench.simulate import BenchSettings, simulate
from coordinator.fleet.broker import port_is_free
from coordinator.fleet.provision import provision
from coordinator.intake.observer import RoundResult
from coordinator.rounds.rules import RoundPolicy
from coordinator.setup.settings import InitSettings, ServerSettings
from coordinator.storage.spool import Spool
from coordinator.storage.store import RunStore
from coordinator.strategies.aggregate import ClientUpdate
from coordinator.strategies.means import AveFL
from edge_agent.data.device_data import IMAGES_FILE, LABELS_FILE, STATE_FILE
from protocol import messages, wire
from protocol.credentials import load_credentials
from protocol.files import load_arrays
from protocol.mqtt import parse_broker_url
from protocol.tensors import weights_hash

pytestmark = pytest.mark.integration


def aggregate(base: dict, updates: list[messages.Update]) -> dict:
    """The AveFL aggregate of these updates, computed here independently of the coordinator process."""
    return AveFL().aggregate(base, [ClientUpdate(u.device_id, u.tensors, u.num_samples) for u in updates], None)[0]


def test_a_redelivered_update_is_applied_once(tmp_path: Path, broker, processes) -> None:
    """QoS 1 is at least once: the same encoded update arriving twice is acked twice but aggregated once; the same
    update id with other content is a duplicate; the committed round's spool is deleted."""
    run_dir = tmp_path / "run"
    processes.append(
        start_coordinator(broker.address, run_dir, "redeliver", "--rounds", "1", "--quorum", "2", "--min-devices", "2")
    )
    first, second = FakeDevice(broker.address, "redeliver", "dev-a"), FakeDevice(broker.address, "redeliver", "dev-b")
    try:
        announcement, base = first.current_round()
        update_a = first.update(announcement, perturbed(base, seed=1))
        update_b = second.update(announcement, perturbed(base, seed=2))
        payload_a = wire.encode(update_a)
        first.publish(payload_a)
        first.publish(payload_a)
        first.publish(wire.encode(dataclasses.replace(update_a, tensors=perturbed(base, seed=9))))
        second.publish(wire.encode(update_b))
        acks = first.acks(3)
        assert [(a.accepted, a.update_id) for a in acks] == [(True, update_a.update_id)] * 2 + [
            (False, update_a.update_id)
        ]
        assert acks[2].rejection == "duplicate" and "already accepted with different content" in acks[2].reason
        assert second.acks(1)[0].accepted
    finally:
        first.close()
        second.close()
    assert wait_exit(processes[0], "coordinator") == 0

    with RunStore(run_dir) as store:
        [record] = store.rounds()
        assert (record.accepted, record.rejected) == (2, 1)
        assert store.rejection_kinds() == {"duplicate": 1}
        assert list((run_dir / "spool").iterdir()) == []
        final = store.checkpoints.load(1)
        assert weights_hash(store.checkpoints.load(0)) == announcement.model_hash
    once = aggregate(base, [update_a, update_b])
    twice = aggregate(base, [update_a, dataclasses.replace(update_a, device_id="dev-a-again"), update_b])
    assert all(np.array_equal(final[name], once[name]) for name in once)
    assert not all(np.allclose(final[name], twice[name]) for name in twice)
    assert log_text(run_dir / "coordinator.log").count("update accepted device=dev-a") == 1


def final_model_hash(run_dir: Path, round_id: int) -> str:
    """The recorded hash of a run's checkpoint after `round_id`."""
    with RunStore(run_dir) as store:
        return weights_hash(store.checkpoints.load(round_id))


def start_fleet(broker, run_dir: Path, fleet: str, devices: int, *options: str) -> list:
    """A coordinator process and one agent process per device on `fleet`; returns [coordinator, *agents]."""
    coordinator = start_coordinator(broker.address, run_dir, fleet, *options)
    return [coordinator, *(start_agent(launch, broker.address, fleet) for launch in fleet_shards(run_dir, devices))]


def spooled_devices(run_dir: Path, round_id: int) -> set[str]:
    """The devices whose updates of a round are durable in a run's spool (read as a restarted coordinator would)."""
    return set(Spool(run_dir / "spool").round_index(round_id))


def test_a_killed_coordinator_resumes_its_round_from_the_spool(tmp_path: Path, broker, processes) -> None:
    """SIGKILL after one of four updates is spooled; the restarted coordinator takes it back, waits for the others,
    finishes, and ends with exactly the model of an uninterrupted run: agents are deterministic per device and round,
    and the aggregate does not depend on the order the four updates arrive in."""
    options = ("--rounds", "2", "--quorum", "4", "--min-devices", "4")
    reference = start_fleet(broker, tmp_path / "reference", "reference", 4, *options)  # uninterrupted, alongside
    processes.extend(reference)
    run_dir = tmp_path / "resumed"
    first, *others = fleet_shards(run_dir, devices=4)
    coordinator = start_coordinator(broker.address, run_dir, "resumed", *options)
    agents = [start_agent(first, broker.address, "resumed")]
    processes.extend([coordinator, *agents])
    wait_until(lambda: first.device_id in spooled_devices(run_dir, 1), "the first device's update in the spool")
    kill(coordinator)
    assert committed_rounds(run_dir) == []

    agents.extend(start_agent(launch, broker.address, "resumed") for launch in others)
    restarted = start_coordinator(broker.address, run_dir, "resumed", *options)
    processes.extend([*agents[1:], restarted])
    survivors = [*reference, *agents, restarted]
    assert [wait_exit(process, "fleet process") for process in survivors] == [0] * len(survivors)

    assert committed_rounds(run_dir) == [(1, 4), (2, 4)]
    log = log_text(run_dir / "coordinator.log")
    assert log.count(f"resumed spooled update device={first.device_id} round=1") == 1
    with RunStore(run_dir) as store:
        assert store.rejection_counts() == {}
        # each device labelled 40 a round: nobody redid round 1
        assert [d.acquired_labels for d in store.device_rounds(2)] == [2 * LABELS] * 4
    for launch in (first, *others):
        assert len(oracle_labels(launch.state_dir)) == 2 * LABELS

    for round_id in (0, 1, 2):
        assert final_model_hash(run_dir, round_id) == final_model_hash(tmp_path / "reference", round_id)


def test_the_fleet_rides_out_a_broker_restart_mid_round(tmp_path: Path, broker, processes) -> None:
    """mosquitto stops while the devices train round 1 and comes back on the same port once one of them has tried
    to publish its update: every client reconnects on its own, the update queued meanwhile goes out on reconnect,
    both rounds close with both devices, and nothing is counted twice."""
    run_dir = tmp_path / "run"
    fleet = start_fleet(broker, run_dir, "restart", 2, "--rounds", "2", "--quorum", "2", "--min-devices", "2")
    processes.extend(fleet)
    launches = fleet_shards(run_dir, devices=2)
    wait_until(lambda: any(len(oracle_labels(launch.state_dir)) for launch in launches), "a device labelling round 1")
    assert committed_rounds(run_dir) == []
    broker.stop()
    wait_until(
        lambda: any("step done" in log_text(launch.log_file) for launch in launches),
        "a device finishing its training while the broker is down",
    )
    time.sleep(1.0)
    broker.start()
    assert [wait_exit(process, "fleet process") for process in fleet] == [0, 0, 0]

    assert committed_rounds(run_dir) == [(1, 2), (2, 2)]
    log = log_text(run_dir / "coordinator.log")
    assert "mqtt disconnected client=coordinator-restart" in log
    assert "session_present=True" in log  # the broker kept the coordinator's session across its restart
    for launch in launches:
        assert log.count(f"update accepted device={launch.device_id} round=1 ") == 1
        assert len(oracle_labels(launch.state_dir)) == 2 * LABELS
    with RunStore(run_dir) as store:
        assert store.rejection_counts() == {}
        assert [d.acquired_labels for d in store.device_rounds(2)] == [2 * LABELS, 2 * LABELS]


def sha256_of(path: Path) -> str:
    """The file's SHA-256, to show it was not rewritten."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_device_killed_while_training_keeps_its_labels_and_rejoins(tmp_path: Path, broker, processes) -> None:
    """SIGKILL once the device stored round 1's labels but before its update went out: its labelled store and pool
    survive, and the restarted agent trains round 1 again on the same batch (no label asked twice) and rejoins."""
    run_dir = tmp_path / "run"
    fleet = start_fleet(
        broker, run_dir, "crash", 2, "--rounds", "2", "--quorum", "2", "--min-devices", "2", "--epochs", "10"
    )
    processes.extend(fleet)
    victim = fleet_shards(run_dir, devices=2)[1]
    wait_until(lambda: len(oracle_labels(victim.state_dir)) > 0, "the device storing round 1's labels")
    kill(fleet[2])
    assert victim.device_id not in spooled_devices(run_dir, 1), (
        "the device was killed after publishing, not during training"
    )
    at_kill = load_arrays(victim.state_dir / LABELS_FILE)
    images_at_kill = sha256_of(victim.state_dir / IMAGES_FILE)
    batch = oracle_labels(victim.state_dir)
    assert len(batch) == LABELS
    state = json.loads((victim.state_dir / STATE_FILE).read_text())
    assert state.get("last_finished_round", 0) == 0
    assert state["round_batches"]["round"] == 1
    assert sorted(state["round_batches"]["batches"][0]) == sorted(batch.tolist())

    restarted = start_agent(victim, broker.address, "crash")
    processes.append(restarted)
    survivors = [fleet[0], fleet[1], restarted]
    assert [wait_exit(process, "fleet process") for process in survivors] == [0, 0, 0]

    assert committed_rounds(run_dir) == [(1, 2), (2, 2)]
    after = load_arrays(victim.state_dir / LABELS_FILE)
    held = len(at_kill["indices"])
    for name in ("indices", "labels", "sources"):
        assert np.array_equal(after[name][:held], at_kill[name]), f"labels.npz {name} changed for the labels held"
    assert sha256_of(victim.state_dir / IMAGES_FILE) == images_at_kill
    assert len(oracle_labels(victim.state_dir)) == 2 * LABELS  # round 1's batch reused, round 2's new
    assert set(batch) <= set(oracle_labels(victim.state_dir)[:LABELS])
    with RunStore(run_dir) as store:
        round_one = {d.device_id: d.acquired_labels for d in store.device_rounds(1)}
        assert round_one == {"dev-00": LABELS, victim.device_id: LABELS}
        assert store.rejection_counts() == {}


def test_a_device_that_hangs_then_dies_is_left_out_and_taken_back_when_it_returns(
    tmp_path: Path,
    broker,
    processes,
) -> None:
    """dev-02 hangs in round 1 (SIGSTOP: still connected), so round 1 closes at its deadline with the other two;
    then it dies (SIGKILL: the broker publishes its 'offline' last will) and round 2 closes as soon as the living
    answer; restarted, it is counted again from the next round on."""
    timeout = 15.0
    run_dir = tmp_path / "run"
    fleet = start_fleet(
        broker,
        run_dir,
        "absent",
        3,
        "--rounds",
        "4",
        "--min-devices",
        "2",
        "--round-timeout",
        str(timeout),
        "--wait-devices",
        "3",
    )
    processes.extend(fleet)
    absent = fleet_shards(run_dir, devices=3)[2]
    wait_until(
        lambda: (
            (absent.state_dir / STATE_FILE).exists()
            and "round_batches" in json.loads((absent.state_dir / STATE_FILE).read_text())
        ),
        "dev-02 starting round 1",
    )
    fleet[3].send_signal(signal.SIGSTOP)
    wait_until(lambda: len(committed_rounds(run_dir)) >= 1, "round 1 closing")
    kill(fleet[3])
    wait_until(lambda: len(committed_rounds(run_dir)) >= 2, "round 2 closing")
    # hold the others until dev-02, restarted, has answered round 3: a fresh process's slow first round on a busy
    # machine must not let the run end without it
    for other in fleet[1:3]:
        other.send_signal(signal.SIGSTOP)
    returned = start_agent(absent, broker.address, "absent")
    processes.append(returned)
    wait_until(lambda: "update published device=dev-02 round=3" in log_text(absent.log_file), "dev-02 answering")
    for other in fleet[1:3]:
        other.send_signal(signal.SIGCONT)
    survivors = [fleet[0], fleet[1], fleet[2], returned]
    assert [wait_exit(process, "fleet process") for process in survivors] == [0, 0, 0, 0]

    with RunStore(run_dir) as store:
        rounds = store.rounds()
        accepted = {r.round_id: sorted(d.device_id for d in store.device_rounds(r.round_id)) for r in rounds}
    assert accepted[1] == accepted[2] == ["dev-00", "dev-01"]
    assert rounds[0].closed_at - rounds[0].started_at >= timeout  # closed at its deadline, not before
    assert rounds[0].metrics["stragglers"] == ["dev-02"]
    assert rounds[1].closed_at - rounds[1].started_at < timeout  # did not wait for the dead device
    assert rounds[1].metrics["offline"] == ["dev-02"]
    assert accepted[3] == accepted[4] == ["dev-00", "dev-01", "dev-02"]
    log = log_text(run_dir / "coordinator.log")
    assert "round deadline passed round=1 accepted=2 needed=3 stragglers=['dev-02']" in log
    assert "device status device=dev-02 state=offline" in log


def test_the_bench_notices_a_dead_agent_at_once(tmp_path: Path, caplog) -> None:
    """An agent process that dies (here: its shard is corrupt) is named with its log file and the bench goes on
    with the living at once, instead of waiting for the 600 s round deadline."""
    settings = ServerSettings(
        run_dir=tmp_path / "run",
        fleet="dead",
        recipe=messages.Recipe(labels_per_acquisition=LABELS, epochs=1, mc_passes=2, batch_size=20),
        policy=RoundPolicy(rounds=1, quorum=3, round_timeout=600),
        init=InitSettings(samples=INIT_SAMPLES, epochs=2),
        validation_samples=VALIDATION_SAMPLES,
        test_samples=500,
        evaluate_devices=False,
    )
    broken = settings.run_dir / "devices" / "dev-02" / "shard.npz"
    broken.parent.mkdir(parents=True)
    broken.write_bytes(b"not a shard")
    results: list[RoundResult] = []
    started = time.monotonic()
    with caplog.at_level("ERROR", logger="bench.simulate"):
        simulate(settings, BenchSettings(devices=3, partition="iid", pool_size=200), results.append)
    assert time.monotonic() - started < 300
    assert [sorted(r.divergence) for r in results] == [["dev-00", "dev-01"]]
    [error] = [record.getMessage() for record in caplog.records if record.levelname == "ERROR"]
    assert error.startswith("agent died device=dev-02 exit=2 log=") and error.endswith(
        f"{broken.parent / 'agent.log'}; the run goes on with the others"
    )
    assert "fl-bench:" in log_text(broken.parent / "agent.log")


def test_a_killed_coordinator_takes_its_embedded_broker_along_and_its_restart_listens_where_it_was(
    tmp_path: Path,
    processes,
) -> None:
    """Without --broker, SIGKILL must not leave an orphaned mosquitto behind, and the restarted coordinator's broker
    takes the same port, so that devices reconnect to the address they know and find the same round."""
    run_dir = tmp_path / "run"
    marker = "embedded broker listening at "

    def broker_urls() -> list[str]:
        return [line.split(marker)[1] for line in log_text(run_dir / "coordinator.log").splitlines() if marker in line]

    first = start_coordinator(None, run_dir, "embedded", "--rounds", "1")
    processes.append(first)
    wait_until(lambda: len(broker_urls()) == 1, "the embedded broker")
    address = parse_broker_url(broker_urls()[0])
    device = FakeDevice(address, "embedded", "dev-a")
    announcement, _ = device.current_round()
    device.close()
    kill(first)
    wait_until(lambda: port_is_free(address.port), "the embedded broker going down with its coordinator", 30)

    second = start_coordinator(None, run_dir, "embedded", "--rounds", "1")
    processes.append(second)
    wait_until(lambda: len(broker_urls()) == 2, "the restarted embedded broker")
    assert broker_urls() == [address.url] * 2
    device = FakeDevice(address, "embedded", "dev-a")
    again, _ = device.current_round()
    device.close()
    assert (again.run_id, again.round_id, again.model_hash) == (announcement.run_id, 1, announcement.model_hash)


def test_a_replay_after_a_coordinator_restart_is_refused_as_a_replay(tmp_path: Path, broker, processes) -> None:
    """The nonces of accepted updates live in run.sqlite: a signed round-1 update sent again after the coordinator
    was killed and restarted in round 2 is a `replay` (with nonces in memory only it would pass the signature
    check and be a mere `stale_round`)."""
    run_dir, secure = tmp_path / "run", tmp_path / "secure"
    provision("replay", 1, secure)
    key = load_credentials(secure / "devices" / "dev-00.json").hmac_key
    options = ("--secure", str(secure), "--rounds", "2", "--quorum", "1", "--min-devices", "1")
    processes.append(start_coordinator(broker.address, run_dir, "replay", *options))
    device = FakeDevice(broker.address, "replay", "dev-00")
    try:
        announcement, base = device.current_round()
        original = wire.signed(wire.encode(device.update(announcement, perturbed(base, seed=1))), key)
        device.publish(original)
        assert device.acks(1)[0].accepted
        second, base = device.current_round(after=1)
        kill(processes[-1])
        processes.append(start_coordinator(broker.address, run_dir, "replay", *options))
        device.publish(original)
        [replayed] = device.acks(1)
        assert (replayed.accepted, replayed.rejection) == (False, "replay"), replayed.reason
        device.publish(wire.signed(wire.encode(device.update(second, perturbed(base, seed=2))), key))
        assert device.acks(1)[0].accepted
    finally:
        device.close()
    assert wait_exit(processes[-1], "the restarted coordinator") == 0
