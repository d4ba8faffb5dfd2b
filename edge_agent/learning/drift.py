# Drift between a camera's newest images and its older ones: the uncertain share jumped, or the predicted mix moved.
"""One definition of drift, applied where the data is. The coordinator flags a device whose last hour of predictions
has an uncertain share DRIFT_JUMP above its hours before (uncertain_jump over its counts); a device compares the
images that arrived since its last acquisition with its older pool, both scored by the round's model, and calls it
drift when either the uncertain share jumped the same way or the predicted class mix moved beyond chance (a G-test of
homogeneity at SIGNIFICANCE): a lighting change shows in the first, a change of what the camera sees in the second
(ALGORITHMS.md section 7.13)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edge_agent.learning.predict import Verdicts
from edge_agent.learning.prior_shift import SIGNIFICANCE, chi2_tail
from protocol.prediction_messages import UNCERTAIN

DRIFT_JUMP = 0.2  # the newer images' uncertain share this far above the older ones' is drift
DRIFT_MIN_RECENT = 20  # newer images a comparison needs before their shares are trusted
DRIFT_MIN_BASELINE = 50  # older images it needs


@dataclass(frozen=True)
class Seen:
    """What a model said about some images: how many, how many uncertain (above UNCERTAIN), and per class how many
    it predicted."""

    count: int
    uncertain: int
    classes: np.ndarray

    @classmethod
    def of(cls, verdicts: Verdicts, positions: np.ndarray, num_classes: int) -> Seen:
        """The counts of the verdicts at these positions."""
        predicted = verdicts.classes[positions]
        return cls(
            len(positions),
            int(np.count_nonzero(verdicts.uncertainties[positions] > UNCERTAIN)),
            np.bincount(predicted, minlength=num_classes).astype(np.int64),
        )


def uncertain_jump(recent_uncertain: int, recent: int, baseline_uncertain: int, baseline: int) -> bool:
    """Whether the recent uncertain share is DRIFT_JUMP or more above the baseline's, each over enough images
    (DRIFT_MIN_RECENT, DRIFT_MIN_BASELINE) to be trusted."""
    if recent < DRIFT_MIN_RECENT or baseline < DRIFT_MIN_BASELINE:
        return False
    return recent_uncertain / recent - baseline_uncertain / baseline >= DRIFT_JUMP


def mix_moved(recent: np.ndarray, baseline: np.ndarray, level: float = SIGNIFICANCE) -> bool:
    """Whether two class counts come from different mixes beyond chance: the G-test of homogeneity of the 2 x K
    table (K the classes either holds) against chi-squared with K - 1 degrees of freedom, below `level`; False
    where either side is below its DRIFT_MIN_ count."""
    table = np.stack([np.asarray(recent, np.float64), np.asarray(baseline, np.float64)])
    if table[0].sum() < DRIFT_MIN_RECENT or table[1].sum() < DRIFT_MIN_BASELINE:
        return False
    table = table[:, table.sum(axis=0) > 0]
    expected = table.sum(axis=1, keepdims=True) * table.sum(axis=0, keepdims=True) / table.sum()
    present = table > 0
    statistic = 2.0 * float(np.sum(table[present] * np.log(table[present] / expected[present])))
    return chi2_tail(statistic, table.shape[1] - 1) < level


def drift_reason(recent: Seen, baseline: Seen) -> str | None:
    """Why the recent images drifted from the baseline ones (a short, bounded line), or None where they did not."""
    if uncertain_jump(recent.uncertain, recent.count, baseline.uncertain, baseline.count):
        return (
            f"uncertain share {recent.uncertain / recent.count:.2f} on {recent.count} new images against "
            f"{baseline.uncertain / baseline.count:.2f} on {baseline.count} older"
        )
    if mix_moved(recent.classes, baseline.classes):
        moved = np.abs(recent.classes / recent.count - baseline.classes / baseline.count)
        widest = int(np.argmax(moved))
        return (
            f"predicted class mix moved on {recent.count} new images against {baseline.count} older "
            f"(class {widest}: {recent.classes[widest] / recent.count:.2f} against "
            f"{baseline.classes[widest] / baseline.count:.2f})"
        )
    return None
