# Batch-aware selections in pure numpy: stochastic power sampling, BADGE's k-means++, core-set's greedy k-center,
# class-balanced top-k and quotas that level label counts, TypiClust's k-means and typicality.
from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from edge_agent.learning.acquisition_scores import top_k


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


def nearest_squared_distances(rows: np.ndarray, centres: np.ndarray, block: int = 256) -> np.ndarray:
    """Each row's squared Euclidean distance to its nearest centre (inf for every row when there is no centre),
    |x|^2 + |c|^2 - 2 x.c over blocks of centres, so memory stays rows x block."""
    rows = np.asarray(rows, dtype=np.float64)
    nearest = np.full(len(rows), np.inf)
    if len(centres) == 0:
        return nearest
    centres = np.asarray(centres, dtype=np.float64)
    if rows.ndim != 2 or centres.ndim != 2 or rows.shape[1] != centres.shape[1]:
        raise ValueError(f"need (N, d) rows and (M, d) centres of one width, got {rows.shape} and {centres.shape}")
    lengths = np.sum(rows**2, axis=1)
    for start in range(0, len(centres), block):
        part = centres[start : start + block]
        squared = lengths[:, None] + np.sum(part**2, axis=1) - 2.0 * rows @ part.T
        nearest = np.minimum(nearest, np.maximum(squared, 0.0).min(axis=1))
    return nearest


