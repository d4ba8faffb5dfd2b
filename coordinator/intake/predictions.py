# Devices' predictions coming in: each batch checked and bounded, then counted per device by hour (no tensors kept),
# the counts kept in the run's store in batches so a restart shows the same hour.
from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from coordinator.intake.observer import RoundObserver
from coordinator.storage.prediction_counts import PredictionTable, StoredDevice, StoredHour
from edge_agent.learning.drift import uncertain_jump
from protocol import topics, wire
from protocol.prediction_messages import UNCERTAIN, BatchError, PredictionBatch, check_batch
from protocol.reassembly import Dropped
from protocol.supervision import Health, SupervisedThread

log = logging.getLogger(__name__)

MAX_BATCH_BYTES = 1 << 20  # a device's batch of 256 predictions is ~35 KB
HOURS_KEPT = 24
MAX_PREDICTING_DEVICES = 10000  # devices whose predictions are counted (a fleet's; more are not)
FLUSH_SECONDS = 5.0  # how often the counts changed since are written to the run's store (and once more at the end)
KEEPER = "prediction-counts"  # the keeper's part, as health names it
MAX_CLASSES = 64  # class names counted per device (more are summed under "other")
REFUSAL_LOG_SECONDS = 60.0  # a device's refused batches are logged at most once a minute


@dataclass
class HourCounts:
    """One hour of one device's predictions: how many, how many uncertain, and by class name."""

    predictions: int = 0
    uncertain: int = 0
    classes: Counter[str] = field(default_factory=Counter)


