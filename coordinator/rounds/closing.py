# Closing a round: the aggregate, its evaluation, and one atomic commit of the checkpoint and the round's records.
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from coordinator.intake.observer import PEAK_RSS, RoundResult
from coordinator.intake.round_aggregator import Aggregate, RoundAggregator
from coordinator.intake.update_intake import RoundCollector
from coordinator.rounds.evaluation import RoundScores, TestScores
from coordinator.storage.store import SECURE_LABELS, DeviceRoundRecord, RoundRecord, RunStore, StrategyState
from coordinator.strategies.aggregate import ClientUpdate
from coordinator.strategies.contract import Strategy
from coordinator.strategies.pooled_head import CLASS_SHARES
from protocol.dp import DP_SGD_EPSILON_METRIC
from protocol.tensors import Weights

log = logging.getLogger(__name__)
DEVICE_EPSILON = "device_dp_sgd_epsilon"  # round metrics: each DP-SGD device's example-level epsilon, as it reported
# Round metrics: the server's test set's size, and the round's model on the field set (accuracy, per class, size).
TEST_IMAGES, FIELD_ACCURACY, FIELD_CLASS_ACCURACY, FIELD_IMAGES = (
    "test_images",
    "field_accuracy",
    "field_class_accuracy",
    "field_images",
)


@dataclass(frozen=True)
class RoundTiming:
    """When a round opened: wall-clock for the records, monotonic for durations."""

    wall: float
    monotonic: float


class RoundEvaluator(Protocol):
    """What closing a round asks of the server's data (coordinator.rounds.evaluation.Evaluator; a relay's NoEvaluation)."""

    def test_scores(self, weights: Weights) -> TestScores:
        """A model's test accuracy, overall and per class."""

    def round_scores(self, version: int, weights: Weights) -> RoundScores:
        """A committed version's scores on the server's test set and on the field set."""

    def selection_accuracy(self, weights: Weights) -> float:
        """A model's BNN accuracy on the selection split (strategies that choose among models)."""


def latest_device_labels(store: RunStore) -> dict[str, int]:
    """Each device's oracle-label count as of its last accepted update, so a resumed run counts labels right."""
    return {record.device_id: record.acquired_labels for record in store.device_rounds() if record.accepted}


def label_shares(store: RunStore) -> list[float]:
    """The fleet's human labels per class as shares after the last committed round: the shares a statistics fit
    reports (exact, and the only ones a secure round gives), else the devices' counts in that round's accepted
    updates summed; [] before any round or without counts."""
    rounds = store.rounds()
    if not rounds:
        return []
    reported = rounds[-1].report.get(CLASS_SHARES)
    if isinstance(reported, list):
        return [float(share) for share in reported]
    counts = [record.class_counts for record in store.device_rounds(rounds[-1].round_id) if record.accepted]
    totals = [float(sum(column)) for column in zip(*(count for count in counts if count))]
    total = sum(totals)
    return [value / total for value in totals] if total > 0 else []


def device_epsilons(collector: RoundCollector) -> dict[str, dict[str, float]]:
    """{DEVICE_EPSILON: {device: epsilon}} for the accepted devices whose update reports a DP-SGD epsilon (each
    device accounts its own examples), or {} when none does, so a round without DP-SGD keeps its record."""
    spent = {
        device: float(update.metrics[DP_SGD_EPSILON_METRIC])
        for device, update in sorted(collector.accepted.items())
        if DP_SGD_EPSILON_METRIC in update.metrics
    }
    return {DEVICE_EPSILON: spent} if spent else {}


