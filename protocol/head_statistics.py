# The head's statistics: the sums a device sends in place of a trained classifier when the fleet fits its head.
"""A linear head on a frozen backbone is fitted from sums over labelled rows: per class, how many and their feature
sum; over all of them, the second moment; and, for the temperature, the negative log-likelihood of the device's new
labels under the round's head at a grid of temperatures. Sums add up across devices, so the fleet's sum is what the
pooled labels would give however the labels are spread, and secure aggregation and device DP sum them as they sum
weights. Each statistic is the device's sum divided by its label count n (the round aggregator's FedAvg weighs it
by n back into the fleet's sum over its total), with features divided by SCALE first, so every entry lies in [0, 1]
for features in [0, SCALE] (the Lite backbones' ReLU6): within secure aggregation's default clip of 1.

Where the fleet asks for it (the class-statistics rule's `pool_statistics`), a device adds its unlabelled pool's
posterior sums under the round's head, each over its pool's rows (sums: no label and no row is sent as such; the
privacy guide says what a crafted head reads from them); the fleet's weighted mean of them refines the class means
in rounds without new labels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protocol.tensors import Weights

SCALE = 6.0  # features are divided by this before they are summed (the ReLU6 bound of the Lite backbones' features)
CLASS_SUMS = "statistics.class_sums"  # (C, D): per class, the sum of its labelled rows' scaled features, over n
CLASS_COUNTS = "statistics.class_counts"  # (C,): per class, its labels, over n
SECOND_MOMENT = "statistics.second_moment"  # (D (D + 1) / 2,): the upper triangle of sum x x^T (scaled), over n
CALIBRATION = (
    "statistics.calibration"  # (K + 1,): NLL of the new labels at each of TEMPERATURES, and their count, over n
)
POOL_SUMS = (
    "statistics.pool_sums"  # (C, D): per class, the round head's posterior-weighted sum of the pool's scaled rows
)
POOL_MASS = "statistics.pool_mass"  # (C,): per class, the round head's posterior mass over the pool; both over its rows
TEMPERATURES = np.geomspace(0.1, 1000.0, 41)  # the grid the temperature is chosen on (x 1.26 a step)
NAMES = (CLASS_SUMS, CLASS_COUNTS, SECOND_MOMENT, CALIBRATION, POOL_SUMS, POOL_MASS)


def triangle_size(features: int) -> int:
    """Entries of a symmetric (features x features) matrix's upper triangle, diagonal included."""
    return features * (features + 1) // 2


def upper(features: int) -> np.ndarray:
    """The boolean mask of a (features x features) matrix's upper triangle (1.6 MB at 1280 features, where the
    index arrays of np.triu_indices would take 13 MB of a 512 MB device's memory)."""
    return np.triu(np.ones((features, features), dtype=bool))


def packed(matrix: np.ndarray) -> np.ndarray:
    """The upper triangle of a symmetric matrix, row by row, as one vector."""
    return matrix[upper(len(matrix))]


def unpacked(vector: np.ndarray, features: int) -> np.ndarray:
    """The symmetric (features x features) matrix whose upper triangle `vector` holds (packed's inverse)."""
    matrix = np.zeros((features, features), dtype=np.float64)
    matrix[upper(features)] = vector
    return matrix + np.triu(matrix, 1).T


