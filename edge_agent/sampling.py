# Acquisition heuristics: per-sample uncertainty scores from MC-dropout probabilities, and top-k selection.
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, ClassVar

import numpy as np

ROW_SUM_TOLERANCE = 1e-3


def check_probabilities(probs: np.ndarray) -> np.ndarray:
    """Returns `probs` as float64 after checking it is an (r, N, C) array of probability rows.

    Rejecting negative values and rows that do not sum to 1 catches logits passed by mistake.
    """
    probs = np.asarray(probs, dtype=np.float64)
    if probs.ndim != 3:
        raise ValueError(f"probs must have 3 dimensions (passes, samples, classes), got shape {probs.shape}")
    passes, _, classes = probs.shape
    if passes < 1 or classes < 2:
        raise ValueError(f"probs needs at least 1 pass and 2 classes, got shape {probs.shape}")
    if not np.all(np.isfinite(probs)):
        raise ValueError("probs must be finite (found NaN or inf)")
    if np.any(probs < 0.0) or not np.allclose(probs.sum(axis=-1), 1.0, rtol=0.0, atol=ROW_SUM_TOLERANCE):
        raise ValueError("probs rows must be non-negative and sum to 1 (softmax outputs, not logits)")
    return probs


def _entropy(probs: np.ndarray) -> np.ndarray:
    """Shannon entropy (natural log) over the last axis, with 0 * ln 0 taken as 0."""
    log_probs = np.log(probs, out=np.zeros_like(probs), where=probs > 0.0)
    return -np.sum(probs * log_probs, axis=-1)


def _sorted_mean_probs(probs: np.ndarray) -> np.ndarray:
    """The (N, C) mean over passes, each row sorted in descending order."""
    return -np.sort(-check_probabilities(probs).mean(axis=0), axis=-1)


def entropy_scores(probs: np.ndarray) -> np.ndarray:
    """Predictive entropy H(mean_r p_r) per sample: total uncertainty of the MC-dropout ensemble."""
    return _entropy(check_probabilities(probs).mean(axis=0))


def bald_scores(probs: np.ndarray) -> np.ndarray:
    """BALD mutual information H(mean_r p_r) - mean_r H(p_r): the part of the uncertainty due to the weights."""
    probs = check_probabilities(probs)
    return _entropy(probs.mean(axis=0)) - _entropy(probs).mean(axis=0)


def margin_scores(probs: np.ndarray) -> np.ndarray:
    """Negated gap between the two largest mean probabilities, so a small margin scores high."""
    ranked = _sorted_mean_probs(probs)
    return -(ranked[:, 0] - ranked[:, 1])


def least_confidence_scores(probs: np.ndarray) -> np.ndarray:
    """One minus the largest mean probability: how unsure the ensemble is of its top class."""
    return 1.0 - _sorted_mean_probs(probs)[:, 0]


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest scores, highest first, ties to the lowest index; k is clipped to len(scores)."""
    if k < 0:
        raise ValueError(f"k must be non-negative, got {k}")
    scores = np.asarray(scores, dtype=np.float64)
    if scores.ndim != 1:
        raise ValueError(f"scores must be one-dimensional, got shape {scores.shape}")
    if np.any(np.isnan(scores)):
        raise ValueError("scores must not contain NaN")
    return np.argsort(-scores, kind="stable")[:k]


class Heuristic(ABC):
    """An acquisition function: one score per pool sample, higher means ask the oracle first."""

    name: ClassVar[str]
    needs_probabilities: ClassVar[bool]

    @abstractmethod
    def scores(self, probs: np.ndarray | None, num_samples: int, rng: np.random.Generator) -> np.ndarray:
        """Scores for `num_samples` samples; `probs` is (r, N, C) when `needs_probabilities`, else may be None."""


class RandomHeuristic(Heuristic):
    """Uniform random scores, so that top-k is a uniform draw without replacement (the passive baseline)."""

    name = "random"
    needs_probabilities = False

    def scores(self, probs: np.ndarray | None, num_samples: int, rng: np.random.Generator) -> np.ndarray:
        """Independent U[0, 1) draws from `rng`, one per sample; `probs` is ignored."""
        return rng.random(num_samples)


class ProbabilityHeuristic(Heuristic):
    """A heuristic that is a pure function of the MC-dropout probabilities."""

    needs_probabilities = True
    score_function: ClassVar[Callable[[np.ndarray], np.ndarray]]

    def scores(self, probs: np.ndarray | None, num_samples: int, rng: np.random.Generator) -> np.ndarray:
        """Applies the score function after checking that probabilities for `num_samples` samples are given."""
        if probs is None:
            raise ValueError(f"sampler {self.name!r} needs MC-dropout probabilities, got None")
        if np.ndim(probs) == 3 and np.shape(probs)[1] != num_samples:
            raise ValueError(f"probs cover {np.shape(probs)[1]} samples, expected {num_samples}")
        return self.score_function(probs)


class EntropyHeuristic(ProbabilityHeuristic):
    """Largest predictive entropy first (the core paper's sampler)."""

    name = "entropy"
    score_function = staticmethod(entropy_scores)


class BaldHeuristic(ProbabilityHeuristic):
    """Largest BALD mutual information first."""

    name = "bald"
    score_function = staticmethod(bald_scores)


class MarginHeuristic(ProbabilityHeuristic):
    """Smallest top-two margin first."""

    name = "margin"
    score_function = staticmethod(margin_scores)


class LeastConfidenceHeuristic(ProbabilityHeuristic):
    """Lowest top-class probability first."""

    name = "least-confidence"
    score_function = staticmethod(least_confidence_scores)


HEURISTICS: dict[str, type[Heuristic]] = {
    heuristic.name: heuristic
    for heuristic in (
        RandomHeuristic,
        EntropyHeuristic,
        BaldHeuristic,
        MarginHeuristic,
        LeastConfidenceHeuristic,
    )
}


def make_heuristic(name: str) -> Heuristic:
    """A fresh heuristic by its registry name."""
    if name not in HEURISTICS:
        raise ValueError(f"unknown sampler {name!r}; known: {', '.join(sorted(HEURISTICS))}")
    return HEURISTICS[name]()
