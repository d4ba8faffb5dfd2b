# Datasets (Fashion-MNIST IDX files), atomic file I/O, shards, and a device's persisted pool/labels/replay set.
from __future__ import annotations

import dataclasses
import gzip
import io
import json
import math
import os
import tempfile
import zipfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

DEFAULT_DATA_DIR = Path("/usr/share/datasets/fashion-mnist")
CLASS_NAMES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
IMAGE_SHAPE = (28, 28)
FASHION_MNIST_MEAN = 0.2860
FASHION_MNIST_STD = 0.3530

_IDX_DTYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_FASHION_MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


class DatasetMissingError(FileNotFoundError):
    """A dataset file is absent; the message says which one and how to install it."""

    def __init__(self, path: Path) -> None:
        super().__init__(
            f"Fashion-MNIST file {path} is missing; install it with "
            "`apt-get install dataset-fashion-mnist` or pass --data-dir DIR"
        )
        self.path = path


def _read_exactly(handle: BinaryIO, size: int, path: Path) -> bytes:
    """Up to `size` bytes of an open (possibly gzip) file; a broken gzip stream is a ValueError naming it."""
    try:
        return handle.read(size)
    except (OSError, EOFError, zlib.error) as exc:
        raise ValueError(f"{path}: corrupt gzip stream ({exc})") from exc


def read_idx(path: Path | str, limit: int | None = None) -> np.ndarray:
    """Reads an IDX file (gzip or plain by suffix), checking the header against the data length.

    With `limit`, only the first `limit` items are decompressed and read (the dry run of a big pool file
    then holds only what it scores); the rest of the file is not checked.
    """
    path = Path(path)
    with gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb") as handle:
        magic = _read_exactly(handle, 4, path)
        if len(magic) < 4 or magic[0] != 0 or magic[1] != 0:
            raise ValueError(f"{path}: not an IDX file (bad magic number)")
        dtype_code, ndim = magic[2], magic[3]
        if dtype_code not in _IDX_DTYPES:
            raise ValueError(f"{path}: unknown IDX data type code 0x{dtype_code:02x}")
        if ndim == 0:
            raise ValueError(f"{path}: IDX header declares zero dimensions")
        dims = _read_exactly(handle, 4 * ndim, path)
        if len(dims) < 4 * ndim:
            raise ValueError(f"{path}: truncated IDX header ({4 + len(dims)} bytes, need {4 + 4 * ndim})")
        shape = tuple(int(d) for d in np.frombuffer(dims, dtype=">u4"))
        count = shape[0] if limit is None else min(limit, shape[0])
        dtype = _IDX_DTYPES[dtype_code]
        expected = count * math.prod(shape[1:]) * dtype.itemsize
        raw = _read_exactly(handle, expected, path)
        trailing = limit is None and len(_read_exactly(handle, 1, path)) > 0
    if len(raw) != expected or trailing:
        state = "truncated" if len(raw) < expected else "has trailing bytes"
        raise ValueError(
            f"{path}: IDX data {state}: header {shape} needs {expected} bytes, file has "
            f"{len(raw)}{'+' if trailing else ''}"
        )
    data = np.frombuffer(raw, dtype=dtype).reshape((count, *shape[1:]))
    return data.astype(dtype.newbyteorder("="))


@dataclass(frozen=True)
class FashionMNIST:
    """The Fashion-MNIST train and test splits as uint8 arrays: images (N, 28, 28), labels (N,)."""

    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray


def _find_dataset_file(data_dir: Path, stem: str) -> Path:
    """The gzip or plain copy of a dataset file in data_dir; DatasetMissingError if neither exists."""
    for candidate in (data_dir / f"{stem}.gz", data_dir / stem):
        if candidate.is_file():
            return candidate
    raise DatasetMissingError(data_dir / f"{stem}.gz")


def _check_images(images: np.ndarray, where: str) -> None:
    """Raises ValueError unless images are uint8 shaped (N, 28, 28)."""
    if images.dtype != np.uint8 or images.ndim != 3 or images.shape[1:] != IMAGE_SHAPE:
        raise ValueError(f"{where}: images are {images.dtype} {images.shape}, expected uint8 (N, 28, 28)")


def _check_labels(labels: np.ndarray, count: int, num_classes: int, where: str) -> None:
    """Raises ValueError unless labels are `count` integers in [0, num_classes)."""
    if not np.issubdtype(labels.dtype, np.integer) or labels.shape != (count,):
        raise ValueError(f"{where}: labels are {labels.dtype} {labels.shape}, expected {count} integers")
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"{where}: labels must lie in [0, {num_classes}), got {labels.min()}..{labels.max()}")


