# The round machinery's pure parts: suspect-aware aggregation.
from __future__ import annotations

import numpy as np

from coordinator.rounds import SuspectPolicy, aggregate_with_suspects
from coordinator.strategies import AveFL, ClientUpdate, Median, weighted_average
from edge_agent.models import build_model, get_weights


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
