# The weighted means and selections: the core paper's AveFL, OptFL and MixFL, FedAvg, FMLU's entropy weights and
# CADIS's clustered weights.
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from coordinator.strategies.aggregate import ClientUpdate, entropy_coefficients, weighted_average
from coordinator.strategies.cadis import CADIS_INITIAL_THRESHOLD, CadisState, cadis_coefficients
from coordinator.strategies.contract import (
    Evaluate,
    Strategy,
    StreamingWeightedAverage,
    WeightedAverageStrategy,
    check_updates,
    metric_of,
)
from protocol.messages import METRIC_MEME_ENTROPY
from protocol.options import Option
from protocol.tensors import Weights


class AveFL(StreamingWeightedAverage):
    """The core paper's Algorithm 1: the plain mean of the client models."""

    name = "avefl"
    summary = "plain mean of the client models (the core paper's Algorithm 1)"
    asynchronous = True  # FedBuff at staleness 0, K = every device and eta_g = 1 is avefl's plain mean

    def update_weight(self, update: ClientUpdate) -> float:
        """a_i = 1 (1/n once normalised)."""
        return 1.0


class OptFL(Strategy):
    """The core paper's Algorithm 2: keep the single client model most accurate on the validation split."""

    name = "optfl"
    summary = "the single client model most accurate on the server's selection split (Algorithm 2)"
    needs_evaluation = True

    def aggregate(
        self, global_weights: Weights, updates: Sequence[ClientUpdate], evaluate: Evaluate | None
    ) -> tuple[Weights, dict[str, Any]]:
        """A copy of W_j*, j* = argmax_j accuracy (ties to the earliest update); the report lists every accuracy."""
        check_updates(updates)
        evaluate = self.require_evaluate(evaluate)
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
    summary = "the AveFL model unless the OptFL model is strictly more accurate (Algorithm 3)"
    needs_evaluation = True

    def aggregate(
        self, global_weights: Weights, updates: Sequence[ClientUpdate], evaluate: Evaluate | None
    ) -> tuple[Weights, dict[str, Any]]:
        """W_ave if acc_ave >= acc_opt else W_opt; each candidate model is evaluated exactly once."""
        evaluate = self.require_evaluate(evaluate)
        averaged, average_report = AveFL().aggregate(global_weights, updates, None)
        best, best_report = OptFL().aggregate(global_weights, updates, evaluate)
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


class FedAvg(StreamingWeightedAverage):
    """McMahan et al.'s FedAvg: the mean of the client models weighted by their sample counts."""

    name = "fedavg"
    summary = "mean of the client models weighted by their labelled-sample counts"
    weighs_by_samples = True

    def update_weight(self, update: ClientUpdate) -> float:
        """a_i = n_i (n_i / sum_j n_j once normalised)."""
        return float(update.num_samples)


class CADIS(Strategy):
    """CADIS: clusters clients by the running similarity of their classifier updates and gives each cluster
    the weight of its data rather than of its size. State (similarity sums, counts, tau, step) survives restarts.
    Transitive learning (estimating unobserved pairs) is not implemented: unobserved pairs count as dissimilar.
    """

    name = "cadis"
    summary = "clustered weights from the running similarity of the devices' classifier updates"
    weighs_by_samples = True
    options = (
        Option(
            "threshold",
            float,
            CADIS_INITIAL_THRESHOLD,
            "initial clustering threshold tau on the rescaled similarity Q",
            0.0,
            1.0,
            flag="--cadis-threshold",
        ),
        Option(
            "split",
            int,
            0,
            "1: tau each round from the data (Otsu's cut of Q when it forms two clear groups) instead of the rising tau",
            0.0,
            1.0,
            flag="--cadis-split",
        ),
    )

    def __init__(self, threshold: float = CADIS_INITIAL_THRESHOLD, split: int = 0) -> None:
        self.clusters = CadisState(
            threshold=self.option("threshold").check(threshold), split=bool(self.option("split").check(split))
        )

    def aggregate(
        self, global_weights: Weights, updates: Sequence[ClientUpdate], evaluate: Evaluate | None
    ) -> tuple[Weights, dict[str, Any]]:
        """Eq. 11-13 and 1-2: similarity against the global model sent this round, clustered weights, then tau rises.

        The state changes only once the aggregate exists, so a failing round leaves it as it was.
        """
        check_updates(updates)
        device_ids = [update.device_id for update in updates]
        following, sizes, layer, tau = self.clusters.observed(global_weights, device_ids, [u.weights for u in updates])
        coefficients = cadis_coefficients([update.num_samples for update in updates], sizes)
        averaged = weighted_average([update.weights for update in updates], coefficients)
        report = {
            "coefficients": {device: float(a) for device, a in zip(device_ids, coefficients)},
            "cluster_sizes": {device: int(size) for device, size in zip(device_ids, sizes)},
            "threshold": tau,
            "layer": layer,
        }
        self.clusters = following
        return averaged, report

    def state(self) -> dict[str, Any]:
        """Devices in matrix order, similarity sums and counts, the current tau and step."""
        return self.clusters.to_json()

    def load_state(self, state: dict[str, Any], tensors: Weights) -> None:
        """Restores state(); a malformed state is a ValueError that says what is wrong."""
        self.clusters = CadisState.from_json(state)


class FMLU(WeightedAverageStrategy):
    """FMLU's server side: the memes averaged with weights exp(-H_c), H_c each meme's mean prediction entropy."""

    name = "fmlu"
    summary = "memes averaged with weights exp(-H), H their mean prediction entropy (needs --local-rule dmlu)"
    required_metrics = (METRIC_MEME_ENTROPY,)

    def metric_bounds(self, num_classes: int) -> Mapping[str, tuple[float, float]]:
        """A mean prediction entropy lies in [0, ln C]."""
        return {METRIC_MEME_ENTROPY: (0.0, math.log(num_classes))}

    def coefficients(self, updates: Sequence[ClientUpdate]) -> np.ndarray:
        """w_c = exp(-H_c) / sum exp(-H_c')."""
        return entropy_coefficients([metric_of(update, METRIC_MEME_ENTROPY) for update in updates])
