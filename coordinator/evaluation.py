# Server-side evaluation: plain test accuracy, BNN (MC-dropout) accuracy for OptFL/MixFL selection, per class.
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from torch import nn

from edge_agent.data import normalise
from edge_agent.mc_dropout import TorchMCDropout, predict_probabilities
from edge_agent.models import Weights, build_model, set_weights


@dataclass(frozen=True)
class LabelledSplit:
    """Normalised images and their labels: the test split or the server's selection (validation) split."""

    images: np.ndarray
    labels: np.ndarray

    @classmethod
    def from_uint8(cls, images: np.ndarray, labels: np.ndarray) -> "LabelledSplit":
        """Normalises raw uint8 images once, so repeated evaluations do not redo it."""
        return cls(normalise(images), np.asarray(labels, dtype=np.int64))


def accuracy_of(predictions: np.ndarray, labels: np.ndarray) -> float:
    """Fraction of argmax predictions equal to the labels."""
    return float(np.mean(predictions.argmax(axis=-1) == labels)) if len(labels) else float("nan")


class Evaluator:
    """Evaluates weight sets on the test split (dropout off) and on the selection split (BNN, r passes)."""

    def __init__(self, model_name: str, test: LabelledSplit, selection: LabelledSplit, passes: int, seed: int) -> None:
        self.model: nn.Module = build_model(model_name)
        self.test = test
        self.selection = selection
        self.passes = passes
        self.seed = seed

    def test_accuracy(self, weights: Weights) -> float:
        """Accuracy of the deterministic model on the whole test split."""
        set_weights(self.model, weights)
        return accuracy_of(predict_probabilities(self.model, self.test.images), self.test.labels)

    def selection_accuracy(self, weights: Weights) -> float:
        """Accuracy of BNN predictions (mean softmax of MC-dropout passes) on the selection split."""
        set_weights(self.model, weights)
        probabilities = TorchMCDropout(self.model).probabilities(self.selection.images, self.passes, self.seed)
        return accuracy_of(probabilities.mean(axis=0), self.selection.labels)
