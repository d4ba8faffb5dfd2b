# Aggregation strategies behind one interface (AveFL, FedAvg, OptFL, MixFL) and the averaging math they share.
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Sequence

import numpy as np

from edge_agent.models import Weights

Evaluate = Callable[[Weights], float]


@dataclass(frozen=True)
class ClientUpdate:
    """One device's model for a round, with its labelled-sample count and the local metrics it reported."""

    device_id: str
    weights: Weights
    num_samples: int
    metrics: Mapping[str, float] = field(default_factory=dict)


def _check_same_layout(weight_sets: Sequence[Weights]) -> None:
    """Raises ValueError unless every weight set has the first one's tensor names, shapes and dtypes."""
    reference = weight_sets[0]
    for index, weights in enumerate(weight_sets[1:], start=1):
        if set(weights) != set(reference):
            missing = sorted(set(reference) - set(weights))
            extra = sorted(set(weights) - set(reference))
            raise ValueError(f"weight set {index} differs in tensor names: missing {missing}, unexpected {extra}")
        for name, array in reference.items():
            other = weights[name]
            if other.shape != array.shape or other.dtype != array.dtype:
                raise ValueError(
                    f"tensor {name!r} of weight set {index} is {other.dtype}{list(other.shape)}, "
                    f"expected {array.dtype}{list(array.shape)}"
                )


def _normalised(coefficients: Sequence[float]) -> np.ndarray:
    """The coefficients scaled to sum 1; they must be finite, non-negative and have a positive sum."""
    values = np.asarray(coefficients, dtype=np.float64)
    if values.ndim != 1 or not np.all(np.isfinite(values)) or np.any(values < 0.0):
        raise ValueError(f"coefficients must be a flat list of finite non-negative numbers, got {coefficients!r}")
    total = values.sum()
    if total <= 0.0:
        raise ValueError(f"coefficients must have a positive sum, got {coefficients!r}")
    return values / total


def weighted_average(weight_sets: Sequence[Weights], coefficients: Sequence[float]) -> Weights:
    """sum_i a_i W_i per tensor with the a_i renormalised to sum 1 (Eq. 1-2), in float64, cast back to the input dtype."""
    if not weight_sets:
        raise ValueError("weighted_average needs at least one weight set")
    if len(coefficients) != len(weight_sets):
        raise ValueError(f"got {len(coefficients)} coefficients for {len(weight_sets)} weight sets")
    _check_same_layout(weight_sets)
    normalised = _normalised(coefficients)
    return {
        name: _combine([weights[name] for weights in weight_sets], normalised)
        for name in weight_sets[0]
    }


def _combine(arrays: Sequence[np.ndarray], coefficients: np.ndarray) -> np.ndarray:
    """sum_i a_i x_i accumulated in float64 and returned in the dtype of the arrays."""
    total = np.zeros(arrays[0].shape, dtype=np.float64)
    for a, array in zip(coefficients, arrays):
        total += a * array.astype(np.float64)
    return total.astype(arrays[0].dtype)


def uniform_coefficients(n: int) -> np.ndarray:
    """a_i = 1/n for n participants (AveFL)."""
    if n < 1:
        raise ValueError(f"need at least one participant, got {n}")
    return np.full(n, 1.0 / n)


def sample_count_coefficients(counts: Sequence[int]) -> np.ndarray:
    """a_i = n_i / sum_j n_j (FedAvg); counts must be non-negative with a positive sum."""
    return _normalised(counts)


def _check_updates(updates: Sequence[ClientUpdate]) -> None:
    """Raises ValueError for an empty round or a device that appears twice."""
    if not updates:
        raise ValueError("cannot aggregate zero updates")
    counts = Counter(update.device_id for update in updates)
    duplicates = sorted(device for device, count in counts.items() if count > 1)
    if duplicates:
        raise ValueError(f"more than one update from device(s) {duplicates}")


def _require_evaluate(strategy: Strategy, evaluate: Evaluate | None) -> Evaluate:
    """Returns `evaluate`, or raises ValueError when a strategy that needs it was given None."""
    if evaluate is None:
        raise ValueError(f"strategy {strategy.name!r} needs an evaluate function (accuracy on the validation split)")
    return evaluate


