# Label propagation over the kNN graph of a device's cached feature rows (Iscen et al. 2019): device-only pseudo-labels.
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from edge_agent.learning.acquisition_scores import class_prior_bias
from edge_agent.learning.head_training import HeadSettings, train_classifier

BLOCK_ROWS = 128  # rows of the similarity matrix held at once: 128 x 4000 float32 is 2 MB (its partition's indices 4)
NO_ALIGNMENT, OWN_SHARES, FLEET_SHARES = 0, 1, 2  # what the teacher's pool posteriors are aligned to (alignment)


@dataclass(frozen=True)
class Propagation:
    """How a device pseudo-labels its pool: a cosine kNN graph of `neighbours` per row (the unit rows projected
    to `projection` dimensions by a fixed Gaussian matrix first, 0: not projected; cosines survive a random
    projection up to a small error, and the search is a fifth of the cost at 1280 features), edge weights
    max(cos, 0)^`power`, the diffusion (I - alpha W)^-1 Y solved by `iterations` conjugate-gradient steps; a pool row
    keeps the round's head's prediction where the diffusion agrees with it, at most `most` in equal quotas per class
    the device holds a human label of, the most confident first. `alignment` (alignment_target) says what the
    head's pool posteriors are aligned to before (aligned): nothing, the device's human-label shares or the
    fleet's."""

    neighbours: int = 10
    alpha: float = 0.9
    power: float = 3.0
    iterations: int = 20
    most: int = 300
    projection: int = 256
    alignment: int = NO_ALIGNMENT


@dataclass(frozen=True)
class Graph:
    """A kNN graph: row i's neighbours (N, k) and their edge weights (N, k); the affinity W is A + A^T, and
    `scale` is D^-1/2 of W's row sums (0 for a row without edges)."""

    neighbours: np.ndarray
    weights: np.ndarray
    scale: np.ndarray

    def product(self, values: np.ndarray) -> np.ndarray:
        """D^-1/2 W D^-1/2 `values` for (N, C) values: the symmetric normalised affinity times them."""
        scaled = values * self.scale[:, None]
        return self.scale[:, None] * symmetric_product(self.neighbours, self.weights, scaled)


@dataclass(frozen=True)
class PseudoLabels:
    """Pool positions, the class given to each and its weight in the loss: what a device trains on beside its human
    labels and never stores, counts or sends."""

    positions: np.ndarray
    labels: np.ndarray
    weights: np.ndarray


def unit_rows(features: np.ndarray) -> np.ndarray:
    """The rows as float32 scaled to unit length (a zero row stays zero)."""
    rows = np.asarray(features, dtype=np.float32)
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return rows / np.maximum(norms, np.float32(1e-12))


def nearest_neighbours(features: np.ndarray, neighbours: int, block: int = BLOCK_ROWS) -> tuple[np.ndarray, np.ndarray]:
    """(indices, cosine similarities), each (N, k) with k = min(neighbours, N - 1): every row's k most similar other
    rows, the similarity matrix computed `block` rows at a time so memory stays O(block x N)."""
    unit = unit_rows(features)
    count = len(unit)
    k = min(neighbours, count - 1)
    indices = np.zeros((count, max(k, 0)), dtype=np.int64)
    similarities = np.zeros((count, max(k, 0)), dtype=np.float32)
    if k <= 0:
        return indices, similarities
    for start in range(0, count, block):
        rows = np.arange(start, min(start + block, count))
        block_similarities = unit[rows] @ unit.T
        block_similarities[np.arange(len(rows)), rows] = -np.inf
        top = np.argpartition(block_similarities, -k, axis=1)[:, -k:]  # the k largest, without a negated copy
        indices[rows] = top
        similarities[rows] = np.take_along_axis(block_similarities, top, axis=1)
    return indices, similarities


def symmetric_product(neighbours: np.ndarray, weights: np.ndarray, values: np.ndarray) -> np.ndarray:
    """(A + A^T) values for the sparse A whose row i holds weights[i] at columns neighbours[i]."""
    result = np.einsum("nk,nkc->nc", weights, values[neighbours])
    flat = neighbours.ravel()
    for column in range(values.shape[1]):
        result[:, column] += np.bincount(flat, (weights * values[:, column : column + 1]).ravel(), len(values))
    return result


def projected(features: np.ndarray, dimensions: int) -> np.ndarray:
    """The unit rows times a fixed (seeded) Gaussian matrix to `dimensions` columns (computed as the rows' product
    over their norms: no unit copy of the rows); the rows as they are where `dimensions` is 0 or not below their
    width."""
    if dimensions == 0 or dimensions >= features.shape[1]:
        return features
    matrix = np.random.default_rng(0).standard_normal((features.shape[1], dimensions), dtype=np.float32)
    rows = np.asarray(features, dtype=np.float32)
    norms = np.sqrt(np.einsum("ij,ij->i", rows, rows))[:, None]  # no squared copy of the rows
    return (rows @ matrix) / np.maximum(norms, np.float32(1e-12))


