# Suspicion for statistics updates: whether a device's labels name the classes the rest of the fleet's labels give.
from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from coordinator.intake.divergence import MIN_DEVICES_TO_JUDGE
from coordinator.strategies.aggregate import ClientUpdate
from protocol.head_statistics import CLASS_COUNTS, CLASS_SUMS

LABEL_MARGIN = "label-margin"  # what a statistics update is judged on (the suspect's "layer" in reports and logs)
MIN_JUDGED_LABELS = 20  # fewer labels (in classes the rest holds) are too few to judge a device by
SHARES_TOLERANCE = 0.02  # a device's shares sum to 1 within this as sent in float32 or float16
SUSPECT_FRACTION = 0.25  # a suspect's labels explain at most this share of what the median device's do


def label_margin(
    own: tuple[np.ndarray, np.ndarray], labels: float, fleet: tuple[np.ndarray, np.ndarray]
) -> float | None:
    """How well one device's labels name its rows by the rest of the fleet: over its labelled rows of the classes the
    rest holds labels of, the mean of (the labelled class's logit less the mean logit) under the nearest-class-mean
    head of the rest (every other device's class means: w_c = mu_c, b_c = -|mu_c|^2 / 2), from its class sums and
    shares `own` (each over its `labels` rows) and the fleet's summed sums and counts. Honest labels score well
    above 0, labels given at random about 0, systematically wrong ones below; None with fewer than
    MIN_JUDGED_LABELS judged labels, or for shares that are no distribution (statistics noised under --dp device:
    noise would be judged, not labels)."""
    (sums, shares), (fleet_sums, fleet_counts) = own, fleet
    if np.any(shares < 0) or abs(float(shares.sum()) - 1.0) > SHARES_TOLERANCE:
        return None
    rest_counts = fleet_counts - labels * shares
    rest = rest_counts > 1e-6
    if labels * float(shares[rest].sum()) < MIN_JUDGED_LABELS - 1e-6:
        return None
    means = (fleet_sums[rest] - labels * sums[rest]) / rest_counts[rest, None]
    bias = -0.5 * np.sum(means * means, axis=1)
    mass = float(shares[rest].sum())
    given = float(np.sum(sums[rest] * means) + shares[rest] @ bias) / mass
    average = float(sums[rest].sum(axis=0) @ means.mean(axis=0)) / mass + float(bias.mean())
    return given - average


def label_margins(updates: Iterable[ClientUpdate]) -> dict[str, float]:
    """Device -> label_margin, for the devices of a round's statistics updates that can be judged (each update's
    class sums and shares over its num_samples labels)."""
    devices = {
        update.device_id: (
            np.asarray(update.weights[CLASS_SUMS], np.float64),
            np.asarray(update.weights[CLASS_COUNTS], np.float64),
            float(update.num_samples),
        )
        for update in updates
    }
    fleet_sums = sum(labels * sums for sums, _, labels in devices.values())
    fleet_counts = sum(labels * shares for _, shares, labels in devices.values())
    margins = {
        device: label_margin((sums, shares), labels, (np.asarray(fleet_sums), np.asarray(fleet_counts)))
        for device, (sums, shares, labels) in devices.items()
    }
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
