# The promotion gate: whether a committed round's model is good enough to serve, from both models' answers on the
# same test images (a one-sided paired interval on each fall, overall and per class, against a stated tolerance).
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from protocol.errors import UsageError

DEFAULT_TOLERANCE_POINTS = 0.5
DEFAULT_MAX_CLASS_DROP_POINTS = 2.0
DEFAULT_CONFIDENCE = 0.95
DEFAULT_FIELD_IMAGES = 200
ABANDONED = "abandoned"  # a secure round's outcome in its metrics when its sum was refused
SERVER_SET = "the server's test set"
FIELD_SET = "the field set"


@dataclass(frozen=True)
class PromotionGate:
    """A committed round serves unless, on the test set that decides, its accuracy fell from the serving model's by
    more than `tolerance_points` (percentage points) or one class's recall fell by more than
    `max_class_drop_points`, each beyond doubt at `confidence`: the fall's one-sided lower confidence bound (a
    paired interval: both models answer the same images) lies above the tolerance. The confidence holds for the
    round's tests together (Bonferroni over the overall test and one per class). The field set decides once it
    holds at least `field_images` images, the server's test set before; with `field_window` N > 0 the field set is
    the newest N answered field test images (so it follows a field that drifts), else all of them."""

    tolerance_points: float = DEFAULT_TOLERANCE_POINTS
    max_class_drop_points: float = DEFAULT_MAX_CLASS_DROP_POINTS
    confidence: float = DEFAULT_CONFIDENCE
    field_images: int = DEFAULT_FIELD_IMAGES
    field_window: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.tolerance_points <= 100.0:
            raise UsageError(f"--promotion-tolerance must lie in [0, 100] points, got {self.tolerance_points}")
        if not 0.0 <= self.max_class_drop_points <= 100.0:
            raise UsageError(
                f"--promotion-max-class-drop must lie in [0, 100] points, got {self.max_class_drop_points}"
            )
        if not 0.5 <= self.confidence < 1.0:
            raise UsageError(f"--promotion-confidence must lie in [0.5, 1), got {self.confidence}")
        if self.field_images < 1:
            raise UsageError(f"--promotion-field-images must be at least 1, got {self.field_images}")
        if self.field_window < 0:
            raise UsageError(f"--field-test-window must be 0 (every image) or more, got {self.field_window}")
        if 0 < self.field_window < self.field_images:
            raise UsageError(
                f"--field-test-window {self.field_window} is below --promotion-field-images {self.field_images}: "
                "the field set would never decide"
            )


@dataclass(frozen=True)
class PairedTable:
    """Two models' answers on the same test images, per class (index: the images' true class): images both got
    right, the serving model alone (`lost` by the candidate), the candidate alone (`gained`), neither."""

    both: np.ndarray
    lost: np.ndarray
    gained: np.ndarray
    neither: np.ndarray

    @property
    def images(self) -> int:
        """How many images the table counts."""
        return int(self.both.sum() + self.lost.sum() + self.gained.sum() + self.neither.sum())

    def cells(self, index: int | None) -> tuple[int, int, int, int]:
        """(both, lost, gained, neither) of one class, or of every image (None)."""
        if index is None:
            return int(self.both.sum()), int(self.lost.sum()), int(self.gained.sum()), int(self.neither.sum())
        return int(self.both[index]), int(self.lost[index]), int(self.gained[index]), int(self.neither[index])


def paired_table(labels: np.ndarray, serving: np.ndarray, candidate: np.ndarray, num_classes: int) -> PairedTable:
    """The paired table of two models' predicted classes on the same labelled images."""
    serving_right, candidate_right = serving == labels, candidate == labels

    def count(mask: np.ndarray) -> np.ndarray:
        return np.bincount(labels[mask], minlength=num_classes)[:num_classes].astype(np.int64)

    return PairedTable(
        count(serving_right & candidate_right),
        count(serving_right & ~candidate_right),
        count(~serving_right & candidate_right),
        count(~serving_right & ~candidate_right),
    )


@dataclass(frozen=True)
class GateEvidence:
    """What the gate reads of one round: the paired tables of the candidate and the serving model on the server's
    test set and on the field set (no images: none answered yet)."""

    test: PairedTable
    field: PairedTable


