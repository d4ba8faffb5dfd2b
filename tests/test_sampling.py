# Unit tests for the acquisition heuristics: hand-computed scores, properties, top-k and the registry.
import warnings

import numpy as np
import pytest

from edge_agent.learning.acquisition_scores import (
    bald_scores,
    entropy_scores,
    least_confidence_scores,
    margin_scores,
    top_k,
)
from edge_agent.learning.heuristics import (
    BaldHeuristic,
    EntropyHeuristic,
    Heuristic,
    LeastConfidenceHeuristic,
    MarginHeuristic,
    RandomHeuristic,
)
from edge_agent.learning.sampling import SAMPLERS, heuristic_names, make_heuristic

# r=2 passes, N=2 samples, C=3 classes; indexed [pass, sample, class].
HAND_PROBS = np.array(
    [
        [[1.0, 0.0, 0.0], [0.5, 0.5, 0.0]],
        [[0.0, 1.0, 0.0], [0.5, 0.25, 0.25]],
    ]
)


def random_probs(rng: np.random.Generator, passes: int, samples: int, classes: int) -> np.ndarray:
    """Random probability rows shaped (passes, samples, classes)."""
    return rng.dirichlet(np.ones(classes), size=(passes, samples))


def test_entropy_on_hand_example() -> None:
    # sample 0: mean = [0.5, 0.5, 0]            -> H = ln 2 = 0.693147
    # sample 1: mean = [0.5, 0.375, 0.125]      -> H = 0.5*ln 2 + 0.375*ln(8/3) + 0.125*ln 8
    #                                                = 0.346574 + 0.367811 + 0.259930 = 0.974315
    np.testing.assert_allclose(entropy_scores(HAND_PROBS), [0.693147, 0.974315], atol=1e-6)


def test_bald_on_hand_example() -> None:
    # sample 0: H(mean) = ln 2 = 0.693147; each pass is one-hot, so mean_r H(p_r) = 0  -> BALD = 0.693147
    # sample 1: H(mean) = 0.974315 (above); H(pass 1) = ln 2 = 0.693147;
    #           H(pass 2) = 0.5*ln 2 + 2*0.25*ln 4 = 0.346574 + 0.693147 = 1.039721;
    #           mean_r H = (0.693147 + 1.039721) / 2 = 0.866434  -> BALD = 0.974315 - 0.866434 = 0.107881
    np.testing.assert_allclose(bald_scores(HAND_PROBS), [0.693147, 0.107881], atol=1e-6)


def test_exact_zeros_give_no_nan_and_no_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scores = [f(HAND_PROBS) for f in (entropy_scores, bald_scores, margin_scores, least_confidence_scores)]
    assert all(np.all(np.isfinite(s)) for s in scores)


def test_bald_is_zero_when_all_passes_agree() -> None:
    single = random_probs(np.random.default_rng(1), 1, 50, 10)
    agreeing = np.repeat(single, 7, axis=0)
    np.testing.assert_allclose(bald_scores(agreeing), 0.0, atol=1e-12)
    np.testing.assert_allclose(entropy_scores(agreeing), entropy_scores(single), atol=1e-12)


def test_bald_is_non_negative_and_at_most_entropy() -> None:
    probs = random_probs(np.random.default_rng(2), 5, 100, 4)
    bald, entropy = bald_scores(probs), entropy_scores(probs)
    assert np.all(bald >= -1e-12)
    assert np.all(bald <= entropy + 1e-12)
    assert np.any(bald > 1e-3)


@pytest.mark.parametrize("classes", [2, 3, 10])
def test_entropy_is_ln_c_for_uniform_and_at_most_ln_c_otherwise(classes: int) -> None:
    uniform = np.full((3, 4, classes), 1.0 / classes)
    np.testing.assert_allclose(entropy_scores(uniform), np.log(classes), atol=1e-12)
    others = entropy_scores(random_probs(np.random.default_rng(classes), 3, 200, classes))
    assert np.all(others < np.log(classes))


def test_margin_and_least_confidence_rank_a_hand_example() -> None:
    # one pass; mean probs per sample, with top-two margin and 1 - max:
    #   a = [0.45, 0.45, 0.10]  margin 0.00 -> score -0.00; 1 - max = 0.55
    #   b = [0.40, 0.30, 0.30]  margin 0.10 -> score -0.10; 1 - max = 0.60
    #   c = [0.90, 0.05, 0.05]  margin 0.85 -> score -0.85; 1 - max = 0.10
    probs = np.array([[[0.45, 0.45, 0.10], [0.40, 0.30, 0.30], [0.90, 0.05, 0.05]]])
    np.testing.assert_allclose(margin_scores(probs), [0.0, -0.10, -0.85], atol=1e-12)
    np.testing.assert_allclose(least_confidence_scores(probs), [0.55, 0.60, 0.10], atol=1e-12)
    assert top_k(margin_scores(probs), 3).tolist() == [0, 1, 2]
    assert top_k(least_confidence_scores(probs), 3).tolist() == [1, 0, 2]


