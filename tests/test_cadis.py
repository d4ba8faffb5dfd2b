# CADIS (ALGORITHMS.md section 3): similarity, Q-matrix, clustering, threshold, weights, stored state, KD rule.
from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from coordinators import commit_weights, coordinator_on
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.storage.store import RoundRecord, RunStore, StrategyState
from coordinator.strategies.aggregate import ClientUpdate
from coordinator.strategies.cadis import (
    CADIS_INITIAL_THRESHOLD,
    CADIS_THRESHOLD_CAP,
    cadis_coefficients,
    classifier_tensor,
    cluster_sizes,
    next_threshold,
    otsu_cut,
    pairwise_cosine,
    q_matrix,
    split_threshold,
)
from coordinator.strategies.means import CADIS, FedAvg
from coordinator.strategies.registry import make_strategy
from edge_agent.data.fashion_mnist import load_fashion_mnist
from edge_agent.learning.local_data import LocalData
from edge_agent.learning.local_rules import CadisKD
from edge_agent.learning.models import build_model, get_weights
from edge_agent.learning.rule_losses import relational_kd_loss
from edge_agent.learning.torch_rules import train_rule
from edge_agent.learning.training import TrainSettings, run_epochs
from protocol import messages
from protocol.tensors import weights_hash

GLOBAL = get_weights(build_model(seed=0))
LAYER = "fc2.weight"


def client(device: str, direction: np.ndarray, samples: int, seed: int) -> ClientUpdate:
    """A client whose classifier moved from the global model along `direction`; its other layers get noise."""
    rng = np.random.default_rng(seed)
    weights = {name: (array + rng.normal(0, 0.01, array.shape)).astype(array.dtype) for name, array in GLOBAL.items()}
    weights[LAYER] = (GLOBAL[LAYER] + direction.reshape(GLOBAL[LAYER].shape)).astype(np.float32)
    return ClientUpdate(device, weights, samples)


def basis(index: int, scale: float = 0.1) -> np.ndarray:
    """A classifier change along one coordinate: changes on different coordinates are orthogonal."""
    vector = np.zeros(GLOBAL[LAYER].size)
    vector[index] = scale
    return vector


def test_the_classifier_layer_is_the_final_dense_weight() -> None:
    assert classifier_tensor(GLOBAL) == LAYER


def test_one_client_per_cluster_gives_fedavg_weights() -> None:
    updates = [client(f"d{i}", basis(i), samples, i) for i, samples in enumerate([10, 30, 60, 100])]
    cadis, report = CADIS().aggregate(GLOBAL, updates, None)
    fedavg, fedavg_report = FedAvg().aggregate(GLOBAL, updates, None)
    assert report["cluster_sizes"] == {"d0": 1, "d1": 1, "d2": 1, "d3": 1}
    assert report["coefficients"] == pytest.approx(fedavg_report["coefficients"])
    assert report["coefficients"]["d3"] == pytest.approx(0.5)
    for name in GLOBAL:
        np.testing.assert_allclose(cadis[name], fedavg[name], rtol=1e-6, atol=1e-7)


def test_a_single_cluster_gives_fedavg_weights() -> None:
    updates = [
        client(f"d{i}", basis(0, scale), samples, i)
        for i, (scale, samples) in enumerate([(0.1, 10), (0.2, 30), (0.05, 60)])
    ]
    _, report = CADIS().aggregate(GLOBAL, updates, None)
    assert report["cluster_sizes"] == {"d0": 3, "d1": 3, "d2": 3}
    assert report["coefficients"] == pytest.approx({"d0": 0.1, "d1": 0.3, "d2": 0.6})


def test_clusters_of_three_and_one_get_equal_mass() -> None:
    updates = [client(f"d{i}", basis(0) + basis(1, 0.001 * i), 50, i) for i in range(3)] + [
        client("d3", basis(7), 50, 3)
    ]
    _, report = CADIS().aggregate(GLOBAL, updates, None)
    assert report["cluster_sizes"] == {"d0": 3, "d1": 3, "d2": 3, "d3": 1}
    assert report["coefficients"] == pytest.approx({"d0": 1 / 6, "d1": 1 / 6, "d2": 1 / 6, "d3": 1 / 2})


