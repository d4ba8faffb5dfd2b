# Named tensors without torch: the Weights type, a layout (name -> shape, dtype), the one layout check, the hash.
from __future__ import annotations

import hashlib

import numpy as np

from protocol.errors import FalError

Weights = dict[str, np.ndarray]
WeightSpec = dict[str, tuple[tuple[int, ...], str]]


def spec_of(weights: Weights) -> WeightSpec:
    """Name -> (shape, numpy dtype string) of every tensor: the layout every weight set of a model shares."""
    return {name: (tuple(array.shape), str(array.dtype)) for name, array in weights.items()}


class LayoutError(FalError, ValueError):
    """Weights whose tensor names, shapes or dtypes differ from the layout they must have."""


def check_layout(spec: WeightSpec, weights: Weights) -> None:
    """Raises LayoutError naming the first tensor whose name, shape or dtype differs from the spec.

    Name lists in the message are capped, so a weight set with thousands of stray names gives a short error.
    """
    missing = sorted(set(spec) - set(weights))
    extra = sorted(set(weights) - set(spec))
    if missing or extra:
        raise LayoutError(
            f"tensor names differ from the model: missing {_capped(missing)}, unexpected {_capped(extra)}"
        )
    for name, (shape, dtype) in spec.items():
        array = weights[name]
        if tuple(array.shape) != shape:
            raise LayoutError(f"tensor {name!r} has shape {tuple(array.shape)}, expected {shape}")
        if str(array.dtype) != dtype:
            raise LayoutError(f"tensor {name!r} has dtype {array.dtype}, expected {dtype}")


def _capped(names: list[str], shown: int = 5) -> str:
    """The first few names of a list and how many more there are, for error messages of bounded length."""
    head = [name[:64] for name in names[:shown]]
    return f"{head}" + (f" and {len(names) - shown} more" if len(names) > shown else "")


def weights_hash(weights: Weights) -> str:
    """SHA-256 over names, dtypes, shapes and little-endian bytes, in sorted name order: a model's identity."""
    digest = hashlib.sha256()
    for name in sorted(weights):
        array = np.ascontiguousarray(weights[name])
        little_endian = array.astype(array.dtype.newbyteorder("<"), copy=False)
        digest.update(f"{name}|{little_endian.dtype.str}|{array.shape}|".encode())
        digest.update(little_endian.tobytes())
    return digest.hexdigest()
