# Closing a round: the aggregate, its evaluation, and one atomic commit of the checkpoint and the round's records.
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

from coordinator.aggregation import ClientUpdate
from coordinator.evaluation import Evaluator, TestScores
from coordinator.intake import RoundCollector
from coordinator.observer import RoundResult
from coordinator.round_aggregator import Aggregate, RoundAggregator
from coordinator.store import DeviceRoundRecord, RoundRecord, RunStore, StrategyState
from coordinator.strategies import Strategy
from edge_agent.tensors import Weights

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundTiming:
    """When a round opened: wall-clock for the records, monotonic for durations."""

    wall: float
    monotonic: float


def latest_device_labels(store: RunStore) -> dict[str, int]:
    """Each device's oracle-label count as of its last accepted update, so a resumed run counts labels right."""
    return {record.device_id: record.acquired_labels for record in store.device_rounds() if record.accepted}


class RoundCloser:
    """Turns a collected round into the next global model: aggregate, evaluate, commit (checkpoint first)."""

    def __init__(
        self, store: RunStore, strategy: Strategy, evaluator: Evaluator, evaluate_devices: bool, base_labels: int
    ) -> None:
        self.store = store
        self.strategy = strategy
        self.evaluator = evaluator
        self.evaluate_devices = evaluate_devices
        self.base_labels = base_labels
        self.device_labels = latest_device_labels(store)
        self.restore_strategy_state()

    def restore_strategy_state(self) -> None:
        """Gives a stateful strategy the state committed with the last round, so a restart continues it."""
        stored = self.store.latest_strategy_state()
        if stored is None:
            return
        if stored.strategy != self.strategy.name:
            raise ValueError(
                f"the run in {self.store.run_dir} holds state of strategy {stored.strategy!r}; "
                f"it cannot resume with {self.strategy.name!r}"
            )
        self.strategy.load_state(stored.state)
        log.info("strategy state restored strategy=%s", stored.strategy)

    def close(
        self, collector: RoundCollector, aggregator: RoundAggregator, timing: RoundTiming, extra: dict[str, Any]
    ) -> tuple[Weights, RoundResult]:
        """Aggregates, evaluates and commits the round; `extra` goes into the round's report (participants) and
        metrics (presence)."""
        device_scores: dict[str, TestScores] = {}

        def score(update: ClientUpdate) -> None:
            if self.evaluate_devices:
                device_scores[update.device_id] = self.evaluator.test_scores(update.weights)

        aggregation_started = time.monotonic()
        aggregate = aggregator.finish(self.evaluator.selection_accuracy, score)
        report = {**aggregate.report, **extra.get("report", {})}
        report["aggregation_seconds"] = time.monotonic() - aggregation_started
        for device, layers in aggregate.suspects.items():
            log.warning("suspect update round=%d device=%s layers=%s", collector.round_id, device, ",".join(layers))
        scores = self.evaluator.test_scores(aggregate.weights)
        for update in collector.accepted.values():
            self.device_labels[update.device_id] = update.acquired_labels
        metrics = {
            **extra.get("metrics", {}),
            "class_accuracy": scores.per_class,
            "device_class_accuracy": {device: score.per_class for device, score in device_scores.items()},
        }
        device_accuracy = {device: score.accuracy for device, score in device_scores.items()}
        labels = self.base_labels + sum(self.device_labels.values())
        record = RoundRecord(
            collector.round_id,
            timing.wall,
            time.time(),
            "",
            scores.accuracy,
            labels,
            len(collector.accepted),
            collector.rejection_count,
            report,
            metrics,
        )
        self.commit(collector, aggregate, record, device_accuracy)
        result = RoundResult(
            collector.round_id,
            scores.accuracy,
            device_accuracy,
            labels,
            aggregate.divergence,
            time.monotonic() - timing.monotonic,
            dict(collector.rejected),
            report,
            aggregate.suspects,
        )
        return aggregate.weights, result

    def commit(
        self, collector: RoundCollector, aggregate: Aggregate, record: RoundRecord, device_accuracy: dict[str, float]
    ) -> None:
        """Checkpoints the new global model, then commits the round (its record completed with the checkpoint's
        hash), its per-device records and the strategy's state in one transaction."""
        model_hash = self.store.save_checkpoint(collector.round_id, aggregate.weights)
        devices = [
            DeviceRoundRecord(
                collector.round_id,
                device,
                True,
                "",
                update.num_samples,
                list(update.class_counts),
                device_accuracy.get(device),
                aggregate.divergence.get(device, {}),
                collector.sizes.get(device, 0),
                time.time(),
                update.acquired_labels,
            )
            for device, update in sorted(collector.accepted.items())
        ]
        state = self.strategy.state()
        strategy_state = None if state is None else StrategyState(self.strategy.name, state)
        self.store.commit_round(dataclasses.replace(record, model_hash=model_hash), devices, strategy_state)
