# TypiClust, balanced-margin, level-margin and the phased samplers over small numpy arrays: clusters, typicality,
# quotas, picks, edges.
from __future__ import annotations

from dataclasses import replace
from functools import cache

import numpy as np
import pytest

from edge_agent.learning.acquisition_scores import margin_scores, top_k
from edge_agent.learning.batch_samplers import LevelMargin, PhasedSampler, TypicalitySampler
from edge_agent.learning.batch_selection import (
    kmeans,
    level_quotas,
    principal_rows,
    quota_picks,
    typical_picks,
    typicality,
)
from edge_agent.learning.heuristics import AcquisitionContext, Embeddings, MarginHeuristic
from edge_agent.learning.sampling import SAMPLERS, make_sampler


def blobs(sizes: tuple[int, ...], width: int = 6, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Well-separated Gaussian blobs of the given sizes (rows, blob of each row)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 20, (len(sizes), width))
    which = np.repeat(np.arange(len(sizes)), sizes)
    return centres[which] + rng.normal(0, 1, (len(which), width)), which


def context_of(
    features: np.ndarray,
    labelled: np.ndarray | None = None,
    probs: np.ndarray | None = None,
    options: dict[str, float] | None = None,
    labels_held: int = 0,
    classes: int = 3,
    counts: np.ndarray | None = None,
) -> AcquisitionContext:
    """An acquisition context over pool features, labelled features and (if given) MC-dropout probabilities; the
    class counts given, or `labels_held` labels all of class 0."""
    if counts is None:
        counts = np.zeros(classes)
        counts[0] = labels_held
    return AcquisitionContext(
        num_samples=len(features),
        rng=np.random.default_rng(5),
        class_counts=counts,
        options=options or {},
        probabilities=cache(lambda: probs),
        own_logits=lambda: np.zeros(0),
        global_logits=lambda: np.zeros(0),
        embeddings=lambda: Embeddings(np.zeros(0), np.zeros(0), np.zeros(0)),
        features=lambda: features,
        labelled_features=lambda: np.zeros((0, 0)) if labelled is None else labelled,
    )


def test_kmeans_finds_separated_blobs_and_clips_k_to_the_rows() -> None:
    rows, which = blobs((30, 20, 10))
    found = kmeans(rows, 3, np.random.default_rng(0))
    assert len(set(zip(found.tolist(), which.tolist()))) == 3, "each blob is one cluster"
    assert sorted(kmeans(rows[:2], 5, np.random.default_rng(0)).tolist()) == [0, 1]
    assert kmeans(np.zeros((0, 4)), 3, np.random.default_rng(0)).shape == (0,)


def test_kmeans_and_typicality_of_identical_rows_are_finite() -> None:
    same = np.ones((12, 5))
    clusters = kmeans(same, 4, np.random.default_rng(1))
    assert clusters.shape == (12,) and clusters.min() >= 0
    scores = typicality(same, 3)
    assert np.all(np.isfinite(scores)) and np.all(scores == 0)


def test_principal_rows_keep_the_spread_and_project_the_labelled_rows_alike() -> None:
    rng = np.random.default_rng(2)
    rows = rng.normal(size=(200, 2)) @ np.array([[5.0, 0, 0, 0, 0, 0], [0, 2.0, 0, 0, 0, 0]]) + 7.0
    pool, labelled = principal_rows(rows, rows[:3], 2, rng)
    assert pool.shape == (200, 2) and pool.dtype == np.float32
    np.testing.assert_allclose(labelled, pool[:3], rtol=1e-5, atol=1e-4)
    distances = np.linalg.norm(rows[:, None] - rows[None, :20], axis=2)
    projected = np.linalg.norm(pool[:, None] - pool[None, :20], axis=2)
    np.testing.assert_allclose(projected, distances, rtol=1e-3, atol=1e-3)
    empty_pool, none = principal_rows(rows, np.zeros((0, 0)), 40, rng)
    assert none.shape == (0, empty_pool.shape[1]) and empty_pool.shape[1] <= 6
    flat, _ = principal_rows(np.ones((5, 4)), np.zeros((0, 0)), 2, rng)
    assert np.all(np.isfinite(flat))
    with pytest.raises(ValueError, match="non-empty"):
        principal_rows(np.zeros((0, 3)), np.zeros((0, 0)), 2, rng)


