# Batch-aware samplers against hand-checked cases: power sampling, BADGE's k-means++, class-balanced top-k.
from __future__ import annotations

from functools import cache

import numpy as np
import pytest

from edge_agent.learning.acquisition_scores import bald_scores, entropy_scores, top_k
from edge_agent.learning.batch_samplers import FastSampler, KsasSampler, PowerSampler
from edge_agent.learning.batch_selection import (
    class_balanced_top_k,
    k_center_greedy,
    kmeans_pp_outer,
    nearest_squared_distances,
    power_sample,
)
from edge_agent.learning.heuristics import AcquisitionContext, Embeddings
from edge_agent.learning.local_data import LocalData, balanced_sample
from edge_agent.learning.sampling import make_sampler


def test_power_sampling_with_a_huge_exponent_is_top_k() -> None:
    scores = np.random.default_rng(1).random(200)
    drawn = power_sample(scores, 20, 1e6, np.random.default_rng(0))
    np.testing.assert_array_equal(drawn, top_k(scores, 20))


def test_power_sampling_with_exponent_0_is_uniform_and_follows_the_scores_in_between() -> None:
    scores = np.array([1.0, 1.0, 9.0, 9.0])  # with beta = 1, each of the last two is drawn first with p = 0.45
    firsts = [power_sample(scores, 1, 1.0, np.random.default_rng(seed))[0] for seed in range(4000)]
    share = np.bincount(firsts, minlength=4) / len(firsts)
    assert share[2] + share[3] == pytest.approx(0.9, abs=0.02)
    uniform = [power_sample(scores, 1, 0.0, np.random.default_rng(seed))[0] for seed in range(4000)]
    assert np.bincount(uniform, minlength=4) / 4000 == pytest.approx([0.25] * 4, abs=0.03)


def test_power_sampling_draws_zero_scores_last_and_never_twice() -> None:
    scores = np.array([0.0, 0.5, 0.0, 0.2])
    drawn = power_sample(scores, 4, 1.0, np.random.default_rng(3))
    assert sorted(drawn[:2].tolist()) == [1, 3] and sorted(drawn.tolist()) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="non-negative score"):
        power_sample(np.array([0.1, -0.2]), 1, 1.0, np.random.default_rng(0))


def test_kmeans_pp_starts_with_the_longest_embedding_then_takes_the_far_point() -> None:
    """Ten near-copies of one long embedding and one far point: the second pick is the far point (its squared
    distance dwarfs the copies' combined)."""
    left = np.tile([[1.0, 0.0]], (11, 1))
    right = np.tile([[2.0, 0.0]], (11, 1)) + np.random.default_rng(0).normal(0, 1e-4, (11, 2))
    right[7] = [0.0, -1.5]  # shorter than the copies, but far from them
    right[4] = [2.1, 0.0]  # the longest of the copies
    for seed in range(20):
        picked = kmeans_pp_outer(left, right, 2, np.random.default_rng(seed))
        assert picked.tolist() == [4, 7]


def test_kmeans_pp_matches_distances_of_the_materialised_outer_products() -> None:
    rng = np.random.default_rng(5)
    left, right = rng.normal(size=(30, 4)), rng.normal(size=(30, 6))
    picked = kmeans_pp_outer(left, right, 30, np.random.default_rng(0))
    assert sorted(picked.tolist()) == list(range(30)), "every row is picked once when k = N"
    full = np.einsum("ni,nj->nij", left, right).reshape(30, -1)
    assert picked[0] == np.argmax(np.linalg.norm(full, axis=1))


def test_kmeans_pp_of_identical_rows_still_picks_distinct_ones() -> None:
    picked = kmeans_pp_outer(np.ones((5, 2)), np.ones((5, 3)), 3, np.random.default_rng(0))
    assert len(set(picked.tolist())) == 3


def test_k_center_greedy_takes_the_farthest_cluster_first_then_the_next() -> None:
    """Labelled centres sit on cluster A; the pool holds copies of A, a far cluster B and a nearer cluster C: the
    first pick is in B, the second in C, and A is never picked while B and C hold a point."""
    jitter = np.random.default_rng(0).normal(0, 0.01, (12, 2))
    pool = np.concatenate([np.zeros((4, 2)), np.full((4, 2), 10.0), np.tile([[0.0, 4.0]], (4, 1))]) + jitter
    picked = k_center_greedy(pool, np.zeros((3, 2)), 2, np.random.default_rng(0))
    assert 4 <= picked[0] < 8 and 8 <= picked[1] < 12
    assert sorted(k_center_greedy(pool, np.zeros((1, 2)), 20, np.random.default_rng(0)).tolist()) == list(range(12))


