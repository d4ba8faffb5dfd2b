# Streaming aggregation: AveFL/FedAvg summed as updates arrive equal the batch formula; no tensors stay in memory.
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from coordinator.intake.round_aggregator import BatchAggregator, StreamingAggregator, SuspectPolicy, make_aggregator
from coordinator.intake.scratch import TensorScratch
from coordinator.intake.update_intake import RoundCollector
from coordinator.intake.validation import Expectation, decoded
from coordinator.strategies.aggregate import ClientUpdate, weighted_average
from coordinator.strategies.means import AveFL, FedAvg
from coordinator.strategies.registry import make_strategy
from coordinator.strategies.robust import Median
from edge_agent.learning.models import build_model, get_weights, weight_spec
from protocol import messages, wire
from protocol.model_spec import DEFAULT_SPEC
from protocol.tensors import weights_hash

NUM_CLASSES = DEFAULT_SPEC.num_classes

MODEL = build_model(seed=0)
BASE = get_weights(MODEL)


def device_updates(count: int, scaled: int | None = None) -> list[ClientUpdate]:
    """Devices near the base model with different sample counts; device `scaled` sends its weights x50."""
    rng = np.random.default_rng(3)
    updates = []
    for index in range(count):
        weights = {name: (array + rng.normal(0, 0.01, array.shape)).astype(array.dtype) for name, array in BASE.items()}
        if index == scaled:
            weights = {name: array * np.float32(50) for name, array in weights.items()}
        updates.append(ClientUpdate(f"dev-{index:02d}", weights, int(rng.integers(1, 500))))
    return updates


@pytest.mark.parametrize("name", ["avefl", "fedavg"])
def test_streamed_aggregate_equals_the_batch_weighted_average(name: str) -> None:
    strategy = make_strategy(name)
    updates = device_updates(7)
    running = strategy.begin()
    for index in np.random.default_rng(0).permutation(len(updates)):
        strategy.accumulate(running, updates[index])
    streamed, report = strategy.finish(running, BASE)
    counts = [u.num_samples for u in updates] if name == "fedavg" else [1] * len(updates)
    batch = weighted_average([u.weights for u in updates], counts)
    for tensor, expected in batch.items():
        assert streamed[tensor].dtype == expected.dtype
        np.testing.assert_array_equal(streamed[tensor], expected)
    assert report["coefficients"] == pytest.approx({u.device_id: c / sum(counts) for u, c in zip(updates, counts)})
    assert strategy.streaming and not Median.streaming


def test_streaming_rejects_what_the_batch_path_rejects() -> None:
    strategy = FedAvg()
    running = strategy.begin()
    update = device_updates(1)[0]
    strategy.accumulate(running, update)
    with pytest.raises(ValueError, match="more than one update"):
        strategy.accumulate(running, update)
    with pytest.raises(ValueError, match="differs in tensor names, shapes or dtypes"):
        strategy.accumulate(running, ClientUpdate("dev-99", {"fc2.bias": np.zeros(10, np.float32)}, 5))
    empty = strategy.begin()
    strategy.accumulate(empty, ClientUpdate("dev-00", BASE, 0))
    with pytest.raises(ValueError, match="positive sum"):
        strategy.finish(empty, BASE)


def test_a_streamed_round_keeps_only_metadata_and_flags_the_scaled_device(tmp_path: Path) -> None:
    updates = device_updates(5, scaled=4)
    by_device = {update.device_id: update for update in updates}
    base_hash = weights_hash(BASE)
    streamed = StreamingAggregator(AveFL(), BASE, SuspectPolicy(), TensorScratch(tmp_path))
    expectation = Expectation(1, base_hash, weight_spec(MODEL), NUM_CLASSES, 1 << 22)
    collector = RoundCollector(expectation, streamed.absorb)
    for update in updates:
        payload = wire.encode(
            messages.Update(
                update.device_id, 1, "u", base_hash, update.num_samples, [1] * NUM_CLASSES, 0, {}, update.weights
            )
        )
        assert collector.offer(decoded(update.device_id, payload, expectation))[1] is True
    assert all(accepted.tensors == {} for accepted in collector.accepted.values())
    aggregate = streamed.finish(None)
    batch, _ = AveFL().aggregate(BASE, updates, None)
    assert all(np.array_equal(aggregate.weights[name], batch[name]) for name in batch)
    assert list(aggregate.suspects) == ["dev-04"] and aggregate.report["suspects"] == aggregate.suspects
    assert aggregate.report["streamed"] is True and set(aggregate.divergence) == set(by_device)
    batched = BatchAggregator(AveFL(), BASE, SuspectPolicy())
    for update in updates:
        batched.absorb(update)
    assert batched.finish(None).divergence == aggregate.divergence  # the same figures from the scratch's views


def test_the_aggregator_is_chosen_by_what_the_strategy_declares(tmp_path: Path) -> None:
    """Streaming for a strategy that declares it (unless suspects are to be left out), batch otherwise; a class
    that declares streaming without the fold methods is refused when it is defined."""

    scratch = TensorScratch(tmp_path)
    assert isinstance(make_aggregator(FedAvg(), BASE, SuspectPolicy(), scratch), StreamingAggregator)
    assert isinstance(make_aggregator(FedAvg(), BASE, SuspectPolicy(exclude=True), scratch), BatchAggregator)
    assert isinstance(make_aggregator(Median(), BASE, SuspectPolicy(), scratch), BatchAggregator)
    with pytest.raises(TypeError, match="declares streaming but has no begin, accumulate, finish"):

        class StreamingMedian(Median):
            streaming = True
