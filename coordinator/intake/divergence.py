# Per-layer divergence of device models from the aggregate, ||W_i^l - W_agg^l|| / ||W_i^l||, and outlier scores on it.
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from protocol.tensors import Weights

NORM_ORDERS: dict[str, int] = {"l2": 2, "l1": 1}
MAD_SCALE = 1.4826  # 1 / Phi^-1(3/4): makes 1.4826 * MAD estimate the standard deviation of normal data
MAD_FLOOR = 1e-12  # the MAD is taken as at least MAD_FLOOR * |median| (MAD_FLOOR itself when the median is 0)
MIN_DEVICES_TO_JUDGE = 3  # with fewer devices there is no majority to call one of them an outlier
# With fewer trained tensors than this (a classifier head: its weight and its bias) each tensor's score compares
# noise (a 5-number bias moves as much by chance as by intent): the whole update is judged as one.
MIN_TENSORS_PER_LAYER = 4
WHOLE_UPDATE = "whole-update"  # the name suspicion gives the whole update when it judges it as one
# A whole update's MAD is floored at this share of the median: judged over a handful of devices, three honest
# heads that happen to agree closely would otherwise make a fourth a few percent further an outlier. At the default
# threshold 3.5 an update must then lie more than 26% beyond the median (1 + 3.5 * 1.4826 * 0.05).
WHOLE_UPDATE_MAD_FLOOR = 0.05


def check_norm(norm: str) -> None:
    """Raises ValueError for a norm name other than those in NORM_ORDERS."""
    if norm not in NORM_ORDERS:
        raise ValueError(f"unknown norm {norm!r}; known: {', '.join(sorted(NORM_ORDERS))}")


def tensor_norm(array: np.ndarray, norm: str = "l2") -> float:
    """The L2 (Frobenius) or L1 norm of the flattened tensor, computed in float64 with numpy's pairwise sum rather
    than BLAS: the same bits on any machine, and no BLAS thread pool (which under CPU contention took a
    millisecond per layer of every update at intake)."""
    check_norm(norm)
    values = np.asarray(array, dtype=np.float64).ravel()
    if norm == "l1":
        return float(np.abs(values).sum())
    return float(np.sqrt(np.square(values).sum()))


def relative_divergence(device_tensor: np.ndarray, aggregate_tensor: np.ndarray, norm: str = "l2") -> float:
    """||W_i - W_agg|| / ||W_i||; for a zero W_i, 0.0 if W_agg is also zero, else inf."""
    device = np.asarray(device_tensor, dtype=np.float64)
    difference = tensor_norm(device - np.asarray(aggregate_tensor, dtype=np.float64), norm)
    scale = tensor_norm(device, norm)
    if scale == 0.0:
        return 0.0 if difference == 0.0 else float("inf")
    return difference / scale


def layer_divergence(device_weights: Weights, aggregate: Weights, norm: str = "l2") -> dict[str, float]:
    """Tensor name -> relative divergence of one device model from the aggregate (the paper's div_i^l)."""
    check_norm(norm)
    if set(device_weights) != set(aggregate):
        missing = sorted(set(aggregate) - set(device_weights))
        extra = sorted(set(device_weights) - set(aggregate))
        raise ValueError(f"tensor names differ from the aggregate: missing {missing}, unexpected {extra}")
    for name, array in device_weights.items():
        if np.shape(array) != np.shape(aggregate[name]):
            raise ValueError(
                f"tensor {name!r} has shape {np.shape(array)}, the aggregate's is {np.shape(aggregate[name])}"
            )
    return {name: relative_divergence(array, aggregate[name], norm) for name, array in device_weights.items()}


def whole_divergence(device_weights: Weights, reference: Weights, norm: str = "l2") -> float:
    """||W_i - W_ref|| / ||W_i|| over every tensor of the update taken as one vector (layer_divergence's checks)."""
    layer_divergence(device_weights, reference, norm)
    names = sorted(device_weights)
    device = np.concatenate([np.asarray(device_weights[name], dtype=np.float64).ravel() for name in names])
    return relative_divergence(device, np.concatenate([np.ravel(reference[name]) for name in names]), norm)


