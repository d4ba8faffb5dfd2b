# The promotion gate: whether a committed round's model is good enough to serve, from its held-out scores alone.
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from protocol.errors import UsageError

DEFAULT_TOLERANCE_POINTS = 0.5
DEFAULT_MAX_CLASS_DROP_POINTS = 5.0
ABANDONED = "abandoned"  # a secure round's outcome in its metrics when its sum was refused
# Points a comparison forgives for float rounding: a class that fell exactly the bound (0.89 to 0.84 is
# 5.000000000000004 points in floats), or a round exactly at the tolerance's floor, is within it.
ROUNDING_POINTS = 1e-6


@dataclass(frozen=True)
class PromotionGate:
    """A committed round serves when its held-out accuracy is at least the serving model's less `tolerance_points`
    (percentage points) and no class's recall (accuracy on that class's held-out images) fell by more than
    `max_class_drop_points`."""

    tolerance_points: float = DEFAULT_TOLERANCE_POINTS
    max_class_drop_points: float = DEFAULT_MAX_CLASS_DROP_POINTS

    def __post_init__(self) -> None:
        if not 0.0 <= self.tolerance_points <= 100.0:
            raise UsageError(f"--promotion-tolerance must lie in [0, 100] points, got {self.tolerance_points}")
        if not 0.0 <= self.max_class_drop_points <= 100.0:
            raise UsageError(
                f"--promotion-max-class-drop must lie in [0, 100] points, got {self.max_class_drop_points}"
            )


@dataclass(frozen=True)
class ModelScores:
    """A model's scores on the server's held-out split: accuracy (None: not measured) and each class's recall
    (None for a class without held-out images; empty: not kept), and whether its round was abandoned."""

    accuracy: float | None
    per_class: Sequence[float | None] = field(default_factory=list)
    abandoned: bool = False


@dataclass(frozen=True)
class Verdict:
    """The gate's answer: promote or not, and why in one bounded line."""

    promote: bool
    reason: str


def points(fraction: float) -> float:
    """A fraction as percentage points."""
    return 100.0 * fraction


def largest_class_drop(candidate: Sequence[float | None], serving: Sequence[float | None]) -> tuple[int, float] | None:
    """(class, drop in points) of the class whose recall fell most from `serving` to `candidate` (classes either
    lacks left out), None when no class is measured by both."""
    drops = [
        (index, points(before - after))
        for index, (after, before) in enumerate(zip(candidate, serving, strict=False))
        if after is not None and before is not None
    ]
    return max(drops, key=lambda item: (item[1], -item[0])) if drops else None


def verdict(gate: PromotionGate, candidate: ModelScores, serving: ModelScores, class_names: Sequence[str]) -> Verdict:
    """Whether the candidate round's model should replace the serving one, with the reason (class names name a
    class; a name beyond the list is its index)."""
    if candidate.abandoned:
        return Verdict(False, "the round was abandoned: its model is the one it started from")
    if candidate.accuracy is None:
        return Verdict(False, "the round's model was not measured on the held-out split")
    if serving.accuracy is None:
        return Verdict(True, f"accuracy {candidate.accuracy:.4f}; the serving model was not measured")
    floor = serving.accuracy - gate.tolerance_points / 100.0
    if points(candidate.accuracy - floor) < -ROUNDING_POINTS:
        return Verdict(
            False,
            f"accuracy {candidate.accuracy:.4f} is below the serving model's {serving.accuracy:.4f} "
            f"less {gate.tolerance_points:g} points",
        )
    drop = largest_class_drop(candidate.per_class, serving.per_class)
    if drop is not None and drop[1] > gate.max_class_drop_points + ROUNDING_POINTS:
        index, fell = drop
        name = class_names[index] if index < len(class_names) else str(index)
        return Verdict(
            False,
            f"class {name[:40]} recall fell {fell:.1f} points ({serving.per_class[index]:.4f} to "
            f"{candidate.per_class[index]:.4f}), more than {gate.max_class_drop_points:g}",
        )
    return Verdict(True, f"accuracy {candidate.accuracy:.4f} against the serving model's {serving.accuracy:.4f}")
