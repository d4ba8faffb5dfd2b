# The strategy contract: one round's updates in, the next global model and a report out; what a strategy declares
# (streaming, asynchronous, evaluation, metrics, state) decides how the round machinery feeds it.
from __future__ import annotations

import math
from abc import abstractmethod
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, TypeGuard

import numpy as np

from coordinator.strategies.aggregate import ClientUpdate, RunningSum, weighted_average
from protocol.options import Method
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


STREAMING_METHODS = ("begin", "accumulate", "finish")


class Strategy(Method):
    """Turns one round's client updates into the next global model plus a JSON-serialisable report.

    The contract: every strategy aggregates a whole round (`aggregate`). What it declares decides how the round
    machinery feeds it (make_aggregator, check_async_settings), never its class:
    - streaming: it also folds updates as they arrive, begin() -> accumulate() per update -> finish(), with the
      same result as aggregate() (StreamingWeightedAverage), so a round need not hold every update;
    - asynchronous: FedBuff's staleness-weighted mean of the updates' changes is its asynchronous form (--mode async);
    - needs_evaluation, required_metrics: what aggregate() reads besides the models;
    - state(), tensors(), load_state(): what it carries from round to round.
    """

    needs_evaluation: ClassVar[bool] = False
    streaming: ClassVar[bool] = False
    weighs_by_samples: ClassVar[bool] = False  # the claimed sample counts set the weights (so they are bounded)
    asynchronous: ClassVar[bool] = False
    statistics: ClassVar[bool] = False  # its updates carry head statistics (protocol.head_statistics), not models
    required_metrics: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Refuses a class that declares streaming without the methods that fold updates as they arrive."""
        super().__init_subclass__(**kwargs)
        missing = [method for method in STREAMING_METHODS if cls.streaming and not hasattr(cls, method)]
        if missing:
            raise TypeError(f"strategy class {cls.__name__} declares streaming but has no {', '.join(missing)}")

    @abstractmethod
    def aggregate(
        self, global_weights: Weights, updates: Sequence[ClientUpdate], evaluate: Evaluate | None
    ) -> tuple[Weights, dict[str, Any]]:
        """The new global weights and a report; `evaluate` scores a candidate's accuracy on the server's split."""

    def fitted(self, aggregate: Weights, head: Weights, samples: float = 0.0) -> tuple[Weights, dict[str, Any]]:
        """The round's new trained set from what the round aggregated (`head`: the round's model's trained set;
        `samples`: the sample count the aggregate's weights summed) and what to add to the report: the aggregate
        itself for a strategy over models; a statistics strategy fits it."""
        return aggregate, {}

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


def metric_of(update: ClientUpdate, metric: str) -> float:
    """A finite metric of an update, or ValueError naming the device (the validator rejects such updates first)."""
    value = update.metrics.get(metric)
    if value is None or not math.isfinite(value):
        raise ValueError(f"update of {update.device_id} has no finite {metric!r} metric (got {value!r})")
    return float(value)


def streams(strategy: Strategy) -> TypeGuard[StreamingWeightedAverage]:
    """Whether the strategy declares that it folds updates as they arrive (its class checks it has the methods)."""
    return strategy.streaming