def test_typicality_ranks_the_dense_centre_first_and_a_lone_row_zero() -> None:
    rows = np.array([[0.0, 0.0], [0.1, 0.0], [-0.1, 0.0], [0.0, 0.1], [5.0, 5.0]])
    scores = typicality(rows, 2)
    assert int(np.argmax(scores)) == 0 and int(np.argmin(scores)) == 4
    assert typicality(rows[:1], 20).tolist() == [0.0]
    np.testing.assert_allclose(typicality(rows, 2, block=2), scores)


def test_typical_picks_take_the_largest_uncovered_clusters_then_go_round_again() -> None:
    clusters = np.array([0, 0, 0, 0, 1, 1, 1, 2, 2, 3])
    covered = np.array([1, 0, 0, 0])
    first = lambda members: -members.astype(float)  # noqa: E731  the lowest position is the most typical
    assert typical_picks(clusters, covered, first, 3).tolist() == [4, 7, 9]
    assert typical_picks(clusters, covered, first, 5).tolist() == [4, 7, 9, 0, 5]
    everything = typical_picks(clusters, covered, first, 50)
    assert sorted(everything.tolist()) == list(range(10))


def test_typiclust_covers_every_blob_before_a_second_pick_and_skips_what_labels_cover() -> None:
    rows, which = blobs((40, 30, 20, 10))
    sampler = make_sampler("typiclust")
    picked = sampler.select(context_of(rows, options={"typical_clusters": 4}), 4)
    assert sorted(which[picked].tolist()) == [0, 1, 2, 3]
    labelled = rows[which == 0][:2]
    covered = sampler.select(context_of(rows, labelled, options={"typical_clusters": 4}), 3)
    assert 0 not in which[covered].tolist()
    scores = sampler.score_pool(context_of(rows, options={"typical_clusters": 4}))
    assert scores.shape == (100,) and np.all(np.isfinite(scores))


def test_typiclust_with_fewer_rows_than_the_batch_or_identical_rows_picks_distinct_rows() -> None:
    rows, _ = blobs((2, 1))
    assert sorted(make_sampler("typiclust").choose(context_of(rows), 10).tolist()) == [0, 1, 2]
    same = make_sampler("typiclust").choose(context_of(np.ones((20, 8))), 6)
    assert len(set(same.tolist())) == 6


def test_typiclust_options_are_declared_and_checked() -> None:
    keys = {option.key for option in TypicalitySampler.options}
    assert {"typical_dims", "typical_neighbours", "typical_clusters", "cold_start_labels"} <= keys
    rows, _ = blobs((10, 10))
    with pytest.raises(ValueError, match="typical-clusters"):
        make_sampler("typiclust").select(context_of(rows, options={"typical_clusters": 0}), 2)


def probabilities_predicting(classes: np.ndarray, count: int, seed: int = 3) -> np.ndarray:
    """(2, N, count) MC-dropout probabilities whose mean predicts `classes`, with random margins."""
    rng = np.random.default_rng(seed)
    top = rng.uniform(0.4, 0.9, len(classes))
    probs = np.tile(((1 - top) / (count - 1))[:, None], (1, count))
    probs[np.arange(len(classes)), classes] = top
    return np.stack([probs, probs])


def test_balanced_margin_balances_a_skewed_predicted_mix_and_is_margin_otherwise() -> None:
    skewed = np.array([0] * 40 + [1] * 5 + [2] * 5)
    probs = probabilities_predicting(skewed, 3)
    picked = make_sampler("balanced-margin").select(context_of(np.zeros((50, 2)), probs=probs), 6)
    assert np.bincount(skewed[picked], minlength=3).tolist() == [2, 2, 2]
    even = np.arange(48) % 3
    probs = probabilities_predicting(even, 3)
    chosen = make_sampler("balanced-margin").select(context_of(np.zeros((48, 2)), probs=probs), 6)
    np.testing.assert_array_equal(chosen, top_k(margin_scores(probs), 6))
    never = make_sampler("balanced-margin").select(
        context_of(np.zeros((50, 2)), probs=probabilities_predicting(skewed, 3), options={"balance_skew": 100}), 6
    )
    np.testing.assert_array_equal(never, top_k(margin_scores(probabilities_predicting(skewed, 3)), 6))


