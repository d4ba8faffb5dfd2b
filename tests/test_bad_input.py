# Bad input over MQTT (issue #5): a real coordinator process behind a real mosquitto answers each bad update with a
# specific rejection on the device's ack topic, counts and logs it once, and aggregates only the valid updates.
from __future__ import annotations

import sqlite3
from collections import Counter
from pathlib import Path

import msgpack
import numpy as np
import pytest
from fleet import FakeDevice, log_text, perturbed, start_coordinator, stop_all, wait_exit, wait_until

from coordinator.fleet.broker import EmbeddedBroker
from coordinator.storage.store import RunStore
from coordinator.strategies.aggregate import ClientUpdate
from coordinator.strategies.means import AveFL
from protocol import messages, wire

pytestmark = pytest.mark.integration

FLEET = "bad"


def rewrite(update: messages.Update, **fields) -> bytes:
    """The encoded update with envelope fields replaced (None removes one): what a broken encoder would send."""
    envelope = msgpack.unpackb(wire.encode(update), raw=False)
    for name, value in fields.items():
        if value is None:
            envelope.pop(name)
        else:
            envelope[name] = value
    return msgpack.packb(envelope, use_bin_type=True)


def with_tensor(tensors: dict[str, np.ndarray], name: str, array: np.ndarray) -> dict[str, np.ndarray]:
    """The tensors with one replaced."""
    return {**tensors, name: array}


def bad_updates(
    rogue: FakeDevice, announcement: messages.RoundAnnouncement, base: dict
) -> list[tuple[str, bytes, str]]:
    """(case, payload, expected words of the reason) for every kind of bad update a device might send."""
    good = perturbed(base, seed=99)
    first = next(iter(good))
    renamed = {(f"{name}.renamed" if name == first else name): array for name, array in good.items()}
    nan, inf, huge = good[first].copy(), good[first].copy(), good[first].copy()
    nan.flat[0], inf.flat[-1], huge.flat[0] = np.nan, np.inf, 2.0**31

    def valid(tensors: dict[str, np.ndarray] = good, **changes) -> messages.Update:
        return rogue.update(announcement, tensors, **changes)

    return [
        ("undecodable bytes", b"\xc1\x00not msgpack", "undecodable: undecodable msgpack"),
        ("wrong wire version", rewrite(valid(), v=1), "wire version 1 is not supported"),
        ("missing field", rewrite(valid(), tensors=None), "missing field 'tensors'"),
        ("wrong field type", rewrite(valid(), num_samples="many"), "update.num_samples must be an integer"),
        ("not the device's topic", wire.encode(valid(device_id="dev-a")), "does not match the topic's 'dev-r'"),
        ("future round", wire.encode(valid(round_id=announcement.round_id + 5)), "future round: update is for round"),
        ("wrong base model", wire.encode(valid(base_hash="f" * 64)), "base model mismatch"),
        ("tensor names", wire.encode(valid(tensors=renamed)), "tensor mismatch"),
        ("tensor shape", wire.encode(valid(tensors=with_tensor(good, first, good[first][:1]))), "tensor mismatch"),
        (
            "tensor dtype",
            wire.encode(valid(tensors=with_tensor(good, first, good[first].astype(np.float64)))),
            "tensor mismatch",
        ),
        ("NaN", wire.encode(valid(tensors=with_tensor(good, first, nan))), "non-finite values"),
        ("infinity", wire.encode(valid(tensors=with_tensor(good, first, inf))), "non-finite values"),
        ("beyond the aggregate's range", wire.encode(valid(tensors=with_tensor(good, first, huge))), "out of range"),
        ("over the size limit", wire.encode(valid(nonce=bytes(wire.DEFAULT_MAX_MESSAGE_BYTES))), "too large"),
    ]


def average(base: dict, updates: list[messages.Update]) -> dict:
    """AveFL of the updates, computed here."""
    return AveFL().aggregate(base, [ClientUpdate(u.device_id, u.tensors, u.num_samples) for u in updates], None)[0]