def _check_split(images: np.ndarray, labels: np.ndarray, where: str) -> None:
    """Raises ValueError unless a split has uint8 (N, 28, 28) images and N uint8 labels in 0..9."""
    _check_images(images, where)
    if labels.dtype != np.uint8:
        raise ValueError(f"{where}: labels are {labels.dtype}, expected uint8")
    _check_labels(labels, len(images), len(CLASS_NAMES), where)


def load_fashion_mnist(data_dir: Path | None = None) -> FashionMNIST:
    """Loads the four Fashion-MNIST IDX files from data_dir (default: the Debian package's folder)."""
    data_dir = Path(data_dir) if data_dir is not None else DEFAULT_DATA_DIR
    arrays = {key: read_idx(_find_dataset_file(data_dir, stem)) for key, stem in _FASHION_MNIST_FILES.items()}
    _check_split(arrays["train_images"], arrays["train_labels"], f"{data_dir}: train split")
    _check_split(arrays["test_images"], arrays["test_labels"], f"{data_dir}: test split")
    return FashionMNIST(**arrays)


def normalise(images: np.ndarray) -> np.ndarray:
    """uint8 images (N, H, W) -> float32 (N, 1, H, W) scaled to [0, 1] then standardised with Fashion-MNIST stats."""
    if images.dtype != np.uint8 or images.ndim != 3:
        raise ValueError(f"normalise expects uint8 images shaped (N, H, W), got {images.dtype} {images.shape}")
    scaled = images.astype(np.float32)[:, None, :, :] / np.float32(255.0)
    return (scaled - np.float32(FASHION_MNIST_MEAN)) / np.float32(FASHION_MNIST_STD)


def _fsync_directory(directory: Path) -> None:
    """Flushes a directory entry change (a rename) to disk."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    """Replaces path with data so that a crash leaves either the old file or the new one, never a mix.

    The parent folder is created if missing, so callers need not prepare it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp_name, path)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


def save_arrays(path: Path | str, arrays: Mapping[str, np.ndarray]) -> None:
    """Writes named arrays as an .npz archive (no pickled objects), atomically."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for name, array in arrays.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"{path}: array names must be non-empty strings, got {name!r}")
            array = np.asarray(array)
            if array.dtype.hasobject:
                raise ValueError(f"{path}: array {name!r} has object dtype, which cannot be saved without pickle")
            with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, array, allow_pickle=False)
    atomic_write_bytes(path, buffer.getvalue())


def load_arrays(path: Path | str) -> dict[str, np.ndarray]:
    """Reads an .npz archive written by save_arrays; a corrupt or non-npz file is a ValueError naming it."""
    path = Path(path)
    raw = path.read_bytes()
    try:
        loaded = np.load(io.BytesIO(raw), allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):
            raise ValueError("a single .npy array, not an .npz archive")
        with loaded:
            return {name: loaded[name] for name in loaded.files}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{path}: corrupt or unreadable array archive ({exc})") from exc


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
    """Reads a shard written by save_shard (a file without seeds is a shard without seeds)."""
    arrays = load_arrays(path)
    if not {"images", "labels"} <= set(arrays) <= set(SHARD_ARRAYS):
        raise ValueError(f"{path}: a shard holds {', '.join(SHARD_ARRAYS)}, found {sorted(arrays)}")
    shard = Shard(**{name: arrays[name] for name in arrays})
    _check_shard(shard, str(path))
    return dataclasses.replace(
        shard, labels=shard.labels.astype(np.int64), seed_labels=shard.seed_labels.astype(np.int64)
    )


def _check_shard(shard: Shard, where: str) -> None:
    """Pool and seed arrays are uint8 images with one valid label each."""
    _check_images(shard.images, where)
    _check_labels(shard.labels, len(shard.images), len(CLASS_NAMES), where)
    _check_images(shard.seed_images, f"{where} (seeds)")
    _check_labels(shard.seed_labels, len(shard.seed_images), len(CLASS_NAMES), f"{where} (seeds)")


def _as_index_array(values: Any, what: str) -> np.ndarray:
    """A 1-D int64 copy of values; ValueError if they are not integers."""
    array = np.asarray(values)
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{what} must be a 1-D array of integers, got {array.dtype} {array.shape}")
    return array.astype(np.int64)


LABEL_SOURCES = ("oracle", "seed", "weak")
HUMAN_SOURCES = ("oracle", "seed")


def source_code(source: str) -> int:
    """The stored code of a label source; ValueError for an unknown one."""
    if source not in LABEL_SOURCES:
        raise ValueError(f"unknown label source {source!r}; known: {', '.join(LABEL_SOURCES)}")
    return LABEL_SOURCES.index(source)


def _write_labelled(
    path: Path,
    indices: np.ndarray,
    labels: np.ndarray,
    sources: np.ndarray,
    replay: np.ndarray,
    num_classes: int,
    replay_per_class: int,
) -> None:
    """Writes a device's labelled indices, labels, their sources, replay indices and settings as one atomic file."""
    record = {
        "indices": indices,
        "labels": labels,
        "sources": sources,
        "replay": replay,
        "num_classes": np.int64(num_classes),
        "replay_per_class": np.int64(replay_per_class),
    }
    save_arrays(path, record)


