# DP-SGD on head-only devices (ALGORITHMS.md section 13.1): per-example clipping, the noise, Poisson batches, the ledger.
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
from dp_accounting import rdp

from coordinator.dashboard.views import RunSnapshot, privacy_view
from coordinator.intake.update_intake import RoundCollector
from coordinator.intake.validation import Expectation
from coordinator.rounds import evaluation
from coordinator.rounds.closing import DEVICE_EPSILON, RoundCloser, RoundTiming
from coordinator.storage.store import RunStore
from coordinator.strategies.registry import make_strategy
from edge_agent.learning.bundle import store_bundle
from edge_agent.learning.dp_sgd import LEDGER_FILE, PrivateSteps
from edge_agent.learning.head_learner import HeadLearner
from edge_agent.learning.head_training import HeadSettings, SgdSteps, cross_entropy_gradients, train_classifier
from edge_agent.learning.learner_choice import round_problem
from edge_agent.learning.local_data import LocalData
from edge_agent.learning.local_rules import DpSgd
from edge_agent.learning.models import build_model, get_weights
from edge_agent.loop.agent_settings import AgentSettings
from export.bundle_writer import ensure_bundle_files
from protocol import messages
from protocol.dp import DP_SGD_EPSILON_METRIC
from protocol.dp_accountant import ORDERS
from protocol.errors import UsageError


def private(tmp_path: Path, clip: float, noise: float, batch: int, seed: int = 0) -> PrivateSteps:
    """DP-SGD's steps with a seeded rng (the device's are from fresh entropy) and a ledger under tmp_path."""
    return PrivateSteps(clip, noise, batch, 1e-5, tmp_path / LEDGER_FILE, np.random.default_rng(seed))


def problem(rows: int, dim: int = 6, classes: int = 4, seed: int = 0) -> tuple[np.ndarray, ...]:
    """Random float64 features, labels and a head."""
    rng = np.random.default_rng(seed)
    features, labels = rng.normal(scale=2.0, size=(rows, dim)), rng.integers(0, classes, rows)
    return features, labels, rng.normal(size=(classes, dim)), rng.normal(size=classes)


def loss_of(features: np.ndarray, labels: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> float:
    """The mean cross-entropy, as the trainer computes it."""
    return cross_entropy_gradients(features, labels, weight, bias)[0]


def test_an_unclipped_example_gradient_is_the_finite_difference_of_its_loss(tmp_path: Path) -> None:
    features, labels, weight, bias = problem(3)
    steps = private(tmp_path, math.inf, 0.0, 1)
    for row in range(3):
        x, y = features[row : row + 1], labels[row : row + 1]
        _, grad_weight, grad_bias = steps.gradients(x, y, [weight, bias], None)
        for parameter, gradient in ((weight, grad_weight), (bias, grad_bias)):
            numeric = np.zeros_like(parameter)
            for index in np.ndindex(parameter.shape):
                step = np.zeros_like(parameter)
                step[index] = 1e-6
                plus = (weight + step, bias) if parameter is weight else (weight, bias + step)
                minus = (weight - step, bias) if parameter is weight else (weight, bias - step)
                numeric[index] = (loss_of(x, y, *plus) - loss_of(x, y, *minus)) / 2e-6
            assert np.allclose(gradient, numeric, atol=1e-6), row


def test_each_example_gradient_is_clipped_to_c_and_a_batch_is_their_sum_over_the_batch_size(tmp_path: Path) -> None:
    features, labels, weight, bias = problem(40)
    clip, norms = 0.5, []
    one = private(tmp_path, clip, 0.0, 1)
    singles = []
    for row in range(40):
        _, grad_weight, grad_bias = one.gradients(features[row : row + 1], labels[row : row + 1], [weight, bias], None)
        unclipped = private(tmp_path, math.inf, 0.0, 1).gradients(
            features[row : row + 1], labels[row : row + 1], [weight, bias], None
        )
        norms.append(math.hypot(np.linalg.norm(unclipped[1]), np.linalg.norm(unclipped[2])))
        clipped = math.hypot(np.linalg.norm(grad_weight), np.linalg.norm(grad_bias))
        assert clipped <= clip * (1 + 1e-12)
        assert clipped == pytest.approx(min(norms[-1], clip), rel=1e-9)
        singles.append((grad_weight, grad_bias))
    assert min(norms) < clip < max(norms)
    _, batch_weight, batch_bias = private(tmp_path, clip, 0.0, 40).gradients(features, labels, [weight, bias], None)
    assert np.allclose(batch_weight, sum(w for w, _ in singles) / 40, atol=1e-12)
    assert np.allclose(batch_bias, sum(b for _, b in singles) / 40, atol=1e-12)


def test_the_noise_has_std_z_c_over_the_expected_batch(tmp_path: Path) -> None:
    clip, noise, batch = 0.7, 1.3, 4
    weight, bias = np.zeros((10, 20_000)), np.zeros(10)
    empty = np.zeros((0, 20_000))
    _, grad_weight, grad_bias = private(tmp_path, clip, noise, batch, seed=5).gradients(
        empty, np.zeros(0, np.int64), [weight, bias], None
    )
    entries = np.concatenate([grad_weight.ravel(), grad_bias])
    std, count = noise * clip / batch, len(entries)
    assert abs(entries.mean()) < 5 * std / math.sqrt(count)
    # the sample variance over 200k entries: chi-square with n degrees, relative sd sqrt(2 / n) (0.32%)
    assert abs(np.mean(np.square(entries)) / std**2 - 1.0) < 5 * math.sqrt(2.0 / count)


class ShuffledPrivate(PrivateSteps):
    """DP-SGD's gradients over plain SGD's seeded shuffled batches (only to compare with plain training)."""

    batches = SgdSteps.batches


def test_without_noise_or_clip_the_private_step_is_plain_sgd_bit_for_bit(tmp_path: Path) -> None:
    features, labels, weight, bias = (array.astype(np.float32) for array in problem(96, seed=2))
    settings = HeadSettings(3, 16, 0.1, 0.9, 1e-3, 0.2, 7, "cosine")
    plain = train_classifier(features, labels, weight, bias, settings)
    steps = ShuffledPrivate(math.inf, 0.0, 16, 1e-5, tmp_path / LEDGER_FILE, np.random.default_rng(1))
    same = train_classifier(features, labels, weight, bias, settings, None, steps)
    assert plain[0].tobytes() == same[0].tobytes() and plain[1].tobytes() == same[1].tobytes()
    assert plain[2] == same[2]
    clipped = ShuffledPrivate(0.1, 0.0, 16, 1e-5, tmp_path / LEDGER_FILE, np.random.default_rng(1))
    assert not np.allclose(train_classifier(features, labels, weight, bias, settings, None, clipped)[0], plain[0])


def test_poisson_batches_include_each_row_at_rate_batch_over_n(tmp_path: Path) -> None:
    steps = private(tmp_path, 1.0, 1.0, 10)
    sizes = [len(batch) for _ in range(200) for batch in steps.batches(250, 10, np.random.default_rng(0))]
    assert len(sizes) == 200 * 25 and min(sizes) >= 0
    q = 10 / 250
    assert abs(np.mean(sizes) - 10) < 5 * math.sqrt(250 * q * (1 - q) / len(sizes))
    assert steps.sampling_rate(250) == q and steps.sampling_rate(5) == 1.0


def reference_epsilon(rate: float, noise: float, steps: int, delta: float) -> float:
    """dp_accounting's RDP epsilon of `steps` Poisson-sampled Gaussian steps, composed directly."""
    accountant = rdp.RdpAccountant(list(ORDERS))
    accountant.compose(dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(noise)), steps)
    return float(accountant.get_epsilon(delta))


