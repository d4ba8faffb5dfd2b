# The server's holdout of a labelled data set: W0's class-balanced samples, the selection split, the rest.
from __future__ import annotations

import numpy as np

from protocol.errors import UsageError
from protocol.model_spec import CLASS_NAMES

NUM_CLASSES = len(CLASS_NAMES)


def checked_indices(labels: np.ndarray, indices: np.ndarray | None, num_classes: int = NUM_CLASSES) -> np.ndarray:
    """The subset to partition (default all), validated as unique in-range integers; labels in [0, num_classes)."""
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must be a 1-D integer array, got {labels.dtype} {labels.shape}")
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes})")
    if indices is None:
        return np.arange(len(labels), dtype=np.int64)
    indices = np.asarray(indices)
    if indices.ndim != 1 or (indices.size and not np.issubdtype(indices.dtype, np.integer)):
        raise ValueError(f"indices must be a 1-D integer array, got {indices.dtype} {indices.shape}")
    indices = indices.astype(np.int64)
    if indices.size and (indices.min() < 0 or indices.max() >= len(labels)):
        raise ValueError(f"indices must lie in [0, {len(labels)})")
    if len(np.unique(indices)) != len(indices):
        raise ValueError("indices must not repeat")
    return indices


def server_holdout(
    labels: np.ndarray,
    init_samples: int,
    validation_samples: int,
    rng: np.random.Generator,
    num_classes: int = NUM_CLASSES,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Splits all samples into (init, validation, rest), each sorted and all disjoint.

    The init set (the server's initial training data) is class-balanced: init_samples // num_classes per class,
    the remainder one each to the first classes. Validation is a uniform random draw from what is left.
    """
    labels = np.asarray(labels)
    all_indices = checked_indices(labels, None, num_classes)
    if init_samples < 0 or validation_samples < 0:
        raise UsageError(f"sample counts must be >= 0, got init {init_samples}, validation {validation_samples}")
    per_class, remainder = divmod(init_samples, num_classes)
    init_parts = []
    for cls in range(num_classes):
        wanted = per_class + (1 if cls < remainder else 0)
        members = all_indices[labels == cls]
        if len(members) < wanted:
            raise UsageError(f"class {cls} has {len(members)} samples, fewer than the {wanted} the init set needs")
        init_parts.append(rng.choice(members, size=wanted, replace=False))
    init_idx = np.sort(np.concatenate(init_parts))
    remaining = np.setdiff1d(all_indices, init_idx)
    if len(remaining) < validation_samples:
        raise UsageError(f"only {len(remaining)} samples remain after the init set, {validation_samples} requested")
    val_idx = np.sort(rng.choice(remaining, size=validation_samples, replace=False))
    rest_idx = np.setdiff1d(remaining, val_idx)
    return init_idx, val_idx, rest_idx
