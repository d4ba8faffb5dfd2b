# Asynchronous rounds (FedBuff): fold every K arriving updates, each down-weighted by its staleness, into a new version.
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from coordinator.asynchronous.buffer import BufferSum, delta_of
from coordinator.asynchronous.intake import AsyncPolicy, Buffered, Taken, VersionCollector
from coordinator.intake.observer import RoundResult
from coordinator.intake.round_aggregator import RoundAggregator, SuspectPolicy
from coordinator.intake.scratch import TensorScratch
from coordinator.intake.update_intake import RoundCollector
from coordinator.intake.validation import Rejection, decoded
from coordinator.rounds.closing import RoundTiming
from coordinator.rounds.loop import Coordinator, OpenRound, RoundParts, round_expectation
from coordinator.rounds.rules import RoundRules
from coordinator.strategies.aggregate import ClientUpdate
from coordinator.strategies.contract import Evaluate, Strategy
from coordinator.strategies.registry import STRATEGIES
from protocol.errors import UsageError
from protocol.mqtt import MqttSession
from protocol.tensors import Weights, weights_hash

log = logging.getLogger(__name__)


def check_async_settings(strategy: str, suspects: SuspectPolicy, participation: float) -> None:
    """ValueError for settings asynchronous rounds cannot honour (they fold by FedBuff's rule, not a strategy's)."""
    asynchronous = STRATEGIES.select(lambda known: known.asynchronous)
    if strategy in STRATEGIES and STRATEGIES.get(strategy).statistics:
        raise UsageError(
            f"--mode async folds models, and --strategy {strategy} fits the head from every device's latest "
            f"statistics: drop --mode async, or average trained heads (--strategy {' or '.join(asynchronous)} "
            "--local-rule kept-labels)"
        )
    if strategy not in asynchronous:
        raise UsageError(
            f"--mode async folds by FedBuff's rule (a staleness-weighted plain mean of the updates' changes, avefl's "
            f"asynchronous form): use --strategy {' or '.join(asynchronous)}, not {strategy[:64]!r}"
        )
    if suspects.exclude:
        raise UsageError("--mode async flags suspects but cannot leave them out: drop --exclude-suspects")
    if participation < 1.0:
        raise UsageError("--mode async takes updates from every device: drop --participation")


class BufferedAggregator(RoundAggregator):
    """One version's fold: absorbs each buffered update as its delta rebased onto the current version (so suspects
    are judged on what the update changes, however old its base), and folds them by FedBuff's rule. The devices'
    own models are viewed in the buffer's scratch (`trained`), not decoded again."""

    def __init__(
        self,
        strategy: Strategy,
        base: Weights,
        policy: SuspectPolicy,
        server_lr: float,
        trained: TensorScratch,
        model: Weights,
    ) -> None:
        super().__init__(strategy, base, policy, model=model)
        self.server_lr = server_lr
        self.trained = trained
        self.buffer = BufferSum()
        self.staleness: dict[str, int] = {}
        self.deltas: dict[str, Weights] = {}
        self.entries: dict[str, Buffered] = {}
        self.folded: list[dict[str, Any]] = []

    def absorb_entry(self, entry: Buffered, trained_from: Weights, staleness: int) -> None:
        """Takes one buffered update: the trained set of the version it trained from and how many versions old that
        is."""
        device = entry.update.device_id
        delta = delta_of(self.trained.get(device), trained_from)
        self.deltas[device], self.staleness[device], self.entries[device] = delta, staleness, entry
        rebased = {name: self.base[name].astype(change.dtype) + change for name, change in delta.items()}
        self.absorb(ClientUpdate(device, rebased, entry.update.num_samples, entry.update.metrics))
        self.folded.append(
            {"device": device, "base": entry.base, "staleness": staleness}
            | {"update_id": entry.update.update_id, "digest": entry.digest}
        )

    def keep(self, update: ClientUpdate) -> None:
        """Adds s(tau) times the update's delta to the buffer's sum."""
        self.buffer.add(update.device_id, self.deltas.pop(update.device_id), self.staleness[update.device_id])

    def combine(self, suspects: dict[str, list[str]], evaluate: Evaluate | None) -> tuple[Weights, dict[str, Any]]:
        """W_v + eta_g * sum_i s(tau_i) Delta_i / K, and what went into it."""
        weights = self.buffer.fold(self.base, self.server_lr)
        report = {"buffered": True, "server_lr": self.server_lr, "buffer": len(self.folded), "folded": self.folded}
        return weights, report | {"staleness_weights": self.buffer.weights()}

    def models(self) -> Iterator[ClientUpdate]:
        """The devices' own models, viewed in the scratch, in device order."""
        for device in sorted(self.staleness):
            update = self.entries[device].update
            yield ClientUpdate(device, self.trained.get(device), update.num_samples, update.metrics)


