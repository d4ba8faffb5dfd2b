# The pooled head: statistics summed over devices fit the head the pooled labels give, however the labels are spread.
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from coordinator.asynchronous.intake import AsyncPolicy
from coordinator.intake.round_aggregator import SuspectPolicy, make_aggregator
from coordinator.intake.scratch import TensorScratch
from coordinator.privacy.rounds import DpSettings, PrivateRounds
from coordinator.setup.server_data import evaluation_line, load_server_data
from coordinator.setup.settings import ServerSettings
from coordinator.strategies.aggregate import ClientUpdate
from coordinator.strategies.pooled_head import UNSEEN_BIAS, PooledHead, lda_head, relative_temperature
from coordinator.strategies.registry import make_strategy
from protocol import head_statistics, messages
from protocol.dp import WITHIN_CLIP_METRIC, DpRound, privatised
from protocol.errors import UsageError
from protocol.head_statistics import TEMPERATURES, HeadStatistics, calibration_sums
from protocol.model_spec import DEFAULT_SPEC
from protocol.trained_set import POOL_STATISTICS, STATISTICS_RULE

CLASSES, FEATURES = 4, 12
HEAD = {
    "classifier_fc.weight": np.zeros((CLASSES, FEATURES), np.float32),
    "classifier_fc.bias": np.zeros(CLASSES, np.float32),
}


def gaussian_classes(rows: int, seed: int, noise: float = 0.6) -> tuple[np.ndarray, np.ndarray]:
    """Non-negative features (as a ReLU6 backbone gives) of CLASSES Gaussian classes with a shared covariance."""
    rng = np.random.default_rng(seed)
    centres = np.random.default_rng(99).uniform(1.0, 4.0, size=(CLASSES, FEATURES))
    labels = rng.integers(CLASSES, size=rows)
    return np.clip(centres[labels] + rng.normal(0.0, noise, size=(rows, FEATURES)), 0.0, 6.0), labels


def device_updates(features: np.ndarray, labels: np.ndarray, owners: np.ndarray) -> list[ClientUpdate]:
    """Each owner's statistics as its update would carry them, weighed by its label count."""
    updates = []
    for owner in np.unique(owners):
        mine = owners == owner
        tensors = HeadStatistics.of_labels(features[mine], labels[mine], CLASSES).tensors()
        updates.append(ClientUpdate(f"dev-{owner}", tensors, float(np.count_nonzero(mine))))
    return updates


def fitted_head(updates: list[ClientUpdate], scratch: Path) -> dict[str, np.ndarray]:
    """The head a plain round of pooled-head commits from these updates (the round aggregator, streamed)."""
    base = head_statistics.layout(CLASSES, FEATURES)
    aggregator = make_aggregator(PooledHead(), base, SuspectPolicy(), TensorScratch(scratch), model=HEAD, head=HEAD)
    for update in updates:
        aggregator.absorb(update)
    return aggregator.finish(None).weights


def test_the_fleet_fits_the_head_the_pooled_labels_give_however_they_are_spread(tmp_path: Path) -> None:
    features, labels = gaussian_classes(400, seed=1)
    pooled = fitted_head(device_updates(features, labels, np.zeros(len(labels), np.int64)), tmp_path)
    by_class = fitted_head(device_updates(features, labels, labels), tmp_path)  # each device holds one class only
    spread = np.random.default_rng(2).integers(7, size=len(labels))
    uneven = fitted_head(device_updates(features, labels, spread), tmp_path)
    for name in HEAD:
        np.testing.assert_allclose(by_class[name], pooled[name], rtol=2e-4, atol=2e-4)
        np.testing.assert_allclose(uneven[name], pooled[name], rtol=2e-4, atol=2e-4)
    test, truth = gaussian_classes(400, seed=3)
    logits = test @ pooled["classifier_fc.weight"].T + pooled["classifier_fc.bias"]
    assert np.mean(np.argmax(logits, 1) == truth) > 0.95


