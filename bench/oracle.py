# The bench's simulated oracle: it knows every shard sample's true label and answers every query at once.
from __future__ import annotations

import numpy as np

from edge_agent.data.oracle import Oracle


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