class AsyncCoordinator(Coordinator):
    """Runs a fleet's versions asynchronously: announces version v (as round v + 1), takes updates trained from
    any of the last S + 1 versions, and commits version v + 1 as soon as K are buffered (checkpoint, record with
    each update's staleness, test accuracy), then announces it. A device trains on the newest model it has.
    A restarted process reloads the window of models and takes the buffers back from the spool."""

    def __init__(
        self, fleet: str, session: MqttSession, rules: RoundRules, parts: RoundParts, policy: AsyncPolicy
    ) -> None:
        super().__init__(fleet, session, rules, parts)
        self.policy = policy

    def run(self, global_weights: Weights, first_round: int, on_round: Callable[[RoundResult], None]) -> Weights:
        """Commits versions first_round..policy.rounds from `global_weights` (version first_round - 1)."""
        collector = self.resumed_collector(first_round - 1, global_weights)
        while collector.version < self.rules.policy.rounds:
            global_weights, result = self.run_version(collector, global_weights)
            on_round(result)
        self.parts.publisher.announce_final(self.rules.policy.rounds, weights_hash(global_weights), self.rules.recipe)
        return global_weights

    def resumed_collector(self, version: int, weights: Weights) -> VersionCollector:
        """The collector at `version`: the window's older models from their checkpoints, the updates folded into
        recent versions (so redeliveries are recognised), and the buffers a killed predecessor spooled."""
        expectation = round_expectation(self.rules, self.parts.closer.strategy, version + 1, weights)
        store = self.parts.intake.store
        collector = VersionCollector(expectation, self.policy, version, weights, store.spool.folder)
        for older in range(max(0, version - self.policy.max_staleness), version):
            collector.remember(older, store.checkpoints.load(older))
        for record in store.rounds()[-(self.policy.max_staleness + 1) :]:
            for item in record.report.get("folded", []):
                taken = Taken(item["update_id"], item["digest"], record.round_id)
                collector.folded[(item["device"], item["base"])] = taken
        for target in (version + 1, version + 2):
            for device_id, payload in store.spool.items(target):
                try:  # decoding each spooled payload again: recovery, where an accepted update is decoded twice
                    update, _ = collector.offer(decoded(device_id, payload, collector.expectation))
                    if update.round_id != target:  # its first update no longer valid: it moves up a buffer
                        store.spool.add(update.round_id, device_id, payload)
                    log.info("resumed spooled update device=%s round=%d", device_id, update.round_id)
                except Rejection as rejection:
                    log.warning("spooled update no longer valid device=%s reason=%s", device_id, rejection.reason)
        return collector

    def run_version(self, collector: VersionCollector, weights: Weights) -> tuple[Weights, RoundResult]:
        """Announces the current version, collects until the buffer is full (or the deadline passes with at least
        the minimum), then folds and commits the next version."""
        timing = RoundTiming(time.time(), time.monotonic())
        aggregator = BufferedAggregator(
            self.parts.closer.strategy,
            collector.expectation.base,
            self.rules.suspects,
            self.policy.server_lr,
            collector.tensors,
            weights,
        )
        self.announce_version(collector.version, weights)
        self.collect_buffer(collector, aggregator, timing)
        return self.fold(collector, aggregator, timing)

    def announce_version(self, version: int, weights: Weights) -> None:
        """Retains version's model (bundle, encoder) and announces it as round version + 1."""
        model_hash, recipe = weights_hash(weights), self.rules.recipe
        self.parts.publisher.publish_model(weights, model_hash)
        self.parts.publisher.publish_encoder(recipe.encoder)
        deadline = time.time() + self.rules.policy.round_timeout
        self.parts.publisher.announce(version + 1, model_hash, recipe, deadline, [])
        self.parts.observer.round_opened(version + 1, self.policy.buffer)

    def collect_buffer(self, collector: VersionCollector, aggregator: BufferedAggregator, timing: RoundTiming) -> None:
        """Handles messages until K updates are buffered, or the deadline passes with at least the minimum."""
        opened, minimum = OpenRound(collector, aggregator, []), self.rules.policy.min_devices
        deadline = timing.monotonic + self.rules.policy.round_timeout
        while not collector.full():
            if time.monotonic() >= deadline:
                have = len(collector.buffer)
                log.warning("buffer deadline passed round=%d buffered=%d needed=%d", collector.round_id, have, minimum)
                if have >= minimum:
                    return
                deadline = time.monotonic() + self.rules.policy.round_timeout
            self.handle_next(opened)

    def fold(
        self, collector: VersionCollector, aggregator: BufferedAggregator, timing: RoundTiming
    ) -> tuple[Weights, RoundResult]:
        """Folds the buffer into the next version through the round closer (aggregate, evaluate, commit)."""
        entries = sorted(collector.buffer.values(), key=lambda entry: entry.update.device_id)
        for entry in entries:
            trained_from = collector.expectation_of(entry.base).base
            aggregator.absorb_entry(entry, trained_from, collector.version - entry.base)
        record = RoundCollector(
            collector.expectation,
            accepted={entry.update.device_id: entry.update for entry in entries},
            digests={entry.update.device_id: entry.digest for entry in entries},
            sizes={entry.update.device_id: entry.size for entry in entries},
            rejected=dict(collector.rejected),
            rejection_count=collector.rejection_count,
        )
        presence = {"quorum": self.policy.buffer, "stragglers": [], "offline": self.parts.presence.missing([])}
        weights, result = self.parts.closer.close(record, aggregator, timing, presence, [])
        collector.fold_next(weights)
        self.refresh_serving()
        staleness = ",".join(str(item["staleness"]) for item in aggregator.folded)
        counts = (result.round_id, len(entries), staleness, result.accuracy, result.seconds)
        log.info("version committed round=%d folded=%d staleness=%s accuracy=%.4f seconds=%.1f", *counts)
        self.parts.observer.round_closed(result)
        return weights, result
