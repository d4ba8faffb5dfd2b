# Aggregation strategies behind one interface (AveFL, FedAvg, OptFL, MixFL, Median, TrimmedMean, FMLU, CADIS) and their math.
from __future__ import annotations

import inspect
import math
import numbers
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from edge_agent.models import NUM_CLASSES
from edge_agent.tensors import Weights
from edge_agent.wire import METRIC_MEME_ENTROPY

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
    return {name: _combine([weights[name] for weights in weight_sets], normalised) for name in weight_sets[0]}


def _combine(arrays: Sequence[np.ndarray], coefficients: np.ndarray) -> np.ndarray:
    """sum_i a_i x_i accumulated in float64 and returned in the dtype of the arrays."""
    total = np.zeros(arrays[0].shape, dtype=np.float64)
    for a, array in zip(coefficients, arrays):
        total += a * array.astype(np.float64)
    return total.astype(arrays[0].dtype)


@dataclass
class RunningSum:
    """sum_i c_i W_i per tensor (float64) and each c_i, over the updates added so far: one model's worth of memory."""

    totals: dict[str, np.ndarray] = field(default_factory=dict)
    dtypes: dict[str, np.dtype] = field(default_factory=dict)
    coefficients: dict[str, float] = field(default_factory=dict)


def add_to_running_sum(running: RunningSum, device_id: str, weights: Weights, coefficient: float) -> None:
    """Adds c * W in place (float64); the first weight set fixes the layout every later one must match."""
    if device_id in running.coefficients:
        raise ValueError(f"more than one update from device(s) {[device_id]}")
    if not np.isfinite(coefficient) or coefficient < 0.0:
        raise ValueError(f"coefficients must be finite and non-negative, got {coefficient!r} for {device_id}")
    if running.totals:
        expected = {name: (total.shape, running.dtypes[name]) for name, total in running.totals.items()}
        if {name: (array.shape, array.dtype) for name, array in weights.items()} != expected:
            raise ValueError(f"the update of {device_id} differs in tensor names, shapes or dtypes from the first one")
    else:
        running.totals = {name: np.zeros(array.shape, dtype=np.float64) for name, array in weights.items()}
        running.dtypes = {name: array.dtype for name, array in weights.items()}
    for name, array in weights.items():
        running.totals[name] += coefficient * array.astype(np.float64)
    running.coefficients[device_id] = float(coefficient)


def running_mean(running: RunningSum) -> Weights:
    """sum_i c_i W_i / sum_i c_i, cast back to the input dtypes; the coefficients must have a positive sum."""
    if not running.coefficients:
        raise ValueError("cannot aggregate zero updates")
    total = sum(running.coefficients.values())
    if total <= 0.0:
        raise ValueError(f"coefficients must have a positive sum, got {list(running.coefficients.values())!r}")
    return {name: (summed / total).astype(running.dtypes[name]) for name, summed in running.totals.items()}


def _per_coordinate(weight_sets: Sequence[Weights], statistic: Callable[[np.ndarray], np.ndarray]) -> Weights:
    """statistic(stack) per tensor, the stack's axis 0 running over the weight sets, in float64, cast back."""
    if not weight_sets:
        raise ValueError("a per-coordinate statistic needs at least one weight set")
    _check_same_layout(weight_sets)
    return {
        name: statistic(np.stack([weights[name].astype(np.float64) for weights in weight_sets])).astype(array.dtype)
        for name, array in weight_sets[0].items()
    }


def coordinate_median(weight_sets: Sequence[Weights]) -> Weights:
    """The median of the n values of every coordinate (the mean of the middle two for even n)."""
    return _per_coordinate(weight_sets, lambda stack: np.median(stack, axis=0))


def check_trim(trim: float) -> None:
    """Raises ValueError unless trim is a number in [0, 0.5)."""
    if isinstance(trim, bool) or not isinstance(trim, numbers.Real) or not 0.0 <= trim < 0.5:
        raise ValueError(f"trim must be a number in [0, 0.5), got {trim!r}")


def trimmed_count(n: int, trim: float) -> int:
    """floor(trim * n), the values dropped from each end; trim < 0.5 always leaves at least one of n >= 1 values."""
    check_trim(trim)
    if n < 1:
        raise ValueError(f"need at least one value to trim, got {n}")
    return math.floor(trim * n)


