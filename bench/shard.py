# The bench's shard: a simulated device's pool with its ground truth and seeds, saved and loaded checked.
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edge_agent.data.device_data import DeviceData
from edge_agent.data.image_arrays import IMAGE_SHAPE, check_images, check_labels
from protocol.errors import UsageError
from protocol.files import load_arrays, save_arrays
from protocol.model_spec import CLASS_NAMES


@dataclass(frozen=True)
class Shard:
    """A simulated device's data: pool images with the ground truth its oracle reveals, and pre-labelled seeds.

    The seeds are the few balanced samples the coordinator hands every device (from its own W0 samples), so
    that the replay set can hold every class even where the device's own data holds only some (Type i).
    """

    images: np.ndarray
    labels: np.ndarray
    seed_images: np.ndarray = field(default_factory=lambda: np.zeros((0, *IMAGE_SHAPE), dtype=np.uint8))
    seed_labels: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def all_images(self) -> np.ndarray:
        """Pool images followed by seed images: the device's index space."""
        return np.concatenate([self.images, self.seed_images])

    @property
    def all_labels(self) -> np.ndarray:
        """Ground truth over the same index space as all_images."""
        return np.concatenate([self.labels, self.seed_labels]).astype(np.int64)

    @property
    def seed_indices(self) -> np.ndarray:
        """Where the seeds sit in the device's index space."""
        return np.arange(len(self.images), len(self.images) + len(self.seed_images), dtype=np.int64)


SHARD_ARRAYS = ("images", "labels", "seed_images", "seed_labels")


def save_shard(path: Path | str, shard: Shard) -> None:
    """Writes a shard file after checking every array's shape and dtype."""
    _check_shard(shard, str(path))
    save_arrays(path, {name: getattr(shard, name) for name in SHARD_ARRAYS})


def load_shard(path: Path | str) -> Shard:
    """Reads a shard written by save_shard (a file without seeds is a shard without seeds); a file that is not one
    is a UsageError naming it (a shard is what a person gives `fl-bench device --data`)."""
    try:
        arrays = load_arrays(path)
        if not {"images", "labels"} <= set(arrays) <= set(SHARD_ARRAYS):
            raise ValueError(f"{path}: a shard holds {', '.join(SHARD_ARRAYS)}, found {sorted(arrays)}")
        shard = Shard(**{name: arrays[name] for name in arrays})
        _check_shard(shard, str(path))
    # load_arrays' UnreadableFileError and the shard checks' ValueErrors: the person's shard file
    except ValueError as error:
        raise UsageError(str(error)) from None
    return dataclasses.replace(
        shard, labels=shard.labels.astype(np.int64), seed_labels=shard.seed_labels.astype(np.int64)
    )


def _check_shard(shard: Shard, where: str) -> None:
    """Pool and seed arrays are uint8 images with one valid label each."""
    check_images(shard.images, where)
    check_labels(shard.labels, len(shard.images), len(CLASS_NAMES), where)
    check_images(shard.seed_images, f"{where} (seeds)")
    check_labels(shard.seed_labels, len(shard.seed_images), len(CLASS_NAMES), f"{where} (seeds)")


def open_device_data(state_dir: Path | str, shard: Shard) -> DeviceData:
    """A device's persisted data for this shard: resumed if it exists, else created with its seeds labelled once."""
    data = DeviceData.open_or_create(state_dir, shard.all_images)
    if len(shard.seed_labels) and data.count_labels("seed") == 0:
        data.add_labels(shard.seed_indices, shard.seed_labels, source="seed")
    return data