def hour_drifted(recent: HourCounts, baseline: HourCounts) -> bool:
    """Whether the uncertain share of the last hour jumped above the share of the hours before (the camera moved,
    the light changed): the drift test devices apply too (edge_agent.learning.drift.uncertain_jump)."""
    return uncertain_jump(recent.uncertain, recent.predictions, baseline.uncertain, baseline.predictions)


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
        self.changed: set[int] = set()  # the hours counted since they were last kept

    def add(self, batch: PredictionBatch, now: float) -> None:
        """Counts a checked batch as arrived at `now`."""
        self.changed.add(int(now // 3600))
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

    def restore(self, hours: list[StoredHour], device: StoredDevice | None) -> None:
        """Takes back the hours and totals a previous process kept."""
        for row in hours:
            self.hours[row.hour] = HourCounts(row.predictions, row.uncertain, Counter(row.classes))
        if device is not None:
            self.total, self.serving_version = device.total, device.serving_version

    def kept(self, device_id: str) -> tuple[list[StoredHour], StoredDevice]:
        """The hours counted since they were last kept (those still held) and the totals, as rows to keep; from now
        on none has changed."""
        rows = [
            StoredHour(device_id, hour, counts.predictions, counts.uncertain, dict(counts.classes))
            for hour, counts in sorted(self.hours.items())
            if hour in self.changed
        ]
        self.changed = set()
        return rows, StoredDevice(device_id, self.total, self.serving_version)

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
            "drift": hour_drifted(recent, baseline),
            "hours": [
                {"hour": hour * 3600, "predictions": counts.predictions, "uncertain_share": share(counts)}
                for hour, counts in sorted(self.hours.items())
                if current - HOURS_KEPT < hour <= current
            ],
        }


def share(counts: HourCounts) -> float | None:
    """The uncertain share of some counts (None without predictions)."""
    return counts.uncertain / counts.predictions if counts.predictions else None


def first_hour_kept(now: float) -> int:
    """The oldest hour whose counts are kept at `now` (the HOURS_KEPT hours up to the current one)."""
    return int(now // 3600) - HOURS_KEPT + 1


class FleetPredictions:
    """Every device's predictions by hour, at most MAX_PREDICTING_DEVICES devices (a batch of one more is counted
    nowhere), and which changed since they were last kept; the coordinator's loop adds, a page and the keeper read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._devices: dict[str, DevicePredictions] = {}
        self._changed: set[str] = set()

    def add(self, device_id: str, batch: PredictionBatch, now: float) -> None:
        """Counts a device's checked batch as arrived at `now`."""
        with self._lock:
            known = self._devices.get(device_id)
            if known is None and len(self._devices) < MAX_PREDICTING_DEVICES:
                known = self._devices[device_id] = DevicePredictions()
            if known is not None:
                known.add(batch, now)
                self._changed.add(device_id)

    def summaries(self, now: float) -> dict[str, dict[str, Any]]:
        """Device id -> its predictions' summary at `now` (DevicePredictions.summary)."""
        with self._lock:
            return {device: counts.summary(now) for device, counts in sorted(self._devices.items())}

    def restore(self, hours: list[StoredHour], devices: list[StoredDevice]) -> None:
        """Takes back what a previous process kept (devices beyond MAX_PREDICTING_DEVICES left out)."""
        by_device: dict[str, list[StoredHour]] = {}
        for row in hours:
            by_device.setdefault(row.device_id, []).append(row)
        totals = {device.device_id: device for device in devices}
        with self._lock:
            for device_id in sorted(set(by_device) | set(totals))[:MAX_PREDICTING_DEVICES]:
                counts = self._devices.setdefault(device_id, DevicePredictions())
                counts.restore(by_device.get(device_id, []), totals.get(device_id))

    def changes(self) -> tuple[list[StoredHour], list[StoredDevice]]:
        """The hours and totals counted since they were last kept, as rows; from now on none has changed."""
        hours: list[StoredHour] = []
        devices: list[StoredDevice] = []
        with self._lock:
            for device_id in sorted(self._changed):
                rows, totals = self._devices[device_id].kept(device_id)
                hours += rows
                devices.append(totals)
            self._changed = set()
        return hours, devices

    def unkept(self, hours: list[StoredHour], devices: list[StoredDevice]) -> None:
        """Marks rows that `changes` gave as changed again (their write failed): the next write takes them."""
        with self._lock:
            for row in hours:
                self._devices[row.device_id].changed.add(row.hour)
            self._changed.update(device.device_id for device in devices)


class PredictionKeeper:
    """Keeps a fleet's prediction counts in the run's store: `start` takes back the hours kept (the last HOURS_KEPT)
    and starts a supervised thread that writes what changed every `seconds`, in one transaction that also deletes
    the hours no longer kept (the store holds at most HOURS_KEPT hours a device, plus what one interval adds);
    `close` writes once more. A process killed outright (SIGKILL, power) loses what arrived since the last write:
    at most `seconds` of counts. A write that fails is retried at the next (the part restarts under the rule)."""

    def __init__(
        self, counts: FleetPredictions, table: PredictionTable, health: Health, seconds: float = FLUSH_SECONDS
    ) -> None:
        self.counts = counts
        self.table = table
        self.seconds = seconds
        self._thread = SupervisedThread(KEEPER, self._serve, health)

    def start(self) -> None:
        """Takes back the kept hours and starts writing."""
        now = time.time()
        self.counts.restore(self.table.hours(first_hour_kept(now)), self.table.devices())
        self._thread.start()

    def write(self) -> None:
        """Writes what changed since the last write and deletes the hours no longer kept."""
        hours, devices = self.counts.changes()
        try:
            self.table.save(hours, devices, first_hour_kept(time.time()))
        except BaseException:
            self.counts.unkept(hours, devices)
            raise

    def close(self) -> None:
        """Stops the thread and writes what changed since its last write."""
        self._thread.stop()
        self.write()

    def _serve(self, stop: threading.Event) -> None:
        """The keeper's thread: a write every `seconds` until stopped."""
        while not stop.wait(self.seconds):
            self.write()


def relayed_device(relay_id: str, device_id: str) -> str:
    """The name a relay's site device is counted under: the relay's id, then the device's (site fleets name their
    devices independently, so one site's dev-00 is not another's, nor a direct device of the same name)."""
    return f"{relay_id}/{device_id}"


class PredictionIntake:
    """Takes devices' prediction batches off their predictions topics: each decoded within MAX_BATCH_BYTES,
    checked (`check_batch`) and bound to the device its topic names, then handed to the observer. A refused batch is
    counted and logged (at most once a minute per device, its reason bounded); nothing a device sends raises.
    Given the fleet's `class_names`, a batch whose class is not one of them is refused too. The devices named as
    `relays` may pass on their site devices' batches (`on_relayed`)."""

    def __init__(self, observer: RoundObserver, class_names: Sequence[str] = (), relays: Sequence[str] = ()) -> None:
        self.observer = observer
        self.class_names = tuple(class_names)
        self.relays = frozenset(relays)
        self._logged: dict[str, float] = {}

    def on_predictions(self, device_id: str, payload: bytes, dropped: Dropped | None) -> None:
        """One message of a device's predictions topic."""
        batch = self.checked(device_id, payload, dropped)
        if batch is None:
            return
        if batch.device_id != device_id:
            self.refuse(device_id, f"batch names device {wire.shown(batch.device_id)}")
            return
        self.observer.predictions_received(device_id, batch)

    def on_relayed(self, relay_id: str, payload: bytes, dropped: Dropped | None) -> None:
        """One message of a relay's relayed predictions topic: a batch of one of its site devices, counted under
        `relayed_device` (the relay checked it against the site device's topic). Refused from a device not named
        as a relay (`--relay`), as from any device a relay may not speak for."""
        if relay_id not in self.relays:
            self.refuse(relay_id, "relayed predictions from a device not named as a relay (--relay)")
            return
        batch = self.checked(relay_id, payload, dropped)
        if batch is None:
            return
        if not topics.is_identifier(batch.device_id):
            self.refuse(relay_id, f"relayed batch names device {wire.shown(batch.device_id)}, not an identifier")
            return
        self.observer.predictions_received(relayed_device(relay_id, batch.device_id), batch)

    def checked(self, sender: str, payload: bytes, dropped: Dropped | None) -> PredictionBatch | None:
        """The batch a message carries, decoded and checked; None (the sender's batch refused) if it is not one."""
        if dropped is not None:
            self.refuse(sender, f"dropped in chunks: {dropped.reason}")
            return None
        try:
            return check_batch(wire.decode(payload, PredictionBatch, MAX_BATCH_BYTES), self.class_names)
        except (wire.WireError, BatchError) as error:
            self.refuse(sender, str(error))
            return None

    def refuse(self, device_id: str, reason: str) -> None:
        """Counts a refused batch and logs it unless this device's last refusal was logged under a minute ago."""
        self.observer.predictions_refused(device_id)
        now = time.monotonic()
        if now - self._logged.get(device_id, -math.inf) >= REFUSAL_LOG_SECONDS:
            self._logged[device_id] = now
            log.warning("predictions refused device=%s reason=%s", device_id, reason[:200])