def test_a_class_no_label_holds_is_never_predicted_and_an_empty_round_keeps_the_head() -> None:
    features, labels = gaussian_classes(200, seed=4)
    held = labels != 2
    weight, bias = lda_head(HeadStatistics.of_labels(features[held], labels[held], CLASSES), 0.8)
    assert np.all(weight[2] == 0.0) and bias[2] == UNSEEN_BIAS
    assert 2 not in np.argmax(features @ weight.T + bias, 1)
    empty = {name: np.zeros_like(array) for name, array in head_statistics.layout(CLASSES, FEATURES).items()}
    kept = {name: array + 1.0 for name, array in HEAD.items()}
    head, report = PooledHead().fitted(empty, kept)
    assert report["classes_seen"] == 0 and all(np.array_equal(head[name], kept[name]) for name in HEAD)


def test_the_temperature_is_chosen_on_held_out_labels_and_carried_to_more_labels() -> None:
    rng = np.random.default_rng(5)
    true_logits = rng.normal(0.0, 2.0, size=(2000, CLASSES))  # calibrated: each label is drawn from their softmax
    chances = np.exp(true_logits) / np.exp(true_logits).sum(1, keepdims=True)
    labels = np.array([rng.choice(CLASSES, p=row) for row in chances])
    sums = calibration_sums(true_logits * 10.0, labels)  # a head ten times too sure of itself
    losses = sums[:-1]
    assert sums[-1] == 2000 and TEMPERATURES[int(np.argmin(losses))] == pytest.approx(10.0, rel=0.3)
    chosen = TEMPERATURES[np.argmin(losses)]
    assert relative_temperature(np.array([*losses, 0.25])) == pytest.approx(0.75**2 * np.sqrt(chosen))
    assert relative_temperature(np.array([*losses, 0.0])) is None
    strategy = PooledHead()
    features, labels = gaussian_classes(200, seed=6)
    statistics = HeadStatistics.of_labels(features, labels, CLASSES, np.array([*losses, 50.0])).tensors()
    strategy.fitted(statistics, HEAD)
    assert strategy.temperature == 1.0, "the first fit has no head of its own to calibrate against"
    _, report = strategy.fitted(statistics, HEAD)
    assert report["temperature"] == pytest.approx(relative_temperature(np.array([*losses, 50.0]) / 200))
    restarted = PooledHead()
    restarted.load_state(strategy.state() or {}, {})
    assert restarted.temperature == strategy.temperature


def test_statistics_and_their_layout_round_trip_as_an_update_carries_them() -> None:
    features, labels = gaussian_classes(50, seed=7)
    statistics = HeadStatistics.of_labels(features, labels, CLASSES)
    back = HeadStatistics.of_tensors(statistics.tensors())
    np.testing.assert_allclose(back.second_moment, statistics.second_moment, rtol=1e-6)
    layout = head_statistics.layout(CLASSES, FEATURES)
    assert {name: array.shape for name, array in statistics.tensors().items()} == {
        name: array.shape for name, array in layout.items()
    }
    assert max(float(np.max(np.abs(array))) for array in statistics.tensors().values()) <= 1.0
    with pytest.raises(ValueError, match="at least one labelled row"):
        HeadStatistics.of_labels(features[:0], labels[:0], CLASSES)


def pool_statistics(
    labelled: tuple[np.ndarray, np.ndarray], pool: np.ndarray, head: tuple[np.ndarray, np.ndarray], new: int = 0
) -> dict[str, np.ndarray]:
    """One device's statistics with its pool's posterior sums under `head`; `new` labels held out for calibration."""
    (features, labels), (weight, bias) = labelled, head
    posteriors = head_statistics.pool_posterior_sums(pool, pool @ weight.T + bias)
    calibration = calibration_sums(features[:new] @ weight.T + bias, labels[:new]) if new else None
    return HeadStatistics.of_labels(features, labels, CLASSES, calibration, posteriors).tensors()


