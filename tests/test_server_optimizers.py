# Server optimisers (FedAvgM, FedAdam, FedYogi, FedAdagrad) against hand-computed steps; their state across restarts.
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from coordinators import commit_weights, coordinator_on

from coordinator.storage.store import RunStore
from coordinator.strategies.aggregate import ClientUpdate
from coordinator.strategies.means import FedAvg
from coordinator.strategies.registry import make_strategy
from coordinator.strategies.server_optimizers import adam_moment, adaptive_step, momentum_step, yogi_moment
from edge_agent.learning.models import build_model, get_weights

BASE = {"w": np.array([0.0, 1.0, -2.0], dtype=np.float32)}


def updates_towards(*targets: list[float], samples: tuple[int, ...] = (1, 3)) -> list[ClientUpdate]:
    """One update per target vector, with the given sample counts."""
    return [
        ClientUpdate(f"dev-{i}", {"w": np.array(target, dtype=np.float32)}, count)
        for i, (target, count) in enumerate(zip(targets, samples))
    ]


def test_fedavgm_with_lr_1_and_no_momentum_is_fedavg() -> None:
    updates = updates_towards([1.0, 1.0, 0.0], [0.0, 3.0, -2.0])
    plain, _ = FedAvg().aggregate(BASE, updates, None)
    stepped, report = make_strategy("fedavgm", server_lr=1.0, server_momentum=0.0).aggregate(BASE, updates, None)
    np.testing.assert_allclose(stepped["w"], plain["w"], atol=1e-7)
    assert report["server_optimizer"]["step_norm"] == pytest.approx(report["server_optimizer"]["pseudo_gradient_norm"])


def test_fedavgm_momentum_carries_the_last_step() -> None:
    strategy = make_strategy("fedavgm", server_lr=0.5, server_momentum=0.5)
    first, _ = strategy.aggregate(BASE, updates_towards([2.0, 1.0, -2.0], [2.0, 1.0, -2.0]), None)
    np.testing.assert_allclose(first["w"], [1.0, 1.0, -2.0])  # m = (2, 0, 0), x = 0 + 0.5 m
    second, _ = strategy.aggregate(first, updates_towards([1.0, 1.0, -2.0], [1.0, 1.0, -2.0]), None)
    np.testing.assert_allclose(second["w"], [1.5, 1.0, -2.0])  # Delta = 0, m = 0.5 (2, 0, 0), x = 1 + 0.5 m


def test_momentum_step_of_a_zero_delta_without_history_stays_put() -> None:
    following, momentum = momentum_step(BASE, {"w": np.zeros(3)}, {}, 1.0, 0.9)
    np.testing.assert_array_equal(following["w"], BASE["w"])
    np.testing.assert_array_equal(momentum["w"], np.zeros(3))


@pytest.mark.parametrize(
    ("name", "second_moment"),
    [
        ("fedadam", lambda d2, tau, b2: b2 * tau**2 + (1 - b2) * d2),
        ("fedyogi", lambda d2, tau, b2: tau**2 - (1 - b2) * d2 * np.sign(tau**2 - d2)),
        ("fedadagrad", lambda d2, tau, b2: tau**2 + d2),
    ],
)
def test_the_first_adaptive_step_matches_the_formula(name: str, second_moment) -> None:
    """x1 = x0 + lr (1 - b1) Delta / (sqrt(v1) + tau), v0 = tau^2, Delta the sample-weighted mean minus x0."""
    lr, b1, b2, tau = 0.1, 0.9, 0.99, 0.01
    options = {"server_lr": lr, "beta1": b1, "tau": tau} | ({} if name == "fedadagrad" else {"beta2": b2})
    updates = updates_towards([4.0, 1.0, -2.0], [0.0, 1.0, -1.0])  # samples 1 and 3
    delta = (np.array([4.0, 1.0, -2.0]) * 1 + np.array([0.0, 1.0, -1.0]) * 3) / 4 - BASE["w"]
    stepped, _ = make_strategy(name, **options).aggregate(BASE, updates, None)
    v1 = second_moment(delta**2, tau, b2)
    expected = BASE["w"] + lr * (1 - b1) * delta / (np.sqrt(v1) + tau)
    np.testing.assert_allclose(stepped["w"], expected.astype(np.float32), rtol=1e-6)
    assert abs(stepped["w"][0] - BASE["w"][0]) == pytest.approx(lr * (1 - b1) * 1.0 / (math.sqrt(v1[0]) + tau))


