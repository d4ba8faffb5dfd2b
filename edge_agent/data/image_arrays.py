# Checks shared by the datasets, shards and the device store: uint8 image stacks, label vectors, index arrays.
from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from protocol.errors import UsageError
from protocol.files import checked_npz

IMAGE_SHAPE = (28, 28)


def check_images(images: np.ndarray, where: str, image_shape: tuple[int, ...] = IMAGE_SHAPE) -> None:
    """Raises ValueError unless images are uint8 shaped (N, *image_shape) (default: 28x28 grey)."""
    if images.dtype != np.uint8 or images.shape[1:] != image_shape:
        shown = ", ".join(str(side) for side in image_shape)
        raise UsageError(f"{where}: images are {images.dtype} {images.shape}, expected uint8 (N, {shown})")


def check_labels(labels: np.ndarray, count: int, num_classes: int, where: str) -> None:
    """Raises ValueError unless labels are `count` integers in [0, num_classes)."""
    if not np.issubdtype(labels.dtype, np.integer) or labels.shape != (count,):
        raise UsageError(f"{where}: labels are {labels.dtype} {labels.shape}, expected {count} integers")
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise UsageError(f"{where}: labels must lie in [0, {num_classes}), got {labels.min()}..{labels.max()}")


def as_index_array(values: Any, what: str) -> np.ndarray:
    """A 1-D int64 copy of values; ValueError if they are not integers."""
    array = np.asarray(values)
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{what} must be a 1-D array of integers, got {array.dtype} {array.shape}")
    return array.astype(np.int64)


def model_input(images: np.ndarray) -> np.ndarray:
    """Raw uint8 images, (N, H, W) for one channel or channels-last (N, H, W, C) as cameras give them, as float32
    (N, C, H, W) scaled to [0, 1]: what every zoo model takes (each model standardises with its spec's mean and std)."""
    if images.dtype != np.uint8 or images.ndim not in (3, 4):
        raise ValueError(f"expected uint8 images shaped (N, H, W) or (N, H, W, C), got {images.dtype} {images.shape}")
    stack = images[:, None, :, :] if images.ndim == 3 else images.transpose(0, 3, 1, 2)
    return np.ascontiguousarray(stack, dtype=np.float32) / np.float32(255.0)


def as_model_input(images: np.ndarray) -> np.ndarray:
    """Raw uint8 images as model inputs (model_input); model inputs already (float32 (N, C, H, W)) as they are."""
    return model_input(images) if images.dtype == np.uint8 else np.ascontiguousarray(images)


@dataclass(frozen=True)
class ImageDataset:
    """A labelled data set's train and test splits: uint8 images (N, H, W) or (N, H, W, C), integer labels (N,)."""

    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray


DATASET_KEYS = ("train_images", "train_labels", "test_images", "test_labels")


def load_npz_dataset(path: Path, image_shape: tuple[int, ...], num_classes: int) -> ImageDataset:
    """A data set of one's own from an .npz holding DATASET_KEYS (no pickle), checked against the model spec's
    image shape and class count; every error names the file and the array."""
    if not Path(path).is_file():
        raise UsageError(f"{path}: no such data set file")
    try:
        with checked_npz(path, Path(path)) as archive:
            missing = [key for key in DATASET_KEYS if key not in archive.files]
            if missing:
                raise UsageError(f"{path}: lacks {', '.join(missing)} (needs {', '.join(DATASET_KEYS)})")
            arrays = {key: archive[key] for key in DATASET_KEYS}
    except (OSError, EOFError, zipfile.BadZipFile) as error:
        raise UsageError(f"{path}: not a readable .npz ({str(error)[:120]})") from None
    for split in ("train", "test"):
        images, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        check_images(images, f"{path}: {split}_images", image_shape)
        check_labels(labels, len(images), num_classes, f"{path}: {split}_labels")
    return ImageDataset(**arrays)
