# Acquisition functions: per-sample scores (MC-dropout heuristics, KSAS, FAST prototype entropy), top-k selection
# and the batch-aware selections (stochastic power sampling, BADGE's k-means++, class-balanced top-k).
from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import numpy as np

from protocol.options import Method, Option, Registry

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


class Embeddings(NamedTuple):
    """Frozen-encoder features of the pool and of the device's human-labelled samples (FAST's seeds)."""

    pool: np.ndarray
    reference: np.ndarray
    reference_labels: np.ndarray


@dataclass(frozen=True)
class AcquisitionContext:
    """What a sampler may look at for one acquisition over a pool of `num_samples` samples.

    The expensive views are callables, so each sampler pays only for what it uses (the agent memoises them).
    `class_counts` counts the human labels per class (n_i of KSAS); `options` are the recipe's method parameters.
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


SAMPLERS: Registry[type[Sampler]] = Registry("sampler")

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


def make_heuristic(name: str) -> Heuristic:
    """A fresh probability heuristic by its registry name (what `edge-agent score` can run from a bundle alone)."""
    heuristics = heuristic_names()
    if name not in heuristics:
        raise ValueError(f"unknown sampler {name!r}; known: {', '.join(sorted(heuristics))}")
    heuristic = SAMPLERS.get(name)()
    assert isinstance(heuristic, Heuristic)
    return heuristic


def heuristic_names() -> list[str]:
    """The registered samplers that need nothing but MC-dropout probabilities (what a bundle alone can run)."""
    return SAMPLERS.select(lambda method: issubclass(method, Heuristic))


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64; -inf logits (impossible classes) stay -inf."""
    logits = np.asarray(logits, dtype=np.float64)
    shifted = logits - np.max(logits, axis=-1, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def class_prior_bias(class_counts: np.ndarray, lam: float) -> np.ndarray:
    """lam * ln n_c per class (KAFAL's knowledge weight): -inf for a class with n_c = 0 when lam > 0.

    With lam = 0, or before any label exists, the bias is 0 everywhere (no specialised knowledge yet).
    """
    counts = np.asarray(class_counts, dtype=np.float64)
    if counts.ndim != 1 or np.any(counts < 0) or not np.all(np.isfinite(counts)):
        raise ValueError(f"class counts must be a flat list of non-negative numbers, got {class_counts!r}")
    if lam < 0 or not np.isfinite(lam):
        raise ValueError(f"lambda must be a non-negative number, got {lam!r}")
    if lam == 0 or counts.sum() == 0:
        return np.zeros_like(counts)
    return np.where(counts > 0, lam * np.log(np.where(counts > 0, counts, 1.0)), -np.inf)


def ksas_scores(own_logits: np.ndarray, global_logits: np.ndarray, class_counts: np.ndarray, lam: float) -> np.ndarray:
    """KSAS (KAFAL Eq. 1-3): D(x) = sum_y (P_y - Q_y)(ln P_y - ln Q_y) of the knowledge-weighted softmaxes.

    P = softmax(own logits + lam ln n), Q = softmax(global logits + lam ln n); a class with n = 0 has
    P = Q = 0 and contributes 0 (the reference code returns NaN there).
    """
    own_logits = np.asarray(own_logits, dtype=np.float64)
    global_logits = np.asarray(global_logits, dtype=np.float64)
    if own_logits.ndim != 2 or own_logits.shape != global_logits.shape:
        raise ValueError(
            f"logits must be two (N, C) arrays of one shape, got {own_logits.shape} and {global_logits.shape}"
        )
    bias = class_prior_bias(class_counts, lam)
    if bias.shape != own_logits.shape[1:]:
        raise ValueError(f"{len(bias)} class counts for {own_logits.shape[1]} classes")
    possible = np.isfinite(bias)
    log_p = np.where(possible, _log_softmax(own_logits + bias), 0.0)
    log_q = np.where(possible, _log_softmax(global_logits + bias), 0.0)
    return np.sum((np.exp(log_p) - np.exp(log_q)) * (log_p - log_q), axis=-1)


class KsasSampler(Sampler):
    """KAFAL's knowledge-specialised sampler: largest discrepancy between the device's own and the global model."""

    name = "ksas"
    summary = "KAFAL: discrepancy between the device's own and the global model, class-count weighted"
    needs_model_logits = True
    options = (
        COLD_START,
        Option("lambda", float, 1.0, "KSAS knowledge weight lambda", low=0.0, flag="--ksas-lambda"),
    )

    def score_pool(self, context: AcquisitionContext) -> np.ndarray:
        """ksas_scores of the own model and the downloaded global model, lambda from the recipe (default 1)."""
        return ksas_scores(
            context.own_logits(),
            context.global_logits(),
            context.class_counts,
            self.option_value(context.options, "lambda"),
        )


def _unit_rows(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm (a zero row stays zero)."""
    vectors = np.asarray(vectors, dtype=np.float64)
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / np.where(norms > 0, norms, 1.0)


def _check_reference(embeddings: np.ndarray, reference: np.ndarray, labels: np.ndarray, num_classes: int) -> None:
    """ValueError unless there is at least one labelled reference of the pool's width and labels fit num_classes."""
    if len(reference) == 0:
        raise ValueError("sampler 'fast' needs human-labelled seeds on the device (e.g. --initial-label-fraction)")
    if np.ndim(embeddings) != 2 or np.ndim(reference) != 2 or np.shape(embeddings)[1] != np.shape(reference)[1]:
        raise ValueError(f"embeddings {np.shape(embeddings)} and references {np.shape(reference)} must be (N, d)")
    if len(labels) != len(reference) or np.min(labels) < 0 or np.max(labels) >= num_classes:
        raise ValueError(f"need one label in [0, {num_classes}) per reference embedding")


def prototype_similarities(
    embeddings: np.ndarray, reference: np.ndarray, labels: np.ndarray, num_classes: int
) -> tuple[np.ndarray, np.ndarray]:
    """FAST Eq. 7: (s, seeded) with s[i, c] = mean cosine of sample i to the seeds of class c (0 where unseeded)."""
    _check_reference(embeddings, reference, labels, num_classes)
    cosines = _unit_rows(embeddings) @ _unit_rows(reference).T
    one_hot = np.eye(num_classes)[np.asarray(labels, dtype=np.int64)]
    per_class = one_hot.sum(axis=0)
    seeded = per_class > 0
    similarities = (cosines @ one_hot) / np.where(seeded, per_class, 1.0)
    return np.clip(similarities, -1.0, 1.0), seeded


def prototype_entropy(similarities: np.ndarray, seeded: np.ndarray) -> np.ndarray:
    """FAST Eq. 8: u_i = H(softmax(s_i)) over the seeded classes only (unseeded classes are masked out)."""
    masked = np.where(seeded, np.asarray(similarities, dtype=np.float64), -np.inf)
    log_p = np.where(seeded, _log_softmax(masked), 0.0)
    return -np.sum(np.where(seeded, np.exp(log_p) * log_p, 0.0), axis=-1)


def knn_labels(
    embeddings: np.ndarray, reference: np.ndarray, labels: np.ndarray, k: int, num_classes: int
) -> np.ndarray:
    """FAST's weak labels: majority vote of the k nearest references in L2 (k clipped to their count); ties go
    to the lowest class, equal distances to the earlier reference."""
    _check_reference(embeddings, reference, labels, num_classes)
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    embeddings = np.asarray(embeddings, dtype=np.float64)
    reference = np.asarray(reference, dtype=np.float64)
    distances = (
        np.sum(embeddings**2, axis=1, keepdims=True) - 2.0 * embeddings @ reference.T + np.sum(reference**2, axis=1)
    )
    nearest = np.argsort(distances, axis=1, kind="stable")[:, : min(k, len(reference))]
    votes = np.eye(num_classes, dtype=np.int64)[np.asarray(labels, dtype=np.int64)[nearest]].sum(axis=1)
    return np.argmax(votes, axis=1)


class FastSampler(Sampler):
    """FAST: frozen-encoder prototype entropy decides what a person labels; kNN votes label the rest weakly."""

    name = "fast"
    summary = "FAST: frozen-encoder prototype entropy asks people; kNN votes label the rest weakly"
    needs_encoder = True
    options = (
        COLD_START,
        Option("knn_k", int, 10, "FAST: neighbours voting for a weak label", low=1.0, flag="--knn-k"),
    )

    def score_pool(self, context: AcquisitionContext) -> np.ndarray:
        """Prototype-cosine entropy of each pool embedding against the device's human-labelled seeds."""
        pool, reference, labels = context.embeddings()
        return prototype_entropy(*prototype_similarities(pool, reference, labels, len(context.class_counts)))

    def weak_labels(self, context: AcquisitionContext) -> np.ndarray:
        """kNN majority labels of every pool sample (k from the recipe, default 10)."""
        pool, reference, labels = context.embeddings()
        return knn_labels(
            pool, reference, labels, int(self.option_value(context.options, "knn_k")), len(context.class_counts)
        )


def power_sample(scores: np.ndarray, k: int, beta: float, rng: np.random.Generator) -> np.ndarray:
    """Kirsch et al.'s stochastic power acquisition: k samples drawn without replacement with probability in
    proportion to score^beta (Gumbel-top-k on beta ln s). beta -> inf is top-k; beta = 0 a uniform draw; a zero
    score is drawn last."""
    scores = np.asarray(scores, dtype=np.float64)
    if scores.ndim != 1 or np.any(np.isnan(scores)) or np.any(scores < 0):
        raise ValueError("power sampling needs one non-negative score per sample")
    if not (beta >= 0 and np.isfinite(beta)):
        raise ValueError(f"beta must be a non-negative number, got {beta!r}")
    with np.errstate(divide="ignore"):
        keys = beta * np.log(scores) if beta > 0 else np.zeros_like(scores)
    return top_k(np.where(scores > 0, keys + rng.gumbel(size=len(scores)), -np.inf), k)


def kmeans_pp_outer(left: np.ndarray, right: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ seeding over the rows g_i = left_i (outer) right_i without building them: |g_i - g_j|^2 =
    |l_i|^2 |r_i|^2 + |l_j|^2 |r_j|^2 - 2 (l_i . l_j)(r_i . r_j). The first pick is the longest g_i; each next one
    is drawn with probability in proportion to its squared distance to the nearest pick (uniform once all are 0)."""
    left, right = np.asarray(left, dtype=np.float64), np.asarray(right, dtype=np.float64)
    if left.ndim != 2 or right.ndim != 2 or len(left) != len(right):
        raise ValueError(f"need two (N, d) arrays with one row per sample, got {left.shape} and {right.shape}")
    norms = np.sum(left**2, axis=1) * np.sum(right**2, axis=1)
    picked = [int(np.argmax(norms))] if len(left) and k > 0 else []
    nearest = np.full(len(left), np.inf)
    while len(picked) < min(k, len(left)):
        last = picked[-1]
        to_last = norms + norms[last] - 2.0 * (left @ left[last]) * (right @ right[last])
        nearest = np.minimum(nearest, np.maximum(to_last, 0.0))
        nearest[picked] = 0.0
        total = nearest.sum()
        weights = nearest / total if total > 0 else np.where(np.isin(np.arange(len(left)), picked), 0.0, 1.0)
        picked.append(int(rng.choice(len(left), p=weights / weights.sum())))
    return np.asarray(picked, dtype=np.int64)


def badge_parts(mean_probs: np.ndarray, features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """BADGE's last-layer gradient embedding as its two factors: (p - onehot(argmax p)) and the features; their
    outer product is the cross-entropy gradient w.r.t. the classifier weights at the predicted label."""
    mean_probs = np.asarray(mean_probs, dtype=np.float64)
    if len(mean_probs) != len(features):
        raise ValueError(f"{len(mean_probs)} probability rows for {len(features)} feature rows")
    residual = mean_probs - np.eye(mean_probs.shape[1])[np.argmax(mean_probs, axis=1)]
    return residual, np.asarray(features, dtype=np.float64)


def class_balanced_top_k(scores: np.ndarray, predicted: np.ndarray, k: int, num_classes: int) -> np.ndarray:
    """floor(k / C) highest scores among the samples predicted as each class, the rest of the k by the highest
    scores left (FAST's class-aware selection): a batch that cannot be all one class."""
    scores = np.asarray(scores, dtype=np.float64)
    order = top_k(scores, len(scores))
    quota = k // num_classes
    chosen = np.concatenate([order[predicted[order] == c][:quota] for c in range(num_classes)]).astype(np.int64)
    rest = order[~np.isin(order, chosen)][: max(k - len(chosen), 0)]
    picked = np.concatenate([chosen, rest])
    return picked[np.argsort(-scores[picked], kind="stable")]


class PowerSampler(Sampler):
    """Stochastic batch acquisition (Kirsch et al., TMLR 2023) over an MC-dropout score: diverse batches without
    a pairwise term, and a cold start that is not all one kind of sample."""

    options = (
        COLD_START,
        Option("power_beta", float, 1.0, "power of the score the draw follows", low=0.0, flag="--power-beta"),
    )

    @abstractmethod
    def base_scores(self, probs: np.ndarray) -> np.ndarray:
        """The per-sample uncertainty the draw follows."""

    def score_pool(self, context: AcquisitionContext) -> np.ndarray:
        """The base uncertainty of every pool sample (rounding noise below 0 clipped to 0)."""
        return np.maximum(self.base_scores(context.probabilities()), 0.0)

    def select(self, context: AcquisitionContext, budget: int) -> np.ndarray:
        """A draw of `budget` samples with probability in proportion to score^beta."""
        beta = self.option_value(context.options, "power_beta")
        return power_sample(self.score_pool(context), budget, beta, context.rng)


class PowerEntropy(PowerSampler):
    """Power sampling over the predictive entropy."""

    name = "power-entropy"
    summary = "draw in proportion to entropy^beta (stochastic batch acquisition)"

    def base_scores(self, probs: np.ndarray) -> np.ndarray:
        """entropy_scores(probs)."""
        return entropy_scores(probs)


class PowerBald(PowerSampler):
    """Power sampling over BALD."""

    name = "power-bald"
    summary = "draw in proportion to BALD^beta (stochastic batch acquisition, Kirsch et al. 2023)"

    def base_scores(self, probs: np.ndarray) -> np.ndarray:
        """bald_scores(probs)."""
        return bald_scores(probs)


class PowerMargin(PowerSampler):
    """Power sampling over one minus the top-two margin."""

    name = "power-margin"
    summary = "draw in proportion to (1 - top-two margin)^beta (stochastic batch acquisition)"

    def base_scores(self, probs: np.ndarray) -> np.ndarray:
        """1 + margin_scores(probs): one minus the gap between the two most likely classes, in [0, 1]."""
        return 1.0 + margin_scores(probs)


class BadgeSampler(Sampler):
    """BADGE (Ash et al., ICLR 2020): k-means++ over last-layer gradient embeddings from the MC-dropout mean, so a
    batch is uncertain (long embeddings) and diverse (far apart)."""

    name = "badge"
    summary = "k-means++ over last-layer gradient embeddings: uncertain and diverse batches"

    def score_pool(self, context: AcquisitionContext) -> np.ndarray:
        """Each sample's gradient-embedding length, |p - onehot| |features|."""
        residual, features = badge_parts(context.probabilities().mean(axis=0), context.features())
        return np.linalg.norm(residual, axis=1) * np.linalg.norm(features, axis=1)

    def select(self, context: AcquisitionContext, budget: int) -> np.ndarray:
        """The k-means++ seeds of the gradient embeddings."""
        residual, features = badge_parts(context.probabilities().mean(axis=0), context.features())
        return kmeans_pp_outer(residual, features, budget, context.rng)


class BalancedEntropy(Sampler):
    """Top entropy per predicted class: at most an equal share of the batch from every class the model sees."""

    name = "balanced-entropy"
    summary = "highest entropy per predicted class, an equal share each (class-balanced batches)"

    def score_pool(self, context: AcquisitionContext) -> np.ndarray:
        """entropy_scores of the pool's MC-dropout probabilities."""
        return entropy_scores(context.probabilities())

    def select(self, context: AcquisitionContext, budget: int) -> np.ndarray:
        """class_balanced_top_k over the predicted (MC-dropout mean) classes."""
        probs = context.probabilities()
        predicted = np.argmax(probs.mean(axis=0), axis=1)
        return class_balanced_top_k(entropy_scores(probs), predicted, budget, probs.shape[2])


for registered in (
    RandomHeuristic,
    EntropyHeuristic,
    BaldHeuristic,
    MarginHeuristic,
    LeastConfidenceHeuristic,
    KsasSampler,
    FastSampler,
    PowerEntropy,
    PowerBald,
    PowerMargin,
    BadgeSampler,
    BalancedEntropy,
):
    SAMPLERS.register(registered)


def make_sampler(name: str) -> Sampler:
    """A fresh sampler of any kind by its registry name (what a device runs in a round)."""
    return SAMPLERS.get(name)()
