# Acquisition scores in pure numpy: MC-dropout heuristics (entropy, BALD, margin, least confidence), KSAS, FAST's
# prototype entropy and kNN weak labels, and top-k selection.
from __future__ import annotations

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
