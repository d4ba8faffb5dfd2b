# Differential privacy's math and round: clipping, the noise's std, the adaptive clip, the accountant, refusals.
from __future__ import annotations

import math
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
from dp_accounting import rdp
from scipy import stats

from bench.cli import main as bench_main
from coordinator.dashboard.live import Counters
from coordinator.dashboard.metrics import render_metrics
from coordinator.intake.round_aggregator import SuspectPolicy
from coordinator.intake.scratch import TensorScratch
from coordinator.privacy.dp_aggregator import DpAggregator, DpPlan
from coordinator.privacy.rounds import DpSettings, PrivateRounds, check_dp_settings, poisson_sample
from coordinator.strategies.aggregate import ClientUpdate
from coordinator.strategies.means import AveFL
from protocol import messages
from protocol.dp import (
    DP_CENTRAL,
    DP_DEVICE,
    DpRound,
    clip_delta,
    count_noise_std,
    delta_of,
    l2_norm,
    next_clip,
    privatised,
)
from protocol.dp_accountant import SampledGaussian, epsilon_of, noise_for_epsilon
from protocol.errors import UsageError

SIZE = 200_000


def variance_bounds(samples: int, confidence: float = 0.999) -> tuple[float, float]:
    """The range the ratio sample variance / true variance lies in with `confidence` (chi-square, samples - 1 dof)."""
    tail = (1.0 - confidence) / 2.0
    dof = samples - 1
    return stats.chi2.ppf(tail, dof) / dof, stats.chi2.ppf(1.0 - tail, dof) / dof


def test_the_variance_bound_is_tight_enough_to_catch_a_noise_two_percent_off() -> None:
    low, high = variance_bounds(SIZE)
    assert low > 0.98**2 and high < 1.02**2


def test_a_clipped_delta_has_norm_at_most_the_clip_over_all_its_tensors_together() -> None:
    rng = np.random.default_rng(3)
    base = {"a": rng.normal(size=(30, 20)).astype(np.float32), "b": rng.normal(size=7).astype(np.float32)}
    for scale in (1e-4, 0.01, 1.0, 100.0):
        weights = {
            name: (array + scale * rng.normal(size=array.shape)).astype(np.float32) for name, array in base.items()
        }
        delta = delta_of(weights, base)
        clipped, norm = clip_delta(delta, 0.5)
        assert norm == pytest.approx(l2_norm(delta))
        assert l2_norm(clipped) <= 0.5 * (1 + 1e-12)
        if norm <= 0.5:  # within the clip: unchanged
            assert all(np.array_equal(clipped[name], delta[name]) for name in delta)
        else:  # scaled, not truncated: the direction is kept
            assert np.allclose(clipped["a"] * norm / 0.5, delta["a"])


def test_a_device_clips_only_the_tensors_its_update_carries() -> None:
    base = {"head": np.zeros(4, dtype=np.float32), "body": np.ones(3, dtype=np.float32)}
    private, _ = privatised(
        {"head": np.full(4, 10.0, dtype=np.float32)}, base, DpRound(1.0, 0.0, 0.0, 1), np.random.default_rng(0)
    )
    assert set(private) == {"head"} and l2_norm(private) == pytest.approx(1.0, rel=1e-6)


def test_the_device_shares_of_noise_add_up_to_the_claimed_std_on_the_sum() -> None:
    """n devices each add N(0, (z C)^2 / n): the sum of their (identical, clipped) deltas carries N(0, (z C)^2)."""
    n, round_dp = 16, DpRound(clip=0.3, noise_multiplier=1.1, quantile=0.0, participants=16)
    base = {"w": np.zeros(SIZE, dtype=np.float32)}
    trained = {"w": np.full(SIZE, 1e-6, dtype=np.float32)}
    rng = np.random.default_rng(11)
    total = sum(delta_of(privatised(trained, base, round_dp, rng)[0], base)["w"] for _ in range(n))
    noise = total - n * 1e-6
    low, high = variance_bounds(SIZE)
    assert low <= np.var(noise, ddof=1) / round_dp.sum_std**2 <= high
    assert abs(float(np.mean(noise))) < 5 * round_dp.sum_std / math.sqrt(SIZE)


def dp_aggregator(
    tmp_path: Path, placement: str, round_dp: DpRound, expected: float, rng_seed: int = 5
) -> DpAggregator:
    """A DP aggregator over a zero model of one large tensor, its scratch under tmp_path."""
    base = {"w": np.zeros(SIZE, dtype=np.float32)}
    scratch = TensorScratch(tmp_path)
    plan = DpPlan(placement, round_dp, expected, 1.0, 0.2, np.random.default_rng(rng_seed), lambda event: 1.0)
    return DpAggregator(AveFL(), base, SuspectPolicy(), scratch, plan, model=base)


