# The stream budget controller (pure numpy): the bucket bounds labelling, the threshold picks the uncertain arrivals.
from __future__ import annotations

import numpy as np
import pytest

from edge_agent.field.stream import (
    BudgetSettings,
    BudgetState,
    decide,
    default_burst,
    query_fraction,
    refill,
    score_threshold,
    start_state,
)


def run_stream(settings: BudgetSettings, times: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """Feeds arrivals through decide; returns the boolean query decisions."""
    state = start_state(settings, float(times[0]))
    asked = []
    for now, score in zip(times.tolist(), scores.tolist()):
        query, state = decide(state, score, now, settings)
        asked.append(query)
    return np.array(asked)


def assert_within_budget(query_times: np.ndarray, settings: BudgetSettings) -> None:
    """No interval [a, b] holds more queries than burst + rate * (b - a)."""
    rate = settings.labels_per_hour / 3600.0
    for start in range(len(query_times)):
        spans = query_times[start:] - query_times[start]
        counts = np.arange(1, len(spans) + 1)
        assert np.all(counts <= settings.burst + rate * spans + 1e-9), f"over budget from query {start}"


def test_a_stream_ten_times_faster_than_the_budget_spends_about_the_budget_on_the_most_uncertain():
    settings = BudgetSettings(labels_per_hour=30, burst=5)
    rng = np.random.default_rng(0)
    times = np.arange(3600) * 10.0
    scores = rng.random(3600)
    asked = run_stream(settings, times, scores)
    hours = times[-1] / 3600
    assert 0.8 * 30 * hours <= asked.sum() <= 5 + 30 * hours
    assert_within_budget(times[asked], settings)
    assert scores[asked].mean() > 0.85, "the budget goes to the high-entropy arrivals"
    assert np.median(scores[asked]) > np.quantile(scores, 0.85)


def test_adversarial_bursts_of_top_scores_stay_within_the_bucket():
    settings = BudgetSettings(labels_per_hour=60, burst=3)
    times = np.repeat(np.arange(20) * 600.0, 50)
    asked = run_stream(settings, times, np.ones(len(times)))
    assert_within_budget(times[asked], settings)
    assert asked.sum() == 3 + 19 * 3, "each burst of 50 gets the 10 minutes' refill, capped at the burst"


def test_a_slow_stream_is_labelled_whole_and_the_threshold_rises_with_the_arrival_rate():
    settings = BudgetSettings(labels_per_hour=60, burst=2)
    times = np.arange(40) * 120.0
    assert run_stream(settings, times, np.random.default_rng(1).random(40)).all()
    scores = np.linspace(0, 1, 100)
    assert query_fraction(np.arange(100) * 6.0, 60) == pytest.approx(0.1, rel=0.02)
    slow = score_threshold(scores, np.arange(100) * 60.0, settings)
    fast = score_threshold(scores, np.arange(100) * 6.0, settings)
    assert slow == 0.0 and fast == pytest.approx(0.9, abs=0.02)
    assert score_threshold(scores[:5], np.arange(5.0), settings) == -np.inf
    assert query_fraction(np.zeros(10), 60) == 0.0


def test_refill_caps_at_the_burst_and_ignores_a_clock_going_back():
    settings = BudgetSettings(labels_per_hour=3600, burst=4)
    assert refill(0.0, 2.5, settings) == pytest.approx(2.5)
    assert refill(3.0, 100.0, settings) == 4.0
    assert refill(1.0, -50.0, settings) == 1.0
    assert default_burst(10) == 2.5 and default_burst(2) == 1.0


def test_state_round_trips_through_json_and_garbage_is_refused():
    settings = BudgetSettings(labels_per_hour=10, burst=2)
    _, state = decide(start_state(settings, 100.0), 0.5, 130.0, settings)
    assert BudgetState.from_json(state.to_json()) == state and state.tokens == 1.0
    for bad in (
        {},
        {"tokens": "x", "updated_at": 0, "scores": [], "times": []},
        {"tokens": 1, "updated_at": 0, "scores": [1.0], "times": []},
    ):
        with pytest.raises(ValueError, match="stream budget state"):
            BudgetState.from_json(bad)


def test_settings_are_checked():
    for kwargs in (
        {"labels_per_hour": 0, "burst": 1},
        {"labels_per_hour": 10, "burst": 0.5},
        {"labels_per_hour": 10, "burst": 1, "window": 5, "min_history": 6},
    ):
        with pytest.raises(ValueError):
            BudgetSettings(**kwargs)
