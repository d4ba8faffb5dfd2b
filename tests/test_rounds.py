# The round seam's pure parts: suspect-aware aggregation, and aggregates that do not depend on arrival order.
from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest

from coordinator.intake.round_aggregator import BatchAggregator, RoundAggregator, StreamingAggregator, SuspectPolicy
from coordinator.intake.scratch import TensorScratch
from coordinator.strategies.aggregate import ClientUpdate, ExactSum, RunningSum, weighted_average
from coordinator.strategies.contract import Strategy, StreamingWeightedAverage
from coordinator.strategies.means import AveFL
from coordinator.strategies.registry import make_strategy
from coordinator.strategies.robust import Median
from edge_agent.learning.models import build_model, get_weights
from protocol.tensors import Weights


def aggregate_with_suspects(
    strategy: Strategy, base: Weights, updates: list[ClientUpdate], evaluate: None, policy: SuspectPolicy
) -> tuple[Weights, dict, dict, dict]:
    """(weights, report, divergence, suspects) of the batch aggregator fed these updates in this order."""
    aggregator = BatchAggregator(strategy, base, policy)
    for update in updates:
        aggregator.absorb(update)
    aggregate = aggregator.finish(evaluate)
    return aggregate.weights, aggregate.report, aggregate.divergence, aggregate.suspects


def honest_and_scaled_updates(scale: float = 50.0) -> list[ClientUpdate]:
    """Five devices near the same model (small independent noise); the last one sends its weights scaled."""
    base = get_weights(build_model(seed=0))
    rng = np.random.default_rng(1)
    updates = []
    for index in range(5):
        weights = {k: (v + rng.normal(0, 0.01, v.shape)).astype(v.dtype) for k, v in base.items()}
        if index == 4:
            weights = {k: v * scale for k, v in weights.items()}
        updates.append(ClientUpdate(f"dev-{index}", weights, 100))
    return updates


def test_a_scaled_update_is_flagged_and_excluded_when_asked() -> None:
    updates = honest_and_scaled_updates()
    base = updates[0].weights
    kept, report, divergence, suspects = aggregate_with_suspects(
        AveFL(), base, updates, None, SuspectPolicy(exclude=True)
    )
    assert list(suspects) == ["dev-4"]
    assert report["excluded"] == ["dev-4"]
    honest_mean = weighted_average([u.weights for u in updates[:4]], [1, 1, 1, 1])
    for name in honest_mean:
        np.testing.assert_allclose(kept[name], honest_mean[name], rtol=1e-6, atol=1e-7)
    assert set(divergence) == {f"dev-{i}" for i in range(5)}


def test_without_exclusion_the_suspect_is_only_flagged() -> None:
    updates = honest_and_scaled_updates()
    averaged, report, _, suspects = aggregate_with_suspects(AveFL(), updates[0].weights, updates, None, SuspectPolicy())
    assert list(suspects) == ["dev-4"] and "excluded" not in report and report["suspects"] == suspects
    full_mean = weighted_average([u.weights for u in updates], [1] * 5)
    name = "fc2.weight"
    np.testing.assert_allclose(averaged[name], full_mean[name], rtol=1e-6)
    honest = updates[0].weights[name]
    assert np.abs(averaged[name]).mean() > 5 * np.abs(honest).mean()


def test_median_resists_the_scaled_update_on_its_own() -> None:
    updates = honest_and_scaled_updates()
    median, _, _, _ = aggregate_with_suspects(Median(), updates[0].weights, updates, None, SuspectPolicy())
    for name, value in median.items():
        honest = np.stack([u.weights[name] for u in updates[:4]])
        assert np.all(value >= honest.min(axis=0) - 1e-6) and np.all(value <= honest.max(axis=0) + 1e-6)


def test_honest_updates_raise_no_suspect() -> None:
    updates = honest_and_scaled_updates(scale=1.0)
    _, report, _, suspects = aggregate_with_suspects(
        AveFL(), updates[0].weights, updates, None, SuspectPolicy(exclude=True)
    )
    assert suspects == {} and "excluded" not in report


