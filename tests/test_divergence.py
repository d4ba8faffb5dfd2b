# Unit tests for per-layer weight divergence: hand values, a direct numpy reference, zero norms and bad input.
import numpy as np
import pytest

from coordinator.intake.divergence import fleet_divergence, layer_divergence
from protocol.tensors import Weights

SHAPES = {"conv.weight": (8, 1, 4, 4), "conv.bias": (8,), "fc.weight": (10, 32)}


def random_weights(rng: np.random.Generator) -> Weights:
    """Float32 weights with the SHAPES layout."""
    return {name: rng.normal(size=shape).astype(np.float32) for name, shape in SHAPES.items()}


def test_divergence_is_zero_when_device_equals_aggregate() -> None:
    weights = random_weights(np.random.default_rng(0))
    for norm in ("l2", "l1"):
        assert layer_divergence(weights, {n: a.copy() for n, a in weights.items()}, norm) == dict.fromkeys(SHAPES, 0.0)


def test_divergence_hand_example() -> None:
    # W_i = [3, 4], W_agg = [3, 0]: L2 |[0, 4]| / |[3, 4]| = 4 / 5 = 0.8; L1 4 / (3 + 4) = 4/7
    # W_i = [3, 4], W_agg = [0, 0]: the whole tensor differs, divergence 1 in any norm
    device = {"a": np.array([3.0, 4.0], dtype=np.float32), "b": np.array([3.0, 4.0], dtype=np.float32)}
    aggregate = {"a": np.array([3.0, 0.0], dtype=np.float32), "b": np.zeros(2, dtype=np.float32)}
    assert layer_divergence(device, aggregate) == pytest.approx({"a": 0.8, "b": 1.0}, abs=1e-12)
    assert layer_divergence(device, aggregate, norm="l1") == pytest.approx({"a": 4 / 7, "b": 1.0}, abs=1e-12)


def test_divergence_matches_a_direct_numpy_computation() -> None:
    rng = np.random.default_rng(1)
    device, aggregate = random_weights(rng), random_weights(rng)
    l2, l1 = layer_divergence(device, aggregate), layer_divergence(device, aggregate, norm="l1")
    for name in SHAPES:
        d, g = device[name].astype(np.float64), aggregate[name].astype(np.float64)
        assert l2[name] == pytest.approx(np.sqrt(np.sum((d - g) ** 2)) / np.sqrt(np.sum(d**2)), rel=1e-12)
        assert l1[name] == pytest.approx(np.sum(np.abs(d - g)) / np.sum(np.abs(d)), rel=1e-12)


def test_divergence_is_computed_in_float64() -> None:
    # squares of 3e20 and 4e20 overflow float32 (max about 3.4e38) but not float64: 5e20 / 5e20 = 1
    device = {"w": np.array([3e20, 4e20], dtype=np.float32)}
    assert layer_divergence(device, {"w": np.zeros(2, dtype=np.float32)}) == {"w": pytest.approx(1.0, rel=1e-7)}


def test_zero_device_tensor_gives_zero_or_infinity() -> None:
    zeros = {"w": np.zeros(3, dtype=np.float32)}
    assert layer_divergence(zeros, {"w": np.zeros(3, dtype=np.float32)}) == {"w": 0.0}
    assert layer_divergence(zeros, {"w": np.array([0.0, 1.0, 0.0], dtype=np.float32)}) == {"w": float("inf")}


def test_fleet_divergence_maps_each_device_to_its_layer_divergence() -> None:
    rng = np.random.default_rng(2)
    aggregate = random_weights(rng)
    updates = {device: random_weights(rng) for device in ("pi-1", "pi-2", "jetson")}
    fleet = fleet_divergence(updates, aggregate, norm="l1")
    assert list(fleet) == ["pi-1", "pi-2", "jetson"]
    for device, weights in updates.items():
        assert fleet[device] == layer_divergence(weights, aggregate, norm="l1")
    assert fleet["pi-1"] != fleet["pi-2"]


def test_bad_input_is_rejected() -> None:
    weights = random_weights(np.random.default_rng(3))
    with pytest.raises(ValueError, match="unknown norm 'linf'; known: l1, l2"):
        layer_divergence(weights, weights, norm="linf")
    with pytest.raises(ValueError, match="unknown norm"):
        fleet_divergence({}, weights, norm="max")
    renamed = {("fc.w" if name == "fc.weight" else name): array for name, array in weights.items()}
    with pytest.raises(ValueError, match="missing \\['fc.weight'\\], unexpected \\['fc.w'\\]"):
        layer_divergence(renamed, weights)
    reshaped = dict(weights, **{"conv.bias": np.zeros(9, dtype=np.float32)})
    with pytest.raises(ValueError, match="'conv.bias' has shape \\(9,\\)"):
        fleet_divergence({"d0": reshaped}, weights)
