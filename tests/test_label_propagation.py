# The pseudo-labels rule: the head's predictions where label propagation agrees, device-only, never of a class not held.
from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from test_feature_cache import HEAD, SPEC, device, export, with_new_classifier

from bench.oracle import SimulatedOracle
from edge_agent.learning.head_training import HeadSettings, cross_entropy_gradients, train_classifier
from edge_agent.learning.learner_choice import make_learner
from edge_agent.learning.local_data import training_view
from edge_agent.learning.local_rules import CLASSIFIER_ONLY, make_local_rule, runs_on
from edge_agent.learning.models import build_model, get_weights
from edge_agent.learning.prior_shift import LABEL_SHARES_KEY
from edge_agent.learning.propagation import (
    FLEET_SHARES,
    NO_ALIGNMENT,
    OWN_SHARES,
    Propagation,
    SemiSupervised,
    aligned,
    alignment_target,
    nearest_neighbours,
    propagate,
    pseudo_labels,
    quota_rows,
)
from edge_agent.learning.sampling import make_sampler
from edge_agent.loop.acquisition import Acquirer
from edge_agent.loop.footprint import PhaseMeter
from edge_agent.loop.round_inputs import RoundModels
from protocol import messages
from protocol.errors import UsageError


def clusters(per_cluster: int, centres: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Points around `centres` well-separated centres in 16 dimensions, and their cluster as the label."""
    rng = np.random.default_rng(seed)
    means = 6.0 * np.eye(16)[:centres]
    labels = np.repeat(np.arange(centres), per_cluster)
    return (means[labels] + rng.normal(size=(len(labels), 16))).astype(np.float32), labels


def test_propagation_over_two_clusters_labels_every_unlabelled_point_by_its_cluster() -> None:
    features, truth = clusters(40, 2)
    labelled = np.array([0, 40])
    pool = np.setdiff1d(np.arange(80), labelled)
    assert np.array_equal(propagate(features[labelled], truth[labelled], features[pool], Propagation()), truth[pool])


def test_a_class_the_device_holds_no_label_of_gets_no_pseudo_label() -> None:
    features, truth = clusters(30, 3)
    labelled = np.array([0, 1, 30, 31])  # classes 0 and 1; the pool holds 30 scenes of class 2
    pool = np.setdiff1d(np.arange(90), labelled)
    logits = 5.0 * np.eye(3)[truth[pool]]  # a head that knows class 2 well
    assert set(propagate(features[labelled], truth[labelled], features[pool], Propagation()).tolist()) == {-1, 0, 1}
    pseudo = pseudo_labels(features[labelled], truth[labelled], features[pool], logits, Propagation())
    assert len(pseudo.labels) == 56 and np.array_equal(pseudo.labels, truth[pool][pseudo.positions])
    semi = SemiSupervised(features[pool], Propagation(), 1.0, 1.0)
    rows, labels, weights, bias = semi.training_set(features[labelled], truth[labelled], features[pool], logits, 3)
    assert len(rows) == 60 and np.count_nonzero(labels == 2) == 0
    assert bias is not None and bias[2] == -np.inf and np.all(weights[:4] == 1.0) and np.all(weights[4:] <= 1.0)


def test_pseudo_labels_are_kept_only_where_head_and_propagation_agree_in_equal_quotas() -> None:
    confidence = np.array([0.1, 0.9, 0.5, 0.3, 0.2, 0.7])
    assert quota_rows(np.array([0, 0, 0, 1, 1, 2]), confidence, 2).tolist() == [1, 2, 3, 4, 5]
    features, truth = clusters(50, 2)
    labelled = np.array([0, 50])
    pool = np.setdiff1d(np.arange(100), labelled)
    logits = 3.0 * np.eye(2)[truth[pool]]
    logits[:10] = logits[:10, ::-1]  # the head is wrong on ten rows of class 0: propagation disagrees there
    pseudo = pseudo_labels(features[labelled], truth[labelled], features[pool], logits, Propagation(most=1000))
    assert np.array_equal(pseudo.positions, np.arange(10, 98)) and np.array_equal(pseudo.labels, truth[pool][10:])
    capped = pseudo_labels(features[labelled], truth[labelled], features[pool], logits, Propagation(most=20))
    assert np.bincount(capped.labels).tolist() == [10, 10]
    one_class = pseudo_labels(features[:2], truth[:2], features[pool], logits, Propagation())
    assert len(one_class.labels) == 0  # labels of one class alone tell no pool rows apart


def test_alignment_moves_the_pools_mean_posterior_to_the_target_and_never_gives_a_class_not_held() -> None:
    skewed = np.tile([0.7, 0.2, 0.1], (5, 1))
    target = np.array([1.0, 1.0, 2.0])
    assert np.allclose(aligned(skewed, target).mean(axis=0), [0.25, 0.25, 0.5])  # alike rows: exact in one step
    rng = np.random.default_rng(3)
    mixed = rng.dirichlet([4.0, 1.0, 0.5], size=200)
    before = np.abs(mixed.mean(axis=0) - target / 4).sum()
    after = aligned(mixed, target)
    assert np.allclose(after.sum(axis=1), 1.0) and np.abs(after.mean(axis=0) - target / 4).sum() < before / 3
    labels = np.array([0, 0, 0, 1])  # a device holding classes 0 and 1 of 4
    assert alignment_target(labels, 4, NO_ALIGNMENT) is None
    assert np.allclose(alignment_target(labels, 4, OWN_SHARES), [2 / 3, 1 / 3, 0, 0])
    fleet = np.array([0.1, 0.3, 0.2, 0.4])
    assert np.allclose(alignment_target(labels, 4, FLEET_SHARES, fleet), fleet)
    for unknown in (np.zeros(0), np.array([0.0, 0.5, 0.5, 0.0]), fleet[:3]):  # the device's own where unusable
        assert np.allclose(alignment_target(labels, 4, FLEET_SHARES, unknown), [2 / 3, 1 / 3, 0, 0])
    features, truth = clusters(30, 3)
    held = np.array([0, 1, 30, 31])
    pool = np.setdiff1d(np.arange(90), held)
    logits = 5.0 * np.eye(3)[truth[pool]]  # the head knows class 2, which the device holds no label of
    settings = Propagation(alignment=FLEET_SHARES)
    semi = SemiSupervised(features[pool], settings, 1.0, 1.0, np.array([0.1, 0.1, 0.8]))
    _, given, _, _ = semi.training_set(features[held], truth[held], features[pool], logits, 3)
    assert np.count_nonzero(given == 2) == 0 and set(given[4:].tolist()) == {0, 1}


def test_alignment_changes_which_pool_rows_the_head_gives_a_class() -> None:
    features, truth = clusters(40, 2)
    labelled = np.array([0, 1, 40, 41])
    pool = np.setdiff1d(np.arange(80), labelled)
    logits = np.where(truth[pool] == 0, 2.0, 0.4)[:, None] * np.array([[1.0, -1.0]])  # class 1's rows: 69% class 0
    plain = pseudo_labels(features[labelled], truth[labelled], features[pool], logits, Propagation(most=1000))
    assert np.count_nonzero(plain.labels == 1) == 0  # the head calls every row class 0; propagation agrees on half
    balanced = np.array([0.5, 0.5])
    fixed = pseudo_labels(features[labelled], truth[labelled], features[pool], logits, Propagation(most=1000), balanced)
    assert np.array_equal(fixed.labels, truth[pool][fixed.positions]) and len(fixed.labels) == 76


def test_the_knn_search_is_blocked_and_finds_the_exact_neighbours() -> None:
    rng = np.random.default_rng(1)
    features = rng.normal(size=(300, 64)).astype(np.float32)
    unit = features / np.linalg.norm(features, axis=1, keepdims=True)
    full = unit @ unit.T
    np.fill_diagonal(full, -np.inf)
    expected = np.sort(np.argsort(-full, axis=1)[:, :5], axis=1)
    tracemalloc.start()
    indices, similarities = nearest_neighbours(features, 5, block=32)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert np.array_equal(np.sort(indices, axis=1), expected)
    assert np.allclose(np.sort(similarities, axis=1), np.sort(np.take_along_axis(full, indices, 1), axis=1))
    assert peak < 2 * unit.nbytes + 3 * 32 * 300 * 8  # the unit rows and a few block-sized arrays, never N x N


def test_row_weights_scale_each_rows_loss_and_a_zero_weight_row_adds_nothing() -> None:
    features, truth = clusters(10, 2)
    rng = np.random.default_rng(2)
    weight, bias = rng.normal(size=(2, 16)), rng.normal(size=2)
    alone = cross_entropy_gradients(features[:10], truth[:10], weight, bias)
    doubled = np.concatenate([np.full(10, 2.0), np.zeros(10)])  # the mean over 20 rows, of which 10 count twice
    weighted = cross_entropy_gradients(features, truth, weight, bias, None, doubled)
    assert all(np.allclose(a, b) for a, b in zip(alone, weighted))
    settings = HeadSettings(epochs=2, batch_size=20, learning_rate=0.1)
    ones = train_classifier(features, truth, weight, bias, settings, row_weights=np.ones(20))
    assert all(np.allclose(a, b) for a, b in zip(ones, train_classifier(features, truth, weight, bias, settings)))


def test_pseudo_labels_runs_on_the_head_only_trainer_alone_and_checks_its_options() -> None:
    rule = make_local_rule("pseudo-labels")
    assert runs_on("pseudo-labels", CLASSIFIER_ONLY) and not runs_on("pseudo-labels", "full")
    with pytest.raises(UsageError, match="--propagation-alpha must lie in"):
        rule.semi_supervised(np.zeros((0, 4)), messages.Recipe(options={"propagation_alpha": 1.0}))
    with pytest.raises(UsageError, match="--pseudo-alignment must lie in"):
        rule.semi_supervised(np.zeros((0, 4)), messages.Recipe(options={"pseudo_alignment": 3}))
    fleet = rule.semi_supervised(np.zeros((0, 4)), messages.Recipe(options={"pseudo_alignment": 2}), [0.5, 0.5])
    assert fleet.settings.alignment == FLEET_SHARES and fleet.fleet_shares.tolist() == [0.5, 0.5]


def test_pseudo_labels_train_the_head_but_never_reach_the_store_or_the_counts(tmp_path: Path) -> None:
    data, truth = device(tmp_path)
    acquirer = Acquirer(HEAD, data, SimulatedOracle(truth), PhaseMeter())
    weights = get_weights(build_model(SPEC, seed=0))
    recipe = messages.Recipe(local_rule="pseudo-labels", labels_per_acquisition=6, epochs=2, batch_size=8)
    bundle = export(with_new_classifier(weights, 1), tmp_path / "bundle")
    trained = {}
    for rule in ("kept-labels", "pseudo-labels"):
        learner = make_learner(HEAD.compute, data.state_dir, SPEC, weights, bundle)
        if rule == "kept-labels":
            models = RoundModels(learner, "", recipe, bundle)
            new, labels = acquirer.acquire(models, make_sampler("random"), 1, 1, 0)
            counts, labelled = data.class_counts(), data.labelled()[0]
        ruled = messages.Recipe(**{**recipe.__dict__, "local_rule": rule})
        metrics = learner.train(training_view(data, new, labels, 1, learner.rows), ruled, 1)
        trained[rule] = learner.weights()["fc2.weight"]
        assert metrics["train_samples"] == 6
    assert not np.allclose(trained["kept-labels"], trained["pseudo-labels"])
    assert data.num_labelled == 6 and np.array_equal(data.class_counts(), counts) and counts.sum() == 6
    assert np.array_equal(data.labelled()[0], labelled) and len(data.pool_indices()) == 54
    assert training_view(data, new, labels, 1).fleet_label_shares == ()  # no announcement has carried them yet
    data.set_state(LABEL_SHARES_KEY, [0.5, 0.5])  # what the agent keeps from a round announcement
    assert training_view(data, new, labels, 1).fleet_label_shares == (0.5, 0.5)