def test_k_center_greedy_without_centres_starts_anywhere_and_then_goes_far() -> None:
    pool = np.array([[0.0], [1.0], [2.0], [9.0]])
    for seed in range(10):
        picked = k_center_greedy(pool, np.zeros((0, 0)), 2, np.random.default_rng(seed))
        assert picked[1] == (3 if picked[0] != 3 else 0), "the second pick is the farthest from the first"


def test_nearest_distances_are_exact_and_refuse_mismatched_widths() -> None:
    rows, centres = np.array([[0.0, 0.0], [3.0, 4.0]]), np.array([[3.0, 0.0], [3.0, 4.0], [0.0, 1.0]])
    np.testing.assert_allclose(nearest_squared_distances(rows, centres, block=2), [1.0, 0.0])
    assert np.isinf(nearest_squared_distances(rows, np.zeros((0, 0)))).all()
    with pytest.raises(ValueError, match="one width"):
        nearest_squared_distances(rows, np.zeros((2, 3)))
    with pytest.raises(ValueError, match="pool features"):
        k_center_greedy(np.zeros(5), np.zeros((0, 0)), 2, np.random.default_rng(0))


def test_the_coreset_sampler_covers_what_the_labels_do_not() -> None:
    """Its score is the distance to the nearest labelled sample; its batch starts in the uncovered cluster."""
    features = np.concatenate([np.zeros((5, 3)), np.full((5, 3), 5.0)])
    probs = np.full((2, 10, 2), 0.5)
    context = context_of(probs, features, labelled=np.zeros((2, 3)))
    sampler = make_sampler("coreset")
    np.testing.assert_allclose(sampler.score_pool(context), [0.0] * 5 + [np.sqrt(75.0)] * 5)
    assert 5 <= sampler.select(context, 2)[0] < 10


def test_class_balanced_top_k_gives_each_predicted_class_its_share() -> None:
    scores = np.array([0.9, 0.8, 0.7, 0.6, 0.1, 0.05])
    predicted = np.array([0, 0, 0, 0, 1, 1])
    picked = class_balanced_top_k(scores, predicted, 4, 2)
    assert sorted(picked.tolist()) == [0, 1, 4, 5]
    assert picked.tolist() == [0, 1, 4, 5], "best first"
    assert sorted(class_balanced_top_k(scores, np.zeros(6, dtype=int), 3, 2).tolist()) == [0, 1, 2]


def context_of(
    probs: np.ndarray,
    features: np.ndarray,
    seed: int = 0,
    class_counts: np.ndarray | None = None,
    options: dict[str, float] | None = None,
    labelled: np.ndarray | None = None,
) -> AcquisitionContext:
    """An acquisition context over given MC-dropout probabilities, penultimate features and labelled features."""
    return AcquisitionContext(
        num_samples=probs.shape[1],
        rng=np.random.default_rng(seed),
        class_counts=np.zeros(probs.shape[2]) if class_counts is None else class_counts,
        options=options or {},
        probabilities=cache(lambda: probs),
        own_logits=lambda: np.zeros(0),
        global_logits=lambda: np.zeros(0),
        embeddings=lambda: Embeddings(np.zeros(0), np.zeros(0), np.zeros(0)),
        features=cache(lambda: features),
        labelled_features=cache(lambda: labelled if labelled is not None else np.zeros((0, 0))),
    )


@pytest.mark.parametrize(
    "name",
    [
        "power-entropy",
        "power-bald",
        "power-margin",
        "badge",
        "coreset",
        "balanced-entropy",
        "balanced-margin",
        "typiclust",
        "typical-then-margin",
        "typical-then-balanced-margin",
    ],
)
def test_every_batch_sampler_picks_distinct_pool_positions(name: str) -> None:
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(5, 60, 4))
    probs = np.exp(logits) / np.exp(logits).sum(axis=-1, keepdims=True)
    features = rng.normal(size=(60, 8))
    picked = make_sampler(name).select(context_of(probs, features), 12)
    assert len(picked) == 12 and len(set(picked.tolist())) == 12 and picked.min() >= 0 and picked.max() < 60
    again = make_sampler(name).select(context_of(probs, features), 12)
    assert again.tolist() == picked.tolist(), "the same seed draws the same batch"


def test_power_margin_with_a_huge_exponent_is_margins_top_k() -> None:
    logits = np.random.default_rng(4).normal(size=(3, 50, 5))
    probs = np.exp(logits) / np.exp(logits).sum(axis=-1, keepdims=True)
    options = {"power_beta": 1e6}
    drawn = make_sampler("power-margin").choose(context_of(probs, np.zeros((50, 2)), options=options), 10)
    np.testing.assert_array_equal(drawn, make_sampler("margin").choose(context_of(probs, np.zeros((50, 2))), 10))


