# The sampler contract (what a sampler may look at, how it chooses a batch) and the baal-style heuristics that score
# a pool by its MC-dropout probabilities alone (random, entropy, BALD, margin, least confidence).
from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import numpy as np

from edge_agent.learning.acquisition_scores import (
    bald_scores,
    entropy_scores,
    least_confidence_scores,
    margin_scores,
    top_k,
)
from protocol.options import Method, Option


class Embeddings(NamedTuple):
    """Frozen-encoder features of the pool and of the device's human-labelled samples (FAST's seeds)."""

    pool: np.ndarray
    reference: np.ndarray
    reference_labels: np.ndarray


@dataclass(frozen=True)
class AcquisitionContext:
    """What a sampler may look at for one acquisition over a pool of `num_samples` samples.

    The expensive views are callables, so each sampler pays only for what it uses (the agent memoises them).
    `class_counts` counts the human labels per class (n_i of KSAS); `options` are the recipe's method parameters;
    `features` are the pool's penultimate features, `labelled_features` those of the human-labelled samples.
    """

    num_samples: int
    rng: np.random.Generator
    class_counts: np.ndarray
    options: Mapping[str, float]
    probabilities: Callable[[], np.ndarray]
    own_logits: Callable[[], np.ndarray]
    global_logits: Callable[[], np.ndarray]
    embeddings: Callable[[], Embeddings]
    features: Callable[[], np.ndarray]
    labelled_features: Callable[[], np.ndarray]


COLD_START = Option(
    "cold_start_labels",
    int,
    0,
    "cold start: below this many human labels a device draws uniformly",
    low=0.0,
)


def uniform_draw(num_samples: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """k positions out of num_samples drawn uniformly without replacement (what random and a cold start ask)."""
    return top_k(rng.random(num_samples), k)


class Sampler(Method):
    """An acquisition function over a device's pool: one score per sample, higher means ask the oracle first."""

    needs_encoder: ClassVar[bool] = False
    needs_model_logits: ClassVar[bool] = False
    options: ClassVar[tuple[Option, ...]] = (COLD_START,)

    def choose(self, context: AcquisitionContext, budget: int) -> np.ndarray:
        """The batch to ask for: a uniform draw while the device holds fewer human labels than the recipe's
        cold_start_labels, the sampler's own selection after."""
        if context.class_counts.sum() < COLD_START.read(context.options):
            return uniform_draw(context.num_samples, budget, context.rng)
        return self.select(context, budget)

    @abstractmethod
    def score_pool(self, context: AcquisitionContext) -> np.ndarray:
        """Scores for the context's `num_samples` pool samples."""

    def select(self, context: AcquisitionContext, budget: int) -> np.ndarray:
        """Positions of the `budget` pool samples to ask for, best first: the top-k scores unless the sampler
        chooses the batch as a whole."""
        return top_k(self.score_pool(context), budget)

    def weak_labels(self, context: AcquisitionContext) -> np.ndarray | None:
        """Machine labels for the pool samples (FAST), or None when the sampler proposes none."""
        return None


class Heuristic(Sampler):
    """A baal-style acquisition function over MC-dropout probabilities (or none, for random)."""

    needs_probabilities: ClassVar[bool]

    @abstractmethod
    def scores(self, probs: np.ndarray | None, num_samples: int, rng: np.random.Generator) -> np.ndarray:
        """Scores for `num_samples` samples; `probs` is (r, N, C) when `needs_probabilities`, else may be None."""

    def score_pool(self, context: AcquisitionContext) -> np.ndarray:
        """The heuristic's scores, with MC-dropout probabilities computed only when it needs them."""
        probs = context.probabilities() if self.needs_probabilities else None
        return self.scores(probs, context.num_samples, context.rng)


class RandomHeuristic(Heuristic):
    """Uniform random scores, so that top-k is a uniform draw without replacement (the passive baseline)."""

    name = "random"
    summary = "uniform random draw (the passive baseline)"
    needs_probabilities = False
    options = ()

    def scores(self, probs: np.ndarray | None, num_samples: int, rng: np.random.Generator) -> np.ndarray:
        """Independent U[0, 1) draws from `rng`, one per sample; `probs` is ignored."""
        return rng.random(num_samples)


class ProbabilityHeuristic(Heuristic):
    """A heuristic that is a pure function of the MC-dropout probabilities."""

    needs_probabilities = True

    @abstractmethod
    def score(self, probs: np.ndarray) -> np.ndarray:
        """The per-sample score of (r, N, C) MC-dropout probabilities."""

    def scores(self, probs: np.ndarray | None, num_samples: int, rng: np.random.Generator) -> np.ndarray:
        """Applies the score function after checking that probabilities for `num_samples` samples are given."""
        if probs is None:
            raise ValueError(f"sampler {self.name!r} needs MC-dropout probabilities, got None")
        if np.ndim(probs) == 3 and np.shape(probs)[1] != num_samples:
            raise ValueError(f"probs cover {np.shape(probs)[1]} samples, expected {num_samples}")
        return self.score(probs)


class EntropyHeuristic(ProbabilityHeuristic):
    """Largest predictive entropy first (the core paper's sampler)."""

    name = "entropy"
    summary = "largest MC-dropout predictive entropy (the core paper's sampler)"

    def score(self, probs: np.ndarray) -> np.ndarray:
        """entropy_scores(probs)."""
        return entropy_scores(probs)


class BaldHeuristic(ProbabilityHeuristic):
    """Largest BALD mutual information first."""

    name = "bald"
    summary = "largest BALD mutual information over MC-dropout passes"

    def score(self, probs: np.ndarray) -> np.ndarray:
        """bald_scores(probs)."""
        return bald_scores(probs)


class MarginHeuristic(ProbabilityHeuristic):
    """Smallest top-two margin first."""

    name = "margin"
    summary = "smallest gap between the two most likely classes"

    def score(self, probs: np.ndarray) -> np.ndarray:
        """margin_scores(probs)."""
        return margin_scores(probs)


class LeastConfidenceHeuristic(ProbabilityHeuristic):
    """Lowest top-class probability first."""

    name = "least-confidence"
    summary = "lowest probability of the most likely class"

    def score(self, probs: np.ndarray) -> np.ndarray:
        """least_confidence_scores(probs)."""
        return least_confidence_scores(probs)