def spread_updates(count: int) -> list[ClientUpdate]:
    """Devices far apart in scale and sample count, so float sums in different orders round differently."""
    base = get_weights(build_model(seed=0))
    rng = np.random.default_rng(7)
    updates = []
    for index in range(count):
        scale = np.float32(10.0 ** rng.integers(-3, 3))
        weights = {k: (v * scale + rng.normal(0, 0.05, v.shape)).astype(v.dtype) for k, v in base.items()}
        updates.append(ClientUpdate(f"dev-{index}", weights, int(rng.integers(1, 5000))))
    return updates


def aggregator_for(kind: str, strategy: Strategy, base: Weights, scratch: TensorScratch) -> RoundAggregator:
    """A batch or streaming aggregator; the streaming one keeps the round's models in `scratch`."""
    if kind == "batch":
        return BatchAggregator(strategy, base, SuspectPolicy())
    assert isinstance(strategy, StreamingWeightedAverage)
    return StreamingAggregator(strategy, base, SuspectPolicy(), scratch)


@pytest.mark.parametrize("name", ["avefl", "fedavg"])
def test_every_arrival_order_gives_the_same_bits_batch_and_streaming(name: str, tmp_path: Path) -> None:
    """The same aggregate bits, and the same divergence figures (the streamed ones measured on the models viewed in
    the scratch), whatever the order and path."""
    updates = spread_updates(5)
    base = updates[0].weights
    seen: dict[str, set[bytes]] = {"batch": set(), "streaming": set()}
    divergences: dict[str, list[dict[str, dict[str, float]]]] = {"batch": [], "streaming": []}
    for order in itertools.permutations(range(5)):
        for kind in seen:
            with TensorScratch(tmp_path) as scratch:
                aggregator = aggregator_for(kind, make_strategy(name), base, scratch)
                for index in order:
                    aggregator.absorb(updates[index])
                aggregate = aggregator.finish(None)
            seen[kind].add(b"".join(aggregate.weights[tensor].tobytes() for tensor in sorted(aggregate.weights)))
            divergences[kind].append(aggregate.divergence)
    assert len(seen["batch"]) == 1 and seen["batch"] == seen["streaming"]
    assert all(divergence == divergences["batch"][0] for kind in divergences for divergence in divergences[kind])
    share = 1.0 / sum(update.num_samples for update in updates)
    plain_sums = set()
    for order in itertools.permutations(range(5)):
        total = np.zeros_like(updates[0].weights["fc2.weight"], dtype=np.float64)
        for index in order:
            total += updates[index].num_samples * share * updates[index].weights["fc2.weight"].astype(np.float64)
        plain_sums.add(total.tobytes())
    assert len(plain_sums) > 1  # the former float64 sum of normalised terms did depend on the order


def test_the_exact_sum_is_within_its_grid_of_the_exactly_rounded_sum() -> None:
    rng = np.random.default_rng(0)
    terms = [rng.normal(0, 1, 500) * 10.0 ** rng.integers(-6, 6) for _ in range(8)]
    exact = ExactSum((500,))
    for term in terms:
        exact.add(term)
    reference = np.array([math.fsum(column) for column in zip(*terms)])
    assert np.max(np.abs(exact.total() - reference)) <= len(terms) * 2.0**-49 + np.max(np.abs(reference)) * 2.0**-52
    with pytest.raises(ValueError, match="beyond"):
        exact.add(np.array([2.0**47] * 500))


def test_an_update_that_would_leave_the_range_is_refused_whole() -> None:
    running = RunningSum()
    small = {"a": np.full(3, 1.0, np.float32), "b": np.full(2, 2.0, np.float32)}
    running.add("dev-0", small, 1.0)
    with pytest.raises(ValueError, match="beyond"):
        running.add("dev-1", {"a": np.full(3, 5.0, np.float32), "b": np.full(2, 2.0**30, np.float32)}, 2.0**20)
    assert list(running.coefficients) == ["dev-0"]
    mean = running.mean()
    assert all(np.array_equal(mean[name], small[name]) for name in small)