class Strategy(ABC):
    """Turns one round's client updates into the next global model plus a JSON-serialisable report."""

    name: ClassVar[str]
    needs_evaluation: ClassVar[bool] = False

    @abstractmethod
    def aggregate(
        self, global_weights: Weights, updates: Sequence[ClientUpdate], evaluate: Evaluate | None
    ) -> tuple[Weights, dict[str, Any]]:
        """The new global weights and a report; `evaluate` scores a candidate's accuracy on the server's split."""


class WeightedAverageStrategy(Strategy):
    """A convex combination of the client models; subclasses choose the coefficients."""

    @abstractmethod
    def coefficients(self, updates: Sequence[ClientUpdate]) -> np.ndarray:
        """One non-negative coefficient per update."""

    def aggregate(
        self, global_weights: Weights, updates: Sequence[ClientUpdate], evaluate: Evaluate | None
    ) -> tuple[Weights, dict[str, Any]]:
        """The weighted average of the updates; the report maps each device to its normalised coefficient."""
        _check_updates(updates)
        coefficients = _normalised(self.coefficients(updates))
        averaged = weighted_average([update.weights for update in updates], coefficients)
        report = {update.device_id: float(a) for update, a in zip(updates, coefficients)}
        return averaged, {"coefficients": report}


class AveFL(WeightedAverageStrategy):
    """The core paper's Algorithm 1: the plain mean of the client models."""

    name = "avefl"

    def coefficients(self, updates: Sequence[ClientUpdate]) -> np.ndarray:
        """a_i = 1/n."""
        return uniform_coefficients(len(updates))


class FedAvg(WeightedAverageStrategy):
    """McMahan et al.'s FedAvg: the mean of the client models weighted by their sample counts."""

    name = "fedavg"

    def coefficients(self, updates: Sequence[ClientUpdate]) -> np.ndarray:
        """a_i = n_i / sum_j n_j."""
        return sample_count_coefficients([update.num_samples for update in updates])


class OptFL(Strategy):
    """The core paper's Algorithm 2: keep the single client model most accurate on the validation split."""

    name = "optfl"
    needs_evaluation = True

    def aggregate(
        self, global_weights: Weights, updates: Sequence[ClientUpdate], evaluate: Evaluate | None
    ) -> tuple[Weights, dict[str, Any]]:
        """A copy of W_j*, j* = argmax_j accuracy (ties to the earliest update); the report lists every accuracy."""
        _check_updates(updates)
        evaluate = _require_evaluate(self, evaluate)
        accuracies = [float(evaluate(update.weights)) for update in updates]
        best = updates[int(np.argmax(accuracies))]
        report = {
            "chosen": best.device_id,
            "accuracy": max(accuracies),
            "accuracies": {update.device_id: acc for update, acc in zip(updates, accuracies)},
        }
        return {name: array.copy() for name, array in best.weights.items()}, report


class MixFL(Strategy):
    """The core paper's Algorithm 3: the AveFL model unless the OptFL model is strictly more accurate."""

    name = "mixfl"
    needs_evaluation = True

    def __init__(self) -> None:
        self._average = AveFL()
        self._best = OptFL()

    def aggregate(
        self, global_weights: Weights, updates: Sequence[ClientUpdate], evaluate: Evaluate | None
    ) -> tuple[Weights, dict[str, Any]]:
        """W_ave if acc_ave >= acc_opt else W_opt; each candidate model is evaluated exactly once."""
        evaluate = _require_evaluate(self, evaluate)
        averaged, average_report = self._average.aggregate(global_weights, updates, None)
        best, best_report = self._best.aggregate(global_weights, updates, evaluate)
        acc_average = float(evaluate(averaged))
        use_average = acc_average >= best_report["accuracy"]
        report = {
            "chosen": "average" if use_average else best_report["chosen"],
            "acc_average": acc_average,
            "acc_best": best_report["accuracy"],
            "coefficients": average_report["coefficients"],
            "accuracies": best_report["accuracies"],
        }
        return (averaged if use_average else best), report


STRATEGIES: dict[str, type[Strategy]] = {strategy.name: strategy for strategy in (AveFL, FedAvg, OptFL, MixFL)}


def make_strategy(name: str) -> Strategy:
    """A fresh strategy by its registry name."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; known: {', '.join(sorted(STRATEGIES))}")
    return STRATEGIES[name]()
