# A device's predictions on the wire: one batch of its serving model's answers for the images it collected.
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from protocol.errors import FalError

UNCERTAIN = 0.5  # a prediction whose uncertainty is above this counts as uncertain (the fleet watches their share)
MAX_BATCH = 1000  # predictions in one message (a device sends at most PUBLISH_BATCH; an observer refuses more)
COLUMNS = ("files", "content_hashes", "class_indices", "class_names", "probabilities", "uncertainties", "times")


class BatchError(FalError, ValueError):
    """A prediction batch whose columns disagree in length or hold values out of range (a bounded reason)."""


@dataclass(frozen=True)
class PredictionBatch:
    """Predictions of one device under one serving version, column by column (row i of every column is one image):
    the image's file (relative to the device's pool folder) and content hash (sha256 hex of its decoded pixels),
    the predicted class's index and name, its mean probability over the MC-dropout passes, the uncertainty (the
    predictive entropy over log(classes), in [0, 1]) and when it was predicted (Unix seconds). Published on the
    device's predictions topic, QoS 1, when the serving message asks for it."""

    KIND: ClassVar[str] = "predictions"
    device_id: str
    serving_version: int
    model_hash: str
    files: list[str]
    content_hashes: list[str]
    class_indices: list[int]
    class_names: list[str]
    probabilities: list[float]
    uncertainties: list[float]
    times: list[float]

    def __len__(self) -> int:
        return len(self.files)

    def rows(self) -> list[dict[str, Any]]:
        """One dict per prediction (what the predictions log holds per line)."""
        head = {"serving_version": self.serving_version, "model_hash": self.model_hash}
        columns = [getattr(self, name) for name in COLUMNS]
        keys = ("file", "content_hash", "class_index", "class_name", "probability", "uncertainty", "time")
        return [{**head, **dict(zip(keys, values))} for values in zip(*columns)]


def check_batch(batch: PredictionBatch, class_names: Sequence[str] = ()) -> PredictionBatch:
    """The batch if its columns have one length (at most MAX_BATCH), indices are non-negative and probabilities and
    uncertainties lie in [0, 1], and, given the fleet's `class_names`, each index names one of them by its name;
    else BatchError with a bounded reason."""
    lengths = {len(getattr(batch, name)) for name in COLUMNS}
    if len(lengths) != 1:
        raise BatchError(f"prediction columns differ in length: {sorted(lengths)[:5]}")
    if len(batch) > MAX_BATCH:
        raise BatchError(f"{len(batch)} predictions in one batch, more than {MAX_BATCH}")
    if batch.serving_version < 0 or any(index < 0 for index in batch.class_indices):
        raise BatchError("a serving version or class index is negative")
    if not all(_unit(value) for value in (*batch.probabilities, *batch.uncertainties)):
        raise BatchError("a probability or uncertainty lies outside [0, 1]")
    if class_names:
        check_classes(batch, class_names)
    return batch


def check_classes(batch: PredictionBatch, class_names: Sequence[str]) -> None:
    """BatchError unless every class index is below len(class_names) and its name is the one the fleet gives it."""
    for index, name in zip(batch.class_indices, batch.class_names):
        if index >= len(class_names):
            raise BatchError(f"class index {index} is not below the fleet's {len(class_names)} classes")
        if name != class_names[index]:
            raise BatchError(f"class {index} is named {str(name)[:40]!r}, not {class_names[index][:40]!r}")


def _unit(value: float) -> bool:
    return math.isfinite(value) and 0.0 <= value <= 1.0