def trimmed_mean(weight_sets: Sequence[Weights], trim: float) -> Weights:
    """Per coordinate: sort the n values, drop floor(trim * n) from each end and average the rest."""
    cut = trimmed_count(len(weight_sets), trim)
    return _per_coordinate(weight_sets, lambda stack: np.sort(stack, axis=0)[cut : len(stack) - cut].mean(axis=0))


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
    streaming: ClassVar[bool] = False
    required_metrics: ClassVar[Mapping[str, tuple[float, float]]] = {}

    @abstractmethod
    def aggregate(
        self, global_weights: Weights, updates: Sequence[ClientUpdate], evaluate: Evaluate | None
    ) -> tuple[Weights, dict[str, Any]]:
        """The new global weights and a report; `evaluate` scores a candidate's accuracy on the server's split."""

    def state(self) -> dict[str, Any] | None:
        """JSON-able state carried from round to round (None for a stateless strategy); the round machinery
        commits it with each round, so a restarted coordinator continues from the last committed round."""
        return None

    def load_state(self, state: dict[str, Any]) -> None:
        """Restores what state() returned; a stateless strategy has nothing to restore."""
        raise ValueError(f"strategy {self.name!r} keeps no state, but a stored state was given")


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


class StreamingWeightedAverage(WeightedAverageStrategy):
    """A weighted average whose coefficient depends on one update alone, so it can be summed as updates arrive:
    begin() -> accumulate() per update -> finish(); the batch aggregate() is the same fold over a list."""

    streaming = True

    @abstractmethod
    def update_weight(self, update: ClientUpdate) -> float:
        """The update's unnormalised, non-negative coefficient."""

    def coefficients(self, updates: Sequence[ClientUpdate]) -> np.ndarray:
        """Each update's own weight (normalised by the caller)."""
        return np.array([self.update_weight(update) for update in updates], dtype=np.float64)

    def begin(self) -> RunningSum:
        """An empty running sum for one round."""
        return RunningSum()

    def accumulate(self, running: RunningSum, update: ClientUpdate) -> None:
        """Adds one update; after this the update's tensors are no longer needed."""
        add_to_running_sum(running, update.device_id, update.weights, self.update_weight(update))

    def finish(self, running: RunningSum) -> tuple[Weights, dict[str, Any]]:
        """The weighted average and, as in the batch report, each device's normalised coefficient."""
        averaged = running_mean(running)
        total = sum(running.coefficients.values())
        return averaged, {"coefficients": {device: c / total for device, c in running.coefficients.items()}}

    def aggregate(
        self, global_weights: Weights, updates: Sequence[ClientUpdate], evaluate: Evaluate | None
    ) -> tuple[Weights, dict[str, Any]]:
        """The streaming fold over a list of updates."""
        _check_updates(updates)
        running = self.begin()
        for update in updates:
            self.accumulate(running, update)
        return self.finish(running)


class AveFL(StreamingWeightedAverage):
    """The core paper's Algorithm 1: the plain mean of the client models."""

    name = "avefl"

    def update_weight(self, update: ClientUpdate) -> float:
        """a_i = 1 (1/n once normalised)."""
        return 1.0


class FedAvg(StreamingWeightedAverage):
    """McMahan et al.'s FedAvg: the mean of the client models weighted by their sample counts."""

    name = "fedavg"

    def update_weight(self, update: ClientUpdate) -> float:
        """a_i = n_i (n_i / sum_j n_j once normalised)."""
        return float(update.num_samples)


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


class Median(Strategy):
    """Coordinate-wise median of the client models: robust while fewer than half the devices are outliers."""

    name = "median"

    def aggregate(
        self, global_weights: Weights, updates: Sequence[ClientUpdate], evaluate: Evaluate | None
    ) -> tuple[Weights, dict[str, Any]]:
        """The coordinate-wise median of the updates."""
        _check_updates(updates)
        return coordinate_median([update.weights for update in updates]), {"method": self.name}


class TrimmedMean(Strategy):
    """Coordinate-wise trimmed mean: drop the floor(trim * n) lowest and highest values, average the rest."""

    name = "trimmed-mean"

    def __init__(self, trim: float = 0.2) -> None:
        check_trim(trim)
        self.trim = trim

    def aggregate(
        self, global_weights: Weights, updates: Sequence[ClientUpdate], evaluate: Evaluate | None
    ) -> tuple[Weights, dict[str, Any]]:
        """The trimmed mean of the updates; the report gives trim and the count dropped from each end."""
        _check_updates(updates)
        trimmed = trimmed_mean([update.weights for update in updates], self.trim)
        dropped = trimmed_count(len(updates), self.trim)
        return trimmed, {"method": self.name, "trim": float(self.trim), "dropped_per_end": dropped}


def entropy_coefficients(entropies: Sequence[float]) -> np.ndarray:
    """FMLU's w_c = exp(-H_c) / sum_c' exp(-H_c'), computed stably; every H_c must be finite."""
    values = np.asarray(entropies, dtype=np.float64)
    if values.ndim != 1 or values.size == 0 or not np.all(np.isfinite(values)):
        raise ValueError(f"entropies must be a non-empty list of finite numbers, got {entropies!r}")
    scaled = np.exp(-(values - values.min()))
    return scaled / scaled.sum()


