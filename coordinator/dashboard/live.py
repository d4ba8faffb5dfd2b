# What the running coordinator knows that the store does not: presence, the last ack of each device, counters.
from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field

from coordinator.intake.observer import RoundObserver, RoundResult
from coordinator.intake.predictions import FleetPredictions, PredictionKeeper
from coordinator.intake.validation import Rejection
from coordinator.storage.store import RunStore
from protocol import messages
from protocol.prediction_messages import PredictionBatch


@dataclass
class DevicePresence:
    """A device as the coordinator last heard it: its status and when any message of it arrived."""

    state: str = "unknown"
    last_seen: float = 0.0
    profile: str = ""
    labelled: int = 0
    status_round: int = 0
    peak_rss_mb: float = 0.0
    part_restarts: int = 0
    set_aside: int = 0


@dataclass
class UpdateAnswer:
    """The last update a device sent and how it was answered."""

    round_id: int
    size: int
    accepted: bool
    reason: str
    answered_at: float


@dataclass
class Counters:
    """Run totals since this coordinator process started, for /metrics."""

    rounds_completed: int = 0
    updates_accepted: int = 0
    rejected_by_kind: dict[str, int] = field(default_factory=dict)
    bytes_received: int = 0
    aggregation_seconds_sum: float = 0.0
    aggregations: int = 0
    dp_epsilon: float | None = None  # a private run: the epsilon its last committed round left spent
    predictions_received: int = 0
    predictions_refused: int = 0  # batches


class LiveState(RoundObserver):
    """The coordinator's live view for the dashboard; updated from the coordinator loop, read from HTTP threads."""

    def __init__(self, total_rounds: int) -> None:
        super().__init__()
        self.total_rounds = total_rounds
        self._lock = threading.Lock()
        self._devices: dict[str, DevicePresence] = {}
        self._answers: dict[str, UpdateAnswer] = {}
        self._counters = Counters()
        self._round = 0
        self._phase = "starting"
        self._round_opened_at = 0.0
        self._needed = 0
        self._predictions = FleetPredictions()
        self._keeper: PredictionKeeper | None = None

    def device_status(self, device_id: str, status: messages.Status | None) -> None:
        """Records presence: 'offline' comes from the device or from its last will; None forgets the device."""
        with self._lock:
            if status is None:
                self._devices.pop(device_id, None)
                return
            presence = self._devices.setdefault(device_id, DevicePresence())
            presence.state, presence.last_seen = status.state, time.time()
            presence.profile = status.profile or presence.profile
            presence.labelled, presence.status_round = status.labelled, status.round_id
            presence.peak_rss_mb = status.peak_rss_mb or presence.peak_rss_mb
            presence.part_restarts, presence.set_aside = status.part_restarts, status.set_aside

    def update_answered(self, device_id: str, round_id: int, size: int, rejection: Rejection | None) -> None:
        """Keeps the device's last answer and counts the update by outcome (rejections by kind) and its bytes."""
        with self._lock:
            now = time.time()
            reason = "" if rejection is None else rejection.reason
            self._answers[device_id] = UpdateAnswer(round_id, size, rejection is None, reason, now)
            if device_id in self._devices:
                self._devices[device_id].last_seen = now
            self._counters.bytes_received += size
            if rejection is None:
                self._counters.updates_accepted += 1
            else:
                kind = str(rejection.kind)
                self._counters.rejected_by_kind[kind] = self._counters.rejected_by_kind.get(kind, 0) + 1

    def predictions_received(self, device_id: str, batch: PredictionBatch) -> None:
        """Counts a device's predictions by the hour they arrived (devices beyond MAX_PREDICTING_DEVICES are only
        counted in the total)."""
        with self._lock:
            self._counters.predictions_received += len(batch)
        self._predictions.add(device_id, batch, time.time())

    def predictions_refused(self, device_id: str) -> None:
        """Counts a refused batch."""
        with self._lock:
            self._counters.predictions_refused += 1

    def predictions(self) -> dict[str, dict]:
        """Device id -> its predictions' summary (per hour, class mix, uncertain shares, drift), now."""
        return self._predictions.summaries(time.time())

    def keep_in(self, store: RunStore) -> None:
        """Takes back the prediction counts the run's store kept and keeps them there (PredictionKeeper)."""
        self._keeper = PredictionKeeper(self._predictions, store.predictions, self.health)
        self._keeper.start()

    def close(self) -> None:
        """Writes the prediction counts a last time."""
        if self._keeper is not None:
            self._keeper.close()
            self._keeper = None

    def round_opened(self, round_id: int, needed: int) -> None:
        """The round now collecting updates and how many close it."""
        with self._lock:
            self._round, self._phase, self._needed, self._round_opened_at = round_id, "collecting", needed, time.time()

    def round_closed(self, result: RoundResult) -> None:
        """Counts the round and its aggregation time; the last round closing finishes the run."""
        with self._lock:
            self._counters.rounds_completed += 1
            self._counters.aggregation_seconds_sum += float(result.report.get("aggregation_seconds", 0.0))
            self._counters.aggregations += 1
            if "dp" in result.report:
                self._counters.dp_epsilon = float(result.report["dp"]["epsilon"])
            self._phase = "finished" if result.round_id >= self.total_rounds else "closed"

    def device_health(self) -> dict[str, tuple[int, int]]:
        """Device id -> its parts' restarts and set-aside messages, as its status last said."""
        with self._lock:
            return {device: (p.part_restarts, p.set_aside) for device, p in self._devices.items()}

    def devices(self) -> dict[str, dict]:
        """Device id -> presence, last answer and predictions' summary, as plain data."""
        predictions = self.predictions()
        with self._lock:
            ids = sorted(set(self._devices) | set(self._answers) | set(predictions))
            return {
                device: {
                    **asdict(self._devices.get(device, DevicePresence())),
                    "last_update": asdict(self._answers[device]) if device in self._answers else None,
                    "predictions": predictions.get(device),
                }
                for device in ids
            }

    def online_count(self) -> int:
        """Devices whose last status is anything but 'offline'."""
        with self._lock:
            return sum(1 for presence in self._devices.values() if presence.state != "offline")

    def progress(self) -> dict:
        """The current round, its phase, when it opened and how many updates close it."""
        with self._lock:
            return {
                "round": self._round,
                "phase": self._phase,
                "round_opened_at": self._round_opened_at,
                "needed": self._needed,
                "total_rounds": self.total_rounds,
            }

    def counters(self) -> Counters:
        """A copy of the run totals."""
        with self._lock:
            return Counters(**{**asdict(self._counters), "rejected_by_kind": dict(self._counters.rejected_by_kind)})