class DeviceData:
    """A device's images, labelled set and replay set, persisted in a state directory so a SIGKILL loses nothing.

    Files: images.npy (written once), labels.npz (labelled indices, labels, replay indices and settings,
    rewritten atomically as one unit on every change) and state.json (the agent's small key/value state).
    """

    IMAGES_FILE = "images.npy"
    LABELS_FILE = "labels.npz"
    STATE_FILE = "state.json"

    def __init__(self, state_dir: Path, images: np.ndarray, labelled: dict[str, np.ndarray], state: dict) -> None:
        """Use create, open or open_or_create; this only wires loaded parts together."""
        self.state_dir = state_dir
        self._images = images
        self.num_classes = int(labelled["num_classes"])
        self.replay_per_class = int(labelled["replay_per_class"])
        self._indices = labelled["indices"]
        self._labels = labelled["labels"]
        self._sources = labelled["sources"]
        self._replay = labelled["replay"]
        self._label_at = np.full(len(images), -1, dtype=np.int64)
        human = self._human_mask()
        self._label_at[self._indices[human]] = self._labels[human]
        self._state = state

    @classmethod
    def create(
        cls, state_dir: Path | str, images: np.ndarray, replay_per_class: int = 5, num_classes: int = len(CLASS_NAMES)
    ) -> DeviceData:
        """Initialises a state directory with these images, nothing labelled and an empty state."""
        state_dir = Path(state_dir)
        _check_images(images, "DeviceData.create")
        buffer = io.BytesIO()
        np.save(buffer, np.ascontiguousarray(images), allow_pickle=False)
        cls.initialise_store(state_dir, replay_per_class, num_classes, {cls.IMAGES_FILE: buffer.getvalue()})
        return cls.open(state_dir)

    @classmethod
    def initialise_store(
        cls,
        state_dir: Path,
        replay_per_class: int,
        num_classes: int,
        pool_files: Mapping[str, bytes],
    ) -> None:
        """Writes the pool's files, an empty state and an empty labelled record (last: it marks a finished store)."""
        if replay_per_class < 0 or num_classes < 1:
            raise ValueError(f"need replay_per_class >= 0 and num_classes >= 1, got {replay_per_class}, {num_classes}")
        if (state_dir / cls.LABELS_FILE).exists():
            raise FileExistsError(f"{state_dir} already holds device data; open it instead of creating it")
        for name, content in pool_files.items():
            atomic_write_bytes(state_dir / name, content)
        atomic_write_bytes(state_dir / cls.STATE_FILE, b"{}")
        empty = np.zeros(0, dtype=np.int64)
        _write_labelled(
            state_dir / cls.LABELS_FILE, empty, empty, empty.astype(np.int8), empty, num_classes, replay_per_class
        )

    @classmethod
    def open(cls, state_dir: Path | str) -> DeviceData:
        """Resumes from a state directory written by create; a clear error if it was never initialised."""
        state_dir = Path(state_dir)
        if not (state_dir / cls.LABELS_FILE).is_file():
            raise FileNotFoundError(f"{state_dir} holds no device data (no {cls.LABELS_FILE}); create it first")
        images = cls._load_images(state_dir / cls.IMAGES_FILE)
        labelled = cls._load_labelled(state_dir / cls.LABELS_FILE, len(images))
        state = cls._load_state(state_dir / cls.STATE_FILE)
        return cls(state_dir, images, labelled, state)

    @classmethod
    def open_or_create(cls, state_dir: Path | str, images: np.ndarray) -> DeviceData:
        """Resumes existing state (checking it holds as many images as given) or creates it from images."""
        state_dir = Path(state_dir)
        if not (state_dir / cls.LABELS_FILE).is_file():
            return cls.create(state_dir, images)
        data = cls.open(state_dir)
        if data.num_samples != len(images):
            raise ValueError(
                f"{state_dir} holds {data.num_samples} images but {len(images)} were given; "
                "use a fresh state directory for a different data set"
            )
        return data

    @staticmethod
    def _load_images(path: Path) -> np.ndarray:
        """The persisted images, memory-mapped read-only; a missing or corrupt file is a clear error."""
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing; the device state directory is incomplete")
        try:
            images = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise ValueError(f"{path}: corrupt image file ({exc})") from exc
        _check_images(images, str(path))
        return images

    @staticmethod
    def _load_labelled(path: Path, num_samples: int) -> dict[str, np.ndarray]:
        """The persisted labelled/replay record, checked for consistency with the image count."""
        arrays = load_arrays(path)
        expected = {"indices", "labels", "sources", "replay", "num_classes", "replay_per_class"}
        if set(arrays) != expected:
            raise ValueError(f"{path}: expected arrays {sorted(expected)}, found {sorted(arrays)}")
        indices, labels, replay = arrays["indices"], arrays["labels"], arrays["replay"]
        _check_labels(labels, len(indices), int(arrays["num_classes"]), str(path))
        _check_labels(arrays["sources"], len(indices), len(LABEL_SOURCES), f"{path} (label sources)")
        in_range = indices.size == 0 or (indices.min() >= 0 and indices.max() < num_samples)
        if not in_range or len(np.unique(indices)) != len(indices) or not np.isin(replay, indices).all():
            raise ValueError(f"{path}: labelled or replay indices are inconsistent with {num_samples} images")
        return arrays

    @staticmethod
    def _load_state(path: Path) -> dict:
        """The agent's key/value state; empty if the file is absent, a ValueError if it is not a JSON object."""
        if not path.is_file():
            return {}
        try:
            state = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: corrupt state file ({exc})") from exc
        if not isinstance(state, dict):
            raise ValueError(f"{path}: state file must hold a JSON object")
        return state

    @property
    def num_samples(self) -> int:
        """How many images the device holds, labelled or not."""
        return len(self._images)

    def _human_mask(self) -> np.ndarray:
        """Which stored entries are human labels (oracle or seed), not weak machine labels."""
        return self._sources != source_code("weak")

    @property
    def num_labelled(self) -> int:
        """How many samples carry a human label (weak labels do not count)."""
        return int(np.count_nonzero(self._human_mask()))

    def pool_indices(self) -> np.ndarray:
        """Indices of the samples without a human label (unlabelled or only weakly labelled), ascending."""
        return np.flatnonzero(self._label_at < 0)

    def images(self, indices: np.ndarray) -> np.ndarray:
        """A uint8 copy of the images at these indices."""
        indices = _as_index_array(indices, "indices")
        self._check_in_range(indices)
        return np.asarray(self._images[indices])

    def labels_at(self, indices: np.ndarray) -> np.ndarray:
        """The label of each of these samples, -1 where a sample is still unlabelled."""
        indices = _as_index_array(indices, "indices")
        self._check_in_range(indices)
        return self._label_at[indices].copy()

    def labelled(self) -> tuple[np.ndarray, np.ndarray]:
        """(indices, labels) of the human-labelled set, in the order they were labelled."""
        human = self._human_mask()
        return self._indices[human], self._labels[human]

    def weak_labels(self) -> tuple[np.ndarray, np.ndarray]:
        """(indices, labels) of the weak machine labels (FAST's kNN votes), on samples no person has labelled."""
        weak = ~self._human_mask()
        return self._indices[weak], self._labels[weak]

    def replay(self) -> tuple[np.ndarray, np.ndarray]:
        """(indices, labels) of the replay set: the first replay_per_class labelled samples of each class."""
        return self._replay.copy(), self._label_at[self._replay]

    def class_counts(self) -> np.ndarray:
        """Number of human-labelled samples per class, shape (num_classes,)."""
        return np.bincount(self._labels[self._human_mask()], minlength=self.num_classes)

    def count_labels(self, source: str) -> int:
        """How many labels came from this source (the oracle's are the ones a person was asked for)."""
        return int(np.count_nonzero(self._sources == source_code(source)))

    def add_labels(self, indices: np.ndarray, labels: np.ndarray, source: str = "oracle") -> None:
        """Moves samples from the pool to the human-labelled set and updates the replay set, all or nothing.

        A human label replaces a weak label on the same sample; a sample a person already labelled is an error.
        """
        if source_code(source) == source_code("weak"):
            raise ValueError(
                f"add_labels takes human labels ({', '.join(HUMAN_SOURCES)}); weak labels go through set_weak_labels"
            )
        indices, labels = self._checked_new_labels(indices, labels, "add_labels")
        keep = ~np.isin(self._indices, indices)
        self._write(
            np.concatenate([self._indices[keep], indices]),
            np.concatenate([self._labels[keep], labels]),
            np.concatenate([self._sources[keep], np.full(len(indices), source_code(source), dtype=np.int8)]),
            np.concatenate([self._replay, self._replay_additions(indices, labels)]),
        )
        self._label_at[indices] = labels

    def set_weak_labels(self, indices: np.ndarray, labels: np.ndarray) -> None:
        """Replaces every weak label by these (atomically); weak labels never overwrite a human label."""
        indices, labels = self._checked_new_labels(indices, labels, "set_weak_labels")
        human = self._human_mask()
        self._write(
            np.concatenate([self._indices[human], indices]),
            np.concatenate([self._labels[human], labels]),
            np.concatenate([self._sources[human], np.full(len(indices), source_code("weak"), dtype=np.int8)]),
            self._replay,
        )

    def _checked_new_labels(
        self, indices: np.ndarray, labels: np.ndarray, caller: str
    ) -> tuple[np.ndarray, np.ndarray]:
        """(indices, labels) as int64 after checking ranges, uniqueness and that no person labelled them yet."""
        indices = _as_index_array(indices, "indices")
        labels = _as_index_array(labels, "labels")
        if len(labels) != len(indices):
            raise ValueError(f"got {len(indices)} indices but {len(labels)} labels")
        self._check_in_range(indices)
        _check_labels(labels, len(indices), self.num_classes, caller)
        if len(np.unique(indices)) != len(indices):
            raise ValueError(f"indices repeat within one {caller} call")
        already = indices[self._label_at[indices] >= 0]
        if already.size:
            raise ValueError(f"samples already labelled by a person: {already[:10].tolist()}")
        return indices, labels

    def _write(self, indices: np.ndarray, labels: np.ndarray, sources: np.ndarray, replay: np.ndarray) -> None:
        """Persists the whole labelled record atomically, then adopts it in memory."""
        _write_labelled(
            self.state_dir / self.LABELS_FILE, indices, labels, sources, replay, self.num_classes, self.replay_per_class
        )
        self._indices, self._labels, self._sources, self._replay = indices, labels, sources, replay

    def _replay_additions(self, indices: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """The newly labelled indices that join the replay set, first come first served per class."""
        _, replay_labels = self.replay()
        room = self.replay_per_class - np.bincount(replay_labels, minlength=self.num_classes)
        joined = []
        for index, label in zip(indices.tolist(), labels.tolist()):
            if room[label] > 0:
                room[label] -= 1
                joined.append(index)
        return np.asarray(joined, dtype=np.int64)

    def _check_in_range(self, indices: np.ndarray) -> None:
        """Raises ValueError naming the first index outside [0, num_samples)."""
        bad = indices[(indices < 0) | (indices >= self.num_samples)]
        if bad.size:
            raise ValueError(f"index {int(bad[0])} out of range for {self.num_samples} samples")

    def get_state(self, key: str, default: Any = None) -> Any:
        """A value from the agent's persisted key/value state, or default."""
        return self._state.get(key, default)

    def set_state(self, key: str, value: Any) -> None:
        """Stores a JSON-able value under key and persists the whole state atomically."""
        if not isinstance(key, str):
            raise ValueError(f"state keys must be strings, got {key!r}")
        updated = {**self._state, key: value}
        try:
            encoded = json.dumps(updated, allow_nan=False, sort_keys=True).encode()
        except (TypeError, ValueError) as exc:
            raise ValueError(f"state value for {key!r} is not JSON-serialisable: {exc}") from exc
        atomic_write_bytes(self.state_dir / self.STATE_FILE, encoded)
        self._state = json.loads(encoded)


def open_device_data(state_dir: Path | str, shard: Shard) -> DeviceData:
    """A device's persisted data for this shard: resumed if it exists, else created with its seeds labelled once."""
    data = DeviceData.open_or_create(state_dir, shard.all_images)
    if len(shard.seed_labels) and data.count_labels("seed") == 0:
        data.add_labels(shard.seed_indices, shard.seed_labels, source="seed")
    return data