def test_the_pools_posteriors_refine_the_class_means_only_in_a_round_without_new_labels() -> None:
    """One EM step from few labels: the pools' posterior sums under a head fitted on 8 labels move the class means
    towards the pool's, and the refined head is more accurate; an acquiring round's (a step behind) and a first
    round's (the spec's fresh head) posteriors are not used."""
    features, labels = gaussian_classes(8, seed=11, noise=1.5)
    pool, _ = gaussian_classes(2000, seed=12, noise=1.5)
    test, truth = gaussian_classes(2000, seed=13, noise=1.5)
    strategy = PooledHead(shrinkage=0.8, pool_labels=80.0)  # the pools weigh 10 times the 8 labels
    fresh = (np.zeros((CLASSES, FEATURES)), np.zeros(CLASSES))
    first, report = strategy.fitted(pool_statistics((features, labels), pool, fresh), HEAD, 8.0)
    assert not report["pool_refined"], "the fresh head's posteriors are noise"
    head = (first["classifier_fc.weight"], first["classifier_fc.bias"])
    acquiring, report = strategy.fitted(pool_statistics((features, labels), pool, head, new=4), HEAD, 8.0)
    assert not report["pool_refined"]
    np.testing.assert_allclose(acquiring["classifier_fc.weight"] * strategy.temperature, head[0], rtol=1e-5)
    refined, report = strategy.fitted(pool_statistics((features, labels), pool, head), HEAD, 8.0)
    assert report["pool_refined"] and report["classes_seen"] == len(np.unique(labels))
    assert report["pool_weight"] == pytest.approx(10.0)

    def accuracy(fitted: dict[str, np.ndarray]) -> float:
        return float(
            np.mean(np.argmax(test @ fitted["classifier_fc.weight"].T + fitted["classifier_fc.bias"], 1) == truth)
        )

    assert accuracy(refined) > accuracy(first) + 0.03
    _, report = PooledHead(pool_labels=0.0).fitted(pool_statistics((features, labels), pool, head), HEAD, 8.0)
    assert not report["pool_refined"]


def test_the_pools_weigh_a_fixed_number_of_labels_that_the_fleets_labels_outgrow() -> None:
    """The pools' weight against the labels is pool_labels over every label in the fit, the server's included: ten
    times 40 labels' weight, once 400; with the server's 200 images beside 80 device labels, 400 / 280."""
    features, labels = gaussian_classes(40, seed=18)
    pool, _ = gaussian_classes(500, seed=19)
    strategy = PooledHead(pool_labels=400.0)
    assert [strategy.pool_weight(count) for count in (40.0, 400.0, 0.0)] == [10.0, 1.0, 0.0]
    first, _ = strategy.fitted(
        pool_statistics((features, labels), pool, (np.zeros_like(HEAD["classifier_fc.weight"]), np.zeros(CLASSES))),
        HEAD,
        40.0,
    )
    head = (first["classifier_fc.weight"], first["classifier_fc.bias"])
    strategy.learn_server_labels(HeadStatistics.of_labels(features, labels, CLASSES), 200)
    _, report = strategy.fitted(pool_statistics((features, labels), pool, head), HEAD, 80.0)
    assert report["pool_refined"] and report["pool_weight"] == pytest.approx(400.0 / 280.0)


def test_a_class_no_label_holds_stays_unseen_whatever_the_pools_say() -> None:
    features, labels = gaussian_classes(40, seed=14)
    held = labels != 1
    pool, _ = gaussian_classes(500, seed=15)  # the pool holds class 1's rows
    head = (np.ones((CLASSES, FEATURES)), np.zeros(CLASSES))  # a head that gives every class the same posterior
    statistics = HeadStatistics.of_tensors(pool_statistics((features[held], labels[held]), pool, head))
    assert statistics.pool_mass[1] > 0.2
    weight, bias = lda_head(statistics, 0.8, pool_weight=10.0)
    assert np.all(weight[1] == 0.0) and bias[1] == UNSEEN_BIAS