def knn_graph(labelled: np.ndarray, pool: np.ndarray, settings: Propagation) -> Graph:
    """The normalised kNN affinity of the labelled rows then the pool's (Iscen et al.): edge weights
    max(cos, 0)^power, W = A + A^T; each part projected before they are joined."""
    rows = np.concatenate([projected(labelled, settings.projection), projected(pool, settings.projection)])
    indices, similarities = nearest_neighbours(rows, settings.neighbours)
    weights = np.maximum(similarities, 0.0).astype(np.float64) ** settings.power
    degrees = symmetric_product(indices, weights, np.ones((len(indices), 1)))[:, 0]
    scale = np.where(degrees > 0, 1.0 / np.sqrt(np.where(degrees > 0, degrees, 1.0)), 0.0)
    return Graph(indices, weights, scale)


def diffused(graph: Graph, seeds: np.ndarray, alpha: float, iterations: int) -> np.ndarray:
    """Z solving (I - alpha W) Z = seeds column by column, by conjugate gradients (the matrix is symmetric positive
    definite for alpha < 1); a column of zeros stays zero."""
    solution = np.zeros_like(seeds)
    residual = seeds.copy()
    direction = residual.copy()
    squared = np.sum(residual * residual, axis=0)
    for _ in range(iterations):
        moved = direction - alpha * graph.product(direction)
        curvature = np.sum(direction * moved, axis=0)
        step = np.divide(squared, curvature, out=np.zeros_like(squared), where=curvature > 0)
        solution += step * direction
        residual -= step * moved
        following = np.sum(residual * residual, axis=0)
        ratio = np.divide(following, squared, out=np.zeros_like(squared), where=squared > 0)
        direction = residual + ratio * direction
        squared = following
    return solution


def class_seeds(labels: np.ndarray, rows: int, classes: int) -> np.ndarray:
    """Y (rows, classes): 1 / n_c at each of the first len(labels) rows in its label's column (each class spreads
    the same mass, whatever its label count), 0 elsewhere."""
    seeds = np.zeros((rows, classes))
    counts = np.bincount(labels, minlength=classes)
    seeds[np.arange(len(labels)), labels] = 1.0 / counts[labels]
    return seeds


def propagate(labelled: np.ndarray, labels: np.ndarray, pool: np.ndarray, settings: Propagation) -> np.ndarray:
    """Each pool row's most diffused class from the human-labelled rows over the kNN graph of both (Iscen et al.
    2019: per-class normalised seeds, conjugate gradients), -1 for a row no label's mass reaches; only a class
    among `labels` can be given (a class without a label has no mass)."""
    labels = np.asarray(labels, dtype=np.int64)
    held = np.unique(labels)
    graph = knn_graph(labelled, pool, settings)
    seeds = class_seeds(np.searchsorted(held, labels), len(labelled) + len(pool), len(held))
    mass = np.maximum(diffused(graph, seeds, settings.alpha, settings.iterations)[len(labelled) :], 0.0)
    return np.where(mass.sum(axis=1) > 0, held[np.argmax(mass, axis=1)], -1)


def held_posteriors(logits: np.ndarray, held: np.ndarray) -> np.ndarray:
    """(N, len(held)) the head's softmax over the held classes alone (the others masked), column j class held[j]."""
    shifted = logits[:, held] - logits[:, held].max(axis=1, keepdims=True)
    return np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)


