# Claimed sample counts (issue #26 item 7): a zero claim cannot stop a FedAvg round, a claim above what the schedule
# lets a device hold is refused as bad_counts, and where no bound is known one update's share of the round is capped.
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fleet import FakeDevice, perturbed, start_coordinator, stop_all, wait_exit

from coordinator.fleet.broker import EmbeddedBroker
from coordinator.intake.round_aggregator import BatchAggregator, StreamingAggregator, SuspectPolicy
from coordinator.intake.scratch import TensorScratch
from coordinator.storage.store import RunStore
from coordinator.strategies.aggregate import ClientUpdate, capped_weights
from coordinator.strategies.means import FedAvg
from protocol import messages, wire

FLEET = "claims"


def test_capped_weights_clip_the_largest_to_the_cap_and_spread_the_excess_in_proportion() -> None:
    # 1e9 against 100 + 100 with a cap of one half: T = 200 / 0.5 = 400, so the claim counts as 200
    np.testing.assert_array_equal(capped_weights([100, 100, 1e9], [0.5] * 3), [100, 100, 200])
    # nothing above its cap: unchanged
    np.testing.assert_array_equal(capped_weights([100, 90, 1], [0.6] * 3), [100, 90, 1])
    clipped = capped_weights([100, 1, 1], [0.6] * 3)
    np.testing.assert_allclose(clipped / clipped.sum(), [0.6, 0.2, 0.2])
    # a relay summing 3 devices may carry up to 3 x 0.25 of the round
    relay = capped_weights([900, 50, 50], [0.75, 0.25, 0.25])
    np.testing.assert_allclose(relay / relay.sum(), [0.75, 0.125, 0.125])
    # caps summing to 1 or less cannot be met: the shares follow the caps; zeros stay zero; one update keeps all
    np.testing.assert_allclose(capped_weights([100, 10, 0], [0.4, 0.4, 0.4]), [10, 10, 0])
    np.testing.assert_array_equal(capped_weights([7], [0.5]), [7])
    with pytest.raises(ValueError, match="caps must lie in"):
        capped_weights([1, 2], [0.5, 0.0])


def test_a_capped_round_is_the_same_batched_or_streamed_in_any_order(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    base = {"w": rng.normal(size=(4, 3)).astype(np.float32)}
    updates = [ClientUpdate(f"d{i}", perturbed(base, seed=i), n) for i, n in enumerate([100, 120, 10**9, 80])]
    results = []
    for turn, order in enumerate((updates, updates[::-1])):
        batch = BatchAggregator(FedAvg(), base, SuspectPolicy(), max_share=0.5)
        stream = StreamingAggregator(
            FedAvg(), base, SuspectPolicy(), TensorScratch(tmp_path / str(turn)), max_share=0.5
        )
        for update in order:
            batch.absorb(update)
            stream.absorb(update)
        results += [batch.finish(None), stream.finish(None)]
    for result in results:
        assert result.report["samples_clipped"] == {"d2": 10**9}
        assert result.report["coefficients"]["d2"] == pytest.approx(0.5)
        assert np.array_equal(result.weights["w"], results[0].weights["w"])


def fedavg(base: dict, updates: list[messages.Update], counts: list[float] | None = None) -> dict:
    """FedAvg of the updates computed here (with the given sample counts instead of the claimed ones)."""
    counts = counts or [u.num_samples for u in updates]
    clients = [ClientUpdate(u.device_id, u.tensors, n) for u, n in zip(updates, counts)]
    return FedAvg().aggregate(base, clients, None)[0]


def one_round(
    tmp_path: Path, options: list[str], claims: dict[str, int]
) -> tuple[dict, list, dict, list[messages.Ack]]:
    """A real fedavg coordinator's one round, devices dev-a, dev-b, ... claiming the given counts in that order:
    (base, the updates sent, the committed model, each device's ack)."""
    run_dir = tmp_path / "run"
    with EmbeddedBroker(tmp_path / "broker") as broker:
        coordinator = start_coordinator(
            broker.address, run_dir, FLEET, "--strategy", "fedavg", "--rounds", "1", *options
        )
        devices = [FakeDevice(broker.address, FLEET, name) for name in claims]
        try:
            announcement, base = devices[0].current_round()
            sent = []
            for index, (device, count) in enumerate(zip(devices, claims.values())):
                tensors = perturbed(base, seed=index)
                sent.append(device.update(announcement, tensors, num_samples=count, acquired_labels=min(count, 50)))
                device.publish(wire.encode(sent[-1]))
            acks = [device.acks(1)[0] for device in devices]
            assert wait_exit(coordinator, "coordinator") == 0
        finally:
            for device in devices:
                device.close()
            stop_all([coordinator])
    with RunStore(run_dir) as store:
        model = store.checkpoints.load(1)
    return base, sent, model, acks


def same_model(model: dict, expected: dict) -> bool:
    """Bit-identical tensors."""
    return all(np.array_equal(model[name], expected[name]) for name in expected)


@pytest.mark.integration
def test_a_zero_sample_update_is_refused_and_the_round_commits_the_honest_fedavg(tmp_path: Path) -> None:
    claims = {"dev-z": 0, "dev-a": 100, "dev-b": 300}
    base, sent, model, acks = one_round(tmp_path, ["--quorum", "2", "--seed-labels", "400"], claims)
    assert not acks[0].accepted and acks[0].rejection == "bad_counts"
    assert "claims 0 samples: the strategy weighs updates by their samples" in acks[0].reason
    assert acks[1].accepted and acks[2].accepted
    assert same_model(model, fedavg(base, sent[1:]))  # the bound (440) applies, so no share cap: 300 weighs 3/4


@pytest.mark.integration
def test_a_claim_above_the_schedules_bound_is_refused_as_bad_counts(tmp_path: Path) -> None:
    # --seed-labels 50 and 40 labels per acquisition (the tiny run's): a device holds at most 90 labels in round 1
    claims = {"dev-r": 10**9, "dev-a": 80, "dev-b": 30}
    base, sent, model, acks = one_round(tmp_path, ["--quorum", "2", "--seed-labels", "50"], claims)
    assert not acks[0].accepted and acks[0].rejection == "bad_counts"
    assert acks[0].reason == "claims 1000000000 samples, more than the 90 a device can hold by round 1"
    assert same_model(model, fedavg(base, sent[1:]))


@pytest.mark.integration
def test_with_no_bound_known_one_claim_carries_at_most_the_share_cap(tmp_path: Path) -> None:
    claims = {"dev-r": 10**9, "dev-a": 100, "dev-b": 100}
    base, sent, model, acks = one_round(tmp_path, ["--quorum", "3"], claims)
    assert all(ack.accepted for ack in acks)
    assert same_model(model, fedavg(base, sent, [200, 100, 100]))  # the default cap, one half
