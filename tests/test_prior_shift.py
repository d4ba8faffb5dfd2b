# A device adapts the head it serves to its class mix only where its labels differ from the fleet's beyond chance.
from __future__ import annotations

import numpy as np
import pytest

from edge_agent.learning.prior_shift import chi2_tail, differs_from_fleet, prior_weights, reweighted
from protocol import messages, wire


@pytest.mark.parametrize(("statistic", "freedom", "tail"), [(16.92, 9, 0.05), (27.88, 9, 0.001), (10.83, 1, 0.001)])
def test_the_chi_squared_tail_is_within_a_fifth_of_the_tables(statistic: float, freedom: int, tail: float) -> None:
    assert chi2_tail(statistic, freedom) == pytest.approx(tail, rel=0.2)


def test_labels_drawn_like_the_fleets_leave_the_head_as_it_is() -> None:
    rng = np.random.default_rng(0)
    shares = rng.dirichlet(np.full(10, 5.0))
    unchanged = sum(np.all(prior_weights(rng.multinomial(100, shares), shares) == 1.0) for _ in range(200))
    assert unchanged >= 195, "at the test's level, about 1 in 1000 devices like the fleet adapts by chance"


def test_a_device_whose_labels_skip_most_classes_weighs_them_down() -> None:
    shares = np.full(10, 0.1)
    counts = np.array([30, 25, 0, 0, 0, 0, 0, 0, 0, 5])
    assert differs_from_fleet(counts, shares)
    weights = prior_weights(counts, shares)
    assert weights[0] > weights[9] > weights[2] and np.all(weights[2:9] == weights[2])
    posteriors = np.array([[0.30, 0.05, 0.40, 0.05, 0.05, 0.05, 0.04, 0.02, 0.02, 0.02]])
    assert np.argmax(posteriors) == 2 and np.argmax(reweighted(posteriors, weights)) == 0
    assert reweighted(posteriors, weights).sum() == pytest.approx(1.0)


@pytest.mark.parametrize("shares", [[], [0.5, 0.5], [0.0] * 10, [-0.1] + [0.11] * 9])
def test_unknown_or_malformed_fleet_shares_leave_the_head_as_it_is(shares: list[float]) -> None:
    assert np.all(prior_weights(np.array([9, 0, 0, 0, 0, 0, 0, 0, 0, 1]), np.asarray(shares)) == 1.0)


def test_the_round_announcement_carries_the_label_shares_and_omits_them_when_unknown() -> None:
    shared = messages.RoundAnnouncement("run", 3, "h" * 64, messages.Recipe(), 1.0, label_shares=[0.25, 0.75])
    assert wire.decode(wire.encode(shared), messages.RoundAnnouncement).label_shares == [0.25, 0.75]
    unknown = messages.RoundAnnouncement("run", 3, "h" * 64, messages.Recipe(), 1.0)
    assert b"label_shares" not in wire.encode(unknown)
