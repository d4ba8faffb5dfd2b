# Suspicion for statistics updates: whether a device's labels name the classes the rest of the fleet's labels give.
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from coordinator.intake.divergence import MIN_DEVICES_TO_JUDGE
from coordinator.strategies.aggregate import ClientUpdate
from protocol.head_statistics import CLASS_COUNTS, CLASS_SUMS, SECOND_MOMENT, packed_trace

LABEL_MARGIN = "label-margin"  # what a statistics update is judged on (the suspect's "layer" in reports and logs)
MIN_JUDGED_LABELS = 20  # fewer labels (in classes the rest holds) are too few to judge a device by
SHARES_TOLERANCE = 0.02  # a device's shares sum to 1 within this as sent in float32 or float16
SUSPECT_FRACTION = 0.25  # a suspect's labels explain at most this share of what the median device's do


@dataclass(frozen=True)
class LabelSums:
    """What judging labels reads of statistics over `labels` rows: per class the rows' feature sums and their counts
    (each over `labels`, as an update carries them: shares for one device's) and the mean squared norm of a row."""

    sums: np.ndarray
    counts: np.ndarray
    square: float
    labels: float

    @classmethod
    def of_update(cls, update: ClientUpdate) -> LabelSums:
        """One update's class sums, shares and second moment's trace over its num_samples labels."""
        sums = np.asarray(update.weights[CLASS_SUMS], np.float64)
        square = packed_trace(update.weights[SECOND_MOMENT], sums.shape[1])
        return cls(sums, np.asarray(update.weights[CLASS_COUNTS], np.float64), square, float(update.num_samples))


def within_variance(sums: np.ndarray, counts: np.ndarray, square: float) -> float:
    """The pooled within-class variance of one row (its covariance's trace), unbiased, from totals over the rows:
    per class the feature sums and row counts, and the summed squared norms; 0 when too few rows."""
    held = counts > 1e-6
    between = float(np.sum(np.sum(sums[held] ** 2, axis=1) / counts[held]))
    freedom = float(counts[held].sum()) - int(np.count_nonzero(held))
    return max(square - between, 0.0) / freedom if freedom > 0 else 0.0


def label_margin(own: LabelSums, fleet: LabelSums) -> float | None:
    """How well one device's labels name its rows by the rest of the fleet: over its labelled rows of the classes the
    rest holds labels of, the mean of (the labelled class's logit less the mean logit) under the nearest-class-mean
    head of the rest (every other device's class means: w_c = mu_c, b_c = -|mu_c|^2 / 2, with |mu_c|^2 estimated
    without bias: the squared norm of a mean over n_c rows less the rows' variance / n_c, which would otherwise
    push down every class the rest holds few labels of, and with it honest devices whose labels are mostly of those:
    ALGORITHMS.md section 11), from the device's statistics `own` and the fleet's summed `fleet` (counts in labels,
    `labels` their total). Honest labels score well above 0, labels given at random about 0, systematically wrong
    ones below; None with fewer than MIN_JUDGED_LABELS judged labels, or for shares that are no distribution
    (statistics noised under --dp device: noise would be judged, not labels)."""
    shares, labels = own.counts, own.labels
    if np.any(shares < 0) or abs(float(shares.sum()) - 1.0) > SHARES_TOLERANCE:
        return None
    rest_counts = fleet.counts - labels * shares
    rest = rest_counts > 1e-6
    if labels * float(shares[rest].sum()) < MIN_JUDGED_LABELS - 1e-6:
        return None
    rest_sums = fleet.sums - labels * own.sums
    variance = within_variance(rest_sums, rest_counts, fleet.square - labels * own.square)
    means = rest_sums[rest] / rest_counts[rest, None]
    bias = -0.5 * (np.sum(means * means, axis=1) - variance / rest_counts[rest])
    mass = float(shares[rest].sum())
    given = float(np.sum(own.sums[rest] * means) + shares[rest] @ bias) / mass
    average = float(own.sums[rest].sum(axis=0) @ means.mean(axis=0)) / mass + float(bias.mean())
    return given - average


def summed(devices: Iterable[LabelSums]) -> LabelSums:
    """The fleet's totals: every device's statistics times its labels, summed (counts then in labels)."""
    each = list(devices)
    return LabelSums(
        np.sum([own.labels * own.sums for own in each], axis=0),
        np.sum([own.labels * own.counts for own in each], axis=0),
        float(sum(own.labels * own.square for own in each)),
        float(sum(own.labels for own in each)),
    )


def label_margins(updates: Iterable[ClientUpdate]) -> dict[str, float]:
    """Device -> label_margin, for the devices of a round's statistics updates that can be judged (each update's
    class sums, shares and second moment over its num_samples labels)."""
    devices = {update.device_id: LabelSums.of_update(update) for update in updates}
    fleet = summed(devices.values())
    margins = {device: label_margin(own, fleet) for device, own in devices.items()}
    return {device: margin for device, margin in margins.items() if margin is not None}


def disagreeing_devices(margins: Mapping[str, float]) -> dict[str, list[str]]:
    """Device -> [LABEL_MARGIN] for each judged device whose margin is below SUSPECT_FRACTION of the judged devices'
    median (a positive one); none with fewer than MIN_DEVICES_TO_JUDGE judged (no majority to judge by)."""
    if len(margins) < MIN_DEVICES_TO_JUDGE:
        return {}
    median = float(np.median(list(margins.values())))
    if not median > 0:
        return {}
    return {device: [LABEL_MARGIN] for device, margin in margins.items() if margin < SUSPECT_FRACTION * median}


def statistics_suspects(updates: Iterable[ClientUpdate]) -> dict[str, list[str]]:
    """The suspects among a round's statistics updates (the class-statistics rule's): devices whose labels disagree
    with the rest's (disagreeing_devices over label_margins). A secure round's one summed update judges nobody."""
    return disagreeing_devices(label_margins(updates))