def packed_trace(vector: np.ndarray, features: int) -> float:
    """The trace of the symmetric matrix `vector` packs (the first entry of each packed row is its diagonal's)."""
    rows = np.arange(features)
    return float(np.sum(np.asarray(vector, np.float64)[rows * features - rows * (rows - 1) // 2]))


def layout(classes: int, features: int) -> Weights:
    """Zeros of every statistic, in float32 as updates carry them: what a statistics round's update must look like."""
    return {
        CLASS_SUMS: np.zeros((classes, features), np.float32),
        CLASS_COUNTS: np.zeros(classes, np.float32),
        SECOND_MOMENT: np.zeros(triangle_size(features), np.float32),
        CALIBRATION: np.zeros(len(TEMPERATURES) + 1, np.float32),
        POOL_SUMS: np.zeros((classes, features), np.float32),
        POOL_MASS: np.zeros(classes, np.float32),
    }


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax, stable for large logits."""
    shifted = logits - np.max(logits, axis=1, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=1, keepdims=True))


def calibration_sums(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Per temperature of TEMPERATURES, the summed negative log-likelihood of `labels` under logits / T, then the
    label count: what chooses the temperature of a head fitted from statistics (new labels are held out from the
    head that chose them)."""
    rows = np.arange(len(labels))
    losses = [-float(np.sum(log_softmax(logits / t)[rows, labels])) for t in TEMPERATURES]
    return np.array([*losses, float(len(labels))], dtype=np.float64)


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax, stable for large logits."""
    return np.exp(log_softmax(logits))


def pool_posterior_sums(features: np.ndarray, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The unlabelled pool's rows under the round's head: per class, the posterior-weighted sum of the scaled rows,
    and the posterior mass, each divided by the pool's rows (so every entry lies in [0, 1]); what refines the class
    means in a round without new labels (one EM step of the shared-covariance Gaussian mixture the LDA head is).
    Zeros for an empty pool."""
    classes = logits.shape[1]
    if len(features) == 0:
        return np.zeros((classes, features.shape[1])), np.zeros(classes)
    posteriors = softmax(np.asarray(logits, np.float64))
    weighted = posteriors.T.astype(np.float32) @ np.asarray(features, np.float32)  # no scaled or float64 copy
    return weighted.astype(np.float64) / (SCALE * len(features)), posteriors.sum(axis=0) / len(features)


@dataclass(frozen=True)
class HeadStatistics:
    """One device's (or the fleet's mean) statistics: class sums (C, D), class counts (C,), the second moment (D, D;
    float32 on a device, float64 once summed) and the calibration sums (K + 1,), each a sum over n labelled rows
    divided by n; and the pool's posterior sums (C, D) and mass (C,) under the round's head, each over the pool's
    rows (zeros unless the fleet asks for them: pool_posterior_sums)."""

    class_sums: np.ndarray
    class_counts: np.ndarray
    second_moment: np.ndarray
    calibration: np.ndarray
    pool_sums: np.ndarray
    pool_mass: np.ndarray

    @classmethod
    def of_labels(
        cls,
        features: np.ndarray,
        labels: np.ndarray,
        classes: int,
        calibration: np.ndarray | None = None,
        pool: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> HeadStatistics:
        """The statistics of labelled rows (features unscaled, as the backbone gives them), with the calibration
        sums of the new labels (none: zeros) and the pool's posterior sums (pool_posterior_sums; none: zeros).
        ValueError for no rows: there is nothing to divide by."""
        if len(labels) == 0:
            raise ValueError("head statistics need at least one labelled row")
        rows = np.asarray(features, np.float32) / np.float32(SCALE)  # float32: the second moment in 6.5 MB, not 13
        n = float(len(labels))
        sums = np.zeros((classes, rows.shape[1]), np.float64)
        np.add.at(sums, np.asarray(labels, np.int64), rows)
        counts = np.bincount(np.asarray(labels, np.int64), minlength=classes).astype(np.float64)
        extra = np.zeros(len(TEMPERATURES) + 1) if calibration is None else np.asarray(calibration, np.float64)
        moment = rows.T @ rows
        moment /= np.float32(n)
        pool_sums, pool_mass = pool if pool is not None else (np.zeros_like(sums), np.zeros(classes))
        return cls(sums / n, counts / n, moment, extra / n, pool_sums, pool_mass)

    @classmethod
    def of_tensors(cls, tensors: Weights) -> HeadStatistics:
        """The statistics an update (or a round's mean of updates) carries."""
        sums = np.asarray(tensors[CLASS_SUMS], np.float64)
        moment = unpacked(np.asarray(tensors[SECOND_MOMENT], np.float64), sums.shape[1])
        counts, calibration, pool_sums, pool_mass = (
            np.asarray(tensors[name], np.float64) for name in (CLASS_COUNTS, CALIBRATION, POOL_SUMS, POOL_MASS)
        )
        return cls(sums, counts, moment, calibration, pool_sums, pool_mass)

    def tensors(self) -> Weights:
        """As an update carries them (float32, the second moment packed)."""
        return {
            CLASS_SUMS: self.class_sums.astype(np.float32),
            CLASS_COUNTS: self.class_counts.astype(np.float32),
            SECOND_MOMENT: packed(self.second_moment).astype(np.float32),
            CALIBRATION: self.calibration.astype(np.float32),
            POOL_SUMS: self.pool_sums.astype(np.float32),
            POOL_MASS: self.pool_mass.astype(np.float32),
        }