def test_the_epsilon_is_dp_accountings_for_every_step_so_far_and_survives_a_restart(tmp_path: Path) -> None:
    settings = HeadSettings(epochs=2, batch_size=8, learning_rate=0.1)
    first = private(tmp_path, 1.0, 1.1, 8).spent(100, settings)[DP_SGD_EPSILON_METRIC]
    assert first == pytest.approx(reference_epsilon(0.08, 1.1, 2 * 13, 1e-5), rel=1e-9)
    again = private(tmp_path, 1.0, 1.1, 8, seed=9).spent(100, settings)[DP_SGD_EPSILON_METRIC]
    assert again == pytest.approx(reference_epsilon(0.08, 1.1, 4 * 13, 1e-5), rel=1e-9) and again > first
    assert (tmp_path / LEDGER_FILE).is_file()
    grown = private(tmp_path, 1.0, 1.1, 8).spent(200, settings)[DP_SGD_EPSILON_METRIC]
    accountant = rdp.RdpAccountant(list(ORDERS))
    for rate, steps in ((0.04, 2 * 25), (0.08, 4 * 13)):
        accountant.compose(dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(1.1)), steps)
    assert grown == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-9)


def head_learner(tmp_path: Path) -> HeadLearner:
    """A head-only learner over a fresh model's bundle (its prefix trains, so rows are images)."""
    weights = get_weights(build_model(seed=0))
    bundle = store_bundle(tmp_path / "bundle", ensure_bundle_files(weights, tmp_path / "export"))
    return HeadLearner(AgentSettings("f", "d", trainer="head").compute, tmp_path, weights, bundle)


def local_data(tmp_path: Path, rows: int) -> LocalData:
    """`rows` labelled random images and nothing else."""
    rng = np.random.default_rng(3)
    images, labels = rng.integers(0, 255, (rows, 28, 28), dtype=np.uint8), rng.integers(0, 10, rows)
    empty = np.zeros((0, 28, 28), np.uint8)
    none = np.zeros(0, np.int64)
    return LocalData(empty, none, empty, none, images, labels, lambda: empty, state_dir=tmp_path)