def aligned(probabilities: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Distribution alignment (ReMixMatch, Berthelot et al. 2020): each row's posteriors times target_c over the
    mean posterior of class c over the rows, renormalised per row, so the rows' mean class shares move to `target`
    (normalised here; one step: exact where the rows are alike). A class of mean posterior 0 keeps 0."""
    shares = probabilities.mean(axis=0)
    ratio = np.divide(target / target.sum(), shares, out=np.zeros_like(shares), where=shares > 0)
    shifted = probabilities * ratio
    return shifted / np.maximum(shifted.sum(axis=1, keepdims=True), np.finfo(np.float64).tiny)


def alignment_target(
    labels: np.ndarray, classes: int, alignment: int, fleet_shares: np.ndarray | None = None
) -> np.ndarray | None:
    """The class shares (classes,) the head's pool posteriors are aligned to: None for NO_ALIGNMENT; for
    OWN_SHARES the device's human-label counts plus one per class it holds (0 for a class it holds none of); for
    FLEET_SHARES the fleet's label shares (the round announcement's), the device's own where those are unknown
    (empty, another length, negative, or 0 on a class the device holds a label of)."""
    if alignment == NO_ALIGNMENT:
        return None
    counts = np.bincount(np.asarray(labels, dtype=np.int64), minlength=classes).astype(np.float64)
    own = np.where(counts > 0, counts + 1.0, 0.0)
    fleet = np.zeros(0) if fleet_shares is None else np.asarray(fleet_shares, dtype=np.float64)
    usable = len(fleet) == classes and np.all(fleet >= 0) and np.all(fleet[counts > 0] > 0)
    chosen = fleet if alignment == FLEET_SHARES and usable else own
    return chosen / chosen.sum()


def pseudo_labels(
    labelled: np.ndarray,
    labels: np.ndarray,
    pool: np.ndarray,
    logits: np.ndarray,
    settings: Propagation,
    target: np.ndarray | None = None,
) -> PseudoLabels:
    """The pool rows where the round's head (its `logits` over the pool, restricted to the classes the device
    holds a human label of; its posteriors aligned to the class shares `target` first where given) and the
    propagation of the human labels (propagate) give the same class, each weighted by the head's probability of
    it; at most settings.most, in equal quotas per held class, the most confident first. A class the device holds
    no human label of is never given, and a device holding labels of one class alone gives none (nothing would
    tell its pool's rows apart)."""
    labels = np.asarray(labels, dtype=np.int64)
    held = np.unique(labels)
    if len(pool) == 0 or len(held) < 2 or settings.most == 0:
        return PseudoLabels(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0))
    probabilities = held_posteriors(np.asarray(logits, dtype=np.float64), held)
    if target is not None:
        probabilities = aligned(probabilities, target[held])
    predicted, confidence = held[np.argmax(probabilities, axis=1)], probabilities.max(axis=1)
    agreed = np.flatnonzero(propagate(labelled, labels, pool, settings) == predicted)
    kept = agreed[quota_rows(predicted[agreed], confidence[agreed], settings.most // len(held))]
    return PseudoLabels(kept, predicted[kept], confidence[kept])


def quota_rows(labels: np.ndarray, weights: np.ndarray, quota: int) -> np.ndarray:
    """Positions of at most `quota` rows of each label, the heaviest first, sorted."""
    order = np.lexsort((-weights, labels))
    ranks = np.arange(len(order)) - np.searchsorted(labels[order], labels[order])
    return np.sort(order[ranks < quota])


@dataclass(frozen=True)
class SemiSupervised:
    """A round's semi-supervised problem beside the labelled one: the device's pool rows (unlabelled), how they are
    pseudo-labelled, the pseudo-labels' weight in the loss, the logit adjustment's tau (0: plain CE) and the
    fleet's label shares of the round's announcement (empty: unknown), for settings.alignment FLEET_SHARES."""

    pool: np.ndarray
    settings: Propagation
    weight: float
    logit_adjustment: float
    fleet_shares: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def training_set(
        self, features: np.ndarray, labels: np.ndarray, pool: np.ndarray, logits: np.ndarray, classes: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """(rows, labels, row weights, logit bias): the labelled features at weight 1, then the pseudo-labelled rows
        of `pool` (the pool's features; `logits` the round's head's over them) at `weight` times their confidence;
        the logit bias tau ln n_c over the weighted class counts of both (-inf for a class the device holds no
        label of, as kept-labels masks it), None for tau 0."""
        target = alignment_target(labels, classes, self.settings.alignment, self.fleet_shares)
        pseudo = pseudo_labels(features, labels, pool, logits, self.settings, target)
        rows = np.concatenate([features, pool[pseudo.positions]])
        joined = np.concatenate([labels, pseudo.labels]).astype(np.int64)
        weights = np.concatenate([np.ones(len(labels)), self.weight * pseudo.weights])
        if self.logit_adjustment == 0.0:
            return rows, joined, weights, None
        counts = np.bincount(joined, weights, minlength=classes)
        return rows, joined, weights, class_prior_bias(counts, self.logit_adjustment)

    def trained(
        self,
        features: np.ndarray,
        labels: np.ndarray,
        pool: np.ndarray,
        head: tuple[np.ndarray, np.ndarray],
        settings: HeadSettings,
        logit_bias: np.ndarray | None,
    ) -> tuple[np.ndarray, np.ndarray, float, int]:
        """(weight, bias, last epoch's loss, pseudo-labels trained on): a teacher trained from the round's `head` on
        the labelled features (with `logit_bias`, as kept-labels trains), its predictions over `pool` (the pool's
        features) as the pseudo-labels' source (training_set), then the teacher trained on, on both (the round's SGD
        twice)."""
        weight, bias, _ = train_classifier(features, labels, *head, settings, logit_bias)
        logits = (pool @ weight.T).astype(np.float64) + bias  # float32 rows: no float64 copy of the pool
        rows, joined, weights, adjusted = self.training_set(features, labels, pool, logits, len(bias))
        return (
            *train_classifier(rows, joined, weight, bias, settings, adjusted, None, weights),
            len(rows) - len(labels),
        )
