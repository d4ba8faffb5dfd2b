# Where labels come from: the Oracle interface (a person at a field device, or the bench's simulated oracle).
from __future__ import annotations

import threading
from abc import ABC, abstractmethod

import numpy as np


class Oracle(ABC):
    """Answers label queries; an answer may be missing (a person has not labelled it yet)."""

    name: str

    @abstractmethod
    def label(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(answered indices, their labels) for the queried pool indices."""

    def start_round(self, round_id: int) -> None:
        """Told when a round starts, so queries can be grouped by round; nothing to do for an immediate oracle."""
        return None

    def stop_with(self, event: threading.Event) -> None:
        """Told the event that stops its agent, so a wait for answers ends with it; an immediate oracle never waits."""
        return None

    def pending(self) -> np.ndarray:
        """Pool indices asked but not answered yet (they must not be asked again); none for an immediate oracle."""
        return np.zeros(0, dtype=np.int64)

    def class_names(self) -> tuple[str, ...] | None:
        """The class names a person answers with, which the model spec must list in the same order (None: the
        oracle answers with class numbers, as the bench's does)."""
        return None
