# Aggregation strategies behind one interface (AveFL, FedAvg, OptFL, MixFL, Median, TrimmedMean, FMLU, CADIS, the
# server optimisers FedAvgM, FedAdam, FedYogi, FedAdagrad), by name.
from __future__ import annotations

import math
from abc import abstractmethod
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from coordinator.aggregation import (
    ClientUpdate,
    RunningSum,
    coordinate_median,
    entropy_coefficients,
    trimmed_count,
    trimmed_mean,
    weighted_average,
)
from coordinator.cadis import CADIS_INITIAL_THRESHOLD, CadisState, cadis_coefficients
from coordinator.server_optimizers import (
    SecondMoment,
    adagrad_moment,
    adam_moment,
    adaptive_step,
    momentum_step,
    pseudo_gradient,
    yogi_moment,
)
from protocol.messages import METRIC_MEME_ENTROPY
from protocol.options import Method, Option, Registry
from protocol.tensors import Weights

Evaluate = Callable[[Weights], float]


def check_updates(updates: Sequence[ClientUpdate]) -> None:
    """Raises ValueError for an empty round or a device that appears twice."""
    if not updates:
        raise ValueError("cannot aggregate zero updates")
    counts = Counter(update.device_id for update in updates)
    duplicates = sorted(device for device, count in counts.items() if count > 1)
    if duplicates:
        raise ValueError(f"more than one update from device(s) {duplicates[:5]}")


class Strategy(Method):
    """Turns one round's client updates into the next global model plus a JSON-serialisable report."""

    needs_evaluation: ClassVar[bool] = False
    streaming: ClassVar[bool] = False
    weighs_by_samples: ClassVar[bool] = False  # the claimed sample counts set the weights (so they are bounded)
    required_metrics: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def aggregate(
        self, global_weights: Weights, updates: Sequence[ClientUpdate], evaluate: Evaluate | None
    ) -> tuple[Weights, dict[str, Any]]:
        """The new global weights and a report; `evaluate` scores a candidate's accuracy on the server's split."""

    def metric_bounds(self, num_classes: int) -> Mapping[str, tuple[float, float]]:
        """[low, high] of every metric in required_metrics, for a model with num_classes classes."""
        return {}

    def state(self) -> dict[str, Any] | None:
        """JSON-able state carried from round to round (None for a stateless strategy); the round machinery
        commits it with each round, so a restarted coordinator continues from the last committed round."""
        return None

    def tensors(self) -> Weights:
        """Per-parameter state committed beside state() (a server optimiser's moments); none by default."""
        return {}

    def load_state(self, state: dict[str, Any], tensors: Weights) -> None:
        """Restores what state() and tensors() returned; a stateless strategy has nothing to restore."""
        raise ValueError(f"strategy {self.name!r} keeps no state, but a stored state was given")

    def require_evaluate(self, evaluate: Evaluate | None) -> Evaluate:
        """Returns `evaluate`, or raises ValueError when this strategy needs it and was given None."""
        if evaluate is None:
            raise ValueError(f"strategy {self.name!r} needs an evaluate function (accuracy on the validation split)")
        return evaluate


class WeightedAverageStrategy(Strategy):
    """A convex combination of the client models; subclasses choose the coefficients."""

    @abstractmethod
    def coefficients(self, updates: Sequence[ClientUpdate]) -> np.ndarray:
        """One non-negative coefficient per update."""

    def aggregate(
        self, global_weights: Weights, updates: Sequence[ClientUpdate], evaluate: Evaluate | None
    ) -> tuple[Weights, dict[str, Any]]:
        """The weighted average of the updates; the report maps each device to its normalised coefficient."""
        check_updates(updates)
        coefficients = self.coefficients(updates)
        averaged = weighted_average([update.weights for update in updates], coefficients)
        total = math.fsum(coefficients.tolist())
        return averaged, {"coefficients": {u.device_id: float(c) / total for u, c in zip(updates, coefficients)}}


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
        running.add(update.device_id, update.weights, self.update_weight(update))

    def finish(self, running: RunningSum, base: Weights) -> tuple[Weights, dict[str, Any]]:
        """The weighted average and, as in the batch report, each device's normalised coefficient (`base`, the
        round's global model, is for strategies that step from it)."""
        return running.mean(), {"coefficients": running.shares()}


STRATEGIES: Registry[type[Strategy]] = Registry("strategy")


@STRATEGIES.register
class AveFL(StreamingWeightedAverage):
    """The core paper's Algorithm 1: the plain mean of the client models."""

    name = "avefl"
    summary = "plain mean of the client models (the core paper's Algorithm 1)"

    def update_weight(self, update: ClientUpdate) -> float:
        """a_i = 1 (1/n once normalised)."""
        return 1.0