def test_margin_and_least_confidence_use_the_mean_over_passes() -> None:
    # sample 0: passes [1, 0] and [0, 1] are each certain, but their mean [0.5, 0.5] is not:
    #           margin 0 -> score 0; 1 - max = 0.5
    # sample 1: passes [0.7, 0.3] twice: margin 0.4 -> score -0.4; 1 - max = 0.3
    probs = np.array([[[1.0, 0.0], [0.7, 0.3]], [[0.0, 1.0], [0.7, 0.3]]])
    np.testing.assert_allclose(margin_scores(probs), [0.0, -0.4], atol=1e-12)
    np.testing.assert_allclose(least_confidence_scores(probs), [0.5, 0.3], atol=1e-12)


@pytest.mark.parametrize("function", [entropy_scores, bald_scores, margin_scores, least_confidence_scores])
def test_score_functions_reject_bad_input(function) -> None:
    with pytest.raises(ValueError, match="3 dimensions"):
        function(np.full((4, 3), 1.0 / 3))
    nan_probs = HAND_PROBS.copy()
    nan_probs[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="finite"):
        function(nan_probs)
    with pytest.raises(ValueError, match="not logits"):
        function(np.array([[[2.0, -1.0, 0.5]]]))


def test_top_k_orders_by_score_and_breaks_ties_by_lowest_index() -> None:
    scores = np.array([1.0, 3.0, 3.0, 2.0, 3.0])
    assert top_k(scores, 3).tolist() == [1, 2, 4]
    assert top_k(scores, 4).tolist() == [1, 2, 4, 3]


def test_top_k_clips_k_and_rejects_negative_k() -> None:
    scores = np.array([0.5, 0.1, 0.9])
    assert top_k(scores, 10).tolist() == [2, 0, 1]
    assert top_k(scores, 0).tolist() == []
    with pytest.raises(ValueError, match="non-negative"):
        top_k(scores, -1)


def test_random_heuristic_draws_distinct_indices_that_depend_on_the_seed() -> None:
    heuristic = RandomHeuristic()
    draws = {seed: top_k(heuristic.scores(None, 1000, np.random.default_rng(seed)), 50) for seed in (0, 1)}
    for indices in draws.values():
        assert len(set(indices.tolist())) == 50
        assert np.all((indices >= 0) & (indices < 1000))
    assert draws[0].tolist() != draws[1].tolist()
    again = top_k(heuristic.scores(None, 1000, np.random.default_rng(0)), 50)
    assert again.tolist() == draws[0].tolist()


def test_random_heuristic_selects_every_sample_equally_often() -> None:
    # 4000 draws of 2 out of 5: each index is expected 4000 * 2/5 = 1600 times (sd about 31).
    rng = np.random.default_rng(3)
    counts = np.zeros(5)
    for _ in range(4000):
        counts[top_k(RandomHeuristic().scores(None, 5, rng), 2)] += 1
    assert np.all(np.abs(counts - 1600) < 150)


@pytest.mark.parametrize(
    ("heuristic", "function"),
    [
        (EntropyHeuristic, entropy_scores),
        (BaldHeuristic, bald_scores),
        (MarginHeuristic, margin_scores),
        (LeastConfidenceHeuristic, least_confidence_scores),
    ],
)
def test_probability_heuristics_apply_their_score_function(heuristic: type[Heuristic], function) -> None:
    probs = random_probs(np.random.default_rng(4), 3, 20, 5)
    rng = np.random.default_rng(0)
    assert heuristic.needs_probabilities
    np.testing.assert_array_equal(heuristic().scores(probs, 20, rng), function(probs))
    with pytest.raises(ValueError, match="needs MC-dropout probabilities"):
        heuristic().scores(None, 20, rng)
    with pytest.raises(ValueError, match="expected 21"):
        heuristic().scores(probs, 21, rng)


def test_registry_names_and_unknown_name() -> None:
    assert sorted(heuristic_names()) == ["bald", "entropy", "least-confidence", "margin", "random"]
    for name, heuristic in ((name, SAMPLERS[name]) for name in heuristic_names()):
        made = make_heuristic(name)
        assert isinstance(made, heuristic) and made.name == name
    assert not RandomHeuristic.needs_probabilities
    with pytest.raises(ValueError, match=r"unknown sampler 'x'; known: bald, entropy, least-confidence"):
        make_heuristic("x")