def k_center_greedy(pool: np.ndarray, centres: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """Sener and Savarese's core-set batch: k distinct pool rows picked one at a time, each the row farthest from
    its nearest centre, a pick joining the centres; with no centre the first pick is uniform."""
    pool = np.asarray(pool, dtype=np.float64)
    if pool.ndim != 2:
        raise ValueError(f"the core-set needs (N, d) pool features, got shape {pool.shape}")
    nearest = nearest_squared_distances(pool, centres)
    picked: list[int] = []
    while len(picked) < min(k, len(pool)):
        choice = int(rng.integers(len(pool))) if not picked and np.isinf(nearest).all() else int(np.argmax(nearest))
        picked.append(choice)
        nearest = np.minimum(nearest, nearest_squared_distances(pool, pool[choice : choice + 1]))
        nearest[picked] = -1.0
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


def principal_rows(rows: np.ndarray, others: np.ndarray, dims: int, rng: np.random.Generator) -> list[np.ndarray]:
    """`rows` and `others` (same width; `others` may be empty) centred on rows' mean and projected on rows' top
    `dims` principal directions, found by a randomised range finder (Halko et al. 2011: one product with a Gaussian
    test matrix, an SVD of the (dims + 8)-row matrix its basis gives), so k-means runs in few dimensions without a
    (D, D) covariance; float32, and no centred copy of the (N, D) rows is made."""
    rows = np.asarray(rows, dtype=np.float32)
    if rows.ndim != 2 or len(rows) == 0:
        raise ValueError(f"need a non-empty (N, d) array of pool features, got shape {rows.shape}")
    mean = rows.mean(axis=0, dtype=np.float64).astype(np.float32)
    width = min(dims + 8, rows.shape[1], len(rows))
    test = rng.standard_normal((rows.shape[1], width)).astype(np.float32)
    basis, _ = np.linalg.qr(rows @ test - mean @ test)
    small = basis.T @ rows - np.outer(basis.sum(axis=0), mean)
    _, _, directions = np.linalg.svd(small, full_matrices=False)
    directions = directions[: min(dims, len(directions))]
    projected = [rows @ directions.T - mean @ directions.T]
    if len(others):
        others = np.asarray(others, dtype=np.float32)
        projected.append(others @ directions.T - mean @ directions.T)
    else:
        projected.append(np.zeros((0, len(directions)), dtype=np.float32))
    return projected


def kmeans(rows: np.ndarray, k: int, rng: np.random.Generator, iterations: int = 20) -> np.ndarray:
    """Each row's cluster (0..k-1, k clipped to the rows) after k-means++ seeding and at most `iterations` Lloyd
    steps (stopping when no row moves); a cluster that empties keeps its centre."""
    rows = np.asarray(rows, dtype=np.float64)
    k = min(k, len(rows))
    if k < 1:
        return np.zeros(len(rows), dtype=np.int64)
    centres = rows[[int(rng.integers(len(rows)))]]
    nearest = nearest_squared_distances(rows, centres)
    while len(centres) < k:
        total = nearest.sum()
        pick = int(rng.choice(len(rows), p=nearest / total)) if total > 0 else int(rng.integers(len(rows)))
        centres = np.vstack([centres, rows[pick]])
        nearest = np.minimum(nearest, nearest_squared_distances(rows, rows[pick : pick + 1]))
    assignment = np.full(len(rows), -1, dtype=np.int64)
    for _ in range(iterations):
        squared = np.sum(rows**2, axis=1)[:, None] + np.sum(centres**2, axis=1) - 2.0 * rows @ centres.T
        moved = np.argmin(squared, axis=1)
        if np.array_equal(moved, assignment):
            break
        assignment = moved
        sizes = np.bincount(assignment, minlength=k)
        sums = np.stack([np.bincount(assignment, weights=column, minlength=k) for column in rows.T], axis=1)
        centres = np.where(sizes[:, None] > 0, sums / np.maximum(sizes, 1)[:, None], centres)
    return assignment


def typicality(rows: np.ndarray, neighbours: int, block: int = 256) -> np.ndarray:
    """TypiClust's typicality of each row among `rows`: minus the mean Euclidean distance to its `neighbours`
    nearest other rows (clipped to the rows there are; 0 for a lone row), so the densest point scores highest.
    Distances in blocks of rows, so memory stays block x N."""
    rows = np.asarray(rows, dtype=np.float64)
    count = min(neighbours, len(rows) - 1)
    if count < 1:
        return np.zeros(len(rows))
    lengths = np.sum(rows**2, axis=1)
    scores = np.empty(len(rows))
    for start in range(0, len(rows), block):
        part = rows[start : start + block]
        squared = np.maximum(lengths[start : start + block, None] + lengths - 2.0 * part @ rows.T, 0.0)
        squared[np.arange(len(part)), np.arange(start, start + len(part))] = np.inf
        closest = np.partition(squared, count - 1, axis=1)[:, :count]
        scores[start : start + block] = -np.sqrt(closest).mean(axis=1)
    return scores


def typical_picks(
    clusters: np.ndarray, covered: np.ndarray, scores_of: Callable[[np.ndarray], np.ndarray], k: int
) -> np.ndarray:
    """TypiClust's batch (Hacohen et al., ICML 2022): the most typical row of each of the largest clusters that no
    label covers yet; once every cluster holds a label or a pick, again round the clusters, fewest labels and
    picks first, then largest. `clusters` is each pool row's cluster, `covered` the labels (human and picked) per
    cluster, `scores_of(members)` the typicality of a cluster's rows (asked once per cluster picked from)."""
    clusters = np.asarray(clusters, dtype=np.int64)
    held = np.asarray(covered, dtype=np.int64).copy()
    sizes = np.bincount(clusters, minlength=len(held))
    queues: dict[int, np.ndarray | None] = {int(c): None for c in np.unique(clusters)}
    picked: list[int] = []
    while len(picked) < min(k, len(clusters)):
        cluster = min(queues, key=lambda c: (held[c], -sizes[c], c))
        queue = queues[cluster]
        if queue is None:
            rows = np.flatnonzero(clusters == cluster)
            queue = rows[top_k(scores_of(rows), len(rows))]
        picked.append(int(queue[0]))
        held[cluster] += 1
        queues[cluster] = queue[1:]
        if len(queue) == 1:
            del queues[cluster]
    return np.asarray(picked, dtype=np.int64)


def level_quotas(counts: np.ndarray, budget: int, caps: np.ndarray | None = None) -> np.ndarray:
    """How many of a batch of `budget` each class gets so that the label counts after it are as level as they can
    be (water-filling: each label in turn to the class with the fewest, the lower index on a tie); a class counted
    inf gets none, a class gets at most its cap (when `caps` are given), and the quotas sum to less than the budget
    only where no class can take more."""
    counts = np.asarray(counts, dtype=np.float64)
    room = np.full(len(counts), np.inf) if caps is None else np.asarray(caps, dtype=np.float64)
    quotas = np.zeros(len(counts), dtype=np.int64)
    for _ in range(max(budget, 0)):
        level = np.where(quotas < room, counts + quotas, np.inf)
        if not np.isfinite(level).any():
            break
        quotas[int(np.argmin(level))] += 1
    return quotas


def quota_picks(scores: np.ndarray, mean_probs: np.ndarray, quotas: np.ndarray) -> np.ndarray:
    """Each class's quota of samples, the largest quota first: the samples predicted (argmax of `mean_probs`) as
    the class with the highest scores, then, where too few are left, those with the highest probability of it; no
    sample twice, and fewer than asked only where the pool runs out."""
    scores, mean_probs = np.asarray(scores, dtype=np.float64), np.asarray(mean_probs, dtype=np.float64)
    if mean_probs.ndim != 2 or len(mean_probs) != len(scores) or len(quotas) != mean_probs.shape[1]:
        raise ValueError(f"need (N, C) probabilities, N scores and C quotas; got {mean_probs.shape}, {scores.shape}")
    predicted, order = np.argmax(mean_probs, axis=1), top_k(scores, len(scores))

    def ranked(c: int) -> Iterator[np.ndarray]:
        """Class c's candidates, best first: the predicted ones by score, then (ranked only when needed) all by
        probability of c."""
        yield order[predicted[order] == c]
        yield top_k(mean_probs[:, c], len(scores))

    free = np.ones(len(scores), dtype=bool)
    picked: list[np.ndarray] = []
    for c in np.argsort(-np.asarray(quotas), kind="stable"):
        want = int(quotas[c])
        for candidates in ranked(int(c)) if want else ():
            take = candidates[free[candidates]][:want]
            free[take], want = False, want - len(take)
            picked.append(take)
            if not want:
                break
    return np.concatenate([np.zeros(0, np.int64), *picked]).astype(np.int64)