def test_a_head_only_device_trains_dp_sgd_and_reports_the_epsilon_of_all_its_rounds(tmp_path: Path) -> None:
    recipe = messages.Recipe(local_rule="dp-sgd", epochs=2, batch_size=10, options={"dp_sgd_noise_multiplier": 1.5})
    data = local_data(tmp_path, 50)
    learner = head_learner(tmp_path)
    metrics = learner.train(data, recipe, seed=1)
    assert metrics[DP_SGD_EPSILON_METRIC] == pytest.approx(reference_epsilon(0.2, 1.5, 10, 1e-5), rel=1e-9)
    again = head_learner(tmp_path)  # a restarted device: its ledger is all it remembers
    restarted = again.train(data, recipe, seed=1)
    assert restarted[DP_SGD_EPSILON_METRIC] == pytest.approx(reference_epsilon(0.2, 1.5, 20, 1e-5), rel=1e-9)
    head = learner.bundle.manifest.head
    assert head is not None
    first, second = learner.weights()[head.weight], again.weights()[head.weight]
    assert not np.array_equal(first, second)  # the same seed: the batches and the noise come from fresh entropy
    assert not np.array_equal(first, get_weights(build_model(seed=0))[head.weight])


def test_dp_sgd_runs_on_head_only_devices_and_a_full_model_device_refuses_it_in_one_line(tmp_path: Path) -> None:
    recipe = messages.Recipe(local_rule="dp-sgd")
    assert round_problem(AgentSettings("f", "d").compute, recipe, None) == (
        "local rule 'dp-sgd' trains the classifier alone; this profile trains the whole model"
    )
    learner = head_learner(tmp_path)
    assert round_problem(AgentSettings("f", "d", trainer="head").compute, recipe, learner.bundle) is None


def test_dp_sgd_refuses_options_out_of_range_and_data_without_a_state_directory(tmp_path: Path) -> None:
    for key, value, message in (
        ("dp_sgd_clip", -1.0, "--dp-sgd-clip must be at least 0"),
        ("dp_sgd_noise_multiplier", -0.5, "--dp-sgd-noise-multiplier must be at least 0"),
        ("dp_sgd_delta", 0.0, r"--dp-sgd-delta must lie in \[1e-12, 1\)"),
        ("dp_sgd_delta", 1.0, r"--dp-sgd-delta must lie in \[1e-12, 1\)"),
    ):
        with pytest.raises(UsageError, match=message):
            DpSgd.option_value({key: value}, key)
    without = dataclasses.replace(local_data(tmp_path, 5), state_dir=None)
    with pytest.raises(ValueError, match="dp-sgd keeps its privacy ledger in the device's state directory"):
        head_learner(tmp_path).train(without, messages.Recipe(local_rule="dp-sgd"), seed=0)


def test_dp_sgd_still_learns_a_separable_problem_at_noise_one(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 4, 2000)
    features = (np.eye(4)[labels] * 3.0 + rng.normal(scale=0.3, size=(2000, 4))).astype(np.float32)
    settings = HeadSettings(epochs=5, batch_size=100, learning_rate=0.5, seed=3)
    weight, bias, _ = train_classifier(
        *(features, labels, np.zeros((4, 4), np.float32), np.zeros(4, np.float32), settings),
        steps=private(tmp_path, 1.0, 1.0, 100, seed=4),
    )
    assert np.mean(np.argmax(features @ weight.T + bias, axis=1) == labels) > 0.95


SCORES = evaluation.RoundScores(evaluation.TestScores(0.5), evaluation.TestScores(float("nan")))


def reported(device: str, metrics: dict[str, float]) -> messages.Update:
    """An accepted update of round 1 carrying these metrics (its tensors do not matter to the record)."""
    return messages.Update(device, 1, device, "base", 4, [4], 4, metrics, {})


def test_the_round_record_keeps_each_dp_sgd_devices_epsilon_and_a_plain_round_keeps_its_record(tmp_path: Path) -> None:
    collector = RoundCollector(Expectation(1, "base", {}, 10, 1 << 20))
    collector.accepted.update(
        {"b": reported("b", {DP_SGD_EPSILON_METRIC: 2.5}), "a": reported("a", {DP_SGD_EPSILON_METRIC: 1.25})}
    )
    closer = RoundCloser(RunStore(tmp_path / "run"), make_strategy("avefl"), None, False, 0)  # type: ignore[arg-type]
    record = closer.round_record(collector, RoundTiming(0.0, 0.0), SCORES, {}, {}, {})
    assert record.metrics[DEVICE_EPSILON] == {"a": 1.25, "b": 2.5}
    later = dataclasses.replace(record, round_id=2, metrics={DEVICE_EPSILON: {"a": 1.75}})
    privacy = privacy_view(RunSnapshot(rounds=[record, later]))
    assert privacy["dp_sgd_epsilons"] == {"a": 1.75, "b": 2.5}
    assert privacy["summary"] == "DP-SGD on 2 devices: example-level epsilon up to 2.5"
    assert privacy_view(RunSnapshot(rounds=[dataclasses.replace(record, metrics={})]))["summary"] == "off"
    plain = RoundCollector(Expectation(1, "base", {}, 10, 1 << 20))
    plain.accepted["a"] = reported("a", {"train_loss": 0.5})
    assert DEVICE_EPSILON not in closer.round_record(plain, RoundTiming(0.0, 0.0), SCORES, {}, {}, {}).metrics
