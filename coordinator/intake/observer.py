# What the round machinery tells those who watch it (the dashboard): a closed round's result, and the events.
from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.intake.validation import Rejection
from coordinator.storage.store import RunStore
from protocol import messages
from protocol.prediction_messages import PredictionBatch
from protocol.supervision import Health

PEAK_RSS = "peak_rss_mb"  # a round's metrics key: device -> peak RSS (MB) from its last status


@dataclass(frozen=True)
class RoundResult:
    """What one closed round produced, for progress lines, JSON output and summaries."""

    round_id: int
    accuracy: float
    device_accuracy: dict[str, float]
    labels: int
    divergence: dict[str, dict[str, float]]
    seconds: float
    rejected: dict[str, str]
    report: dict
    suspects: dict[str, list[str]] = field(default_factory=dict)
    server_labels: int = 0  # of `labels`, the server's own (W0's); the rest are the devices'
    peak_rss_mb: dict[str, float] = field(default_factory=dict)  # each device's peak RSS as its last status said
    test_images: int = 0  # how many of the server's test images `accuracy` is measured on
    field_accuracy: float = float("nan")  # the model's accuracy on the field set (NaN: it holds no image yet)
    field_images: int = 0  # how many answered field test images the field set holds


class RoundObserver:
    """Hears what the coordinator sees as it happens: device presence, answered updates, round boundaries, the
    devices' predictions.

    This base hears nothing; the dashboard's live state overrides it. Called from the coordinator's loop only.
    Its `health` is the process's supervised parts' (what the dashboard shows of them).
    """

    def __init__(self) -> None:
        self.health = Health()

    def device_status(self, device_id: str, status: messages.Status | None) -> None:
        """A device's status message arrived (None: its retained status was cleared)."""

    def update_answered(self, device_id: str, round_id: int, size: int, rejection: Rejection | None) -> None:
        """An update of `size` bytes was acked: accepted when rejection is None, else rejected for that reason."""

    def round_opened(self, round_id: int, needed: int) -> None:
        """A round was announced; `needed` accepted updates close it early."""

    def predictions_received(self, device_id: str, batch: PredictionBatch) -> None:
        """A device's checked batch of predictions arrived (on its predictions topic)."""

    def predictions_refused(self, device_id: str) -> None:
        """A device's batch of predictions did not decode or check, and was dropped."""

    def round_closed(self, result: RoundResult) -> None:
        """A round was aggregated, evaluated and committed."""

    def keep_in(self, store: RunStore) -> None:
        """The run's store is open: what the observer keeps across restarts is taken back from it and kept there
        from now on, until `close` (this base keeps nothing)."""

    def close(self) -> None:
        """The run ends: what the observer keeps is written a last time."""
