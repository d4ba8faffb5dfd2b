# One round's aggregation seam: absorb accepted updates as they arrive, finish into an immutable Aggregate.
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from coordinator.intake.divergence import flag_suspects, layer_divergence, suspicion_divergence
from coordinator.intake.label_agreement import statistics_suspects
from coordinator.intake.scratch import TensorScratch
from coordinator.strategies.aggregate import ClientUpdate, capped_weights, check_magnitude
from coordinator.strategies.contract import Evaluate, Strategy, StreamingWeightedAverage, streams
from protocol.tensors import Weights
from protocol.trained_set import with_trained


@dataclass(frozen=True)
class SuspectPolicy:
    """How updates whose per-layer divergence is an outlier across devices are treated.

    Suspicion is judged on each update's divergence from the round's base model (the last committed global model,
    which nothing sent this round can move), in batch and streamed rounds alike. A device is a suspect when at
    least `min_layer_fraction` of its layers have a robust z-score above `threshold` (single layers of a few
    devices cross it by chance); an update of fewer than divergence.MIN_TENSORS_PER_LAYER tensors (a classifier
    head) is judged as one whole (divergence.suspicion_divergence). A statistics strategy's updates are no model:
    they are judged on how well their labels agree with the rest of the round's (label_agreement; the threshold
    and layer fraction do not apply).
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
    """Takes one round's accepted updates in any order and gives the same Aggregate for the same set of updates.

    Updates, the strategy, divergence and suspicion see the trained set only: `base` is the round's model's trained
    tensors (as validation's Expectation has them). `model` is the round's whole model (None: `base` is all of it);
    its frozen tensors complete the new global model and every model the server evaluates, untouched."""

    def __init__(
        self,
        strategy: Strategy,
        base: Weights,
        policy: SuspectPolicy,
        max_share: float = 1.0,
        *,
        model: Weights | None = None,
        head: Weights | None = None,
    ) -> None:
        self.strategy = strategy
        self.base = base
        self.model = base if model is None else model
        self.head = base if head is None else head
        self.policy = policy
        self.max_share = max_share
        self.from_base: dict[str, dict[str, float]] = {}
        self.claims: dict[str, tuple[float, int]] = {}
        self.clipped: dict[str, float] = {}

    def absorb(self, update: ClientUpdate) -> None:
        """Takes an accepted update; ValueError (nothing kept) when it cannot be aggregated."""
        check_magnitude(update.weights)
        self.keep(update)
        if not self.strategy.statistics:
            self.from_base[update.device_id] = suspicion_divergence(update.weights, self.base)
        self.claims[update.device_id] = (update.num_samples, update.devices)

    def clipped_samples(self) -> dict[str, float]:
        """Device -> its sample count clipped to the round's share cap (each update may carry max_share of the round's
        weight per device it sums), for the devices whose claim the cap lowers; none unless the strategy weighs by
        samples."""
        if not self.strategy.weighs_by_samples or self.max_share >= 1.0:
            return {}
        devices = sorted(self.claims)
        claims = np.array([self.claims[device][0] for device in devices], dtype=np.float64)
        caps = np.minimum(1.0, self.max_share * np.array([self.claims[device][1] for device in devices]))
        clipped = capped_weights(claims, caps)
        return {device: float(value) for device, value, claim in zip(devices, clipped, claims) if value != claim}

    def weighed_samples(self, excluded: Iterable[str] = ()) -> float:
        """The round's sample count as the strategy weighed its updates (a claim the share cap lowered, lowered; the
        `excluded` suspects' left out)."""
        left_out = set(excluded)
        return float(
            sum(self.clipped.get(device, claim[0]) for device, claim in self.claims.items() if device not in left_out)
        )

    def as_weighed(self, update: ClientUpdate) -> ClientUpdate:
        """The update with the sample count the strategy weighs it by (clipped by the share cap where it is)."""
        if update.device_id not in self.clipped:
            return update
        return dataclasses.replace(update, num_samples=self.clipped[update.device_id])

    def finish(self, evaluate: Evaluate | None, visit: Callable[[ClientUpdate], None] | None = None) -> Aggregate:
        """The round's Aggregate (the round's model with its trained tensors aggregated); `visit` sees every update's
        whole model once more (e.g. to score it) in device order."""
        suspects = self.suspects()
        self.clipped = self.clipped_samples()
        aggregate, report = self.combine(suspects, self.completing(evaluate))
        trained, fit = self.strategy.fitted(aggregate, self.head, self.weighed_samples(report.get("excluded", ())))
        report = {**report, **fit}
        if self.clipped:
            report = {**report, "samples_clipped": {device: self.claims[device][0] for device in self.clipped}}
        divergence = {}
        for update in [] if self.strategy.statistics else self.models():  # statistics are no model to measure
            divergence[update.device_id] = layer_divergence(update.weights, trained)
            if visit is not None:
                visit(dataclasses.replace(update, weights=with_trained(self.model, update.weights)))
        return Aggregate(with_trained(self.model, trained), {**report, "suspects": suspects}, divergence, suspects)

    def suspects(self) -> dict[str, list[str]]:
        """Device -> why it is a suspect: its divergence from the base model (suspects_by_divergence), or for a
        statistics strategy's updates (no model to measure) its labels' disagreement with the rest's
        (label_agreement.statistics_suspects)."""
        if self.strategy.statistics:
            return statistics_suspects(self.models())
        return suspects_by_divergence(dict(sorted(self.from_base.items())), self.policy)

    def completing(self, evaluate: Evaluate | None) -> Evaluate | None:
        """`evaluate` of a trained set completed with the round's frozen tensors (a strategy chooses among trained
        sets, the server evaluates whole models)."""
        if evaluate is None:
            return None
        whole = evaluate
        return lambda trained: whole(with_trained(self.model, trained))

    @abstractmethod
    def keep(self, update: ClientUpdate) -> None:
        """Keeps what finish() needs of an update (the update itself, or its share of a running sum)."""

    @abstractmethod
    def combine(self, suspects: dict[str, list[str]], evaluate: Evaluate | None) -> tuple[Weights, dict[str, Any]]:
        """The new global model and the strategy's report (each update weighed with its sample count as
        `self.clipped` lowers it)."""

    @abstractmethod
    def models(self) -> Iterator[ClientUpdate]:
        """The round's updates, in device order."""


