# The fleet's serving version: each committed round decided at the promotion gate, the store's version published.
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from coordinator.rounds.promotion import ABANDONED, GateEvidence, PromotionGate, Verdict, verdict
from coordinator.rounds.publisher import RetainedPublisher
from coordinator.storage.serving_history import (
    GATE,
    HELD,
    PERSON,
    PROMOTED,
    ROLLED_BACK,
    ServingDecision,
    ServingEvent,
)
from coordinator.storage.store import RoundRecord, RunStore
from protocol.errors import UsageError
from protocol.serving_messages import ServingMessage
from protocol.tensors import weights_hash

log = logging.getLogger(__name__)

W0_ACCURACY = "w0_accuracy"  # the run config's key of W0's test accuracy
W0_CLASS_ACCURACY = "w0_class_accuracy"  # ... and of its accuracy on each class
POLL_SECONDS = 1.0  # how often a running coordinator looks for a person's promote or rollback in the store
# What the gate reads of a round: the paired tables of (candidate version, serving version) on both test sets.
Judge = Callable[[int, int], GateEvidence]


def abandoned(record: RoundRecord) -> bool:
    """Whether a committed round was a secure round whose sum was refused (its model is the one it started from)."""
    return bool(record.metrics.get("secure_aggregation") == ABANDONED)


class ServingKeeper:
    """Keeps the serving version apart from the latest round's model: after each commit the gate decides the round
    from what `judge` says of it and the version serving (stored with its reason), and whatever the store says serves (the gate's promotions, a person's promote or
    rollback from another process) is published: its model and bundle retained on their hash topics for as long
    as it serves, then one retained `ServingMessage`. A restarted coordinator publishes the stored version."""

    def __init__(
        self,
        store: RunStore,
        publisher: RetainedPublisher,
        gate: PromotionGate,
        class_names: Sequence[str],
        judge: Judge,
        publish_predictions: bool = False,
    ) -> None:
        self.store = store
        self.publisher = publisher
        self.gate = gate
        self.judge = judge
        self.class_names = tuple(class_names)
        self.publish_predictions = publish_predictions
        self.published: int | None = None
        self.polled = 0.0

    def refresh(self) -> None:
        """Decides every committed round the gate has not (in order), then publishes the serving version if it is
        not the one this process published last."""
        for round_id in self.store.serving.undecided_rounds():
            self.decide(round_id)
        self.publish_current()
        self.polled = time.monotonic()

    def poll(self) -> None:
        """`refresh`, at most once every POLL_SECONDS (the round loop calls it while it waits for messages)."""
        if time.monotonic() - self.polled >= POLL_SECONDS:
            self.refresh()

    def decide(self, round_id: int) -> None:
        """The gate's decision on one committed round against the version serving, judged outside the store's
        transaction; stored only if that version still serves then (a person's promote or rollback in between
        leaves the round for the next refresh to judge again)."""
        record = next(each for each in self.store.rounds() if each.round_id == round_id)
        serving = self.store.serving.serving_version()
        judged = None if serving == round_id else self.verdict_on(record, serving)

        def decision(stack: list[int]) -> ServingDecision | None:
            if stack[-1] == round_id:
                return ServingDecision(round_id, HELD, "it serves already", GATE)
            if stack[-1] != serving or judged is None:
                return None
            return ServingDecision(round_id, PROMOTED if judged.promote else HELD, judged.reason, GATE)

        event = self.store.serving.record(decision)
        if event is not None:
            log.info(
                "serving decision round=%d decision=%s serving=%d reason=%s",
                *(event.round_id, event.decision, event.serving, event.reason),
            )

    def verdict_on(self, record: RoundRecord, serving: int) -> Verdict:
        """The gate's verdict on a committed round against the serving version (an abandoned round: held)."""
        if abandoned(record):
            return Verdict(False, "the round was abandoned: its model is the one it started from")
        return verdict(self.gate, self.judge(record.round_id, serving), self.class_names)

    def publish_current(self) -> None:
        """Publishes the store's serving version unless it is the one published last."""
        version = self.store.serving.serving_version()
        if version == self.published:
            return
        weights = self.store.checkpoints.load(version)
        model_hash = weights_hash(weights)
        change = self.store.serving.last_change()
        promoted_at = change.recorded_at if change is not None and change.serving == version else time.time()
        message = ServingMessage(self.publisher.run_id, version, model_hash, promoted_at, self.publish_predictions)
        self.publisher.publish_serving(message, weights)
        self.published = version
        log.info("serving version published version=%d model=%s", version, model_hash[:12])


def version_name(version: int) -> str:
    """How a person reads a version: W0 or its round."""
    return "W0 (round 0)" if version == 0 else f"round {version}"


def promote_round(store: RunStore, round_id: int) -> ServingEvent:
    """A person's promotion of a committed round (0: W0) to serving, stored for the running (or next) coordinator
    to publish; a UsageError in one line for a round that is not committed, was abandoned, or serves already."""
    record = next((each for each in store.rounds() if each.round_id == round_id), None)
    if round_id != 0 and record is None:
        last = store.last_committed_round()
        committed = "none yet" if last is None else f"rounds 1 to {last}"
        raise UsageError(f"--round {round_id}: no such committed round (the run has committed {committed})")
    if record is not None and abandoned(record):
        raise UsageError(f"--round {round_id}: the round was abandoned, its model is the one it started from")

    def decision(stack: list[int]) -> ServingDecision:
        if stack[-1] == round_id:
            raise UsageError(f"--round {round_id}: {version_name(round_id)} serves already")
        return ServingDecision(round_id, PROMOTED, "promoted by a person", PERSON)

    return stored(store.serving.record(decision))


def roll_back(store: RunStore) -> ServingEvent:
    """A person's rollback: the version that served before the current one serves again, stored for the running
    (or next) coordinator to publish; a UsageError when no earlier version served."""

    def decision(stack: list[int]) -> ServingDecision:
        if len(stack) < 2:
            raise UsageError(f"no earlier version to roll back to: {version_name(stack[-1])} is the first that served")
        return ServingDecision(stack[-1], ROLLED_BACK, f"rolled back by a person to {version_name(stack[-2])}", PERSON)

    return stored(store.serving.record(decision))


def stored(event: ServingEvent | None) -> ServingEvent:
    """The event a person's decision stored (one always is: only an exception stores none)."""
    if event is None:
        raise ValueError("a person's serving decision stored nothing")
    return event