def test_level_quotas_fill_the_emptiest_classes_first_and_skip_what_is_excluded() -> None:
    assert level_quotas(np.array([5, 0, 2, 9]), 6).tolist() == [0, 4, 2, 0], "1 and 2 rise to 4 together"
    assert level_quotas(np.array([1, np.inf, 0, 5]), 5).tolist() == [2, 0, 3, 0]
    assert level_quotas(np.array([3, 3, 3]), 4).tolist() == [2, 1, 1], "a tie goes to the lower index"
    assert level_quotas(np.array([1, 2]), 0).tolist() == [0, 0]
    assert level_quotas(np.array([np.inf, np.inf]), 3).tolist() == [0, 0], "nothing to level: no quota"
    capped = level_quotas(np.array([0, 4, 1]), 7, caps=np.array([2, 9, 0]))
    assert capped.tolist() == [2, 5, 0], "class 0 stops at its cap, class 2 has none left, the rest go to 1"
    assert level_quotas(np.array([0, 0]), 5, caps=np.array([1, 2])).tolist() == [1, 2], "fewer where none has room"


def test_quota_picks_take_the_predicted_by_score_then_the_most_probable_and_never_twice() -> None:
    mean = np.array([[0.9, 0.1], [0.8, 0.2], [0.6, 0.4], [0.7, 0.3], [0.3, 0.7]])
    scores = np.array([0.1, 0.5, 0.9, 0.3, 0.2])
    picked = quota_picks(scores, mean, np.array([2, 3]))
    assert picked.tolist() == [4, 2, 3, 1, 0], "class 1: its one predicted row, then the most probable of it"
    assert len(set(picked.tolist())) == len(picked)
    assert quota_picks(scores, mean, np.array([9, 0])).tolist() == [2, 1, 3, 0, 4], "the pool runs out"
    assert quota_picks(scores[:0], mean[:0], np.array([1, 1])).shape == (0,)
    with pytest.raises(ValueError, match="C quotas"):
        quota_picks(scores, mean, np.array([1, 1, 1]))


def test_level_margin_levels_the_counts_over_the_classes_the_pool_is_predicted_to_hold() -> None:
    predicted = np.array([0] * 30 + [1] * 15 + [2] * 5)
    probs = probabilities_predicting(predicted, 4)
    context = context_of(np.zeros((50, 2)), probs=probs, classes=4, counts=np.array([6.0, 2.0, 0.0, 0.0]))
    picked = make_sampler("level-margin").select(context, 6)
    assert np.bincount(predicted[picked], minlength=4).tolist() == [0, 2, 4, 0], "class 3: no predicted sample"
    scores = margin_scores(probs)
    of_two = np.flatnonzero(predicted == 2)
    assert set(picked[predicted[picked] == 2].tolist()) == set(of_two[np.argsort(-scores[of_two])][:4].tolist())
    phased = make_sampler("typical-then-level-margin")
    assert type(phased.phase(replace(context, class_counts=np.array([5.0, 4.0, 0.0, 0.0])))) is TypicalitySampler
    assert type(phased.phase(replace(context, class_counts=np.array([5.0, 5.0, 0.0, 0.0])))) is LevelMargin


def test_a_phased_sampler_runs_typiclust_below_first_labels_and_margin_after() -> None:
    rows, which = blobs((20, 20, 20))
    probs = probabilities_predicting(which, 3)
    phased = make_sampler("typical-then-margin")
    options = {"first_labels": 10, "typical_clusters": 3}
    early = phased.choose(context_of(rows, probs=probs, options=options, labels_held=9), 3)
    expected = make_sampler("typiclust").choose(context_of(rows, probs=probs, options=options, labels_held=9), 3)
    np.testing.assert_array_equal(early, expected)
    late = phased.choose(context_of(rows, probs=probs, options=options, labels_held=10), 3)
    np.testing.assert_array_equal(late, top_k(margin_scores(probs), 3))
    assert issubclass(type(phased), PhasedSampler) and type(phased).then is MarginHeuristic


def test_phased_samplers_declare_both_samplers_options_once() -> None:
    keys = [option.key for option in SAMPLERS.get("typical-then-balanced-margin").options]
    assert len(keys) == len(set(keys))
    assert {"first_labels", "balance_skew", "typical_clusters", "cold_start_labels"} <= set(keys)
    assert not SAMPLERS.get("typical-then-balanced-margin").needs_encoder