class BatchAggregator(RoundAggregator):
    """Keeps every update until the round closes (strategies that need them all, or suspects to leave out)."""

    def __init__(
        self,
        strategy: Strategy,
        base: Weights,
        policy: SuspectPolicy,
        max_share: float = 1.0,
        *,
        model: Weights | None = None,
        head: Weights | None = None,
    ) -> None:
        super().__init__(strategy, base, policy, max_share, model=model, head=head)
        self.updates: dict[str, ClientUpdate] = {}

    def keep(self, update: ClientUpdate) -> None:
        """Holds the update in memory."""
        if update.device_id in self.updates:
            raise ValueError(f"more than one update from device(s) {[update.device_id]}")
        self.updates[update.device_id] = update

    def combine(self, suspects: dict[str, list[str]], evaluate: Evaluate | None) -> tuple[Weights, dict[str, Any]]:
        """The strategy over the updates in device order, without the suspects when the policy excludes them."""
        updates = [self.as_weighed(update) for update in self.models()]
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
        self,
        strategy: StreamingWeightedAverage,
        base: Weights,
        policy: SuspectPolicy,
        scratch: TensorScratch,
        max_share: float = 1.0,
        *,
        model: Weights | None = None,
        head: Weights | None = None,
    ) -> None:
        super().__init__(strategy, base, policy, max_share, model=model, head=head)
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
        """The running mean (suspects are flagged only: leaving them out needs the batch path). When the share cap
        lowers a claim, the sum is taken again over the scratch's views (one model at a time) with the clipped
        counts: the cap needs the round's total, which no update knows on arrival."""
        running = self.running
        if self.clipped:
            running = self.streaming.begin()
            for update in self.models():
                self.streaming.accumulate(running, self.as_weighed(update))
        weights, report = self.streaming.finish(running, self.base)
        return weights, {**report, "streamed": True}

    def models(self) -> Iterator[ClientUpdate]:
        """The absorbed updates, their weights viewed in the scratch, in device order."""
        for device in sorted(self.running.coefficients):
            yield dataclasses.replace(self.kept[device], weights=self.scratch.get(device))


def make_aggregator(
    strategy: Strategy,
    base: Weights,
    policy: SuspectPolicy,
    scratch: TensorScratch,
    max_share: float = 1.0,
    *,
    model: Weights | None = None,
    head: Weights | None = None,
) -> RoundAggregator:
    """Streaming (keeping weights in `scratch`) when the strategy declares it folds updates as they arrive and no
    suspect is to be left out (that needs every update at the close), else batch; either caps one update's share
    of a sample-weighted round at max_share per device it sums, and aggregates the trained set `base` of the
    round's whole `model` (`head`: that model's trained set, which a statistics strategy fits; None: `base`)."""
    if streams(strategy) and not policy.exclude:
        return StreamingAggregator(strategy, base, policy, scratch, max_share, model=model, head=head)
    return BatchAggregator(strategy, base, policy, max_share, model=model, head=head)
