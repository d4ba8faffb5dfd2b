# Where labels come from: the Oracle interface (a person at a field device, or the bench's simulated oracle).
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

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

    def notify_wait(self, waiting: Callable[[bool], None]) -> None:
        """Told whom to call when a wait for a person's answers starts (True) and ends (False), so the device's
        status can say it waits for answers; an immediate oracle never waits."""
        return None

    def pending(self) -> np.ndarray:
        """Pool indices asked but not answered yet (they must not be asked again); none for an immediate oracle."""
        return np.zeros(0, dtype=np.int64)

    def class_names(self) -> tuple[str, ...] | None:
        """The class names a person answers with, which the model spec must list in the same order (None: the
        oracle answers with class numbers, as the bench's does)."""
        return None

    def wants_guesses(self) -> bool:
        """Whether the queries it is asked go to people with the model's guess (the central labelling queue)."""
        return False

    def note_guesses(self, indices: np.ndarray, guesses: list[Guess]) -> None:
        """Told the model's guess of each sample about to be asked (only when `wants_guesses`)."""
        return None


@dataclass(frozen=True)
class Guess:
    """The model's view of one queried image when it was asked: its class, that class's mean probability over the
    MC-dropout passes, the uncertainty (the mean's entropy over log(classes), in [0, 1]) and the sampler's score."""

    label: int
    probability: float
    uncertainty: float
    score: float
