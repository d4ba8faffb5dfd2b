# What a secure round masks (each device's weighted delta of the spec's trainable tensors and its weight) and the
# FedAvg mean the unmasked sum gives; the device and the coordinator share it, so both sides mask one layout.
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from protocol.secagg.errors import SecAggAbandoned
from protocol.tensors import Weights

MODES = ("off", "secagg")  # the recipe's secure_aggregation values
WEIGHT = "secagg.weight"  # the masked tensor that carries a device's weight (times the clip, to use the range)


def device_weight(num_samples: int, cap: int) -> float:
    """A device's weight in the mean: min(samples, cap) / cap, or 1 for every device when cap is 0."""
    return 1.0 if cap == 0 else min(max(num_samples, 0), cap) / cap


def mask_layout(base: Weights, names: Sequence[str]) -> Weights:
    """Zeros of what every device of the round masks: the trainable tensors and the weight."""
    return {**{name: np.zeros_like(base[name], dtype=np.float32) for name in names}, WEIGHT: np.zeros(1, np.float32)}


def weighted_delta(tensors: Weights, base: Weights, names: Sequence[str], weight: float, clip: float) -> Weights:
    """What a device masks: weight * (its tensor - the round's model) for each trainable tensor, and weight * clip."""
    delta = {name: (weight * (np.asarray(tensors[name], np.float64) - base[name])) for name in names}
    return {**delta, WEIGHT: np.array([weight * clip])}


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