def test_central_placement_noises_the_sum_with_std_z_clip_and_divides_by_the_expected_count(tmp_path: Path) -> None:
    round_dp = DpRound(clip=0.5, noise_multiplier=0.8, quantile=0.0, participants=4.0)
    aggregator = dp_aggregator(tmp_path, DP_CENTRAL, round_dp, expected=4.0)
    for device in range(3):  # each delta is far beyond the clip: clipped to norm 0.5, all along the same vector
        aggregator.absorb(ClientUpdate(f"d{device}", {"w": np.full(SIZE, 1.0, dtype=np.float32)}, 10))
    aggregate = aggregator.finish(None)
    clipped_sum = 3 * 0.5 / math.sqrt(SIZE)
    noise = aggregate.weights["w"].astype(np.float64) * 4.0 - clipped_sum
    low, high = variance_bounds(SIZE)
    assert low <= np.var(noise, ddof=1) / (0.8 * 0.5) ** 2 <= high
    dp = aggregate.report["dp"]
    assert dp["reported"] == 3 and dp["within_clip_fraction"] == 0.0 and dp["effective_noise_multiplier"] == 0.8


def test_device_placement_adds_no_noise_of_its_own_and_refuses_an_unclipped_delta(tmp_path: Path) -> None:
    round_dp = DpRound(clip=0.5, noise_multiplier=0.0, quantile=0.0, participants=2)
    aggregator = dp_aggregator(tmp_path, DP_DEVICE, round_dp, expected=2.0)
    inside = {"w": np.full(SIZE, 0.4 / math.sqrt(SIZE), dtype=np.float32)}
    aggregator.absorb(ClientUpdate("d0", inside, 10, {"dp_within_clip": 1.0}))
    with pytest.raises(ValueError, match="exceeds the clip"):
        aggregator.absorb(ClientUpdate("d1", {"w": np.full(SIZE, 0.01, dtype=np.float32)}, 10, {"dp_within_clip": 1.0}))
    with pytest.raises(ValueError, match="not a noised 0 or 1"):
        aggregator.absorb(ClientUpdate("d2", inside, 10, {"dp_within_clip": 40.0}))
    aggregate = aggregator.finish(None)
    assert np.allclose(aggregate.weights["w"], inside["w"] / 2.0)
    assert aggregate.report["dp"]["effective_noise_multiplier"] == 0.0  # 1 of 2 reported, and z was 0


def test_device_placement_accounts_the_noise_of_the_devices_that_reported(tmp_path: Path) -> None:
    round_dp = DpRound(clip=1.0, noise_multiplier=2.0, quantile=0.0, participants=4)
    aggregator = dp_aggregator(tmp_path, DP_DEVICE, round_dp, expected=4.0)
    aggregator.absorb(ClientUpdate("d0", {"w": np.zeros(SIZE, dtype=np.float32)}, 10, {"dp_within_clip": 1.0}))
    assert aggregator.finish(None).report["dp"]["effective_noise_multiplier"] == pytest.approx(2.0 * math.sqrt(1 / 4))


def test_the_adaptive_clip_moves_towards_the_target_quantile_of_the_norms() -> None:
    rng = np.random.default_rng(2)
    norms = rng.lognormal(mean=0.0, sigma=0.5, size=5000)
    target = float(np.quantile(norms, 0.7))
    for start in (0.05, 20.0):
        clip, distances = start, []
        for _ in range(60):
            clip = next_clip(clip, float(np.mean(norms <= clip)), 0.7, 0.2)
            distances.append(abs(math.log(clip / target)))
        assert distances[-1] < 0.05 < distances[0]
    assert next_clip(1.0, 0.9, 0.5, 0.2) < 1.0 < next_clip(1.0, 0.1, 0.5, 0.2)  # too many within: shrink


def test_adaptive_clipping_spends_part_of_the_noise_on_the_count() -> None:
    fixed = DpRound(1.0, 1.0, 0.0, 100)
    adaptive = DpRound(1.0, 1.0, 0.5, 100)
    assert fixed.delta_multiplier == 1.0 and fixed.count_std == 0.0
    assert adaptive.count_std == count_noise_std(100, 1.0) == 5.0
    assert adaptive.delta_multiplier == pytest.approx((1.0 - 1.0 / 100.0) ** -0.5)
    assert DpRound(1.0, 1.0, 0.5, 3).delta_multiplier <= 1.155  # a small round: the count's noise is at least z