def metric_of(update: ClientUpdate, metric: str) -> float:
    """A finite metric of an update, or ValueError naming the device (the validator rejects such updates first)."""
    value = update.metrics.get(metric)
    if value is None or not math.isfinite(value):
        raise ValueError(f"update of {update.device_id} has no finite {metric!r} metric (got {value!r})")
    return float(value)


class FMLU(WeightedAverageStrategy):
    """FMLU's server side: the memes averaged with weights exp(-H_c), H_c each meme's mean prediction entropy."""

    name = "fmlu"
    required_metrics: ClassVar[Mapping[str, tuple[float, float]]] = {METRIC_MEME_ENTROPY: (0.0, math.log(NUM_CLASSES))}

    def coefficients(self, updates: Sequence[ClientUpdate]) -> np.ndarray:
        """w_c = exp(-H_c) / sum exp(-H_c')."""
        return entropy_coefficients([metric_of(update, METRIC_MEME_ENTROPY) for update in updates])


CADIS_INITIAL_THRESHOLD = 0.975
CADIS_THRESHOLD_CAP = 0.985
CADIS_THRESHOLD_GROWTH = 1.0005


def classifier_tensor(weights: Weights) -> str:
    """The final dense classifier's weight ("penultimate layer" in CADIS): the last 2-D tensor named *weight."""
    names = [name for name, array in weights.items() if array.ndim == 2 and name.endswith("weight")]
    if not names:
        raise ValueError("the model has no 2-D weight tensor to serve as the classifier layer")
    return names[-1]


def pairwise_cosine(vectors: np.ndarray) -> np.ndarray:
    """s_ij = cos(v_i, v_j) for the rows of vectors, s_ii = 1; a pair with a zero vector has similarity 0."""
    vectors = np.asarray(vectors, dtype=np.float64)
    norms = np.linalg.norm(vectors, axis=1)
    safe = np.where(norms > 0.0, norms, 1.0)
    unit = vectors / safe[:, None]
    similarity = np.clip(unit @ unit.T, -1.0, 1.0)
    np.fill_diagonal(similarity, 1.0)
    return similarity


def classifier_similarity(global_weights: Weights, client_weights: Sequence[Weights], layer: str) -> np.ndarray:
    """CADIS's Eq. 11: cosine similarity of the clients' classifier-weight changes vec(W_i - W_g)."""
    reference = global_weights[layer].astype(np.float64).ravel()
    return pairwise_cosine(
        np.stack([weights[layer].astype(np.float64).ravel() - reference for weights in client_weights])
    )