def test_weights_divide_samples_by_cluster_size() -> None:
    np.testing.assert_allclose(cadis_coefficients([10, 20, 30, 40], [2, 2, 1, 1]), np.array([5, 10, 30, 40]) / 85)
    with pytest.raises(ValueError, match="cluster size >= 1"):
        cadis_coefficients([10, 20], [1, 0])


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 8), st.integers(0, 10_000))
def test_similarity_is_symmetric_with_unit_diagonal(count: int, seed: int) -> None:
    vectors = np.random.default_rng(seed).normal(size=(count, 5))
    s = pairwise_cosine(vectors)
    np.testing.assert_allclose(s, s.T, atol=1e-12)
    np.testing.assert_allclose(np.diag(s), 1.0)
    a, b = vectors[0], vectors[1]
    assert s[0, 1] == pytest.approx(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
    assert np.all(np.abs(s) <= 1.0)


def test_similarity_is_measured_on_the_change_from_the_global_model() -> None:
    """Two clients whose classifiers are near each other but moved in opposite directions are dissimilar."""
    updates = [client("a", basis(0), 10, 0), client("b", -basis(0), 10, 1)]
    _, report = CADIS().aggregate(GLOBAL, updates, None)
    assert report["cluster_sizes"] == {"a": 1, "b": 1}


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 8), st.integers(0, 10_000))
def test_q_lies_in_zero_one_and_is_zero_off_the_observed_pairs(count: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    s = pairwise_cosine(rng.normal(size=(count, 4)))
    observed = rng.random((count, count)) < 0.6
    observed = observed | observed.T | np.eye(count, dtype=bool)
    q = q_matrix(s, observed)
    assert np.all(q >= 0.0) and np.all(q <= 1.0)
    assert np.all(q[~observed] == 0.0)
    assert np.all(np.diag(q) == 1.0)


def test_strongly_negative_similarity_ranks_lowest_not_highest() -> None:
    s = np.array([[1.0, 0.9, -0.95], [0.9, 1.0, 0.0], [-0.95, 0.0, 1.0]])
    q = q_matrix(s, np.ones((3, 3), dtype=bool))
    assert q[0, 2] == 0.0
    assert q[0, 1] == pytest.approx((0.9 + 0.95) / 1.95)
    assert list(cluster_sizes(q, 0.9)) == [2, 2, 1]


def test_threshold_is_non_decreasing_and_capped() -> None:
    taus = [CADIS_INITIAL_THRESHOLD]
    for step in range(40):
        taus.append(next_threshold(taus[-1], step))
    assert taus[1] == taus[0]  # 1.0005 ** 0
    assert all(b >= a for a, b in zip(taus, taus[1:]))
    assert max(taus) == CADIS_THRESHOLD_CAP
    first_capped = taus.index(CADIS_THRESHOLD_CAP)
    assert 5 <= first_capped <= 8 and taus[first_capped - 1] < CADIS_THRESHOLD_CAP


def test_the_strategy_raises_its_threshold_each_round() -> None:
    strategy = CADIS()
    seen = []
    for round_index in range(8):
        updates = [client(f"d{i}", basis(i), 10, round_index * 10 + i) for i in range(2)]
        _, report = strategy.aggregate(GLOBAL, updates, None)
        seen.append(report["threshold"])
    assert seen[0] == CADIS_INITIAL_THRESHOLD and seen[-1] == CADIS_THRESHOLD_CAP
    assert all(b >= a for a, b in zip(seen, seen[1:]))


def test_otsu_cuts_between_two_groups_and_measures_how_separate_they_are() -> None:
    # [0.1, 0.12, 0.14 | 0.8, 0.82, 0.84]: the cut lies halfway between 0.14 and 0.8; the groups' spread is tiny
    # next to their distance, so nearly all the variance lies between them
    threshold, separability = otsu_cut(np.array([0.84, 0.1, 0.8, 0.12, 0.82, 0.14]))
    assert threshold == pytest.approx(0.47) and separability > 0.99
    # the best cut of one normal sample explains about 2/pi of its variance: not two groups
    _, unimodal = otsu_cut(np.random.default_rng(0).normal(0.5, 0.1, 2000))
    assert unimodal == pytest.approx(2 / np.pi, abs=0.02)
    assert otsu_cut(np.array([0.3, 0.3, 0.3])) is None and otsu_cut(np.array([0.3])) is None


def test_split_threshold_cuts_only_clear_groups_of_off_diagonal_pairs() -> None:
    # two clusters {0,1} and {2,3}: Q 0.9 within, 0.1 across (the diagonal's 1s are not pairs)
    q = np.array([[1, 0.9, 0.1, 0.1], [0.9, 1, 0.1, 0.1], [0.1, 0.1, 1, 0.9], [0.1, 0.1, 0.9, 1]])
    observed = np.ones_like(q, dtype=bool)
    assert split_threshold(q, observed) == pytest.approx(0.5)
    assert list(cluster_sizes(q, split_threshold(q, observed))) == [2, 2, 2, 2]
    unimodal = np.random.default_rng(1).uniform(0.2, 0.4, (12, 12))
    unimodal = np.triu(unimodal, 1) + np.triu(unimodal, 1).T + np.eye(12)
    assert split_threshold(unimodal, np.ones_like(unimodal, dtype=bool)) == 1.0
    assert list(cluster_sizes(unimodal, 1.0)) == [1] * 12


def test_the_split_option_forms_the_true_clusters_and_weighs_each_by_its_mass() -> None:
    # clusters {a, b, c} (noisy changes along coordinate 0) and {d} (coordinate 7), equal samples: at the rising
    # tau (0.975) no pair is close enough; the split groups a, b, c, so d carries half the mass
    rng = np.random.default_rng(3)
    near = [basis(0) + rng.normal(0, 0.02, GLOBAL[LAYER].size) * 0.1 for _ in range(3)]
    updates = [client(name, direction, 50, i) for i, (name, direction) in enumerate(zip("abc", near))]
    updates.append(client("d", basis(7), 50, 9))
    _, paper = CADIS().aggregate(GLOBAL, updates, None)
    assert set(paper["cluster_sizes"].values()) == {1}
    _, split = CADIS(split=1).aggregate(GLOBAL, updates, None)
    assert split["cluster_sizes"] == {"a": 3, "b": 3, "c": 3, "d": 1} and split["threshold"] < 0.975
    assert split["coefficients"]["d"] == pytest.approx(0.5)


def history_rounds() -> list[list[ClientUpdate]]:
    """Round 1: a and b move alike, c elsewhere. Round 2: a and c only; b's similarity to a is history."""
    return [
        [client("a", basis(0), 40, 1), client("b", basis(0) * 1.5, 40, 2), client("c", basis(5), 40, 3)],
        [client("a", basis(0) * 0.5, 40, 4), client("c", basis(5) * 2, 40, 5)],
    ]


def test_cadis_state_survives_a_coordinator_restart(tmp_path: Path) -> None:
    first_round, second_round = history_rounds()
    with RunStore(tmp_path) as store:
        before = coordinator_on(store, make_strategy("cadis"))
        weights, _ = before.parts.closer.strategy.aggregate(GLOBAL, first_round, None)
        commit_weights(before, 1, weights, GLOBAL)
        state_after_round_1 = before.parts.closer.strategy.state()
    with RunStore(tmp_path) as store:
        after = coordinator_on(store, make_strategy("cadis"))
        assert after.parts.closer.strategy.state() == state_after_round_1
        assert after.parts.closer.strategy.state()["threshold"] == next_threshold(CADIS_INITIAL_THRESHOLD, 0)
        _, resumed = after.parts.closer.strategy.aggregate(GLOBAL, second_round, None)
    _, continued = before.parts.closer.strategy.aggregate(GLOBAL, second_round, None)
    _, forgetful = CADIS().aggregate(GLOBAL, second_round, None)
    assert resumed == continued
    assert resumed["cluster_sizes"] == {"a": 2, "c": 1}
    assert resumed["coefficients"] == pytest.approx({"a": 1 / 3, "c": 2 / 3})
    assert forgetful["coefficients"] == pytest.approx({"a": 0.5, "c": 0.5})


def test_a_run_with_cadis_state_cannot_resume_under_another_strategy(tmp_path: Path) -> None:
    with RunStore(tmp_path) as store:
        coordinator = coordinator_on(store, CADIS())
        weights, _ = coordinator.parts.closer.strategy.aggregate(GLOBAL, history_rounds()[0], None)
        commit_weights(coordinator, 1, weights, GLOBAL)
        with pytest.raises(ValueError, match="holds state of strategy 'cadis'; it cannot resume with 'fedavg'"):
            coordinator_on(store, make_strategy("fedavg"))


def test_strategy_state_commits_with_its_round_or_not_at_all(tmp_path: Path) -> None:
    with RunStore(tmp_path) as store:
        record = RoundRecord(1, 0.0, 1.0, "h", None, 0, 0, 0, {}, {})
        with pytest.raises(ValueError, match="round 1 strategy state is not JSON-serialisable"):
            store.commit_round(record, [], StrategyState("cadis", {"bad": object()}))
        assert store.last_committed_round() is None and store.latest_strategy_state() is None
        store.commit_round(record, [], StrategyState("cadis", {"step": 1}))
        assert store.latest_strategy_state() == StrategyState("cadis", {"step": 1})


def test_the_split_setting_survives_the_stored_state_and_old_states_read_as_the_paper_rule() -> None:
    strategy = CADIS(split=1)
    strategy.aggregate(GLOBAL, history_rounds()[0], None)
    restored = CADIS()
    restored.load_state(strategy.state(), {})
    assert restored.clusters.split and restored.state() == strategy.state()
    old = {key: value for key, value in strategy.state().items() if key != "split"}
    restored.load_state(old, {})
    assert not restored.clusters.split


def test_malformed_stored_state_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match="stored cadis state is malformed"):
        CADIS().load_state({"devices": ["a", "b"], "sums": [[1.0]], "counts": [[1]], "threshold": 0.9, "step": 0}, {})