class RoundCloser:
    """Turns a collected round into the next global model: aggregate, evaluate, commit (checkpoint first); a stateful
    strategy continues from the state committed with the last round (unless `restore` is False)."""

    def __init__(
        self,
        store: RunStore,
        strategy: Strategy,
        evaluator: RoundEvaluator,
        evaluate_devices: bool,
        base_labels: int,
        *,
        restore: bool = True,
    ) -> None:
        self.store = store
        self.strategy = strategy
        self.evaluator = evaluator
        self.evaluate_devices = evaluate_devices
        self.base_labels = base_labels
        self.device_labels = latest_device_labels(store)
        self.secure_labels = sum(int(record.metrics.get(SECURE_LABELS, 0)) for record in store.rounds())
        if restore:  # a relay's site strategies carry nothing from round to round: it restores none
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
        self.strategy.load_state(stored.state, stored.tensors)
        log.info("strategy state restored strategy=%s", stored.strategy)

    def close(
        self,
        collector: RoundCollector,
        aggregator: RoundAggregator,
        timing: RoundTiming,
        presence: dict[str, Any],
        participants: list[str],
    ) -> tuple[Weights, RoundResult]:
        """Aggregates, evaluates and commits the round; the presence figures go into its metrics, the
        participants (when only some were chosen) into its report."""
        device_scores: dict[str, TestScores] = {}
        aggregation_started = time.monotonic()
        aggregate = aggregator.finish(self.evaluator.selection_accuracy, self.device_scorer(device_scores))
        report = {**aggregate.report, **({"participants": list(participants)} if participants else {})}
        report["aggregation_seconds"] = time.monotonic() - aggregation_started
        for device, layers in aggregate.suspects.items():
            log.warning("suspect update round=%d device=%s layers=%s", collector.round_id, device, ",".join(layers))
        scores = self.evaluator.round_scores(collector.round_id, aggregate.weights)
        record = self.round_record(collector, timing, scores, report, dict(presence), device_scores)
        device_accuracy = {device: score.accuracy for device, score in device_scores.items()}
        self.commit(collector, aggregate, record, device_accuracy)
        seconds = time.monotonic() - timing.monotonic
        result = RoundResult(
            *(collector.round_id, scores.test.accuracy, device_accuracy, record.labels, aggregate.divergence, seconds),
            *(dict(collector.rejected), report, aggregate.suspects, self.base_labels, dict(presence.get(PEAK_RSS, {}))),
            *(scores.test.images, scores.field.accuracy, scores.field.images),
        )
        return aggregate.weights, result

    def device_scorer(self, into: dict[str, TestScores]) -> Callable[[ClientUpdate], None]:
        """What the aggregator calls for each device model once the round closes: its test scores, if asked."""

        def score(update: ClientUpdate) -> None:
            if self.evaluate_devices:
                into[update.device_id] = self.evaluator.test_scores(update.weights)

        return score

    def round_record(
        self,
        collector: RoundCollector,
        timing: RoundTiming,
        scores: RoundScores,
        report: dict[str, Any],
        metrics: dict[str, Any],
        device_scores: dict[str, TestScores],
    ) -> RoundRecord:
        """The round's record (its checkpoint hash is filled in at commit), counting every label used so far (a
        secure round's devices report their new labels only as a sum, in its metrics), with its scores on both test
        sets and their sizes (the field set's accuracy None while it holds no image)."""
        for update in collector.accepted.values():
            self.device_labels[update.device_id] = update.acquired_labels
        self.secure_labels += int(metrics.get(SECURE_LABELS, 0))
        metrics["class_accuracy"] = scores.test.per_class
        metrics[TEST_IMAGES] = scores.test.images
        metrics[FIELD_IMAGES] = scores.field.images
        metrics[FIELD_ACCURACY] = scores.field.accuracy if scores.field.images else None
        metrics[FIELD_CLASS_ACCURACY] = scores.field.per_class if scores.field.images else []
        metrics["device_class_accuracy"] = {device: score.per_class for device, score in device_scores.items()}
        metrics.update(device_epsilons(collector))
        labels = self.base_labels + sum(self.device_labels.values()) + self.secure_labels
        accepted, rejected = len(collector.accepted), collector.rejection_count
        return RoundRecord(
            *(collector.round_id, timing.wall, time.time(), "", scores.test.accuracy, labels, accepted, rejected),
            *(report, metrics),
        )

    def commit(
        self, collector: RoundCollector, aggregate: Aggregate, record: RoundRecord, device_accuracy: dict[str, float]
    ) -> None:
        """Checkpoints the new global model, then commits the round (its record completed with the checkpoint's
        hash), its per-device records and the strategy's state in one transaction."""
        model_hash = self.store.checkpoints.save(collector.round_id, aggregate.weights)
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
        strategy_state = None if state is None else StrategyState(self.strategy.name, state, self.strategy.tensors())
        self.store.commit_round(dataclasses.replace(record, model_hash=model_hash), devices, strategy_state)
