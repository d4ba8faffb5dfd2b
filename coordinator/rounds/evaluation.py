# Server-side evaluation: plain test accuracy, BNN (MC-dropout) accuracy for OptFL/MixFL selection, per class; each
# round's model on the server's test set and the field set, and the paired tables the promotion gate reads.
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from torch import nn

from coordinator.rounds.promotion import GateEvidence, paired_table
from edge_agent.data.image_arrays import model_input
from edge_agent.learning.mc_dropout import TorchMCDropout, predict_probabilities
from edge_agent.learning.models import build_model, set_weights
from protocol.model_spec import ModelSpec
from protocol.tensors import Weights

KEPT_VERSIONS = 4  # how many versions' predictions an evaluator keeps (the serving one and the latest rounds)
# The field set as it stands: each image's key, the images (uint8 at the spec's size) and their labels.
FieldSource = Callable[[], tuple[Sequence[str], np.ndarray, np.ndarray]]


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


def class_accuracies(predicted: np.ndarray, labels: np.ndarray, num_classes: int) -> list[float | None]:
    """Accuracy on each class's test images from the predicted classes (None for a class with none), for the
    per-class view (Figure 11)."""
    correct = predicted == labels
    return [float(np.mean(correct[labels == c])) if np.any(labels == c) else None for c in range(num_classes)]


@dataclass(frozen=True)
class TestScores:
    """A model's accuracy on a test set, overall and per class, and the set's size (NaN accuracy: no images)."""

    accuracy: float
    per_class: list[float | None] = field(default_factory=list)
    images: int = 0


def scores_of(predicted: np.ndarray, labels: np.ndarray, num_classes: int) -> TestScores:
    """A model's scores from its predicted classes on labelled images."""
    accuracy = float(np.mean(predicted == labels)) if len(labels) else float("nan")
    return TestScores(accuracy, class_accuracies(predicted, labels, num_classes), len(labels))


@dataclass(frozen=True)
class RoundScores:
    """A round's model on the server's test set and on the field set (no images: no field set yet)."""

    test: TestScores
    field: TestScores


@dataclass
class Predicted:
    """One version's predicted classes: on the server's test set (None: not yet) and on each field image by key."""

    test: np.ndarray | None = None
    by_key: dict[str, int] = field(default_factory=dict)


class Evaluator:
    """Evaluates weight sets on the test split (dropout off) and on the selection split (BNN, r passes); with a
    `field` source, each round's model on the field set too. The predicted classes of the latest KEPT_VERSIONS
    versions are kept (by version: a committed version's weights never change), so the gate pairs a candidate with
    the serving model without scoring either again."""

    def __init__(
        self,
        spec: ModelSpec,
        test: LabelledSplit,
        selection: LabelledSplit,
        passes: int,
        seed: int,
        field: FieldSource | None = None,
    ) -> None:
        self.model: nn.Module = build_model(spec)
        self.num_classes = spec.num_classes
        self.test = test
        self.selection = selection
        self.passes = passes
        self.seed = seed
        self.field = field
        self.predicted: dict[int, Predicted] = {}

    def test_scores(self, weights: Weights) -> TestScores:
        """Accuracy of the deterministic model on the whole test split, overall and per class (one pass)."""
        return scores_of(self.classes(weights, self.test.images), self.test.labels, self.num_classes)

    def classes(self, weights: Weights, images: np.ndarray) -> np.ndarray:
        """The deterministic model's predicted class of each model input."""
        set_weights(self.model, weights)
        return predict_probabilities(self.model, images).argmax(axis=-1)

    def round_scores(self, version: int, weights: Weights) -> RoundScores:
        """A committed version's scores on the server's test set and the field set as it stands."""
        keys, images, labels = self.field_set()
        test, field_classes = self.predictions(version, lambda: weights, keys, images)
        return RoundScores(
            scores_of(test, self.test.labels, self.num_classes), scores_of(field_classes, labels, self.num_classes)
        )

    def evidence(self, candidate: int, serving: int, load: Callable[[int], Weights]) -> GateEvidence:
        """The paired tables of two versions (their weights `load`ed only when their predictions are not kept) on
        the server's test set and on the field set as it stands."""
        keys, images, labels = self.field_set()
        new_test, new_field = self.predictions(candidate, lambda: load(candidate), keys, images)
        old_test, old_field = self.predictions(serving, lambda: load(serving), keys, images)
        return GateEvidence(
            paired_table(self.test.labels, old_test, new_test, self.num_classes),
            paired_table(labels, old_field, new_field, self.num_classes),
        )

    def field_set(self) -> tuple[Sequence[str], np.ndarray, np.ndarray]:
        """The field set as it stands (keys, model inputs, labels); empty without a field source."""
        if self.field is None:
            return [], self.test.images[:0], self.test.labels[:0]
        keys, images, labels = self.field()
        inputs = model_input(images) if len(keys) else self.test.images[:0]
        return keys, inputs, np.asarray(labels, dtype=np.int64)

    def predictions(
        self, version: int, weights: Callable[[], Weights], keys: Sequence[str], images: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """A version's predicted classes on the server's test set and on these field images, from what is kept
        (its weights fetched only when something is missing); the oldest versions beyond KEPT_VERSIONS are let go."""
        kept = self.predicted.pop(version, None) or Predicted()
        self.predicted[version] = kept
        missing = [index for index, key in enumerate(keys) if key not in kept.by_key]
        test = kept.test
        if test is None or missing:
            held = weights()
            if test is None:
                test = kept.test = self.classes(held, self.test.images)
            if missing:
                found = self.classes(held, images[missing])
                kept.by_key.update((keys[index], int(label)) for index, label in zip(missing, found, strict=True))
        kept.by_key = {key: kept.by_key[key] for key in keys}
        while len(self.predicted) > KEPT_VERSIONS:
            del self.predicted[next(iter(self.predicted))]
        return test, np.array([kept.by_key[key] for key in keys], dtype=np.int64)

    def selection_accuracy(self, weights: Weights) -> float:
        """Accuracy of BNN predictions (mean softmax of MC-dropout passes) on the selection split."""
        set_weights(self.model, weights)
        probabilities = TorchMCDropout(self.model).probabilities(self.selection.images, self.passes, self.seed)
        return accuracy_of(probabilities.mean(axis=0), self.selection.labels)