def test_every_bad_update_is_rejected_with_its_reason_and_never_reaches_the_model(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with EmbeddedBroker(tmp_path / "broker") as broker:
        coordinator = start_coordinator(
            broker.address, run_dir, FLEET, "--rounds", "2", "--quorum", "2", "--min-devices", "2"
        )
        devices = [FakeDevice(broker.address, FLEET, name) for name in ("dev-a", "dev-b", "dev-r")]
        honest_a, honest_b, rogue = devices
        try:
            # round 1: the rogue's bad updates, a second distinct update from dev-a, then the two valid ones
            announcement, base = honest_a.current_round()
            cases = bad_updates(rogue, announcement, base)
            for _, payload, _ in cases:
                rogue.publish(payload)
            first_a = honest_a.update(announcement, perturbed(base, seed=1))
            first_b = honest_b.update(announcement, perturbed(base, seed=2))
            honest_a.publish(wire.encode(first_a))
            honest_a.publish(wire.encode(honest_a.update(announcement, perturbed(base, seed=3))))
            honest_b.publish(wire.encode(first_b))
            rogue_acks = rogue.acks(len(cases))
            a_acks = honest_a.acks(2)
            assert honest_b.acks(1)[0].accepted

            # round 2: dev-a's round-1 update replayed, then the two valid ones
            announcement_2, base_2 = honest_a.current_round(after=1)
            rogue.publish(wire.encode(first_a), device_id="dev-a")
            second_a = honest_a.update(announcement_2, perturbed(base_2, seed=4))
            second_b = honest_b.update(announcement_2, perturbed(base_2, seed=5))
            honest_a.publish(wire.encode(second_a))
            honest_b.publish(wire.encode(second_b))
            replay_ack, second_ack = honest_a.acks(2)
            assert honest_b.acks(1)[0].accepted
            assert wait_exit(coordinator, "coordinator") == 0
        finally:
            for device in devices:
                device.close()
            stop_all([coordinator])

    for (case, _, words), ack in zip(cases, rogue_acks):
        assert not ack.accepted and words in ack.reason, (case, ack.reason)
    assert a_acks[0].accepted and a_acks[0].update_id == first_a.update_id
    assert not a_acks[1].accepted and a_acks[1].reason.startswith("duplicate: dev-a already has an accepted update")
    assert not replay_ack.accepted and replay_ack.update_id == first_a.update_id
    assert replay_ack.reason == "stale round: update is for round 1, the current round is 2"
    assert second_ack.accepted and second_ack.update_id == second_a.update_id

    reasons = [ack.reason for ack in rogue_acks] + [a_acks[1].reason, replay_ack.reason]
    log = log_text(run_dir / "coordinator.log")
    assert log.count("update rejected") == len(reasons)
    for reason, count in Counter(reasons).items():
        assert log.count(f"reason={reason}\n") == count, reason  # logged once per rejected update
    with RunStore(run_dir) as store:
        assert store.rejection_counts() == dict(Counter(reasons))
        assert store.rejection_kinds()["out_of_range"] == 1
        assert [(r.accepted, r.rejected) for r in store.rounds()] == [(2, len(cases) + 1), (2, 1)]
        first_model, second_model = store.checkpoints.load(1), store.checkpoints.load(2)
    for model, expected in (
        (first_model, average(base, [first_a, first_b])),
        (second_model, average(base_2, [second_a, second_b])),
    ):
        assert all(np.array_equal(model[name], expected[name]) for name in expected)


def test_a_huge_update_with_many_unknown_fields_gets_a_short_reason_everywhere(tmp_path: Path) -> None:
    """4 MB of unknown field names: the reason in the ack, the store and the log stays under 1 KB, and the device
    decodes the ack with its kind."""
    run_dir = tmp_path / "run"
    with EmbeddedBroker(tmp_path / "broker") as broker:
        coordinator = start_coordinator(broker.address, run_dir, FLEET, "--rounds", "1", "--quorum", "1")
        rogue, honest = FakeDevice(broker.address, FLEET, "dev-r"), FakeDevice(broker.address, FLEET, "dev-a")
        try:
            announcement, base = rogue.current_round()
            envelope = msgpack.unpackb(wire.encode(rogue.update(announcement, perturbed(base, seed=5))), raw=False)
            envelope.update({f"field-{index:04d}-" + "x" * 4000: index for index in range(1000)})
            payload = msgpack.packb(envelope, use_bin_type=True)
            assert len(payload) > 4_000_000
            rogue.publish(payload)
            [ack] = rogue.acks(1)
            honest.publish(wire.encode(honest.update(announcement, perturbed(base, seed=6))))
            assert honest.acks(1)[0].accepted
            assert wait_exit(coordinator, "coordinator") == 0
        finally:
            rogue.close()
            honest.close()
            stop_all([coordinator])
    assert not ack.accepted and ack.rejection == "undecodable" and len(ack.reason.encode()) < 1024
    assert ack.reason.startswith("undecodable: update message has unknown fields [") and "and 995 more]" in ack.reason
    with RunStore(run_dir) as store:
        [(_, device, reason, size, _)] = store.rejections()
        assert device == "dev-r" and reason == ack.reason and size == len(payload)
        assert store.rejection_kinds() == {"undecodable": 1}
    [line] = [line for line in log_text(run_dir / "coordinator.log").splitlines() if "update rejected" in line]
    assert len(line.encode()) < 1024 and "kind=undecodable" in line


def set_aside_rejections(run_dir: Path) -> int:
    """The set_aside rejections a running coordinator's store holds (read-only)."""
    with sqlite3.connect(f"file:{run_dir / 'run.sqlite'}?mode=ro", uri=True) as connection:
        return connection.execute("SELECT COUNT(*) FROM rejections WHERE kind = 'set_aside'").fetchone()[0]


# The coordinator's run with a bug planted in its strategy: every update the mean folds raises a plain ValueError.
BUGGY_STRATEGY = """
import runpy, sys
from coordinator.strategies.contract import StreamingWeightedAverage
def accumulate(self, running, update):
    raise ValueError("planted bug in the strategy")
StreamingWeightedAverage.accumulate = accumulate
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def test_a_bug_inside_the_strategy_stops_the_coordinator_with_its_traceback_and_blames_no_device(
    tmp_path: Path,
) -> None:
    """A ValueError raised inside the strategy while an update is folded is the coordinator's bug, not the device's
    out-of-range update: the process exits with the traceback in its log, the update is neither acked nor stored as
    a rejection, and no round is committed."""
    run_dir = tmp_path / "run"
    with EmbeddedBroker(tmp_path / "broker") as broker:
        coordinator = start_coordinator(
            broker.address, run_dir, FLEET, "--rounds", "1", "--quorum", "1", prelude=BUGGY_STRATEGY
        )
        device = FakeDevice(broker.address, FLEET, "dev-a")
        try:
            announcement, base = device.current_round()
            device.publish(wire.encode(device.update(announcement, perturbed(base, seed=1))))
            assert wait_exit(coordinator, "coordinator") == 1
            assert device.session.next_message(timeout=0.5) is None  # no ack: nothing was decided about the update
        finally:
            device.close()
            stop_all([coordinator])
    log = log_text(run_dir / "coordinator.log")
    assert "Traceback (most recent call last)" in log and "ValueError: planted bug in the strategy" in log
    assert "update rejected" not in log and "out of range" not in log
    with RunStore(run_dir) as store:
        assert store.rejections() == [] and store.rounds() == []


def test_an_update_that_stops_the_coordinator_three_times_is_set_aside_not_redelivered_forever(
    tmp_path: Path,
) -> None:
    """The planted bug again, with the coordinator restarted as systemd would: the broker redelivers the update to
    each new process; the first two exit with the traceback, the third sets the update aside (kept, its device
    named in a set_aside rejection) and goes on serving."""
    run_dir = tmp_path / "run"
    with EmbeddedBroker(tmp_path / "broker") as broker:
        device = FakeDevice(broker.address, FLEET, "dev-a")
        processes = []
        try:
            for start in range(3):
                processes.append(
                    start_coordinator(
                        broker.address, run_dir, FLEET, "--rounds", "1", "--quorum", "1", prelude=BUGGY_STRATEGY
                    )
                )
                if start == 0:
                    announcement, base = device.current_round()
                    device.publish(wire.encode(device.update(announcement, perturbed(base, seed=1))))
                if start < 2:
                    assert wait_exit(processes[-1], f"coordinator {start + 1}") == 1
            wait_until(lambda: set_aside_rejections(run_dir) == 1, "the update set aside by the third coordinator")
            assert len(list((run_dir / "set-aside").glob("*.payload"))) == 1, "kept for inspection"
            assert processes[-1].poll() is None, "the third coordinator goes on"
        finally:
            device.close()
            stop_all(processes)
    log = log_text(run_dir / "coordinator.log")
    assert log.count("ValueError: planted bug in the strategy") == 3
    assert "message set aside part=coordinator sender=dev-a failures=3" in log
    with RunStore(run_dir) as store:
        [(_, device_id, reason, _, _)] = store.rejections()
        assert device_id == "dev-a" and reason.startswith("set aside: its handling failed 3 times")
        assert store.rejection_kinds() == {"set_aside": 1}
