# What a secure round masks (each device's weighted delta of the spec's trainable tensors, its weight and its new
# labels) and the FedAvg mean and label count the unmasked sum gives; both sides share it, so they mask one layout.
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from protocol.secagg.errors import SecAggAbandoned
from protocol.secagg.fixed_point import FixedPoint
from protocol.tensors import Weights

MODES = ("off", "secagg")  # the recipe's secure_aggregation values
WEIGHT = "secagg.weight"  # the masked tensor that carries a device's weight (times the clip, to use the range)
LABELS = "secagg.labels"  # the masked tensor that carries the labels a device acquired since its last masked input


def device_weight(num_samples: int, cap: int) -> float:
    """A device's weight in the mean: min(samples, cap) / cap, or 1 for every device when cap is 0."""
    return 1.0 if cap == 0 else min(max(num_samples, 0), cap) / cap


def weighted_samples(weight_sum: float, cap: int) -> int:
    """The samples a summed weight stands for, device_weight undone over a sum: each device's samples capped at
    `cap` (one per device when cap is 0). A relay sends it upstream as its secure site round's num_samples."""
    return round(weight_sum * cap) if cap > 0 else round(weight_sum)


def mask_layout(base: Weights, names: Sequence[str]) -> Weights:
    """Zeros of what every device of the round masks: the trainable tensors, the weight and the new labels."""
    counts = {WEIGHT: np.zeros(1, np.float32), LABELS: np.zeros(1, np.float32)}
    return {**{name: np.zeros_like(base[name], dtype=np.float32) for name in names}, **counts}


def weighted_delta(
    tensors: Weights, base: Weights, names: Sequence[str], weight: float, clip: float, labels: int
) -> Weights:
    """What a device masks: weight * (its tensor - the round's model, each coordinate clipped to +-clip) for each
    trainable tensor, weight * clip, and its new labels as a count (`in_fixed_units` turns it into whole fixed-point
    steps once the roster is known). Clipping before weighting keeps every coordinate of a sum within the summed
    weight times the clip, which the coordinator checks (`coordinator.secure.secagg_bounds`)."""
    delta = {name: weight * np.clip(np.asarray(tensors[name], np.float64) - base[name], -clip, clip) for name in names}
    return {**delta, WEIGHT: np.array([weight * clip]), LABELS: np.array([float(max(labels, 0))])}


def in_fixed_units(values: Weights, fixed: FixedPoint) -> Weights:
    """The values with the label count as that many fixed-point steps (so the unmasked sum counts labels exactly;
    a count beyond clip / step, about 2^31 / the round's devices, is cut to it)."""
    most = np.floor(fixed.clip / fixed.step)
    return {**values, LABELS: np.minimum(np.asarray(values[LABELS], np.float64), most) * fixed.step}


def label_count(total: Weights, fixed: FixedPoint) -> int:
    """The survivors' new labels: the unmasked sum's label coordinate in whole fixed-point steps."""
    return round(float(total[LABELS][0]) / fixed.step)


def secure_mean(total: Weights, base: Weights, names: Sequence[str], clip: float) -> tuple[Weights, float]:
    """The round's model plus the weighted mean delta the unmasked sum stands for, and the summed weight (a sum of
    zero weight, every survivor with no samples, abandons the round)."""
    weight_sum = float(total[WEIGHT][0]) / clip
    if weight_sum <= 0:
        raise SecAggAbandoned(f"the survivors' weights add up to {weight_sum:.3g}")
    mean = dict(base)
    for name in names:
        mean[name] = (base[name] + np.asarray(total[name]) / weight_sum).astype(np.float32)
    return mean, weight_sum
