# Server-side evaluation: plain test accuracy, BNN (MC-dropout) accuracy for OptFL/MixFL selection, per class.
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from torch import nn

from edge_agent.data.image_arrays import model_input
from edge_agent.learning.mc_dropout import TorchMCDropout, predict_probabilities
from edge_agent.learning.models import build_model, set_weights
from protocol.model_spec import ModelSpec
from protocol.tensors import Weights


@dataclass(frozen=True)
class LabelledSplit:
    """Model inputs (pixels scaled to [0, 1]) and their labels: the test split or the server's selection (validation) split."""

    images: np.ndarray
    labels: np.ndarray

    @classmethod
    def from_uint8(cls, images: np.ndarray, labels: np.ndarray) -> LabelledSplit:
        """Scales raw uint8 images once, so repeated evaluations do not redo it."""
        return cls(model_input(images), np.asarray(labels, dtype=np.int64))


def accuracy_of(predictions: np.ndarray, labels: np.ndarray) -> float:
    """Fraction of argmax predictions equal to the labels."""
    return float(np.mean(predictions.argmax(axis=-1) == labels)) if len(labels) else float("nan")


def class_accuracies(predictions: np.ndarray, labels: np.ndarray, num_classes: int) -> list[float | None]:
    """Accuracy on each class's test images (None for a class with none), for the per-class view (Figure 11)."""
    correct = predictions.argmax(axis=-1) == labels
    return [float(np.mean(correct[labels == c])) if np.any(labels == c) else None for c in range(num_classes)]


@dataclass(frozen=True)
class TestScores:
    """A model's accuracy on the test split, overall and per class."""

    accuracy: float
    per_class: list[float | None] = field(default_factory=list)


class Evaluator:
    """Evaluates weight sets on the test split (dropout off) and on the selection split (BNN, r passes)."""

    def __init__(self, spec: ModelSpec, test: LabelledSplit, selection: LabelledSplit, passes: int, seed: int) -> None:
        self.model: nn.Module = build_model(spec)
        self.test = test
        self.selection = selection
        self.passes = passes
        self.seed = seed

    def test_scores(self, weights: Weights) -> TestScores:
        """Accuracy of the deterministic model on the whole test split, overall and per class (one pass)."""
        set_weights(self.model, weights)
        predictions = predict_probabilities(self.model, self.test.images)
        return TestScores(
            accuracy_of(predictions, self.test.labels),
            class_accuracies(predictions, self.test.labels, predictions.shape[-1]),
        )

    def selection_accuracy(self, weights: Weights) -> float:
        """Accuracy of BNN predictions (mean softmax of MC-dropout passes) on the selection split."""
        set_weights(self.model, weights)
        probabilities = TorchMCDropout(self.model).probabilities(self.selection.images, self.passes, self.seed)
        return accuracy_of(probabilities.mean(axis=0), self.selection.labels)