def test_pool_posterior_sums_lie_within_the_clip_and_an_empty_pool_gives_zeros() -> None:
    pool, _ = gaussian_classes(300, seed=16)
    logits = np.random.default_rng(17).normal(0.0, 30.0, size=(300, CLASSES))
    sums, mass = head_statistics.pool_posterior_sums(pool, logits)
    assert sums.shape == (CLASSES, FEATURES) and sums.min() >= 0.0 and sums.max() <= 1.0
    assert mass.sum() == pytest.approx(1.0) and np.all(mass >= 0)
    np.testing.assert_allclose(sums.sum(axis=0), pool.mean(axis=0) / head_statistics.SCALE, rtol=1e-5)
    empty_sums, empty_mass = head_statistics.pool_posterior_sums(pool[:0], logits[:0])
    assert not empty_sums.any() and not empty_mass.any() and empty_sums.shape == (CLASSES, FEATURES)


@pytest.mark.parametrize(
    ("strategy", "rule", "trainable", "message"),
    [
        ("pooled-head", "kept-labels", "head", "go together"),
        ("fedavg", STATISTICS_RULE, "head", "go together"),
        ("pooled-head", STATISTICS_RULE, "all", "train the head alone"),
    ],
)
def test_conflicting_settings_are_refused_in_one_line(strategy, rule, trainable, message, tmp_path) -> None:
    spec = dataclasses.replace(DEFAULT_SPEC, trainable=trainable)
    with pytest.raises(UsageError, match=message) as refused:
        ServerSettings(tmp_path, strategy=strategy, recipe=messages.Recipe(local_rule=rule), spec=spec)
    assert "\n" not in str(refused.value) and len(str(refused.value)) < 200


def test_pool_statistics_without_a_round_that_does_not_acquire_is_refused_in_one_line(tmp_path: Path) -> None:
    options, spec = {POOL_STATISTICS: 1.0}, dataclasses.replace(DEFAULT_SPEC, trainable="head")
    alone = messages.Recipe(local_rule=STATISTICS_RULE, options=options)
    with pytest.raises(UsageError, match="--rounds-per-acquisition 2") as refused:
        ServerSettings(tmp_path, strategy="pooled-head", recipe=alone, spec=spec)
    assert "\n" not in str(refused.value)
    paired = messages.Recipe(local_rule=STATISTICS_RULE, options=options, rounds_per_acquisition=2)
    assert ServerSettings(tmp_path, strategy="pooled-head", recipe=paired, spec=spec).recipe == paired


def test_async_rounds_are_refused_in_one_line_that_names_both_ways_out(tmp_path: Path) -> None:
    spec = dataclasses.replace(DEFAULT_SPEC, trainable="head")
    recipe = messages.Recipe(local_rule=STATISTICS_RULE)
    with pytest.raises(UsageError, match="drop --mode async, or average trained heads") as refused:
        ServerSettings(tmp_path, strategy="pooled-head", recipe=recipe, spec=spec, asynchronous=AsyncPolicy(2, 1))
    assert "--strategy avefl --local-rule kept-labels" in str(refused.value) and "\n" not in str(refused.value)


def test_the_start_up_line_says_devices_send_no_model_to_measure(tmp_path: Path) -> None:
    spec = dataclasses.replace(DEFAULT_SPEC, trainable="head")
    settings = ServerSettings(
        tmp_path, strategy="pooled-head", recipe=messages.Recipe(local_rule=STATISTICS_RULE), spec=spec
    )
    line = evaluation_line(settings, load_server_data(settings))
    assert line.endswith("; devices send class statistics, no model of their own to measure"), line


def test_pooled_head_is_in_the_registry_with_its_option() -> None:
    strategy = make_strategy("pooled-head", shrinkage=0.5)
    assert isinstance(strategy, PooledHead) and strategy.shrinkage == 0.5 and strategy.statistics


