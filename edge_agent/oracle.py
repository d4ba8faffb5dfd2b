# Where labels come from: the bench's simulated oracle reveals ground truth it was given with the shard.
from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np


class Oracle(ABC):
    """Answers label queries; an answer may be missing (a person has not labelled it yet)."""

    name: str

    @abstractmethod
    def label(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(answered indices, their labels) for the queried pool indices."""


class SimulatedOracle(Oracle):
    """Bench oracle: knows every sample's true label and answers every query at once."""

    name = "simulated"

    def __init__(self, ground_truth: np.ndarray) -> None:
        self.ground_truth = np.asarray(ground_truth)

    def label(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every queried index with its true label."""
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and (indices.min() < 0 or indices.max() >= len(self.ground_truth)):
            raise IndexError(f"oracle query outside the pool of {len(self.ground_truth)} samples")
        return indices, self.ground_truth[indices].astype(np.int64)