def test_relational_kd_is_zero_for_identical_features_and_positive_otherwise() -> None:
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(8, 16, generator=generator)
    assert relational_kd_loss(features.clone(), features).item() == pytest.approx(0.0, abs=1e-6)
    other = torch.randn(8, 16, generator=generator)
    assert relational_kd_loss(other, features).item() > 1e-3
    with pytest.raises(ValueError, match="at least 3 samples"):
        relational_kd_loss(features[:2], features[:2])


def test_relational_kd_depends_only_on_pairwise_distances() -> None:
    """The kernel looks at distances: a rotated and shifted copy of the teacher's features costs nothing."""
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(6, 4, generator=generator)
    rotation, _ = torch.linalg.qr(torch.randn(4, 4, generator=generator))
    assert relational_kd_loss(features @ rotation + 3.0, features).item() == pytest.approx(0.0, abs=1e-5)


def test_short_batches_are_dropped_when_the_rule_needs_three() -> None:
    sizes: list[int] = []

    def record(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        sizes.append(len(inputs))
        return (model(inputs) * 0).sum()

    model = build_model(seed=0)
    images, labels = np.zeros((10, 28, 28), dtype=np.uint8), np.zeros(10, dtype=np.int64)
    run_epochs([model], images, labels, TrainSettings(1, 4, 0.1), record, min_batch=3)
    assert sizes == [4, 4]
    sizes.clear()
    run_epochs([model], images, labels, TrainSettings(1, 4, 0.1), record)
    assert sizes == [4, 4, 2]
    with pytest.raises(ValueError, match="batches of at least 3"):
        run_epochs([model], images, labels, TrainSettings(1, 2, 0.1), record, min_batch=3)


def test_cadis_kd_trains_towards_the_labels_and_zero_kd_weight_is_plain_cross_entropy() -> None:
    dataset = load_fashion_mnist()
    images, labels = dataset.test_images[:40], dataset.test_labels[:40].astype(np.int64)
    empty, none = images[:0], labels[:0]
    data = LocalData(empty, none, empty, none, images, labels, lambda: empty)
    global_model = build_model(seed=3).eval()
    recipe = messages.Recipe(
        local_rule="cadis-kd",
        epochs=2,
        batch_size=8,
        learning_rate=0.05,
        momentum=0.0,
        weight_decay=0.0,
        options={"kd_weight": 1.0},
    )
    with_kd, without_kd = copy.deepcopy(global_model), copy.deepcopy(global_model)
    metrics = train_rule(CadisKD(), with_kd, data, global_model, recipe, seed=2)
    train_rule(
        CadisKD(),
        without_kd,
        data,
        global_model,
        messages.Recipe(**{**recipe.__dict__, "options": {"kd_weight": 0.0}}),
        seed=2,
    )
    plain = copy.deepcopy(global_model)
    run_epochs(
        [plain],
        images,
        labels,
        TrainSettings(2, 8, 0.05, seed=2),
        lambda x, y: torch.nn.functional.cross_entropy(plain.features_and_logits(x)[1], y),
        min_batch=3,
    )
    assert metrics["train_samples"] == 40 and np.isfinite(metrics["train_loss"])
    assert weights_hash(get_weights(without_kd)) == weights_hash(get_weights(plain))
    assert weights_hash(get_weights(with_kd)) != weights_hash(get_weights(plain))
    assert weights_hash(get_weights(global_model)) == weights_hash(get_weights(build_model(seed=3)))


def test_cadis_kd_refuses_a_negative_kd_weight() -> None:
    model = build_model(seed=0)
    images, labels = np.zeros((4, 28, 28), dtype=np.uint8), np.zeros(4, dtype=np.int64)
    data = LocalData(images, labels, images, labels, images, labels, lambda: images)
    with pytest.raises(ValueError, match="--kd-weight must be at least 0, got -1.0"):
        train_rule(CadisKD(), model, data, model, messages.Recipe(options={"kd_weight": -1.0}), seed=0)