def test_device_dp_noises_each_devices_statistics_and_the_round_accounts_epsilon(tmp_path: Path) -> None:
    features, labels = gaussian_classes(2000, seed=8)
    owners = np.random.default_rng(9).integers(200, size=len(labels))  # 10 labels a device
    recipe = messages.Recipe(dp="device", dp_clip=3.0, dp_noise_multiplier=0.5, local_rule=STATISTICS_RULE)
    privacy = PrivateRounds(recipe, 1.0, DpSettings(), [])
    base = head_statistics.layout(CLASSES, FEATURES)
    nearest_mean = PooledHead(shrinkage=1.0)  # the noised second moment swamps a covariance: its scale alone is kept
    aggregator = privacy.aggregator(
        nearest_mean, base, SuspectPolicy(), TensorScratch(tmp_path), (200, 200), model=HEAD, head=HEAD
    )
    round_dp = DpRound(recipe.dp_clip, recipe.dp_noise_multiplier, 0.0, 200)
    rng = np.random.default_rng(10)
    for update in device_updates(features, labels, owners):
        private, within = privatised(update.weights, base, round_dp, rng)
        assert not np.allclose(private[head_statistics.CLASS_SUMS], update.weights[head_statistics.CLASS_SUMS])
        aggregator.absorb(dataclasses.replace(update, weights=private, metrics={WITHIN_CLIP_METRIC: within}))
    result = aggregator.finish(None)
    assert result.report["dp"]["epsilon"] > 0 and result.report["classes_seen"] == CLASSES
    test, truth = gaussian_classes(400, seed=11)
    logits = test @ result.weights["classifier_fc.weight"].T + result.weights["classifier_fc.bias"]
    assert np.mean(np.argmax(logits, 1) == truth) > 0.8, "200 devices' noised statistics still fit the head"


def test_a_coordinator_that_crafts_the_head_reads_one_pool_image_from_the_pools_posterior_sums() -> None:
    """The exposure the privacy guide states for --pool-statistics 1, played by the coordinator: the posteriors come
    from the head it publishes, so a head whose one class wins only past a threshold on one feature (found by
    bisection over rounds; here given) makes that class's pool sums one image's features, exactly."""
    pool, _ = gaussian_classes(500, seed=18)
    top, second = np.sort(pool[:, 3])[-2:][::-1]
    weight = np.zeros((CLASSES, FEATURES))
    weight[0, 3] = 1e4
    bias = np.zeros(CLASSES)
    bias[0] = -1e4 * (top + second) / 2
    sums, mass = head_statistics.pool_posterior_sums(pool, pool @ weight.T + bias)
    assert mass[0] * len(pool) == pytest.approx(1.0, abs=1e-6), "one pool image in the class"
    target = pool[np.argmax(pool[:, 3])] / head_statistics.SCALE
    np.testing.assert_allclose(sums[0] / mass[0], target, rtol=1e-5)


def test_the_servers_labelled_images_join_every_fit_as_if_a_device_held_them() -> None:
    """The server's labelled images (W0's) are summed into the fit, weighed by their count against the devices'
    labels: the head equals the one fitted from both as one pool; the shares announced stay the devices'."""
    features, labels = gaussian_classes(300, seed=19)
    server, devices = slice(0, 100), slice(100, 300)
    together, _ = PooledHead().fitted(HeadStatistics.of_labels(features, labels, CLASSES).tensors(), HEAD, 300.0)
    strategy = PooledHead()
    strategy.learn_server_labels(HeadStatistics.of_labels(features[server], labels[server], CLASSES), 100)
    fleet = HeadStatistics.of_labels(features[devices], labels[devices], CLASSES).tensors()
    folded, report = strategy.fitted(fleet, HEAD, 200.0)
    for name in HEAD:
        np.testing.assert_allclose(folded[name], together[name], rtol=1e-4, atol=1e-4)
    device_shares = np.bincount(labels[devices], minlength=CLASSES) / 200
    np.testing.assert_allclose(report["class_shares"], device_shares, atol=1e-6)
    alone, _ = PooledHead().fitted(fleet, HEAD, 200.0)
    assert not np.allclose(alone["classifier_fc.weight"], folded["classifier_fc.weight"])
