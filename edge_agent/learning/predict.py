# What a serving model says about images: the class, its probability and the MC-dropout uncertainty (numpy, no torch).
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from edge_agent.data.oracle import Guess
from edge_agent.learning.bundle import Bundle


class ServingModel(Protocol):
    """The model a device predicts with ("serving", as opposed to the "latest" model it trains): its version (the
    round whose model serves, 0 for W0), its weights hash and its verified bundle."""

    @property
    def version(self) -> int:
        """The serving version."""
        ...

    @property
    def model_hash(self) -> str:
        """The serving model's weights hash."""
        ...

    @property
    def bundle(self) -> Bundle:
        """The serving model's verified ONNX bundle."""
        ...


@dataclass(frozen=True)
class Verdicts:
    """Per image: the predicted class (argmax of the mean over passes), its mean probability and the uncertainty
    (the predictive entropy of the mean, divided by log(classes): 0 certain, 1 uniform)."""

    classes: np.ndarray
    probabilities: np.ndarray
    uncertainties: np.ndarray


def verdicts(probabilities: np.ndarray) -> Verdicts:
    """The verdicts of MC-dropout outputs (passes, N, C)."""
    mean = probabilities.mean(axis=0, dtype=np.float64)
    classes = mean.argmax(axis=1) if mean.size else np.zeros(len(mean), dtype=np.int64)
    chosen = mean[np.arange(len(mean)), classes] if mean.size else np.zeros(len(mean))
    entropy = -(mean * np.log(np.clip(mean, 1e-12, 1.0))).sum(axis=1)
    scale = np.log(mean.shape[1]) if mean.ndim == 2 and mean.shape[1] > 1 else 1.0
    return Verdicts(classes.astype(np.int64), np.clip(chosen, 0.0, 1.0), np.clip(entropy / scale, 0.0, 1.0))


def guesses_of(probabilities: np.ndarray, scores: np.ndarray | None) -> list[Guess]:
    """The model's guess of each sample asked (its verdict) from MC-dropout outputs (passes, N, C), with the
    sampler's score where it scores each sample, else the uncertainty in its place."""
    seen = verdicts(probabilities)
    worth = seen.uncertainties if scores is None else scores
    return [
        Guess(int(label), float(probability), float(uncertainty), float(score))
        for label, probability, uncertainty, score in zip(
            seen.classes, seen.probabilities, seen.uncertainties, worth, strict=True
        )
    ]