def test_yogi_grows_its_second_moment_no_faster_than_adam() -> None:
    v, squared = np.array([0.0, 1.0, 4.0]), np.array([4.0, 1.0, 0.0])
    assert np.all(np.abs(yogi_moment(v, squared, 0.9) - v) <= np.abs(adam_moment(v, squared, 0.9) - v) + 1e-12)
    assert np.all(yogi_moment(v, squared, 0.9) >= 0)


def test_a_zero_pseudo_gradient_moves_nothing_and_keeps_moments_finite() -> None:
    following, moments = adaptive_step(BASE, {"w": np.zeros(3)}, {}, adam_moment, (0.1, 0.9, 0.99, 1e-3))
    np.testing.assert_array_equal(following["w"], BASE["w"])
    assert all(np.all(np.isfinite(array)) for array in moments.values())


@pytest.mark.parametrize("name", ["fedavgm", "fedadam", "fedyogi", "fedadagrad"])
def test_the_streamed_step_equals_the_batch_step(name: str) -> None:
    updates = updates_towards([1.0, 2.0, 0.5], [0.5, 0.0, -1.0])
    batch, _ = make_strategy(name).aggregate(BASE, updates, None)
    streaming = make_strategy(name)
    running = streaming.begin()
    for update in reversed(updates):
        streaming.accumulate(running, update)
    streamed, _ = streaming.finish(running, BASE)
    np.testing.assert_allclose(streamed["w"], batch["w"], rtol=1e-6)


@pytest.mark.parametrize("name", ["fedavgm", "fedadam", "fedyogi", "fedadagrad"])
def test_the_optimiser_state_survives_a_coordinator_restart(tmp_path: Path, name: str) -> None:
    """Round 1 commits the moments; a restarted coordinator's round 2 equals an uninterrupted one, and differs
    from a strategy that forgot round 1."""
    model = get_weights(build_model(seed=0))
    rng = np.random.default_rng(0)

    def round_updates() -> list[ClientUpdate]:
        return [
            ClientUpdate(f"d{i}", {k: v + rng.normal(0, 0.01, v.shape).astype(v.dtype) for k, v in model.items()}, 10)
            for i in range(3)
        ]

    first_round, second_round = round_updates(), round_updates()
    with RunStore(tmp_path) as store:
        before = coordinator_on(store, make_strategy(name))
        after_first, _ = before.parts.closer.strategy.aggregate(model, first_round, None)
        commit_weights(before, 1, after_first, model)
    assert (tmp_path / "checkpoints" / "strategy_round_0001.npz").is_file()
    with RunStore(tmp_path) as store:
        resumed = coordinator_on(store, make_strategy(name)).parts.closer.strategy
        assert resumed.state() == {"rounds": 1}
        resumed_second, _ = resumed.aggregate(after_first, second_round, None)
    continued_second, _ = before.parts.closer.strategy.aggregate(after_first, second_round, None)
    forgetful_second, _ = make_strategy(name).aggregate(after_first, second_round, None)
    for tensor in model:
        np.testing.assert_array_equal(resumed_second[tensor], continued_second[tensor])
    assert any(not np.array_equal(forgetful_second[t], continued_second[t]) for t in model)


def test_a_server_optimiser_refuses_a_malformed_stored_state() -> None:
    with pytest.raises(ValueError, match="needs a non-negative 'rounds'"):
        make_strategy("fedadam").load_state({"rounds": -1}, {})


def test_a_shared_flag_is_taken_by_the_chosen_strategy_and_refused_for_one_without_it(tmp_path: Path, capsys) -> None:
    from bench.cli import main

    code = main(["simulate", "--devices", "2", "--rounds", "1", "--run-dir", str(tmp_path), "--server-lr", "0.1"])
    assert code == 2
    assert "--server-lr is an option of strategy 'fedavgm'; this run uses 'avefl'" in capsys.readouterr().err