@STRATEGIES.register
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


@STRATEGIES.register
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


@STRATEGIES.register
class FedAvg(StreamingWeightedAverage):
    """McMahan et al.'s FedAvg: the mean of the client models weighted by their sample counts."""

    name = "fedavg"
    summary = "mean of the client models weighted by their labelled-sample counts"
    weighs_by_samples = True

    def update_weight(self, update: ClientUpdate) -> float:
        """a_i = n_i (n_i / sum_j n_j once normalised)."""
        return float(update.num_samples)


@STRATEGIES.register
class Median(Strategy):
    """Coordinate-wise median of the client models: robust while fewer than half the devices are outliers."""

    name = "median"
    summary = "coordinate-wise median of the client models"

    def aggregate(
        self, global_weights: Weights, updates: Sequence[ClientUpdate], evaluate: Evaluate | None
    ) -> tuple[Weights, dict[str, Any]]:
        """The coordinate-wise median of the updates."""
        check_updates(updates)
        return coordinate_median([update.weights for update in updates]), {"method": self.name}


@STRATEGIES.register
class TrimmedMean(Strategy):
    """Coordinate-wise trimmed mean: drop the floor(trim * n) lowest and highest values, average the rest."""

    name = "trimmed-mean"
    summary = "coordinate-wise mean after dropping the extreme values at each end"
    options = (Option("trim", float, 0.2, "fraction trimmed from each end per coordinate", 0.0, 0.5, high_open=True),)

    def __init__(self, trim: float = 0.2) -> None:
        self.trim = self.option("trim").check(trim)

    def aggregate(
        self, global_weights: Weights, updates: Sequence[ClientUpdate], evaluate: Evaluate | None
    ) -> tuple[Weights, dict[str, Any]]:
        """The trimmed mean of the updates; the report gives trim and the count dropped from each end."""
        check_updates(updates)
        trimmed = trimmed_mean([update.weights for update in updates], self.trim)
        dropped = trimmed_count(len(updates), self.trim)
        return trimmed, {"method": self.name, "trim": float(self.trim), "dropped_per_end": dropped}


def metric_of(update: ClientUpdate, metric: str) -> float:
    """A finite metric of an update, or ValueError naming the device (the validator rejects such updates first)."""
    value = update.metrics.get(metric)
    if value is None or not math.isfinite(value):
        raise ValueError(f"update of {update.device_id} has no finite {metric!r} metric (got {value!r})")
    return float(value)


@STRATEGIES.register
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


@STRATEGIES.register
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


class ServerOptimizer(FedAvg):
    """FedAvg's sample-weighted average as a pseudo-gradient, then a server optimiser's step from the global model
    (Reddi et al., "Adaptive Federated Optimization"); its moments are committed with every round."""

    def __init__(self, **options: float) -> None:
        self.hyper = {option.key: float(options.get(option.key, option.default)) for option in self.options}
        self.moments: Weights = {}
        self.rounds = 0

    @abstractmethod
    def step(self, base: Weights, delta: Weights) -> Weights:
        """The next global model from the current one and the pseudo-gradient; updates self.moments."""

    def aggregate(
        self, global_weights: Weights, updates: Sequence[ClientUpdate], evaluate: Evaluate | None
    ) -> tuple[Weights, dict[str, Any]]:
        """The server step toward the weighted average of the updates."""
        return self.server_step(global_weights, *super().aggregate(global_weights, updates, evaluate))

    def finish(self, running: RunningSum, base: Weights) -> tuple[Weights, dict[str, Any]]:
        """The server step toward the streamed weighted average."""
        return self.server_step(base, *super().finish(running, base))

    def server_step(self, base: Weights, averaged: Weights, report: dict[str, Any]) -> tuple[Weights, dict[str, Any]]:
        """Steps and reports the step's size next to the pseudo-gradient's (both L2 over every tensor)."""
        delta = pseudo_gradient(base, averaged)
        following = self.step(base, delta)
        self.rounds += 1
        sizes = {
            "pseudo_gradient_norm": l2_norm(delta),
            "step_norm": l2_norm(pseudo_gradient(base, following)),
            "server_steps": self.rounds,
        }
        return following, {**report, "server_optimizer": sizes}

    def state(self) -> dict[str, Any]:
        """How many steps were taken (the moments travel as tensors())."""
        return {"rounds": self.rounds}

    def tensors(self) -> Weights:
        """The optimiser's moments, float64."""
        return dict(self.moments)

    def load_state(self, state: dict[str, Any], tensors: Weights) -> None:
        """Restores the step count and the moments; a malformed state is a ValueError."""
        rounds = state.get("rounds") if isinstance(state, dict) else None
        if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 0:
            raise ValueError(f"strategy {self.name!r}: stored state needs a non-negative 'rounds', got {state!r:.80}")
        self.rounds = rounds
        self.moments = {name: np.asarray(array, dtype=np.float64) for name, array in tensors.items()}