def accumulate_similarity(
    sums: np.ndarray, counts: np.ndarray, members: Sequence[int], similarity: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Eq. 12 as sums and counts: every pair (i, j) of this round's members gains s_ij and one observation."""
    index = np.ix_(members, members)
    sums, counts = sums.copy(), counts.copy()
    sums[index] += similarity
    counts[index] += 1
    return sums, counts


def with_devices(
    devices: Sequence[str], sums: np.ndarray, counts: np.ndarray, device_ids: Sequence[str]
) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The device list and matrices grown (zero rows and columns) for the devices not seen before."""
    new = [device for device in dict.fromkeys(device_ids) if device not in devices]
    pad = ((0, len(new)), (0, len(new)))
    return list(devices) + new, np.pad(sums, pad), np.pad(counts, pad)


def running_similarity(sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """S_ij = sum_ij / T_ij on observed pairs (T_ij > 0), 0 elsewhere."""
    return np.divide(sums, counts, out=np.zeros_like(sums, dtype=np.float64), where=counts > 0)


def q_matrix(similarity: np.ndarray, observed: np.ndarray) -> np.ndarray:
    """Q_ij = (S_ij - m) / (M - m) on observed pairs, clipped to [0, 1], 0 elsewhere; m, M the observed min, max.

    With every observed value equal (M = m) the observed pairs get Q = 1. No abs(): strongly negative
    similarities stay at the bottom (the reference code's abs() lifts them).
    """
    values = similarity[observed]
    if values.size == 0:
        return np.zeros_like(similarity, dtype=np.float64)
    low, high = float(values.min()), float(values.max())
    scaled = np.ones_like(similarity, dtype=np.float64) if high <= low else (similarity - low) / (high - low)
    return np.where(observed, np.clip(scaled, 0.0, 1.0), 0.0)


def cluster_sizes(q: np.ndarray, threshold: float) -> np.ndarray:
    """|C(k)| = #{j : Q_kj >= tau} over every client seen so far (Eq. 13; k itself counts, Q_kk = 1)."""
    return (np.asarray(q) >= threshold).sum(axis=1)


def cadis_coefficients(num_samples: Sequence[int], sizes: Sequence[int]) -> np.ndarray:
    """w_k = (n_k / |C(k)|) / sum_j (n_j / |C(j)|): each cluster weighs by its mass, not by its head count."""
    counts = np.asarray(num_samples, dtype=np.float64)
    sizes = np.asarray(sizes, dtype=np.float64)
    if counts.shape != sizes.shape or np.any(sizes < 1):
        raise ValueError(f"need one cluster size >= 1 per client, got {list(sizes)} for {len(counts)} clients")
    return _normalised(counts / sizes)


def next_threshold(threshold: float, step: int) -> float:
    """tau_{t+1} = min(tau_t * 1.0005^t, 0.985): the clustering threshold rises every round up to the cap."""
    return min(threshold * CADIS_THRESHOLD_GROWTH**step, CADIS_THRESHOLD_CAP)


class CADIS(Strategy):
    """CADIS: clusters clients by the running similarity of their classifier updates and gives each cluster
    the weight of its data rather than of its size. State (similarity sums, counts, tau, step) survives restarts.
    Transitive learning (estimating unobserved pairs) is not implemented: unobserved pairs count as dissimilar.
    """

    name = "cadis"

    def __init__(self, threshold: float = CADIS_INITIAL_THRESHOLD) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must lie in [0, 1], got {threshold!r}")
        self.threshold = float(threshold)
        self.step = 0
        self.devices: list[str] = []
        self.sums = np.zeros((0, 0))
        self.counts = np.zeros((0, 0), dtype=np.int64)

    def aggregate(
        self, global_weights: Weights, updates: Sequence[ClientUpdate], evaluate: Evaluate | None
    ) -> tuple[Weights, dict[str, Any]]:
        """Eq. 11-13 and 1-2: similarity against the global model sent this round, clustered weights, then tau rises.

        The state changes only once the aggregate exists, so a failing round leaves it as it was.
        """
        _check_updates(updates)
        layer = classifier_tensor(global_weights)
        similarity = classifier_similarity(global_weights, [update.weights for update in updates], layer)
        device_ids = [update.device_id for update in updates]
        devices, sums, counts = with_devices(self.devices, self.sums, self.counts, device_ids)
        members = [devices.index(device) for device in device_ids]
        sums, counts = accumulate_similarity(sums, counts, members, similarity)
        q = q_matrix(running_similarity(sums, counts), counts > 0)
        sizes = cluster_sizes(q, self.threshold)[members]
        coefficients = cadis_coefficients([update.num_samples for update in updates], sizes)
        averaged = weighted_average([update.weights for update in updates], coefficients)
        report = {
            "coefficients": {device: float(a) for device, a in zip(device_ids, coefficients)},
            "cluster_sizes": {device: int(size) for device, size in zip(device_ids, sizes)},
            "threshold": self.threshold,
            "layer": layer,
        }
        self.devices, self.sums, self.counts = devices, sums, counts
        self.threshold = next_threshold(self.threshold, self.step)
        self.step += 1
        return averaged, report

    def state(self) -> dict[str, Any]:
        """Devices in matrix order, similarity sums and counts, the current tau and step."""
        return {
            "devices": list(self.devices),
            "sums": self.sums.tolist(),
            "counts": self.counts.tolist(),
            "threshold": self.threshold,
            "step": self.step,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Restores state(); a malformed state is a ValueError that says what is wrong."""
        try:
            devices = [str(device) for device in state["devices"]]
            sums = np.asarray(state["sums"], dtype=np.float64).reshape(len(devices), len(devices))
            counts = np.asarray(state["counts"], dtype=np.int64).reshape(len(devices), len(devices))
            threshold, step = float(state["threshold"]), int(state["step"])
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"stored cadis state is malformed: {error}") from None
        if len(set(devices)) != len(devices) or np.any(counts < 0) or step < 0:
            raise ValueError("stored cadis state is malformed: repeated devices or negative counts")
        self.devices, self.sums, self.counts, self.threshold, self.step = devices, sums, counts, threshold, step


STRATEGIES: dict[str, type[Strategy]] = {
    strategy.name: strategy for strategy in (AveFL, FedAvg, OptFL, MixFL, Median, TrimmedMean, FMLU, CADIS)
}


def make_strategy(name: str, **options: Any) -> Strategy:
    """A fresh strategy by its registry name, built with the constructor options it takes (e.g. trim=0.2)."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; known: {', '.join(sorted(STRATEGIES))}")
    strategy = STRATEGIES[name]
    accepted = list(inspect.signature(strategy).parameters)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        takes = ", ".join(accepted) or "no options"
        raise ValueError(f"strategy {name!r} does not take option(s) {unknown}; it takes: {takes}")
    return strategy(**options)