@pytest.mark.parametrize(
    ("name", "direct_scores"),
    [
        ("power-entropy", entropy_scores),
        ("power-bald", bald_scores),
        ("power-margin", lambda probs: 1.0 - (np.sort(probs.mean(axis=0))[:, -1] - np.sort(probs.mean(axis=0))[:, -2])),
    ],
)
def test_a_composed_power_sampler_draws_what_the_direct_gumbel_formula_draws(name: str, direct_scores) -> None:
    """The power sampler composed over its score sampler picks, seed for seed, top-k of beta ln s + Gumbel noise
    drawn from the same generator, s being the score computed directly."""
    logits = np.random.default_rng(8).normal(size=(5, 70, 4))
    probs = np.exp(logits) / np.exp(logits).sum(axis=-1, keepdims=True)
    for seed, beta in ((0, 1.0), (3, 2.5), (11, 0.5)):
        context = context_of(probs, np.zeros((70, 2)), seed=seed, options={"power_beta": beta})
        drawn = make_sampler(name).choose(context, 15)
        scores = np.maximum(direct_scores(probs), 0.0)
        gumbel = np.random.default_rng(seed).gumbel(size=70)
        expected = top_k(np.where(scores > 0, beta * np.log(scores) + gumbel, -np.inf), 15)
        np.testing.assert_array_equal(drawn, expected)


def test_power_sampling_composes_over_any_score_sampler_and_asks_for_what_it_asks() -> None:
    """A power sampler over KSAS needs the whole-model logits KSAS needs; over FAST, the encoder."""

    class PowerKsas(PowerSampler):
        name, base = "power-ksas", KsasSampler

    class PowerFast(PowerSampler):
        name, base = "power-fast", FastSampler

    assert PowerKsas.needs_model_logits and not PowerKsas.needs_encoder
    assert PowerFast.needs_encoder and not PowerFast.needs_model_logits
    assert not make_sampler("power-bald").needs_model_logits


def test_a_cold_start_draws_uniformly_until_the_device_holds_enough_labels() -> None:
    """Below cold_start_labels the batch is random's draw from the same generator; at the threshold, margin's."""
    logits = np.random.default_rng(6).normal(size=(4, 80, 3))
    probs = np.exp(logits) / np.exp(logits).sum(axis=-1, keepdims=True)
    features = np.zeros((80, 2))
    margin, random = make_sampler("margin"), make_sampler("random")
    options = {"cold_start_labels": 20.0}
    cold = margin.choose(context_of(probs, features, class_counts=np.array([10, 9, 0]), options=options), 8)
    np.testing.assert_array_equal(cold, random.choose(context_of(probs, features), 8))
    assert not np.array_equal(cold, margin.choose(context_of(probs, features), 8))
    warm = margin.choose(context_of(probs, features, class_counts=np.array([10, 10, 0]), options=options), 8)
    np.testing.assert_array_equal(warm, top_k(margin.score_pool(context_of(probs, features)), 8))


def test_badge_starts_from_the_most_uncertain_sample_and_scores_confident_ones_near_zero() -> None:
    """A confident sample's gradient embedding is near zero: it never opens the batch."""
    confident = np.tile([0.997, 0.001, 0.001, 0.001], (20, 1))
    unsure = np.tile([0.4, 0.3, 0.2, 0.1], (5, 1))
    probs = np.concatenate([confident, unsure])[None]
    features = np.ones((25, 6))
    features[22] *= 2.0
    sampler = make_sampler("badge")
    assert sampler.select(context_of(probs, features), 5)[0] == 22
    lengths = sampler.score_pool(context_of(probs, features))
    assert lengths[:20].max() < 0.01 * lengths[20:].min()


def test_a_balanced_sample_takes_the_classes_in_turn_and_fills_from_the_larger_ones() -> None:
    labels = np.array([0] * 10 + [1] * 3 + [2] * 1)
    picked = balanced_sample(labels, 8, np.random.default_rng(0))
    assert len(set(picked.tolist())) == 8
    assert np.bincount(labels[picked], minlength=3).tolist() == [4, 3, 1]
    assert np.bincount(labels[balanced_sample(labels, 3, np.random.default_rng(1))], minlength=3).tolist() == [1, 1, 1]


def test_the_kept_set_is_every_label_or_a_balanced_reservoir() -> None:
    images = np.arange(12 * 28 * 28, dtype=np.uint8).reshape(12, 28, 28)
    labels = np.array([0] * 9 + [1] * 3)
    empty = np.zeros((0, 28, 28), dtype=np.uint8)
    data = LocalData(empty, labels[:0], empty, labels[:0], images, labels, lambda: empty)
    everything, everything_labels = data.kept_set(0, seed=0)
    assert len(everything) == 12 and everything_labels.tolist() == labels.tolist()
    kept, kept_labels = data.kept_set(6, seed=0)
    assert np.bincount(kept_labels).tolist() == [3, 3]
    assert all(
        any(np.array_equal(image, other) for other in images[labels == label])
        for image, label in zip(kept, kept_labels)
    )