def suspicion_divergence(device_weights: Weights, base: Weights) -> dict[str, float]:
    """What suspicion scores of an update: each tensor's divergence from the base model, or for an update of fewer
    than MIN_TENSORS_PER_LAYER tensors the whole update's, under the name WHOLE_UPDATE."""
    if len(device_weights) < MIN_TENSORS_PER_LAYER:
        return {WHOLE_UPDATE: whole_divergence(device_weights, base)}
    return layer_divergence(device_weights, base)


def fleet_divergence(
    updates: Mapping[str, Weights], aggregate: Weights, norm: str = "l2"
) -> dict[str, dict[str, float]]:
    """Device id -> tensor name -> relative divergence, for every device model of a round."""
    check_norm(norm)
    return {device: layer_divergence(weights, aggregate, norm) for device, weights in updates.items()}


def robust_z_scores(values: Sequence[float], mad_floor: float = MAD_FLOOR) -> np.ndarray:
    """(x - median) / (1.4826 * MAD) per value, MAD = median(|x - median|), floored at mad_floor * |median|
    (mad_floor itself for a zero median).

    All zeros for fewer than MIN_DEVICES_TO_JUDGE values. An infinite value (an all-zero device layer, see
    relative_divergence) scores +inf and is left out of the median and the MAD. Raises ValueError for a
    negative or NaN value: a divergence is neither.
    """
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1 or np.any(np.isnan(x)) or np.any(x < 0.0):
        raise ValueError(f"divergences must be a flat list of non-negative numbers, got {values!r}")
    if x.size < MIN_DEVICES_TO_JUDGE:
        return np.zeros(x.size)
    scores = np.full(x.size, np.inf)
    finite = np.isfinite(x)
    if finite.any():
        center = float(np.median(x[finite]))
        mad = float(np.median(np.abs(x[finite] - center)))
        scores[finite] = (x[finite] - center) / (MAD_SCALE * max(mad, mad_floor * (abs(center) or 1.0)))
    return scores


def suspect_scores(fleet: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """Device id -> layer -> robust z-score of that device's divergence among all devices' on the layer.

    Every device must report the same layers (as fleet_divergence gives); see robust_z_scores for the score (a
    WHOLE_UPDATE's MAD floored at WHOLE_UPDATE_MAD_FLOOR of the median).
    """
    devices = list(fleet)
    if not devices:
        return {}
    layers = list(fleet[devices[0]])
    for device in devices[1:]:
        if set(fleet[device]) != set(layers):
            missing = sorted(set(layers) - set(fleet[device]))
            extra = sorted(set(fleet[device]) - set(layers))
            raise ValueError(
                f"device {device!r} differs in layers from {devices[0]!r}: missing {missing}, unexpected {extra}"
            )
    scores: dict[str, dict[str, float]] = {device: {} for device in devices}
    for layer in layers:
        floor = WHOLE_UPDATE_MAD_FLOOR if layer == WHOLE_UPDATE else MAD_FLOOR
        for device, z in zip(devices, robust_z_scores([fleet[device][layer] for device in devices], floor)):
            scores[device][layer] = float(z)
    return scores


def flag_suspects(fleet: Mapping[str, Mapping[str, float]], threshold: float = 3.5) -> dict[str, list[str]]:
    """Device id -> the layers whose z-score exceeds threshold, for the devices with any such layer.

    One-sided: a divergence unusually close to the aggregate is not suspicious.
    """
    if not np.isfinite(threshold):
        raise ValueError(f"threshold must be a finite number, got {threshold!r}")
    flagged = {
        device: [layer for layer, z in layers.items() if z > threshold]
        for device, layers in suspect_scores(fleet).items()
    }
    return {device: layers for device, layers in flagged.items() if layers}
