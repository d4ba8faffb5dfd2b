# A device's data: its images (from an image source), its labelled record and its journal, in one state directory.
from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from edge_agent.data.feature_cache import content_digests
from edge_agent.data.image_arrays import as_index_array, check_images, check_labels
from edge_agent.data.journal import Journal
from edge_agent.data.labelled_record import HUMAN_SOURCES, LabelledRecord, source_code
from protocol.files import atomic_write_bytes
from protocol.model_spec import CLASS_NAMES

LABELS_FILE = "labels.npz"
STATE_FILE = "state.json"
IMAGES_FILE = "images.npy"


class ImageSource(Protocol):
    """Where a device's images come from: a fixed stack written once (a shard), or a folder that grows."""

    def images(self) -> np.ndarray:
        """Every image so far, uint8 (N, H, W) or (N, H, W, C), indexed by the device's stable sample indices."""
        ...

    def read(self, indices: np.ndarray) -> np.ndarray:
        """A uint8 copy of the images at these (checked) indices."""
        ...

    def refresh(self) -> int:
        """Takes in what arrived since the last call; returns how many images joined (0 for a fixed stack)."""
        ...

    def digests(self, indices: np.ndarray) -> np.ndarray:
        """The content digests (`feature_cache.content_digests`) of the images at these indices, (n, 32) uint8:
        what ties a cached feature row to its image."""
        ...


@dataclass(frozen=True)
class Samples:
    """Some of a device's samples by their stable indices; their images are read only when asked for (a learner
    over a feature cache may need none of them), their content digests (what a cached row is checked against) are
    looked up by index."""

    indices: np.ndarray
    read: Callable[[np.ndarray], np.ndarray]
    digest: Callable[[np.ndarray], np.ndarray]

    def __len__(self) -> int:
        return len(self.indices)

    def images(self) -> np.ndarray:
        """The samples' uint8 images, in index order (read now)."""
        return self.read(self.indices)

    def digests(self) -> np.ndarray:
        """The samples' content digests, (n, 32) uint8, in index order."""
        return self.digest(self.indices)


class StoredImages:
    """The images of a shard, written once to images.npy in the state directory and memory-mapped read-only."""

    def __init__(self, path: Path) -> None:
        """Maps an existing images.npy; a missing or corrupt file is a clear error."""
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing; the device state directory is incomplete")
        try:
            self._images = np.load(path, mmap_mode="r", allow_pickle=False)
        # numpy raises ValueError for a damaged .npy: the state directory's damage, named
        except (ValueError, OSError, EOFError) as exc:
            raise ValueError(f"{path}: corrupt image file ({str(exc)[:200]})") from exc
        check_images(self._images, str(path))
        self._digests: np.ndarray | None = None

    @staticmethod
    def write(path: Path, images: np.ndarray) -> None:
        """Writes the image stack once, atomically."""
        check_images(images, "DeviceData.create")
        buffer = io.BytesIO()
        np.save(buffer, np.ascontiguousarray(images), allow_pickle=False)
        atomic_write_bytes(path, buffer.getvalue())

    def images(self) -> np.ndarray:
        """The whole stack (a read-only memory map)."""
        return self._images

    def read(self, indices: np.ndarray) -> np.ndarray:
        """A uint8 copy of the images at these indices."""
        return np.take(self._images, indices, axis=0)

    def refresh(self) -> int:
        """A shard never grows."""
        return 0

    def digests(self, indices: np.ndarray) -> np.ndarray:
        """Content digests of the images at these indices (the whole stack's, hashed once per process on first use:
        a shard is written once)."""
        if self._digests is None:
            self._digests = content_digests(self._images)
        return self._digests[indices]


def initialise_store(state_dir: Path, replay_per_class: int = 5, num_classes: int = len(CLASS_NAMES)) -> None:
    """Writes an empty journal and an empty labelled record (last: it marks a finished store)."""
    record = LabelledRecord.empty(num_classes, replay_per_class)
    if (state_dir / LABELS_FILE).exists():
        raise FileExistsError(f"{state_dir} already holds device data; open it instead of creating it")
    atomic_write_bytes(state_dir / STATE_FILE, b"{}")
    record.save(state_dir / LABELS_FILE)