def test_the_accountant_is_dp_accounting_composing_poisson_sampled_gaussians() -> None:
    reference = rdp.RdpAccountant()
    reference.compose(dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(1.2)), 30)
    ours = epsilon_of([SampledGaussian(0.1, 1.2)] * 30, 1e-5)
    assert ours == pytest.approx(reference.get_epsilon(1e-5), rel=0.03)
    assert epsilon_of([], 1e-5) == 0.0 and epsilon_of([SampledGaussian(0.1, 0.0)], 1e-5) == math.inf
    z = noise_for_epsilon(2.0, 1e-5, 0.1, 40)
    assert (
        epsilon_of([SampledGaussian(0.1, z)] * 40, 1e-5)
        <= 2.0
        < epsilon_of([SampledGaussian(0.1, z * 0.98)] * 40, 1e-5)
    )


def test_poisson_sampling_includes_each_device_independently_at_the_rate() -> None:
    online = [f"d{index:03d}" for index in range(500)]
    sizes = [len(poisson_sample(online, 0.1, 0, round_id)) for round_id in range(1, 201)]
    assert 45 < np.mean(sizes) < 55 and np.std(sizes) > 3  # binomial(500, 0.1): mean 50, std 6.7 (not a fixed size)
    assert poisson_sample(online, 0.1, 0, 7) == poisson_sample(online, 0.1, 0, 7)  # a restart draws the same
    assert poisson_sample(online[:3], 1.0, 0, 1) == online[:3]


def test_the_budget_is_exhausted_exactly_when_the_next_round_would_cross_it() -> None:
    recipe = messages.Recipe(dp=DP_CENTRAL, dp_noise_multiplier=1.5)
    spent = [epsilon_of([SampledGaussian(0.5, 1.5)] * count, 1e-5) for count in range(1, 6)]
    budget = (spent[2] + spent[3]) / 2  # three rounds fit, a fourth would not
    history = []
    rounds = PrivateRounds(recipe, 0.5, DpSettings(1e-5, budget), history)
    for round_id in range(1, 6):
        if rounds.exhausted(round_id):
            break
        rounds.committed({"sampling_rate": 0.5, "effective_noise_multiplier": 1.5, "next_clip": 0.1})
    assert round_id == 4 and rounds.spent() == pytest.approx(spent[2])


@pytest.mark.parametrize(
    ("changes", "settings", "message"),
    [
        ({"strategy": "optfl"}, {}, "--dp central cannot run with --strategy optfl"),
        ({"strategy": "median"}, {}, "--dp central cannot run with --strategy median"),
        ({"strategy": "fedadam"}, {}, "--dp central cannot run with --strategy fedadam"),
        ({"exclude": True}, {}, "--dp central cannot run with --exclude-suspects"),
        ({"asynchronous": True}, {}, "--dp central cannot run with --mode async"),
        ({"dp": "off"}, {"epsilon_budget": 3.0}, "--dp-epsilon-budget needs --dp central or --dp device"),
        ({"dp": DP_DEVICE, "update_encoding": "int8-delta"}, {}, "--dp device cannot send int8 or top-k deltas"),
        ({"dp_clip": 0.0}, {}, "--dp-clip must be positive"),
        ({}, {"delta": 1.0}, "--dp-delta must lie in (0, 1)"),
    ],
)
def test_what_dp_cannot_run_with_is_refused_in_one_line(changes: dict, settings: dict, message: str) -> None:
    recipe_changes = {key: value for key, value in changes.items() if key in messages.Recipe.__dataclass_fields__}
    recipe = messages.Recipe(**{"dp": DP_CENTRAL, **recipe_changes})
    with pytest.raises(UsageError) as caught:
        check_dp_settings(
            recipe,
            changes.get("strategy", "avefl"),
            SuspectPolicy(exclude=changes.get("exclude", False)),
            changes.get("asynchronous", False),
            DpSettings(**settings),
        )
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_a_conflicting_run_is_refused_on_the_command_line_before_anything_starts(capsys, tmp_path: Path) -> None:
    run = ["simulate", "--devices", "1", "--rounds", "1", "--run-dir", str(tmp_path / "run")]
    assert bench_main([*run, "--dp", "device", "--strategy", "cadis"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("fl-bench: --dp device cannot run with --strategy cadis") and "\n" not in error
    assert not (tmp_path / "run" / "devices").exists()


def test_metrics_show_the_spent_epsilon_of_a_private_run_only() -> None:
    assert "fl_dp_epsilon_spent" not in render_metrics(Counters(), 0, 0)
    assert "\nfl_dp_epsilon_spent 1.25\n" in render_metrics(Counters(dp_epsilon=1.25), 0, 0)
