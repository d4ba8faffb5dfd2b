# Per-layer weight divergence of each device model from the aggregate: ||W_i^l - W_agg^l|| / ||W_i^l||.
from __future__ import annotations

from typing import Mapping

import numpy as np

from edge_agent.models import Weights

NORM_ORDERS: dict[str, int] = {"l2": 2, "l1": 1}


def check_norm(norm: str) -> None:
    """Raises ValueError for a norm name other than those in NORM_ORDERS."""
    if norm not in NORM_ORDERS:
        raise ValueError(f"unknown norm {norm!r}; known: {', '.join(sorted(NORM_ORDERS))}")


def tensor_norm(array: np.ndarray, norm: str = "l2") -> float:
    """The L2 (Frobenius) or L1 norm of the flattened tensor, computed in float64."""
    check_norm(norm)
    return float(np.linalg.norm(np.asarray(array, dtype=np.float64).ravel(), ord=NORM_ORDERS[norm]))


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


def fleet_divergence(
    updates: Mapping[str, Weights], aggregate: Weights, norm: str = "l2"
) -> dict[str, dict[str, float]]:
    """Device id -> tensor name -> relative divergence, for every device model of a round."""
    check_norm(norm)
    return {device: layer_divergence(weights, aggregate, norm) for device, weights in updates.items()}