class DeviceData:
    """A device's images, labelled set and replay set, persisted in a state directory so a SIGKILL loses nothing.

    Files: the image source's (images.npy for a shard, pool/ for a folder), labels.npz (the labelled record,
    rewritten atomically as one unit on every change) and state.json (the agent's journal). With pool_cap, the
    unlabelled pool is the newest pool_cap unlabelled samples.
    """

    def __init__(self, state_dir: Path, source: ImageSource, pool_cap: int | None = None) -> None:
        """Opens the store of an initialised state directory over its image source (create, open and
        open_folder_data make sure it is initialised)."""
        self.state_dir = state_dir
        self.source = source
        self.pool_cap = pool_cap
        self.record = LabelledRecord.load(state_dir / LABELS_FILE, len(source.images()))
        self.journal = Journal(state_dir / STATE_FILE)
        self._label_at = np.full(len(source.images()), -1, dtype=np.int64)
        human = self.record.human
        self._label_at[self.record.indices[human]] = self.record.labels[human]

    @classmethod
    def create(cls, state_dir: Path | str, images: np.ndarray, replay_per_class: int = 5) -> DeviceData:
        """Initialises a state directory with these images, nothing labelled and an empty journal."""
        state_dir = Path(state_dir)
        if (state_dir / LABELS_FILE).exists():
            raise FileExistsError(f"{state_dir} already holds device data; open it instead of creating it")
        StoredImages.write(state_dir / IMAGES_FILE, images)
        initialise_store(state_dir, replay_per_class)
        return cls.open(state_dir)

    @classmethod
    def open(cls, state_dir: Path | str) -> DeviceData:
        """Resumes a shard device's state directory written by create."""
        state_dir = Path(state_dir)
        if not (state_dir / LABELS_FILE).is_file():
            raise FileNotFoundError(f"{state_dir} holds no device data (no {LABELS_FILE}); create it first")
        return cls(state_dir, StoredImages(state_dir / IMAGES_FILE))

    @classmethod
    def open_or_create(cls, state_dir: Path | str, images: np.ndarray) -> DeviceData:
        """Resumes existing state (checking it holds as many images as given) or creates it from images."""
        state_dir = Path(state_dir)
        if not (state_dir / LABELS_FILE).is_file():
            return cls.create(state_dir, images)
        data = cls.open(state_dir)
        if data.num_samples != len(images):
            raise ValueError(
                f"{state_dir} holds {data.num_samples} images but {len(images)} were given; "
                "use a fresh state directory for a different data set"
            )
        return data

    @property
    def image_shape(self) -> tuple[int, ...]:
        """The shape of one of this device's images: (H, W) grey, or (H, W, C) colour."""
        return tuple(self.source.images().shape[1:])

    @property
    def num_classes(self) -> int:
        """How many classes labels may take."""
        return self.record.num_classes

    @property
    def num_samples(self) -> int:
        """How many images the device holds, labelled or not."""
        return len(self._label_at)

    @property
    def num_labelled(self) -> int:
        """How many samples carry a human label (weak labels do not count)."""
        return int(np.count_nonzero(self.record.human))

    def refresh(self) -> int:
        """Takes in the images the source gained; returns how many joined the pool."""
        added = self.source.refresh()
        if added:
            self._label_at = np.concatenate([self._label_at, np.full(added, -1, dtype=np.int64)])
        return added

    def pool_indices(self) -> np.ndarray:
        """Samples without a human label (unlabelled or only weakly labelled), ascending; the newest pool_cap."""
        pool = np.flatnonzero(self._label_at < 0)
        return pool if self.pool_cap is None else pool[-self.pool_cap :]

    def images(self, indices: np.ndarray) -> np.ndarray:
        """A uint8 copy of the images at these indices."""
        return self.source.read(checked_indices(indices, self.num_samples))

    def samples(self, indices: np.ndarray) -> Samples:
        """These samples by index, their images read on demand."""
        return Samples(checked_indices(indices, self.num_samples), self.images, self.digests)

    def digests(self, indices: np.ndarray) -> np.ndarray:
        """The content digests of the images at these indices (what the feature cache ties rows to)."""
        return self.source.digests(checked_indices(indices, self.num_samples))

    def labels_at(self, indices: np.ndarray) -> np.ndarray:
        """The label of each of these samples, -1 where a sample is still unlabelled."""
        return self._label_at[checked_indices(indices, self.num_samples)].copy()

    def labelled(self) -> tuple[np.ndarray, np.ndarray]:
        """(indices, labels) of the human-labelled set, in the order they were labelled."""
        human = self.record.human
        return self.record.indices[human], self.record.labels[human]

    def weak_labels(self) -> tuple[np.ndarray, np.ndarray]:
        """(indices, labels) of the weak machine labels (FAST's kNN votes), on samples no person has labelled."""
        weak = ~self.record.human
        return self.record.indices[weak], self.record.labels[weak]

    def replay(self) -> tuple[np.ndarray, np.ndarray]:
        """(indices, labels) of the replay set: the first replay_per_class labelled samples of each class."""
        return self.record.replay.copy(), self._label_at[self.record.replay]

    def class_counts(self) -> np.ndarray:
        """Number of human-labelled samples per class, shape (num_classes,)."""
        return np.bincount(self.record.labels[self.record.human], minlength=self.num_classes)

    def count_labels(self, source: str) -> int:
        """How many labels came from this source (the oracle's are the ones a person was asked for)."""
        return int(np.count_nonzero(self.record.sources == source_code(source)))

    def add_labels(self, indices: np.ndarray, labels: np.ndarray, source: str = "oracle") -> None:
        """Moves samples from the pool to the human-labelled set and updates the replay set, all or nothing.

        A human label replaces a weak label on the same sample; a sample a person already labelled is an error.
        """
        if source_code(source) == source_code("weak"):
            raise ValueError(
                f"add_labels takes human labels ({', '.join(HUMAN_SOURCES)}); weak labels go through set_weak_labels"
            )
        indices, labels = checked_new_labels(indices, labels, self._label_at, self.num_classes, "add_labels")
        self._adopt(self.record.with_human_labels(indices, labels, source))
        self._label_at[indices] = labels

    def correct_labels(self, indices: np.ndarray, labels: np.ndarray) -> None:
        """Sets these samples' human labels to a person's corrections (-1: none of these, the sample returns to the
        pool), all or nothing; a sample keeps one label, so a corrected label counts once."""
        indices = checked_indices(indices, self.num_samples)
        labels = as_index_array(labels, "labels")
        if len(labels) != len(indices) or len(np.unique(indices)) != len(indices):
            raise ValueError(f"correct_labels needs one label per distinct index, got {len(indices)} and {len(labels)}")
        if labels.size and (labels.min() < -1 or labels.max() >= self.num_classes):
            raise ValueError(f"corrected labels must lie in -1..{self.num_classes - 1}")
        self._adopt(self.record.with_corrections(indices, labels))
        self._label_at[indices] = labels

    def set_weak_labels(self, indices: np.ndarray, labels: np.ndarray) -> None:
        """Replaces every weak label by these (atomically); weak labels never overwrite a human label."""
        indices, labels = checked_new_labels(indices, labels, self._label_at, self.num_classes, "set_weak_labels")
        self._adopt(self.record.with_weak_labels(indices, labels))

    def get_state(self, key: str, default: Any = None) -> Any:
        """A value from the agent's journal, or default."""
        return self.journal.get(key, default)

    def set_state(self, key: str, value: Any) -> None:
        """Stores a JSON-able value in the agent's journal, atomically."""
        self.journal.set(key, value)

    def _adopt(self, record: LabelledRecord) -> None:
        """Persists the whole labelled record atomically, then adopts it in memory."""
        record.save(self.state_dir / LABELS_FILE)
        self.record = record


def checked_indices(indices: np.ndarray, num_samples: int) -> np.ndarray:
    """The indices as int64, ValueError naming the first outside [0, num_samples)."""
    indices = as_index_array(indices, "indices")
    bad = indices[(indices < 0) | (indices >= num_samples)]
    if bad.size:
        raise ValueError(f"index {int(bad[0])} out of range for {num_samples} samples")
    return indices


def checked_new_labels(
    indices: np.ndarray, labels: np.ndarray, label_at: np.ndarray, num_classes: int, caller: str
) -> tuple[np.ndarray, np.ndarray]:
    """(indices, labels) as int64 after checking ranges, uniqueness and that no person labelled them yet
    (label_at holds each sample's human label, -1 where none)."""
    indices = checked_indices(indices, len(label_at))
    labels = as_index_array(labels, "labels")
    if len(labels) != len(indices):
        raise ValueError(f"got {len(indices)} indices but {len(labels)} labels")
    check_labels(labels, len(indices), num_classes, caller)
    if len(np.unique(indices)) != len(indices):
        raise ValueError(f"indices repeat within one {caller} call")
    already = indices[label_at[indices] >= 0]
    if already.size:
        raise ValueError(f"samples already labelled by a person: {already[:10].tolist()}")
    return indices, labels