@dataclass(frozen=True)
class Verdict:
    """The gate's answer: promote or not, and why in one bounded line."""

    promote: bool
    reason: str


def wilson(successes: int, total: int, z: float) -> tuple[float, float]:
    """The Wilson score interval of a proportion (z: the normal quantile of each side)."""
    share = successes / total
    centre = share + z * z / (2 * total)
    spread = z * math.sqrt(share * (1 - share) / total + z * z / (4 * total * total))
    scale = 1 + z * z / total
    return max(0.0, (centre - spread) / scale), min(1.0, (centre + spread) / scale)


def fall_lower_bound(both: int, lost: int, gained: int, neither: int, z: float) -> float:
    """The lower confidence bound of the fall in accuracy from the serving model to the candidate on the same
    images, (lost - gained) / n: Newcombe's hybrid score interval for a paired difference (method 10 of Newcombe
    1998), from each model's Wilson interval and the pairs' correlation. A fraction in [-1, 1]."""
    total = both + lost + gained + neither
    before, after = (both + lost) / total, (both + gained) / total
    low_before, _ = wilson(both + lost, total, z)
    _, high_after = wilson(both + gained, total, z)
    spread = (both + lost) * (gained + neither) * (both + gained) * (lost + neither)
    phi = (both * neither - lost * gained) / math.sqrt(spread) if spread > 0 else 0.0
    down, up = before - low_before, high_after - after
    return before - after - math.sqrt(max(0.0, down * down - 2 * phi * down * up + up * up))


def bonferroni_z(confidence: float, tests: int) -> float:
    """The one-sided normal quantile that holds `confidence` over `tests` tests together."""
    return NormalDist().inv_cdf(1.0 - (1.0 - confidence) / max(1, tests))


def deciding_set(gate: PromotionGate, evidence: GateEvidence) -> tuple[str, PairedTable]:
    """The test set that decides (its name and table): the field set once it holds `field_images`, else the
    server's."""
    if evidence.field.images >= gate.field_images:
        return FIELD_SET, evidence.field
    return SERVER_SET, evidence.test


def verdict(gate: PromotionGate, evidence: GateEvidence, class_names: Sequence[str]) -> Verdict:
    """Whether the candidate round's model should replace the serving one, with the reason (class names name a
    class; a name beyond the list is its index). A fall counts only when its lower bound at the gate's confidence
    is beyond its tolerance, so a fall within what the set's size allows never holds a round."""
    name, table = deciding_set(gate, evidence)
    total = table.images
    if total == 0:
        return Verdict(False, f"{name} holds no images to judge the round on")
    measured = [index for index in range(len(table.both)) if sum(table.cells(index))]
    z = bonferroni_z(gate.confidence, 1 + len(measured))
    both, lost, gained, neither = table.cells(None)
    before, after = (both + lost) / total, (both + gained) / total
    where = f"on {name} ({total} images, {gate.confidence:g} confidence)"
    bound = fall_lower_bound(both, lost, gained, neither, z)
    if 100.0 * bound > gate.tolerance_points:
        return Verdict(
            False,
            f"accuracy fell {100 * (before - after):.1f} points ({before:.4f} to {after:.4f}) {where}: at least "
            f"{100 * bound:.1f}, beyond the {gate.tolerance_points:g}-point tolerance",
        )
    for index in measured:
        cells = table.cells(index)
        bound = fall_lower_bound(*cells, z)
        if 100.0 * bound > gate.max_class_drop_points:
            class_name = class_names[index] if index < len(class_names) else str(index)
            images = sum(cells)
            was, now = (cells[0] + cells[1]) / images, (cells[0] + cells[2]) / images
            return Verdict(
                False,
                f"class {class_name[:40]} recall fell {100 * (was - now):.1f} points ({was:.4f} to {now:.4f}) on "
                f"its {images} images of {name}: at least {100 * bound:.1f}, beyond the "
                f"{gate.max_class_drop_points:g}-point tolerance ({gate.confidence:g} confidence)",
            )
    return Verdict(
        True, f"accuracy {after:.4f} against the serving model's {before:.4f} {where}: no fall beyond its tolerance"
    )
