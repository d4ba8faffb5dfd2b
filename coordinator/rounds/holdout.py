# The server's holdout of a labelled data set: W0's class-balanced samples, the selection split, the rest.
from __future__ import annotations

from dataclasses import dataclass

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


PAPER_INIT_SAMPLES = 100  # W0's balanced samples on Fashion-MNIST (the paper's server)
PAPER_VALIDATION_SAMPLES = 1000  # the paper's selection split on Fashion-MNIST
SELECTION_SHARE = 4  # an own data set's selection split, when the strategy selects: 1 / SELECTION_SHARE of it
MAX_SELECTION = 1000  # ... and at most this many images


@dataclass(frozen=True)
class SplitSizes:
    """How many of the server's labelled training images W0 trains on (None: every one outside the selection
    split, whatever its class) and how many form the selection split OptFL and MixFL score candidates on."""

    init: int | None
    validation: int


def split_sizes(total: int, init: int | None, validation: int | None, selects: bool, own_data: bool) -> SplitSizes:
    """The server's split of its `total` labelled training images; None for a flag not given.

    Fashion-MNIST (not `own_data`) keeps the paper's 100 balanced W0 images and 1000 for selection (the rest are
    dealt to simulated devices). A fleet's own data set trains W0 on all of it, less a selection split only when
    the strategy `selects` among models: a quarter of the images, at most 1000. A UsageError names the flag when a
    selecting strategy is left without a selection split.
    """
    if validation is None:
        own_share = min(MAX_SELECTION, total // SELECTION_SHARE) if selects else 0
        validation = own_share if own_data else PAPER_VALIDATION_SAMPLES
    if init is None and not own_data:
        init = PAPER_INIT_SAMPLES
    if selects and validation < 1:
        raise UsageError(
            f"this strategy picks its model on a selection split, and {total} labelled images leave none: "
            "give --validation-samples N (at least 1) or another --strategy"
        )
    return SplitSizes(init, validation)


def server_holdout(
    labels: np.ndarray,
    init_samples: int | None,
    validation_samples: int,
    rng: np.random.Generator,
    num_classes: int = NUM_CLASSES,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Splits all samples into (init, validation, rest), each sorted and all disjoint.

    The init set (the server's initial training data) is class-balanced: init_samples // num_classes per class,
    the remainder one each to the first classes. Validation is a uniform random draw from what is left. With
    init_samples None, validation is drawn first and the init set is every other sample (no rest).
    """
    labels = np.asarray(labels)
    all_indices = checked_indices(labels, None, num_classes)
    if validation_samples < 0 or (init_samples is not None and init_samples < 0):
        raise UsageError(
            f"--init-samples and --validation-samples must be >= 0, got {init_samples}, {validation_samples}"
        )
    if init_samples is None:
        if len(all_indices) < validation_samples:
            raise UsageError(
                f"--validation-samples {validation_samples}: the data set has only {len(all_indices)} labelled "
                "training images"
            )
        val_idx = np.sort(rng.choice(all_indices, size=validation_samples, replace=False))
        return np.setdiff1d(all_indices, val_idx), val_idx, np.zeros(0, dtype=np.int64)
    init_idx = balanced_draw(labels, all_indices, init_samples, rng, num_classes)
    remaining = np.setdiff1d(all_indices, init_idx)
    if len(remaining) < validation_samples:
        raise UsageError(
            f"--validation-samples {validation_samples}: only {len(remaining)} labelled images remain after W0's "
            f"{init_samples} (--init-samples); ask for fewer, or leave both flags out to split by the data's size"
        )
    val_idx = np.sort(rng.choice(remaining, size=validation_samples, replace=False))
    rest_idx = np.setdiff1d(remaining, val_idx)
    return init_idx, val_idx, rest_idx


def balanced_draw(
    labels: np.ndarray, indices: np.ndarray, count: int, rng: np.random.Generator, num_classes: int
) -> np.ndarray:
    """W0's class-balanced draw of `count` indices (count // num_classes per class, the remainder one each to the
    first classes), sorted; a UsageError naming --init-samples when a class has too few."""
    per_class, remainder = divmod(count, num_classes)
    parts = []
    for cls in range(num_classes):
        wanted = per_class + (1 if cls < remainder else 0)
        members = indices[labels == cls]
        if len(members) < wanted:
            raise UsageError(
                f"--init-samples {count}: class {cls} has {len(members)} labelled images, fewer than the {wanted} "
                "a balanced W0 needs; ask for fewer, or leave the flag out to train W0 on every image"
            )
        parts.append(rng.choice(members, size=wanted, replace=False))
    return np.sort(np.concatenate(parts))
