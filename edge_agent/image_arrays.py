# Checks shared by the datasets, shards and the device store: uint8 image stacks, label vectors, index arrays.
from __future__ import annotations

from typing import Any

import numpy as np

IMAGE_SHAPE = (28, 28)


def check_images(images: np.ndarray, where: str) -> None:
    """Raises ValueError unless images are uint8 shaped (N, 28, 28)."""
    if images.dtype != np.uint8 or images.ndim != 3 or images.shape[1:] != IMAGE_SHAPE:
        raise ValueError(f"{where}: images are {images.dtype} {images.shape}, expected uint8 (N, 28, 28)")


def check_labels(labels: np.ndarray, count: int, num_classes: int, where: str) -> None:
    """Raises ValueError unless labels are `count` integers in [0, num_classes)."""
    if not np.issubdtype(labels.dtype, np.integer) or labels.shape != (count,):
        raise ValueError(f"{where}: labels are {labels.dtype} {labels.shape}, expected {count} integers")
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"{where}: labels must lie in [0, {num_classes}), got {labels.min()}..{labels.max()}")


def as_index_array(values: Any, what: str) -> np.ndarray:
    """A 1-D int64 copy of values; ValueError if they are not integers."""
    array = np.asarray(values)
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{what} must be a 1-D array of integers, got {array.dtype} {array.shape}")
    return array.astype(np.int64)