def l2_norm(tensors: Weights) -> float:
    """The L2 norm of all tensors taken together."""
    return math.sqrt(math.fsum(float(np.sum(np.square(array, dtype=np.float64))) for array in tensors.values()))


SERVER_LR_HELP = "server learning rate (eta)"


@STRATEGIES.register
class FedAvgM(ServerOptimizer):
    """Hsu et al.'s FedAvgM: server momentum over the rounds' pseudo-gradients."""

    name = "fedavgm"
    summary = "FedAvg with server momentum (Hsu et al. 2019)"
    options = (
        Option("server_lr", float, 1.0, SERVER_LR_HELP, low=0.0, flag="--server-lr"),
        Option("server_momentum", float, 0.5, "server momentum beta", 0.0, 1.0, high_open=True),
    )

    def step(self, base: Weights, delta: Weights) -> Weights:
        """momentum_step with the declared lr and beta."""
        following, self.moments = momentum_step(
            base, delta, self.moments, self.hyper["server_lr"], self.hyper["server_momentum"]
        )
        return following


class AdaptiveServerOptimizer(ServerOptimizer):
    """FedAdam, FedYogi and FedAdagrad: one adaptive step, the second-moment rule looked up by name."""

    def step(self, base: Weights, delta: Weights) -> Weights:
        """adaptive_step with this class's second-moment rule and its declared hyperparameters."""
        hyper = (self.hyper["server_lr"], self.hyper["beta1"], self.hyper.get("beta2", 0.0), self.hyper["tau"])
        following, self.moments = adaptive_step(base, delta, self.moments, SECOND_MOMENTS[self.name], hyper)
        return following


def adaptive_options(lr: float, tau: float, decays_v: bool = True) -> tuple[Option, ...]:
    """The hyperparameters of an adaptive server optimiser with its defaults for lr and tau; beta2 only where the
    second moment decays (not Adagrad's, which only grows)."""
    beta2 = Option("beta2", float, 0.99, "second-moment decay", 0.0, 1.0, high_open=True, flag="--server-beta2")
    return (
        Option("server_lr", float, lr, SERVER_LR_HELP, low=0.0, flag="--server-lr"),
        Option("beta1", float, 0.9, "first-moment decay", 0.0, 1.0, high_open=True, flag="--server-beta1"),
        *((beta2,) if decays_v else ()),
        Option("tau", float, tau, "adaptivity (added to sqrt v)", low=1e-12, flag="--server-tau"),
    )


@STRATEGIES.register
class FedAdam(AdaptiveServerOptimizer):
    """Reddi et al.'s FedAdam."""

    name = "fedadam"
    summary = "FedAvg's pseudo-gradient through a server Adam step (Reddi et al. 2021)"
    options = adaptive_options(0.003, 1e-3)


@STRATEGIES.register
class FedYogi(AdaptiveServerOptimizer):
    """Reddi et al.'s FedYogi."""

    name = "fedyogi"
    summary = "FedAvg's pseudo-gradient through a server Yogi step (Reddi et al. 2021)"
    options = adaptive_options(0.003, 1e-3)


@STRATEGIES.register
class FedAdagrad(AdaptiveServerOptimizer):
    """Reddi et al.'s FedAdagrad."""

    name = "fedadagrad"
    summary = "FedAvg's pseudo-gradient through a server Adagrad step (Reddi et al. 2021)"
    options = adaptive_options(0.03, 1e-2, decays_v=False)


SECOND_MOMENTS: dict[str, SecondMoment] = {
    FedAdam.name: adam_moment,
    FedYogi.name: yogi_moment,
    FedAdagrad.name: adagrad_moment,
}


def make_strategy(name: str, **options: Any) -> Strategy:
    """A fresh strategy by its registry name, built with its declared options (e.g. trim=0.2), each checked."""
    strategy = STRATEGIES.get(name)
    declared = {option.key for option in strategy.options}
    unknown = sorted(set(options) - declared)
    if unknown:
        takes = ", ".join(sorted(declared)) or "no options"
        raise ValueError(f"strategy {name!r} does not take option(s) {unknown[:5]}; it takes: {takes}")
    return strategy(**{key: strategy.option(key).check(value) for key, value in options.items()})
