# One round's aggregation seam: absorb accepted updates as they arrive, finish into an immutable Aggregate.
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from coordinator.aggregation import ClientUpdate, check_magnitude
from coordinator.divergence import flag_suspects, layer_divergence
from coordinator.scratch import TensorScratch
from coordinator.strategies import Evaluate, Strategy, StreamingWeightedAverage
from protocol.tensors import Weights


@dataclass(frozen=True)
class SuspectPolicy:
    """How updates whose per-layer divergence is an outlier across devices are treated.

    Suspicion is judged on each update's divergence from the round's base model (the last committed global model,
    which nothing sent this round can move), in batch and streamed rounds alike. A device is a suspect when at
    least `min_layer_fraction` of its layers have a robust z-score above `threshold` (single layers of a few
    devices cross it by chance).
    """

    threshold: float = 3.5
    min_layer_fraction: float = 0.5
    exclude: bool = False


def suspects_by_divergence(divergence: dict[str, dict[str, float]], policy: SuspectPolicy) -> dict[str, list[str]]:
    """Device -> outlier layers, for devices with at least policy.min_layer_fraction of their layers flagged."""
    flagged = flag_suspects(divergence, policy.threshold)
    layer_count = len(next(iter(divergence.values()), {}))
    return {
        device: layers for device, layers in flagged.items() if len(layers) >= policy.min_layer_fraction * layer_count
    }


@dataclass(frozen=True)
class Aggregate:
    """What a round's updates produced: the new global model, the strategy's report, each update's per-layer
    divergence from the new model, and the suspects with their outlier layers."""

    weights: Weights
    report: dict[str, Any]
    divergence: dict[str, dict[str, float]]
    suspects: dict[str, list[str]]


class RoundAggregator(ABC):
    """Takes one round's accepted updates in any order and gives the same Aggregate for the same set of updates."""

    def __init__(self, strategy: Strategy, base: Weights, policy: SuspectPolicy) -> None:
        self.strategy = strategy
        self.base = base
        self.policy = policy
        self.from_base: dict[str, dict[str, float]] = {}

    def absorb(self, update: ClientUpdate) -> None:
        """Takes an accepted update; ValueError (nothing kept) when it cannot be aggregated."""
        check_magnitude(update.weights)
        self.keep(update)
        self.from_base[update.device_id] = layer_divergence(update.weights, self.base)

    def finish(self, evaluate: Evaluate | None, visit: Callable[[ClientUpdate], None] | None = None) -> Aggregate:
        """The round's Aggregate; `visit` sees every update's model once more (e.g. to score it) in device order."""
        suspects = suspects_by_divergence(dict(sorted(self.from_base.items())), self.policy)
        weights, report = self.combine(suspects, evaluate)
        divergence = {}
        for update in self.models():
            divergence[update.device_id] = layer_divergence(update.weights, weights)
            if visit is not None:
                visit(update)
        return Aggregate(weights, {**report, "suspects": suspects}, divergence, suspects)

    @abstractmethod
    def keep(self, update: ClientUpdate) -> None:
        """Keeps what finish() needs of an update (the update itself, or its share of a running sum)."""

    @abstractmethod
    def combine(self, suspects: dict[str, list[str]], evaluate: Evaluate | None) -> tuple[Weights, dict[str, Any]]:
        """The new global model and the strategy's report."""

    @abstractmethod
    def models(self) -> Iterator[ClientUpdate]:
        """The round's updates, in device order."""


class BatchAggregator(RoundAggregator):
    """Keeps every update until the round closes (strategies that need them all, or suspects to leave out)."""

    def __init__(self, strategy: Strategy, base: Weights, policy: SuspectPolicy) -> None:
        super().__init__(strategy, base, policy)
        self.updates: dict[str, ClientUpdate] = {}

    def keep(self, update: ClientUpdate) -> None:
        """Holds the update in memory."""
        if update.device_id in self.updates:
            raise ValueError(f"more than one update from device(s) {[update.device_id]}")
        self.updates[update.device_id] = update

    def combine(self, suspects: dict[str, list[str]], evaluate: Evaluate | None) -> tuple[Weights, dict[str, Any]]:
        """The strategy over the updates in device order, without the suspects when the policy excludes them."""
        updates = list(self.models())
        trusted = [update for update in updates if update.device_id not in suspects]
        excluded = self.policy.exclude and bool(suspects) and bool(trusted)
        evaluate = evaluate if self.strategy.needs_evaluation else None
        weights, report = self.strategy.aggregate(self.base, trusted if excluded else updates, evaluate)
        return weights, {**report, "excluded": sorted(suspects)} if excluded else report

    def models(self) -> Iterator[ClientUpdate]:
        """The held updates, in device order."""
        return iter([self.updates[device] for device in sorted(self.updates)])


class StreamingAggregator(RoundAggregator):
    """Adds each update to an order-independent running sum on arrival and keeps no tensors in memory: its decoded
    weights go to a scratch file and are viewed again (not decoded again) only to measure them against the new
    global model."""

    def __init__(
        self, strategy: StreamingWeightedAverage, base: Weights, policy: SuspectPolicy, scratch: TensorScratch
    ) -> None:
        super().__init__(strategy, base, policy)
        self.streaming = strategy
        self.running = strategy.begin()
        self.scratch = scratch
        self.kept: dict[str, ClientUpdate] = {}

    def keep(self, update: ClientUpdate) -> None:
        """Keeps the update's weights in the scratch and adds them, weighted, to the running sum."""
        self.scratch.put(update.device_id, update.weights)
        self.streaming.accumulate(self.running, update)
        self.kept[update.device_id] = dataclasses.replace(update, weights={})

    def combine(self, suspects: dict[str, list[str]], evaluate: Evaluate | None) -> tuple[Weights, dict[str, Any]]:
        """The running mean (suspects are flagged only: leaving them out needs the batch path)."""
        weights, report = self.streaming.finish(self.running, self.base)
        return weights, {**report, "streamed": True}

    def models(self) -> Iterator[ClientUpdate]:
        """The absorbed updates, their weights viewed in the scratch, in device order."""
        for device in sorted(self.running.coefficients):
            yield dataclasses.replace(self.kept[device], weights=self.scratch.get(device))


def make_aggregator(
    strategy: Strategy, base: Weights, policy: SuspectPolicy, scratch: TensorScratch
) -> RoundAggregator:
    """Streaming (keeping weights in `scratch`) when the strategy can sum as updates arrive and no suspect is to be
    left out, else batch."""
    if isinstance(strategy, StreamingWeightedAverage) and not policy.exclude:
        return StreamingAggregator(strategy, base, policy, scratch)
    return BatchAggregator(strategy, base, policy)
