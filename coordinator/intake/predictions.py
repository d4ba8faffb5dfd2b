# Devices' predictions coming in: each batch checked and bounded, then counted per device by hour (no tensors kept).
from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from coordinator.intake.observer import RoundObserver
from protocol import wire
from protocol.prediction_messages import UNCERTAIN, BatchError, PredictionBatch, check_batch
from protocol.reassembly import Dropped

log = logging.getLogger(__name__)

MAX_BATCH_BYTES = 1 << 20  # a device's batch of 256 predictions is ~35 KB
HOURS_KEPT = 24
MAX_CLASSES = 64  # class names counted per device (more are summed under "other")
DRIFT_JUMP = 0.2  # the last hour's uncertain share this far above the hours before flags the device
DRIFT_MIN_RECENT = 20  # predictions the last hour needs before its share is trusted
DRIFT_MIN_BASELINE = 50  # predictions the hours before need
REFUSAL_LOG_SECONDS = 60.0  # a device's refused batches are logged at most once a minute


@dataclass
class HourCounts:
    """One hour of one device's predictions: how many, how many uncertain, and by class name."""

    predictions: int = 0
    uncertain: int = 0
    classes: Counter[str] = field(default_factory=Counter)


def uncertain_jump(recent: HourCounts, baseline: HourCounts) -> bool:
    """Whether the uncertain share of the last hour jumped DRIFT_JUMP above the share of the hours before (the
    camera moved, the light changed), each with enough predictions to be trusted."""
    if recent.predictions < DRIFT_MIN_RECENT or baseline.predictions < DRIFT_MIN_BASELINE:
        return False
    return recent.uncertain / recent.predictions - baseline.uncertain / baseline.predictions >= DRIFT_JUMP


def summed(hours: list[HourCounts]) -> HourCounts:
    """The counts of several hours together."""
    total = HourCounts()
    for hour in hours:
        total.predictions += hour.predictions
        total.uncertain += hour.uncertain
        total.classes.update(hour.classes)
    return total


class DevicePredictions:
    """One device's predictions by the hour they arrived at the coordinator (its own clock is not trusted), the
    newest HOURS_KEPT hours."""

    def __init__(self) -> None:
        self.hours: dict[int, HourCounts] = {}
        self.total = 0
        self.serving_version = -1

    def add(self, batch: PredictionBatch, now: float) -> None:
        """Counts a checked batch as arrived at `now`."""
        hour = self.hours.setdefault(int(now // 3600), HourCounts())
        hour.predictions += len(batch)
        hour.uncertain += sum(1 for value in batch.uncertainties if value > UNCERTAIN)
        for name in batch.class_names:
            key = name if name in hour.classes or len(hour.classes) < MAX_CLASSES else "other"
            hour.classes[key[:64]] += 1
        self.total += len(batch)
        self.serving_version = batch.serving_version
        for old in sorted(self.hours)[:-HOURS_KEPT]:
            del self.hours[old]

    def summary(self, now: float) -> dict[str, Any]:
        """Predictions in the last hour, the class mix and uncertain share over the hours kept, the last hour's
        uncertain share and the hours' before, whether it jumped (drift), and each kept hour's count and uncertain
        share (its start in Unix seconds): the device over time."""
        current = int(now // 3600)
        kept = [counts for hour, counts in self.hours.items() if current - HOURS_KEPT < hour <= current]
        recent = self.hours.get(current, HourCounts())
        baseline = summed([counts for hour, counts in self.hours.items() if current - HOURS_KEPT < hour < current])
        every = summed(kept)
        return {
            "total": self.total,
            "per_hour": recent.predictions,
            "serving_version": self.serving_version,
            "class_mix": {name: count / every.predictions for name, count in every.classes.most_common()}
            if every.predictions
            else {},
            "uncertain_share": share(every),
            "uncertain_share_last_hour": share(recent),
            "uncertain_share_before": share(baseline),
            "drift": uncertain_jump(recent, baseline),
            "hours": [
                {"hour": hour * 3600, "predictions": counts.predictions, "uncertain_share": share(counts)}
                for hour, counts in sorted(self.hours.items())
                if current - HOURS_KEPT < hour <= current
            ],
        }


def share(counts: HourCounts) -> float | None:
    """The uncertain share of some counts (None without predictions)."""
    return counts.uncertain / counts.predictions if counts.predictions else None


class PredictionIntake:
    """Takes devices' prediction batches off their predictions topics: each decoded within MAX_BATCH_BYTES,
    checked (`check_batch`) and bound to the device its topic names, then handed to the observer. A refused batch is
    counted and logged (at most once a minute per device, its reason bounded); nothing a device sends raises.
    Given the fleet's `class_names`, a batch whose class is not one of them is refused too."""

    def __init__(self, observer: RoundObserver, class_names: Sequence[str] = ()) -> None:
        self.observer = observer
        self.class_names = tuple(class_names)
        self._logged: dict[str, float] = {}

    def on_predictions(self, device_id: str, payload: bytes, dropped: Dropped | None) -> None:
        """One message of a device's predictions topic."""
        if dropped is not None:
            self.refuse(device_id, f"dropped in chunks: {dropped.reason}")
            return
        try:
            batch = check_batch(wire.decode(payload, PredictionBatch, MAX_BATCH_BYTES), self.class_names)
        except (wire.WireError, BatchError) as error:
            self.refuse(device_id, str(error))
            return
        if batch.device_id != device_id:
            self.refuse(device_id, f"batch names device {wire.shown(batch.device_id)}")
            return
        self.observer.predictions_received(device_id, batch)

    def refuse(self, device_id: str, reason: str) -> None:
        """Counts a refused batch and logs it unless this device's last refusal was logged under a minute ago."""
        self.observer.predictions_refused(device_id)
        now = time.monotonic()
        if now - self._logged.get(device_id, -math.inf) >= REFUSAL_LOG_SECONDS:
            self._logged[device_id] = now
            log.warning("predictions refused device=%s reason=%s", device_id, reason[:200])
